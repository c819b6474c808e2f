"""The request stream in transformers' words: ``generate_batch`` and a serving loop with
``add_request``, ``get_result``, ``request_id_iter`` and ``cancel_request``.

:class:`Requests` turns what a caller gives (token ids, an adapter name, a length limit and
sampling settings, read as transformers' ``generate`` reads them) into checked
:class:`Sequence` objects, refusing a bad request by name before it reaches the engine.
:func:`generate_batch` runs a list of inputs to the end in the caller's thread.
:class:`ServingManager` runs the engine's turns on a background thread while requests are
added, read and cancelled from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from fxlora.adapters import AdapterPool
from fxlora.compiler.progress import shown
from fxlora.errors import AdapterError, GenerationConfigError
from fxlora.runtime.backend import Backend
from fxlora.runtime.block_allocator import blocks_for
from fxlora.runtime.engine import Engine, Event
from fxlora.runtime.generation import PREFILL_GRAPH_TOKENS
from fxlora.runtime.generation_config import GenerationSettings, resolve
from fxlora.runtime.kv_cache import probe_shapes
from fxlora.runtime.paged_cache import PagedKVCache
from fxlora.runtime.routing import check_adapter_keywords
from fxlora.runtime.runner import MAX_EOS, StreamRunner
from fxlora.runtime.sequence import Decoding, GenerationOutput, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamOptions:
    """How the request stream is served (``cm.serve(...)``, ``cm.generate_batch``)."""

    max_batch_size: int  # rows decoded together
    max_len: int  # tokens of one request: prompt and new tokens
    kv_cache_memory: int | float | None = None  # bytes, or a fraction of free device memory; None: max_batch_size x max_len
    block_size: int = 16  # tokens per KV-cache block
    max_prefill_tokens: int = 4096  # prompt tokens one prefill admits (the first request whatever its length)
    window: int = 8  # decode steps between the host's reads of the tokens
    buckets: tuple[int, ...] | None = None  # decode graphs' row counts (and max_batch_size); None: powers of two
    cuda_graphs: bool | None = None
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_len", "block_size", "max_prefill_tokens", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        memory = self.kv_cache_memory
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0
                                   or (isinstance(memory, float) and memory > 1)):  # fmt: skip
            raise ValueError(f"kv_cache_memory must be bytes (an int > 0) or a fraction of free memory in (0, 1], got {memory!r}")
        if self.buckets is not None and not all(1 <= b <= self.max_batch_size for b in self.buckets):
            raise ValueError(f"batch buckets {list(self.buckets)} must lie in 1..max_batch_size={self.max_batch_size}")


def make_engine(
    model: torch.nn.Module, step: Any, backend: Backend, options: StreamOptions, group: object = None, progress: bool = True
) -> Engine:
    """The engine of ``options``: a paged KV cache sized from its memory budget, the runner's
    buffers, and its decode graphs traced and captured."""
    param = next(model.parameters())
    shapes = probe_shapes(model, param.device)
    block = PagedKVCache.block_bytes(shapes, options.block_size, param.dtype)
    memory = options.kv_cache_memory
    if memory is None:
        budget = blocks_for(options.max_len, options.block_size) * options.max_batch_size * block
    elif isinstance(memory, float):
        if param.device.type != "cuda":
            raise ValueError(f"kv_cache_memory as a fraction of free memory needs a CUDA device, the model is on {param.device}")
        budget = int(torch.cuda.mem_get_info(param.device)[0] * memory)
    else:
        budget = memory
    num_blocks = budget // block + 1  # and the scratch block
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory={memory!r} holds no KV-cache block of {block} bytes")
    runner = StreamRunner(
        model, step, backend, max_rows=options.max_batch_size, max_len=options.max_len, num_blocks=num_blocks,
        block_size=options.block_size, window=options.window, buckets=options.buckets, cuda_graphs=options.cuda_graphs,
        prefill_graph_tokens=options.prefill_graph_tokens, layer_shapes=shapes,
    )  # fmt: skip
    log.info("paged KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, options.block_size, runner.cache.nbytes / 2**20)
    with backend.lock, torch.no_grad():
        runner.warm_up(progress)
    return Engine(runner, backend.pool, backend.lock, options.max_prefill_tokens, group)


class Requests:
    """Builds checked requests for one engine."""

    def __init__(
        self, engine: Engine, pool: AdapterPool, model_config: Any, generation_config: Any, vocab_size: int | None,
        remember_settings: bool = False,
    ):  # fmt: skip
        """``remember_settings``: resolve each distinct set of keywords against the generation
        configs once (one ``generate_batch`` call, where they cannot change), not per request."""
        self.engine, self.pool = engine, pool
        self.model_config, self.generation_config, self.vocab_size = model_config, generation_config, vocab_size
        self._settings: dict[Any, GenerationSettings] | None = {} if remember_settings else None

    def make(
        self,
        input_ids: Any,
        adapter_name: str | None = None,
        max_new_tokens: int | None = None,
        request_id: str | None = None,
        streaming: bool = False,
        seed: int | None = None,
        stop_token_ids: Any = None,
        **settings: Any,
    ) -> Sequence:
        """A request, checked: raises naming the request and the cause."""
        request_id = self.engine.new_id() if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        try:
            check_adapter_keywords(settings, (), "A request names its adapter as adapter_name= (generate_batch: adapter_names=)")
            prompt = _prompt(input_ids, self.vocab_size)
            if stop_token_ids is not None:
                if settings.get("eos_token_id") is not None:
                    raise ValueError("pass eos_token_id or stop_token_ids, not both")
                settings["eos_token_id"] = stop_token_ids
            config = self._resolve(max_new_tokens, settings)
            if len(config.eos_token_ids) > MAX_EOS:
                raise GenerationConfigError(f"at most {MAX_EOS} end tokens per request, got {len(config.eos_token_ids)}")
            new_tokens = config.new_tokens(len(prompt))
            if new_tokens < 1:
                raise GenerationConfigError(f"max_length={config.max_length} leaves no room after a prompt of {len(prompt)} tokens")
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
            if seed is not None and not -(2**63) <= seed < 2**63:
                raise ValueError(f"seed must lie in [-2**63, 2**63) (a 64-bit int), got {seed}")
            decoding = Decoding(  # the runner's int64 buffers hold them: larger limits mean what these do
                max_new_tokens=new_tokens,
                min_new_tokens=min(config.min_tokens(len(prompt)), new_tokens),
                eos_token_ids=config.eos_token_ids,
                do_sample=config.do_sample,
                temperature=config.temperature,
                top_k=None if config.top_k is None else min(config.top_k, self.vocab_size or 2**62),
                top_p=config.top_p,
                seed=seed if seed is not None else int(torch.randint(0, 2**62, ())),
            )
            runner = self.engine.runner
            if len(prompt) + new_tokens > runner.max_len:
                raise ValueError(
                    f"prompt length {len(prompt)} + max_new_tokens {new_tokens} exceeds max_len={runner.max_len}: ask "
                    f"for fewer new tokens, or serve with max_len={len(prompt) + new_tokens} or more"
                )
            need, blocks = blocks_for(len(prompt) + new_tokens, runner.cache.block_size), runner.cache.allocator.num_blocks - 1
            if need > blocks:
                raise ValueError(
                    f"the request needs {need} KV-cache blocks, more than the cache's {blocks}: give the cache more memory"
                )
            if adapter_name is not None:
                if not isinstance(adapter_name, str):
                    raise AdapterError(f"adapter_name must be a name or None, got {adapter_name!r}")
                if adapter_name not in self.pool.adapters:
                    raise AdapterError(f"unknown adapter {adapter_name!r}; loaded: {sorted(self.pool.adapters)}")
        except (ValueError, TypeError) as e:
            raise type(e)(f"request {request_id!r}: {e}") from None
        return Sequence(request_id, prompt, adapter_name, decoding, streaming)

    def _resolve(self, max_new_tokens: int | None, settings: dict[str, Any]) -> GenerationSettings:
        """The request's settings, checked (remembered by their keywords where asked)."""
        key = None
        if self._settings is not None:
            key = (_frozen(max_new_tokens), tuple(sorted((k, _frozen(v)) for k, v in settings.items())))
            try:
                if key in self._settings:
                    return self._settings[key]
            except TypeError:  # an unhashable value: resolved each time
                key = None
        config = resolve(self.model_config, self.generation_config, max_new_tokens=max_new_tokens, **settings)
        config.check_tokens(self.vocab_size)
        if key is not None:
            self._settings[key] = config
        return config


def _frozen(value: Any) -> Any:
    """``value`` as a key that tells apart what compares equal across types (1, 1.0, True)."""
    return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else (type(value), value)


def _prompt(input_ids: Any, vocab_size: int | None) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be one prompt's token ids, got a tensor of shape {tuple(input_ids.shape)}")
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Seq):
        raise TypeError(f"input_ids must be a list of token ids, got {type(input_ids).__name__}")
    prompt = list(input_ids)
    if not prompt:
        raise ValueError("the prompt is empty: a request needs at least one token")
    for i, t in enumerate(prompt):
        try:
            prompt[i] = operator.index(t)  # an int, or one of numpy's or a 0-d tensor's
        except TypeError:
            raise TypeError(f"token {t!r} of the prompt is not an int but {type(t).__name__}") from None
        if isinstance(t, bool) or prompt[i] < 0 or (vocab_size is not None and prompt[i] >= vocab_size):
            raise ValueError(f"token {t!r} of the prompt is not a token id of the model (0 <= id < {vocab_size})")
    return prompt


# transformers' generate_batch arguments of the whole call, and the one value of each that fxlora serves
CALL_ARGUMENTS = {
    "warmup": (True, "the stream's engine captures its graphs when it is built (the first call, or cm.serve())"),
    "persistent_manager": (True, "the stream's engine (its paged cache and graphs) stays with the compiled model"),
    "record_timestamps": (False, "results carry created_time, first_token_time and finished_time only"),
    "continuous_batching_config": (None, "the stream's sizes are fxlora.compile's or cm.serve()'s options "
                                         "(max_batch_size, max_len, kv_cache_memory, block_size, max_prefill_tokens)"),
}  # fmt: skip
REQUEST_ONLY = {
    "adapter_name": "generate_batch takes one adapter per input as adapter_names=",
    "request_id": "generate_batch numbers its requests itself; name them through cm.serve() and add_request",
    "streaming": "generate_batch returns finished results; stream through cm.serve() and request_id_iter",
}


def check_call_arguments(adapter_names: Any, settings: dict[str, Any]) -> None:
    """Refuse, for the whole ``generate_batch`` call, what a transformers user may pass that
    fxlora serves otherwise: another value of a call argument, a request's own argument, a
    ``GenerationConfig`` where ``adapter_names`` goes (transformers' second argument)."""
    if type(adapter_names).__name__ == "GenerationConfig":
        raise TypeError("generate_batch's second argument is adapter_names (one per input, or None): pass generation_config= by keyword")
    for key, value in list(settings.items()):
        if key in CALL_ARGUMENTS:
            served, why = CALL_ARGUMENTS[key]
            if value is not None and value != served:
                raise ValueError(f"generate_batch({key}={value!r}) is not served: {why}")
            del settings[key]
        elif key in REQUEST_ONLY:
            raise TypeError(f"generate_batch got {key}=: {REQUEST_ONLY[key]}")


def generate_batch(
    requests: Requests,
    inputs: Seq[Any],
    adapter_names: Seq[str | None] | None,
    per_input: dict[str, Any],
    settings: dict[str, Any],
    progress_bar: bool,
    manager: ServingManager | None = None,
) -> list[GenerationOutput]:
    """Every input to its end; results in input order. A bad input gets a result with
    ``finish_reason="error"`` and its message, and the others run. Requests start longest first
    (by ``max_new_tokens``, then prompt length). The engine's turns run in the caller's thread,
    or in ``manager``'s loop when given."""
    if isinstance(inputs, (str, torch.Tensor)) or not isinstance(inputs, Seq):
        raise TypeError(f"inputs must be a list of token-id lists, got {type(inputs).__name__}")
    n = len(inputs)
    if adapter_names is not None and not isinstance(adapter_names, (list, tuple)):  # a set or dict has no order
        raise AdapterError(f"adapter_names must be a list or tuple, one per input in input order, got {type(adapter_names).__name__}")
    names = list(adapter_names) if adapter_names is not None else [None] * n
    if len(names) != n:
        raise AdapterError(f"adapter_names must have one entry (a name or None) per input: {n} inputs, got {adapter_names!r}")
    for key, values in per_input.items():
        if len(values) != n:
            raise ValueError(f"{key} has {len(values)} values for {n} inputs")
    outputs: list[GenerationOutput | None] = [None] * n
    index: dict[str, int] = {}
    seqs = []
    ids = requests.engine.batch_ids(n)  # the same on every rank of a tensor-parallel model
    for i, (prompt, name) in enumerate(zip(inputs, names)):
        kw = {**settings, **{k: v[i] for k, v in per_input.items()}}
        request_id = ids[i]
        try:
            seqs.append(requests.make(prompt, adapter_name=name, request_id=request_id, **kw))
            index[request_id] = i
        except (ValueError, TypeError) as e:
            outputs[i] = GenerationOutput(request_id, _ids_or_empty(prompt), adapter_name=name, finish_reason="error", error=str(e))
    # Longest first: every result is returned at the end, so the order requests start in is free,
    # and starting the longest ones first leaves the shortest to fill the rows at the end, where
    # arrival order would leave a few long ones decoding in a nearly empty batch.
    seqs.sort(key=lambda seq: (seq.decoding.max_new_tokens, len(seq.prompt_ids)), reverse=True)
    from tqdm.auto import tqdm

    with tqdm(total=n, desc="fxlora: generating", unit="request", **shown(progress_bar)) as bar:
        bar.update(n - len(index))
        if manager is not None:
            with manager.claimed(list(index)):  # no other reader of the loop's results takes these
                if manager.is_driver:  # (the other ranks' loops serve rank 0's, whose ids are these)
                    for seq in seqs:
                        manager.add(seq)
                for request_id, i in index.items():
                    outputs[i] = manager.get_result(request_id)
                    bar.update()
            return outputs  # type: ignore[return-value]
        engine = requests.engine
        with engine.driver:  # one caller of the engine's turns at a time: each gets its own events
            _drive(engine, seqs, index, outputs, bar)
    return outputs  # type: ignore[return-value]


def _drive(engine: Engine, seqs: list[Sequence], index: dict[str, int], outputs: list, bar: Any) -> None:
    """Turn the engine until every request of ``index`` ended, its output in ``outputs``."""
    for seq in seqs:
        engine.add(seq)
    try:
        while index:
            events = engine.step()
            for event in events:
                i = index.pop(event.seq.request_id, None) if event.finished else None
                if i is not None:
                    outputs[i] = event.seq.output()
                    bar.update()
            engine.forget(events)
    except BaseException as e:
        engine.forget(engine.fail_all("error", f"{type(e).__name__}: {e}"))
        raise


def _ids_or_empty(prompt: Any) -> list[int]:
    try:
        return [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
    except (TypeError, ValueError):
        return []


class ServingManager:
    """A running loop over the engine, on a background thread (a daemon, named
    ``fxlora-serving``). Use it as a context manager: ``with cm.serve() as manager``.

    Each result is handed out once, in the order it came: to ``get_result(request_id)`` or
    ``request_id_iter(request_id)`` if asked for by id, otherwise to ``get_result()`` or
    iteration, oldest first. As in transformers, a request added with ``streaming=True``
    gives partial results (``finish_reason`` None, the tokens so far) before its final one,
    each handed out the same way."""

    def __init__(self, requests: Requests):
        self.requests, self.engine = requests, requests.engine
        self._results: dict[str, list[GenerationOutput]] = {}  # per request: partials, then the final one
        self._order: list[str] = []  # the request of each result not yet handed out, oldest first
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._hard_stop = False  # stop() asked for the requests in flight to end at once
        self._thread: threading.Thread | None = None
        self._closed = False  # the loop ended: no request is taken any more
        self._claimed: dict[str, int] = {}  # request id -> callers waiting for it by id
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ServingManager:
        if self._thread is None:
            self.engine.stopped = False
            self._thread = threading.Thread(target=self._loop, name="fxlora-serving", daemon=True)
            self._thread.start()
        return self

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def serving(self) -> bool:
        """Whether this process's calls go through the loop: it runs, or, on a rank after the
        first of a tensor-parallel model, this rank has not stopped it yet. Rank 0's stop ends
        every rank's loop while the others' code may still be inside ``with cm.serve()``; a
        decision by their threads' state alone would then differ from rank 0's."""
        if self.is_running():
            return True
        return not self.is_driver and self._thread is not None and not self._stop.is_set()

    def stop(
        self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False, hard_stop: bool = False
    ) -> None:
        """Stop the loop, as transformers' manager stops: no request is taken any more, the
        requests in flight run to their ends, then the loop ends; with ``hard_stop`` they end at
        once with ``finish_reason="cancelled"``. ``block``: wait up to ``timeout`` seconds for
        the loop to end. Under tensor parallelism rank 0's stop stops every rank; the others
        wait for it. The engine (its paged cache and graphs) stays with the compiled model for
        the next ``cm.serve()`` whatever ``keep_for_next_session`` says, so only False is taken."""
        if keep_for_next_session:
            raise ValueError(
                "stop(keep_for_next_session=True) is not served: the stream's engine always stays with the compiled model, "
                "and the next cm.serve() starts a loop over it"
            )
        self._hard_stop = self._hard_stop or hard_stop
        self._stop.set()
        self._wake.set()
        if block and self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ServingManager:
        return self.start()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop(hard_stop=exc_type is not None)  # leaving on an error: what is in flight is cancelled

    @property
    def is_driver(self) -> bool:
        """Whether this process takes requests: every process but the ranks after the first of
        a tensor-parallel model, whose loops follow rank 0's."""
        return self.engine.group is None or torch.distributed.get_rank(self.engine.group) == 0

    def _loop(self) -> None:
        with self.engine.driver:  # the one caller of the engine's turns while it serves
            self._serve()

    def _serve(self) -> None:
        try:
            while not self.engine.stopped:
                if self.is_driver and not self.engine.has_work and not self._stop.is_set():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    if self.engine.group is None:
                        continue  # alone, an idle turn is nothing; ranks meet at every turn
                stopping = self._stop.is_set() and (self._hard_stop or not self.engine.has_work)
                self._deliver(self.engine.step(stop=stopping))
        except BaseException as e:  # noqa: BLE001 - every request in flight hears of it, and later calls raise it
            self.error = e
            log.exception("the serving loop stopped")
            self._close("error", f"the serving loop stopped: {type(e).__name__}: {e}")
            return
        self._close("cancelled")

    def _close(self, reason: str, error: str | None = None) -> None:
        """The loop ended: what is in flight ends with ``reason``, and from here on add()
        refuses. One step under the results' lock, so that no request reaches the inbox after
        it was emptied and a reader woken by the close finds those last results."""
        with self._changed:
            self._closed = True
            self._deliver(self.engine.fail_all(reason, error))
            self._changed.notify_all()

    def _deliver(self, events: list[Event]) -> None:
        if not events:
            return
        with self._changed:
            for event in events:
                rid = event.seq.request_id
                self._results.setdefault(rid, []).append(event.seq.output())
                self._order.append(rid)
            self.engine.forget(events)
            self._changed.notify_all()

    # -- requests, from any thread ------------------------------------------------------------
    def add_request(
        self,
        input_ids: Any,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        *,
        adapter_name: str | None = None,
        **settings: Any,
    ) -> str | None:
        """Queue a request; returns its id. The arguments come in transformers' order; the
        adapter (or None, the base model) is named by keyword. A bad request raises here,
        naming it; it never reaches the loop. On a rank after the first of a tensor-parallel
        model this does nothing and returns None: the loops of every rank serve the requests
        added on rank 0."""
        if not self.is_driver:
            return None
        if self.error is not None:
            raise RuntimeError(f"the serving loop stopped: {type(self.error).__name__}: {self.error}") from self.error
        if self._stop.is_set() or self._thread is None:
            raise RuntimeError("the serving loop is not running: use `with cm.serve() as manager:` (or manager.start())")
        seq = self.requests.make(input_ids, adapter_name, max_new_tokens, request_id, streaming, **settings)
        self.add(seq)
        return seq.request_id

    def add(self, seq: Sequence) -> None:
        """Queue a checked request (:meth:`Requests.make`)."""
        with self._changed:
            if self._closed or self._stop.is_set():
                raise RuntimeError("the serving loop is stopping: the request is not taken")
            if seq.request_id in self._results:
                raise ValueError(f"request {seq.request_id!r}: the id is in use by a result not read yet")
            self.engine.add(seq)
        self._wake.set()

    def cancel_request(self, request_id: str) -> None:
        """End a request: it finishes with ``finish_reason="cancelled"`` and the tokens it made
        (on rank 0 under tensor parallelism, as ``add_request``)."""
        self.engine.cancel(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next result (of ``request_id``, if given: a streaming request's partial ones,
        then its final one), or None after ``timeout`` seconds."""
        for out in self._take(request_id, timeout):
            return out
        return None

    def request_id_iter(self, request_id: str, *, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """The request's results as they come: partial ones whose tokens grow (for a request
        added with ``streaming=True``), then the finished one; stops early after ``timeout``
        seconds without news."""
        yield from self._take(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Results as they come (a streaming request's partial ones too), until the loop stops
        and every one was read."""
        while True:
            out = self.get_result(timeout=0.1)
            if out is not None:
                yield out
            elif not self.is_running():
                with self._changed:
                    if not self._order:
                        return

    @contextlib.contextmanager
    def claimed(self, request_ids: list[str]) -> Iterator[None]:
        """Within the block the results of ``request_ids`` go only to callers that ask for them
        by id, never to ``get_result()`` or iteration."""
        with self._changed:
            for request_id in request_ids:
                self._claim(request_id)
        try:
            yield
        finally:
            with self._changed:
                for request_id in request_ids:
                    self._unclaim(request_id)

    def _claim(self, request_id: str) -> None:
        self._claimed[request_id] = self._claimed.get(request_id, 0) + 1

    def _unclaim(self, request_id: str) -> None:
        self._claimed[request_id] -= 1
        if not self._claimed[request_id]:
            del self._claimed[request_id]

    def _take(self, request_id: str | None, timeout: float | None) -> Iterator[GenerationOutput]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._changed:
                if request_id is not None:
                    self._claim(request_id)
                try:
                    while (out := self._next(request_id)) is None:
                        if request_id is not None and request_id not in self._results and not self.engine.knows(request_id):
                            if self.is_driver or self._closed:  # (on the other ranks, rank 0's requests are on their way)
                                raise KeyError(f"no request {request_id!r}: unknown, or its result was already read")
                        if (self._closed or self._thread is None) and not (
                            self._order if request_id is None else self._results.get(request_id)
                        ):
                            return  # the loop ended (or never started), and nothing more comes
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            return
                        self._changed.wait(left)
                finally:
                    if request_id is not None:
                        self._unclaim(request_id)
            yield out
            if out.is_finished():
                return

    def _next(self, request_id: str | None) -> GenerationOutput | None:
        """The next result to hand out (under the lock): the oldest one no caller waits for by
        id, or the request's oldest."""
        if request_id is None:
            request_id = next((r for r in self._order if r not in self._claimed), None)
        results = self._results.get(request_id) if request_id is not None else None
        if not results:
            return None
        out = results.pop(0)
        self._order.remove(request_id)  # (its first entry: its oldest result)
        if out.is_finished():
            del self._results[request_id]
        return out
