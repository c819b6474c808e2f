"""Per-call adapter selection and the choice between the ``lora`` and ``nolora`` graphs.

``use_adapters`` sets the adapter names of the rows of the next calls (a context
variable, so threads and tasks keep their own). A ``Router`` is what a compiled graph
becomes: on each call it reads those names on the host, runs ``nolora`` when no row has
an adapter, and otherwise passes the rows' slot ids to ``lora``. Nothing here reads
device memory, so routing never synchronises.

``use_slots`` is the runtime's form of the same choice: it hands the graphs a slot-id
tensor it owns (a static buffer a CUDA graph reads on every replay), or ``None`` for
``nolora``, and the names are no longer looked at.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxlora.adapters import AdapterPool
from fxlora.errors import LoraNotRunError
from fxlora.passes.graph_edit import BASE_CALL, TARGETS
from fxlora.runtime.cuda_graphs import GraphSet, cpu_work

_coverage: contextvars.ContextVar[Coverage | None] = contextvars.ContextVar("fxlora_coverage", default=None)
_adapter_names: contextvars.ContextVar[tuple[str | None, ...] | None] = contextvars.ContextVar(
    "fxlora_adapter_names", default=None
)
_NAMES = object()  # _slot_ids' default: route by the adapter names
_slot_ids: contextvars.ContextVar[object] = contextvars.ContextVar("fxlora_slot_ids", default=_NAMES)


@dataclass
class Coverage:
    """What the compiled graphs run inside a block served: the pools they read and the
    modules whose LoRA ran. Code Dynamo does not compile (a graph break, a hit recompile
    limit) runs the plain model; this is how a caller notices, instead of returning base
    outputs for adapter rows."""

    pools: dict[int, AdapterPool] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)

    def require(self, needed: set[str]) -> None:
        """Raise if the LoRA of a module in ``needed`` did not run."""
        if missing := needed - self.modules:
            raise LoraNotRunError(
                f"the LoRA of {len(missing)} module(s), e.g. {sorted(missing)[0]!r}, did not run: that code ran "
                "outside the compiled graphs (a graph break, or Dynamo's recompile limit was hit). See explain() "
                "and TORCH_LOGS=graph_breaks,recompiles."
            )

    def require_adapters(self, names: Sequence[str | None]) -> None:
        """Raise unless the LoRA of every targeted module of these adapters ran."""
        adapters = {n for n in names if n is not None}
        if not adapters:
            return
        if not self.pools:
            raise LoraNotRunError(
                f"rows ask for adapters {sorted(adapters)}, but no fxlora graph ran: the model ran outside the "
                "compiled graphs (Dynamo's recompile limit was hit, or nothing compiled with the fxlora backend "
                "was called inside use_adapters). See TORCH_LOGS=recompiles."
            )
        for pool in self.pools.values():
            self.require(pool.modules_of(adapters))


@contextlib.contextmanager
def use_adapters(adapter_names: Sequence[str | None] | None) -> Iterator[None]:
    """Rows of calls made inside run with these adapters (``None``: the base model). If a
    row's adapter did not run on every module it targets (part of the model ran outside
    the compiled graphs), the block raises :class:`LoraNotRunError` instead of returning
    base outputs for that row."""
    names = None if adapter_names is None else tuple(adapter_names)
    token = _adapter_names.set(names)
    try:
        with record_coverage() as coverage:
            yield
    finally:
        _adapter_names.reset(token)
    coverage.require_adapters(names or ())


@contextlib.contextmanager
def use_slots(slot_ids: torch.Tensor | None) -> Iterator[None]:
    """Calls made inside run ``lora`` with these per-row slot ids (int32, on the graphs'
    device, -1 for no adapter), or ``nolora`` when ``slot_ids`` is None."""
    token = _slot_ids.set(slot_ids)
    try:
        yield
    finally:
        _slot_ids.reset(token)


def current_adapter_names() -> tuple[str | None, ...] | None:
    return _adapter_names.get()


@contextlib.contextmanager
def record_coverage() -> Iterator[Coverage]:
    """Collects what the graphs run inside the block served (see :class:`Coverage`)."""
    coverage = Coverage()
    token = _coverage.set(coverage)
    try:
        yield coverage
    finally:
        _coverage.reset(token)


class Router:
    """Runs one compiled graph's ``lora`` or ``nolora`` variant, as the current names ask."""

    def __init__(
        self,
        lora: fx.GraphModule | None,
        nolora: fx.GraphModule,
        pool: AdapterPool,
        device: torch.device,
        graphs: GraphSet | None = None,
    ):
        """``graphs``: replay the variants from CUDA graphs captured per input signature."""
        self.lora, self.nolora, self.pool, self.device = lora, nolora, pool, device
        self.graphs = graphs
        variants = (("lora", lora), ("nolora", nolora)) if graphs is not None else ()
        self.uncapturable = {v: cpu_work(g) for v, g in variants if g is not None}
        self.lora_modules = frozenset().union(
            *(
                n.meta.get(TARGETS) or ({n.meta["fxlora_module"]} if n.meta.get(BASE_CALL) else set())
                for n in (lora.graph.nodes if lora is not None else ())
            )
        )

    def _slot_ids(self) -> torch.Tensor | None:
        """The rows' slot ids, or None when ``nolora`` serves the call."""
        given = _slot_ids.get()
        if given is not _NAMES:
            return given  # type: ignore[return-value]
        names = current_adapter_names()
        if names is None or all(n is None for n in names):
            return None
        slots = self.pool.slot_ids(names)
        return torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True)

    def __call__(self, *args):
        slot_ids = self._slot_ids() if self.lora is not None else None
        coverage = _coverage.get()
        if coverage is not None:  # a graph runs whole or raises: what it serves is known before it runs
            coverage.pools[id(self.pool)] = self.pool
            if slot_ids is not None:
                coverage.modules |= self.lora_modules
        if slot_ids is None:
            return self._run("nolora", args)
        return self._run("lora", (*args, slot_ids))

    def _run(self, variant: str, args: tuple):
        fn = getattr(self, variant)
        if self.graphs is None:
            return fn(*args)
        return self.graphs.call((id(self), variant), fn, args, self.uncapturable[variant])
