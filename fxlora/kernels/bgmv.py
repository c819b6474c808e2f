"""The LoRA expand as a batched gather matrix-vector product, for a handful of tokens, in Triton.

With very few tokens the expand after the base GEMM is bound by the latency of its chain of
dependent loads, not by bytes. This kernel gives every program one token and lets it read its
adapter straight from ``token_slot`` (as Punica's BGMV does), where the segmented expand of
:mod:`fxlora.kernels.sgmv` first walks the segment table:
``y[t, cols] += scaling[s] * B[s, cols] @ v[t]`` in place, ``v`` from the SGMV shrink; with
``store``, ``y[t, cols] = scaling[s] * B[s, cols] @ v[t]``, zeros where there is no delta.

Multi-slice layout (``B`` stacking each slice's output rows, ``scaling`` / ``rank`` one value
per (slot, slice)) as in :mod:`fxlora.kernels.sgmv`. Tokens without an adapter are not touched
(with ``store``: zeros).

On Hopper and later the expand is launched as a programmatic dependent of the kernel before
it (the base GEMM): it loads its token's slot and ``B`` while that kernel finishes, then waits
for it (``gdc_wait``) before reading ``v`` and ``y``. Launches depend only on shapes, so they
can be captured in a CUDA graph and replayed with other assignments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from fxlora.kernels import launch_table
from fxlora.kernels.launch_table import TokenExpandConfig as ExpandConfig
from fxlora.kernels.sgmv import (
    b_columns,
    column_align,
    output_slices,
    pdl_options,
    rows_contiguous,
    slice_columns,
    slice_output,
    slice_starts,
)


@triton.jit
def _expand_kernel(
    y_ptr, v_ptr, b_ptr, scaling_ptr, rank_ptr, slice_start_ptr, slot_ptr,
    y_off1, y_off2, y_off3, stride_y0, stride_y1, stride_y2, stride_y3,
    stride_vt, stride_bs, stride_bn,
    MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ALIGN: tl.constexpr, PDL: tl.constexpr, STORE: tl.constexpr,
):
    t, sl = tl.program_id(0), tl.program_id(2)
    slot = tl.load(slot_ptr + t)
    rank = tl.load(rank_ptr + tl.maximum(slot, 0) * NUM_SLICES + sl)
    col0, width = slice_columns(slice_start_ptr, sl, ALIGN)
    y_sl, stride_yt = slice_output(y_ptr, sl, (y_off1, y_off2, y_off3), (stride_y0, stride_y1, stride_y2, stride_y3))
    if tl.program_id(1) * BLOCK_N >= width:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < width
    out = y_sl + t.to(tl.int64) * stride_yt + n
    if slot < 0 or rank == 0:
        if STORE:
            if PDL:
                gdc_wait()
            tl.store(out, tl.zeros((BLOCK_N,), y_ptr.dtype.element_ty), mask=n_ok)
        return
    cols = col0 + n
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    # the slot, B and the scaling are ready before the kernel ahead of this one finishes
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + cols[:, None].to(tl.int64) * stride_bn + r[None, :],
        mask=n_ok[:, None] & (r < b_columns(rank, MAX_RANK))[None, :],
        other=0.0,
    )
    scale = tl.load(scaling_ptr + slot * NUM_SLICES + sl)
    if PDL:
        gdc_wait()
    vs = tl.load(v_ptr + t.to(tl.int64) * stride_vt + sl * MAX_RANK + r, mask=r_ok, other=0.0)
    delta = tl.sum(b.to(tl.float32) * vs[None, :], 1) * scale
    if STORE:
        tl.store(out, delta.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        y = tl.load(out, mask=n_ok, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=n_ok)


def serves(tokens: int, max_rank: int, device: torch.device | None = None) -> bool:
    """Whether ``lora_linear`` expands with this kernel rather than the segmented one: a
    class of the launch table's ``token_expand_serves``."""
    return launch_table.token_expand_serves(tokens, max_rank, device)


def expand_config(tokens: int, device: torch.device | None = None) -> ExpandConfig:
    return launch_table.token_expand_config(tokens, device)


def lora_expand(
    y: torch.Tensor | Sequence[torch.Tensor],  # (T, N), or (T, N_i) per slice — updated in place
    v: torch.Tensor,  # (T, num_slices * max_rank) float32, from sgmv.lora_shrink
    lora_b: torch.Tensor,  # (slots, N, max_rank)
    scaling: torch.Tensor,  # (slots * num_slices,) float32
    rank: torch.Tensor,  # (slots * num_slices,) int32
    token_slot: torch.Tensor,
    slice_widths: tuple[int, ...] | None = None,
    config: ExpandConfig | None = None,
    store: bool = False,
) -> None:
    """On Hopper and later the kernel starts before the one ahead of it has finished: ``y`` and
    ``v`` are read (and written) after waiting for it, ``token_slot``, ``lora_b``, ``scaling``
    and ``rank`` before, so they must not come from that kernel (in ``lora_linear`` they come
    from the batch-info prologue and the pool, ahead of the base GEMM). ``store``: write each
    token's delta (zeros for a token without an adapter, or in a rank-0 slot's slices) instead
    of adding it to ``y``, which may hold anything before."""
    y, y_offsets, y_strides, widths = output_slices(y, slice_widths)
    tokens = y.shape[0]
    _, _, max_rank = lora_b.shape
    cfg = config or expand_config(tokens, y.device)
    lora_b = rows_contiguous(lora_b)
    grid = (tokens, launch_table.cdiv(max(widths), cfg.block_n), len(widths))
    _expand_kernel[grid](
        y, v, lora_b, scaling, rank, slice_starts(tuple(widths), y.device), token_slot,
        *y_offsets, *y_strides, v.stride(0), lora_b.stride(0), lora_b.stride(1),
        MAX_RANK=max_rank, NUM_SLICES=len(widths), BLOCK_N=cfg.block_n, BLOCK_R=launch_table.next_power_of_2(max_rank),
        ALIGN=column_align(tuple(widths)), STORE=store,
        num_warps=cfg.num_warps, **pdl_options(y.device),
    )
