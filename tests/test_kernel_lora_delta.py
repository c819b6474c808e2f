"""fxlora::lora_delta's reference against the LoRA formula written token by token (one output,
and several outputs of the multi-slice layout served one at a time), its registration
(schema, fake, functionalization, Inductor on CPU), and its Triton implementation (in
Triton's interpreter without CUDA) against the reference.

Tolerances (TOL): float32 1e-5 relative and absolute; float16 1e-2."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from lora_cases import DEVICE, TOL, make_case, multi_slice, nan_workspace, per_token

from fxlora.kernels import sgmv
from fxlora.ops import BatchInfo, LoraWeights, batch_info, lora_delta
from fxlora.ops.delta_launcher import lora_workspace


def draw_members(data, gen, d_in, widths, max_rank, num_slots, dtype):
    """Per output: its base output's weight and bias, and its factors."""
    members = []
    for width in widths:
        ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
        _, w, b, a, bb, scaling, rank, _ = make_case(gen, 1, d_in, width, max_rank, ranks, [], dtype)
        members.append((w, b, LoraWeights(a, bb, scaling, rank)))
    return members


@given(
    rows=st.integers(1, 5),
    per_row=st.integers(1, 4),
    d_in=st.integers(1, 24),
    widths=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    max_rank=st.integers(1, 8),
    num_slots=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    data=st.data(),
)
def test_lora_delta_matches_formula(rows, per_row, d_in, widths, max_rank, num_slots, dtype, data):
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = torch.randn(rows * per_row, d_in, generator=gen).to(dtype)
    members = draw_members(data, gen, d_in, widths, max_rank, num_slots, dtype)
    meta = BatchInfo(*batch_info(torch.tensor(slots, dtype=torch.int32), x, 1, num_slots))
    bases = [F.linear(x, w, b) for w, b, _ in members]
    ys = [y.clone() for y in bases]
    joint = multi_slice([f for _, _, f in members])
    assert lora_delta(x, ys, joint, meta, lora_workspace(x, joint.lora_a)) is None
    base_rows = meta.token_slot < 0
    for y, base, (w, b, f) in zip(ys, bases, members, strict=True):
        expected = per_token(x, w, b, *f, meta.token_slot)
        torch.testing.assert_close(y.float(), expected, **TOL[dtype])
        assert torch.equal(y[base_rows], base[base_rows])  # no-adapter rows: untouched, bit for bit


def test_lora_delta_writes_outputs_it_cannot_view_as_rows():
    """An output whose rows are not one view (a transposed result) still gets the delta."""
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(gen, 6, 5, 4, 2, [2, 1], [0, -1, 1], torch.float32)
    x = x.view(3, 2, 5)
    meta = batch_info(slot_ids, x, 1, 2)
    y = F.linear(x, w, b).transpose(0, 1).contiguous().transpose(0, 1)  # (3, 2, 4), not viewable as (6, 4)
    with pytest.raises(RuntimeError):
        y.view(-1, 4)
    lora_delta(x, [y], [a, bb, scaling, rank], meta, lora_workspace(x, a))
    expected = per_token(x.view(6, 5), w, b, a, bb, scaling, rank, meta[0]).view(3, 2, 4)
    torch.testing.assert_close(y, expected, **TOL[torch.float32])


def test_lora_delta_refuses_an_output_of_other_rows():
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(gen, 6, 5, 4, 2, [2, 1], [0, 1], torch.float32)
    y = torch.zeros(5, 4)
    with pytest.raises(ValueError, match=r"output 0 has shape \(5, 4\), but the input's leading shape is \(6,\)"):
        lora_delta(x, [y], [a, bb, scaling, rank], batch_info(slot_ids, x, 1, 2), lora_workspace(x, a))


def op_args(leading=(2, 3)):
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(gen, 6, 5, 3, 2, [2, 1], [0, 1], torch.float32)
    x = x.view(*leading, 5)
    joint = [torch.cat([a, a], 1), torch.cat([bb, bb[:, :2]], 1), scaling.repeat_interleave(2), rank.repeat_interleave(2)]
    ys = [F.linear(x, w, b), F.linear(x, w[:2])]
    return x, ys, joint, list(batch_info(slot_ids, x, 1, 2)), lora_workspace(x, joint[0])


def test_lora_delta_schema_fake_and_functionalization():
    torch.library.opcheck(
        torch.ops.fxlora.lora_delta.default,
        op_args(),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"),
    )
    schema = torch.ops.fxlora.lora_delta.default._schema
    assert schema.is_mutable and [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == [
        "outputs",
        "workspace",
    ]


def test_inductor_compiles_a_graph_with_lora_delta():
    """Inductor (CPU) functionalizes the in-place op: users of the outputs read the sums."""
    x, ys, joint, batch, _ = op_args()
    w = torch.randn(3, 5)

    def step(x, w, slot_ids):
        y = x @ w.T  # not F.linear: the delta goes onto any base
        z = torch.relu(x[..., :2])
        lora_delta(x, [y, z], joint, list(batch_info(slot_ids, x, 1, 2)), lora_workspace(x, joint[0]))
        return torch.tanh(y) + z[..., :1]

    slot_ids = torch.tensor([1, -1], dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x, w, slot_ids), step(x, w, slot_ids), rtol=1e-5, atol=1e-6)
    no_rows = torch.full((2,), -1, dtype=torch.int32)  # Inductor's own kernels round as they do: not bit for bit
    torch.testing.assert_close(compiled(x, w, no_rows), torch.tanh(x @ w.T) + torch.relu(x[..., :1]), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(sgmv is None, reason="needs Triton")
@pytest.mark.parametrize("per_row, max_rank", [(1, 16), (12, 32)], ids=["per_token_expand", "segmented_expand"])
@given(
    rows=st.integers(3, 5),
    widths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    data=st.data(),
)
def test_triton_implementation_matches_the_reference(per_row, max_rank, rows, widths, dtype, data):
    from fxlora.kernels import bgmv
    from fxlora.ops.lora_delta import lora_delta_triton

    assert bgmv.serves(rows * per_row, max_rank) == (per_row == 1)
    num_slots, d_in = 3, 24
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = torch.randn(rows * per_row, d_in, generator=gen).to(dtype)
    members = draw_members(data, gen, d_in, widths, max_rank, num_slots, dtype)
    joint = multi_slice([f for _, _, f in members])
    meta = BatchInfo(*batch_info(torch.tensor(slots, dtype=torch.int32), x, 1, num_slots))
    bases = [F.linear(x, w, b) for w, b, _ in members]
    expected = [y.clone() for y in bases]
    lora_delta(x, expected, joint, meta, lora_workspace(x, joint.lora_a))  # on the host: the reference
    on = lambda ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    got = on(bases)
    lora_delta_triton(x.to(DEVICE), got, on(joint), on(meta), nan_workspace(x, joint.lora_a, device=DEVICE))
    base_rows = meta.token_slot < 0
    for out, ref, base in zip(got, expected, bases, strict=True):
        torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])
        assert torch.equal(out.cpu()[base_rows], base[base_rows])
