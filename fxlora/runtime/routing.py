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
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.hooks import RemovableHandle

from fxlora.adapters import NO_ADAPTER, AdapterPool
from fxlora.adapters.peft_format import BASE_NAME
from fxlora.compiler.inner import compile_inner
from fxlora.errors import AdapterError, AdapterWarning, LoraNotRunError
from fxlora.passes import Variants
from fxlora.runtime.cuda_graphs import GraphSet, cpu_work
from fxlora.runtime.instances import Instances

log = logging.getLogger(__name__)


@dataclass
class Selection:
    """The rows' adapters for the calls of one block, and what the graphs served.

    ``names`` (one per row, ``None`` for the base model) are resolved once per pool: the
    slots are pinned (an adapter unloaded meanwhile keeps its weights until :meth:`release`)
    and the modules the adapters change are noted. ``fixed`` slot ids serve every graph as
    they are. ``batch``, when the caller knows it, is the input whose first dimension the
    rows are: a graph traced in the call finds its rows through it. Code Dynamo does not
    compile (a graph break, a frame it gave up on) runs the plain model; the record of the
    call is how a caller notices, instead of returning base outputs for adapter rows:
    ``pools``, the pools the graphs read; ``modules``, the targets whose LoRA ran in a graph;
    ``left_traced``, the targets a graph called but left as traced, and why; ``eager``,
    targets called outside the graphs (seen by :func:`watch_calls`' hooks); ``unknown``, a
    graph ran for module instances it could not name. With ``watched`` (every target's eager
    calls are seen), a target none of these saw was not called at all, and needs no LoRA (as
    in PEFT)."""

    names: tuple[str | None, ...] | None = None
    fixed: torch.Tensor | None = None
    batch: torch.Tensor | None = None  # the input whose first dimension the rows are counted by
    watched: bool = False
    pools: dict[int, AdapterPool] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)
    left_traced: dict[str, str] = field(default_factory=dict)  # target -> why a graph that ran left it as traced
    eager: set[str] = field(default_factory=set)
    unknown: bool = False
    graph_breaks: Callable[[], list[str]] = list  # the reasons Dynamo gave, for the error
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
        """Raise if a module in ``needed`` ran without its LoRA, or (unless ``watched``) if
        its LoRA did not run; the error names the adapters of ``pool`` that need it."""
        if self.unknown and needed:
            raise LoraNotRunError(
                "a compiled graph ran for module instances other than those it was traced for, and fxlora cannot "
                "name them, so their LoRA did not run (a parameter replaced after compiling, or a graph Dynamo reused "
                "for another model). See explain() and TORCH_LOGS=recompiles."
            )
        if eager := needed & self.eager:
            breaks = self.graph_breaks()
            why = f"; Dynamo's graph breaks: {'; '.join(breaks[:3])}" if breaks else ""
            raise _not_run(
                eager,
                "it ran outside the compiled graphs (a graph break, code Dynamo skipped such as torch.compiler.disable, "
                f"or the model itself called where its compiled version was meant{why})",
            )
        if left := sorted(needed & self.left_traced.keys()):
            raise _not_run(
                left, f"fxlora left that module as traced, because {self.left_traced[left[0]]}", self._users(left[0], pool)
            )
        targets = needed if pool is None else needed & pool.targets.keys()  # (modules no graph brought in: not known to run)
        if not self.watched and (missing := targets - self.modules):
            raise _not_run(missing, "that code ran outside the compiled graphs (a graph break, or Dynamo's recompile limit was hit)")

    def _users(self, fqn: str, pool: AdapterPool | None) -> list[str]:
        """The adapters of this call that have LoRA for target ``fqn`` of ``pool``."""
        adapters = pool.adapters if pool is not None else {}
        return sorted(n for n in set(self.names or ()) - {None} if fqn in getattr(adapters.get(n), "modules", ()))

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


def _not_run(modules: set[str] | list[str], why: str, users: list[str] | None = None) -> LoraNotRunError:
    who = f"adapter(s) {users}: " if users else ""
    return LoraNotRunError(
        f"{who}the LoRA of {len(modules)} module(s), e.g. {sorted(modules)[0]!r}, did not run: {why}. See explain() "
        "and TORCH_LOGS=graph_breaks,recompiles."
    )


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
    if not isinstance(adapter_names, (list, tuple)):  # a set or a dict has no row order
        raise AdapterError(
            f"adapter_names must be a list or tuple with one name (or None) per row, in row order, got "
            f"{type(adapter_names).__name__}"
        )
    names = tuple(None if n == BASE_NAME else n for n in adapter_names)
    for row, name in enumerate(names):
        if name is not None and not isinstance(name, str):
            raise AdapterError(f"adapter_names[{row}] must be an adapter's name or None, got {type(name).__name__} {name!r}")
    return names


@contextlib.contextmanager
def use_slots(slot_ids: torch.Tensor | None, batch: torch.Tensor | None = None) -> Iterator[Selection]:
    """Calls made inside run ``lora`` with these per-row slot ids (int32, on the graphs'
    device, :data:`NO_ADAPTER` for no adapter), or ``nolora`` when ``slot_ids`` is None;
    ``batch``: the input whose first dimension the rows are."""
    with selecting(Selection(fixed=slot_ids, batch=batch)) as selection:
        yield selection


def warn_unnamed(pool: AdapterPool, stacklevel: int = 3) -> None:
    """A call that names no adapters while some are loaded runs the base model: an
    :class:`AdapterWarning` each time (Python's warning filters decide how often it shows)."""
    if pool.adapters:
        warnings.warn(
            f"a call names no adapters while {sorted(pool.adapters)} are loaded: every row runs the base model. Pass "
            "adapter_names (or use fxlora.use_adapters under torch.compile), with None for base-model rows",
            AdapterWarning,
            stacklevel=stacklevel,
        )


ADAPTER_WORDS = ("adapter", "lora")  # a keyword holding one of these looks like an adapter argument


def check_adapter_keywords(keywords: Iterable[str], accepted: Container[str], spelling: str) -> None:
    """Refuse a keyword that looks like an adapter argument but is not one the call takes
    (``accepted``): a model's ``**kwargs`` would swallow it and every row would run the base
    model. ``spelling`` says how the call takes adapters."""
    for key in keywords:
        if key not in accepted and any(word in key.lower() for word in ADAPTER_WORDS):
            raise TypeError(f"unexpected keyword {key}=: the model would ignore it and run the base model. {spelling}")


def current_selection() -> Selection | None:
    return _selection.get()


def watch_calls(model: torch.nn.Module, targets: dict[str, str]) -> list[RemovableHandle]:
    """Note in the current selection each call of a target's module (``targets``: target
    FQN -> its module's FQN) that runs outside the compiled graphs, by a forward pre-hook.
    Traced into a graph, the hook is nothing: a module a graph inlines is known from the
    graph. Returns the hooks' handles."""
    fqns: dict[str, list[str]] = {}
    for target, module in targets.items():
        fqns.setdefault(module, []).append(target)
    handles = []
    for m, t in fqns.items():
        module = model.get_submodule(m)
        handles.append(module.register_forward_pre_hook(_eager_call_hook(tuple(t), weakref.ref(module))))
    return handles


_compiling: contextvars.ContextVar[bool] = contextvars.ContextVar("fxlora_compiling", default=False)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Module calls inside the block are the compiler's own (probes of a region it replaces),
    not the model running outside the graphs."""
    token = _compiling.set(True)
    try:
        yield
    finally:
        _compiling.reset(token)


def _eager_call_hook(targets: tuple[str, ...], owner: Callable[[], torch.nn.Module | None]) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple) -> None:
        # (a copy of the model, copy.deepcopy's, holds the hook too: its calls are its own)
        if not torch.compiler.is_compiling() and not _compiling.get() and module is owner():
            selection = _selection.get()
            if selection is not None:
                selection.eager.update(targets)

    return hook


# Run eagerly, the hook would otherwise become a frame Dynamo compiles (where it is_compiling);
# traced inline, in a graph, it stays what it is.
torch._dynamo.eval_frame.skip_code(_eager_call_hook((), lambda: None).__code__)


__all__ = ["NO_ADAPTER", "Router", "Selection", "current_selection", "use_adapters", "use_slots", "watch_calls"]


class Router:
    """Runs one compiled graph's ``lora`` or ``nolora`` variant, as the current names ask,
    for the module instance the call's inputs belong to."""

    def __init__(
        self,
        instances: Instances,
        pool: AdapterPool,
        device: torch.device,
        graphs: GraphSet | None = None,
        lock: threading.RLock | None = None,
        owner: object = None,
        inner: str = "eager",
        graph_breaks: Callable[[], list[str]] = list,
        frame_names: frozenset[str] = frozenset(),
    ):
        """``graphs``: replay the variants from CUDA graphs captured per input signature;
        ``lock``: held while a variant runs (the graphs of one backend share memory);
        ``owner``: what made the router, kept alive as long as Dynamo keeps the graph;
        ``inner``: the inner compiler of the variants (:mod:`fxlora.compiler.inner`);
        ``graph_breaks``: Dynamo's reasons, for the error when a module ran outside;
        ``frame_names``: the modules the graph calls, named from the frame Dynamo compiled
        (``torch.compile``, without the model's tree), checked against each call's adapters."""
        self.instances, self.pool, self.device = instances, pool, device
        self.frame_names = frame_names
        self._frame_verdicts: dict[frozenset, str | None] = {}  # adapters -> why their LoRA cannot run here
        self.owner = owner
        self.lock = lock or threading.RLock()
        self.graphs = graphs
        self.inner = inner
        self.graph_breaks = graph_breaks
        self._compiled: dict[tuple[int, str], tuple[Variants, Callable[..., Any], str | None]] = {}
        for variant in ("lora", "nolora"):  # compiled now, while Dynamo's tracing context is current
            if getattr(instances.traced, variant) is not None:
                self._compiled_variant(instances.traced, variant)

    @property
    def lora(self) -> fx.GraphModule | None:
        return self.instances.traced.lora

    @property
    def nolora(self) -> fx.GraphModule:
        return self.instances.traced.nolora

    def __call__(self, *args):
        selection = _selection.get()
        if selection is None:
            warn_unnamed(self.pool)
            selection = Selection()
        slot_ids = selection.slot_ids(self.pool, self.device)
        if slot_ids is None:
            return self._run(self.instances.traced, "nolora", args)
        selection.graph_breaks = self.graph_breaks
        if self.frame_names:
            self._check_frame_names(selection)
        with self.lock:  # building another instance's variants runs the passes, which share the backend's records
            variants = self.instances.of(args)
        if variants is None:  # the instance's modules have no name: none of its LoRA runs
            selection.unknown = True
            return self._run(self.instances.traced, "nolora", args)
        # a graph runs whole or raises
        selection.modules |= variants.rewritten
        selection.left_traced.update(variants.left_traced)
        if variants.lora is None:
            return self._run(variants, "nolora", args)
        return self._run(variants, "lora", (*args, slot_ids))

    def _check_frame_names(self, selection: Selection) -> None:
        """Raise if a module of this graph is named from a frame other than the model's: a
        name that is not one of the call's adapters' modules but ends one (``q_proj`` of a frame
        Dynamo resumed inside an attention module after a graph break, or ``layers.0.…`` of a
        compiled submodule). Which module it is cannot be told, so its LoRA would not run. The
        verdict is kept per set of adapters (as loaded: a reload is another)."""
        adapters = {n: self.pool.adapters.get(n) for n in selection.names or () if n is not None}
        key = frozenset((n, id(a)) for n, a in adapters.items())
        if key not in self._frame_verdicts:
            if len(self._frame_verdicts) >= 64:  # (adapters read again are new objects: keep it small)
                self._frame_verdicts.clear()
            wanted = set().union(*(a.modules.keys() for a in adapters.values() if a is not None))
            endings = {w.split(".", i)[-1]: w for w in sorted(wanted) for i in range(1, w.count(".") + 1)}
            clash = sorted((self.frame_names - wanted) & endings.keys())
            self._frame_verdicts[key] = (
                None if not clash else (
                    f"adapter(s) {sorted(adapters)}: a graph Dynamo compiled names module {clash[0]!r} from the frame it "
                    f"compiled, not from the model (after a graph break inside a module, or torch.compile of a "
                    f"submodule), so fxlora cannot tell whether it is {endings[clash[0]]!r} and its LoRA would not run. "
                    "Compile the whole model, without graph breaks inside its modules (TORCH_LOGS=graph_breaks), or use "
                    "fxlora.compile"
                )
            )  # fmt: skip
        if (error := self._frame_verdicts[key]) is not None:
            raise LoraNotRunError(error)

    def _compiled_variant(self, variants: Variants, variant: str) -> tuple[Callable[..., Any], str | None]:
        """``variant`` of ``variants`` compiled by the inner compiler, and why it must run
        without CUDA graphs (None: it may be captured)."""
        key = (id(variants), variant)
        if key not in self._compiled:
            graph = getattr(variants, variant)
            uncapturable = cpu_work(graph) if self.graphs is not None else None
            # holding ``variants`` keeps its id from naming another while the entry lives
            self._compiled[key] = (variants, compile_inner(graph, self.inner), uncapturable)
        return self._compiled[key][1:]

    def regions(self) -> dict[str, str]:
        """How the inner compiler split each variant of the traced graph into regions, if it did."""
        compiled = {variant: self._compiled_variant(self.instances.traced, variant)[0] for variant in ("lora", "nolora")
                    if getattr(self.instances.traced, variant) is not None}  # fmt: skip
        return {v: fn.regions.describe() for v, fn in compiled.items() if getattr(fn, "regions", None) is not None}

    def _run(self, variants: Variants, variant: str, args: tuple):
        fn, uncapturable = self._compiled_variant(variants, variant)
        with self.lock:
            if self.graphs is None:
                return fn(*args)
            return self.graphs.call((id(self), id(variants), variant), fn, args, uncapturable)
