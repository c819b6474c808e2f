"""``fxlora::decode_attention``: attention of one query token per row over a KV cache, with
grouped-query heads read as they are cached.

It computes what transformers' SDPA attention computes at a decode step,
``scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask, scale=scale)``,
without expanding the cached keys and values to the query heads: query head ``h`` reads KV
head ``h // (heads / kv_heads)``, as ``repeat_kv`` lays them out. On CUDA the Triton kernel of
:mod:`fxlora.kernels.decode_attention` skips cache blocks the mask hides from a row;
elsewhere the reference is that SDPA call itself. A row whose mask hides every cache
column (an unused row of a batch bucket) reads zeros from the kernel, where SDPA would
average every column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.kernels import decode_attention as kernel


def decode_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.library.custom_op("fxlora::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` (rows, heads, 1, dim); ``k``, ``v`` (rows, kv_heads, columns, dim) with ``heads`` a
    multiple of ``kv_heads``; ``mask`` additive (or boolean, True where a column is seen),
    broadcastable to (rows, 1, 1, columns). Returns (rows, heads, 1, dim)."""
    return decode_attention_reference(q, k, v, mask, scale)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as the kernels read it: additive, a boolean one's hidden columns at -inf."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def decode_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    mask = additive(mask, q.dtype)
    return kernel.decode_attention(q.contiguous(), k, v, mask, scale, torch.finfo(mask.dtype).min)


if kernel is not None:
    decode_attention.register_kernel("cuda")(decode_attention_triton)


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
