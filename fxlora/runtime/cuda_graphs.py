"""CUDA-graph capture and replay of whole model steps, sharing one memory pool.

A :class:`GraphSet` captures a callable once per key (for the decode runtime: a
``(variant, batch bucket)`` pair) after a warm-up on a side stream, keeps the outputs the
capture produced (static tensors every replay rewrites), and replays by key. All graphs of
a set allocate from one private pool, captured largest first so smaller ones reuse its
blocks. When graphs cannot be used (no CUDA, or a capture fails) the set says why once, in
a logged warning, and runs the callable eagerly instead: slower, never wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


class GraphSet:
    def __init__(self, device: torch.device, enabled: bool | None = None):
        self.device = device
        self.enabled = device.type == "cuda" if enabled is None else enabled
        if self.enabled and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device}")
        self.fallback_reason: str | None = None if self.enabled else f"the model is on {device}, not CUDA"
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.capture_seconds = 0.0
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self._warned = False

    def capture(self, keys: Iterable[Hashable], fn: Callable[[Hashable], Any], progress: bool = True) -> None:
        """Warm up and capture ``fn(key)`` for every key, in the order given."""
        keys = list(keys)
        if not self.enabled:
            self._warn()
            return
        from tqdm.auto import tqdm

        start = time.perf_counter()
        for key in tqdm(keys, desc="fxlora: capturing CUDA graphs", disable=not progress, leave=False):
            try:
                self.graphs[key] = self._capture_one(fn, key)
            except Exception as e:  # noqa: BLE001 - any failure means: run eagerly, and say why
                self.graphs.clear()
                self.enabled = False
                self.fallback_reason = f"capturing {key} failed: {type(e).__name__}: {e}"
                self._warn()
                return
        self.capture_seconds += time.perf_counter() - start
        log.info("fxlora: captured %d CUDA graphs in %.1f s", len(keys), time.perf_counter() - start)

    def _capture_one(self, fn: Callable[[Hashable], Any], key: Hashable) -> tuple[torch.cuda.CUDAGraph, Any]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # first calls compile kernels and set up cuBLAS workspaces
                fn(key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn(key)
        return graph, out

    def run(self, key: Hashable, fn: Callable[[Hashable], Any]) -> Any:
        """Replay the graph of ``key``, or call ``fn(key)`` when there is none."""
        entry = self.graphs.get(key)
        if entry is None:
            self._warn()
            return fn(key)
        graph, out = entry
        graph.replay()
        return out

    @property
    def pool_bytes(self) -> int:
        """Device memory held by the graphs' private pool."""
        if not self.graphs:
            return 0
        pool = tuple(self._pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool)

    def _warn(self) -> None:
        if not self._warned and self.fallback_reason is not None:
            log.warning("fxlora: running without CUDA graphs: %s", self.fallback_reason)
            self._warned = True
