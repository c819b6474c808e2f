"""The request stream's model runner: static per-row state, prefills, and decode steps that
sample, check ends and feed themselves, replayed from CUDA graphs per batch bucket.

Every row of the running batch has its state in static device buffers: the token it feeds
next, its length, how many tokens it made and may make, its end tokens, its sampling
settings, its adapter's slot and its block table. A decode step (:meth:`StreamRunner.decode`)
reads them, runs the model over the paged cache, picks each row's next token
(:mod:`fxlora.runtime.sampler`), ends the rows that made an end token or their last one, writes
the tokens into the next step's inputs and into a ring of the window's tokens, and moves on:
the host issues a window of steps with no read in between, and reads the window's tokens (a
copy to pinned memory) while the next window runs. The steps of a window replay one CUDA graph
per ``(variant, sampling, bucket)``; rows past the batch's live ones, and rows that ended,
write into the cache's scratch block and change nothing.

A prefill (:meth:`StreamRunner.prefill`) runs the newly admitted requests' prompts, left-padded,
writes their keys and values into their blocks, and picks their first tokens; a short one
replays from a CUDA graph per ``(variant, rows, length)`` bucket, captured on first use, where
that bucket's padding stays close to the eager prefill's (:meth:`StreamRunner._prefill_shape`).
The runner prepares tensors and runs; the engine decides what.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxlora.adapters import NO_ADAPTER
from fxlora.compiler import progress
from fxlora.runtime.backend import Backend, tracing_as
from fxlora.runtime.block_allocator import TRASH_BLOCK, blocks_for
from fxlora.runtime.cuda_graphs import GraphSet
from fxlora.runtime.generation import PREFILL_MIN_LENGTH, default_buckets
from fxlora.runtime.kv_cache import probe_shapes, rows_of
from fxlora.runtime.model_call import ModelCall
from fxlora.runtime.paged_cache import PagedKVCache
from fxlora.runtime.pending import Pending
from fxlora.runtime.sampler import SamplingRows, pick, suppress
from fxlora.runtime.sequence import Decoding

log = logging.getLogger(__name__)

MAX_EOS = 16  # end tokens one request may name
PREFILL_ALIGN = 8  # an eager prefill's length is a multiple of this: Inductor's code guards on (length % 8)
PREFILL_PADDING = 1.25  # a prefill's padded tokens over its prompts' tokens, at most (see prefill_groups)
PREFILL_SMALL = 512  # tokens under which a prefill takes prompts whatever their padding
PREFILL_EXACT_ROWS = 16  # a prefill graph of up to this many rows has exactly its rows (see _prefill_shape)
PREFILL_LENGTH_STEP = 64  # a prefill graph's length: a power of two up to this, then a multiple of it


class StreamRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        step: Callable[..., Any],
        backend: Backend,
        *,
        max_rows: int,
        max_len: int,
        num_blocks: int,
        block_size: int,
        window: int,
        buckets: Sequence[int] | None = None,
        cuda_graphs: bool | None = None,
        prefill_graph_tokens: int = 0,
        layer_shapes: list | None = None,
    ):
        param = next(model.parameters())
        self.device, self.dtype, self.backend = param.device, param.dtype, backend
        self.max_rows, self.max_len, self.window = max_rows, max_len, window
        self.buckets = sorted({*(buckets or default_buckets(max_rows)), max_rows})  # every row count admitted has one
        self.prefill_graph_tokens = prefill_graph_tokens
        self.model_call = ModelCall(model, step, backend)
        shapes = layer_shapes or probe_shapes(model, self.device)
        self.cache = PagedKVCache(num_blocks, block_size, blocks_for(max_len, block_size), self.dtype, self.device, shapes)
        rows, dev = max_rows, self.device
        long = dict(dtype=torch.long, device=dev)
        self.next_ids = torch.zeros(rows, 1, **long)
        self.lengths = torch.zeros(rows, 1, **long)  # tokens in the cache: the position of the token fed next
        self.count = torch.zeros(rows, **long)  # new tokens made
        self.max_new = torch.zeros(rows, **long)
        self.min_new = torch.zeros(rows, **long)
        self.eos = torch.full((rows, MAX_EOS), -1, **long)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.block_table = torch.full((rows, self.cache.max_blocks_per_row), TRASH_BLOCK, dtype=torch.int32, device=dev)
        self.slot_ids = torch.full((rows,), NO_ADAPTER, dtype=torch.int32, device=dev)
        self.sampling = SamplingRows(
            greedy=torch.ones(rows, dtype=torch.bool, device=dev),
            temperature=torch.ones(rows, dtype=torch.float32, device=dev),
            top_k=torch.zeros(rows, **long),
            top_p=torch.ones(rows, dtype=torch.float32, device=dev),
            seed=torch.zeros(rows, **long),
        )
        # two windows' tokens, step by step: one window runs while the host reads the other
        self.ring = torch.full((2 * window, rows), -1, **long)
        self.ring_index = torch.zeros(1, **long)
        self._parity = 0
        self.columns = torch.arange(self.cache.columns, device=dev)
        self.graphs = GraphSet(self.device, cuda_graphs)
        # the pages' block count traced as a size: caches of other sizes reuse the graphs
        self._pages = [(t, (0,)) for layer in self.cache.layers for t in (layer.keys, layer.values)]
        self._prefill_inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @property
    def row_state(self) -> list[torch.Tensor]:
        """Every per-row buffer, batch dimension first."""
        s = self.sampling
        return [
            self.next_ids, self.lengths, self.count, self.max_new, self.min_new, self.eos, self.active,
            self.block_table, self.slot_ids, s.greedy, s.temperature, s.top_k, s.top_p, s.seed,
        ]  # fmt: skip

    # -- rows ------------------------------------------------------------------------------
    def place(self, rows: list[int], decodings: list[Decoding], slots: list[int], blocks: list[list[int]]) -> None:
        """Set up ``rows`` for new requests (before their prefill): settings, slot, blocks."""
        if not rows:
            return
        index = self._index(rows)
        eos = [list(d.eos_token_ids) + [-1] * (MAX_EOS - len(d.eos_token_ids)) for d in decodings]
        table = [b + [TRASH_BLOCK] * (self.cache.max_blocks_per_row - len(b)) for b in blocks]
        s = self.sampling
        for buffer, values in (
            (self.max_new, [d.max_new_tokens for d in decodings]),
            (self.min_new, [d.min_new_tokens for d in decodings]),
            (self.eos, eos),
            (self.block_table, table),
            (self.slot_ids, slots),
            (s.greedy, [not d.do_sample for d in decodings]),
            (s.temperature, [d.temperature for d in decodings]),
            (s.top_k, [d.top_k or 0 for d in decodings]),
            (s.top_p, [d.top_p for d in decodings]),
            (s.seed, [d.seed for d in decodings]),
        ):
            buffer.index_copy_(0, index, _to_device(torch.tensor(values, dtype=buffer.dtype), self.device))

    def extend_blocks(self, entries: list[tuple[int, int, int]]) -> None:
        """Write ``(row, index, block)`` entries into the block table."""
        if entries:
            rows, columns, blocks = (torch.tensor(v) for v in zip(*entries))
            flat = rows * self.block_table.shape[1] + columns
            self.block_table.view(-1).index_copy_(
                0, _to_device(flat, self.device), _to_device(blocks.to(torch.int32), self.device)
            )

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Copy rows' state from ``sources`` to ``targets`` (closing gaps in the batch)."""
        if sources:
            src, dst = self._index(sources), self._index(targets)
            for buffer in self.row_state:
                buffer.index_copy_(0, dst, buffer.index_select(0, src))

    def stop(self, rows: list[int]) -> None:
        """End ``rows`` (cancelled, or gone): their next steps write scratch and change nothing."""
        if rows:
            self.active.index_fill_(0, self._index(rows), False)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return _to_device(torch.tensor(rows, dtype=torch.long), self.device)

    # -- prefill ---------------------------------------------------------------------------
    def prefill(
        self, rows: list[int], prompts: list[list[int]], blocks: list[list[int]], slots: list[int], sampling: bool
    ) -> Pending:
        """Run the prompts of the requests just placed in ``rows`` and start them: their keys
        and values go into their blocks, their first tokens are picked and fed next, and the
        rows become live (or end at once: an end token, or a single new token asked for).
        The prompts run in groups of similar lengths (:func:`prefill_groups`), so that little
        of a prefill is padding. ``slots``: the rows' adapter slots; ``sampling``: whether any
        of them samples. Returns the first tokens in the order of ``rows``, on their way to
        the host."""
        order, firsts = [], []
        for group in prefill_groups([len(p) for p in prompts]):
            order += group
            take = lambda values: [values[i] for i in group]  # noqa: E731, B023
            adapters = any(slot != NO_ADAPTER for slot in take(slots))
            firsts.append(self._prefill_group(take(rows), take(prompts), take(blocks), adapters, sampling))
        tokens = torch.cat(firsts)
        if order != sorted(order):  # back in the order of rows
            position = {i: p for p, i in enumerate(order)}
            tokens = tokens.index_select(0, self._index([position[i] for i in range(len(order))]))
        return Pending.of(tokens[None])

    def _prefill_group(
        self, rows: list[int], prompts: list[list[int]], blocks: list[list[int]], uses_adapters: bool, sampling: bool
    ) -> torch.Tensor:
        """One prefill of ``prompts``, left-padded to the longest; their first tokens."""
        n, longest = len(rows), max(map(len, prompts))
        shape = self._prefill_shape(n, longest, sum(map(len, prompts)))
        # eagerly, one row as two (Dynamo specialises 1), and a length Inductor's alignment guards admit
        prefill_rows, length = shape or (n + int(n == 1), -(-longest // PREFILL_ALIGN) * PREFILL_ALIGN)
        ids = torch.zeros(prefill_rows, length, dtype=torch.long)
        keep = torch.zeros(prefill_rows, length, dtype=torch.bool)
        slots = torch.zeros(prefill_rows, length, dtype=torch.long)  # TRASH_BLOCK's slots: padding writes there
        bs = self.cache.block_size
        for i, (prompt, seq_blocks) in enumerate(zip(prompts, blocks)):
            start = length - len(prompt)
            ids[i, start:] = torch.tensor(prompt)
            keep[i, start:] = True
            position = torch.arange(len(prompt))
            slots[i, start:] = torch.tensor(seq_blocks)[position // bs] * bs + position % bs
        variant = "lora" if uses_adapters else "nolora"
        slot_ids = None
        if uses_adapters:  # the padding rows read no adapter: their LoRA would be work for nothing
            slot_ids = torch.full((prefill_rows,), NO_ADAPTER, dtype=torch.int32, device=self.device)
            slot_ids[:n] = self.slot_ids.index_select(0, self._index(rows))
        inputs = {"ids": ids, "keep": keep, "slots": slots.view(-1)}
        with tracing_as("prefill"):
            if shape is not None:  # the shape's static inputs, which its graph reads
                static = self._prefill_inputs.get(shape)
                if static is None:
                    static = self._prefill_inputs[shape] = {k: torch.empty_like(v, device=self.device) for k, v in inputs.items()}
                    static["slot_ids"] = torch.full((prefill_rows,), NO_ADAPTER, dtype=torch.int32, device=self.device)
                for k, v in inputs.items():
                    static[k].copy_(_to_device(v, self.device))
                if slot_ids is not None:
                    static["slot_ids"].copy_(slot_ids)
                logits = self.graphs.run_captured(("prefill", variant, *shape), self._prefill_graph)
            else:
                inputs = {k: _to_device(v, self.device) for k, v in inputs.items()}
                logits = self._prefill(inputs["ids"], inputs["keep"], inputs["slots"], slot_ids)
        return self._start(rows, logits[:n], [len(p) for p in prompts], sampling)

    def _prefill_graph(self, key: tuple) -> torch.Tensor:
        _, variant, rows, length = key
        static = self._prefill_inputs[(rows, length)]
        return self._prefill(static["ids"], static["keep"], static["slots"], static["slot_ids"] if variant == "lora" else None)

    def _prefill(self, ids: torch.Tensor, keep: torch.Tensor, slots: torch.Tensor, slot_ids: torch.Tensor | None) -> torch.Tensor:
        length = ids.shape[1]
        positions = (keep.long().cumsum(1) - 1).clamp(min=0)
        columns = torch.arange(length, device=ids.device)
        visible = keep[:, None, None, :] & (columns[None, :, None] >= columns[None, None, :])[:, None]
        mask = torch.full(visible.shape, torch.finfo(self.dtype).min, dtype=self.dtype, device=ids.device)
        mask.masked_fill_(visible, 0.0)
        self.cache.prefilling, self.cache.slot_mapping = True, slots
        dynamic = [(slots, (0,)), (mask, (3,)), *self._pages]  # the mask spans the prompts' columns only
        return self.model_call(self.cache, ids, positions, mask, columns, slot_ids, dynamic=dynamic)

    def _prefill_shape(self, rows: int, longest: int, tokens: int) -> tuple[int, int] | None:
        """The ``(rows, length)`` bucket a prefill of ``rows`` prompts (the longest ``longest``
        tokens, ``tokens`` in all) replays from a CUDA graph at, or None (eager). A graph's shape
        keeps up to :data:`PREFILL_EXACT_ROWS` rows as they are (more go to a batch bucket) and
        pads the length to a power of two up to :data:`PREFILL_LENGTH_STEP`, then to a multiple
        of it; it is taken where its tokens stay within ``prefill_graph_tokens`` and within
        :data:`PREFILL_PADDING` of the eager prefill's own padded tokens. An eager prefill
        launches each kernel from the host (a few hundred a layer's worth), which costs more
        than that much padding."""
        if not self.graphs.enabled:
            return None
        step = PREFILL_LENGTH_STEP
        length = max(PREFILL_MIN_LENGTH, 1 << (longest - 1).bit_length()) if longest <= step else -(-longest // step) * step
        bucket = max(rows if rows <= PREFILL_EXACT_ROWS else self.bucket_for(rows), min(2, self.max_rows))
        padded, eager = bucket * length, rows * -(-longest // PREFILL_ALIGN) * PREFILL_ALIGN
        if padded > self.prefill_graph_tokens or (padded > PREFILL_SMALL and padded > PREFILL_PADDING * eager):
            return None
        return bucket, length

    def _start(self, rows: list[int], logits: torch.Tensor, prompt_lengths: list[int], sampling: bool) -> torch.Tensor:
        """The first token of each new row, picked as a decode step picks it, and the rows made live."""
        index = self._index(rows)
        take = lambda t: t.index_select(0, index)  # noqa: E731
        s = self.sampling
        rows_settings = SamplingRows(*(take(t) for t in (s.greedy, s.temperature, s.top_k, s.top_p, s.seed)))
        zero = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        logits = suppress(logits.float(), take(self.eos), take(self.min_new) > 0)
        tokens = pick(logits, rows_settings, zero, sampling)
        ended = (tokens[:, None] == take(self.eos)).any(1) | (take(self.max_new) <= 1)
        self.next_ids.index_copy_(0, index, tokens[:, None])
        self.lengths.index_copy_(0, index, _to_device(torch.tensor(prompt_lengths)[:, None], self.device))
        self.count.index_fill_(0, index, 1)
        self.active.index_copy_(0, index, ~ended)
        return tokens

    # -- decode ----------------------------------------------------------------------------
    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def decode(self, rows: int, steps: int, uses_adapters: bool, sampling: bool) -> Pending:
        """``steps`` decode steps of the batch's first ``rows`` rows, back to back; returns
        their tokens ``(steps, rows)`` (-1 where a row was not live) and, as a last row, which
        rows are still live, on their way to the host. The window alternates between the
        ring's two halves, so the host reads one while the next runs."""
        key = ("lora" if uses_adapters else "nolora", sampling, max(self.bucket_for(rows), min(2, self.max_rows)))
        start = self._parity * self.window
        self._parity ^= 1
        self.ring_index.fill_(start)
        with tracing_as("decode step"):
            for _ in range(steps):
                self.graphs.run(key, self._decode)
        return Pending.of(torch.cat([self.ring[start : start + steps, :rows], self.active[None, :rows].long()]))

    def _decode(self, key: tuple[str, bool, int]) -> torch.Tensor:
        variant, sampling, rows = key
        lengths, live = self.lengths[:rows, 0], self.active[:rows]
        mask = torch.where(self.columns[None, :] <= lengths[:, None], 0.0, torch.finfo(self.dtype).min)
        mask = mask.to(self.dtype)[:, None, None, :]
        bs = self.cache.block_size
        block = self.block_table[:rows].gather(1, (lengths // bs)[:, None].clamp(max=self.block_table.shape[1] - 1))
        self.cache.prefilling = False
        self.cache.slot_mapping = torch.where(live, block[:, 0].long() * bs + lengths % bs, TRASH_BLOCK * bs)
        self.cache.block_table = rows_of(self.block_table, rows)
        slot_ids = rows_of(self.slot_ids, rows) if variant == "lora" else None
        ids, positions = rows_of(self.next_ids, rows), rows_of(self.lengths, rows)
        logits = self.model_call(self.cache, ids, positions, mask, lengths[:1], slot_ids, dynamic=[(self.cache.block_table, (0,)), (self.cache.slot_mapping, (0,)), *self._pages])
        count, eos = self.count[:rows], self.eos[:rows]
        s = self.sampling
        logits = suppress(logits.float(), eos, live & (count < self.min_new[:rows]))
        view = SamplingRows(s.greedy[:rows], s.temperature[:rows], s.top_k[:rows], s.top_p[:rows], s.seed[:rows])
        tokens = pick(logits, view, count, sampling)
        made = count + live.long()
        ended = live & ((tokens[:, None] == eos).any(1) | (made >= self.max_new[:rows]))
        # modulo the ring's length: warm-ups and captures step it too
        self.ring[:, :rows].index_copy_(0, self.ring_index % self.ring.shape[0], torch.where(live, tokens, -1)[None])
        self.ring_index.add_(1)
        self.next_ids[:rows, 0].copy_(torch.where(live, tokens, self.next_ids[:rows, 0]))
        self.lengths[:rows, 0].add_(live.long())
        count.copy_(made)
        live.logical_and_(~ended)
        return tokens

    def warm_up(self, show: bool = True) -> None:
        """Trace the decode step and capture every ``(variant, sampling, bucket)`` graph up
        front, largest bucket first, while no row is live: a first capture during serving
        would run warm-up steps over live rows."""
        keys = [(v, sampling, b) for b in sorted(self.buckets, reverse=True) for v in ("nolora", "lora") for sampling in (False, True)]
        with tracing_as("decode step"):
            with progress.waiting("fxlora: tracing the stream's decode step") if show else contextlib.nullcontext():
                for key in (keys[0], keys[2]):  # nolora, lora: one trace each serves every bucket (rows dynamic)
                    self._decode(key)
            self.graphs.capture(keys, self._decode, progress=show)


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """The prompts of one admission (by their ``lengths``) split into prefills: longest first,
    each prefill taking the next prompts while its padding stays within
    :data:`PREFILL_PADDING` of its tokens, or it is small (:data:`PREFILL_SMALL` tokens), where
    a launch costs more than padding. Returns lists of indices into ``lengths``."""
    groups: list[list[int]] = []
    tokens = width = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        padded = (len(groups[-1]) + 1) * width if groups else 0
        if groups and (padded <= PREFILL_SMALL or padded <= PREFILL_PADDING * (tokens + lengths[i])):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens, width = lengths[i], -(-lengths[i] // PREFILL_ALIGN) * PREFILL_ALIGN
    return groups


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
