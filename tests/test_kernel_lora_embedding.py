"""fxlora::lora_embedding's reference against PEFT's embedding LoRA formula."""

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fxlora.ops import batch_info, lora_embedding


@given(
    rows=st.integers(1, 4),
    per_row=st.integers(1, 5),
    vocab=st.integers(2, 30),
    dim=st.integers(1, 16),
    max_rank=st.integers(1, 6),
    num_slots=st.integers(1, 3),
    data=st.data(),
)
def test_lora_embedding_matches_formula(rows, per_row, vocab, dim, max_rank, num_slots, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    weight = torch.randn(vocab, dim, generator=gen)
    lora_a = torch.randn(num_slots, max_rank, vocab, generator=gen)
    lora_b = torch.randn(num_slots, dim, max_rank, generator=gen)
    for s, r in enumerate(ranks):
        lora_a[s, r:], lora_b[s, :, r:] = 0, 0
    scaling, rank = torch.rand(num_slots, generator=gen), torch.tensor(ranks, dtype=torch.int32)
    ids = torch.randint(0, vocab, (rows, per_row), generator=gen)
    meta = batch_info(torch.tensor(slots, dtype=torch.int32), ids, 0, num_slots)
    out = lora_embedding(ids, weight, [lora_a, lora_b, scaling, rank], meta)
    expected = F.embedding(ids, weight)
    for i, s in enumerate(slots):
        if s >= 0:
            r = ranks[s]
            expected[i] += (F.embedding(ids[i], lora_a[s, :r].T) @ lora_b[s, :, :r].T) * scaling[s]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_lora_embedding_fake():
    ids = torch.tensor([[1, 2], [0, 3]])
    meta = list(batch_info(torch.tensor([0, -1], dtype=torch.int32), ids, 0, 1))
    lora = [torch.randn(1, 2, 4), torch.randn(1, 3, 2), torch.ones(1), torch.tensor([2], dtype=torch.int32)]
    args = (ids, torch.randn(4, 3), lora, meta)
    torch.library.opcheck(torch.ops.fxlora.lora_embedding.default, args, test_utils=("test_schema", "test_faketensor"))
