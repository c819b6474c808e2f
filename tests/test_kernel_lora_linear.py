"""fxlora::lora_linear's reference against the LoRA formula written token by token."""

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fxlora.kernels import batch_info, lora_linear
from fxlora.kernels.lora_linear import lora_workspace

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def make_case(gen, tokens, d_in, d_out, max_rank, ranks, slots, dtype, bias=True):
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    lora_a, lora_b = r(len(ranks), max_rank, d_in) / d_in**0.5, r(len(ranks), d_out, max_rank)
    for s, rank in enumerate(ranks):  # the pool zero-pads beyond each slot's rank
        lora_a[s, rank:], lora_b[s, :, rank:] = 0, 0
    scaling = torch.rand(len(ranks), generator=gen) * 2
    rank = torch.tensor(ranks, dtype=torch.int32)
    x, w = r(tokens, d_in), r(d_out, d_in) / d_in**0.5
    b = r(d_out) if bias else None
    slot_ids = torch.tensor(slots, dtype=torch.int32)
    return x, w, b, lora_a, lora_b, scaling, rank, slot_ids


def per_token(x, w, b, lora_a, lora_b, scaling, rank, token_slot):
    out = F.linear(x, w, b).float()
    for t, s in enumerate(token_slot.tolist()):
        if s >= 0:
            r = int(rank[s])
            out[t] += scaling[s] * (lora_b[s, :, :r].float() @ (lora_a[s, :r].float() @ x[t].float()))
    return out


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
    meta = batch_info(slot_ids, x, 1, num_slots)
    out = lora_linear(x, w, b, a, bb, scaling, rank, *meta, lora_workspace(x, a))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), per_token(x, w, b, a, bb, scaling, rank, meta[0]), **TOL[dtype])
    base_rows = meta[0] < 0
    assert torch.equal(out[base_rows], F.linear(x, w, b)[base_rows])  # no-adapter rows: untouched


def test_lora_linear_keeps_leading_dims_and_fake():
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb, scaling, rank, slot_ids = make_case(gen, 6, 5, 3, 2, [2, 1], [0, 1], torch.float32)
    x = x.view(2, 3, 5)
    meta = batch_info(slot_ids, x, 1, 2)
    assert lora_linear(x, w, b, a, bb, scaling, rank, *meta, lora_workspace(x, a)).shape == (2, 3, 3)
    torch.library.opcheck(
        torch.ops.fxlora.lora_linear.default,
        (x, w, b, a, bb, scaling, rank, *meta, lora_workspace(x, a)),
        test_utils=("test_schema", "test_faketensor"),
    )
