"""The host tier's memory: an adapter's factors copied into a few pinned byte buffers, laid
out so that a page-in copies them into the slots in few copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

PACK_BYTES = 8 << 20  # the host memory one pinned allocation of an adapter's factors holds at most
_ALIGN = 64


def packed_copies(groups: Sequence[Sequence[torch.Tensor]], allocate: Callable[[int], torch.Tensor]) -> list[list[torch.Tensor]]:
    """Copies of the tensors of ``groups`` as views of a few byte buffers from
    ``allocate(nbytes)``: each group's end to end in one buffer if it fits in one (a larger
    group's tensors are placed one by one), each buffer of at most :data:`PACK_BYTES` (but for
    one tensor larger than that).

    Pinning host memory is a driver call that page-locks it, and the driver takes such calls
    one at a time, across the processes of a host: an 8B model's 16 adapters pinned factor by
    factor (8,192 calls) took 1.2 s alone and 50 s with a second process pinning on the same
    host. PyTorch's pinned allocator rounds each allocation up to a power of two, so the
    buffers are filled first-fit from the largest piece down: all but the last are nearly full,
    and that one loses less than half of what it takes."""
    pieces: list[list[tuple[int, int]]] = []  # (group, tensor) runs, each kept end to end
    for g, group in enumerate(groups):
        run = [(g, t) for t in range(len(group))]
        pieces += [run] if _laid_out([group[t] for _, t in run])[1] <= PACK_BYTES else [[one] for one in run]
    layouts = [_laid_out([groups[g][t] for g, t in run]) for run in pieces]
    buffers: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(pieces)), key=lambda i: -layouts[i][1]):
        size = layouts[i][1]
        b = next((b for b, free in enumerate(room) if free >= size), None)
        if b is None:
            buffers.append([])
            room.append(PACK_BYTES)
            b = len(buffers) - 1
        buffers[b].append(i)
        room[b] -= size
    out: list[list[torch.Tensor]] = [[None] * len(group) for group in groups]  # type: ignore[list-item]
    for members in buffers:
        buffer = allocate(sum(layouts[i][1] for i in members))
        start = 0
        for i in members:
            for (g, t), offset in zip(pieces[i], layouts[i][0]):
                x = groups[g][t]
                out[g][t] = buffer[start + offset : start + offset + x.nbytes].view(x.dtype).view(x.shape).copy_(x)
            start += layouts[i][1]
    return out


def _laid_out(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of ``tensors`` placed end to end, each aligned to its dtype, and the bytes
    they span rounded up to ``_ALIGN``."""
    end, offsets = 0, []
    for t in tensors:
        end = -(-end // t.element_size()) * t.element_size()
        offsets.append(end)
        end += t.nbytes
    return offsets, -(-end // _ALIGN) * _ALIGN


def pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

