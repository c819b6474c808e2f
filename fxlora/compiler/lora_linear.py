"""lora_linear: targeted ``F.linear`` calls become ``fxlora::lora_linear``.

Matches ``torch._C._nn.linear`` / ``F.linear`` / ``aten.linear`` nodes that ``annotate``
attributed to a module the adapter pool targets, and replaces each with
``fxlora::lora_linear(x, weight, bias, lora, batch, workspace)``: ``lora`` the list of the
target's pool buffers (``pool_nodes``), ``batch`` the list of its tokens' ``batch_info``
outputs, the workspace a ``lora_workspace`` node of its own (so ``hoist`` can plan it). The
``torch.addmm(bias, x, weight)`` of transformers' ``Conv1D`` (GPT-2), whose weight is stored
transposed, becomes the same op on ``weight.t()``. A module whose forward calls linear
several times over its weight has each call replaced, each its own op over the same pool
buffers. A module whose calls read different weights, whose weight shape differs from the
pool's, or whose input's rows cannot be told (:func:`fxlora.compiler.batch_info.row_dim`), is
left alone and reported. Calls that read a tensor subclass (torchao's quantised weights) are
left to ``lora_delta``, which adds the delta onto whatever they compute. Linears of modules no
adapter targets are untouched.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxlora.adapters import PoolGroup, PoolTarget
from fxlora.compiler.annotate import LINEAR, is_conv1d_addmm
from fxlora.compiler.batch_info import batch_info_for, row_dim
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import (
    base_calls,
    call_arg,
    fake_value,
    meta_shape,
    pool_nodes,
    reads_wrapped_tensor,
    replace_with,
)
from fxlora.errors import NotServed
from fxlora.ops.delta_launcher import lora_workspace


def lora_linear(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    is_base = lambda n: (n.target in LINEAR or is_conv1d_addmm(n)) and not reads_wrapped_tensor(n)  # noqa: E731
    for target, node in base_calls(gm, ctx, "linear", is_base, linear_weight):
        fqn = target.fqn
        conv1d = node.target is torch.addmm
        if conv1d:
            bias, x, weight = call_arg(node, 0, "input"), call_arg(node, 1, "mat1"), call_arg(node, 2, "mat2")
        else:
            x, weight, bias = call_arg(node, 0, "input"), call_arg(node, 1, "weight"), call_arg(node, 2, "bias")
        shape, want = meta_shape(weight), (target.info.out_features, target.info.in_features)
        if shape is not None and shape != (want[::-1] if conv1d else want):
            ctx.leave_traced(fqn, f"linear weight {shape} does not fit the module's {want}")
            continue
        try:
            rows = row_dim(gm, ctx, x, feature_dims=1)
        except NotServed as why:
            ctx.leave_traced(fqn, str(why))
            continue
        with gm.graph.inserting_before(node):
            if conv1d:
                weight = gm.graph.call_function(torch.t, (weight,))
            args = (x, weight, bias, *lora_operands(gm, ctx, x, target, rows))
        replace_with(gm, node, torch.ops.fxlora.lora_linear.default, args)
        ctx.rewritten[fqn] = "fxlora::lora_linear"
    gm.recompile()
    return gm


def linear_weight(node: fx.Node) -> fx.Node:
    """The weight a linear call reads: ``F.linear``'s ``weight``, or the ``Conv1D`` addmm's ``mat2``."""
    return call_arg(node, 2, "mat2") if node.target is torch.addmm else call_arg(node, 1, "weight")


def lora_operands(
    gm: fx.GraphModule,
    ctx: PassContext,
    x: fx.Node,
    factors: PoolTarget | PoolGroup,
    rows: int,
    workspace: bool = True,
) -> tuple[list[fx.Node], list[fx.Node], fx.Node | None]:
    """What a linear LoRA op takes after its base operands, inserted at the current point:
    the factors' bundle, the batch info bundle of ``x``'s tokens (rows along its dimension
    ``rows``) and (``workspace``) the shrink's workspace."""
    lora = pool_nodes(gm, factors)
    scratch = None
    if workspace:
        scratch = gm.graph.call_function(lora_workspace, (x, lora[0]))
        fake_value(scratch, lambda xv: lora_workspace(xv, factors.lora_a), x)
    return lora, batch_info_for(gm, ctx, x, 1, rows), scratch
