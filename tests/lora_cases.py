"""Shared by the LoRA kernel tests: pool factors in the kernels' multi-slice layout, the
reference delta, and hypothesis draws of slot assignments."""

import torch
from hypothesis import strategies as st

from fxlora.kernels.lora_linear import lora_delta_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def pool_factors(gen, slots, slices, max_rank, d_in, widths, ranks, dtype):
    a = torch.randn(slots, slices * max_rank, d_in, generator=gen) / d_in**0.5
    b = torch.randn(slots, sum(widths), max_rank, generator=gen) / max_rank**0.5
    rank = torch.tensor(ranks, dtype=torch.int32)  # (slots * slices,)
    for s in range(slots):
        for i in range(slices):
            r = ranks[s * slices + i]
            a[s, i * max_rank + r : (i + 1) * max_rank] = 0
    scaling = torch.rand(slots * slices, generator=gen) + 0.5
    return a.to(dtype), b.to(dtype), scaling, rank


def reference(y, x, a, b, scaling, rank, token_slot, widths, max_rank):
    """Multi-slice delta from the single-slice reference, one slice at a time."""
    y = y.clone()
    slices = len(widths)
    col = 0
    for i, w in enumerate(widths):
        ai = a[:, i * max_rank : (i + 1) * max_rank]
        bi = b[:, col : col + w]
        part = y[:, col : col + w].clone()
        lora_delta_reference(part, x, ai, bi, scaling[i::slices].contiguous(), rank[i::slices].contiguous(), token_slot)
        y[:, col : col + w] = part
        col += w
    return y


def draw_assignment(data, tokens: int, slots: int) -> list[int]:
    """Per-token slots: mixed with -1 (no adapter), all -1, or all one adapter."""
    mode = data.draw(st.sampled_from(["mixed", "none", "one"]))
    if mode == "none":
        return [-1] * tokens
    if mode == "one":
        return [data.draw(st.integers(0, slots - 1))] * tokens
    return data.draw(st.lists(st.integers(-1, slots - 1), min_size=tokens, max_size=tokens))
