"""fxlora::batch_info against its definition."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxlora import AdapterError
from fxlora.ops import batch_info
from fxlora.ops.batch_info import compact_segments, token_segments

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU, Triton's interpreter


def check_segments(
    slots: list[int], sorted_tokens, seg_start, seg_len, seg_slot, num_slots: int, entries: int | None = None
) -> None:
    """The segment list's contract: ``entries`` entries (``fxlora::batch_info``'s: ``num_slots``;
    by default ``min(T, num_slots)``), every non-empty one among the first ``min(T, num_slots)``
    that the kernels read; each slot present in one non-empty segment, in slot order, holding
    its tokens in order; no-adapter tokens last."""
    read = min(len(slots), num_slots)
    entries = read if entries is None else entries
    assert all(t.shape == (entries,) and t.dtype == torch.int32 for t in (seg_start, seg_len, seg_slot))
    assert sorted(sorted_tokens.tolist()) == list(range(len(slots)))
    assert not seg_len[read:].any()
    busy = seg_len > 0
    assert seg_slot[busy].tolist() == sorted({s for s in slots if s >= 0})
    for start, length, slot in zip(seg_start[busy].tolist(), seg_len[busy].tolist(), seg_slot[busy].tolist()):
        assert sorted_tokens[start : start + length].tolist() == [t for t, s in enumerate(slots) if s == slot]  # stable
    covered = int(seg_len.sum())
    assert all(slots[t] == -1 for t in sorted_tokens[covered:].tolist())
    starts = seg_start.tolist()
    assert starts == sorted(starts) and max(starts, default=0) <= len(slots)  # the kernels' search relies on it
    assert starts[:1] in ([0], [])  # ... and on the first starting at 0, with or without adapters
    last = max((i for i, n in enumerate(seg_len.tolist()) if n), default=-1)
    assert all(s == covered for s in starts[last + 1 :])  # the expand that stores finds the no-adapter tokens there


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
    check_segments(token_slot.tolist(), *segments, num_slots, entries=num_slots)


@given(
    rows=st.integers(1, 6),
    seq=st.integers(1, 5),
    num_slots=st.integers(1, 40),
    data=st.data(),
)
def test_batch_info_of_time_major_tokens(rows, seq, num_slots, data):
    """``(seq, batch, ...)`` tokens with ``row_dim=1``: position ``s`` of row ``b`` is token
    ``s · batch + b``, on every device's implementation (CUDA's one-launch sort takes rows in
    order, so these take the ATen path there)."""
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    slot_ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    tokens = torch.empty(seq, rows, 7, device=DEVICE)
    token_slot, *segments = batch_info(slot_ids, tokens, 1, num_slots, 1)
    assert token_slot.tolist() == [slots[b] for _ in range(seq) for b in range(rows)]
    check_segments(token_slot.tolist(), *(t.cpu() for t in segments), num_slots, entries=num_slots)
    if rows > 1 and seq != rows:
        with pytest.raises(AdapterError, match=f"adapter_names has {rows} entries but the batch has {seq} rows"):
            batch_info(slot_ids, tokens, 1, num_slots, 0)  # the first dimension is not the rows


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
    torch.library.opcheck(
        torch.ops.fxlora.batch_info.default,
        (torch.tensor([0, -1, 1], dtype=torch.int32), torch.empty(2, 3, 5), 1, 3, 1),
        test_utils=("test_schema", "test_faketensor"),
    )


@given(st.lists(st.integers(-1, 40), min_size=1, max_size=50), st.integers(41, 600), st.booleans())
def test_compact_segments_of_a_large_pool(slots, num_slots, one_per_slot):
    entries = num_slots if one_per_slot else None
    check_segments(slots, *compact_segments(torch.tensor(slots, dtype=torch.int32), num_slots, entries), num_slots, entries)


@given(
    rows=st.integers(1, 12),
    per_row=st.integers(1, 6),
    num_slots=st.integers(1, 40) | st.integers(41, 3000),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_slot_sort_matches_definition(rows, per_row, num_slots, dtype, data):
    """The one-launch Triton prologue, with pools smaller and larger than the batch, and a list
    of the fewest entries or of one per slot (``fxlora::batch_info``'s, longer than the block)."""
    slot_sort = pytest.importorskip("fxlora.kernels.slot_sort")
    top = data.draw(st.sampled_from([1, 3, num_slots]), label="distinct slots at most")
    slots = data.draw(st.lists(st.integers(-1, min(top, num_slots) - 1), min_size=rows, max_size=rows))
    entries = data.draw(st.sampled_from([None, num_slots]), label="entries")
    row_slot = torch.tensor(slots, dtype=dtype, device=DEVICE)
    token_slot, *segments = slot_sort.slot_sort(row_slot, per_row, num_slots, entries)
    assert token_slot.tolist() == [s for s in slots for _ in range(per_row)]
    check_segments(token_slot.tolist(), *(t.cpu() for t in segments), num_slots, entries)


def test_slot_sort_without_adapters():
    """No token with an adapter: a list of empty entries that still starts at 0."""
    slot_sort = pytest.importorskip("fxlora.kernels.slot_sort")
    out = slot_sort.slot_sort(torch.full((70,), -1, dtype=torch.int64, device=DEVICE), 1, 100)
    assert [t.tolist() for t in out] == [[-1] * 70, list(range(70)), [0] * 70, [0] * 70, [0] * 70]


def test_batches_of_up_to_64_tokens_share_the_sort_s_compilation(monkeypatch):
    """Every batch of up to ``MIN_BLOCK`` tokens launches the sort with the same block (and the
    token count, which differs, is not specialised): the decode buckets share one compilation."""
    slot_sort = pytest.importorskip("fxlora.kernels.slot_sort")
    blocks = []

    class Recorder:  # stands in for the jitted kernel: records the block it is given
        def __getitem__(self, grid):
            return lambda *args, **constexprs: blocks.append(constexprs["BLOCK"])

    monkeypatch.setattr(slot_sort, "_slot_sort_kernel", Recorder())
    for rows in (1, 2, 4, 8, 16, 32, 64):
        slot_sort.slot_sort(torch.zeros(rows, dtype=torch.int32), 1, 16)
    assert set(blocks) == {slot_sort.MIN_BLOCK}


def test_slot_sort_names_its_limit():
    slot_sort = pytest.importorskip("fxlora.kernels.slot_sort")
    with pytest.raises(ValueError, match=f"1 to {slot_sort.MAX_TOKENS} tokens, not {slot_sort.MAX_TOKENS + 1}"):
        slot_sort.slot_sort(torch.zeros(slot_sort.MAX_TOKENS + 1, dtype=torch.int32), 1, 4)
    with pytest.raises(ValueError, match="a segment list of 2 entries cannot hold 3 tokens of 4 slots"):
        slot_sort.slot_sort(torch.zeros(3, dtype=torch.int32), 1, 4, entries=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("count", [1, 64, 1000, 2048, 2049, 6000])
@pytest.mark.parametrize("num_slots", [16, 4096])
def test_batch_info_on_cuda(count, num_slots):
    """The op on CUDA: one launch up to ``MAX_TOKENS`` tokens, the ATen ops beyond."""
    slot_ids = torch.randint(-1, min(40, num_slots), (count,), dtype=torch.int32, device="cuda")
    token_slot, *segments = batch_info(slot_ids, torch.empty(count, 8, device="cuda"), 1, num_slots)
    assert torch.equal(token_slot, slot_ids)
    check_segments(slot_ids.tolist(), *(t.cpu() for t in segments), num_slots, entries=num_slots)
    reference = token_segments(slot_ids.cpu(), 1, num_slots, entries=num_slots)  # the ATen ops, on the CPU
    assert torch.equal(segments[0].cpu(), reference[1])
