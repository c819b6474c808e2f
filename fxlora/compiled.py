"""``fxlora.compile``: a user's model and PEFT adapters in, a multi-adapter model out.

``compile`` reads the adapters, checks them against every module of the model, packs them
into an :class:`AdapterPool`, and compiles the model with ``torch.compile`` and the fxlora
backend. The :class:`CompiledModel` it returns takes ``adapter_names`` (one per row) on
every call, and loads or unloads adapters into pool slots without retracing.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import math
import os
import types
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from fxlora.adapters import AdapterPool, experts, model_modules, placement, read_adapter, sharding
from fxlora.adapters.peft_format import AdapterSource, LoraAdapter, directory_stamp
from fxlora.adapters.quantization import check_quantized
from fxlora.compiler import experts_op, progress
from fxlora.compiler.experts_probe import choose_layout
from fxlora.compiler.inner import resolve as resolve_inner
from fxlora.compiler.module_tree import ModuleTree
from fxlora.errors import AdapterError, NotServed
from fxlora.runtime import Backend, peft_methods
from fxlora.runtime.backend import dynamo_errors, raise_recompile_limit
from fxlora.runtime.engine import Engine
from fxlora.runtime.explain import report
from fxlora.runtime.generation import PREFILL_GRAPH_TOKENS, DecodeRuntime
from fxlora.runtime.generation_config import resolve as resolve_generation
from fxlora.runtime.routing import Selection, check_adapter_keywords, check_names, selecting, warn_unnamed, watch_calls
from fxlora.runtime.sequence import GenerationOutput
from fxlora.runtime.serving import (
    Requests,
    ServingManager,
    StreamOptions,
    check_call_arguments,
    generate_batch,
    make_engine,
)

log = logging.getLogger(__name__)

SPELLING = "Rows take adapters as adapter_names=[...], one name (or None for the base model) per row"


class CompiledModel(torch.nn.Module):
    """A model compiled for mixed batches of LoRA adapters.

    Call it as the model, plus ``adapter_names=[...]``: one entry per row, an adapter name
    or ``None`` for the base model. It returns what the model returns.
    """

    def __init__(self, model: torch.nn.Module, backend: Backend, compiled: Any, runtime_options: Mapping[str, Any]):
        super().__init__()
        self.model = model
        self._backend = backend
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: it wraps `model`
        self._runtime_options = dict(runtime_options)
        self._runtime: DecodeRuntime | None = None
        self._engine: tuple[StreamOptions, Engine] | None = None  # the request stream's, with its options
        self._manager: ServingManager | None = None
        self._device = next(model.parameters()).device
        self._group = sharding.process_group(model)  # the tensor-parallel ranks' group, or None
        self._forward_keywords = frozenset(inspect.signature(model.forward).parameters)

    @property
    def pool(self) -> AdapterPool:
        return self._backend.pool

    @property
    def backend(self) -> Backend:
        """The Dynamo backend serving this model: its pool, arena, compiled graphs and the
        modules each graph rewrote."""
        return self._backend

    @property
    def adapter_names(self) -> list[str]:
        """Names of the adapters loaded now (in a GPU slot or in the host tier), in load order."""
        return list(self.pool.adapters)

    @property
    def config(self) -> Any:
        """The model's config."""
        return self.model.config

    @property
    def generation_config(self) -> Any:
        """The model's generation config, which ``generate`` reads."""
        return getattr(self.model, "generation_config", None)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def compile_count(self) -> int:
        """How many graphs have been traced and compiled so far (a retrace adds one)."""
        return len(self._backend.routers)

    @torch.no_grad()
    def forward(self, *args: Any, adapter_names: Sequence[str | None] | None = None, **kwargs: Any) -> Any:
        """The model's forward over a mixed batch. It serves inference (fxlora's ops have no
        backward): every call runs without autograd, whatever the caller's grad mode, so a
        call in another mode (a new thread's is on) runs the graphs already compiled."""
        check_adapter_keywords(kwargs, self._forward_keywords, SPELLING)
        self._refuse_while_serving_sharded("a call of the model")
        names = check_names(adapter_names)
        # Views of a larger tensor would make Dynamo guard on their base and offset and
        # retrace for each new slicing; a private copy of such small inputs avoids that.
        args = tuple(_own(a) for a in args)
        kwargs = {k: _own(v) for k, v in kwargs.items()}
        batch = _batch_input(args, kwargs)  # graphs traced in this call find their rows through it
        rows = batch.shape[0] if batch is not None and batch.dim() > 0 else None
        if rows == 0:
            raise ValueError("the batch has 0 rows: call with at least one")
        if names is None:
            warn_unnamed(self.pool, stacklevel=6)  # the caller's line, past no_grad's wrapper and Module.__call__
        elif rows is not None and len(names) != rows:
            raise AdapterError(f"adapter_names has {len(names)} entries but the batch has {rows} rows")
        for t in (*args, *kwargs.values()):
            mark_batch_dims_dynamic(t)
        first = not self._backend.records
        if first:
            log.info("tracing and compiling %s: the first call of each input layout takes a while", type(self.model).__name__)
        raise_recompile_limit()  # in this thread: Dynamo's config is per thread
        with selecting(Selection(names=names, batch=batch, watched=True)) as selection:
            selection.slot_ids(self.pool, self._device)  # resolved once, here: unknown names fail before any work
            shown = progress.waiting(f"fxlora: tracing {type(self.model).__name__} (first call)") if first else nullcontext()
            with self._backend.lock, shown, dynamo_errors(self.model):
                out = self._compiled(*args, **kwargs)
            selection.require_adapters()
        return out

    def prepare(self) -> DecodeRuntime:
        """Build the generation runtime now rather than on the first ``generate``: the KV
        cache and static buffers, and on CUDA the decode graphs of every batch bucket."""
        with self._backend.lock:
            if self._runtime is None:
                self._runtime = DecodeRuntime(self.model, self._compiled, self._backend, **self._runtime_options)
        return self._runtime

    # -- the request stream ---------------------------------------------------------------------
    def serve(self, *, generation_config: Any = None, **options: Any) -> ServingManager:
        """A serving loop for a stream of requests, run on a background thread: use it as
        ``with cm.serve() as manager:``, then ``manager.add_request(...)``,
        ``get_result``, ``request_id_iter``, ``cancel_request`` from any thread.
        ``generation_config`` gives the requests' defaults (else the model's); ``options`` are
        :class:`~fxlora.runtime.serving.StreamOptions` fields (``max_batch_size``,
        ``max_len``, ``kv_cache_memory``, ``block_size``, ...), by default the compile's."""
        with self._backend.lock:
            if self._manager is not None and self._manager.is_running():
                raise RuntimeError("this model is already serving: stop the running manager first (manager.stop())")
            self._manager = ServingManager(self._requests(options, generation_config))
        return self._manager

    @torch.no_grad()
    def generate_batch(
        self,
        inputs: Sequence[Sequence[int]],
        adapter_names: Sequence[str | None] | None = None,
        max_new_tokens: int | Sequence[int] | None = None,
        *,
        generation_config: Any = None,
        progress_bar: bool = True,
        **settings: Any,
    ) -> list[GenerationOutput]:
        """Generate for every input (a list of token-id lists of any lengths) with continuous
        batching, each with its own adapter (``adapter_names``, one per input or None) and
        settings; returns one :class:`GenerationOutput` per input, in input order. Any setting
        (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
        ``min_new_tokens``) may be one value or a list of one per input; ``eos_token_id`` /
        ``stop_token_ids`` are per input when given as a list of lists (or Nones). A bad input
        finishes with ``finish_reason="error"`` and the others run. While a serving loop runs
        (``cm.serve()``), the inputs go through it. transformers' call arguments are taken at the
        value fxlora serves (``warmup=True``, ``persistent_manager=True``,
        ``record_timestamps=False``, no ``continuous_batching_config``) and refused otherwise."""
        check_call_arguments(adapter_names, settings)
        settings["max_new_tokens"] = max_new_tokens
        per_input = {}
        for key, value in list(settings.items()):
            if key in ("eos_token_id", "stop_token_ids"):
                if isinstance(value, (list, tuple)) and value and all(v is None or isinstance(v, (list, tuple)) for v in value):
                    per_input[key] = settings.pop(key)
            elif isinstance(value, (list, tuple)):
                per_input[key] = settings.pop(key)
        manager = self._manager if self._manager is not None and self._manager.serving else None
        requests = self._requests({}, generation_config, remember_settings=True)
        return generate_batch(requests, inputs, adapter_names, per_input, settings, progress_bar, manager)

    def _requests(self, options: Mapping[str, Any], generation_config: Any, remember_settings: bool = False) -> Requests:
        """The request builder over this model's engine, built (or rebuilt, for other options) now."""
        defaults = {k: self._runtime_options[k] for k in ("max_batch_size", "max_len", "cuda_graphs", "prefill_graph_tokens")}
        # the compile's batch buckets hold for its max_batch_size; another size takes its own defaults
        same = options.get("max_batch_size", defaults["max_batch_size"]) == defaults["max_batch_size"]
        buckets = _tuple(self._runtime_options["buckets"]) if same else None
        wanted = StreamOptions(**{**defaults, "buckets": buckets, **options})
        with self._backend.lock:
            if self._engine is None or (options and self._engine[0] != wanted):
                engine = make_engine(self.model, self._compiled, self._backend, wanted, self._group)
                self._engine = (wanted, engine)
            engine = self._engine[1]
        vocab = getattr(self.config.get_text_config(decoder=True), "vocab_size", None)
        return Requests(engine, self.pool, self.generation_config, generation_config, vocab, remember_settings)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        *,
        adapter_names: Sequence[str | None] | None = None,
        generation_config: Any = None,
        generator: torch.Generator | None = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Generate new tokens for every row, each row with its own adapter (or none), as
        transformers' ``generate`` would: the settings are the model's ``generation_config``
        (or ``generation_config``), overridden by the keywords (any ``GenerationConfig`` field:
        ``max_new_tokens``, ``max_length``, ``min_new_tokens``, ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``eos_token_id``, ``pad_token_id``; ``eos_token_id=()`` means none).
        Settings fxlora does not serve are refused by name. ``input_ids`` is a tensor or a list
        of token-id lists (of any lengths); without ``attention_mask`` the padding is read from
        ``pad_token_id`` as transformers does. Returns the prompts, left-padded, followed by the
        new tokens; a row that produced an end token is padded with the pad token after it.
        Sampling draws from ``generator``; ``streamer`` (transformers' ``BaseStreamer``) gets
        the tokens step by step."""
        check_adapter_keywords(kwargs, (), SPELLING)
        self._refuse_while_serving_sharded("generate")
        if "stop_strings" in kwargs or "tokenizer" in kwargs:
            raise TypeError(
                "stop_strings / tokenizer are not supported by fxlora's generate (it stops on token ids): pass the "
                "stop strings' token ids as eos_token_id"
            )
        settings = resolve_generation(self.generation_config, generation_config, **kwargs)
        vocab = getattr(self.config.get_text_config(decoder=True), "vocab_size", None)
        settings.check_tokens(vocab)
        input_ids, attention_mask = batch_of_prompts(input_ids, attention_mask, settings.pad_token_id, vocab)
        names = check_names(adapter_names)
        if names is None:
            warn_unnamed(self.pool, stacklevel=4)  # the caller's line, past no_grad's wrapper
        return self.prepare().generate(
            input_ids, attention_mask, adapter_names=names, settings=settings, generator=generator, streamer=streamer
        )

    def load_adapter(self, source: AdapterSource, adapter_name: str | None = None) -> None:
        """Load an adapter into a free slot, as PEFT's ``load_adapter(path, adapter_name=...)``:
        graphs are not retraced. On any error nothing changes. ``source`` is a PEFT adapter
        directory, a ``(config, state_dict)`` pair or a ``{"config": ..., "state_dict": ...}``
        mapping. fxlora's earlier order, ``load_adapter(name, source)``, is read too where the
        arguments tell it: a name (no directory, nothing like a path) first, then a source that
        is not a string or is a directory."""
        if isinstance(source, str) and adapter_name is not None and not _is_dir(source) and not _path_like(source):
            if not isinstance(adapter_name, str) or _is_dir(adapter_name):
                source, adapter_name = adapter_name, source  # load_adapter(name, source)
        self._load(adapter_name, source)  # name and source are checked with the adapter (on every rank)

    def _load(self, name: str | None, source: AdapterSource) -> None:
        if self._group is None:
            load(self.pool, self.model, name, source, None)
            return
        self._refuse_while_serving_sharded("load_adapter")
        with self._backend.lock:  # the ranks' agreement must not interleave with a call's collectives
            load(self.pool, self.model, name, source, self._group)

    def unload_adapter(self, name: str) -> None:
        """Remove an adapter from its slot (after the calls reading it return)."""
        self._refuse_while_serving_sharded("unload_adapter")
        self.pool.unload(name)

    def _refuse_while_serving_sharded(self, call: str) -> None:
        """Under tensor parallelism the ranks' loops admit rank 0's requests turn by turn, and a
        load's agreement, a call's and a ``generate``'s steps are collectives of their own: with a
        loop serving, the ranks would not meet in one order (a hang, or ranks holding other
        adapters). ``generate_batch`` goes through the loop instead."""
        if self._group is not None and self._manager is not None and self._manager.serving:
            raise RuntimeError(
                f"{call} while cm.serve() runs under tensor parallelism: every rank's loop would admit requests "
                "against other adapters, or wait in another collective; stop the loop (manager.stop()) first, or send requests through it"
            )

    def delete_adapter(self, adapter_names: str | Sequence[str]) -> None:
        """PEFT's name for :meth:`unload_adapter`; takes one name or several (each unloaded
        once, however often it is named), and unloads none if any is not loaded."""
        names = [adapter_names] if isinstance(adapter_names, str) else adapter_names
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise AdapterError(f"delete_adapter takes an adapter name or a list of names, got {adapter_names!r}")
        if missing := [n for n in names if n not in self.pool.adapters]:
            raise AdapterError(f"adapter(s) {missing} not loaded, so none was deleted; loaded: {sorted(self.pool.adapters)}")
        for name in dict.fromkeys(names):
            self.unload_adapter(name)

    def explain(self) -> str:
        """A report read top to bottom: the adapter pool (slots used and free, each adapter),
        every traced graph by role with its LoRA ops, what is not served and why, memory, and
        the terms it uses."""
        backend, runtime = self._backend, self._runtime
        memory = {}
        lines = backend.describe_runtime()
        if self._engine is not None:
            engine = self._engine[1]
            lines += engine.describe()
            memory["paged KV cache"] = f"{engine.runner.cache.nbytes / 2**20:.2f} MiB"
        if runtime is not None:
            lines += runtime.describe()
            memory["KV cache"] = f"{runtime.cache.nbytes / 2**20:.2f} MiB ({runtime.max_batch_size} rows x {runtime.max_len} tokens)"
            if runtime.graphs.graphs:
                memory["CUDA graph pool"] = f"{runtime.graphs.pool_bytes / 2**20:.2f} MiB"
        return report(
            f"fxlora: {type(self.model).__name__} compiled for mixed batches of LoRA adapters",
            backend.pool,
            backend.arena,
            backend.records,
            sorted(set(backend.pool.targets) - set(backend.rewritten)) if backend.records else [],
            backend.notes,
            lines,
            memory,
        )


def mark_batch_dims_dynamic(x: Any) -> None:
    """Trace the rows and positions of an input as sizes, so one graph serves every batch
    shape (Dynamo still specialises a size of 1)."""
    if isinstance(x, torch.Tensor):
        for d in range(min(x.dim(), 2)):
            if x.shape[d] > 1:
                torch._dynamo.maybe_mark_dynamic(x, d)


def _tuple(buckets: Sequence[int] | None) -> tuple[int, ...] | None:
    return tuple(buckets) if buckets is not None else None


def _is_dir(path: str) -> bool:
    return os.path.isdir(os.fspath(path))


def _path_like(text: str) -> bool:
    """Whether ``text`` reads as a path (a missing directory), never as an adapter's name."""
    return os.sep in text or "/" in text or text.startswith((".", "~"))


def batch_of_prompts(
    input_ids: Any, attention_mask: torch.Tensor | None, pad_token_id: int | None, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``generate``'s prompts as a 2-D tensor of at least one row and one token: a tensor as it
    is, or a list of token-id lists left-padded (with ``pad_token_id``, else 0) with its mask;
    every id checked against ``vocab_size`` (one read of the prompts, once per call)."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a tensor of input_ids; a list of token lists needs none")
        rows = [list(row) for row in input_ids]
        if not rows or not all(rows) or not all(isinstance(t, int) and not isinstance(t, bool) for r in rows for t in r):
            raise ValueError("input_ids as a list must hold one non-empty list of int token ids per row")
        width = max(map(len, rows))
        pad = pad_token_id if pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor or a list of token-id lists, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        shape = tuple(input_ids.shape)
        raise ValueError(f"input_ids must be (rows, tokens) with at least one of each, got shape {shape}")
    if vocab_size is not None and not input_ids.is_floating_point():
        outside = (input_ids < 0) | (input_ids >= vocab_size)
        if bool(outside.any()):
            row, column = (int(i) for i in outside.nonzero()[0])
            raise ValueError(
                f"input_ids[{row}, {column}] = {int(input_ids[row, column])} is not a token id of the model "
                f"(0 <= id < vocab_size={vocab_size})"
            )
    return input_ids, attention_mask


def _own(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) and x._base is not None else x


def _batch_input(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The input whose first dimension is the batch's rows."""
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


def compile(
    model: torch.nn.Module,
    adapters: Mapping[str, AdapterSource] | None = None,
    *,
    max_loras: int | None = 8,
    max_rank: int = 64,
    max_cpu_loras: int | None = None,
    lora_memory: int | None = None,
    target_modules: str | list[str] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    max_batch_size: int = 8,
    max_len: int = 512,
    batch_buckets: Sequence[int] | None = None,
    cuda_graphs: bool | None = None,
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
    inner: str | None = None,
) -> CompiledModel:
    """Compile ``model`` to serve mixed batches of LoRA adapters.

    ``adapters`` maps names to PEFT adapter directories, ``(config, state_dict)`` pairs or
    ``{"config": ..., "state_dict": ...}`` mappings, any number of them: ``max_loras`` is the
    GPU slots, and an adapter without one waits in the host tier (pinned host memory on CUDA)
    until a call names it, when it is copied into a free slot, or the least recently used one no
    call reads. ``max_cpu_loras`` bounds the adapters the host tier keeps; beyond it, adapters
    read from directories drop their factors and are read again when needed. ``lora_memory``
    (bytes, with ``max_loras=None``) gives the GPU slots as a memory budget instead: as many as
    fit over the targets at ``max_rank``. A ``peft.PeftModel`` brings its own
    adapters and base model. ``target_modules`` (PEFT syntax, ``"all-linear"`` included)
    reserves pool space for adapters loaded later; by default the modules of the given
    adapters are the targets, or every linear layer but the output head when none are given.
    The model itself is not modified, but for three settings: MoE experts that run transformers'
    eager loop (it reads routing on the host) are switched to its `grouped_mm` implementation,
    and modules whose own code loops over experts or segments on the host with no such
    implementation to switch to (LongCat-Flash's experts, transformers 5.17's Aria segment
    GEMMs) compute by ``fxlora::moe_lora`` or one grouped GEMM, proven equal to their own code,
    flagged as transformers flags its experts (:mod:`fxlora.compiler.experts_op`; a compile that
    fails takes it all off again); each targeted module gets a forward pre-hook that notes,
    during a call of the compiled model, a call of it that runs outside the compiled graphs (it
    does nothing otherwise); and
    the model's PEFT methods (``load_adapter``, ``delete_adapter``, ``set_adapter``, ...) act
    through the compiled model or refuse (:mod:`fxlora.runtime.peft_methods`), as PEFT's layers
    injected into it would change every row. A model that already holds such layers is refused.

    ``generate`` serves batches of up to ``max_batch_size`` rows of up to ``max_len`` tokens
    (prompt and new tokens) from a static KV cache; its decode steps replay CUDA graphs
    captured per ``batch_buckets`` (default: 2, 4, 8, ... up to ``max_batch_size``; one row replays
    the bucket of 2) when
    ``cuda_graphs`` (default: on CUDA). So does a prefill of at most ``prefill_graph_tokens``
    tokens (the batch bucket times the prompt length rounded up to a power of two, at least 16),
    from a graph captured the first time its shape comes; 0 runs every prefill eagerly.

    ``inner`` is the compiler of the rewritten graphs: ``"inductor"`` (the default on CUDA)
    fuses the base model's small operations around the LoRA ops; ``"eager"`` (the default
    elsewhere) runs the FX graphs as they are, the base model op for op.
    """
    if adapters is not None and not isinstance(adapters, Mapping):
        raise TypeError(f"adapters must map adapter names to sources, got {type(adapters).__name__}")
    if inner is not None:
        resolve_inner(inner, torch.device("cpu"))  # a bad name fails before anything changes
    if isinstance(prefill_graph_tokens, bool) or not isinstance(prefill_graph_tokens, int) or prefill_graph_tokens < 0:
        raise ValueError(f"prefill_graph_tokens must be an int >= 0 (0: no prefill graphs), got {prefill_graph_tokens!r}")
    adapters = dict(adapters or {})
    model, from_peft = _unwrap_peft(model)
    peft_methods.check_no_peft_layers(model)
    for name, source in from_peft.items():
        if name in adapters:
            raise AdapterError(f"adapter {name!r} is given twice: in adapters= and in the PeftModel")
        adapters[name] = source
    if target_modules is None and not adapters:
        target_modules = "all-linear"
    output_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    pool = AdapterPool(
        max_loras,
        max_rank,
        target_modules,
        max_cpu_loras=max_cpu_loras,
        lora_memory=lora_memory,
        output_embedding=next((n for n, m in model.named_modules() if m is output_head), None),
    )
    group = sharding.process_group(model)
    # flags and marks only: loop experts found, read and probed as transformers' experts are, and
    # segment GEMMs' LoRA read as they compute; taken off again if the compile fails
    marked = experts.mark_loop_experts(model) + experts_op.mark_segment_gemms(model)
    try:
        for name, source in adapters.items():
            load(pool, model, name, source, group)
        with sharding.one_outcome(group):  # a tensor-parallel model: every rank fails, or none does
            modules = model_modules(model)
            quantized = check_quantized(model, pool, modules)  # before the pool compares weights it cannot read
            pool.register_modules(modules, complete=True)
            _check_experts_gates(model, pool)
        config = getattr(model, "config", None)
        if quantized and quantized.experts and not quantized.kept_experts:
            # grouped_mm cannot read quantised experts: fxlora::moe_lora runs their own GEMMs
            experts_op.serve_quantized(model, quantized.method)
            log.info("experts switched to fxlora::moe_lora on their quantised weights")
        elif (
            getattr(config, "_experts_implementation", None) in (None, "eager")
            and any(experts.is_experts(m) and not experts.is_loop_experts(m) for m in model.modules())
            and not (quantized and quantized.kept_experts)
        ):
            # the eager experts loop reads routing on the host and breaks the graph; this one traces.
            # Switched after every check, so that a compile that fails leaves the model as it was.
            model.set_experts_implementation("grouped_mm")
            log.info("experts switched to the traceable grouped_mm implementation")
        if served := experts_op.serve_loops(model):  # experts with no implementation to switch: the op is their forward
            log.info("experts that loop over the routing compute by fxlora::moe_lora: %s", ", ".join(served))
        if served := experts_op.serve_segment_gemms(model):
            log.info("segment GEMMs that loop over their segments compute by one grouped GEMM: %s", ", ".join(served))
        backend = Backend(pool, modules=ModuleTree(model), inner=inner)
        # a call of a target outside the compiled graphs is seen, so one the model makes nowhere needs no LoRA
        watch_calls(model, {fqn: t.module for fqn, t in pool.targets.items()})
        if group is not None:
            backend.notes.append(sharding.describe(group, [t.info.shard for t in pool.targets.values()]))
        if quantized is not None:
            backend.notes.append(quantized.describe())
            log.info("%s", quantized.describe())
        raise_recompile_limit()
        compiled = torch.compile(own_code_object(model), backend=backend, dynamic=dynamic, fullgraph=fullgraph)
        log.info("%d adapters in %d target modules", len(adapters), len(pool.targets))
        runtime = dict(
            max_batch_size=max_batch_size, max_len=max_len, buckets=batch_buckets, cuda_graphs=cuda_graphs,
            prefill_graph_tokens=prefill_graph_tokens,
        )  # fmt: skip
        cm = CompiledModel(model, backend, compiled, runtime)
        # the model's own PEFT methods would inject layers every graph reads: they go through cm
        peft_methods.guard(model, cm._load, cm.unload_adapter)
        return cm
    except BaseException:
        experts.unmark(marked)
        raise


def load(pool: AdapterPool, model: torch.nn.Module, name: str, source: AdapterSource, group: object | None) -> None:
    """Read, place and load one adapter. With the ``group`` of a tensor-parallel model every
    rank loads it or none does: a rank that fails tells the others, which raise too."""
    reread = None
    if isinstance(source, (str, os.PathLike)):  # the host tier may drop its factors and read them again
        path = Path(source).absolute()  # (from where it was, whatever the working directory is then)
        stamp = directory_stamp(path)

        def reread() -> LoraAdapter:
            if (now := directory_stamp(path)) != stamp:
                what = "are gone" if not now else "changed"
                raise AdapterError(f"adapter {name!r} ({path}): its files {what} since it was loaded: load it again")
            return placement.resolve(read_adapter(name, path), model)

    with sharding.one_outcome(group):
        adapter = placement.resolve(read_adapter(name, source), model)
    pool.load(adapter, group, reload=reread)


def _check_experts_gates(model: torch.nn.Module, pool: AdapterPool) -> None:
    """Refuse, before anything is traced, experts modules the pool targets whose gate
    ``fxlora::moe_lora`` cannot compute: no adapter could ever be served on them."""
    owners: dict[str, list[str]] = {}
    for fqn, target in pool.targets.items():
        if target.info.kind == "experts" and experts.is_experts(target.info.owner):
            owners.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    for owner, fqns in owners.items():
        try:
            choose_layout(model.get_submodule(owner))
        except NotServed as why:
            raise AdapterError(
                f"experts module {owner!r} is targeted ({pool.targeted_by(fqns)}), but {why}: fxlora cannot serve LoRA on it"
            ) from None


def own_code_object(model: torch.nn.Module) -> Callable[..., Any]:
    """A function that calls ``model``, with a code object of its own. Dynamo keeps its
    cache, and its recompile budget, per code object, and transformers wraps the ``forward``
    of every model in one shared function: compiled through that, models would use up one
    another's budget."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    code = call.__code__.replace(co_name=f"fxlora_{type(model).__name__}_{id(model):x}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def _unwrap_peft(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, AdapterSource]]:
    """A PeftModel's LoRA adapters, and a copy of its base model without LoRA layers that
    shares every tensor with it (the PeftModel itself keeps working)."""
    try:
        from peft import PeftModel, get_peft_model_state_dict
    except ImportError:  # pragma: no cover - peft is a dependency
        return model, {}
    if not isinstance(model, PeftModel):
        return model, {}
    _check_peft_layers(model)
    adapters = {
        name: (config, get_peft_model_state_dict(model, adapter_name=name))
        for name, config in model.peft_config.items()
    }
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    return clone.unload(), adapters


def _check_peft_layers(model: Any) -> None:
    """Refuse a PeftModel whose LoRA layers compute otherwise than their saved adapters: merged
    into the base weights (fxlora would add them again), scaled at run time (``set_scale``,
    ``rescale_adapter_scale``: fxlora serves ``alpha / r``), or an output head tied to an
    embedding's LoRA (``ensure_weight_tying``)."""
    from peft.tuners.lora import LoraLayer

    tied = bool(getattr(getattr(model.get_base_model(), "config", None), "tie_word_embeddings", False))  # (any nn.Module)
    for name, config in model.peft_config.items():
        if tied and getattr(config, "ensure_weight_tying", False):
            raise AdapterError(
                f"adapter {name!r} (a PeftModel): ensure_weight_tying=True on a model with tied embeddings ties the "
                "output head's LoRA to the embedding's, which fxlora does not serve"
            )
    for path, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        if layer.merged_adapters:
            raise AdapterError(
                f"adapter(s) {layer.merged_adapters} of the PeftModel are merged into its base weights (module "
                f"{path!r}): fxlora adds the LoRA onto the base itself; call unmerge_adapter() before fxlora.compile"
            )
        for adapter, scaling in layer.scaling.items():
            r, alpha = layer.r[adapter], layer.lora_alpha[adapter]
            plain = alpha / math.sqrt(r) if layer.use_rslora.get(adapter, False) else alpha / r
            if not math.isclose(scaling, plain, rel_tol=1e-6):
                raise AdapterError(
                    f"adapter {adapter!r} of the PeftModel: module {path!r} scales its LoRA by {scaling:g}, not by its "
                    f"config's {plain:g} (set_scale, rescale_adapter_scale): fxlora serves the config's; undo the "
                    "rescaling, or give the adapter a lora_alpha that makes it"
                )
