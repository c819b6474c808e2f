"""``fxlora::grouped_mm``: ATen's grouped GEMM behind an op of fxlora's own, for the dtypes
Inductor cannot trace it in.

``grouped_mm(x, w, offsets)`` multiplies each segment of ``x``'s rows by its group's matrix:
rows ``offsets[g - 1] .. offsets[g]`` (from 0 for the first group) by ``w[g]``, ``w`` stored
``(groups, in, out)``. ATen's ``_grouped_mm`` computes float32 and float16 in eager, on CUDA
and on the CPU, but its meta function, which Inductor traces with, admits only bfloat16. This
op runs the same ATen kernel and has a fake of its own, so a graph compiled by Inductor
reaches that kernel in every dtype. Graphs in bfloat16 keep ATen's op, which Inductor lowers
itself (:func:`traceable_grouped_mm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_aten_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One matmul per group: the oracle of the op."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=x.dtype, device=x.device)  # rows past the last offset: zeros
    if parts:
        out[: ends[-1]] = torch.cat(parts)
    return out


@torch.library.custom_op("fxlora::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, in), ``w`` (groups, in, out), ``offsets`` (groups,) int32, the groups'
    cumulative row ends. Returns (rows, out). ATen's kernel reads 16-byte rows: odd widths are
    zero-padded first (a copy; real models never need it)."""
    fin, fout = w.shape[1:]
    align = 16 // x.element_size()
    pad_in, pad_out = -fin % align, -fout % align
    if pad_in or pad_out:
        x, w = F.pad(x, (0, pad_in)), F.pad(w, (0, pad_out, 0, pad_in))
        return _aten_grouped_mm(x, w, offs=offsets)[:, :fout].contiguous()
    return _aten_grouped_mm(x, w, offs=offsets)


@grouped_mm.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[-1])


def traceable_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """ATen's grouped GEMM in bfloat16 over 16-byte rows, which Inductor traces and lowers,
    else this op. A tensor subclass ``w`` (a quantised weight) serves ATen's op through its own
    dispatch, or raises ``NotImplementedError``; this op it does not serve."""
    if x.dtype == torch.bfloat16 and not (w.shape[1] % 8 or w.shape[2] % 8):
        return _aten_grouped_mm(x, w, offs=offsets)
    return torch.ops.fxlora.grouped_mm(x, w, offsets)
