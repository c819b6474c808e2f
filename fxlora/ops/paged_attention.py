"""The paged-attention ops: ``fxlora::gather_pages``, a paged KV cache's keys (or values) of
each row in its order, and ``fxlora::paged_decode_attention``, a decode step's attention
read straight from the pages.

A paged cache keeps one layer's keys in ``pages (blocks, block_size, kv_heads, dim)``; a row's
``block_table (rows, max_blocks)`` lists the blocks that hold its columns, block ``j`` of the
row holding columns ``j·block_size ...``. ``gather_pages`` returns the keys as the model's
attention reads a static cache, ``(rows, kv_heads, max_blocks·block_size, dim)``: what the
row's mask hides (columns past its length, unused table entries) is whatever the pages hold.
It is an op of its own so that the decode-attention pass finds it by name and serves the
attention on the pages, without gathering them.

``paged_decode_attention`` is that attention: ``fxlora::decode_attention`` over the gathered
keys and values (its reference gathers them), computed on CUDA by the same Triton kernel
(:mod:`fxlora.kernels.decode_attention`) reading each column through the block table.
The kernel reads no page for a column the mask hides, so a row's unused table entries may
name any block; a row whose mask hides every column reads zeros.
"""

from __future__ import annotations

import torch

from fxlora.kernels import decode_attention as kernel
from fxlora.ops.decode_attention import additive, decode_attention_reference


def gather_pages_reference(pages: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    rows, blocks = block_table.shape
    gathered = pages[block_table.long()]  # (rows, max_blocks, block_size, kv_heads, dim)
    return gathered.flatten(1, 2).transpose(1, 2).contiguous()


@torch.library.custom_op("fxlora::gather_pages", mutates_args=())
def gather_pages(pages: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``pages`` (blocks, block_size, kv_heads, dim); ``block_table`` (rows, max_blocks) of
    block ids. Returns (rows, kv_heads, max_blocks * block_size, dim)."""
    return gather_pages_reference(pages, block_table)


@gather_pages.register_fake
def _(pages, block_table):
    rows, blocks = block_table.shape
    return pages.new_empty(rows, pages.shape[2], blocks * pages.shape[1], pages.shape[3])


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    k, v = gather_pages_reference(k_pages, block_table), gather_pages_reference(v_pages, block_table)
    return decode_attention_reference(q, k, v, mask, scale)


@torch.library.custom_op("fxlora::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q`` (rows, heads, 1, dim); ``k_pages`` (blocks, block_size, kv_heads, dim) and
    ``v_pages`` (blocks, block_size, kv_heads, v_dim) with ``heads`` a multiple of
    ``kv_heads``; ``block_table`` (rows, max_blocks) of block ids; ``mask`` additive (or
    boolean, True where a column is seen), broadcastable to (rows, 1, 1, max_blocks *
    block_size). Returns (rows, heads, 1, v_dim)."""
    return paged_decode_attention_reference(q, k_pages, v_pages, block_table, mask, scale)


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    mask = additive(mask, q.dtype)
    masked = torch.finfo(mask.dtype).min
    return kernel.paged_decode_attention(q.contiguous(), k_pages, v_pages, block_table, mask, scale, masked)


if kernel is not None:
    paged_decode_attention.register_kernel("cuda")(paged_decode_attention_triton)


@paged_decode_attention.register_fake
def _(q, k_pages, v_pages, block_table, mask, scale):
    return q.new_empty(q.shape[0], q.shape[1], 1, v_pages.shape[3])
