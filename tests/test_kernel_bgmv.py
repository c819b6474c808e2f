"""The Triton BGMV expand (one token per program, for a handful of tokens) after the SGMV
shrink, against the reference, drawn over shapes that are not multiples of the block sizes.
On a machine without CUDA they run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), float32 and float16."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import draw_case, ptx_memory_ops

bgmv = pytest.importorskip("fxlora.kernels.bgmv")
sgmv = pytest.importorskip("fxlora.kernels.sgmv")


@settings(max_examples=60 if torch.cuda.is_available() else 25)  # the CPU runs Triton's interpreter
@given(data=st.data())
def test_expand_matches_reference(data):
    store = data.draw(st.booleans(), label="store")
    c = draw_case(data, store=store)
    expand = data.draw(st.none() | st.builds(bgmv.ExpandConfig, st.sampled_from([16, 32]), st.just(4)), label="expand")
    v = sgmv.lora_shrink(c.x, c.a, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, c.seg_slot, len(c.widths), out=c.workspace(data))
    bgmv.lora_expand(c.outputs(data), v, c.b, c.scaling, c.rank, c.token_slot, c.widths, config=expand, store=store)
    c.check()


@pytest.mark.parametrize("store", [False, True], ids=["add", "store"])
def test_expand_moves_whole_words(store):
    """With aligned slice widths no load or store of ``y`` or ``B`` is narrower than the layout
    gives each thread (two bf16 at 128 columns and 2 warps), in the code compiled for Hopper."""
    signature = {"y_ptr": "*bf16", "v_ptr": "*fp32", "b_ptr": "*bf16", "scaling_ptr": "*fp32"}
    signature.update(dict.fromkeys(["rank_ptr", "slice_start_ptr", "slot_ptr"], "*i32"))
    signature.update(dict.fromkeys(["y_off1", "y_off2", "y_off3", "stride_y0", "stride_y1", "stride_y2", "stride_y3", "stride_vt", "stride_bs", "stride_bn"], "i32"))
    constexprs = dict(MAX_RANK=16, NUM_SLICES=3, BLOCK_N=128, BLOCK_R=16, ALIGN=sgmv.column_align((4096, 1024, 1024)), PDL=True, STORE=store)
    ops = ptx_memory_ops("fxlora.kernels.bgmv", "_expand_kernel", signature, constexprs, num_warps=2)
    assert not any(op.endswith((".b16", ".b8")) for op in ops), ops
    assert ops.get("ld.global.v4.b32", 0) > 0, ops
