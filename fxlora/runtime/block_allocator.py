"""The paged KV cache's blocks: which are free, and how many are promised.

Block 0 is never handed out: rows with nothing to write (padding, idle rows of a batch
bucket) write there. A sequence is admitted only when the blocks its longest outcome needs
(prompt plus every new token it may make) can be promised to it; it takes them one by one as
it grows and returns them all when it ends. So a running sequence never waits for a block,
and nothing is ever preempted. The allocator only counts: it never touches the device.
"""

from __future__ import annotations

from collections import deque

TRASH_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(1, num_blocks))
        self._promised = 0  # blocks promised to admitted sequences and not yet taken

    @property
    def free(self) -> int:
        """Blocks neither held nor promised."""
        return len(self._free) - self._promised

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def can_promise(self, blocks: int) -> bool:
        return blocks <= self.free

    def promise(self, blocks: int) -> None:
        if blocks > self.free:
            raise RuntimeError(f"cannot promise {blocks} KV-cache blocks: {self.free} are free")
        self._promised += blocks

    def take(self) -> int:
        """One promised block."""
        if self._promised < 1:
            raise RuntimeError("a KV-cache block was taken that was never promised")
        self._promised -= 1
        return self._free.popleft()

    def release(self, blocks: list[int], promised: int) -> None:
        """Return a sequence's ``blocks`` and the ``promised`` ones it did not take."""
        if promised > self._promised:
            raise RuntimeError("more KV-cache blocks returned as promised than were promised")
        self._promised -= promised
        self._free.extend(blocks)
