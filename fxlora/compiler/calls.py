"""What a traced call is: the base calls the LoRA passes look for (linear, transformers'
``Conv1D`` addmm, embedding), and which modules' calls a graph holds, read from the module
``annotate`` wrote on each node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxlora.adapters import ModuleInfo
from fxlora.compiler.graph_edit import call_arg

if TYPE_CHECKING:
    from fxlora.compiler.context import PassContext

LINEAR = {torch._C._nn.linear, F.linear, torch.ops.aten.linear.default}
EMBEDDING = {F.embedding, torch.ops.aten.embedding.default}


def embedding_args(node: fx.Node) -> tuple:
    """``(ids, weight)`` of an embedding call: ``F.embedding(input, weight)`` or
    ``aten.embedding(weight, indices)``."""
    if node.target is F.embedding:
        return call_arg(node, 0, "input"), call_arg(node, 1, "weight")
    return call_arg(node, 1, "indices"), call_arg(node, 0, "weight")


def is_conv1d_addmm(node: fx.Node) -> bool:
    """``torch.addmm(bias, x, weight)`` inside transformers' ``Conv1D`` (GPT-2's linear)."""
    from transformers.pytorch_utils import Conv1D

    module_type = node.meta.get("fxlora_module_type")
    return node.target is torch.addmm and isinstance(module_type, type) and issubclass(module_type, Conv1D)


def linear_weight(node: fx.Node) -> fx.Node:
    """The weight a linear call reads: ``F.linear``'s ``weight``, or the ``Conv1D`` addmm's ``mat2``."""
    return call_arg(node, 2, "mat2") if node.target is torch.addmm else call_arg(node, 1, "weight")


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
