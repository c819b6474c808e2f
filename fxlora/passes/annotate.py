"""annotate: record on every call node the FQN of the module whose forward produced it.

Reads ``nn_module_stack`` (set by Dynamo and torch.export): the innermost entry names the
module, e.g. ``L['self'].model.layers[0].mlp`` becomes ``model.layers.0.mlp``. A node
without that metadata but whose weight is a ``get_attr`` of ``<module>.weight`` (as
``torch.fx.symbolic_trace`` makes) is attributed to ``<module>``. Writes
``node.meta["fxlora_module"]`` and ``node.meta["fxlora_module_type"]``; changes nothing else
in the graph. When the pool has not seen the whole model (``torch.compile`` hands over one
graph at a time), it tells the pool which linear and embedding modules this graph holds.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxlora.adapters import ModuleInfo
from fxlora.passes.context import PassContext
from fxlora.passes.graph_edit import call_arg

LINEAR = {torch._C._nn.linear, F.linear, torch.ops.aten.linear.default}
EMBEDDING = {F.embedding, torch.ops.aten.embedding.default}


def embedding_args(node: fx.Node) -> tuple:
    """``(ids, weight)`` of an embedding call: ``F.embedding(input, weight)`` or
    ``aten.embedding(weight, indices)``."""
    if node.target is F.embedding:
        return call_arg(node, 0, "input"), call_arg(node, 1, "weight")
    return call_arg(node, 1, "indices"), call_arg(node, 0, "weight")

_ROOT = re.compile(r"^L\[['\"](?:self|fn|mod|model)['\"]\]\.?")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def module_fqn(path: str) -> str:
    """``L['self'].model.layers[0]._modules['mlp']`` -> ``model.layers.0.mlp``."""
    path = _ROOT.sub("", path)
    path = _INDEX.sub(r".\1", path).replace("._modules.", ".").lstrip(".")
    return path.removeprefix("_modules.")


def annotate(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack")
        if stack:
            path, module_type = list(stack.values())[-1]
            node.meta["fxlora_module"] = module_fqn(path)
            node.meta["fxlora_module_type"] = module_type
            continue
        weight = node.args[1] if len(node.args) > 1 else None
        if isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target.endswith(".weight"):
            node.meta["fxlora_module"] = weight.target.removesuffix(".weight")
    if not ctx.pool.complete:
        ctx.pool.register_modules(modules_in_graph(gm))
    return gm


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
