"""The arena: one byte buffer that holds every hoisted allocation of a compiled model.

The ``hoist`` pass turns each allocation of a graph (``torch.empty`` / ``zeros`` / ``full``
/ ``arange`` / ``*_like`` / ``new_*``, and the LoRA ops' workspaces) into a *site* of an
:class:`ArenaPlan`: the site knows when its buffer is live (from its allocation to the last
use of anything aliasing it) and asks the plan for memory on every call.

A plan first *measures*: sites allocate as the graph did and record the largest size
they saw. :meth:`Arena.plan` then places every measured site of every plan at a fixed
offset, sites of one graph sharing bytes when their lifetimes do not overlap, and allocates
the buffer once, sized for the largest plan: graphs run one at a time, so all graphs and
both variants share it. From then on a site returns a view of the buffer (filled as the
allocation would have been), or, when a call needs more than was measured, allocates as
before. The runtime measures every batch bucket before it plans, so captured CUDA graphs
read and write only arena memory for these allocations.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxlora.ops.delta_launcher import lora_workspace

log = logging.getLogger(__name__)

ALIGN = 256  # bytes; every site starts on such a boundary


def _fill_value(index: int) -> Callable[[torch.Tensor, tuple, dict], None]:
    def fill(view: torch.Tensor, args: tuple, kwargs: dict) -> None:
        view.fill_(args[index] if len(args) > index else kwargs["fill_value"])

    return fill


def _arange(view: torch.Tensor, args: tuple, kwargs: dict) -> None:
    torch.arange(*args, out=view, **{k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory")})


def _method(name: str) -> Callable[..., torch.Tensor]:
    return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)


_none = lambda view, args, kwargs: None  # noqa: E731
_zero = lambda view, args, kwargs: view.zero_()  # noqa: E731
_one = lambda view, args, kwargs: view.fill_(1)  # noqa: E731

# kind -> (the allocation, how its contents are set)
KINDS: dict[str, tuple[Callable[..., torch.Tensor], Callable[[torch.Tensor, tuple, dict], Any]]] = {
    "empty": (torch.empty, _none),
    "zeros": (torch.zeros, _zero),
    "ones": (torch.ones, _one),
    "full": (torch.full, _fill_value(1)),
    "arange": (torch.arange, _arange),
    "empty_like": (torch.empty_like, _none),
    "zeros_like": (torch.zeros_like, _zero),
    "ones_like": (torch.ones_like, _one),
    "full_like": (torch.full_like, _fill_value(1)),
    "new_empty": (_method("new_empty"), _none),
    "new_zeros": (_method("new_zeros"), _zero),
    "new_ones": (_method("new_ones"), _one),
    "new_full": (_method("new_full"), _fill_value(2)),
}
# The LoRA ops' scratch, which the LoRA passes insert as calls of their own; like every kind,
# each takes device="meta" to compute its shape.
WORKSPACES = {f: f.__name__ for f in (lora_workspace,)}
KINDS.update({kind: (f, _none) for f, kind in WORKSPACES.items()})


@dataclass
class Site:
    start: int  # node index of the allocation
    end: int  # node index of the last use of anything aliasing it
    measured: int = 0  # most bytes a call needed
    offset: int | None = None  # in the arena, once planned
    capacity: int = 0


class ArenaPlan(torch.nn.Module):
    """The hoisted allocations of one graph."""

    def __init__(self, arena: Arena, sites: list[Site], graph_name: str):
        super().__init__()
        object.__setattr__(self, "arena", arena)  # shared, not a submodule of each plan
        self.sites, self.graph_name = sites, graph_name
        self.devices: dict[int, torch.device] = {}

    def take(self, index: int, kind: str, args: tuple, kwargs: dict) -> torch.Tensor:
        make, fill = KINDS[kind]
        site, buffer = self.sites[index], self.arena.buffer
        if site.offset is not None and buffer is not None:
            shape = make(*args, **{**kwargs, "device": "meta"})
            nbytes = shape.numel() * shape.element_size()
            if nbytes <= site.capacity and shape.is_contiguous():
                view = buffer[site.offset : site.offset + nbytes].view(shape.dtype).view(shape.shape)
                fill(view, args, kwargs)
                return view
        out = make(*args, **kwargs)
        site.measured = max(site.measured, out.numel() * out.element_size())
        self.devices[index] = out.device
        return out

    def place(self, device: torch.device) -> int:
        """Give every measured site on ``device`` an offset; returns the bytes this plan needs."""
        placed: list[Site] = []
        for i, site in sorted(enumerate(self.sites), key=lambda s: (-s[1].measured, s[1].start)):
            if not site.measured or self.devices.get(i) != device:
                continue
            site.capacity = -(-site.measured // ALIGN) * ALIGN
            offset = 0
            for other in sorted(
                (p for p in placed if p.start <= site.end and site.start <= p.end), key=operator.attrgetter("offset")
            ):
                if offset + site.capacity <= other.offset:
                    break
                offset = max(offset, other.offset + other.capacity)
            site.offset = offset
            placed.append(site)
        return max((s.offset + s.capacity for s in placed), default=0)

    @property
    def placed(self) -> list[Site]:
        return [s for s in self.sites if s.offset is not None]


def hoisted(plan: ArenaPlan, index: int, kind: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """What a hoisted allocation node calls."""
    return plan.take(index, kind, args, kwargs)


class Arena:
    """One buffer for the hoisted allocations of every graph of a compiled model."""

    def __init__(self) -> None:
        self.plans: list[ArenaPlan] = []
        self.buffer: torch.Tensor | None = None

    def new_plan(self, sites: list[Site], graph_name: str) -> ArenaPlan:
        plan = ArenaPlan(self, sites, graph_name)
        self.plans.append(plan)
        return plan

    def plan(self, device: torch.device) -> None:
        """Place every site measured so far and allocate the buffer. Later calls (after new
        graphs were measured) may only keep or grow it before any graph is captured."""
        size = max((p.place(device) for p in self.plans), default=0)
        if self.buffer is None or self.buffer.numel() < size or self.buffer.device != device:
            self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        log.info("arena of %d bytes for %d allocations", size, sum(len(p.placed) for p in self.plans))

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    @property
    def replaced_bytes(self) -> int:
        """What the placed allocations would take side by side, at the sizes measured."""
        return sum(s.measured for p in self.plans for s in p.placed)
