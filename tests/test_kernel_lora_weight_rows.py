"""fxlora::lora_weight_rows against PEFT's delta of a 3-D parameter: each row's copy is the
weight plus its adapter's ``scaling · B[e] @ A[e]`` (transposed where the module is), the weight
itself for rows without one; on the CPU and on CUDA (the same ATen code)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxlora.ops import batch_info, lora_weight_rows


def check(data, device):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    rows, experts, d1, d2 = (data.draw(st.integers(1, n)) for n in (5, 3, 4, 6))
    num_slots, max_rank, transposed = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.booleans())
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    fin, fout = (d1, d2) if transposed else (d2, d1)
    weight = torch.randn(experts, d1, d2, generator=gen)
    lora_a = torch.randn(num_slots, experts, max_rank, fin, generator=gen)  # past a slot's rank: left as noise
    lora_b = torch.randn(num_slots, experts, fout, max_rank, generator=gen)
    scaling, rank = torch.rand(num_slots, generator=gen), torch.tensor(ranks, dtype=torch.int32)
    expected = weight.expand(rows, -1, -1, -1).clone()
    for i, s in enumerate(slots):
        if s >= 0:
            delta = (lora_b[s, :, :, : ranks[s]] @ lora_a[s, :, : ranks[s]]) * scaling[s]
            expected[i] += delta.transpose(-1, -2) if transposed else delta
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    ids, slot_ids = torch.zeros(rows, 3, dtype=torch.long, device=device), torch.tensor(slots, dtype=torch.int32, device=device)
    out = lora_weight_rows(weight.to(device), on(lora_a, lora_b, scaling, rank), list(batch_info(slot_ids, ids, 1, num_slots)), transposed)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.equal(out[i].cpu(), weight)  # no adapter: the weight bit for bit


@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_lora_weight_rows_matches_peft(data):
    check(data, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@given(data=st.data())
@settings(max_examples=20, deadline=None)
def test_lora_weight_rows_on_cuda(data):
    check(data, "cuda")
