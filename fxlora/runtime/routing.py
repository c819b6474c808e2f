"""Per-call adapter selection and the choice between the ``lora`` and ``nolora`` graphs.

A :class:`Selection` is the one value a call carries: which adapter each row uses, resolved
to a per-row slot-id tensor once per pool, and what the compiled graphs served. It lives in a
context variable (threads and tasks keep their own), so Dynamo never sees it and changing
adapters never retraces. ``use_adapters`` makes one from names; the runtime's ``use_slots``
from a slot-id tensor it owns (a static buffer a CUDA graph reads on every replay). A
:class:`Router` is what a compiled graph becomes: it runs ``nolora`` when no row has an
adapter and otherwise ``lora`` with the slot ids. Nothing here reads device memory, so
routing never synchronises.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from fxlora.adapters import NO_ADAPTER, AdapterPool
from fxlora.adapters.peft_format import BASE_NAME
from fxlora.compiler import Variants
from fxlora.compiler.inner import compile_inner
from fxlora.errors import AdapterError, LoraNotRunError
from fxlora.runtime.cuda_graphs import GraphSet, cpu_work

log = logging.getLogger(__name__)


@dataclass
class Selection:
    """The rows' adapters for the calls of one block, and what the graphs served.

    ``names`` (one per row, ``None`` for the base model) are resolved once per pool: the
    slots are pinned (an adapter unloaded meanwhile keeps its weights until :meth:`release`)
    and the modules the adapters change are noted. ``fixed`` slot ids
    serve every graph as they are. ``batch``, when the caller knows it, is the input whose
    first dimension the rows are: a graph traced in the call finds its rows through it.
    ``pools`` and ``modules`` record the pools the graphs read and the modules whose LoRA
    ran; ``left_traced``, the targets a graph that ran left as traced, and why. Code Dynamo
    does not compile (a graph break, a frame it gave up on) runs the plain model; this is
    how a caller notices, instead of returning base outputs for adapter rows."""

    names: tuple[str | None, ...] | None = None
    fixed: torch.Tensor | None = None
    batch: torch.Tensor | None = None  # the input whose first dimension the rows are counted by
    pools: dict[int, AdapterPool] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)
    left_traced: dict[str, str] = field(default_factory=dict)  # target -> why a graph that ran left it as traced
    _held: dict[int, tuple[list[int], set[str]]] = field(default_factory=dict)  # pool -> (slots, needed)
    _tensors: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict)

    def slot_ids(self, pool: AdapterPool, device: torch.device) -> torch.Tensor | None:
        """Per-row int32 slot ids on ``device``, or None when no row has an adapter."""
        self.pools[id(pool)] = pool
        if self.fixed is not None:
            return self.fixed
        if not self.uses_adapters:
            return None
        if id(pool) not in self._held:
            self._held[id(pool)] = pool.acquire(self.names)
        key = (id(pool), device)
        if key not in self._tensors:
            self._tensors[key] = _to_slot_tensor(self._held[id(pool)][0], device)
        return self._tensors[key]

    def release(self) -> None:
        for pool_id, (slots, _) in self._held.items():
            self.pools[pool_id].release(slots)
        self._held.clear()

    @property
    def uses_adapters(self) -> bool:
        return self.names is not None and any(n is not None for n in self.names)

    def require(self, needed: set[str], pool: AdapterPool | None = None) -> None:
        """Raise if the LoRA of a module in ``needed`` did not run; the error names the
        adapters of ``pool`` that need it, where the compiler said why it left it out."""
        missing = needed - self.modules
        if left := sorted(missing & self.left_traced.keys()):
            fqn = left[0]
            adapters = pool.adapters if pool is not None else {}
            users = sorted(n for n in set(self.names or ()) - {None} if fqn in getattr(adapters.get(n), "modules", ()))
            raise LoraNotRunError(
                f"adapter(s) {users}: the LoRA of {len(missing)} module(s), e.g. {fqn!r}, did not run: fxlora left "
                f"that module as traced, because {self.left_traced[fqn]}. See explain()."
            )
        if missing:
            raise LoraNotRunError(
                f"the LoRA of {len(missing)} module(s), e.g. {sorted(missing)[0]!r}, did not run: that code ran "
                "outside the compiled graphs (a graph break, or Dynamo's recompile limit was hit). See explain() "
                "and TORCH_LOGS=graph_breaks,recompiles."
            )

    def require_adapters(self) -> None:
        """Raise unless the LoRA of every targeted module of the named adapters ran."""
        if not self.uses_adapters:
            return
        if not self.pools:
            adapters = sorted({n for n in self.names if n is not None})
            raise LoraNotRunError(
                f"rows ask for adapters {adapters}, but no fxlora graph ran: the model ran outside the "
                "compiled graphs (Dynamo's recompile limit was hit, or nothing compiled with the fxlora backend "
                "was called inside use_adapters). See TORCH_LOGS=recompiles."
            )
        for pool_id, (_, needed) in self._held.items():
            self.require(needed, self.pools[pool_id])


def _to_slot_tensor(slots: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int32).to(device, non_blocking=True)


_selection: contextvars.ContextVar[Selection | None] = contextvars.ContextVar("fxlora_selection", default=None)


@contextlib.contextmanager
def selecting(selection: Selection) -> Iterator[Selection]:
    """Calls inside the block serve ``selection``; its slots are released when it ends."""
    token = _selection.set(selection)
    try:
        yield selection
    finally:
        _selection.reset(token)
        selection.release()


@contextlib.contextmanager
def use_adapters(adapter_names: Sequence[str | None] | None) -> Iterator[None]:
    """Rows of calls made inside run with these adapters (``None``: the base model). If a
    row's adapter did not run on every module it targets (part of the model ran outside
    the compiled graphs), the block raises :class:`LoraNotRunError` instead of returning
    base outputs for that row."""
    selection = Selection(names=check_names(adapter_names))
    with selecting(selection):
        yield
        selection.require_adapters()


def check_names(adapter_names: Sequence[str | None] | None) -> tuple[str | None, ...] | None:
    """``adapter_names`` as a tuple with PEFT's ``"__base__"`` read as ``None``, refusing a
    single string (a slip for a list of one)."""
    if adapter_names is None:
        return None
    if isinstance(adapter_names, str):
        raise AdapterError(
            f"adapter_names must be a sequence with one name (or None) per row, got the string {adapter_names!r}: "
            f"write [{adapter_names!r}] for one row"
        )
    return tuple(None if n == BASE_NAME else n for n in adapter_names)


@contextlib.contextmanager
def use_slots(slot_ids: torch.Tensor | None, batch: torch.Tensor | None = None) -> Iterator[Selection]:
    """Calls made inside run ``lora`` with these per-row slot ids (int32, on the graphs'
    device, :data:`NO_ADAPTER` for no adapter), or ``nolora`` when ``slot_ids`` is None;
    ``batch``: the input whose first dimension the rows are."""
    with selecting(Selection(fixed=slot_ids, batch=batch)) as selection:
        yield selection


_warned: weakref.WeakSet[AdapterPool] = weakref.WeakSet()


def warn_unnamed(pool: AdapterPool) -> None:
    """Once per pool: a call that names no adapters while some are loaded runs the base model."""
    if pool.adapters and pool not in _warned:
        _warned.add(pool)
        log.warning(
            "a call names no adapters while %s are loaded: every row runs the base model. Pass adapter_names "
            "(or use fxlora.use_adapters under torch.compile), with None for base-model rows",
            sorted(pool.adapters),
        )


def current_selection() -> Selection | None:
    return _selection.get()


__all__ = ["NO_ADAPTER", "Router", "Selection", "current_selection", "use_adapters", "use_slots"]


class Router:
    """Runs one compiled graph's ``lora`` or ``nolora`` variant, as the current names ask."""

    def __init__(
        self,
        variants: Variants,
        pool: AdapterPool,
        device: torch.device,
        graphs: GraphSet | None = None,
        lock: threading.RLock | None = None,
        owner: object = None,
        inner: str = "eager",
    ):
        """``graphs``: replay the variants from CUDA graphs captured per input signature;
        ``lock``: held while a variant runs (the graphs of one backend share memory);
        ``owner``: what made the router, kept alive as long as Dynamo keeps the graph;
        ``inner``: the inner compiler of both variants (:mod:`fxlora.compiler.inner`)."""
        self.pool, self.device = pool, device
        self.owner = owner
        self.lock = lock or threading.RLock()
        self.graphs = graphs
        self.lora_modules = variants.rewritten
        self.left_traced = variants.left_traced
        candidates = (("lora", variants.lora), ("nolora", variants.nolora)) if graphs is not None else ()
        self.uncapturable = {v: cpu_work(g) for v, g in candidates if g is not None}
        self.lora = compile_inner(variants.lora, inner) if variants.lora is not None else None
        self.nolora = compile_inner(variants.nolora, inner)

    def __call__(self, *args):
        selection = _selection.get()
        if selection is None:
            warn_unnamed(self.pool)
            selection = Selection()
        slot_ids = selection.slot_ids(self.pool, self.device)
        if slot_ids is not None and self.left_traced:
            selection.left_traced.update(self.left_traced)
        if slot_ids is None or self.lora is None:
            return self._run("nolora", args)
        selection.modules |= self.lora_modules  # a graph runs whole or raises
        return self._run("lora", (*args, slot_ids))

    def _run(self, variant: str, args: tuple):
        fn = getattr(self, variant)
        with self.lock:
            if self.graphs is None:
                return fn(*args)
            return self.graphs.call((id(self), variant), fn, args, self.uncapturable[variant])
