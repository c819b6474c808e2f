"""CUDA-graph capture and replay of whole model steps, sharing one memory pool.

A :class:`GraphSet` captures a callable once per key (for the decode runtime: a
``(variant, batch bucket)`` pair, up front; a prefill's shape, on first use) after a warm-up
on a side stream, keeps the outputs the capture produced (static tensors every replay
rewrites), and replays by key. All graphs of a set allocate from one private pool: the
decode steps are captured largest first so smaller ones reuse its blocks, and a later graph
takes freed blocks where they fit (graphs replay one at a time, so their scratch may
overlap). When graphs cannot be used (no CUDA, or a capture fails) the set says why once, in
a logged warning, and runs the callable eagerly instead: slower, never wrong.

:meth:`GraphSet.call` serves callers that own no static buffers (``torch.compile(...,
backend="fxlora", options={"cuda_graphs": True})``): it captures per input signature on
first use and copies inputs in and mutated inputs and outputs out around each replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from fxlora.compiler.graph_edit import meta_value

log = logging.getLogger(__name__)


class GraphSet:
    def __init__(self, device: torch.device, enabled: bool | None = None):
        self.device = device
        self.enabled = enabled is not False and device.type == "cuda"
        # turned off by the caller: nothing to warn about; asked for (or by default) on CPU: say so
        self.fallback_reason = None if enabled is False or self.enabled else f"the model is on {device}, not CUDA"
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._calls: dict[Hashable, _Captured] = {}
        self._refused: set[Hashable] = set()
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

        from fxlora.compiler.progress import shown

        start = time.perf_counter()
        for key in tqdm(keys, desc="fxlora: capturing CUDA graphs", **shown(progress), leave=False):
            try:
                self.graphs[key] = self._capture_one(fn, key)
            except Exception as e:  # noqa: BLE001 - any failure means: run eagerly, and say why
                self.graphs.clear()
                self.enabled = False
                self.fallback_reason = f"capturing {key} failed: {type(e).__name__}: {e}"
                self._warn()
                return
        log.info("warmed up and captured %d CUDA graphs in %.1f s", len(keys), time.perf_counter() - start)

    def _capture_one(
        self, fn: Callable[[Hashable], Any], key: Hashable, warmups: int = 2
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        self._warm_up(fn, key, warmups)
        return self._capture(fn, key)

    def _warm_up(self, fn: Callable[[Hashable], Any], key: Hashable, warmups: int) -> None:
        """The first calls, on a side stream: they compile kernels and set up cuBLAS workspaces."""
        side, current = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                for _ in range(warmups):
                    fn(key)
        finally:
            current.wait_stream(side)

    def _capture(self, fn: Callable[[Hashable], Any], key: Hashable) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Capture ``fn(key)``. Only this thread's CUDA calls must be capturable: other threads
        may use the device meanwhile (a graph captured on first use, while an adapter loads)."""
        graph, start, current = torch.cuda.CUDAGraph(), time.perf_counter(), torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = fn(key)
        except Exception:
            torch.cuda.set_stream(current)  # a failed capture's end leaves its stream current
            _release_generator(self.device)
            raise
        self.capture_seconds += time.perf_counter() - start  # the capture alone, not the warm-ups
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

    def run_captured(self, key: Hashable, fn: Callable[[Hashable], Any]) -> Any:
        """Replay the graph of ``key``, warming up and capturing it on first use. An error in
        the warm-up is ``fn``'s own and propagates; a key whose capture fails runs ``fn(key)``
        eagerly from then on, said once in a logged warning, and the set's other graphs stay."""
        if not self.enabled or key in self._refused:
            return fn(key)
        if key not in self.graphs:
            start = time.perf_counter()
            self._warm_up(fn, key, warmups=2)
            try:
                self.graphs[key] = self._capture(fn, key)
            except Exception as e:  # noqa: BLE001 - as in capture(), for this key alone
                self._refused.add(key)
                log.warning("graph %s runs without CUDA graphs: capturing it failed: %s: %s", key, type(e).__name__, e)
                return fn(key)
            log.info("warmed up and captured the CUDA graph of %s in %.2f s", key, time.perf_counter() - start)
        return self.run(key, fn)

    def call(self, key: Hashable, fn: Callable[..., Any], args: tuple, uncapturable: str | None = None) -> Any:
        """``fn(*args)``, replayed from a graph captured for ``key`` and the signature of
        ``args`` (shapes, strides, dtypes; the address of every static input).

        The first call of a signature runs ``fn`` eagerly on ``args`` (its result is the
        answer, and it notes which inputs ``fn`` mutates), then captures ``fn`` on private
        copies of the inputs whose address may change. Static inputs (parameters, buffers,
        tensors marked with ``torch._dynamo.mark_static_address``) are read in place; a new
        address is a new signature. Replays copy the inputs in, mutated inputs back, and
        return copies of the outputs, so callers never see a later replay overwrite them. CPU
        inputs the graph copies to the device are kept in pinned memory; writing the next
        call's values waits for the previous replay of that graph to have read them.

        ``uncapturable``: why ``fn`` must run eagerly (see :func:`cpu_work`); said once per key.
        """
        if not self.enabled:
            self._warn()
            return fn(*args)
        if uncapturable is not None:
            if key not in self._refused:
                self._refused.add(key)
                log.warning("graph %s runs without CUDA graphs: %s", key, uncapturable)
            return fn(*args)
        sig = (key, *(_signature(a) for a in args))
        captured = self._calls.get(sig)
        if captured is None:
            versions = [_version(a) for a in args]
            out = fn(*args)
            # inference tensors keep no version counter: count them as mutated (a harmless copy back)
            mutated = {
                i
                for i, (a, v) in enumerate(zip(args, versions))
                if isinstance(a, torch.Tensor) and (v is None or _version(a) != v)
            }
            try:
                self._calls[sig] = _Captured(self, fn, args, mutated)
            except Exception as e:  # noqa: BLE001 - as in capture(): run eagerly from now on, and say why
                self._calls.clear()
                self.enabled = False
                self.fallback_reason = f"capturing {key} failed: {type(e).__name__}: {e}"
                self._warn()
            return out
        return captured(args)

    @property
    def pool_bytes(self) -> int:
        """Device memory held by the graphs' private pool."""
        if not self.graphs and not self._calls:
            return 0
        pool = tuple(self._pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool)

    def _warn(self) -> None:
        if not self._warned and self.fallback_reason is not None:
            log.warning("running without CUDA graphs: %s", self.fallback_reason)
            self._warned = True


def _release_generator(device: torch.device) -> None:
    """After a failed capture: torch 2.11 leaves the device's default generator marked as
    capturing (its capture never ended), and every later random op on the device raises
    "Offset increment outside graph capture". Give it a fresh state with the same seed and
    offset."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())


def _version(x: Any) -> int | None:
    return x._version if isinstance(x, torch.Tensor) and not x.is_inference() else None


def _is_static(x: torch.Tensor) -> bool:
    return isinstance(x, torch.nn.Parameter) or torch._dynamo.utils.get_static_address_type(x) is not None


def _signature(x: Any) -> Hashable:
    if not isinstance(x, torch.Tensor):
        return x if isinstance(x, Hashable) else repr(x)
    where = x.data_ptr() if _is_static(x) else None
    return (tuple(x.shape), x.stride(), x.dtype, x.device, where)


class _Captured:
    """One captured signature of :meth:`GraphSet.call`."""

    def __init__(self, graphs: GraphSet, fn: Callable[..., Any], args: tuple, mutated: set[int]):
        # graphs read copies of the inputs whose address may change between calls
        self.copied = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not _is_static(a)]
        self.mutated = sorted(mutated & set(self.copied))
        inputs = list(args)
        for i in self.copied:  # CPU ones pinned, so that the graph's copy to the device captures
            inputs[i] = args[i].clone().pin_memory() if args[i].device.type == "cpu" else args[i].clone()
        self.inputs = inputs
        host = any(inputs[i].device.type == "cpu" for i in self.copied)
        self.read = torch.cuda.Event() if host else None
        self.graph, self.out = graphs._capture_one(lambda _: fn(*inputs), None, warmups=0)

    def __call__(self, args: tuple) -> Any:
        if self.read is not None:
            self.read.synchronize()  # the last replay has copied its host inputs to the device
        for i in self.copied:
            self.inputs[i].copy_(args[i])
        self.graph.replay()
        if self.read is not None:
            self.read.record()
        for i in self.mutated:
            args[i].copy_(self.inputs[i])
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.out)


def cpu_work(gm: fx.GraphModule) -> str | None:
    """Why a CUDA graph of ``gm`` would not redo all of its work on replay: a CPU tensor that
    the graph computes or changes (a replay runs device work only). CPU inputs that the graph
    only copies to the device are fine: their copies are made non-blocking here, the form a
    capture accepts (the runtime keeps such inputs pinned). None when there is no such tensor."""
    copies = []
    for node in gm.graph.nodes:
        if not any(t.device.type == "cpu" for t in _traced_tensors(node)):
            continue
        to_device = [
            u
            for u in node.users
            if u.op == "call_method" and u.target in ("to", "cuda") and not any(t.device.type == "cpu" for t in _traced_tensors(u))
        ]
        if node.op != "placeholder" or len(to_device) != len(node.users):
            return f"it computes on a CPU tensor ({node.op} {node.name})"
        copies += to_device
    for copy in copies:
        copy.kwargs = {**copy.kwargs, "non_blocking": True}
    if copies:
        gm.recompile()
    return None


def _traced_tensors(node: fx.Node) -> list[torch.Tensor]:
    val = meta_value(node)
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return [v for v in vals if isinstance(v, torch.Tensor)]
