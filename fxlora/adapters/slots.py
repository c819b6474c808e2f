"""The pool's slot tensors: one target's stacked factors (:class:`PoolTarget`), the joint
tensors a layer's linears that read one input share (:class:`Stack`), a layer's targets written
together (:class:`TargetSet`), and neighbours served by one multi-slice launch
(:class:`PoolGroup`). They are allocated once and written in place: their addresses never
change, so compiled graphs and captured CUDA graphs keep reading them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fxlora.adapters.modules import ModuleInfo
from fxlora.adapters.peft_format import LoraAdapter, LoraFactors


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
    last linear, which goes after the others (:func:`block_outputs`): ``lora_a[slots, n ·
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
    return (layer_of(fqn), info.in_features, info.dtype, info.device)


def layer_of(fqn: str) -> str:
    """The layer a module belongs to: its name up to its last layer number ("" for none)."""
    layer = re.match(r"(.*\.\d+)\.", fqn)
    return layer[1] if layer else ""


def block_outputs(modules: dict[str, ModuleInfo]) -> set[str]:
    """The last linear of each module that holds several (an attention's output projection, an
    MLP's down projection): it reads what its block computed, not the input its siblings
    share, so a :class:`Stack` puts it after them."""
    last: dict[str, list[str]] = {}
    for fqn, info in modules.items():
        if info.kind == "linear":
            last.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    return {fqns[-1] for fqns in last.values() if len(fqns) > 1}


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

