"""Batched multi-adapter generation: a static KV cache, a prefill, then decode steps
replayed from CUDA graphs captured per ``(variant, batch bucket)``.

The :class:`DecodeRuntime` owns every tensor a decode step reads: the KV cache, and static
buffers for the next token ids, positions, the attention mask and the rows' slot ids. A
step writes the new values into them, picks the graph from the host-side adapter names
(``nolora`` when no row has an adapter: no LoRA work, no batch-info prologue), replays it,
and reads the logits of the real rows. Prompts are laid out left-padded: every row writes
the same cache column at each step, and padding stays masked.

A short prefill is bound by the host (a LoRA op called eagerly holds it for a few hundred
µs), so one of at most ``prefill_graph_tokens`` tokens (:data:`PREFILL_GRAPH_TOKENS` by
default) is replayed from a CUDA graph too: its rows padded to the batch bucket, its prompts left-padded to a length bucket (a power
of two), the graph of each ``(variant, rows, length)`` captured on first use. Longer
prefills run eagerly at their own length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from fxlora.adapters import NO_ADAPTER, sharding
from fxlora.compiler.progress import shown
from fxlora.errors import AdapterError
from fxlora.runtime.backend import Backend, tracing_as
from fxlora.runtime.cuda_graphs import GraphSet
from fxlora.runtime.generation_config import GenerationSettings
from fxlora.runtime.kv_cache import StaticKVCache, probe_shapes, rows_of
from fxlora.runtime.model_call import ModelCall
from fxlora.runtime.pending import Pending

log = logging.getLogger(__name__)

VARIANTS = ("nolora", "lora")
PREFILL_GRAPH_TOKENS = 8192  # by default, the most tokens (batch bucket x length bucket) a prefill replays from a graph
PREFILL_MIN_LENGTH = 16  # the shortest length bucket


def default_buckets(max_batch_size: int) -> list[int]:
    """Powers of two from 2 below ``max_batch_size``, then ``max_batch_size`` itself. A batch
    of one row replays the bucket of 2 (its second row idle): a bucket of 1 would be a trace
    of its own, as Dynamo specialises a dimension of size 1, and the bucket of 2 costs a
    one-row step next to nothing more (both read the same weights)."""
    buckets, b = [], 2
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return [*buckets, max_batch_size]


class DecodeRuntime:
    """Static buffers, KV cache and decode graphs of one compiled model."""

    def __init__(
        self,
        model: torch.nn.Module,
        step: Callable[..., Any],
        backend: Backend,
        max_batch_size: int,
        max_len: int,
        buckets: Sequence[int] | None = None,
        cuda_graphs: bool | None = None,
        prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
        progress: bool = True,
    ):
        """``step`` calls ``model`` compiled with ``backend`` (whose pool, arena and rewritten
        modules the runtime reads)."""
        param = next(model.parameters())
        self.step, self.backend, self.device, self.dtype = step, backend, param.device, param.dtype
        # ranks of a tensor-parallel model must stop at the same step: they decide on what they copied, waiting for it
        self.ranks_agree = sharding.process_group(model) is not None
        self.max_batch_size, self.max_len, self.prefill_graph_tokens = max_batch_size, max_len, prefill_graph_tokens
        self.buckets = sorted(set(buckets or default_buckets(max_batch_size)))
        if self.buckets[0] < 1 or self.buckets[-1] > max_batch_size:
            raise ValueError(f"batch buckets {self.buckets} must lie in 1..max_batch_size={max_batch_size}")
        _check_window(model.config, max_len)
        shapes = probe_shapes(model, self.device)
        self.cache = StaticKVCache(model.config, max_batch_size, max_len, self.dtype, self.device, shapes)
        rows, dev = max_batch_size, self.device
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.mask = torch.full((rows, 1, 1, max_len), _masked(self.dtype), dtype=self.dtype, device=dev)
        self.slot_ids = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        self.column = torch.zeros(1, dtype=torch.long, device=dev)
        self._prefill_inputs: dict[tuple[int, int], _PrefillInputs] = {}  # captured prefills' inputs, by shape
        self.model_call = ModelCall(model, step, backend)
        self.graphs = GraphSet(self.device, cuda_graphs)
        keys = [(v, b) for b in sorted(self.buckets, reverse=True) for v in VARIANTS]
        with torch.no_grad():
            log.info("tracing the decode step for batch buckets %s", self.buckets)
            start = time.perf_counter()
            steps = tqdm(keys, desc="fxlora: tracing decode steps", **shown(progress), leave=False)
            with tracing_as("decode step"):
                for key in steps:  # traces the decode graphs and measures their allocations
                    self._decode(key)
            seconds = time.perf_counter() - start
            log.info("decode step traced, compiled and run once per bucket and variant (%d) in %.1f s", len(keys), seconds)
            backend.arena.plan(self.device)
            self.graphs.capture(keys, self._decode, progress=progress)

    # -- one model call -------------------------------------------------------------------
    def _call(self, rows: int, ids, positions, mask, columns, slot_ids) -> torch.Tensor:
        """Run the compiled model over the cache's first ``rows`` rows; returns the logits of
        the last position, ``(rows, vocab)``."""
        self.cache.select_rows(rows)
        self.cache.columns = columns
        return self.model_call(self.cache, ids, positions, mask, columns, slot_ids, dynamic=self.cache.tensors())

    def _decode(self, key: tuple[str, int]) -> torch.Tensor:
        variant, rows = key
        slot_ids = rows_of(self.slot_ids, rows) if variant == "lora" else None
        ids, positions, mask = (rows_of(t, rows) for t in (self.ids, self.positions, self.mask))
        return self._call(rows, ids, positions, mask, self.column, slot_ids)

    def _prefill(self, key: tuple[str, str, int, int]) -> torch.Tensor:
        """A prefill at a graph's shape, from the static inputs of that shape (positions and
        mask derive from them inside, so a graph holds the mask only as scratch)."""
        _, variant, rows, length = key
        inputs = self._prefill_inputs[(rows, length)]
        slot_ids = inputs.slot_ids if variant == "lora" else None
        return self._call(rows, inputs.ids, *self._prefill_layout(inputs.keep), slot_ids)

    def _prefill_layout(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions, 4-D additive mask (causal, padding masked, over the cache's ``max_len``
        columns) and cache columns of a prefill whose real tokens ``keep`` marks."""
        length = keep.shape[1]
        positions = (keep.long().cumsum(1) - 1).clamp(min=0)
        columns = torch.arange(length, device=keep.device)
        visible = keep[:, None, None, :] & (columns[None, :, None] >= columns[None, None, :])[:, None]
        mask = torch.full((keep.shape[0], 1, length, self.max_len), _masked(self.dtype), dtype=self.dtype, device=keep.device)
        mask[..., :length].masked_fill_(visible, 0.0)
        return positions, mask, columns

    def prefill_shape(self, rows: int, prompt_len: int, max_new_tokens: int) -> tuple[int, int] | None:
        """The ``(rows, length)`` a prefill replays from a CUDA graph at, or None when it runs
        eagerly: no CUDA graphs, more than ``prefill_graph_tokens`` tokens, or no room in the
        cache for the padded prompt and the new tokens."""
        if not self.graphs.enabled:
            return None
        length = max(PREFILL_MIN_LENGTH, 1 << (prompt_len - 1).bit_length())
        # one row prefills as two, as eagerly: Dynamo specialises a dimension of size 1
        bucket = max(self.bucket_for(rows), min(2, self.max_batch_size))
        if bucket * length > self.prefill_graph_tokens or length + max_new_tokens > self.max_len:
            return None
        return bucket, length

    def describe(self) -> list[str]:
        roles = "lora and nolora"
        lines = [f"decode steps: batch buckets {self.buckets}, each with a {roles} graph"]
        if self.graphs.graphs:
            prefills = sum(key[0] == "prefill" for key in list(self.graphs.graphs))  # a call may be adding one
            lines.append(
                f"CUDA graphs: {len(self.graphs.graphs) - prefills} decode steps ({roles} x buckets) and {prefills} "
                f"prefills (up to {self.prefill_graph_tokens} tokens, captured on first use), captured in "
                f"{self.graphs.capture_seconds:.1f} s"
            )
        else:
            lines.append(f"CUDA graphs: none, decode steps run eagerly ({self.graphs.fallback_reason or 'turned off'})")
        return lines

    # -- generation ------------------------------------------------------------------------
    def bucket_for(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(
            f"a batch of {rows} rows is larger than the largest batch bucket, {self.buckets[-1]}: compile with "
            f"batch_buckets= that include {rows} or more (up to max_batch_size={self.max_batch_size}), "
            "or split the batch"
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        adapter_names: Sequence[str | None] | None,
        settings: GenerationSettings,
        generator: torch.Generator | None = None,
        streamer: Any = None,
    ) -> torch.Tensor:
        """One generate call: the rows' adapters are pinned for the whole call (unloading
        one meanwhile takes effect after it), and the runtime serves one call at a time.
        ``streamer`` (transformers' ``BaseStreamer``) is given the prompts, then each step's
        tokens as the host reads them (a wait for the device per step), then ``end()``."""
        rows, prompt_len = input_ids.shape
        attention_mask, problem = prompt_mask(input_ids, attention_mask, settings.pad_token_id, settings.eos_token_ids)
        if problem is not None and problem.device.type == "cpu":
            raise_mask_problem(int(problem), settings.pad_token_id)
            problem = None  # else read after the last step, with no extra wait
        max_new_tokens = settings.new_tokens(prompt_len)
        if max_new_tokens < 1:
            raise ValueError(
                f"max_length={settings.max_length} leaves no room for new tokens after a prompt of {prompt_len} "
                "tokens: raise max_length, or pass max_new_tokens"
            )
        names = list(adapter_names) if adapter_names is not None else [None] * rows
        if len(names) != rows:
            raise AdapterError(f"adapter_names has {len(names)} entries but the batch has {rows} rows")
        if rows > self.max_batch_size:
            raise ValueError(
                f"a batch of {rows} rows is larger than max_batch_size={self.max_batch_size}: compile with a larger "
                f"max_batch_size= (fxlora.compile(..., max_batch_size={rows})), or split the batch"
            )
        if prompt_len + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the KV cache's "
                f"max_len={self.max_len}: compile with a larger max_len= "
                f"(fxlora.compile(..., max_len={prompt_len + max_new_tokens})), or ask for fewer new tokens"
            )
        self.bucket_for(rows)  # a batch no decode graph serves fails before any work
        pool = self.backend.pool
        slots, _ = pool.acquire(names)
        try:
            with self.backend.lock:
                out = self._generate(input_ids, attention_mask, slots, max_new_tokens, settings, generator, streamer)
        finally:
            pool.release(slots)
        if problem is not None:  # the prompts' mask, read after the last step: no wait of its own
            raise_mask_problem(int(Pending.of(problem).get()), settings.pad_token_id)
        if streamer is not None:
            streamer.end()
        return out

    def _generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        slots: list[int],
        max_new_tokens: int,
        settings: GenerationSettings,
        generator: torch.Generator | None,
        streamer: Any,
    ) -> torch.Tensor:
        rows, prompt_len = input_ids.shape
        eos_ids = list(settings.eos_token_ids)
        eos = _to_device(torch.tensor(eos_ids, dtype=torch.long), self.device)
        pad = settings.pad_token_id if settings.pad_token_id is not None else eos_ids[0] if eos_ids else 0
        sampling = Sampling(settings, generator)
        min_new_tokens = settings.min_tokens(prompt_len)
        ids, keep = _left_align(input_ids.to(self.device), attention_mask, pad)
        if streamer is not None:
            streamer.put(ids.cpu())

        # prefill: the whole prompt, causal and padding-masked, into cache columns [0, length), replayed from a
        # CUDA graph at a bucketed shape when short (prefill_shape), else run at its own length. Extra rows repeat
        # the first with no adapter and their results are dropped; eagerly, one row prefills as two: Dynamo
        # specialises a dimension of size 1, so a one-row prefill would be a trace and compile of its own (the
        # default decode buckets start at 2 for the same reason).
        captured = self.prefill_shape(rows, prompt_len, max_new_tokens)
        prefill_rows, length = captured or (rows + int(rows == 1 and self.max_batch_size > 1), prompt_len)
        prefill_ids, prefill_keep = _pad_prompts(ids, keep, prefill_rows, length, pad)
        variant = "lora" if any(s >= 0 for s in slots) else "nolora"
        slot_ids = None
        if variant == "lora":
            slot_ids = _to_device(torch.tensor(slots + [NO_ADAPTER] * (prefill_rows - rows), dtype=torch.int32), self.device)
        with tracing_as("prefill"):
            if captured:
                inputs = self._prefill_inputs.get(captured)
                if inputs is None:
                    inputs = self._prefill_inputs[captured] = _PrefillInputs(*captured, self.device)
                inputs.write(prefill_ids, prefill_keep, slot_ids)
                logits = self.graphs.run_captured(("prefill", variant, *captured), self._prefill)[:rows]
            else:
                layout = self._prefill_layout(prefill_keep)
                logits = self._call(prefill_rows, prefill_ids, *layout, slot_ids)[:rows]

        # decode state in the static buffers; each row keeps its slot for the whole call
        self.mask.fill_(_masked(self.dtype))
        self.mask[:rows, 0, 0, :length].masked_fill_(prefill_keep[:rows], 0.0)
        self.positions[:rows, 0].copy_(keep.sum(1))
        if slot_ids is not None:
            self.slot_ids.fill_(NO_ADAPTER)
            self.slot_ids[:rows].copy_(slot_ids[:rows])
        bucket = self.bucket_for(rows)  # checked before the call: it fits
        finished = _Finished(rows, len(eos) > 0, max_new_tokens, self.device, wait=self.ranks_agree)
        out = [ids]
        streamed_ended = torch.zeros(rows, dtype=torch.bool)  # with a streamer: the rows ended, as the host saw
        host_eos = torch.tensor(eos_ids, dtype=torch.long)
        for step in range(max_new_tokens):
            logits = logits.float()
            if step < min_new_tokens and eos_ids:
                logits[:, eos] = float("-inf")  # no end before min_new_tokens
            tokens = torch.where(finished.rows, pad, sampling.pick(logits))
            out.append(tokens[:, None])
            if streamer is not None:  # (the streamer reads every step's tokens anyway)
                host = tokens.cpu()
                streamer.put(host)
                streamed_ended |= torch.isin(host, host_eos)
            finished.update(step, tokens, eos)
            if step == max_new_tokens - 1 or finished.seen_all(step) or (not self.ranks_agree and bool(streamed_ended.all())):
                break  # (once every row ended, the streamer gets no padding)
            column = length + step
            self.ids[:rows, 0].copy_(tokens)
            self.column.fill_(column)
            self.mask[:, 0, 0, column] = 0.0
            logits = self.graphs.run((variant, bucket), self._decode)[:rows]
            self.positions[:rows].add_(1)
        return torch.cat(out, dim=1)[:, : prompt_len + finished.steps(len(out) - 1)]


CHECK_EVERY = 8  # decode steps between the host's looks at which rows have finished


class _Finished:
    """Which rows produced an end token, kept on the device. The host hears of it through a
    non-blocking copy it reads ``CHECK_EVERY`` steps later, so no step waits for the device;
    the steps run meanwhile make only padding, which is cut off at the end. With ``wait`` (the
    ranks of a tensor-parallel model, whose decode steps run collectives together) the host
    waits for that copy, so every rank stops after the same step."""

    def __init__(self, rows: int, tracked: bool, max_new_tokens: int, device: torch.device, wait: bool = False):
        self.tracked, self.device, self.wait = tracked, device, wait
        self.rows = torch.zeros(rows, dtype=torch.bool, device=device)
        # the number of new tokens to keep: up to the step after which every row had finished
        self.keep = torch.full((1,), max_new_tokens, dtype=torch.long, device=device)
        self.host = torch.zeros(2, dtype=torch.long, pin_memory=device.type == "cuda")  # (all finished, keep)
        self.copied: torch.cuda.Event | None = None  # marks the last copy to ``host`` on CUDA
        self.pending = False

    def update(self, step: int, tokens: torch.Tensor, eos: torch.Tensor) -> None:
        if not self.tracked:
            return
        self.rows |= (tokens[:, None] == eos).any(1)
        self.keep = torch.where(self.rows.all() & (self.keep > step), step + 1, self.keep)

    def seen_all(self, step: int) -> bool:
        """Whether every row had finished by a step the host has heard of."""
        if not self.tracked or step % CHECK_EVERY:
            return False
        if self.pending and self.wait and self.copied is not None:
            self.copied.synchronize()  # the host's answer may not depend on when the copy landed
        if self.pending and (self.copied is None or self.copied.query()) and bool(self.host[0]):
            return True
        self._copy()
        return False

    def steps(self, ran: int) -> int:
        """How many of the ``ran`` new tokens to keep."""
        if not self.tracked:
            return ran
        self._copy()
        if self.copied is not None:
            self.copied.synchronize()  # once per call, after the last step
        return min(ran, int(self.host[1]))

    def _copy(self) -> None:
        self.host.copy_(torch.cat([self.rows.all().long().view(1), self.keep]), non_blocking=True)
        self.pending = True
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.copied = None


class _PrefillInputs:
    """The static inputs a captured prefill reads: token ids, the mask of real tokens and the
    rows' slot ids, each call's values written into them."""

    def __init__(self, rows: int, length: int, device: torch.device):
        self.ids = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.keep = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.slot_ids = torch.full((rows,), NO_ADAPTER, dtype=torch.int32, device=device)

    def write(self, ids: torch.Tensor, keep: torch.Tensor, slot_ids: torch.Tensor | None) -> None:
        self.ids.copy_(ids)
        self.keep.copy_(keep)
        if slot_ids is not None:
            self.slot_ids.copy_(slot_ids)


def _pad_prompts(ids: torch.Tensor, keep: torch.Tensor, rows: int, length: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-aligned prompts ``ids`` (and their mask of real tokens ``keep``) left-padded to
    ``length`` columns, with rows repeating the first up to ``rows``."""
    more = length - ids.shape[1]
    ids = torch.nn.functional.pad(ids, (more, 0), value=pad)
    keep = torch.nn.functional.pad(keep, (more, 0), value=False)
    extra = rows - ids.shape[0]
    return torch.cat([ids, ids[:1].expand(extra, -1)]), torch.cat([keep, keep[:1].expand(extra, -1)])


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to ``device`` without making the host wait."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


MASK_PROBLEMS = {
    1: "row {row} of attention_mask holds a value other than 0 (padding) and 1 (a token)",
    2: "row {row} of attention_mask is all 0: every prompt needs at least one token",
    3: "row {row} of attention_mask has padding between tokens: fxlora takes left- or right-padded prompts (1s in one run)",
    4: "row {row} of input_ids holds only pad_token_id={pad}: every prompt needs at least one token (pass "
    "attention_mask if the pad token is a real token there)",
    5: "row {row} of input_ids begins or ends with pad_token_id={pad}, which is also an end token, so its padding "
    "cannot be told from its tokens: pass attention_mask",
}


def prompt_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int | None, eos_token_ids: Sequence[int]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The mask of real tokens of a batch of prompts, and its problem, if any: a mask must hold 0
    and 1 only, give every row a token, and keep each row's tokens in one run (left or right
    padding). Without a mask it is read from the padding, as transformers does: the leading or
    trailing runs of ``pad_token_id`` are padding, unless the pad token is also an end token,
    where a row that begins or ends with it is ambiguous. The problem is a 0-d tensor on the
    prompts' device (-1: none; else ``row * 8 + code`` of the first bad row, see
    :data:`MASK_PROBLEMS`), computed without reading the device: :func:`raise_mask_problem`
    reads it, at once for host tensors, after the call's last step for device ones."""
    rows, length = input_ids.shape
    if attention_mask is None:
        if pad_token_id is None:
            return None, None
        is_pad = input_ids == pad_token_id
        lead = is_pad.long().cumprod(1).bool()
        trail = is_pad.flip(1).long().cumprod(1).flip(1).bool()
        keep = ~(lead | trail)
        codes = torch.where(keep.any(1), 0, 4)
        if pad_token_id in eos_token_ids:
            codes = torch.where(is_pad[:, 0] | is_pad[:, -1], 5, codes)
        return keep.long(), _first_problem(codes)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}")
    keep = attention_mask.bool()
    columns = torch.arange(length, device=keep.device)
    # real tokens in one run: none between a row's first and last real token is padding
    first = torch.where(keep, columns, length).amin(1)
    last = torch.where(keep, columns, -1).amax(1)
    holes = ((columns >= first[:, None]) & (columns <= last[:, None]) & ~keep).any(1)
    codes = torch.where(holes, 3, 0)
    codes = torch.where(keep.any(1), codes, 2)
    codes = torch.where(((attention_mask != 0) & (attention_mask != 1)).any(1), 1, codes)
    return attention_mask, _first_problem(codes)


def _first_problem(codes: torch.Tensor) -> torch.Tensor:
    """``row * 8 + code`` of the first row with a problem, or -1; no indexing by a device value."""
    rows = torch.arange(codes.shape[0], device=codes.device)
    first = torch.where(codes > 0, rows * 8 + codes, codes.shape[0] * 8).amin()
    return torch.where(first < codes.shape[0] * 8, first, -1)


def raise_mask_problem(problem: int, pad_token_id: int | None) -> None:
    if problem >= 0:
        row, code = divmod(problem, 8)
        raise ValueError(MASK_PROBLEMS[code].format(row=row, pad=pad_token_id))


def _left_align(ids: torch.Tensor, attention_mask: torch.Tensor | None, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts moved to the right end of their rows (left padding), and the mask of real
    tokens; a right- or left-padded batch gives the same layout."""
    if attention_mask is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    keep = attention_mask.to(ids.device).bool()
    # a stable sort of "is a real token" puts padding first and keeps the tokens' order
    order = torch.sort(keep.int(), dim=1, stable=True).indices
    return torch.where(keep.gather(1, order), ids.gather(1, order), pad), keep.gather(1, order)


def _masked(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def _check_window(config: Any, max_len: int) -> None:
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    uses_window = window is not None and (
        "sliding_attention" in (getattr(text, "layer_types", None) or ()) or getattr(text, "use_sliding_window", True)
    )
    if uses_window and max_len > window:
        raise NotImplementedError(
            f"generate with max_len={max_len} beyond the model's sliding window of {window} tokens is not supported: "
            f"use max_len <= {window}"
        )


class Sampling:
    """Greedy, or temperature / top-k / top-p sampling from ``generator``."""

    def __init__(self, settings: GenerationSettings, generator: torch.Generator | None = None):
        self.do_sample, self.temperature, self.top_k, self.top_p = (
            settings.do_sample, settings.temperature, settings.top_k, settings.top_p,
        )  # fmt: skip
        self.generator = generator

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative <= 1 - self.top_p
            drop[:, -1] = False  # the most likely token always stays
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]
