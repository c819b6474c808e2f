"""``fxlora::lora_shrink``: the first half of ``fxlora::lora_delta``, issued before the base
computation it adds onto.

``workspace[t, i * R : i * R + rank] = x[t] @ lora_a[s, i * R : i * R + rank].T`` (float32) for
every token ``t`` with slot ``s >= 0`` and every slice ``i`` of the multi-slice layout
(``R = lora_a.shape[1] // slices``, ``rank`` the slot's rank for that slice); other entries
are unspecified (the reference leaves them, the CUDA kernel may zero them). A later
``fxlora::lora_delta(..., workspace, shrunk=True)`` over the same ``x``, factors and batch
expands it onto the base's outputs.

The pair exists for bases the graph keeps as traced (a quantised matmul): ``lora_delta`` can
only follow them, and its shrink, which reads ``x`` alone, would wait for them. Placed before
the base, the shrink runs beside it: while a CUDA graph is captured on a side stream that
``lora_delta`` joins before its expand, so the graph holds it as a parallel branch; called
eagerly, on the current stream (the fork would cost the host more than it saves).

Forked, the shrink reads ``x`` after the op has returned, so ``x``'s memory must not serve
anything else before ``lora_delta`` joins: the op marks it used by the side stream for the
caching allocator (``record_stream``), and a graph holding the op must not reuse the buffer in
its own code (fxlora compiles such graphs with Inductor's buffer reuse off).
"""

from __future__ import annotations

import torch

from fxlora.kernels import sgmv
from fxlora.ops.batch_info import slot_groups
from fxlora.ops.delta_launcher import capturing, fork, kernel_rows, on_side_stream, shrink_into
from fxlora.ops.operands import BatchInfo, LoraWeights


@torch.library.custom_op("fxlora::lora_shrink", mutates_args=("workspace",))
def lora_shrink(
    x: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor], workspace: torch.Tensor, slices: int
) -> None:
    """Write the shrink of ``x`` (``(..., in)``) into ``workspace`` (from
    :func:`fxlora.ops.delta_launcher.lora_workspace`); ``lora`` (:class:`LoraWeights`) holds
    ``slices`` slices. The reference: each slot's tokens and slices, as PEFT multiplies."""
    lora_a, _, _, rank = LoraWeights(*lora)
    x2 = x.reshape(-1, x.shape[-1])
    token_slot = BatchInfo(*batch).token_slot
    width = lora_a.shape[1] // slices
    for i in range(slices):
        for s, r, idx in slot_groups(token_slot, rank[i::slices]):
            a = lora_a[s, i * width : i * width + r]
            workspace[idx, i * width : i * width + r] = (x2.index_select(0, idx).to(a.dtype) @ a.T).float()


def lora_shrink_triton(
    x: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor], workspace: torch.Tensor, slices: int
) -> None:
    """The CUDA implementation: the SGMV shrink, on the side stream while a CUDA graph is
    captured."""
    weights, info = LoraWeights(*lora), BatchInfo(*batch)
    x2 = kernel_rows(x, weights)
    if not capturing(x):
        shrink_into(workspace, x2, weights, info, slices, 1)
        return
    with on_side_stream(x.device, fork(x.device)):
        shrink_into(workspace, x2, weights, info, slices, 1)
        side = torch.cuda.current_stream()
        x.record_stream(side)  # read after this op returns: freed meanwhile, not reused before the read
        if x2.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():  # a copy made here
            x2.record_stream(side)


if sgmv is not None:
    lora_shrink.register_kernel("cuda")(lora_shrink_triton)


@lora_shrink.register_fake
def _(x, lora, batch, workspace, slices):
    return None
