"""The Triton BGMV expand (one token per program, for a handful of tokens) after the SGMV
shrink, against the reference, drawn over shapes that are not multiples of the block sizes.
On a machine without CUDA they run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), float32 and float16."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import draw_case

bgmv = pytest.importorskip("fxlora.kernels.bgmv")
sgmv = pytest.importorskip("fxlora.kernels.sgmv")


@settings(max_examples=60)
@given(data=st.data())
def test_expand_matches_reference(data):
    c = draw_case(data)
    expand = data.draw(st.none() | st.builds(bgmv.ExpandConfig, st.sampled_from([16, 32]), st.just(4)), label="expand")
    v = sgmv.lora_shrink(c.x, c.a, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, len(c.widths))
    bgmv.lora_expand(c.y, v, c.b, c.scaling, c.rank, c.token_slot, c.widths, config=expand)
    c.check()
