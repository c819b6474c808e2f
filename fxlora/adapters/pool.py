"""The adapter pool: every LoRA target's factors stacked into fixed slots.

For each target module the pool holds ``lora_a[slots, max_rank, in]``,
``lora_b[slots, out, max_rank]``, a float32 ``scaling[slots]`` and an int32 ``rank[slots]``,
allocated once (the linear targets of one layer that read inputs of one width as slices of
joint tensors, :class:`Stack`, so that neighbours can be served as one group). A slot whose
adapter does not touch the module has rank 0 and scaling 0; ranks below ``max_rank`` are
zero-padded. Slot id ``-1`` means "no adapter". Loading copies
into a free slot in place, so the tensors keep their addresses: compiled graphs read them
directly and never need a retrace or recapture. The slots are a cache over a host tier of
every registered adapter (pinned when the slots are on CUDA), paged in on demand.

The tensors are laid out in :mod:`fxlora.adapters.slots`, the host tier's buffers in
:mod:`fxlora.adapters.host_buffers`; what the pool knows of a module is a
:class:`~fxlora.adapters.modules.ModuleInfo`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import traceback
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import host_buffers, sharding
from fxlora.adapters.modules import ModuleInfo
from fxlora.adapters.peft_format import LoraAdapter, all_linear, all_linear_selects, selects_module
from fxlora.adapters.slots import PoolGroup, PoolTarget, Stack, TargetSet, block_outputs, layer_of, stack_key
from fxlora.errors import AdapterError, NoFreeSlot, NotServed, ShardingError

if TYPE_CHECKING:
    from peft import LoraConfig

log = logging.getLogger(__name__)

NO_ADAPTER = -1


@dataclass(frozen=True)
class _Dropped:
    """A module's LoRA the host tier dropped: read again from the adapter's source when needed."""

    kind: str
    rank: int


class AdapterPool:
    """Fixed slots of LoRA factors for a set of target modules.

    ``targets`` decides which modules get pool space: modules of the initially loaded
    adapters, plus those matching ``target_modules`` (PEFT matching rules, ``"all-linear"``
    included). A module's status is fixed once it is registered, since compiled graphs
    are built from it. When the module table is complete (built from the model) every
    adapter is checked against it on load; otherwise (a graph at a time, as under
    ``torch.compile``) modules are checked as graphs bring them in.
    """

    def __init__(
        self,
        max_loras: int | None = 8,
        max_rank: int = 64,
        target_modules: str | list[str] | None = None,
        output_embedding: str | None = "lm_head",
        max_cpu_loras: int | None = None,
        lora_memory: int | None = None,
    ):
        """``lora_memory``: bytes of GPU memory for the slots, in place of ``max_loras``: as many
        slots as fit, counted when the model's modules are registered (the targets known)."""
        if (max_loras is None) == (lora_memory is None):
            raise ValueError("give the pool's GPU slots as max_loras= or as lora_memory= (bytes), one of them")
        for arg, value in (("max_loras", max_loras), ("max_rank", max_rank), ("lora_memory", lora_memory)):
            if value is None and arg != "max_rank":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{arg} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{arg} must be positive, got {value}")
        self.lora_memory = lora_memory
        max_loras = max_loras or 0  # counted from lora_memory when the modules are registered
        if max_cpu_loras is not None and (isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int) or max_cpu_loras < 1):
            raise ValueError(f"max_cpu_loras must be an int >= 1 (or None: no bound), got {max_cpu_loras!r}")
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self._patterns: LoraConfig | None = None
        if target_modules:
            from peft import LoraConfig

            self._patterns = LoraConfig(target_modules=target_modules)
        self._output_embedding = output_embedding  # "all-linear" leaves it out, as PEFT does
        self.modules: dict[str, ModuleInfo] = {}
        self.targets: dict[str, PoolTarget] = {}
        self.groups: dict[tuple[str, ...], PoolGroup] = {}
        self._sets: list[TargetSet] = []  # the targets by layer (registration and device), written together
        self._set_of: dict[str, TargetSet] = {}  # each target's set
        self.complete = False
        self.adapters: dict[str, LoraAdapter] = {}  # every registered adapter, in registration order
        self.slot_of: dict[str, int] = {}  # the resident ones: their GPU slots
        # the host tier: adapters whose factors are in (pinned) host memory, least recently used
        # first; one beyond max_cpu_loras keeps only how to read it again (its directory)
        self.host: OrderedDict[str, None] = OrderedDict()
        self._reload: dict[str, Callable[[], LoraAdapter]] = {}
        self._used: Counter[int] = Counter()  # per slot, when last acquired (a clock): LRU
        self._clock = 0
        self.hits = self.misses = 0  # acquisitions that found their adapter resident, or paged it in
        # Calls in flight pin the slots they read: an adapter unloaded or evicted under one keeps
        # its slot's contents until the last such call ends, and no load takes that slot before.
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)
        self._pins: Counter[int] = Counter()  # per slot, the calls in flight reading it
        self._owned: defaultdict[object, Counter[int]] = defaultdict(Counter)  # per owner (a thread, the stream's scheduler), its pins
        self._draining: set[int] = set()
        self._fences: dict[int, torch.cuda.Event] = {}  # per slot, the last use on the default stream (CUDA)
        self._group_plans: dict[tuple, tuple] = {}  # see _group_plan

    # -- modules -------------------------------------------------------------------------
    def register_modules(self, modules: dict[str, ModuleInfo], complete: bool = False) -> None:
        """Add modules to the table and allot pool space to those that are wanted.

        Checks every loaded adapter against the new modules before changing anything."""
        with self._lock:
            self._register_modules(modules, complete)

    def _register_modules(self, modules: dict[str, ModuleInfo], complete: bool) -> None:
        new = {fqn: info for fqn, info in modules.items() if fqn not in self.modules}
        for fqn, info in new.items():
            if info.unshardable is not None and self.wants(fqn, info):
                raise ShardingError(
                    f"module {fqn!r} is targeted ({self.targeted_by([fqn])}), but {info.unshardable}: fxlora cannot split its LoRA"
                )
        for name, adapter in list(self.adapters.items()):
            if adapter.modules.keys() & new.keys():
                adapter = self._factors(name)
            for fqn in adapter.modules.keys() & new.keys():
                self._check_module(adapter, fqn, new[fqn])
            if complete:
                self._check_exists(adapter, self.modules.keys() | new.keys())
        wanted = {fqn: info for fqn, info in new.items() if self.wants(fqn, info)}
        sized = self.lora_memory is not None and not self.targets
        slots = self._slots_in_budget(wanted) if sized else self.max_loras
        sets = self._allocate(wanted, block_outputs(new), slots)  # before anything changes: it may not fit
        if sized:
            self.max_loras = slots
            log.info("%d GPU slots in lora_memory=%d bytes", slots, self.lora_memory)
        self.modules.update(new)
        self.complete = self.complete or complete
        made = {t.fqn: t for written in sets for t in written.targets}
        self.targets.update((fqn, made[fqn]) for fqn in wanted)
        for written in sets:
            self._sets.append(written)
            self._set_of.update(dict.fromkeys((t.fqn for t in written.targets), written))
            for name, slot in list(self.slot_of.items()):  # the resident adapters that touch them
                if any(t.fqn in self.adapters[name].modules for t in written.targets):
                    self._write(slot, self._factors(name), sets=[written])
        for name in self.host:  # adapters registered before their modules: in pinned memory now, if on CUDA
            self.adapters[name] = self._pinned(self.adapters[name])
        for name in list(self.adapters):  # and in the slots the memory budget gave, as many as fit
            slot = self._free_slot(evict=False) if name not in self.slot_of else None
            if slot is not None:
                self._place(name, slot)

    def _slot_bytes(self, wanted: dict[str, ModuleInfo]) -> int:
        """The bytes one slot takes over the modules ``wanted`` as targets."""
        per_slot = 0
        for info in wanted.values():
            size = torch.empty(0, dtype=info.dtype).element_size()
            per_slot += max(info.experts, 1) * self.max_rank * (info.in_features + info.out_features) * size + 8
        return per_slot

    def _slots_in_budget(self, wanted: dict[str, ModuleInfo]) -> int:
        """``max_loras`` from ``lora_memory``: as many slots as it holds over the targets."""
        per_slot = self._slot_bytes(wanted)
        slots = self.lora_memory // per_slot if per_slot else 0
        if slots < 1:
            raise AdapterError(
                f"lora_memory={self.lora_memory} bytes hold no slot: one takes {per_slot} bytes over the targets "
                f"at max_rank={self.max_rank}"
            )
        return slots

    def _allocate(self, wanted: dict[str, ModuleInfo], outputs: set[str], slots: int) -> list[TargetSet]:
        """The targets of the modules ``wanted``, with ``slots`` slots each, in sets by layer and
        device (``outputs``: the blocks' last linears, :func:`_outputs`); an AdapterError naming
        the setting if their memory cannot be had (and none of it kept)."""
        stacked: dict[tuple, list[tuple[str, ModuleInfo]]] = {}
        for fqn, info in sorted(wanted.items(), key=lambda item: item[0] in outputs):  # stable
            if (key := stack_key(fqn, info)) is not None:
                stacked.setdefault(key, []).append((fqn, info))

        def allocated() -> list[TargetSet]:
            stack_of = {}
            for members in stacked.values():
                stack = Stack.of(members, slots, self.max_rank)
                stack_of.update(dict.fromkeys(stack.fqns, stack))
            by_layer: dict[tuple, list[PoolTarget]] = {}
            for fqn, info in wanted.items():
                target = PoolTarget(fqn, info, slots, self.max_rank, stack_of.get(fqn))
                by_layer.setdefault((layer_of(fqn), info.device), []).append(target)
            return [TargetSet(targets, slots) for targets in by_layer.values()]

        try:
            return allocated()
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            traceback.clear_frames(e.__traceback__)  # what was allocated goes now, not when the error does
        per_slot = self._slot_bytes(wanted)
        setting = f"lora_memory={self.lora_memory}" if self.lora_memory is not None else f"max_loras={slots}"
        devices = ", ".join(sorted({str(info.device) for info in wanted.values()}))
        raise AdapterError(
            f"{setting}: {slots} slots of {per_slot} bytes over {len(wanted)} targets at max_rank={self.max_rank} "
            f"({slots * per_slot / 2**30:.1f} GiB on {devices}) could not be allocated ({reason}): lower it or max_rank"
        )

    def wants(self, fqn: str, info: ModuleInfo) -> bool:
        """Whether registering module ``fqn`` makes it a target: a loaded adapter touches it,
        or ``target_modules`` selects it."""
        return any(fqn in a.modules for a in self.adapters.values()) or self._wanted(fqn, info)

    def _wanted(self, fqn: str, info: ModuleInfo) -> bool:
        if self._patterns is None:
            return False
        targets = self._patterns.target_modules
        if all_linear(targets):  # linear modules, as PEFT's "all-linear" picks them by type
            return all_linear_selects(targets, info.kind, info.parameter, fqn == self._output_embedding)
        return selects_module(self._patterns, fqn)

    def _check_exists(self, adapter: LoraAdapter, modules: Iterable[str]) -> None:
        for fqn in adapter.modules.keys() - modules:
            raise AdapterError(
                f"adapter {adapter.name!r} ({adapter.source}): targets module {fqn!r}, which the model lacks "
                "(or which is not an nn.Linear, transformers Conv1D or nn.Embedding)"
            )

    def _check_module(self, adapter: LoraAdapter, fqn: str, info: ModuleInfo) -> None:
        f = adapter.modules[fqn]
        where = f"adapter {adapter.name!r} ({adapter.source}): module {fqn!r}"
        if f.kind != info.kind:
            raise AdapterError(f"{where}: the adapter has {f.kind} LoRA but the model's module is an {info.kind}")
        fin, fout = info.whole
        if f.kind == "experts":
            # a per-expert dimension, or 1: one factor shared by every expert
            fits = f.a.shape[0] in (1, info.all_experts) and f.b.shape[0] in (1, info.all_experts)
            want_a, want_b = (info.all_experts, f.rank, fin), (info.all_experts, fout, f.rank)
            fits = fits and f.a.shape[1:] == want_a[1:] and f.b.shape[1:] == want_b[1:]
        else:
            want_a, want_b = (f.rank, fin), (fout, f.rank)
            fits = tuple(f.a.shape) == want_a and tuple(f.b.shape) == want_b
        if not fits:
            raise AdapterError(
                f"{where}: shape mismatch: lora_A {tuple(f.a.shape)} and lora_B {tuple(f.b.shape)} do not fit the "
                f"model's {info.kind} ({fin} -> {fout}), which needs {want_a} and {want_b}"
            )
        base = adapter.base_weights.get(fqn)
        if base is not None and info.weight is not None:
            mine = sharding.local_tensor(info.weight)
            if is_traceable_wrapper_subclass(mine):  # a quantised weight (torchao's) cannot be told equal to a plain one
                raise AdapterError(
                    f"{where}: the adapter carries base weights {tuple(base.shape)} for it, and the model holds it quantised "
                    f"({type(mine).__name__}), which they cannot be compared with: save the adapter without them (PEFT's "
                    "save_embedding_layers=False)"
                )
            if base.shape == info.weight.shape and info.shard is not None:
                base = info.shard.local(base)
            elif base.shape == info.weight.shape and sharding.is_distributed(info.weight):  # an embedding split as traced
                base = sharding.local_part(base, info.weight)
            if base.shape != mine.shape or not torch.equal(base.to(mine), mine):
                raise AdapterError(
                    f"{where}: the adapter carries its own base weights {tuple(base.shape)} that differ from the "
                    f"model's {tuple(info.weight.shape)}: replacing base weights is not supported"
                )

    def join(self, fqns: Sequence[str]) -> PoolGroup:
        """The group of linear targets ``fqns`` (in this order), made on first request.
        Raises :class:`NotServed`, saying why, when they cannot be one: they are not neighbours
        of one :class:`Stack`, in its order."""
        with self._lock:  # a graph built during a call joins while loads may write
            key = tuple(fqns)
            if key not in self.groups:
                self.groups[key] = PoolGroup(self._neighbours(key), self._set_of[key[0]])
            return self.groups[key]

    def _neighbours(self, fqns: tuple[str, ...]) -> list[PoolTarget]:
        members = [self.targets[f] for f in fqns]
        keys = {stack_key(m.fqn, m.info) for m in members}
        if None in keys or len({key[1:] for key in keys}) > 1:
            raise NotServed("the modules differ in kind, input width, dtype or device")
        if len(keys) > 1:
            raise NotServed("they lie in different layers")
        if len({id(m.stack) for m in members}) > 1:
            raise NotServed("they were registered apart (from different graphs)")
        order = members[0].stack.fqns
        start = order.index(fqns[0])
        if order[start : start + len(fqns)] != fqns:
            raise NotServed(f"they are not neighbours in the pool's order ({', '.join(order)})")
        return members

    # -- adapters ------------------------------------------------------------------------
    def load(
        self, adapter: LoraAdapter, group: object | None = None, reload: Callable[[], LoraAdapter] | None = None
    ) -> int | None:
        """Register ``adapter``: checked against every module before anything changes, then held
        in the host tier, and copied into a GPU slot now if one is free (else when a call names
        it). With the process ``group`` of a tensor-parallel model, every rank registers it or
        none does. ``reload`` reads it again (from its directory) once the host tier had to drop
        its factors. Returns its slot, or None."""
        with self._lock:
            with sharding.one_outcome(group):
                self._check_load(adapter)
                adapter = self._pinned(adapter)
            name = adapter.name
            self.adapters[name] = adapter
            if reload is not None:
                self._reload[name] = reload
            self._keep_on_host(name)
            slot = self._free_slot(evict=False) if self.max_loras else None  # (no slots yet: sized with the modules)
            if slot is not None:
                self._place(name, slot)
        where = f"slot {slot}" if slot is not None else "the host tier (no free slot: it is paged in when a call names it)"
        log.info("loaded adapter %r into %s", adapter.name, where)
        return slot

    def _pinned(self, adapter: LoraAdapter) -> LoraAdapter:
        """``adapter`` with its factors in pinned host memory, when the slots are on CUDA: copies
        to a slot are then asynchronous, and may run beside compute on a side stream. A stack's
        A factors lie end to end in slot order, and so do its B factors: an adapter that fills
        the stack is copied into a slot in two copies (:meth:`TargetSet.writes`)."""
        if not self._on_cuda() or all(isinstance(f, _Dropped) or f.a.is_pinned() for f in adapter.modules.values()):
            return adapter
        held = {fqn: f for fqn, f in adapter.modules.items() if not isinstance(f, _Dropped)}
        runs = [[t.fqn for t in members if t.fqn in held] for written in self._sets for _, members in written.stacks.values()]
        stacked = {fqn for run in runs for fqn in run}
        keys = [[(fqn, part) for fqn in run] for part in ("a", "b") for run in runs if run]
        keys += [[(fqn, "a"), (fqn, "b")] for fqn in held if fqn not in stacked]
        groups = [[getattr(held[fqn], part) for fqn, part in group] for group in keys]
        factors: dict[str, dict[str, torch.Tensor]] = {fqn: {} for fqn in held}
        for group, copies in zip(keys, host_buffers.packed_copies(groups, host_buffers.pinned_bytes)):
            for (fqn, part), t in zip(group, copies):
                factors[fqn][part] = t
        modules = dict(adapter.modules) | {fqn: dataclasses.replace(f, **factors[fqn]) for fqn, f in held.items()}
        return dataclasses.replace(adapter, modules=modules)

    def _keep_on_host(self, name: str) -> None:
        """``name`` was just used: the most recent of the host tier, whose oldest beyond
        ``max_cpu_loras`` (never ``name`` itself) drop their factors if they can be read again."""
        self.host[name] = None
        self.host.move_to_end(name)
        if self.max_cpu_loras is None:
            return
        droppable = [n for n in self.host if n in self._reload and n != name]
        for old in droppable[: max(0, len(self.host) - self.max_cpu_loras)]:
            del self.host[old]
            adapter = self.adapters[old]
            self.adapters[old] = dataclasses.replace(adapter, modules={k: _Dropped(f.kind, f.rank) for k, f in adapter.modules.items()})

    def _factors(self, name: str) -> LoraAdapter:
        """``name``'s factors, read again from its source (and checked again) if the host tier
        dropped them."""
        if name not in self.host:
            adapter = dataclasses.replace(self._reload[name](), name=name)
            dropped = self.adapters[name]
            if adapter.modules.keys() != dropped.modules.keys():
                raise AdapterError(f"adapter {name!r} ({adapter.source}): its files changed since it was loaded")
            self._check_load(adapter, again=True)
            self.adapters[name] = self._pinned(adapter)
        self._keep_on_host(name)
        return self.adapters[name]

    def _free_slot(self, evict: bool = True) -> int | None:
        """A slot a new adapter may take: an empty one, else (with ``evict``) the least recently
        used one that no call reads (its adapter stays registered, on the host); None if none."""
        taken = set(self.slot_of.values())
        empty = next((s for s in range(self.max_loras) if s not in taken and s not in self._draining and not self._pins[s]), None)
        if empty is not None or not evict:
            return empty
        evictable = [s for s in taken if not self._pins[s]]
        return min(evictable, key=self._used.__getitem__) if evictable else None

    def _place(self, name: str, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """Copy ``name`` into ``slot``, evicting whoever held it (on ``stream`` if given)."""
        adapter = self._factors(name)  # before anything changes: reading it again may fail
        evicted = next((n for n, s in self.slot_of.items() if s == slot), None)
        if evicted is not None:
            del self.slot_of[evicted]
            log.info("evicted adapter %r from slot %d (it stays registered)", evicted, slot)
        self._write(slot, adapter, stream)
        self.slot_of[name] = slot
        self._clock += 1
        self._used[slot] = self._clock

    def _check_load(self, adapter: LoraAdapter, again: bool = False) -> None:
        """Check that ``adapter`` fits the pool and the model (``again``: it is loaded, and was
        read again from its source)."""
        name = adapter.name
        unresolved = [fqn for fqn, f in adapter.modules.items() if f.kind == "parameter"]
        if unresolved:
            raise AdapterError(
                f"adapter {name!r} ({adapter.source}): target_parameters LoRA ({unresolved[0]!r}) needs the model to "
                "tell which experts parameter it is: serve it with fxlora.compile(model, ...)"
            )
        if name in self.adapters and not again:
            raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
        if adapter.max_rank > self.max_rank:
            worst = max(adapter.modules, key=lambda m: adapter.modules[m].rank)
            raise AdapterError(
                f"adapter {name!r} ({adapter.source}): rank {adapter.max_rank} of module {worst!r} exceeds max_rank={self.max_rank}"
            )
        if self.complete:
            self._check_exists(adapter, self.modules)
        for fqn in adapter.modules:
            if fqn in self.modules:
                self._check_module(adapter, fqn, self.modules[fqn])
                if fqn not in self.targets and not again:  # (read again, it is one: targets are being made)
                    raise AdapterError(
                        f"adapter {name!r} ({adapter.source}): module {fqn!r} was not compiled as a LoRA target; "
                        "name it in target_modules when compiling"
                    )

    def unload(self, name: str) -> None:
        """Take ``name`` out: calls that start later cannot name it. Its slot is zeroed now,
        or, while calls in flight read it, when the last of them ends."""
        if not isinstance(name, str):
            raise AdapterError(f"unload_adapter takes one adapter's name, got {type(name).__name__} {name!r} (delete_adapter takes several)")
        with self._lock:
            if name not in self.adapters:
                raise AdapterError(f"adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
            del self.adapters[name]
            self.host.pop(name, None)
            self._reload.pop(name, None)
            slot = self.slot_of.pop(name, None)
            if slot is not None and self._pins[slot]:
                self._draining.add(slot)
            elif slot is not None:
                self._write(slot, None)
        log.info("unloaded adapter %r%s", name, f" from slot {slot}" if slot is not None else " (it held no slot)")

    def acquire(
        self,
        adapter_names: Sequence[str | None],
        stream: torch.cuda.Stream | None = None,
        timeout: float | None = 60.0,
        owner: object = None,
    ) -> tuple[list[int], set[str]]:
        """Per-row slot ids for a call, pinned until :meth:`release`, and the modules the named
        adapters change (for the call's coverage check; under ``torch.compile`` some may be
        modules no graph brought in yet). An adapter without a slot is
        paged in: into an empty slot, else the least recently used one no call reads; its copy
        runs on ``stream`` when given (the caller waits for that stream before reading it), else
        in order on the current one. When every slot is read by calls in flight, waits up to
        ``timeout`` seconds (None: as long as it takes) for one to end, and fails at once where
        every slot is read by calls of ``owner``, which cannot end while it waits. ``owner``: who
        holds the pins until :meth:`release` (by default the calling thread, which releases
        them)."""
        owner = threading.get_ident() if owner is None else owner
        with self._lock:
            names = list(dict.fromkeys(n for n in adapter_names if n is not None))
            for name in names:
                if name not in self.adapters:
                    raise AdapterError(f"unknown adapter {name!r} in adapter_names; loaded: {sorted(self.adapters)}")
            if len(names) > self.max_loras:
                raise AdapterError(
                    f"a call names {len(names)} adapters but the pool has max_loras={self.max_loras} GPU slots: split the "
                    f"batch, or compile with max_loras={len(names)} or more"
                )
            # Each adapter is pinned once placed, so that no other call evicts it meanwhile, and the
            # call reads it there, as it was then: waiting for a later one's slot releases the lock,
            # and an adapter unloaded or loaded again meanwhile keeps its pinned slot for this call.
            pinned: dict[str, int] = {}
            modules: set[str] = set()
            try:
                for name in names:
                    if name in self.slot_of:
                        self.hits += 1
                        if name in self.host:
                            self.host.move_to_end(name)  # used: the host tier drops it last
                    elif self._wait_for_slot(name, timeout, owner):  # another call placed it meanwhile
                        self.hits += 1
                    else:
                        self.misses += 1
                        self._place(name, self._free_slot(), stream)
                    slot = pinned[name] = self.slot_of[name]
                    self._pins[slot] += 1
                    self._owned[owner][slot] += 1
                    modules |= self.adapters[name].modules.keys()
                    self._clock += 1
                    self._used[slot] = self._clock
            except BaseException:
                self.release(pinned.values(), owner)
                raise
            return [NO_ADAPTER if name is None else pinned[name] for name in adapter_names], modules

    def _wait_for_slot(self, name: str, timeout: float | None, owner: object) -> bool:
        """Wait (under the lock) up to ``timeout`` for a slot ``name`` may take, or for ``name``
        to be placed by another call (then True); fail at once once every slot is read by
        ``owner``'s calls, which cannot end while it waits."""
        owned = self._owned.get(owner, Counter())
        alone = lambda: all(self._pins[s] == owned[s] for s in range(self.max_loras))  # noqa: E731
        placed = lambda: name in self.slot_of or name not in self.adapters or self._free_slot() is not None  # noqa: E731
        if not self._released.wait_for(lambda: placed() or alone(), timeout):
            raise NoFreeSlot(
                f"adapter {name!r}: no GPU slot came free in {timeout} s: all max_loras={self.max_loras} slots are read "
                "by calls in flight; compile with a larger max_loras= or wait for them"
            )
        if name not in self.adapters:
            raise AdapterError(f"adapter {name!r} was unloaded while a call waited for a slot for it")
        if not placed():
            held = sorted(n for n, s in self.slot_of.items() if owned[s])
            raise NoFreeSlot(
                f"adapter {name!r}: all max_loras={self.max_loras} GPU slots are read by calls this one runs inside "
                f"(an enclosing call or fxlora.use_adapters block of the same thread, reading {held}), which cannot "
                "end while it waits: name every adapter in the enclosing call, or compile with a larger max_loras="
            )
        return name in self.slot_of

    def release(self, slots: Iterable[int], owner: object = None) -> None:
        """End a call's pins, ``owner``'s as :meth:`acquire` took them (a pin of a slot that
        ``owner`` does not hold: another owner's); a slot unloaded meanwhile is zeroed once
        nothing reads it."""
        owner = threading.get_ident() if owner is None else owner
        with self._lock:
            for slot in set(slots) - {NO_ADAPTER}:
                self._pins[slot] -= 1
                mine = self._owned.get(owner)
                holder = owner if mine and mine[slot] else next((o for o, held in self._owned.items() if held[slot]), None)
                if holder is not None:
                    held = self._owned[holder]
                    held[slot] -= 1
                    if not held[slot]:
                        del held[slot]
                    if not held:
                        del self._owned[holder]
                self._fence(slot)  # the call's work that reads the slot was issued before this point
                if not self._pins[slot] and slot in self._draining:
                    self._draining.discard(slot)
                    self._write(slot, None)
            self._released.notify_all()

    def _fence(self, slot: int) -> None:
        """Mark, on the current stream, the last work issued that reads or writes ``slot``: a
        copy into it on another stream waits for that point, and for nothing else."""
        if self._on_cuda():
            self._fences[slot] = event = torch.cuda.Event()
            event.record()

    def _on_cuda(self) -> bool:
        return any(written.scaling.is_cuda for written in self._sets)

    @torch.no_grad()
    def _write(
        self, slot: int, adapter: LoraAdapter | None, stream: torch.cuda.Stream | None = None, sets: list[TargetSet] | None = None
    ) -> None:
        """Put ``adapter`` (None: none) into ``slot`` of every target set (or of ``sets``), on
        ``stream`` if given: the fills and factor copies of all sets as one call each, their
        scaling and rank, and their groups', from one host tensor each."""
        sets = self._sets if sets is None else sets
        if stream is not None and slot in self._fences:
            stream.wait_event(self._fences[slot])
        fills: list[torch.Tensor] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        scaling: list[float] = []
        rank: list[int] = []
        for written in sets:
            set_fills, set_copies = written.writes(slot, adapter)
            fills += set_fills
            copies += set_copies
            set_scaling, set_rank = written.columns(adapter)
            scaling += set_scaling
            rank += set_rank
        starts, first = {}, 0  # where each set's values begin in the columns
        for written in sets:
            starts[id(written)] = first
            first += len(written.targets)
        groups, index = self._group_plan(starts)
        # the tables' values, then the groups' (gathered on the host), in one host tensor each
        columns = [torch.tensor(scaling, dtype=torch.float32), torch.tensor(rank, dtype=torch.int32)]
        columns = [torch.cat([c, c[index]]) for c in columns]
        if self._on_cuda():
            columns = [c.pin_memory() for c in columns]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if fills:
                torch._foreach_zero_(fills)
            if copies:
                torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies], non_blocking=True)
            staged: dict[torch.device, list[torch.Tensor]] = {}  # the columns, one copy to each device
            for written in sets:
                device = written.scaling.device
                if device not in staged:
                    staged[device] = [c.to(device, non_blocking=True) for c in columns]
                at, n = starts[id(written)], len(written.targets)
                for table, values in zip((written.scaling, written.rank), staged[device]):
                    table[:, slot].copy_(values[at : at + n])
            for device, values in staged.items():  # the groups' slices of the slot: one list copy a value
                if mine := [(g, first + at, n) for g, at, n in groups if g.scaling.device == device]:
                    for part, column in zip(("scaling", "rank"), values):
                        torch._foreach_copy_([getattr(g, part)[slot * n : (slot + 1) * n] for g, _, n in mine],
                                             [column[at : at + n] for _, at, n in mine])  # fmt: skip
        if stream is None:
            self._fence(slot)

    def _group_plan(self, starts: dict[int, int]) -> tuple[list[tuple[PoolGroup, int, int]], torch.Tensor]:
        """The groups of the sets being written (``starts``: where each set's values begin in
        the written columns), each with where its values begin after the columns and its size,
        and a host index of its members' values in the columns: made once for these sets and
        groups."""
        key = (tuple(starts.items()), len(self.groups))
        if key not in self._group_plans:
            if len(self._group_plans) >= 8:  # (registrations write a few sets each: keep it small)
                self._group_plans.clear()
            groups = [g for g in self.groups.values() if id(g.owner) in starts]
            sizes = [len(g.fqns) for g in groups]
            index = [starts[id(g.owner)] + g.owner.rows[f] for g in groups for f in g.fqns]
            plan = list(zip(groups, itertools.accumulate([0, *sizes]), sizes))
            self._group_plans[key] = (plan, torch.tensor(index, dtype=torch.long))
        return self._group_plans[key]

    def slot_ids(self, adapter_names: Sequence[str | None]) -> list[int]:
        """Per-row slot ids of resident adapters; ``None`` rows get :data:`NO_ADAPTER`."""
        slots = []
        for name in adapter_names:
            if name is None:
                slots.append(NO_ADAPTER)
            elif name in self.slot_of:
                slots.append(self.slot_of[name])
            elif name in self.adapters:
                raise AdapterError(f"adapter {name!r} holds no GPU slot now: acquire() pages it in")
            else:
                raise AdapterError(f"unknown adapter {name!r} in adapter_names; loaded: {sorted(self.adapters)}")
        return slots

    @property
    def host_bytes(self) -> int:
        """Host memory the host tier's factors take."""
        return sum(f.a.nbytes + f.b.nbytes for n in self.host for f in self.adapters[n].modules.values())

    def targeted_by(self, fqns: Iterable[str]) -> str:
        """What targets these modules, for messages: the loaded adapters with LoRA on any of
        them, or ``target_modules``."""
        fqns = set(fqns)
        users = sorted(name for name, a in self.adapters.items() if a.modules.keys() & fqns)
        return f"adapter(s) {users}" if users else "target_modules"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.targets.values())
