"""Which requests run: admission into the running batch, and what ends.

The scheduler keeps the waiting requests in arrival order and the running ones in the rows of
the batch. At each of the engine's decision points it ends what finished (returning its
KV-cache blocks and its adapter's pin) and admits waiting requests while a row is free, the
blocks their longest outcome needs can be promised, and the prefill stays within its token
budget (the first request is admitted whatever its length). Admission resolves the request's
adapter to a pool slot and pins it until the request ends, so an adapter unloaded meanwhile
keeps serving the requests admitted with it; a request whose adapter is gone fails alone.
Requests are admitted in order: one that waits for blocks holds back those behind it, so no
request waits longer than the running ones take to free what it needs. The scheduler knows
adapters: a request whose adapter is not in a GPU slot gets one (a free slot, else the least
recently used one no running request reads; the copy overlaps the running decode), and when
every slot is read by running requests, the requests behind it whose adapters are in slots may
go first, for a bounded number of turns. Meanwhile one slot drains for it: the one whose
running readers end soonest (by the new tokens they may still make) admits no new reader, so
that it comes free for the waiting request, not only once every slot's readers happen to end
together.
"""

from __future__ import annotations

from collections import deque

from fxlora.adapters import NO_ADAPTER, AdapterPool
from fxlora.errors import AdapterError, NoFreeSlot
from fxlora.runtime.block_allocator import BlockAllocator, blocks_for
from fxlora.runtime.sequence import Sequence, Status

# turns a request whose adapter finds no free GPU slot may be passed over by requests whose
# adapters are in slots (each turn a window of decode steps): its wait stays bounded
ADAPTER_PASSES = 32


class Scheduler:
    def __init__(self, allocator: BlockAllocator, pool: AdapterPool, max_rows: int, max_prefill_tokens: int):
        self.allocator, self.pool = allocator, pool
        self.max_rows, self.max_prefill_tokens = max_rows, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in the order of the batch's rows

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def admit(self, copy_stream: object = None) -> tuple[list[Sequence], list[Sequence]]:
        """The waiting requests that join the batch now, and those that failed on admission
        (their adapter no longer loaded). A request whose adapter has no GPU slot gets one
        (its copy issued on ``copy_stream``); when every slot is read by running requests it
        is passed over, for the requests behind it whose adapters are in slots, at most
        :data:`ADAPTER_PASSES` turns, after which nothing behind it starts before it."""
        admitted: list[Sequence] = []
        failed: list[Sequence] = []
        passed: list[Sequence] = []
        try:
            self._admit(copy_stream, admitted, failed, passed)
        finally:  # whatever happened, every request is waiting, running or ended
            self.waiting.extendleft(reversed(passed))  # back at the front, in their order
            self.running += admitted
        return admitted, failed

    def _admit(self, copy_stream: object, admitted: list[Sequence], failed: list[Sequence], passed: list[Sequence]) -> None:
        tokens = 0
        draining = None  # the adapter whose slot admits no new reader, for a request waiting for a slot
        while self.waiting and len(self.running) + len(admitted) < self.max_rows:
            seq = self.waiting[0]
            need = blocks_for(seq.max_length, self.allocator.block_size)
            if admitted and tokens + len(seq.prompt_ids) > self.max_prefill_tokens:
                break
            if not self.allocator.can_promise(need):
                break
            self.waiting.popleft()
            if draining is not None and seq.adapter_name == draining:  # its slot drains: it waits, uncounted
                passed.append(seq)  # (the slot's readers end within their budgets; then it pages in as any other)
                continue
            try:
                (seq.slot,), _ = self.pool.acquire([seq.adapter_name], stream=copy_stream, timeout=0, owner=self)
            except NoFreeSlot:  # every slot is read by running requests
                draining = draining or self._soonest_free(admitted)
                if seq.passes >= ADAPTER_PASSES:
                    self.waiting.appendleft(seq)
                    break  # its wait is over: the requests behind it wait for it
                seq.passes += 1
                passed.append(seq)
                continue
            except Exception as e:  # noqa: BLE001 - it fails alone (its adapter gone, unreadable), naming why
                seq.finish("error", f"request {seq.request_id!r}: {type(e).__name__}: {e}" if not isinstance(e, AdapterError)
                           else f"request {seq.request_id!r}: {e}")  # fmt: skip
                failed.append(seq)
                continue
            self.allocator.promise(need)
            seq.reserved, seq.status = need, Status.RUNNING
            tokens += len(seq.prompt_ids)
            admitted.append(seq)

    def _soonest_free(self, admitted: list[Sequence]) -> str | None:
        """The adapter whose running readers may end soonest: the fewest new tokens the
        longest of them may still make (a reader admitted this turn, its whole budget)."""
        left: dict[str, int] = {}
        for seq in (*self.running, *admitted):
            if seq.slot not in (None, NO_ADAPTER):
                budget = seq.decoding.max_new_tokens - len(seq.generated) - seq.unread
                left[seq.adapter_name] = max(left.get(seq.adapter_name, 0), budget)
        return min(left, key=left.__getitem__) if left else None

    def cancel_waiting(self, request_ids: set[str]) -> list[Sequence]:
        """End the waiting requests of ``request_ids`` now."""
        ended = [seq for seq in self.waiting if seq.request_id in request_ids]
        for seq in ended:
            self.waiting.remove(seq)
            seq.finish("cancelled")
        return ended

    def grow(self, seq: Sequence, tokens: int) -> list[tuple[int, int]]:
        """Blocks for ``seq`` to hold ``tokens`` tokens (at most its longest outcome), taken
        from its promise; returns the new ``(index, block)`` entries of its block table."""
        new = []
        while len(seq.blocks) * self.allocator.block_size < min(tokens, seq.max_length):
            seq.blocks.append(self.allocator.take())
            seq.reserved -= 1
            new.append((len(seq.blocks) - 1, seq.blocks[-1]))
        return new

    def retire(self, seq: Sequence) -> None:
        """``seq`` ended: its blocks, its promise and its adapter's pin go back."""
        if seq in self.running:
            self.running.remove(seq)
        self.allocator.release(seq.blocks, seq.reserved)
        seq.blocks, seq.reserved = [], 0
        if seq.slot is not None:
            self.pool.release([seq.slot], owner=self)  # whichever thread turns the engine
            seq.slot = None

    def fail_waiting(self, reason: str, error: str | None = None) -> list[Sequence]:
        """End every waiting request (the engine is stopping, or broke)."""
        ended = list(self.waiting)
        self.waiting.clear()
        for seq in ended:
            seq.finish(reason, error)
        return ended

    @property
    def uses_adapters(self) -> bool:
        return any(seq.slot not in (None, NO_ADAPTER) for seq in self.running)
