"""annotate: record on every call node the module whose forward produced it.

Matches every call node. Emits no node: it writes ``node.meta["fxlora_module"]`` (the
module's FQN), ``node.meta["fxlora_module_type"]`` and, from Dynamo's key,
``node.meta["fxlora_module_call"]``, which tells a module's calls apart
(:func:`fxlora.compiler.graph_edit.module_calls`). Leaves the graph's nodes and edges as they
are, and a node it cannot attribute without metadata; raises :class:`AttributionError` when
no call of a graph the pool has targets for resolves.

The module comes from the innermost ``nn_module_stack`` entry (set by Dynamo and
torch.export), resolved against the model's own tree when it is known
(:class:`fxlora.compiler.module_tree.ModuleTree`: by identity, then by its path with any root
spelling removed, then by the unique FQN ending with that path); without the model the path
with its root removed is the FQN. A node without that metadata whose weight is a ``get_attr``
of ``<module>.weight`` (as ``torch.fx.symbolic_trace`` makes) is attributed to ``<module>``.
``ctx.renamed`` moves a module's calls to another instance of the same code (a graph Dynamo
reuses for it). When the pool has not seen the whole model (``torch.compile`` hands over one
graph at a time), the pass tells it which linear and embedding modules this graph holds.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxlora.compiler.calls import modules_in_graph
from fxlora.compiler.context import PassContext
from fxlora.compiler.module_tree import AttributionError, module_fqn, renamed


def annotate(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    unresolved: list[str] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack")
        if stack:
            key, (path, module_type) = list(stack.items())[-1]
            fqn = module_fqn(path) if ctx.modules is None else ctx.modules.resolve(str(key), path, module_type)
            if fqn is None:
                unresolved.append(path)
                continue
            node.meta["fxlora_module"] = renamed(fqn, ctx.renamed) if ctx.renamed else fqn
            node.meta["fxlora_module_type"] = module_type
            node.meta["fxlora_module_call"] = str(key)  # Dynamo's key: "<id>@<n>" for the module's n-th call
            continue
        weight = node.args[1] if len(node.args) > 1 else None
        if isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target.endswith(".weight"):
            node.meta["fxlora_module"] = weight.target.removesuffix(".weight")
    if unresolved and not any("fxlora_module" in n.meta for n in gm.graph.nodes) and ctx.pool.targets:
        import transformers

        raise AttributionError(
            f"no call in the traced graph could be attributed to a module of the model (transformers "
            f"{transformers.__version__}, torch {torch.__version__}): Dynamo names the modules e.g. "
            f"{unresolved[0]!r}, which is not a path of the model's module tree"
        )
    if not ctx.pool.complete:
        ctx.pool.register_modules(modules_in_graph(gm))
    return gm
