"""The adapter pool: every LoRA target's factors stacked into fixed slots.

For each target module the pool holds ``lora_a[slots, max_rank, in]``,
``lora_b[slots, out, max_rank]``, a float32 ``scaling[slots]`` and an int32 ``rank[slots]``,
allocated once (the linear targets of one layer that read inputs of one width as slices of
joint tensors, :class:`Stack`, so that neighbours can be served as one group). A slot whose
adapter does not touch the module has rank 0 and scaling 0; ranks below ``max_rank`` are
zero-padded. Slot id ``-1`` means "no adapter". Loading copies
into a free slot in place, so the tensors keep their addresses: compiled graphs read them
directly and never need a retrace or recapture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import re
import threading
import traceback
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from fxlora.adapters import sharding
from fxlora.adapters.peft_format import LoraAdapter, LoraFactors, all_linear, all_linear_selects, selects_module
from fxlora.adapters.sharding import Sharding
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


@dataclass(frozen=True, eq=False)
class ModuleInfo:
    """What the pool needs to know of a module that may carry LoRA. Under tensor parallelism
    the features are those this rank computes, and ``shard`` says which slice of the whole
    module they are (:mod:`fxlora.adapters.sharding`); ``unshardable`` says why a sharded
    module cannot carry LoRA, should it be targeted."""

    kind: Literal["linear", "embedding", "experts"]
    in_features: int  # for an embedding: num_embeddings
    out_features: int  # for an embedding: embedding_dim
    dtype: torch.dtype
    device: torch.device
    weight: torch.Tensor | None = field(default=None, repr=False)
    experts: int = 0  # for "experts": a 3-D parameter of this many experts (on this rank) ...
    owner: torch.nn.Module | None = field(default=None, repr=False)  # ... held by this experts module
    parameter: str | None = None  # a linear over this 2-D parameter of the module (:meth:`over_parameter`)
    shard: Sharding | None = None
    unshardable: str | None = None

    @property
    def all_experts(self) -> int:
        """How many experts the whole module has; an expert-parallel rank holds ``experts``."""
        return self.shard.size if self.shard is not None and self.shard.dim == "experts" else self.experts

    @property
    def whole(self) -> tuple[int, int]:
        """``(in, out)`` features of the whole module, which adapters are written for."""
        s = self.shard
        return (
            s.size if s is not None and s.dim == "in" else self.in_features,
            s.size if s is not None and s.dim == "out" else self.out_features,
        )

    @staticmethod
    def of(module: torch.nn.Module) -> ModuleInfo | None:
        from transformers.pytorch_utils import Conv1D

        if isinstance(module, Conv1D):  # a linear whose weight is stored (in, out)
            return ModuleInfo._linear(module.weight, out_dim=1, keep_weight=False)
        if isinstance(module, torch.nn.Linear):  # its features, whatever shape a quantised weight packs into
            dtype = module.weight.dtype
            if not dtype.is_floating_point:  # a packed weight (bitsandbytes): LoRA in the dtype the layer computes in
                dtype = getattr(module, "compute_dtype", None) or torch.get_default_dtype()
            return ModuleInfo._linear(module.weight, out_dim=0, features=(module.out_features, module.in_features), dtype=dtype)
        if isinstance(module, torch.nn.Embedding):  # whole factors, however the weight is split (DTensor: its whole shape)
            w = module.weight
            n, d = w.shape
            return ModuleInfo("embedding", n, d, w.dtype, w.device, w)
        return None

    @staticmethod
    def _linear(
        w: torch.Tensor,
        out_dim: int,
        keep_weight: bool = True,
        parameter: str | None = None,
        features: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> ModuleInfo:
        """A linear over ``w`` (output features along ``out_dim``), of ``features`` ``(out, in)``
        when given and ``w`` is not sharded, else of ``w``'s (local) shape."""
        if features is None or sharding.is_distributed(w):
            shape = sharding.local_tensor(w).shape
            features = (shape[out_dim], shape[1 - out_dim])
        shard, why = _sharding(w, out_dim, 1 - out_dim)
        weight = w if keep_weight else None
        fout, fin = features
        dtype = dtype or w.dtype
        return ModuleInfo("linear", fin, fout, dtype, w.device, weight, parameter=parameter, shard=shard, unshardable=why)

    @staticmethod
    def over_parameter(module: torch.nn.Module) -> ModuleInfo | None:
        """For a module of no kind :meth:`of` knows that holds one 2-D floating-point
        parameter ``W (out, in)`` of its own (an MoE router's ``weight``): the linear its
        forward may compute over it. PEFT's ``target_parameters`` LoRA of ``W`` adds
        ``scaling · B @ A`` to it, which is the linear LoRA of ``F.linear(x, W)``; the passes
        serve it only on an ``F.linear`` call of the module that reads ``W``."""
        found = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 2 and p.is_floating_point()]
        if len(found) != 1:
            return None
        name, w = found[0]
        return ModuleInfo._linear(w, out_dim=0, parameter=name)


def model_modules(model: torch.nn.Module) -> dict[str, ModuleInfo]:
    """Every linear (``nn.Linear``, transformers' ``Conv1D``) and embedding module of
    ``model``, the up and down parameters of every experts module, every other module's one
    2-D parameter (:meth:`ModuleInfo.over_parameter`) and its 3-D parameters, as PEFT's
    ``target_parameters`` reads them (``(experts, out, in)`` unless the module says
    ``is_transposed``)."""
    from fxlora.adapters import experts

    found = {}
    for name, m in model.named_modules():
        if (info := ModuleInfo.of(m)) is not None:
            found[name] = info
        elif experts.is_experts(m):
            for p, w in experts.experts_parameters(m).items():
                local = sharding.local_tensor(w)
                fin, fout = experts.in_out(m, local)
                shard, why = _sharding(w, *((2, 1) if m.is_transposed else (1, 2)), experts_dim=0)
                info = ModuleInfo("experts", fin, fout, w.dtype, w.device, w, local.shape[0], m, shard=shard, unshardable=why)
                found[f"{name}.{p}"] = info
        elif (info := ModuleInfo.over_parameter(m)) is not None:
            found[name] = info
        if not experts.is_experts(m):  # any other module's 3-D parameters: the passes read what the graph does with them
            for p, w in m.named_parameters(recurse=False):
                if w.dim() == 3 and w.is_floating_point():
                    fin, fout = experts.in_out(m, w)
                    why = "LoRA of a 3-D parameter outside an experts module is not served under tensor parallelism"
                    found[f"{name}.{p}"] = ModuleInfo(
                        "experts", fin, fout, w.dtype, w.device, w, w.shape[0], m, unshardable=why if sharding.is_distributed(w) else None
                    )
    for fqn, info in found.items():
        if info.unshardable is not None and (entry := sharding.plan_entry(model, fqn)) is not None:
            found[fqn] = dataclasses.replace(info, unshardable=f"{info.unshardable} (its tp_plan entry {entry})")
    return found


def _sharding(weight: torch.Tensor, out_dim: int, in_dim: int, experts_dim: int | None = None) -> tuple[Sharding | None, str | None]:
    """``(shard, None)``, or ``(None, why)`` for a layout whose LoRA fxlora cannot split."""
    try:
        return sharding.sharding_of(weight, out_dim, in_dim, experts_dim), None
    except ShardingError as e:
        return None, str(e)


class PoolTarget:
    """The stacked LoRA factors of one module."""

    def __init__(self, fqn: str, info: ModuleInfo, slots: int, max_rank: int, stack: Stack | None = None):
        """``stack``: the joint tensors whose slices hold this linear target's factors; else
        they are its own. ``scaling`` and ``rank`` are rows of its :class:`TargetSet`'s tables."""
        self.fqn, self.info, self.stack = fqn, info, stack
        if stack is not None:
            self.lora_a, self.lora_b = stack.slices(fqn, 1)
        else:
            kw = dict(dtype=info.dtype, device=info.device)
            per_expert = (info.experts,) if info.kind == "experts" else ()  # (slots, [experts,] ...)
            self.lora_a = torch.zeros(slots, *per_expert, max_rank, info.in_features, **kw)
            self.lora_b = torch.zeros(slots, *per_expert, info.out_features, max_rank, **kw)
        self.scaling: torch.Tensor  # (slots,) float32 and int32: rows its TargetSet gives it
        self.rank: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.lora_a, self.lora_b, self.scaling, self.rank))

    @property
    def module(self) -> str:
        """The module whose call runs this target: the target itself, or for an experts
        parameter its experts module."""
        return self.fqn.rpartition(".")[0] if self.info.kind == "experts" else self.fqn

    def factors(self, factors: LoraFactors) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's ``factors`` for this target."""
        return (factors.a, factors.b) if self.info.shard is None else self.info.shard.factors(factors.a, factors.b)

    def copies(self, slot: int, factors: LoraFactors) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (slot view, factor) pairs that put ``factors`` into ``slot``; ranks below
        ``max_rank`` fill the first rows of A and columns of B (an expert dimension of 1
        broadcasts)."""
        a, b = self.factors(factors)
        return [(self.lora_a[slot, ..., : factors.rank, :], a), (self.lora_b[slot, ..., : factors.rank], b)]


@dataclass(eq=False)
class Stack:
    """The linear targets of one layer that read inputs of one width, their factors side by
    side in joint tensors from registration on, in registration order but for each block's
    last linear, which goes after the others (:func:`_outputs`): ``lora_a[slots, n ·
    max_rank, in]`` stacks each member's rank rows, ``lora_b[slots, sum(out), max_rank]`` each
    member's output rows (member ``i``'s first at ``rows[i]``). Any run of neighbours is then
    served as one group (:class:`PoolGroup`) as views of these tensors, so a graph that reads a
    member alone and one that reads the group read the same memory, whichever came first."""

    fqns: tuple[str, ...]
    rows: tuple[int, ...]
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @staticmethod
    def of(members: list[tuple[str, ModuleInfo]], slots: int, max_rank: int) -> Stack:
        info = members[0][1]
        widths = [m.out_features for _, m in members]
        rows = tuple(sum(widths[:i]) for i in range(len(widths)))
        kw = dict(dtype=info.dtype, device=info.device)
        lora_a = torch.zeros(slots, len(members) * max_rank, info.in_features, **kw)
        lora_b = torch.zeros(slots, sum(widths), max_rank, **kw)
        return Stack(tuple(fqn for fqn, _ in members), rows, lora_a, lora_b)

    @property
    def max_rank(self) -> int:
        return self.lora_b.shape[-1]

    def slices(self, first: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``lora_a`` and ``lora_b`` over ``count`` members from ``first`` on."""
        i = self.fqns.index(first)
        max_rank = self.max_rank
        end = self.rows[i + count] if i + count < len(self.rows) else self.lora_b.shape[1]
        return self.lora_a[:, i * max_rank : (i + count) * max_rank], self.lora_b[:, self.rows[i] : end]


def stack_key(fqn: str, info: ModuleInfo) -> tuple | None:
    """Which stack a target's factors join: linear targets of one layer (the name up to its
    last layer number) and one input width, dtype and device; None for others."""
    if info.kind != "linear":
        return None
    return (_layer(fqn), info.in_features, info.dtype, info.device)


def _layer(fqn: str) -> str:
    """The layer a module belongs to: its name up to its last layer number ("" for none)."""
    layer = re.match(r"(.*\.\d+)\.", fqn)
    return layer[1] if layer else ""


def _outputs(modules: dict[str, ModuleInfo]) -> set[str]:
    """The last linear of each module that holds several (an attention's output projection, an
    MLP's down projection): it reads what its block computed, not the input its siblings
    share, so a :class:`Stack` puts it after them."""
    last: dict[str, list[str]] = {}
    for fqn, info in modules.items():
        if info.kind == "linear":
            last.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    return {fqns[-1] for fqns in last.values() if len(fqns) > 1}


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


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class TargetSet:
    """The targets of one layer (as one registration made them, on one device), written
    together: their stacks, the other targets, and every target's ``scaling`` and ``rank`` as a
    row of one table each, so that a slot's values for all of them are one copy into a column.
    Writing an adapter into a slot takes a fill and a copy per factor tensor, not a launch per
    target and value; the layers' like targets are like views, so identical layers compile once."""

    def __init__(self, targets: list[PoolTarget], slots: int):
        device = targets[0].info.device
        self.targets, self.rows = targets, {t.fqn: i for i, t in enumerate(targets)}
        self.stacks: dict[int, tuple[Stack, list[PoolTarget]]] = {}
        for t in targets:
            if t.stack is not None:
                self.stacks.setdefault(id(t.stack), (t.stack, []))[1].append(t)
        for stack, members in self.stacks.values():  # in the stack's layout order
            members.sort(key=lambda t: stack.fqns.index(t.fqn))
        self.scaling = torch.zeros(len(targets), slots, dtype=torch.float32, device=device)
        self.rank = torch.zeros(len(targets), slots, dtype=torch.int32, device=device)
        for i, t in enumerate(targets):
            t.scaling, t.rank = self.scaling[i], self.rank[i]

    def writes(self, slot: int, adapter: LoraAdapter | None) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """What writing ``adapter`` (None: none) into ``slot`` takes: the slot tensors to zero
        first (a stack's only where its members' factors leave rows of it unwritten) and the
        (slot view, factor) copies, in slot order; the scaling and rank are :meth:`columns`."""
        factors = adapter.modules if adapter is not None else {}
        fills: list[torch.Tensor] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for stack, members in self.stacks.values():
            found = [(t, factors.get(t.fqn)) for t in members]
            if all(f is not None and f.rank == stack.max_rank for _, f in found):  # the factors fill the slot
                parts = [t.factors(f) for t, f in found]
                a, b = _joined([a for a, _ in parts]), _joined([b for _, b in parts])
                if a is not None and b is not None:  # and lie end to end: a copy each
                    copies += [(stack.lora_a[slot].view(-1), a), (stack.lora_b[slot].view(-1), b)]
                    continue
            else:
                fills += [stack.lora_a[slot], stack.lora_b[slot]]
            copies += [pair for t, f in found if f is not None for pair in t.copies(slot, f)]
        for target in self.targets:
            if target.stack is None:
                fills += [target.lora_a[slot], target.lora_b[slot]]
                if (f := factors.get(target.fqn)) is not None:
                    copies += target.copies(slot, f)
        return fills, copies

    def columns(self, adapter: LoraAdapter | None) -> tuple[list[float], list[int]]:
        """``adapter``'s scaling and rank per target, in table order (0 where it has none)."""
        found = [None if adapter is None else adapter.modules.get(t.fqn) for t in self.targets]
        return [0.0 if f is None else f.scaling for f in found], [0 if f is None else f.rank for f in found]


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``tensors`` if each starts where the one before ends, all dense, of
    one dtype and within the first one's storage; else None."""
    first = tensors[0]
    end = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end or t.dtype != first.dtype or not t.is_contiguous():
            return None
        end += t.nbytes
    storage = first.untyped_storage()
    if end > storage.data_ptr() + storage.nbytes():
        return None
    return first.as_strided(((end - first.data_ptr()) // first.element_size(),), (1,), first.storage_offset())


class PoolGroup:
    """Neighbouring linear targets of one :class:`Stack` that read the same input, served by
    one multi-slice LoRA launch: ``lora_a`` and ``lora_b`` are the stack's slices of them, and
    ``scaling`` and ``rank`` hold one value per (slot, member), slot-major, copied from the
    members' values at every write (:meth:`AdapterPool._group_plan`)."""

    def __init__(self, members: list[PoolTarget], owner: TargetSet):
        self.members = members
        self.fqns = tuple(m.fqn for m in members)
        self.fqn = "+".join(self.fqns)  # names the group's buffers in a graph
        self.widths = tuple(m.info.out_features for m in members)
        first = members[0]
        self.lora_a, self.lora_b = first.stack.slices(first.fqn, len(members))
        self.owner = owner
        rows = torch.tensor([owner.rows[f] for f in self.fqns], device=first.info.device)
        with torch.no_grad():  # every slot's values as the set's tables hold them, slot-major
            self.scaling, self.rank = (table.index_select(0, rows).t().contiguous().view(-1) for table in (owner.scaling, owner.rank))


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
        sets = self._allocate(wanted, _outputs(new), slots)  # before anything changes: it may not fit
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
                by_layer.setdefault((_layer(fqn), info.device), []).append(target)
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
        for group, copies in zip(keys, packed_copies(groups, _pinned_bytes)):
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
        self, adapter_names: Sequence[str | None], stream: torch.cuda.Stream | None = None, timeout: float | None = 60.0
    ) -> tuple[list[int], set[str]]:
        """Per-row slot ids for a call, pinned until :meth:`release`, and the target modules
        the named adapters change (for the call's coverage check). An adapter without a slot is
        paged in: into an empty slot, else the least recently used one no call reads; its copy
        runs on ``stream`` when given (the caller waits for that stream before reading it), else
        in order on the current one. When every slot is read by calls in flight, waits up to
        ``timeout`` seconds (None: as long as it takes) for one to end."""
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
            pinned: list[int] = []
            try:
                for name in names:  # each pinned once placed, so that no other call evicts it meanwhile
                    if name in self.slot_of:
                        self.hits += 1
                    elif self._wait_for_slot(name, timeout):  # another call placed it meanwhile
                        self.hits += 1
                    else:
                        self.misses += 1
                        self._place(name, self._free_slot(), stream)
                    slot = self.slot_of[name]
                    self._pins[slot] += 1
                    pinned.append(slot)
                    self._clock += 1
                    self._used[slot] = self._clock
            except BaseException:
                self.release(pinned)
                raise
            return self.slot_ids(adapter_names), self.modules_of(names)

    def _wait_for_slot(self, name: str, timeout: float | None) -> bool:
        """Wait (under the lock) up to ``timeout`` for a slot ``name`` may take, or for ``name``
        to be placed by another call (then True)."""
        ready = lambda: name in self.slot_of or name not in self.adapters or self._free_slot() is not None  # noqa: E731
        if not self._released.wait_for(ready, timeout):
            raise NoFreeSlot(
                f"adapter {name!r}: no GPU slot came free in {timeout} s: all max_loras={self.max_loras} slots are read "
                "by calls in flight; compile with a larger max_loras= or wait for them"
            )
        if name not in self.adapters:
            raise AdapterError(f"adapter {name!r} was unloaded while a call waited for a slot for it")
        return name in self.slot_of

    def release(self, slots: Iterable[int]) -> None:
        """End a call's pins; a slot unloaded meanwhile is zeroed once nothing reads it."""
        with self._lock:
            for slot in set(slots) - {NO_ADAPTER}:
                self._pins[slot] -= 1
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

    def modules_of(self, adapter_names: Iterable[str]) -> set[str]:
        """The target modules these loaded adapters change."""
        return set().union(*(self.adapters[n].modules.keys() & self.targets.keys() for n in adapter_names))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.targets.values())
