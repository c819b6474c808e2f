"""``fxlora::gather_pages``: a paged KV cache's keys (or values) of each row, in its order.

A paged cache keeps one layer's keys in ``pages (blocks, block_size, kv_heads, dim)``; a row's
``block_table (rows, max_blocks)`` lists the blocks that hold its columns, block ``j`` of the
row holding columns ``j·block_size ...``. ``gather_pages`` returns the keys as the model's
attention reads a static cache, ``(rows, kv_heads, max_blocks·block_size, dim)``: what the
row's mask hides (columns past its length, unused table entries) is whatever the pages hold.
It is an op of its own so that the decode-attention pass finds it by name and serves the
attention on the pages, without gathering them.
"""

from __future__ import annotations

import torch


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
