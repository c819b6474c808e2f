"""A paged KV cache: every layer's keys and values in fixed-size blocks, one pool for all rows.

Each layer holds ``keys (blocks, block_size, kv_heads, dim)`` and values alike, allocated once
and sized from a memory budget. A step tells the cache where its new tokens go
(``slot_mapping``: per token, ``block · block_size + offset``; block 0 takes what nothing
reads) and, at a decode step, which blocks hold each row's columns (``block_table``, one row
of block ids per batch row). ``update`` writes the new keys and values into their slots and
returns what attention reads: at a prefill the new keys themselves (a prefill attends to its
own tokens only), at a decode step ``fxlora::gather_pages`` of the pool, which the
decode-attention pass turns into attention that reads the pages in place.

It implements the ``transformers`` cache interface attention layers call (``update``); the
runtime always passes ``position_ids`` and a prepared 4-D attention mask.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from fxlora.runtime.block_allocator import BlockAllocator


class _PagedLayer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False

    def __init__(self, cache: PagedKVCache, keys: torch.Tensor, values: torch.Tensor, index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache = self.cache
        for name, states, pages in (("keys", key_states, self.keys), ("values", value_states, self.values)):
            if states.shape[1] != pages.shape[2] or states.shape[-1] != pages.shape[-1]:
                raise ValueError(
                    f"fxlora paged KV cache layer {self.index}: {name} of shape {tuple(states.shape)} do not fit the "
                    f"pages' (blocks, block_size, heads, dim) = {tuple(pages.shape)}"
                )
        # (rows, heads, tokens, dim) -> one (heads, dim) entry per token, into its slot
        block, offset = cache.slot_mapping // cache.block_size, cache.slot_mapping % cache.block_size
        for states, pages in ((key_states, self.keys), (value_states, self.values)):
            pages.index_put_((block, offset), states.transpose(1, 2).reshape(-1, *pages.shape[2:]).to(pages.dtype))
        if cache.prefilling:
            return key_states, value_states
        gather = torch.ops.fxlora.gather_pages
        return gather(self.keys, cache.block_table), gather(self.values, cache.block_table)

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.cache.columns, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.cache.columns

    def get_max_length(self) -> int:
        return self.cache.columns


class PagedKVCache(Cache):
    """Keys and values of every layer in ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_blocks_per_row: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_shapes: list[tuple[tuple[int, int], tuple[int, int]]],
    ):
        """``layer_shapes``: per layer, ``(heads, dim)`` of the keys and of the values it caches."""
        self.block_size, self.max_blocks_per_row = block_size, max_blocks_per_row
        self.columns = max_blocks_per_row * block_size  # what a decode step's attention spans
        layers = [
            _PagedLayer(
                self,
                torch.zeros((num_blocks, block_size, kh, kd), dtype=dtype, device=device),
                torch.zeros((num_blocks, block_size, vh, vd), dtype=dtype, device=device),
                i,
            )
            for i, ((kh, kd), (vh, vd)) in enumerate(layer_shapes)
        ]
        super().__init__(layers=layers)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.prefilling = False
        self.slot_mapping = torch.zeros(1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(1, max_blocks_per_row, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    @staticmethod
    def block_bytes(layer_shapes: list[tuple[tuple[int, int], tuple[int, int]]], block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over every layer."""
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(block_size * (kh * kd + vh * vd) * size for (kh, kd), (vh, vd) in layer_shapes)
