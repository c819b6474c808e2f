"""fxlora::batch_info against its definition."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxlora import AdapterError
from fxlora.kernels import batch_info
from fxlora.kernels.batch_info import compact_segments


def check_segments(slots: list[int], sorted_tokens, seg_start, seg_len, seg_slot, num_slots: int) -> None:
    """The segment list's contract: ``min(T, num_slots)`` entries; each slot present in one
    non-empty segment, in slot order, holding its tokens in order; no-adapter tokens last."""
    entries = min(len(slots), num_slots)
    assert all(t.shape == (entries,) and t.dtype == torch.int32 for t in (seg_start, seg_len, seg_slot))
    assert sorted(sorted_tokens.tolist()) == list(range(len(slots)))
    busy = seg_len > 0
    assert seg_slot[busy].tolist() == sorted({s for s in slots if s >= 0})
    for start, length, slot in zip(seg_start[busy].tolist(), seg_len[busy].tolist(), seg_slot[busy].tolist()):
        assert sorted_tokens[start : start + length].tolist() == [t for t, s in enumerate(slots) if s == slot]  # stable
    covered = int(seg_len.sum())
    assert all(slots[t] == -1 for t in sorted_tokens[covered:].tolist())
    starts = seg_start.tolist()
    assert starts == sorted(starts) and max(starts, default=0) <= len(slots)  # the kernels' search relies on it


@given(
    rows=st.integers(1, 6),
    per_row=st.integers(1, 5),
    num_slots=st.integers(1, 40),
    data=st.data(),
    flat=st.booleans(),
)
def test_batch_info_groups_tokens_by_slot(rows, per_row, num_slots, data, flat):
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    slot_ids = torch.tensor(slots, dtype=torch.int32)
    tokens = torch.empty(rows * per_row, 7) if flat else torch.empty(rows, per_row, 7)
    token_slot, *segments = batch_info(slot_ids, tokens, 1, num_slots)
    assert token_slot.tolist() == [s for s in slots for _ in range(per_row)]
    check_segments(token_slot.tolist(), *segments, num_slots)


def test_batch_info_of_token_ids():
    out = batch_info(torch.tensor([1, -1], dtype=torch.int32), torch.zeros(2, 3, dtype=torch.long), 0, 2)
    assert out[0].tolist() == [1, 1, 1, -1, -1, -1]


@pytest.mark.parametrize("shape", [(3, 4, 8), (7, 8)])
def test_batch_info_rejects_rows_that_do_not_match(shape):
    with pytest.raises(AdapterError, match="adapter_names has 2 entries"):
        batch_info(torch.zeros(2, dtype=torch.int32), torch.empty(shape), 1, 4)


def test_batch_info_schema_and_fake():
    torch.library.opcheck(
        torch.ops.fxlora.batch_info.default,
        (torch.tensor([0, -1, 1], dtype=torch.int32), torch.empty(3, 2, 5), 1, 3),
        test_utils=("test_schema", "test_faketensor"),
    )


@given(st.lists(st.integers(-1, 40), min_size=1, max_size=50), st.integers(41, 600))
def test_compact_segments_of_a_large_pool(slots, num_slots):
    check_segments(slots, *compact_segments(torch.tensor(slots, dtype=torch.int32), num_slots), num_slots)
