"""fxlora::lora_linear's reference against the LoRA formula written token by token,
fxlora::lora_linear_fused's against its members served one at a time,
fxlora::lora_linear_beside's against lora_linear_fused's outputs taken apart, and the ops'
Triton implementations (on one stream: in Triton's interpreter without CUDA) against the
references."""

import contextlib
import functools
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from lora_cases import DEVICE, TOL, make_case, multi_slice, nan_workspace, per_token
from torch.utils._python_dispatch import TorchDispatchMode

from fxlora.kernels import sgmv
from fxlora.ops import BatchInfo, LoraWeights, batch_info, lora_linear, lora_linear_beside, lora_linear_fused
from fxlora.ops.delta_launcher import lora_workspace


@given(
    rows=st.integers(1, 5),
    per_row=st.integers(1, 4),
    d_in=st.integers(1, 24),
    d_out=st.integers(1, 24),
    max_rank=st.integers(1, 8),
    num_slots=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    bias=st.booleans(),
    data=st.data(),
)
def test_lora_linear_matches_formula(rows, per_row, d_in, d_out, max_rank, num_slots, dtype, bias, data):
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(
        gen, rows * per_row, d_in, d_out, max_rank, ranks, slots, dtype, bias
    )
    meta = BatchInfo(*batch_info(slot_ids, x, 1, num_slots))
    out = lora_linear(x, w, b, [a, bb, scaling, rank], meta, lora_workspace(x, a))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), per_token(x, w, b, a, bb, scaling, rank, meta.token_slot), **TOL[dtype])
    base_rows = meta.token_slot < 0
    assert torch.equal(out[base_rows], F.linear(x, w, b)[base_rows])  # no-adapter rows: untouched


def test_lora_linear_keeps_leading_dims_and_fake():
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(gen, 6, 5, 3, 2, [2, 1], [0, 1], torch.float32)
    x = x.view(2, 3, 5)
    args = (x, w, b, [a, bb, scaling, rank], list(batch_info(slot_ids, x, 1, 2)), lora_workspace(x, a))
    assert lora_linear(*args).shape == (2, 3, 3)
    torch.library.opcheck(torch.ops.fxlora.lora_linear.default, args, test_utils=("test_schema", "test_faketensor"))


@given(
    rows=st.integers(1, 5),
    per_row=st.integers(1, 3),
    d_in=st.integers(1, 24),
    widths=st.lists(st.integers(1, 24), min_size=2, max_size=3),
    max_rank=st.integers(1, 8),
    num_slots=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    data=st.data(),
)
def test_lora_linear_fused_matches_its_members_one_at_a_time(
    rows, per_row, d_in, widths, max_rank, num_slots, dtype, data
):
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = torch.randn(rows * per_row, d_in, generator=gen).to(dtype)
    slot_ids = torch.tensor(slots, dtype=torch.int32)
    members = []
    for width in widths:
        ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
        bias = data.draw(st.booleans())
        _, w, b, a, bb, scaling, rank, _ = make_case(gen, 1, d_in, width, max_rank, ranks, slots, dtype, bias)
        members.append((w, b, LoraWeights(a, bb, scaling, rank)))
    weights, biases, factors = zip(*members, strict=True)
    joint = multi_slice(factors)
    meta = BatchInfo(*batch_info(slot_ids, x, 1, num_slots))
    outs = lora_linear_fused(x, list(weights), list(biases), joint, meta)
    base_rows = meta.token_slot < 0
    for out, (w, b, f) in zip(outs, members, strict=True):
        torch.testing.assert_close(out, lora_linear(x, w, b, f, meta, lora_workspace(x, f.lora_a)), **TOL[dtype])
        assert out.is_contiguous()
        assert torch.equal(out[base_rows], F.linear(x, w, b)[base_rows])  # untouched: the member's own linear


def test_lora_linear_fused_keeps_leading_dims_and_fake():
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(gen, 6, 5, 3, 2, [2, 1], [0, 1], torch.float32)
    x = x.view(2, 3, 5)
    joint = [torch.cat([a, a], 1), torch.cat([bb, bb[:, :2]], 1), scaling.repeat_interleave(2), rank.repeat_interleave(2)]
    args = (x, [w, w[:2]], [b, None], joint, list(batch_info(slot_ids, x, 1, 2)))
    assert [y.shape for y in lora_linear_fused(*args)] == [(2, 3, 3), (2, 3, 2)]
    torch.library.opcheck(torch.ops.fxlora.lora_linear_fused.default, args, test_utils=("test_schema", "test_faketensor"))


@given(
    rows=st.integers(1, 5),
    widths=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    data=st.data(),
)
def test_lora_linear_beside_is_the_fused_ops_outputs_taken_apart(rows, widths, dtype, data):
    """Each member's base output, and its columns of the delta apart: added, the fused op's
    output bit for bit; zero for tokens without an adapter."""
    num_slots, max_rank, d_in = 3, 8, 16
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = torch.randn(rows, 2, d_in, generator=gen).to(dtype)
    members = []
    for width in widths:
        ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
        _, w, b, a, bb, scaling, rank, _ = make_case(gen, 1, d_in, width, max_rank, ranks, slots, dtype, data.draw(st.booleans()))
        members.append((w, b, LoraWeights(a, bb, scaling, rank)))
    weights, biases, factors = (list(t) for t in zip(*members, strict=True))
    meta = list(batch_info(torch.tensor(slots, dtype=torch.int32), x, 1, num_slots))
    *ys, delta = lora_linear_beside(x, weights, biases, multi_slice(factors), meta)
    fused = lora_linear_fused(x, weights, biases, multi_slice(factors), meta)
    assert delta.shape == (rows, 2, sum(widths)) and delta.dtype == dtype
    for y, columns, out, w, b in zip(ys, delta.split(widths, -1), fused, weights, biases, strict=True):
        assert torch.equal(y, F.linear(x, w, b)) and torch.equal(y + columns, out)
    assert not delta[torch.tensor(slots) < 0].any()
    torch.library.opcheck(
        torch.ops.fxlora.lora_linear_beside.default, (x, weights, biases, multi_slice(factors), meta),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_strided_size_one_dimension_is_one_gemm_not_a_bmm():
    # (tokens, 1, hidden) with a stride aten.matmul does not fold on the size-1 dimension, as
    # Inductor may pass: the base GEMM stays one mm over the tokens, not a bmm over an expanded weight
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(gen, 4, 8, 6, 2, [2, 1], [0, 1, -1, 0], torch.float32)
    strided = torch.randn(4, 3, 8, generator=gen)[:, :1]
    strided.copy_(x[:, None])
    assert strided.stride() == (24, 8, 1)
    joint = [torch.cat([a, a], 1), torch.cat([bb, bb[:, :2]], 1), scaling.repeat_interleave(2), rank.repeat_interleave(2)]
    implementations = [(lora_linear, "single"), (lora_linear_fused, "fused")]
    if sgmv is not None:
        from fxlora.ops.lora_linear import lora_linear_fused_triton, lora_linear_triton

        one_stream = dict(overlap=False)
        implementations += [
            (functools.partial(lora_linear_triton, **one_stream), "single"),
            (functools.partial(lora_linear_fused_triton, **one_stream), "fused"),
        ]
    for op, kind in implementations:
        on = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
        meta = [on(t) for t in batch_info(slot_ids, x, 1, 2)]
        xs = {"strided": on(strided), "contiguous": on(x[:, None])}
        out, ops = {}, _Ops()
        for name, inp in xs.items():
            with ops if name == "strided" else contextlib.nullcontext():
                if kind == "single":
                    out[name] = [op(inp, on(w), on(b), [on(t) for t in (a, bb, scaling, rank)], meta, lora_workspace(inp, on(a)))]
                else:
                    out[name] = op(inp, [on(w), on(w[:2])], [on(b), None], [on(t) for t in joint], meta)
        assert torch.ops.aten.bmm.default not in ops.seen, (op, ops.seen)
        for got, ref in zip(out["strided"], out["contiguous"], strict=True):
            assert got.shape == ref.shape and torch.equal(got, ref)


@pytest.mark.skipif(sgmv is None, reason="needs Triton")
@pytest.mark.parametrize("per_row, max_rank", [(1, 16), (12, 32)], ids=["per_token_expand", "segmented_expand"])
@given(
    rows=st.integers(3, 5),
    widths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    data=st.data(),
)
def test_triton_implementations_match_the_references(per_row, max_rank, rows, widths, dtype, data):
    from fxlora.kernels import bgmv
    from fxlora.ops.lora_linear import lora_linear_beside_triton, lora_linear_fused_triton, lora_linear_triton

    assert bgmv.serves(rows * per_row, max_rank) == (per_row == 1)
    num_slots, d_in = 3, 24
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = torch.randn(rows * per_row, d_in, generator=gen).to(dtype)
    members = []
    for width in widths:
        ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
        _, w, b, a, bb, scaling, rank, _ = make_case(gen, 1, d_in, width, max_rank, ranks, slots, dtype)
        members.append((w, b, LoraWeights(a, bb, scaling, rank)))
    meta = BatchInfo(*batch_info(torch.tensor(slots, dtype=torch.int32), x, 1, num_slots))
    weights, biases, factors = zip(*members, strict=True)
    joint = multi_slice(factors)
    w, b, f = members[0]
    expected = [lora_linear(x, w, b, f, meta, lora_workspace(x, f.lora_a))]  # on the host: the references
    expected += lora_linear_fused(x, list(weights), list(biases), joint, meta)
    on = lambda ts: [t.to(DEVICE) if t is not None else None for t in ts]  # noqa: E731
    x, w, b = on((x, w, b))
    f, joint, meta, weights, biases = on(f), on(joint), on(meta), on(weights), on(biases)
    got = [lora_linear_triton(x, w, b, f, meta, nan_workspace(x, f[0]), overlap=False)]
    module = sys.modules[lora_linear_fused_triton.__module__]  # the op's own scratch, NaN as well
    with mock.patch.object(module, "lora_workspace", nan_workspace):
        got += lora_linear_fused_triton(x, weights, biases, joint, meta, overlap=False)
    with mock.patch.object(module, "lora_workspace", nan_workspace):
        *ys, delta = lora_linear_beside_triton(x, weights, biases, joint, meta, overlap=False)
    got += [y + columns for y, columns in zip(ys, delta.split(list(widths), -1), strict=True)]
    expected += expected[1:]  # the fused op's outputs, taken apart and added
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])
