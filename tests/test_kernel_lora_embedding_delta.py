"""fxlora::lora_embedding_delta against PEFT's embedding LoRA formula added onto a lookup's
output, on the CPU (the reference) and on CUDA (the Triton expand)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fxlora.ops import batch_info, lora_embedding_delta


def case(data, device="cpu"):
    """ids, a lookup's output, the factors, the rows' slots and the expected sum."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    rows, per_row, vocab, dim = (data.draw(st.integers(1, n)) for n in (4, 5, 30, 16))
    num_slots, max_rank = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    y = torch.randn(rows, per_row, dim, generator=gen)
    lora_a = torch.randn(num_slots, max_rank, vocab, generator=gen)
    lora_b = torch.randn(num_slots, dim, max_rank, generator=gen)
    for s, r in enumerate(ranks):
        lora_a[s, r:], lora_b[s, :, r:] = 0, 0
    scaling, rank = torch.rand(num_slots, generator=gen), torch.tensor(ranks, dtype=torch.int32)
    ids = torch.randint(0, vocab, (rows, per_row), generator=gen)
    expected = y.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            r = ranks[s]
            expected[i] += (F.embedding(ids[i], lora_a[s, :r].T) @ lora_b[s, :, :r].T) * scaling[s]
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    ids, y, slot_ids = on(ids, y, torch.tensor(slots, dtype=torch.int32))
    return ids, y, on(lora_a, lora_b, scaling, rank), batch_info(slot_ids, ids, 0, num_slots), expected


@given(data=st.data())
def test_lora_embedding_delta_matches_formula(data):
    ids, y, lora, meta, expected = case(data)
    before = y.clone()
    out = lora_embedding_delta(ids, y, lora, meta)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, before)  # a new tensor: the op's input is left as it was


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_lora_embedding_delta_on_cuda(data):
    ids, y, lora, meta, expected = case(data, "cuda")
    torch.testing.assert_close(lora_embedding_delta(ids, y, lora, meta).cpu(), expected, rtol=1e-4, atol=1e-4)


def test_lora_embedding_delta_fake():
    ids = torch.tensor([[1, 2], [0, 3]])
    meta = list(batch_info(torch.tensor([0, -1], dtype=torch.int32), ids, 0, 1))
    lora = [torch.randn(1, 2, 4), torch.randn(1, 3, 2), torch.ones(1), torch.tensor([2], dtype=torch.int32)]
    args = (ids, torch.randn(2, 2, 3), lora, meta)
    torch.library.opcheck(torch.ops.fxlora.lora_embedding_delta.default, args, test_utils=("test_schema", "test_faketensor"))
