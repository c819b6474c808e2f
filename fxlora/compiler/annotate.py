"""annotate: record on every call node the FQN of the module whose forward produced it.

Reads ``nn_module_stack`` (set by Dynamo and torch.export). When the model is known (a
:class:`ModuleTree`), the innermost entry is resolved against the model's own module tree:
first by identity (Dynamo keys inlined modules by ``id(module)``), then by its path with any
root spelling removed (``L['self']``, ``L['args'][0]`` under a decorated ``forward``,
``L['fn']``, ...), then by the unique module whose FQN ends with that path (a frame resumed
inside a layer). Without the model, the path with its root removed is the FQN. A node
without that metadata but whose weight is a ``get_attr`` of ``<module>.weight`` (as
``torch.fx.symbolic_trace`` makes) is attributed to ``<module>``. ``ctx.renamed`` then
moves the calls of a module to another instance of the same code (a graph Dynamo reuses for
it). Writes ``node.meta["fxlora_module"]``, ``node.meta["fxlora_module_type"]`` and, from
Dynamo's key, ``node.meta["fxlora_module_call"]``, which tells a module's calls apart
(:func:`fxlora.compiler.graph_edit.module_calls`); changes nothing else in the graph. When
the pool has not seen the whole model (``torch.compile`` hands over one graph at a time), it
tells the pool which linear and embedding modules this graph holds.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxlora.adapters import ModuleInfo
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import call_arg

LINEAR = {torch._C._nn.linear, F.linear, torch.ops.aten.linear.default}
EMBEDDING = {F.embedding, torch.ops.aten.embedding.default}


def embedding_args(node: fx.Node) -> tuple:
    """``(ids, weight)`` of an embedding call: ``F.embedding(input, weight)`` or
    ``aten.embedding(weight, indices)``."""
    if node.target is F.embedding:
        return call_arg(node, 0, "input"), call_arg(node, 1, "weight")
    return call_arg(node, 1, "indices"), call_arg(node, 0, "weight")

# A Dynamo source's root: a local or global of the traced frame and any subscripts after it
# (``L['self']``, ``L['args'][0]``, ``L['kwargs']['model']``, ``G['model']``).
_ROOT = re.compile(r"^[LG]\[(['\"])[^'\"]*\1\](?:\[[^\]]*\])*\.?")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def module_fqn(path: str) -> str:
    """``L['self'].model.layers[0]._modules['mlp']`` -> ``model.layers.0.mlp``."""
    path = _ROOT.sub("", path)
    path = _INDEX.sub(r".\1", path).replace("._modules.", ".").lstrip(".")
    return path.removeprefix("_modules.")


class AttributionError(RuntimeError):
    """No call of a traced graph could be attributed to a module of the model."""


class ModuleTree:
    """Every submodule of a model: its FQN by identity, and its type by FQN; and which
    modules hold each parameter."""

    def __init__(self, model: torch.nn.Module):
        named = list(model.named_modules(remove_duplicate=False))
        self._fqn = {id(m): name for name, m in reversed(named)}  # a shared module: its first name
        self._type = {name: type(m) for name, m in named}
        self._model = model
        self._owners = self._parameters()

    def _parameters(self) -> dict[int, tuple[torch.Tensor, list[tuple[str, str]]]]:
        """id(parameter) -> (the parameter, its (module FQN, attribute) holders); the
        parameter is kept so that an id reused by a later object never matches."""
        owners: dict[int, tuple[torch.Tensor, list[tuple[str, str]]]] = {}
        for name, m in self._model.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), (p, []))[1].append((name, attr))
        return owners

    def owners(self, tensor: object, reread: bool = False) -> list[tuple[str, str]]:
        """The ``(module FQN, attribute)`` pairs that hold ``tensor`` as a parameter; with
        ``reread``, read again from the model when ``tensor`` is new (a parameter replaced
        since)."""
        entry = self._owners.get(id(tensor))
        if reread and (entry is None or entry[0] is not tensor):
            self._owners = self._parameters()
            entry = self._owners.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else []

    def type_of(self, fqn: str) -> type | None:
        return self._type.get(fqn)

    def resolve(self, key: str, path: str, module_type: type | None) -> str | None:
        """The FQN of the ``nn_module_stack`` entry ``key: (path, module_type)``, or None."""
        ident = key.partition("@")[0]  # Dynamo adds "@<n>" to the key of a repeated call
        fqn = self._fqn.get(int(ident)) if ident.isdigit() else None
        if fqn is not None and self._matches(fqn, module_type):
            return fqn
        fqn = module_fqn(path)
        if fqn in self._type:
            return fqn if self._matches(fqn, module_type) else None
        parts = fqn.split(".")
        for i in range(1, len(parts)):  # the path has a prefix the tree lacks (``__self__.``)
            if self._matches(suffix := ".".join(parts[i:]), module_type):
                return suffix
        ending = [name for name in self._type if name.endswith("." + fqn) and self._matches(name, module_type)]
        return ending[0] if len(ending) == 1 else None

    def _matches(self, fqn: str, module_type: type | None) -> bool:
        found = self._type.get(fqn)
        return found is not None and (module_type is None or found is module_type)


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


def renamed(fqn: str, renames: dict[str, str]) -> str:
    """``fqn`` with its longest prefix found in ``renames`` replaced."""
    parts = fqn.split(".")
    for i in range(len(parts), 0, -1):
        new = renames.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return fqn


def called_targets(gm: fx.GraphModule, ctx: PassContext) -> frozenset[str]:
    """The pool targets whose module ``gm`` calls (the module, or a submodule of it, owns a
    call node)."""
    called = _called_modules(gm)
    return frozenset(fqn for fqn, t in ctx.pool.targets.items() if t.module in called)


def _called_modules(gm: fx.GraphModule) -> set[str]:
    """The modules that own a call node of ``gm``, and their ancestors."""
    called: set[str] = set()
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxlora_module")
        while fqn and fqn not in called:
            called.add(fqn)
            fqn = fqn.rpartition(".")[0]
    return called


def instance_parameters(gm: fx.GraphModule, ctx: PassContext) -> tuple[tuple[int, str, str], ...]:
    """``(input index, module FQN, attribute)`` of one parameter per linear, embedding or
    experts module ``gm`` calls, among its inputs: a call that passes other tensors there
    runs the graph for another instance of the same code. Needs the model's tree."""
    if ctx.modules is None or not ctx.inputs:
        return ()
    candidates = {fqn.rpartition(".")[0] if info.kind == "experts" else fqn for fqn, info in ctx.pool.modules.items()}
    called = _called_modules(gm) & candidates
    found: dict[str, tuple[int, str, str]] = {}
    for i, value in enumerate(ctx.inputs):
        for fqn, attr in ctx.modules.owners(value) if isinstance(value, torch.Tensor) else ():
            if fqn in called and fqn not in found:
                found[fqn] = (i, fqn, attr)
    return tuple(found.values())


def modules_in_graph(gm: fx.GraphModule) -> dict[str, ModuleInfo]:
    """Linear and embedding modules called in ``gm``, read off their weights' metadata."""
    found = {}
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxlora_module")
        if fqn is None or node.op != "call_function":
            continue
        if node.target in LINEAR:
            kind, weight = "linear", call_arg(node, 1, "weight")
        elif is_conv1d_addmm(node):
            kind, weight = "conv1d", call_arg(node, 2, "mat2")
        elif node.target in EMBEDDING:
            kind, weight = "embedding", embedding_args(node)[1]
        else:
            continue
        val = weight.meta.get("val", weight.meta.get("example_value")) if isinstance(weight, fx.Node) else None
        if val is None or val.dim() != 2:
            continue
        rows, cols = val.shape
        in_f, out_f = (cols, rows) if kind == "linear" else (rows, cols)
        found[fqn] = ModuleInfo("embedding" if kind == "embedding" else "linear", int(in_f), int(out_f), val.dtype, val.device)
    return found


def is_conv1d_addmm(node: fx.Node) -> bool:
    """``torch.addmm(bias, x, weight)`` inside transformers' ``Conv1D`` (GPT-2's linear)."""
    from transformers.pytorch_utils import Conv1D

    module_type = node.meta.get("fxlora_module_type")
    return node.target is torch.addmm and isinstance(module_type, type) and issubclass(module_type, Conv1D)
