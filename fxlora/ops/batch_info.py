"""``fxlora::batch_info``: the prologue that turns per-row slot ids into per-token metadata.

Every LoRA op of a graph reads the same metadata, computed once per token layout:

- ``token_slot[T]``: the slot of each token (``-1``: no adapter);
- ``sorted_tokens[T]``: token indices grouped by slot (stable), no-adapter tokens last;
- ``seg_start[num_slots]``, ``seg_len[num_slots]``, ``seg_slot[num_slots]``: the segments:
  segment ``i``'s tokens lie at ``seg_start[i]`` in ``sorted_tokens`` and read slot
  ``seg_slot[i]``'s factors, in slot order. With no more slots than tokens, one entry per slot
  (empty for a slot not in the batch); with more slots than tokens (a pool larger than a
  decode batch), a compact list of the slots present, then empty entries, so that every
  non-empty segment lies in the first ``min(T, num_slots)`` entries: the kernels' grids have
  a row of programs per entry and read only those. The compact list takes twice as many
  small kernels to build. Either way the starts ascend from 0, which the SGMV kernels' search
  relies on, and an empty entry after the last segment starts where the no-adapter tokens
  begin, which is how the expand that stores (``sgmv.lora_expand(store=True)``) finds them.
  The list's length is the pool's, not the batch's, so that the op's output shapes never
  compare the token count with the slot count: a graph traced for one batch size serves
  every other.

That is the reference, a dozen or two small ATen kernels. On CUDA a batch of up to
``slot_sort.MAX_TOKENS`` tokens takes one Triton launch instead, which always builds the
compact list (:mod:`fxlora.kernels.slot_sort`).

All outputs have shapes fixed by the token count and the number of slots, never by which
adapters are present, so the prologue can be captured in a CUDA graph and replayed with
other assignments. ``row_dim`` says which leading dimension of ``tokens`` indexes the rows:
``0`` for a ``(B, S, ...)`` activation or its row-major ``(B*S, ...)`` flattening, ``1`` for a
time-major ``(S, B, ...)`` one (XLNet), whose tokens take their rows in turn.
"""

from __future__ import annotations

import math

import torch

from fxlora.errors import AdapterError
from fxlora.kernels import slot_sort


def _token_count(tokens: torch.Tensor, feature_dims: int) -> int:
    return math.prod(tokens.shape[: tokens.dim() - feature_dims])


@torch.library.custom_op("fxlora::batch_info", mutates_args=())
def batch_info(
    slot_ids: torch.Tensor, tokens: torch.Tensor, feature_dims: int, num_slots: int, row_dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` is only read for its shape: its leading ``dim - feature_dims`` dims index
    tokens, dimension ``row_dim`` of them the rows."""
    outer, per_row = _row_layout(slot_ids, tokens, feature_dims, row_dim)
    return token_segments(slot_ids, per_row, num_slots, outer, entries=num_slots)


def batch_info_triton(slot_ids: torch.Tensor, tokens: torch.Tensor, feature_dims: int, num_slots: int, row_dim: int = 0):
    """The CUDA implementation: :func:`fast_token_segments`."""
    outer, per_row = _row_layout(slot_ids, tokens, feature_dims, row_dim)
    if outer > 1:  # time-major rows: the one-launch sort takes rows in order, so the ATen path
        return token_segments(slot_ids, per_row, num_slots, outer, entries=num_slots)
    return fast_token_segments(slot_ids, per_row, num_slots, entries=num_slots)


def _row_layout(slot_ids: torch.Tensor, tokens: torch.Tensor, feature_dims: int, row_dim: int) -> tuple[int, int]:
    """``(outer, per_row)``: the tokens are ``outer`` runs of every row in turn, each row
    ``per_row`` consecutive tokens of a run; raises :class:`AdapterError` when their shape
    does not hold the batch's rows."""
    rows, count = slot_ids.numel(), _token_count(tokens, feature_dims)
    lead = tokens.shape[: tokens.dim() - feature_dims]
    outer = max(math.prod(lead[:row_dim]), 1)
    at_rows = lead[row_dim] if len(lead) >= 2 else None
    if rows == 0 or count % (rows * outer) or (at_rows is not None and at_rows != rows):
        found = f"{at_rows} rows" if at_rows is not None else f"{count} tokens, which do not split into {rows} rows"
        hint = (
            " (a LoRA target whose input one row shares with all, such as a position embedding, cannot differ per row)"
            if at_rows == 1
            else ""
        )
        raise AdapterError(f"adapter_names has {rows} entries but the batch has {found}{hint}")
    return outer, count // (rows * outer)


def token_segments(
    row_slot: torch.Tensor, per_row: int, num_slots: int, outer: int = 1, entries: int | None = None
) -> tuple[torch.Tensor, ...]:
    """``(token_slot, sorted_tokens, seg_start, seg_len, seg_slot)`` for ``per_row`` tokens in
    each row of ``row_slot`` (``-1``: no adapter), the rows ``outer`` times in turn, by ATen ops.
    ``entries``: the segment list's length (see :func:`segments`)."""
    token_slot = row_slot.to(torch.int32).repeat_interleave(per_row)
    if outer > 1:
        token_slot = token_slot.repeat(outer)
    return (token_slot, *segments(token_slot, num_slots, entries))


def fast_token_segments(
    row_slot: torch.Tensor, per_row: int, num_slots: int, entries: int | None = None
) -> tuple[torch.Tensor, ...]:
    """:func:`token_segments` in one Triton launch where one program holds the batch: for the
    Triton implementations of the ops."""
    if 0 < row_slot.numel() * per_row <= slot_sort.MAX_TOKENS:
        return slot_sort.slot_sort(row_slot, per_row, num_slots, entries)
    return token_segments(row_slot, per_row, num_slots, entries=entries)


def segments(
    token_slot: torch.Tensor, num_slots: int, entries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_tokens, seg_start, seg_len, seg_slot)`` of per-token slot ids (``-1``: none):
    :func:`slot_segments` where the pool has no more slots than there are tokens, else the
    compact list of :func:`compact_segments`, which takes twice as many small kernels. The
    list has ``entries`` entries (at least ``min(T, num_slots)``; by default that many):
    ``fxlora::batch_info`` asks for ``num_slots``, so that its length does not depend on the
    token count."""
    if num_slots > token_slot.numel():
        return compact_segments(token_slot, num_slots, entries)
    return slot_segments(token_slot, num_slots)


def slot_segments(
    token_slot: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_tokens, seg_start, seg_len, seg_slot)`` of per-token slot ids (``-1``: none),
    one segment per slot (see the module's docstring). On the device, with no host read."""
    key, sorted_tokens = _sort_by_slot(token_slot, num_slots)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=token_slot.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    seg_len = counts[:num_slots].contiguous()
    seg_start = (torch.cumsum(seg_len, 0, dtype=torch.int32) - seg_len).contiguous()
    seg_slot = torch.arange(num_slots, dtype=torch.int32, device=token_slot.device)
    return sorted_tokens.to(torch.int32), seg_start, seg_len, seg_slot


def _sort_by_slot(token_slot: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's sort key (its slot, ``num_slots`` for none) and the tokens in key order
    (stable)."""
    key = torch.where(token_slot < 0, num_slots, token_slot).to(torch.int64)
    return key, torch.argsort(key, stable=True)


if slot_sort is not None:
    batch_info.register_kernel("cuda")(batch_info_triton)


@batch_info.register_fake
def _(slot_ids, tokens, feature_dims, num_slots, row_dim=0):
    count = _token_count(tokens, feature_dims)
    i32 = dict(dtype=torch.int32, device=slot_ids.device)
    return (
        slot_ids.new_empty(count, **i32),
        slot_ids.new_empty(count, **i32),
        *(slot_ids.new_empty(num_slots, **i32) for _ in range(3)),
    )


def slot_groups(token_slot: torch.Tensor, rank: torch.Tensor):
    """``(slot, rank, token indices)`` for every slot present with a nonzero rank. Reads
    device values on the host: for the reference implementations only."""
    ranks = rank.tolist()
    for s in torch.unique(token_slot[token_slot >= 0]).tolist():
        if ranks[s]:
            yield s, ranks[s], (token_slot == s).nonzero().squeeze(1)


def compact_segments(
    token_slot: torch.Tensor, num_slots: int, entries: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_tokens, seg_start, seg_len, seg_slot)`` of per-token slot ids (``-1``: none):
    the tokens grouped by slot (stable, no-adapter tokens last) and one segment per slot
    present, then empty entries, in a list of ``entries`` (default ``min(T, num_slots)``; see
    the module's docstring). On the device, with no host read."""
    count, device = token_slot.numel(), token_slot.device
    entries = min(count, num_slots) if entries is None else entries
    key, sorted_tokens = _sort_by_slot(token_slot, num_slots)
    keys = key.index_select(0, sorted_tokens)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    seg = torch.cumsum(first, 0) - 1  # the segment of each sorted position
    covered = (keys < num_slots).sum()  # where the no-adapter tokens begin, and the empty entries
    # one entry more than the list: the no-adapter tokens' run, last, may fall past its end
    seg_start = covered.expand(entries + 1).clone()
    seg_start.scatter_reduce_(0, seg, torch.arange(count, device=device), "amin")
    seg_len = torch.zeros(entries + 1, dtype=torch.int32, device=device)
    seg_len.scatter_add_(0, seg, (keys < num_slots).to(torch.int32))  # no-adapter tokens form no segment
    seg_slot = torch.zeros(entries + 1, dtype=torch.int64, device=device).scatter_(0, seg, keys)
    seg_slot.clamp_(max=num_slots - 1)
    return (
        sorted_tokens.to(torch.int32),
        seg_start[:entries].to(torch.int32),
        seg_len[:entries],
        seg_slot[:entries].to(torch.int32),
    )
