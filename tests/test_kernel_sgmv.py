"""The Triton SGMV kernels against the reference, drawn over shapes that are not multiples of
the block sizes. On a machine without CUDA they run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), float32 and float16."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import DEVICE, DTYPES, TOL, draw_assignment, pool_factors, reference

from fxlora.kernels import batch_info

sgmv = pytest.importorskip("fxlora.kernels.sgmv")


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
    assignment = draw_assignment(data, tokens, slots)
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
    expand = data.draw(
        st.none() | st.builds(sgmv.ExpandConfig, blocks, blocks, st.just(4), st.integers(1, 3), st.integers(1, 2)),
        label="expand",
    )
    v = sgmv.lora_shrink(x_d, a_d, rank_d, sorted_tokens, seg_start, seg_len, num_slices=slices, config=shrink)
    sgmv.lora_expand(y_d, v, b_d, scaling_d, rank_d, sorted_tokens, seg_start, seg_len, tuple(widths), config=expand)
    torch.testing.assert_close(y_d.cpu().float(), expected.float(), **TOL[dtype])
    untouched = (meta[0] < 0).tolist()
    assert torch.equal(y_d.cpu()[untouched], y[untouched])  # no-adapter tokens are not written
