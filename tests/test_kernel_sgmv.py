"""The Triton SGMV kernels against the reference, drawn over shapes that are not multiples of
the block sizes. On a machine without CUDA they run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), float32 and float16."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import draw_case, ptx_memory_ops

sgmv = pytest.importorskip("fxlora.kernels.sgmv")


@settings(max_examples=60 if torch.cuda.is_available() else 25)  # the CPU runs Triton's interpreter
@given(data=st.data())
def test_shrink_expand_match_reference(data):
    store = data.draw(st.booleans(), label="store")
    c = draw_case(data, store=store)
    blocks = st.sampled_from([16, 32])
    shrink = data.draw(
        st.none()
        | st.builds(
            sgmv.ShrinkConfig,
            blocks,
            blocks,
            st.integers(1, 3),
            st.sampled_from([1, 2, 4]),
            block_r=st.sampled_from([16, 32, 64]),
            num_stages=st.integers(1, 3),
            rows_last=st.booleans(),
        ),
        label="shrink",
    )
    expand = data.draw(
        st.none()
        | st.builds(
            sgmv.ExpandConfig, blocks, blocks, st.just(4), st.sampled_from([1, 2, 3, 8]), st.integers(1, 2), st.booleans()
        ),
        label="expand",
    )
    v = sgmv.lora_shrink(c.x, c.a, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, c.seg_slot, len(c.widths), config=shrink, out=c.workspace(data))
    y = c.outputs(data)
    sgmv.lora_expand(y, v, c.b, c.scaling, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, c.seg_slot, c.widths, config=expand, store=store)
    c.check()


@settings(max_examples=5)
@given(data=st.data())
def test_long_segment_lists_match_reference(data):
    """Segment lists longer than the search reads at once (more tokens and more slots than 64),
    so it takes two steps; most segments are one token long."""
    store = data.draw(st.booleans(), label="store")
    c = draw_case(data, slots=(65, 100), tokens=(65, 100), store=store)
    v = sgmv.lora_shrink(c.x, c.a, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, c.seg_slot, len(c.widths))
    y = c.outputs(data)
    sgmv.lora_expand(y, v, c.b, c.scaling, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, c.seg_slot, c.widths, store=store)
    c.check()


@settings(max_examples=8)
@given(data=st.data())
def test_a_pool_larger_than_the_batch(data):
    """More slots than tokens (a decode batch on a large pool): the list is compact, and the
    kernels read only its first ``tokens`` entries, of the fewest or of one per slot."""
    store = data.draw(st.booleans(), label="store")
    c = draw_case(data, slots=(9, 40), tokens=(1, 8), store=store)
    v = sgmv.lora_shrink(c.x, c.a, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, c.seg_slot, len(c.widths))
    y = c.outputs(data)
    sgmv.lora_expand(y, v, c.b, c.scaling, c.rank, c.sorted_tokens, c.seg_start, c.seg_len, c.seg_slot, c.widths, store=store)
    c.check()


def test_column_align():
    """The alignment the expands assume divides every slice's width and first column."""
    assert sgmv.column_align((4096, 1024, 1024)) == 16
    assert sgmv.column_align((1536, 576)) == 16
    assert sgmv.column_align((24, 8)) == 8
    assert sgmv.column_align((4096, 6)) == 2
    assert sgmv.column_align((67,)) == 1


@pytest.mark.parametrize("store", [False, True], ids=["add", "store"])
def test_expand_moves_16_bytes_at_a_time(store):
    """With aligned slice widths the expand's loads and stores of ``y`` and ``B`` are 16 bytes
    wide in the code compiled for Hopper (2-byte ones made it several times slower), also where
    it stores the delta and the zeros."""
    signature = dict.fromkeys(["rank_ptr", "slice_start_ptr", "sorted_ptr", "seg_start_ptr", "seg_len_ptr", "seg_slot_ptr"], "*i32")
    signature = {"y_ptr": "*bf16", "v_ptr": "*fp32", "b_ptr": "*bf16", "scaling_ptr": "*fp32", **signature}
    signature.update(dict.fromkeys(["num_segs", "T", *["y_off1", "y_off2", "y_off3", "stride_y0", "stride_y1", "stride_y2", "stride_y3", "stride_vt", "stride_bs", "stride_bn"]], "i32"))
    constexprs = dict(
        MAX_RANK=16, NUM_SLICES=3, SEGS_P2=4, BLOCK_M=32, BLOCK_N=64, BLOCK_R=16, TILES=4, STAGES=2,
        ALIGN=sgmv.column_align((4096, 1024, 1024)), IEEE=False, PDL=True, ROWS_LAST=False, STORE=store,
    )
    ops = ptx_memory_ops("fxlora.kernels.sgmv", "_expand_kernel", signature, constexprs)
    assert not any(op.endswith((".b16", ".b8")) for op in ops), ops
    assert ops.get("cp.async.cg", 0) + ops.get("ld.global.v4.b32", 0) > 0 and ops.get("st.global.v4.b32", 0) > 0, ops


@pytest.mark.parametrize("tokens, segs", [(32, 16), (2048, 2048)], ids=["decode", "prefill_long_segment_list"])
def test_shrink_moves_16_bytes_at_a_time(tokens, segs):
    """With 4096 features (a multiple of 16, which Triton specialises on) the shrink loads ``x``
    and ``A`` 16 bytes at a time in the code compiled for Hopper, with its launch parameters for
    the token count; only the batch info is read in 4-byte words."""
    signature = {"x_ptr": "*bf16", "a_ptr": "*bf16", "v_ptr": "*fp32"}
    signature.update(dict.fromkeys(["rank_ptr", "sorted_ptr", "seg_start_ptr", "seg_len_ptr", "seg_slot_ptr"], "*i32"))
    signature.update(dict.fromkeys(["num_segs", "K", "RANKS", "stride_xt", "stride_as", "stride_ar", "stride_vt"], "i32"))
    cfg = sgmv.shrink_config(tokens, 4096, 16)
    constexprs = dict(
        MAX_RANK=16, NUM_SLICES=1, SEGS_P2=segs, BLOCK_M=cfg.block_m, BLOCK_R=16, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, IEEE=False, ROWS_LAST=cfg.rows_last,
    )
    ops = ptx_memory_ops(
        "fxlora.kernels.sgmv", "_shrink_kernel", signature, constexprs, cfg.num_warps, cfg.num_stages, ("K", "RANKS")
    )
    assert set(ops) <= {"cp.async.cg", "ld.global.b32", "ld.global.v4.b32"}, ops
    assert ops.get("cp.async.cg", 0) + ops.get("ld.global.v4.b32", 0) > 0, ops


def test_batch_sizes_of_one_pool_share_the_kernels_compilations(monkeypatch):
    """Up to 64 tokens every batch size launches the kernels with the same search width over
    the segment list, so the decode buckets of one pool compile each kernel once per launch
    configuration, not once per bucket (``num_segs``, which differs, is not specialised)."""
    widths = []

    class Recorder:  # stands in for the jitted kernels: records the search width they are given
        def __getitem__(self, grid):
            return lambda *args, **constexprs: widths.append(constexprs["SEGS_P2"])

    monkeypatch.setattr(sgmv, "_shrink_kernel", Recorder())
    monkeypatch.setattr(sgmv, "_expand_kernel", Recorder())

    def launch(tokens, entries):
        widths.clear()
        rank = torch.full((entries,), 16, dtype=torch.int32)
        segments = [torch.zeros(entries, dtype=torch.int32) for _ in range(4)]
        v = sgmv.lora_shrink(torch.randn(tokens, 64), torch.randn(entries, 16, 64), rank, *segments)
        y = torch.randn(tokens, 32)
        sgmv.lora_expand(y, v, torch.randn(entries, 32, 16), torch.ones(entries), rank, *segments)
        return set(widths)

    assert {w for t in (1, 2, 4, 8, 16, 32, 64) for w in launch(t, 16)} == {16}
    assert {w for t in (1, 8, 64) for w in launch(t, 16 * 64)} == {64}  # the MoE path's list of slots x experts
    assert launch(128, 16 * 64) == {128} and launch(4096, 16 * 64) == {1024}
