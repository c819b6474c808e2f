"""The scheduler's admission with adapters: when every GPU slot is read by running requests, a
request waiting for one passes the turn to requests whose adapters are in slots, and the slot
whose readers end soonest admits no new reader, so that it comes free for the waiting request."""

from fxlora.errors import NoFreeSlot
from fxlora.runtime.block_allocator import BlockAllocator
from fxlora.runtime.scheduler import Scheduler
from fxlora.runtime.sequence import Decoding, Sequence


class Slots:
    """The scheduler's view of an adapter pool: ``count`` slots, each pinned by its readers; an
    adapter without a slot takes an unpinned one or raises :class:`NoFreeSlot`."""

    def __init__(self, count: int):
        self.count, self.slot_of, self.pins = count, {}, {}

    def acquire(self, names, stream=None, timeout=None):
        (name,) = names
        if name is None:
            return [-1], set()
        if name not in self.slot_of:
            free = [s for s in range(self.count) if not self.pins.get(s)]
            if not free:
                raise NoFreeSlot(f"adapter {name!r}: no free slot")
            self.slot_of = {n: s for n, s in self.slot_of.items() if s != free[0]}
            self.slot_of[name] = free[0]
        slot = self.slot_of[name]
        self.pins[slot] = self.pins.get(slot, 0) + 1
        return [slot], {name}

    def release(self, slots):
        for slot in slots:
            if slot >= 0:
                self.pins[slot] -= 1


def request(i: int, adapter: str | None, max_new: int = 8) -> Sequence:
    return Sequence(f"r{i}", [1, 2, 3], adapter, Decoding(max_new_tokens=max_new), streaming=False)


def test_the_slot_whose_readers_end_soonest_drains_for_a_waiting_request():
    scheduler = Scheduler(BlockAllocator(256, 16), Slots(2), max_rows=8, max_prefill_tokens=1000)
    short, long = request(0, "a", max_new=4), request(1, "b", max_new=64)
    for seq in (short, long):
        scheduler.add(seq)
    assert scheduler.admit() == ([short, long], [])
    waiting, more_a, more_b = request(2, "c"), request(3, "a"), request(4, "b")
    for seq in (waiting, more_a, more_b):
        scheduler.add(seq)
    admitted, _ = scheduler.admit()
    assert admitted == [more_b]  # "a" drains: its reader ends within 4 tokens, "b"'s in 64
    assert list(scheduler.waiting) == [waiting, more_a] and (waiting.passes, more_a.passes) == (1, 0)
    short.generated = [7] * 4
    short.finish("length")
    scheduler.retire(short)  # "a"'s slot is free: the waiting request takes it, then "a" waits for one
    admitted, _ = scheduler.admit()
    assert admitted == [waiting] and list(scheduler.waiting) == [more_a]


def test_a_request_passed_over_too_often_holds_back_those_behind_it():
    scheduler = Scheduler(BlockAllocator(256, 16), Slots(1), max_rows=8, max_prefill_tokens=1000)
    reader = request(0, "a", max_new=64)
    scheduler.add(reader)
    scheduler.admit()
    waiting = request(1, "b")
    waiting.passes = 32
    behind = request(2, None)
    scheduler.add(waiting)
    scheduler.add(behind)
    assert scheduler.admit() == ([], [])
    assert list(scheduler.waiting) == [waiting, behind]
