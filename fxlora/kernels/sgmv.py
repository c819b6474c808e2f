"""Segmented gather matrix-vector products for multi-adapter LoRA, in Triton.

Tokens arrive grouped by slot, in segments (``sorted_tokens``, ``seg_start``, ``seg_len``,
``seg_slot`` from ``fxlora::batch_info``: segment ``i`` reads adapter ``seg_slot[i]``). Two
kernels compute the LoRA delta of every token with its own slot's factors, as Punica's SGMV
does:

- shrink: ``v[t, :] = x[t] @ A[s].T`` for the tokens ``t`` of slot ``s``, float32; the
  reduction over ``x``'s features is split across programs that add into a zeroed ``v``;
- expand: ``y[t, cols] += scaling[s] * v[t] @ B[s, cols].T``, in place, each program
  looping over a few column tiles with pipelined loads; beyond decode sizes programs take the
  row blocks from the last one back, so the rows of ``y`` that the GEMM wrote last, which are
  still in L2, are read first. With ``store`` it writes the delta instead, ``y`` holding
  anything before, and zeros in the rows of tokens without an adapter and in a rank-0 slot's
  slices: ``y`` is then the delta alone, written once and never read.

Several output slices of unequal width may share one input (fused ``qkv_proj``,
``gate_up_proj``, MLA's ``q_a_proj`` + ``kv_a_proj_with_mqa``): ``A`` then stacks each
slice's ``max_rank`` rows, ``B`` each slice's output rows, and ``scaling`` / ``rank`` hold
one value per (slot, slice). The expands update either one output's column slices or one
output per slice (:func:`output_slices`).

The kernels read at most one entry per token however large the pool (the MoE path reads its
pool as ``slots · experts`` adapters): the first ``min(T, entries)`` of the list, where
``fxlora::batch_info`` puts every non-empty segment.

The expands move ``y`` and ``B`` in 16-byte pieces: the slices' widths tell the kernel how
far their columns are aligned (:func:`column_align`), and a slot reads ``B``'s rank columns up
to the next multiple of 8. Those past its rank meet zeros (the loads of ``v`` stop at the
rank) and must be finite (the pool keeps them zero).

On Hopper and later the expand is launched as a programmatic dependent (PDL) of the kernel
before it, so its launch overlaps that kernel's tail; it waits for it (``gdc_wait``) before
reading anything.

Launch parameters come from :mod:`fxlora.kernels.launch_table`, per device and shape class.

Graph safety: the grids are sized for the worst case — ``cdiv(T, BLOCK_M)`` plus one per
entry of the segment list they read — and a program with nothing to do (past its segment, a
rank-0 slot) returns at once. With ``store`` the programs after every segment's blocks write
the zeros of the rows without an adapter (:func:`_rest_block`): the grid holds them too.
Launches depend only on shapes, never on which adapters are present, so they can be captured
in a CUDA graph and replayed with other assignments.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from fxlora.kernels.launch_table import (
    ExpandConfig,
    ShrinkConfig,
    cdiv,
    expand_config,
    next_power_of_2,
    shrink_config,
)

FANOUT = tl.constexpr(64)  # segments that _segment_block searches in one step


@triton.jit
def _segment_block(pid, seg_start, seg_len, seg_slot, num_segs, SEGS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Which segment's tokens, which block of them, and which adapter's factors program ``pid``
    handles: ``(seg, slot, block, start, length)``, ``seg == num_segs`` when there is none.

    In a list of up to ``FANOUT`` segments their blocks are numbered back to back (a sum over
    every segment's block count), so the busy programs come first: at decode that is faster
    than leaving gaps between them. A longer list cannot afford that sum in every program.
    There segment ``i``'s blocks begin at program ``i + seg_start[i] // BLOCK_M``: the segments
    lie in order in ``sorted_tokens`` from its start, so that grows with ``i``, one segment's
    blocks end before the next one's begin, and every program id stays below
    ``cdiv(T, BLOCK_M) + num_segs``. A first load of every ``SEGS_P2 // FANOUT``-th start
    picks the stretch that holds ``pid``'s segment and a second finds it: no program reads
    every segment."""
    if SEGS_P2 > FANOUT:
        STEP: tl.constexpr = SEGS_P2 // FANOUT
        coarse = tl.arange(0, FANOUT) * STEP
        ok = coarse < num_segs
        firsts = coarse + tl.load(seg_start + coarse, mask=ok, other=0) // BLOCK_M
        lo = (tl.sum((ok & (firsts <= pid)).to(tl.int32), 0) - 1) * STEP  # first(0) == 0 <= pid
        WIDTH: tl.constexpr = STEP
    else:
        lo = 0
        WIDTH: tl.constexpr = SEGS_P2
    offs = lo + tl.arange(0, WIDTH)
    ok = offs < num_segs
    starts = tl.load(seg_start + offs, mask=ok, other=0)
    lens = tl.load(seg_len + offs, mask=ok, other=0)
    slots = tl.load(seg_slot + offs, mask=ok, other=0)
    if SEGS_P2 > FANOUT:  # the last segment whose first program is at most pid
        firsts = offs + starts // BLOCK_M
        seg = lo + tl.sum((ok & (firsts <= pid)).to(tl.int32), 0) - 1
    else:  # the last non-empty segment whose first program is at most pid
        blocks = (lens + BLOCK_M - 1) // BLOCK_M
        firsts = tl.cumsum(blocks, 0) - blocks
        seg = tl.max(tl.where(ok & (firsts <= pid) & (blocks > 0), offs, 0), 0)
    pick = offs == seg
    block = pid - tl.sum(tl.where(pick, firsts, 0), 0)
    start = tl.sum(tl.where(pick, starts, 0), 0)
    length = tl.sum(tl.where(pick, lens, 0), 0)
    slot = tl.sum(tl.where(pick, slots, 0), 0)
    seg = tl.where(block * BLOCK_M < length, seg, num_segs)
    return seg, slot, block, start, length


@triton.jit
def _rest_block(pid, seg_start, seg_len, num_segs, T, SEGS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows without an adapter, which ``sorted_tokens`` holds after every segment's, as one
    more segment after the list's: which block of them program ``pid`` handles and where they
    lie, ``(block, start, length)``; ``block`` is negative, or past them, for programs before
    or after it. They start where the list's last entry ends (an empty entry starts where the
    no-adapter tokens begin), and their blocks are numbered as :func:`_segment_block` numbers
    a segment's: after the others' blocks in a list of up to ``FANOUT`` entries, else from
    program ``num_segs + start // BLOCK_M``. Either way the grid of
    ``cdiv(T, BLOCK_M) + num_segs`` programs holds them: ``k`` non-empty segments and these
    rows take fewer than ``T / BLOCK_M + k + 1`` blocks."""
    start = tl.load(seg_start + num_segs - 1) + tl.load(seg_len + num_segs - 1)
    if SEGS_P2 > FANOUT:
        first = num_segs + start // BLOCK_M
    else:
        offs = tl.arange(0, SEGS_P2)
        lens = tl.load(seg_len + offs, mask=offs < num_segs, other=0)
        first = tl.sum((lens + BLOCK_M - 1) // BLOCK_M, 0)
    return pid - first, start, T - start


@triton.jit
def _store_zeros(out_rows, row_ok, lo, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    """Zeros into the columns ``lo`` to ``lo + BLOCK_N * TILES`` (within ``width``) of the
    ``BLOCK_M`` rows at ``out_rows`` (pointers to their first column) where ``row_ok``."""
    zeros = tl.zeros((BLOCK_M, BLOCK_N), out_rows.dtype.element_ty)
    for n0 in tl.range(lo, tl.minimum(lo + BLOCK_N * TILES, width), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        tl.store(out_rows[:, None] + n[None, :], zeros, mask=row_ok[:, None] & (n < width)[None, :])


@triton.jit
def slice_columns(slice_start_ptr, sl, ALIGN: tl.constexpr):
    """First column and width of output slice ``sl``, both multiples of ``ALIGN`` (see
    :func:`column_align`): what lets loads and stores of ``y`` move 16 bytes at a time."""
    col0 = tl.multiple_of(tl.load(slice_start_ptr + sl), ALIGN)
    width = tl.multiple_of(tl.load(slice_start_ptr + sl + 1) - col0, ALIGN)
    return col0, width


@triton.jit
def slice_output(y_ptr, sl, y_offsets, y_strides):
    """Where output slice ``sl``'s first element lies and its row stride: slice 0 at ``y_ptr``,
    slice ``i`` ``y_offsets[i - 1]`` elements after it (:func:`output_slices`). Selected by
    arithmetic, so the divisibility Triton knows of every offset and stride carries over."""
    off1, off2, off3 = y_offsets
    s0, s1, s2, s3 = y_strides
    one, two, three = (sl == 1).to(tl.int64), (sl == 2).to(tl.int64), (sl == 3).to(tl.int64)
    stride = s0 * (1 - one - two - three) + s1 * one + s2 * two + s3 * three
    return y_ptr + (off1 * one + off2 * two + off3 * three), stride


@triton.jit
def b_columns(rank, MAX_RANK: tl.constexpr):
    """How many of ``B``'s rank columns a slot of rank ``rank`` reads: its rank rounded up to a
    multiple of 8 (within ``MAX_RANK``), so that each row of ``B`` loads in 16-byte pieces. The
    extra columns meet zeros of ``v`` (masked to the exact rank) and must hold finite values;
    the pool keeps them zero."""
    return tl.minimum(tl.cdiv(rank, 8) * 8, MAX_RANK)


@triton.jit(do_not_specialize=["num_segs"])  # one compilation for every batch size: see segments_p2
def _shrink_kernel(
    x_ptr, a_ptr, v_ptr, rank_ptr,
    sorted_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    num_segs, K, RANKS,  # RANKS = num_slices * max_rank: columns of v, rows of each A[s]
    stride_xt, stride_as, stride_ar, stride_vt,
    MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr, SEGS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr, ROWS_LAST: tl.constexpr,
):
    if ROWS_LAST:  # see launch_table.ShrinkConfig.rows_last
        row_pid, rank_pid, split = tl.program_id(2), tl.program_id(0), tl.program_id(1)
    else:
        row_pid, rank_pid, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seg, slot, block, start, length = _segment_block(row_pid, seg_start_ptr, seg_len_ptr, seg_slot_ptr, num_segs, SEGS_P2, BLOCK_M)
    if seg >= num_segs:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    tokens = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    r = rank_pid * BLOCK_R + tl.arange(0, BLOCK_R)
    slice_rank = tl.load(rank_ptr + slot * NUM_SLICES + r // MAX_RANK, mask=r < RANKS, other=0)
    r_ok = (r % MAX_RANK) < slice_rank  # padded rank rows are never read
    if tl.max(r_ok.to(tl.int32), 0) == 0:
        return
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    for k0 in range(split * k_per_split, tl.minimum((split + 1) * k_per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xs = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # A[s] rows are contiguous along k: load them as stored, transpose in registers
        a = tl.load(a_base + r[:, None] * stride_ar + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(xs, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(xs, tl.trans(a))
    out = v_ptr + tokens[:, None] * stride_vt + r[None, :]
    mask = row_ok[:, None] & (r[None, :] < RANKS)
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["num_segs", "T"])
def _expand_kernel(
    y_ptr, v_ptr, b_ptr, scaling_ptr, rank_ptr, slice_start_ptr,
    sorted_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    num_segs, T,
    y_off1, y_off2, y_off3, stride_y0, stride_y1, stride_y2, stride_y3,
    stride_vt, stride_bs, stride_bn,
    MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr, SEGS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
    ALIGN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, ROWS_LAST: tl.constexpr, STORE: tl.constexpr,
):
    if PDL:  # launched before the kernel ahead finishes: wait for it before reading anything
        gdc_wait()
    if ROWS_LAST:  # see launch_table.ShrinkConfig.rows_last
        pid, col_pid, sl = tl.program_id(2), tl.program_id(0), tl.program_id(1)
    else:  # row blocks from the last: the rows of y the GEMM wrote last are the likeliest still in L2
        pid, col_pid, sl = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seg, slot, block, start, length = _segment_block(pid, seg_start_ptr, seg_len_ptr, seg_slot_ptr, num_segs, SEGS_P2, BLOCK_M)
    col0, width = slice_columns(slice_start_ptr, sl, ALIGN)
    y_sl, stride_yt = slice_output(y_ptr, sl, (y_off1, y_off2, y_off3), (stride_y0, stride_y1, stride_y2, stride_y3))
    lo = col_pid * (BLOCK_N * TILES)  # this program's TILES column tiles
    if lo >= width:
        return
    if seg >= num_segs:
        if STORE:  # perhaps a block of the rows without an adapter: zeros
            rest, rest_start, rest_len = _rest_block(pid, seg_start_ptr, seg_len_ptr, num_segs, T, SEGS_P2, BLOCK_M)
            if rest >= 0 and rest * BLOCK_M < rest_len:
                rows = rest * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = rows < rest_len
                tokens = tl.load(sorted_ptr + rest_start + rows, mask=row_ok, other=0).to(tl.int64)
                _store_zeros(y_sl + tokens * stride_yt, row_ok, lo, width, BLOCK_M, BLOCK_N, TILES)
        return
    rank = tl.load(rank_ptr + slot * NUM_SLICES + sl)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    if rank == 0:
        if STORE:
            tokens = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
            _store_zeros(y_sl + tokens * stride_yt, row_ok, lo, width, BLOCK_M, BLOCK_N, TILES)
        return
    tokens = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    b_ok = r < b_columns(rank, MAX_RANK)
    vs = tl.load(v_ptr + tokens[:, None] * stride_vt + (sl * MAX_RANK + r)[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if not IEEE:
        vs = vs.to(b_ptr.dtype.element_ty)
    scale = tl.load(scaling_ptr + slot * NUM_SLICES + sl)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    for n0 in tl.range(lo, tl.minimum(lo + BLOCK_N * TILES, width), BLOCK_N, num_stages=STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < width
        out = y_sl + tokens[:, None] * stride_yt + n[None, :]
        mask = row_ok[:, None] & n_ok[None, :]
        if not STORE:
            y = tl.load(out, mask=mask, other=0.0)
        # B[s] rows are contiguous along the rank: load them as stored, transpose in registers
        cols = col0 + n  # B stacks the slices' rows
        b = tl.load(b_base + cols[:, None].to(tl.int64) * stride_bn + r[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0.0)
        if IEEE:
            delta = tl.dot(vs, tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            delta = tl.dot(vs, tl.trans(b))
        if STORE:
            tl.store(out, (delta * scale).to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out, (y.to(tl.float32) + delta * scale).to(y.dtype), mask=mask)


@cache
def pdl_options(device: torch.device) -> dict:
    """The ``PDL`` constexpr and launch option of the expand kernels: programmatic dependent
    launch on Hopper (sm_90) and later, not in the interpreter."""
    on = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@cache
def slice_starts(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    return torch.tensor(starts, dtype=torch.int32, device=device)


MAX_SLICES = 4  # the expands take the first slice's pointer and three offsets from it


def output_slices(
    y: torch.Tensor | Sequence[torch.Tensor], widths: tuple[int, ...] | None
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The expands' outputs: one ``(T, sum(widths))`` tensor whose column slices they update,
    or one ``(T, width)`` tensor per slice (the members of a fused group, each its own output).
    Returns the first slice, the others' element offsets from it, every slice's row stride
    (both padded with zeros to :data:`MAX_SLICES` slices) and the widths."""
    if isinstance(y, torch.Tensor):
        widths = widths or (y.shape[1],)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        parts = [y[:, c : c + w] for c, w in zip(starts, widths, strict=True)]
    else:
        parts = list(y)
        widths = tuple(p.shape[1] for p in parts)
    if len(parts) > MAX_SLICES:
        raise ValueError(f"the expands serve at most {MAX_SLICES} output slices, got {len(parts)}")
    for p in parts:
        if p.stride(1) != 1 or p.dtype != parts[0].dtype or p.shape[0] != parts[0].shape[0]:
            raise ValueError("output slices must share dtype and rows and be contiguous along their features")
    first, size = parts[0], parts[0].element_size()
    offsets = [(p.data_ptr() - first.data_ptr()) // size for p in parts[1:]]
    pad = MAX_SLICES - len(parts)
    return first, (*offsets, *[0] * pad), (*[p.stride(0) for p in parts], *[0] * pad), widths


def column_align(widths: tuple[int, ...]) -> int:
    """The largest power of two up to 16 that divides every slice width, hence every slice's
    first column: the ``ALIGN`` the expand kernels may assume of them."""
    align = 16
    while any(w % align for w in widths):
        align //= 2
    return align


def rows_contiguous(factors: torch.Tensor) -> torch.Tensor:
    """A pool's factors as the kernels read them: any strides (a member of a joined group is a
    view of the group's tensors) as long as each row is contiguous."""
    return factors if factors.stride(-1) == 1 else factors.contiguous()


def _p2(n: int, floor: int = 16) -> int:
    return max(floor, next_power_of_2(n))


def segments_p2(entries: int, tokens: int) -> int:
    """The ``SEGS_P2`` of a launch over a segment list of ``entries`` entries: a power of two
    at least the entries it may read, ``min(entries, tokens)``. Up to :data:`FANOUT` tokens it
    is the same for every token count, so that the batch sizes of one pool share the kernels'
    compilations (the search reads at most that many starts either way)."""
    return _p2(min(entries, max(tokens, FANOUT.value)), 2)


def _grid(rows: int, second: int, third: int, rows_last: bool) -> tuple[int, int, int]:
    """The kernels' grid: row blocks on the first axis, or on the last (``rows_last``)."""
    if rows_last and rows > 65535:  # CUDA's limit on a grid's last axis
        raise ValueError(f"{rows} row blocks exceed the grid's last axis; rows_last is for few tokens")
    return (second, third, rows) if rows_last else (rows, second, third)


def lora_shrink(
    x: torch.Tensor,  # (T, K)
    lora_a: torch.Tensor,  # (slots, num_slices * max_rank, K)
    rank: torch.Tensor,  # (slots * num_slices,) int32
    sorted_tokens: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    num_slices: int = 1,
    config: ShrinkConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``v`` (T, num_slices * max_rank), float32; segment ``i`` reads slot ``seg_slot[i]``'s
    factors. Without ``out`` every other entry is zero. In ``out`` (scratch holding anything)
    the kernel writes the entries the expands read, the rows of tokens with an adapter in the
    columns below their slice's rank, and may leave the rest as they were; a reduction split
    over ``K`` adds into ``out`` zeroed first."""
    tokens, k = x.shape
    _, ranks, _ = lora_a.shape
    segs = min(seg_len.numel(), tokens)  # every non-empty segment lies in the first min(T, entries)
    cfg = config or shrink_config(tokens, k, ranks, device=x.device, segments=segs)
    if out is None:
        v = torch.zeros(tokens, ranks, dtype=torch.float32, device=x.device)
    else:
        if out.shape != (tokens, ranks) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"shrink workspace must be contiguous float32 {(tokens, ranks)}, got {tuple(out.shape)}")
        v = out.zero_() if cfg.split_k > 1 else out  # one piece stores what it computes
    x, lora_a = x.contiguous(), rows_contiguous(lora_a)
    block_r = _p2(min(ranks, cfg.block_r))
    grid = _grid(cdiv(tokens, cfg.block_m) + segs, cdiv(ranks, block_r), cfg.split_k, cfg.rows_last)
    _shrink_kernel[grid](
        x, lora_a, v, rank, sorted_tokens, seg_start, seg_len, seg_slot,
        segs, k, ranks,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), v.stride(0),
        MAX_RANK=ranks // num_slices, NUM_SLICES=num_slices, SEGS_P2=segments_p2(seg_len.numel(), tokens),
        BLOCK_M=cfg.block_m, BLOCK_R=block_r, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        IEEE=x.dtype == torch.float32, ROWS_LAST=cfg.rows_last,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return v


def lora_expand(
    y: torch.Tensor | Sequence[torch.Tensor],  # (T, N), or (T, N_i) per slice — updated in place
    v: torch.Tensor,  # (T, num_slices * max_rank) float32, from lora_shrink
    lora_b: torch.Tensor,  # (slots, N, max_rank)
    scaling: torch.Tensor,  # (slots * num_slices,) float32
    rank: torch.Tensor,  # (slots * num_slices,) int32
    sorted_tokens: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    slice_widths: tuple[int, ...] | None = None,
    config: ExpandConfig | None = None,
    store: bool = False,
) -> None:
    """``store``: write each token's delta into ``y`` (holding anything before; zeros for a
    token without an adapter and in a rank-0 slot's slices) instead of adding it."""
    y, y_offsets, y_strides, widths = output_slices(y, slice_widths)
    tokens = y.shape[0]
    _, _, max_rank = lora_b.shape
    segs = min(seg_len.numel(), tokens)
    cfg = config or expand_config(tokens, max_rank, segs, len(widths), max(widths), device=y.device)
    lora_b = rows_contiguous(lora_b)
    grid = _grid(cdiv(tokens, cfg.block_m) + segs, cdiv(max(widths), cfg.block_n * cfg.tiles), len(widths), cfg.rows_last)
    _expand_kernel[grid](
        y, v, lora_b, scaling, rank, slice_starts(tuple(widths), y.device),
        sorted_tokens, seg_start, seg_len, seg_slot,
        segs, tokens,
        *y_offsets, *y_strides, v.stride(0), lora_b.stride(0), lora_b.stride(1),
        MAX_RANK=max_rank, NUM_SLICES=len(widths), SEGS_P2=segments_p2(seg_len.numel(), tokens),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=_p2(max_rank), TILES=cfg.tiles, STAGES=cfg.stages,
        ALIGN=column_align(tuple(widths)), IEEE=y.dtype == torch.float32, ROWS_LAST=cfg.rows_last, STORE=store,
        num_warps=cfg.num_warps,
        **pdl_options(y.device),
    )
