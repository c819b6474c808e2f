"""The request stream's loop: decode a window, read the last one, end, admit, prefill, emit.

:meth:`Engine.step` is one turn. It takes the requests added and cancelled since the last
turn and ends what was cancelled; issues a window of decode steps over every running row (a
few steps back to back, no read between them); while they run, reads what the previous
turn's window and prefill made (tokens, and which rows ended), ends those rows and closes the
gaps they leave so the batch stays in its smallest bucket; then admits waiting requests into
the free rows (:class:`Scheduler`) and prefills them. All of it is issued on one stream, so the
device runs it in that order while the host is one turn behind. A turn holds the backend's
lock, so calls of the compiled model from other threads run between turns; the caller hands
the turn's events on, then :meth:`Engine.forget` frees the ended requests' ids. The engine only
coordinates: the scheduler decides who runs, the runner runs them.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from fxlora.adapters import AdapterPool
from fxlora.runtime.pending import Pending
from fxlora.runtime.plan import Plan
from fxlora.runtime.runner import StreamRunner
from fxlora.runtime.scheduler import Scheduler
from fxlora.runtime.sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """A request's news from one turn: new tokens (for a streaming request), or its end."""

    seq: Sequence
    finished: bool


class Engine:
    def __init__(
        self, runner: StreamRunner, pool: AdapterPool, lock: threading.RLock, max_prefill_tokens: int, group: object = None
    ):
        """``group``: the ranks of a tensor-parallel model, whose turns follow rank 0's plan."""
        self.runner, self.lock, self.group = runner, lock, group
        self._plan_group = _host_group(group)
        self.stopped = False
        # adapters paged into GPU slots are copied on a stream of their own, beside the decode
        self._copies = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        self.scheduler = Scheduler(runner.cache.allocator, pool, runner.max_rows, max_prefill_tokens)
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._cancelled: queue.SimpleQueue[Sequence] = queue.SimpleQueue()  # the requests, not their ids
        self._window: tuple[Pending, list[Sequence], int] | None = None  # the last window: its tokens, rows, steps
        self._first: tuple[Pending, list[Sequence]] | None = None  # the last prefill: first tokens, requests
        self._known: dict[str, Sequence] = {}  # every request added and not yet ended
        self._known_lock = threading.Lock()
        self._ids = itertools.count()
        self._batches = itertools.count()
        self.driver = threading.Lock()  # held by whoever turns the engine: a serving loop, or generate_batch

    def new_id(self) -> str:
        """A request id no other request of this engine has had."""
        with self._known_lock:
            return f"req_{next(self._ids)}"

    def batch_ids(self, n: int) -> list[str]:
        """Ids for the ``n`` requests of one ``generate_batch`` call: counted by calls, so the same
        on every rank of a tensor-parallel model whatever requests rank 0 alone added."""
        with self._known_lock:
            batch = next(self._batches)
        return [f"batch{batch}_{i}" for i in range(n)]

    # -- from any thread -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        with self._known_lock:
            if seq.request_id in self._known:
                raise ValueError(f"request id {seq.request_id!r} is already in use by a request that has not ended")
            self._known[seq.request_id] = seq
        self._inbox.put(seq)

    def cancel(self, request_id: str) -> None:
        """Cancel ``request_id`` at the next turn; an id not in flight is ignored, and so is a
        request that has ended by then: a later request with its id is not cancelled."""
        with self._known_lock:
            seq = self._known.get(request_id)
        if seq is not None:
            self._cancelled.put(seq)

    def describe(self) -> list[str]:
        """Lines for ``explain()``: the stream's rows, its cache's blocks, its graphs."""
        r, allocator = self.runner, self.runner.cache.allocator
        graphs = r.graphs
        decode = sum(not isinstance(key[0], str) or key[0] != "prefill" for key in list(graphs.graphs))
        lines = [
            f"request stream: up to {r.max_rows} rows (batch buckets {r.buckets}), requests of up to {r.max_len} tokens, "
            f"{len(self.scheduler.running)} running and {len(self.scheduler.waiting)} waiting",
            f"paged KV cache: {allocator.num_blocks - 1} blocks of {allocator.block_size} tokens, {allocator.used} held, "
            f"{allocator.free} free",
        ]
        if graphs.graphs:
            lines.append(f"stream CUDA graphs: {decode} decode steps (variant x sampling x bucket) and "
                         f"{len(graphs.graphs) - decode} prefills, captured in {graphs.capture_seconds:.1f} s")  # fmt: skip
        else:
            lines.append(f"stream CUDA graphs: none, steps run eagerly ({graphs.fallback_reason or 'turned off'})")
        return lines

    def knows(self, request_id: str) -> bool:
        """Whether ``request_id`` is in flight (added and not ended)."""
        with self._known_lock:
            return request_id in self._known

    @property
    def has_work(self) -> bool:
        return bool(self._known)

    # -- one turn --------------------------------------------------------------------------
    @torch.no_grad()  # whatever the calling thread's mode: a serving loop's thread starts with grad on
    def step(self, stop: bool = False) -> list[Event]:
        """One turn. Its device work (a window of decode steps, then the gaps closed and a
        prefill) is issued in that order on one stream, and the host reads the previous turn's
        window and prefill while this turn's window runs: decisions use what the host has read,
        and every change to a row's state is issued after the steps that read it."""
        events: list[Event] = []
        with self.lock:
            plan = self._plan(stop)
            self._take(plan, events)
            if plan.stop:
                self.stopped = True
                return events
            window = self._launch()
            self._read(events)
            self._admit(events)
            self._window = window
        return events

    def forget(self, events: list[Event]) -> None:
        """The ended requests of ``events`` were handed on: their ids are free again."""
        with self._known_lock:
            for event in events:
                if event.finished:
                    self._known.pop(event.seq.request_id, None)

    def fail_all(self, reason: str, error: str | None = None) -> list[Event]:
        """End every request in flight with ``reason`` (and ``error``): the loop broke, or is
        stopping."""
        with self.lock:
            ended = self.scheduler.fail_waiting(reason, error)
            while True:
                try:
                    ended.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for seq in list(self.scheduler.running):
                self.scheduler.retire(seq)
                ended.append(seq)
            self._window = self._first = None
            for seq in ended:
                if seq.status is not Status.FINISHED:
                    seq.finish(reason, error)
            events = [Event(seq, True) for seq in ended]  # before any device work, which may fail after a device error
            try:
                self.runner.stop(list(range(self.runner.max_rows)))
            except Exception:  # noqa: BLE001 - the requests have their ends; the device state is moot
                log.exception("could not stop the rows on the device")
        return events

    def _plan(self, stop: bool) -> Plan:
        """What this turn takes in: the requests added and cancelled since the last one, and
        whether to stop; under tensor parallelism, rank 0's, on every rank."""
        plan = Plan(stop=stop)
        while True:
            try:
                plan.added.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        with self._known_lock:
            while True:
                try:
                    seq = self._cancelled.get_nowait()
                except queue.Empty:
                    break
                if self._known.get(seq.request_id) is seq:
                    plan.cancelled.add(seq.request_id)
        if self.group is None:
            return plan
        shared = plan.broadcast(self._plan_group)
        with self._known_lock:  # this rank's own requests give way to rank 0's, id for id
            for seq in shared.added:
                self._known[seq.request_id] = seq
        return shared

    def _take(self, plan: Plan, events: list[Event]) -> None:
        for seq in plan.added:
            self.scheduler.add(seq)
        if not plan.cancelled:
            return
        events += [Event(seq, True) for seq in self.scheduler.cancel_waiting(plan.cancelled)]
        ended = [seq for seq in self.scheduler.running if seq.request_id in plan.cancelled]
        self.runner.stop([seq.row for seq in ended])
        for seq in ended:
            seq.finish("cancelled")
        self._end(ended, events)

    def _launch(self) -> tuple[Pending, list[Sequence], int] | None:
        """Issue a window of decode steps over the running rows: as many steps as the one with
        the most tokens left may still make (at most the runner's window), with blocks for
        every column it may write."""
        running = self.scheduler.running
        if not running:
            return None
        steps = min(self.runner.window, max(s.decoding.max_new_tokens - len(s.generated) - s.unread for s in running))
        if steps < 1:  # every row made its last token: the host has yet to read them
            return None
        entries = []
        for seq in running:
            entries += [(seq.row, i, block) for i, block in self.scheduler.grow(seq, seq.length + seq.unread + steps)]
        self.runner.extend_blocks(entries)
        sampling = any(s.decoding.do_sample for s in running)
        pending = self.runner.decode(len(running), steps, self.scheduler.uses_adapters, sampling)
        for seq in running:
            seq.unread += steps
        return pending, list(running), steps

    def _read(self, events: list[Event]) -> None:
        """What the previous turn's window and prefill made: tokens, and which rows ended."""
        ended: list[Sequence] = []
        if self._window is not None:
            pending, seqs, steps = self._window
            values = pending.get()
            tokens, live = values[:-1].T.tolist(), values[-1].tolist()
            for seq, new, still in zip(seqs, tokens, live):
                seq.unread -= steps
                if seq.status is Status.FINISHED:  # cancelled meanwhile: what it made since is dropped
                    continue
                new = [t for t in new if t >= 0]
                seq.generated += new
                if not still:
                    last = seq.generated[-1]
                    stop = last in seq.decoding.eos_token_ids and len(seq.generated) > seq.decoding.min_new_tokens
                    seq.finish("stop" if stop else "length")
                    ended.append(seq)
                elif new and seq.streaming:
                    events.append(Event(seq, False))
        if self._first is not None:
            pending, seqs = self._first
            now = time.perf_counter()
            for seq, token in zip(seqs, pending.get()[0].tolist()):
                seq.unread -= 1
                if seq.status is Status.FINISHED:
                    continue
                seq.generated.append(token)  # before any window's tokens: the first window with it is read later
                seq.first_token_time = now
                if token in seq.decoding.eos_token_ids and seq.decoding.min_new_tokens < 1:
                    seq.finish("stop")
                elif seq.decoding.max_new_tokens <= 1:
                    seq.finish("length")
                if seq.status is Status.FINISHED:
                    ended.append(seq)
                elif seq.streaming:
                    events.append(Event(seq, False))
            self._first = None
        self._end(ended, events)

    def _admit(self, events: list[Event]) -> None:
        admitted, failed = self.scheduler.admit(self._copies)
        events += [Event(seq, True) for seq in failed]
        if not admitted:
            return
        first_row = len(self.scheduler.running) - len(admitted)
        rows = list(range(first_row, first_row + len(admitted)))
        for row, seq in zip(rows, admitted):
            seq.row, seq.unread = row, 1  # its first token, read next turn
            self.scheduler.grow(seq, len(seq.prompt_ids) + 1)
        if self._copies is not None:  # adapters paged in for them: their copies ran beside the window
            torch.cuda.current_stream(self.runner.device).wait_stream(self._copies)
        self.runner.place(rows, [s.decoding for s in admitted], [s.slot for s in admitted], [s.blocks for s in admitted])
        pending = self.runner.prefill(
            rows,
            [s.prompt_ids for s in admitted],
            [s.blocks for s in admitted],
            [s.slot for s in admitted],
            sampling=any(s.decoding.do_sample for s in admitted),
        )
        self._first = (pending, admitted)

    def _end(self, ended: list[Sequence], events: list[Event]) -> None:
        """Retire ended running requests and close the gaps in the batch's rows."""
        if not ended:
            return
        before = len(self.scheduler.running)
        for seq in ended:
            self.scheduler.retire(seq)
            seq.row = None
            events.append(Event(seq, True))
        sources, targets = [], []
        for i, seq in enumerate(self.scheduler.running):
            if seq.row != i:
                sources.append(seq.row)
                targets.append(i)
                seq.row = i
        self.runner.move(sources, targets)
        self.runner.stop(list(range(len(self.scheduler.running), before)))  # rows a moved one left


def _host_group(group: object) -> object:
    """``group``'s ranks with a host backend, for the plan: a plan sent over NCCL would make
    every turn wait for the device. Made on every rank, as the engine is."""
    if group is None:
        return None
    import torch.distributed as dist

    if dist.get_backend(group) != "nccl":
        return group
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")
