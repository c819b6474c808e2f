"""The Triton SGMV kernels against the reference, drawn over shapes that are not multiples of
the block sizes. On a machine without CUDA they run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), float32 and float16."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxlora.kernels import batch_info
from fxlora.kernels.lora_linear import lora_delta_reference

sgmv = pytest.importorskip("fxlora.kernels.sgmv")

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


@settings(max_examples=60)
@given(
    tokens=st.integers(1, 67),
    d_in=st.integers(1, 80),
    widths=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    max_rank=st.integers(1, 64),
    slots=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_shrink_expand_match_reference(tokens, d_in, widths, max_rank, slots, dtype, data):
    slices = len(widths)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=slots * slices, max_size=slots * slices))
    mode = data.draw(st.sampled_from(["mixed", "none", "one"]))
    if mode == "none":
        assignment = [-1] * tokens
    elif mode == "one":
        assignment = [data.draw(st.integers(0, slots - 1))] * tokens
    else:
        assignment = data.draw(st.lists(st.integers(-1, slots - 1), min_size=tokens, max_size=tokens))
    a, b, scaling, rank = pool_factors(gen, slots, slices, max_rank, d_in, widths, ranks, dtype)
    x = torch.randn(tokens, d_in, generator=gen).to(dtype)
    y = torch.randn(tokens, sum(widths), generator=gen).to(dtype)
    meta = batch_info(torch.tensor(assignment, dtype=torch.int32), x, 1, slots)
    expected = reference(y, x, a, b, scaling, rank, meta[0], widths, max_rank)

    on = lambda *t: [u.to(DEVICE) for u in t]  # noqa: E731
    x_d, y_d, a_d, b_d, scaling_d, rank_d = on(x, y, a, b, scaling, rank)
    token_slot, sorted_tokens, seg_start, seg_len = on(*meta)
    blocks = st.sampled_from([16, 32])
    shrink = data.draw(st.none() | st.builds(sgmv.ShrinkConfig, blocks, blocks, st.integers(1, 3), st.just(4)), label="shrink")
    expand = data.draw(st.none() | st.builds(sgmv.ExpandConfig, blocks, blocks, st.just(4)), label="expand")
    v = sgmv.lora_shrink(x_d, a_d, rank_d, sorted_tokens, seg_start, seg_len, num_slices=slices, config=shrink)
    sgmv.lora_expand(y_d, v, b_d, scaling_d, rank_d, sorted_tokens, seg_start, seg_len, tuple(widths), config=expand)
    torch.testing.assert_close(y_d.cpu().float(), expected.float(), **TOL[dtype])
    untouched = (meta[0] < 0).tolist()
    assert torch.equal(y_d.cpu()[untouched], y[untouched])  # no-adapter tokens are not written
