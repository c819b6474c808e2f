"""lora_linear: targeted ``F.linear`` calls become ``fxlora::lora_linear``.

Matches the ``torch._C._nn.linear`` / ``F.linear`` / ``aten.linear`` calls, and the
``torch.addmm(bias, x, weight)`` of transformers' ``Conv1D`` (GPT-2), that ``annotate``
attributed to a linear the pool targets and ``fuse`` left (one per call of the module, all
over the module's own weight: :func:`fxlora.compiler.graph_edit.base_calls`).

Emits ``fxlora::lora_linear(x, weight, bias, lora, batch, workspace)`` in each one's place:
``lora`` the target's pool buffers (``pool_nodes``), ``batch`` its tokens' ``batch_info``
outputs, the workspace a ``lora_workspace`` node of its own (so ``hoist`` can plan it); a
``Conv1D`` weight, stored transposed, goes in as ``weight.t()``. A module whose forward calls
linear several times over its weight has each call replaced, each its own op over the same
pool buffers.

Leaves alone, and records as skipped, a module whose calls read different weights, one call
of which makes several linear calls, whose weight shape differs from the pool's, or whose
input's rows cannot be told (:func:`fxlora.compiler.rows.row_dim`). Calls that read a tensor
subclass (torchao's quantised weights) are ``lora_delta``'s, which adds the delta onto
whatever they compute; linears of modules no adapter targets are untouched.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxlora.compiler.calls import LINEAR, is_conv1d_addmm, linear_weight
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import base_calls, call_arg, meta_shape, reads_wrapped_tensor, replace_with
from fxlora.compiler.operands import lora_operands
from fxlora.compiler.rows import row_dim
from fxlora.errors import NotServed


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
