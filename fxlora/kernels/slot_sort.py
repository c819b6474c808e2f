"""``fxlora::batch_info``'s work in one Triton program: token slots from row slots, the tokens
sorted by slot (stable) and the compact segment list (see :mod:`fxlora.ops.batch_info`
for the outputs' contract; its ATen ops are the reference).

The program holds the whole batch in one block of ``BLOCK`` positions:

- each token's key is its slot, ``num_slots`` for no adapter, ``num_slots + 1`` for padding;
- ``tl.sort`` of ``key · BLOCK + position`` (distinct values, so the sort is stable) gives
  ``sorted_tokens``;
- a position starts a run where its key differs from its left neighbour's and ends one where
  it differs from its right neighbour's (``tl.gather``); a running max of the run starts gives
  every position its run's start, and a cumulative count of starts its run's index;
- the last position of every run of a slot writes that run's segment.

The runs of slots come first, in slot order; the list's entries past them are empty: length
0, starting where the no-adapter tokens begin, so that the starts ascend from 0 however many
tokens have an adapter, as the SGMV kernels' search requires.

At decode sizes that is one launch where the ATen ops take a dozen or two small kernels, an
order of magnitude faster; at :data:`MAX_TOKENS` one program's sort still beats them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxlora.kernels.launch_table import next_power_of_2

#: the most tokens one program sorts; larger batches take the ATen ops
MAX_TOKENS = 2048
#: the fewest positions a program holds: every batch of up to this many tokens shares one
#: compilation (the smallest batches sort 64 keys where 16 would do: a few more compare steps)
MIN_BLOCK = 64


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["T"])
def _slot_sort_kernel(
    row_slot, token_slot, sorted_tokens, seg_start, seg_len, seg_slot, T, num_slots, per_row, entries,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pos = tl.arange(0, BLOCK)
    real = pos < T
    slot = tl.load(row_slot + pos // per_row, mask=real, other=-1).to(tl.int32)
    tl.store(token_slot + pos, slot, mask=real)
    key = tl.where(real, tl.where(slot < 0, num_slots, slot), num_slots + 1)
    packed = tl.sort(key.to(tl.int64) * BLOCK + pos)
    key = (packed // BLOCK).to(tl.int32)
    tl.store(sorted_tokens + pos, (packed % BLOCK).to(tl.int32), mask=real)
    first = (pos == 0) | (key != tl.gather(key, tl.maximum(pos - 1, 0), 0))
    last = (pos == BLOCK - 1) | (key != tl.gather(key, tl.minimum(pos + 1, BLOCK - 1), 0))
    run = tl.cumsum(first.to(tl.int32), 0) - 1
    run_start = tl.associative_scan(tl.where(first, pos, 0), 0, _max)
    ends = last & (key < num_slots)  # runs of no adapter and of padding form no segment
    tl.store(seg_start + run, run_start, mask=ends)
    tl.store(seg_len + run, pos + 1 - run_start, mask=ends)
    tl.store(seg_slot + run, key, mask=ends)
    busy = tl.sum((first & (key < num_slots)).to(tl.int32), 0)
    covered = tl.sum((key < num_slots).to(tl.int32), 0)  # where the no-adapter tokens begin
    for first_entry in range(0, entries, BLOCK):  # a list longer than the block: the rest is empty
        entry = first_entry + pos
        empty = (entry >= busy) & (entry < entries)
        tl.store(seg_start + entry, tl.zeros([BLOCK], tl.int32) + covered, mask=empty)
        tl.store(seg_len + entry, tl.zeros([BLOCK], tl.int32), mask=empty)
        tl.store(seg_slot + entry, tl.zeros([BLOCK], tl.int32), mask=empty)


def slot_sort(
    row_slot: torch.Tensor, per_row: int, num_slots: int, entries: int | None = None
) -> tuple[torch.Tensor, ...]:
    """``(token_slot, sorted_tokens, seg_start, seg_len, seg_slot)`` for ``per_row`` tokens in
    each row of ``row_slot`` (an integer tensor, ``-1``: no adapter), in one launch; at most
    :data:`MAX_TOKENS` tokens. The segment list has ``entries`` entries (default, and at
    least, ``min(T, num_slots)``)."""
    count = row_slot.numel() * per_row
    if not 0 < count <= MAX_TOKENS:
        raise ValueError(f"slot_sort takes 1 to {MAX_TOKENS} tokens, not {count}")
    fewest = min(count, num_slots)
    entries = fewest if entries is None else entries
    if entries < fewest:
        raise ValueError(f"a segment list of {entries} entries cannot hold {count} tokens of {num_slots} slots")
    i32 = dict(dtype=torch.int32, device=row_slot.device)
    out = [torch.empty(count, **i32), torch.empty(count, **i32)] + [torch.empty(entries, **i32) for _ in range(3)]
    block = max(MIN_BLOCK, next_power_of_2(count))
    warps = min(16, max(4, block // 128))  # the sort's work grows with the block: more warps past 512 tokens
    _slot_sort_kernel[(1,)](row_slot, *out, count, num_slots, per_row, entries, BLOCK=block, num_warps=warps)
    return tuple(out)
