"""The ``fxlora`` Dynamo backend: run the pass pipeline on each graph Dynamo hands over and
return a :class:`Router` over its ``lora`` and ``nolora`` variants.

``fxlora.compile`` builds a :class:`Backend` around its own pool; ``torch.compile(...,
backend="fxlora", options={...})`` reaches :func:`fxlora_backend` through the
``torch_dynamo_backends`` entry point, which keeps one backend (and pool) per options dict,
so every graph of one ``torch.compile`` call shares its adapters. With ``"cuda_graphs":
True`` the routers replay their variants from CUDA graphs of one shared :class:`GraphSet`,
captured per input signature on first use.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx

from fxlora.adapters import AdapterPool, read_adapter
from fxlora.compiler import progress
from fxlora.compiler.arena import Arena
from fxlora.compiler.context import PassContext
from fxlora.compiler.inner import resolve as resolve_inner
from fxlora.compiler.module_tree import ModuleTree
from fxlora.errors import AdapterError, TraceError
from fxlora.passes import Variants, run_pipeline
from fxlora.runtime import peft_methods
from fxlora.runtime.cuda_graphs import GraphSet
from fxlora.runtime.explain import GraphRecord
from fxlora.runtime.instances import Instances
from fxlora.runtime.routing import Router, check_adapter_keywords, compiling, current_selection, watch_calls

log = logging.getLogger(__name__)

OPTIONS = ("adapters", "max_loras", "max_rank", "max_cpu_loras", "target_modules", "cuda_graphs", "inner")


class Backend:
    """A Dynamo backend bound to one adapter pool."""

    def __init__(
        self, pool: AdapterPool, cuda_graphs: bool = False, modules: ModuleTree | None = None, inner: str | None = None
    ):
        """``modules``: the model's module tree, which attributes traced calls to modules by
        identity; without it, by the paths Dynamo records. ``inner``: the inner compiler,
        ``"inductor"`` or ``"eager"`` (default: Inductor for graphs on CUDA, eager elsewhere)."""
        if inner is not None:
            resolve_inner(inner, torch.device("cpu"))  # a bad name fails here, not at the first graph
        self.pool = pool
        self.inner = inner
        self.modules = modules
        # One call at a time runs the graphs: they share the arena, the CUDA graphs' memory
        # pool and (under generate) the KV cache. Other threads wait here.
        self.lock = threading.RLock()
        self.cuda_graphs = cuda_graphs
        self.graphs: GraphSet | None = None  # made for the first graph's device
        self.arena = Arena()
        self.routers: list[Router] = []
        self.records: list[GraphRecord] = []  # one per traced graph, for explain()
        self.rewritten: dict[str, str] = {}  # module FQN -> the LoRA op it became, over all graphs
        self.notes: list[str] = []  # about the model as a whole, for explain()
        self.options: Mapping[str, Any] | None = None  # the torch.compile options it was made from
        self._breaks_before = dict(torch._dynamo.utils.counters["graph_break"])
        # under torch.compile: the models whose frames it compiled, and the modules hooked in each
        self._watched: weakref.WeakKeyDictionary[torch.nn.Module, set[str]] = weakref.WeakKeyDictionary()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Backend:
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown fxlora option(s) {sorted(unknown)}; known: {list(OPTIONS)}")
        if not isinstance(options.get("cuda_graphs", False), bool):
            raise TypeError(f"fxlora option 'cuda_graphs' must be True or False, got {options['cuda_graphs']!r}")
        targets = options.get("target_modules")
        if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, (list, tuple, set)) and all(isinstance(t, str) for t in targets)
        ):
            raise TypeError(f"fxlora option 'target_modules' must be a name pattern or a list of names, got {targets!r}")
        adapters = options.get("adapters") or {}
        if not isinstance(adapters, Mapping):
            kind = type(adapters).__name__
            raise TypeError(f"fxlora option 'adapters' must map adapter names to sources, got {kind}")
        pool = AdapterPool(
            max_loras=options.get("max_loras", 8),
            max_rank=options.get("max_rank", 64),
            target_modules=options.get("target_modules"),
            max_cpu_loras=options.get("max_cpu_loras"),
        )
        backend = cls(pool, cuda_graphs=options.get("cuda_graphs", False), inner=options.get("inner"))
        for name, source in adapters.items():
            backend.load(name, source)
        return backend

    def load(self, name: str, source: Any) -> None:
        """Read an adapter and load it into a free slot of the pool."""
        self.pool.load(read_adapter(name, source))
        for model in list(self._watched):
            self._hook(model)

    def watch(self, model: torch.nn.Module) -> None:
        """Under ``torch.compile``: hook the modules of ``model``, whose frame Dynamo compiles,
        that the adapters change, so that a call of one outside the graphs (code Dynamo skipped:
        ``torch.compiler.disable``, a frame it gave up on) is seen and adapter rows raise. A
        model's first frame is its own; a later frame of one of its submodules (after a graph
        break) adds nothing. ``fxlora.compile`` hooks its model itself."""
        if self.modules is not None or model in self._watched:
            return
        if any(model is m for root in list(self._watched) for m in root.modules()):
            return
        self._watched[model] = set()
        self._hook(model)

    def _hook(self, model: torch.nn.Module) -> None:
        hooked = self._watched[model]
        owners = {}
        for fqn in {fqn for adapter in list(self.pool.adapters.values()) for fqn in adapter.modules} - hooked:
            hooked.add(fqn)
            parent, _, leaf = fqn.rpartition(".")
            for owner in (fqn, parent):  # a module, or the module of a targeted parameter
                try:
                    module = model.get_submodule(owner)
                except AttributeError:
                    continue
                if owner == fqn or isinstance(getattr(module, leaf, None), torch.nn.Parameter):
                    owners[fqn] = owner
                break
        watch_calls(model, owners)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **_: Any) -> Router:
        inner = resolve_inner(self.inner, _first_device(example_inputs))
        ctx = self._context(example_inputs, inner)
        start = time.perf_counter()
        with progress.bar(f"fxlora: compiling {_role.get()} graph"):  # the passes, then the inner compiler's regions
            with compiling():
                variants = run_pipeline(gm, ctx)
            passes = time.perf_counter() - start
            devices = {self.pool.targets[fqn].info.device for fqn in variants.rewritten}
            device = devices.pop() if len(devices) == 1 else _first_device(example_inputs)
            if self.cuda_graphs and self.graphs is None:
                self.graphs = GraphSet(device, enabled=True)
            record = GraphRecord.of(len(self.routers), _role.get(), variants, ctx.records, inner)
            rebuild = functools.partial(self._rebuild, gm, record, inner)
            instances = Instances(variants, example_inputs, self.modules, rebuild)
            # without the model's tree (torch.compile) modules are named from the compiled frame
            named = set() if self.modules is not None else {n.meta["fxlora_module"] for n in variants.nolora.graph.nodes if "fxlora_module" in n.meta}
            router = Router(  # compiles the variants
                instances, self.pool, device, self.graphs, self.lock,
                owner=self, inner=inner, graph_breaks=self.graph_breaks, frame_names=frozenset(named),
            )  # fmt: skip
        record.regions = router.regions()
        self.routers.append(router)
        self.records.append(record)
        self.rewritten.update(ctx.rewritten)
        total = time.perf_counter() - start
        log.info("compiled %s (passes %.1f s, %s %.1f s)", next(iter(record.lines())).strip(), passes, inner, total - passes)
        return router

    def _context(self, inputs: list[Any], inner: str, renamed: dict[str, str] | None = None) -> PassContext:
        """The passes' context for a graph whose placeholders get ``inputs``, compiled by ``inner``."""
        selection, on_cuda = current_selection(), _first_device(inputs).type == "cuda"
        # what the runtime replays as CUDA graphs: decode steps, and prefills wherever their shape
        # is captured (the same trace runs eagerly elsewhere: the delta made beside the GEMMs
        # moves there the bytes the in-place one does, and adds no launch)
        captured = self.cuda_graphs or _role.get() in ("decode step", "prefill")
        return PassContext(
            self.pool,
            arena=self.arena if inner == "eager" else None,  # Inductor plans the graph's memory itself
            inputs=list(inputs),
            modules=self.modules,
            decode_attention=on_cuda,
            shrink_ahead=on_cuda and captured,
            batch=selection.batch if selection is not None else None,
            renamed=renamed,
        )

    def _rebuild(
        self, gm: fx.GraphModule, record: GraphRecord, inner: str, renamed: dict[str, str], inputs: list[Any]
    ) -> Variants:
        """The variants of ``gm`` for another instance of the code it was traced from."""
        ctx = self._context(inputs, inner, renamed)
        with compiling():
            variants = run_pipeline(gm, ctx)
        self.rewritten.update(ctx.rewritten)
        record.instances += 1
        # what another instance left as traced, or was told of; how it was served is the traced graph's
        record.records += [r for r in ctx.records if r.kind != "served" and r not in record.records]
        return variants

    def graph_breaks(self) -> list[str]:
        """What Dynamo said of each graph break it recorded since this backend was made."""
        seen = torch._dynamo.utils.counters["graph_break"]
        return [reason.strip().splitlines()[0] for reason, n in seen.items() if n > self._breaks_before.get(reason, 0)]

    def describe_runtime(self) -> list[str]:
        """The CUDA graphs of ``torch.compile(..., options={"cuda_graphs": True})``."""
        if self.graphs is None:
            return []
        if not self.graphs.enabled:
            return [f"CUDA graphs: off, {self.graphs.fallback_reason}"]
        return [
            f"CUDA graphs: {len(self.graphs._calls)} captured (one per variant and input signature) in "
            f"{self.graphs.capture_seconds:.1f} s"
        ]


_role: contextvars.ContextVar[str] = contextvars.ContextVar("fxlora_graph_role", default="forward")


@contextlib.contextmanager
def tracing_as(role: str) -> Iterator[None]:
    """Graphs traced inside the block are reported as ``role`` ("prefill", "decode step")."""
    token = _role.set(role)
    try:
        yield
    finally:
        _role.reset(token)


def _first_device(example_inputs: list[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


# The backend of each live options dict: a backend keeps its dict alive (so ids stay unique)
# and its graphs keep the backend alive; when Dynamo drops them, the pool goes too.
_BACKENDS: weakref.WeakValueDictionary[int, Backend] = weakref.WeakValueDictionary()

# Dynamo's cache entries per code object before it runs the code eagerly. Under
# ``torch.compile`` every transformers model is traced from one shared ``forward`` wrapper,
# a few entries per model (sizes of 1 are specialised); the default of 8 serves two or three.
RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Raise Dynamo's recompile limit to :data:`RECOMPILE_LIMIT`, in the calling thread: Dynamo's
    config is kept per thread, so a call from another thread (a serving loop, a worker) starts
    at the default again."""
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        log.info("raising torch._dynamo.config.recompile_limit to %d", RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT


def fxlora_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    """Entry point for ``torch.compile(model, backend="fxlora", options={...})``.

    PyTorch hands ``options`` to a backend only with a graph, on the compiled model's first
    call, so the backend is made, and its adapters read and checked, then. Dynamo wraps
    whatever a backend raises in its own ``BackendCompilerFailed``; a bad option or adapter
    therefore comes back as a graph that raises the error itself, as it is, from every call.
    """
    options = options if options is not None else {}
    backend = _BACKENDS.get(id(options))
    if backend is None:
        try:
            backend = Backend.from_options(options)
        except (ValueError, TypeError) as e:  # AdapterError is a ValueError
            return _raising(e)
        backend.options = options
        _BACKENDS[id(options)] = backend
        raise_recompile_limit()
    try:
        model, keywords = _compiled_call()
        check_adapter_keywords(keywords, _parameters(model), TORCH_COMPILE_SPELLING)
        if model is not None:
            peft_methods.guard(model, backend.load, backend.pool.unload)
            backend.watch(model)
        return backend(gm, example_inputs)
    except (AdapterError, TypeError) as e:  # an adapter that does not fit a module this graph brought in, or a bad call
        return _raising(e)


TORCH_COMPILE_SPELLING = (
    "Under torch.compile rows take adapters from fxlora.use_adapters: `with fxlora.use_adapters([...]): "
    "compiled(...)`, one name (or None for the base model) per row"
)


def _compiled_call() -> tuple[torch.nn.Module | None, set[str]]:
    """The module and the keywords of the call whose frame Dynamo is compiling. Dynamo guards on
    the keywords a frame was called with, so a call with other keywords compiles anew and is
    checked here too."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        local = dict(tx.f_locals)
    except Exception:  # noqa: BLE001 - not inside Dynamo's tracing, or another torch: nothing to read
        return None, set()
    keywords = {k for name, v in local.items() if name == "kwargs" and isinstance(v, dict) for k in v}
    candidates = [*local.values(), *(local.get("args") or ())]
    model = next((v for v in candidates if isinstance(v, torch.nn.Module)), None)
    return model, keywords


def _parameters(model: torch.nn.Module | None) -> set[str]:
    if model is None:
        return set()
    params = inspect.signature(model.forward).parameters.values()
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}


def _raising(error: Exception) -> Callable[..., Any]:
    traceback = error.__traceback__

    def refuse(*args: Any) -> Any:
        raise error.with_traceback(traceback)

    return refuse


@contextlib.contextmanager
def dynamo_errors(model: torch.nn.Module) -> Iterator[None]:
    """Dynamo's failure to trace or compile ``model`` in the block, raised as a
    :class:`~fxlora.errors.TraceError` naming why, where in the model, and the torch version."""
    try:
        yield
    except torch._dynamo.exc.TorchDynamoException as e:
        raise trace_error(e, model) from e


def trace_error(error: Exception, model: torch.nn.Module) -> TraceError:
    text = str(error)
    reason = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    # the last frame of the user code Dynamo was tracing, past fxlora's own wrapper
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text.partition("from user code:")[2])
    frames = [f for f in frames if "/fxlora/" not in f[0].replace("\\", "/")] or frames
    where = f" at {frames[-1][0]}:{frames[-1][1]} (in {frames[-1][2]})" if frames else ""
    return TraceError(
        f"torch.compile (Dynamo, torch {torch.__version__}) could not trace {type(model).__name__}{where}: "
        f"{type(error).__name__}: {reason}. fxlora serves LoRA inside the graphs Dynamo traces; see the cause below, "
        "and TORCH_LOGS=graph_breaks for where it stopped"
    )
