"""Decode attention in Triton: one query token per row over a KV cache, grouped-query heads
read once, masked cache columns skipped (split-K "flash decoding"); the cache contiguous per
row, or paged.

A program serves one row, one KV head and one split of the cache's columns: it loads the
queries of every head of that KV head's group, walks its columns block by block with an
online softmax, and writes the group's partial outputs with their log-sum-exp; a second
kernel combines the splits. Before reading any key it finds, from the additive mask alone,
the first and last column of its split the row sees (a column at or below ``masked`` is
hidden: past the row's context, its padding, outside a sliding window) and walks only the
blocks between them, so the work follows each row's live context, not the cache's length;
with no branch in the loop, the next blocks' keys and values load while one is computed. A
hidden column's key and value are never read, so whatever the cache holds there (NaN in
never-written memory) does not reach the output. A row whose mask hides every column (an
unused row of a batch bucket) reads zeros. The grid depends only on shapes (worst case:
every column), so a CUDA graph captured once serves every context length.

The paged variant (``PAGED``) is the same kernel with another address per column: the
cache is ``pages (blocks, block_size, kv_heads, dim)`` and logical column ``n`` of row ``b``
lies in slot ``n % block_size`` of block ``block_table[b, n // block_size]``, looked up per
column, so a block of columns may cross pages of any size. The table is read on the device,
so one captured graph also serves every block table. Values may have another head size
than keys (the output has theirs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxlora.kernels.launch_table import cdiv, next_power_of_2

BLOCK_N = 128  # cache columns per step of a program
STAGES = 2  # blocks of keys and values in flight per program (the loop's software pipeline)
SCAN = 256  # mask columns per step of the search for a split's visible columns
TARGET_PROGRAMS = 264  # about two waves on an H100's 132 SMs


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, table_ptr, part_ptr, lse_ptr,
    columns, kv_heads, group, scale, masked,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_mb, stride_mn,
    stride_tb, stride_tn,
    SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr, V_DIM: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    SCAN: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # k and v strides: (row, head, column) of a contiguous cache; (block, head, slot) of a paged one
    bh, split = tl.program_id(0), tl.program_id(1)
    b, kvh = bh // kv_heads, bh % kv_heads
    start = split * SPLIT
    stop = tl.minimum(start + SPLIT, columns)
    # the split's visible columns lie in [lo, hi): found from the mask alone, before any key is read
    lo, hi = stop, start
    for c0 in range(start, stop, SCAN):
        c = c0 + tl.arange(0, SCAN)
        bias = tl.load(mask_ptr + b * stride_mb + c * stride_mn, mask=c < stop, other=masked)
        seen = (c < stop) & (bias > masked)
        lo = tl.minimum(lo, tl.min(tl.where(seen, c, stop), 0))
        hi = tl.maximum(hi, tl.max(tl.where(seen, c + 1, start), 0))
    heads = kvh * group + tl.arange(0, BLOCK_G)
    g_ok = tl.arange(0, BLOCK_G) < group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < V_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):  # no branch inside: the loads pipeline
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        bias = tl.load(mask_ptr + b * stride_mb + n * stride_mn, mask=n_ok, other=masked).to(tl.float32)
        seen = n_ok & (bias > masked)
        bias = tl.where(seen, bias, float("-inf"))
        if PAGED:  # n < columns, so its table entry exists; a hidden column's may name any block, never read
            page = tl.load(table_ptr + b * stride_tb + (n // PAGE) * stride_tn, mask=n_ok, other=0).to(tl.int64)
            k_col, v_col = page * stride_kb + (n % PAGE) * stride_kn, page * stride_vb + (n % PAGE) * stride_vn
        else:
            k_col, v_col = b * stride_kb + n * stride_kn, b * stride_vb + n * stride_vn
        k = tl.load(k_ptr + kvh * stride_kh + k_col[:, None] + d[None, :],
                    mask=seen[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        v = tl.load(v_ptr + kvh * stride_vh + v_col[:, None] + dv[None, :],
                    mask=seen[:, None] & dv_ok[None, :], other=0.0)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a block hidden from a row so far: p = 0, no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    splits = tl.num_programs(1)
    row = (b * kv_heads * group + heads) * splits + split  # (row, head, split) of the partials
    safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(part_ptr + row[:, None] * V_DIM + dv[None, :], acc / safe[:, None], mask=g_ok[:, None] & dv_ok[None, :])
    tl.store(lse_ptr + row, tl.where(l_i > 0, m_i + tl.log(safe), float("-inf")), mask=g_ok)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, splits, stride_ob, stride_oh, heads,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(lse_ptr + bh * splits + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - top), 0.0)
    part = tl.load(part_ptr + (bh * splits + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)  # 0 when the mask hides every column: the row reads 0 (nothing, not NaN)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_size(rows: int, kv_heads: int, columns: int) -> int:
    """Columns per split: enough programs to fill the device, whole blocks each."""
    blocks = cdiv(columns, BLOCK_N)
    splits = max(1, min(blocks, cdiv(TARGET_PROGRAMS, rows * kv_heads)))
    return cdiv(blocks, splits) * BLOCK_N


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, masked: float
) -> torch.Tensor:
    """``q`` (rows, heads, 1, dim); ``k`` (rows, kv_heads, columns, dim), ``v`` (rows, kv_heads,
    columns, v_dim); ``mask`` additive, broadcastable to (rows, 1, 1, columns). Returns (rows,
    heads, 1, v_dim)."""
    kv_heads, columns = k.shape[1], k.shape[2]
    strides = tuple(t.stride(i) for t in (k, v) for i in (0, 1, 2))  # (row, head, column)
    return _attention(q, k, v, mask, scale, masked, kv_heads, columns, strides, None)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    masked: float,
) -> torch.Tensor:
    """``q`` (rows, heads, 1, dim); ``k_pages`` (blocks, block_size, kv_heads, dim), ``v_pages``
    (blocks, block_size, kv_heads, v_dim); ``block_table`` (rows, max_blocks) of block ids;
    ``mask`` additive, broadcastable to (rows, 1, 1, max_blocks * block_size). Returns (rows,
    heads, 1, v_dim)."""
    kv_heads, columns = k_pages.shape[2], block_table.shape[1] * k_pages.shape[1]
    strides = tuple(p.stride(i) for p in (k_pages, v_pages) for i in (0, 2, 1))  # (block, head, slot)
    return _attention(q, k_pages, v_pages, mask, scale, masked, kv_heads, columns, strides, block_table)


def _attention(q, k, v, mask, scale, masked, kv_heads, columns, strides, block_table):
    """Both launches, over a contiguous cache (``block_table`` None) or a paged one; ``strides``
    are k's and v's (row or block, head, column or slot)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode attention reads q, k and v with unit stride in their last dimension")
    rows, heads, _, dim = q.shape
    v_dim = v.shape[-1]
    group = heads // kv_heads
    mask = mask.expand(rows, 1, 1, columns)
    paged = block_table is not None
    table = block_table if paged else mask  # a pointer the contiguous variant never reads
    split = split_size(rows, kv_heads, columns)
    splits = cdiv(columns, split)
    part = torch.empty(rows * heads * splits, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows * heads * splits, dtype=torch.float32, device=q.device)
    block_dv = max(16, next_power_of_2(v_dim))  # tl.dot's smallest operand side
    _split_kernel[(rows * kv_heads, splits)](
        q, k, v, mask, table, part, lse,
        columns, kv_heads, group, scale, masked,
        q.stride(0), q.stride(1), *strides, mask.stride(0), mask.stride(3), table.stride(0), table.stride(-1),
        SPLIT=split, BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=max(16, next_power_of_2(dim)),
        HEAD_DIM=dim, BLOCK_DV=block_dv, V_DIM=v_dim, PAGED=paged, PAGE=k.shape[1] if paged else 1,
        SCAN=SCAN, STAGES=STAGES, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 as float32, not TF32
        num_warps=4,
    )  # fmt: skip
    out = torch.empty(rows, heads, 1, v_dim, dtype=q.dtype, device=q.device)
    _combine_kernel[(rows * heads,)](
        part, lse, out, splits, out.stride(0), out.stride(1), heads,
        BLOCK_S=next_power_of_2(splits), BLOCK_D=block_dv, HEAD_DIM=v_dim,
    )  # fmt: skip
    return out
