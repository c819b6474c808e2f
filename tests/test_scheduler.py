"""The scheduler's admission with adapters: when every GPU slot is read by running requests, a
request waiting for one passes the turn to requests whose adapters are in slots, and the slot
whose readers end soonest admits no new reader, so that it comes free for the waiting request;
over drawn streams, no running request's slot is evicted and every request ends."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fxlora.errors import NoFreeSlot
from fxlora.runtime.block_allocator import BlockAllocator, blocks_for
from fxlora.runtime.scheduler import ADAPTER_PASSES, Scheduler
from fxlora.runtime.sequence import Decoding, Sequence


class Slots:
    """The scheduler's view of an adapter pool: ``count`` slots, each pinned by its readers; an
    adapter without a slot takes an unpinned one or raises :class:`NoFreeSlot`."""

    def __init__(self, count: int):
        self.count, self.slot_of, self.pins = count, {}, {}

    def acquire(self, names, stream=None, timeout=None, owner=None):
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

    def release(self, slots, owner=None):
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


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_drawn_streams_end_with_every_slot_kept_under_its_readers(data):
    """Drawn slots, rows, blocks and requests arriving over turns (each turn decodes a window):
    a running request's slot keeps its adapter to its end, a passed-over request is passed at
    most ADAPTER_PASSES turns, every request ends, and every block and pin comes back."""
    slots = Slots(data.draw(st.integers(1, 4), label="slots"))
    allocator = BlockAllocator(data.draw(st.integers(8, 64), label="blocks"), 4)
    scheduler = Scheduler(allocator, slots, max_rows=data.draw(st.integers(1, 6), label="rows"), max_prefill_tokens=24)
    adapters = [None, *(f"ad{i}" for i in range(data.draw(st.integers(1, 8), label="adapters")))]
    arrivals: dict[int, list[Sequence]] = {}
    for i in range(data.draw(st.integers(1, 30), label="requests")):
        prompt = [1] * data.draw(st.integers(1, 12))
        seq = Sequence(f"r{i}", prompt, data.draw(st.sampled_from(adapters)), Decoding(max_new_tokens=data.draw(st.integers(1, 20))), False)
        if blocks_for(seq.max_length, 4) <= allocator.free:  # (one that never fits is refused before it gets here)
            arrivals.setdefault(data.draw(st.integers(0, 10), label="arrival turn"), []).append(seq)
    window, ended, turn = data.draw(st.integers(1, 4), label="window"), [], 0
    while turn <= 10 or not scheduler.idle:
        assert turn < 2_000, "a request never ended"
        for seq in arrivals.get(turn, []):
            scheduler.add(seq)
        for seq in list(scheduler.running):  # a window of decode steps
            seq.generated += [7] * min(window, seq.decoding.max_new_tokens - len(seq.generated))
            scheduler.grow(seq, seq.length)
            if len(seq.generated) == seq.decoding.max_new_tokens:
                seq.finish("length")
                scheduler.retire(seq)
                ended.append(seq)
        admitted, failed = scheduler.admit()
        assert not failed
        for seq in admitted:  # its prefill makes its first token
            scheduler.grow(seq, seq.length + 1)
            seq.generated.append(7)
        for seq in scheduler.running:
            assert seq.adapter_name is None or slots.slot_of.get(seq.adapter_name) == seq.slot, "a read slot was evicted"
        assert all(seq.passes <= ADAPTER_PASSES for seq in scheduler.waiting)
        turn += 1
    assert len(ended) == sum(map(len, arrivals.values()))
    assert allocator.free == allocator.num_blocks - 1 and not any(slots.pins.values())
