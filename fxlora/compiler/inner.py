"""The inner compiler: what turns each variant's FX graph into the code that runs.

``"eager"`` runs the FX graph itself: on CPU, ``nolora`` is then the traced model op for op,
and ``hoist`` has placed its allocations in the arena. ``"inductor"`` hands each variant to
Inductor, which fuses the base model's norms, rotary embeddings, activations and residual
adds around the ``fxlora::`` ops (opaque custom ops to it) and plans the graph's memory
itself, so ``hoist`` does not run there. On CUDA it compiles an op that has a composition of
ATen ops and smaller ``fxlora::`` ops (``fxlora.ops.COMPOSITIONS``: ``fxlora::moe_lora``) as
that composition, whose glue it then fuses; the variant's own graph keeps the op. Inductor
traces the graph again from the traced values of its inputs, which carry Dynamo's symbolic
sizes: one compilation serves every batch bucket and prompt length, as the FX graph does.

Inductor's FX graph cache keys a compilation on the graph and its own configuration, not on
the fake implementations of the custom ops in it: a cache warmed by an older fxlora whose
ops' output shapes differ would serve code compiled for those. :class:`OpsSalt`, a post-grad
pass that changes nothing, puts a hash of the ops' sources into the key.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import fxlora.kernels
import fxlora.ops
from fxlora.compiler import progress, regions
from fxlora.compiler.arena import WORKSPACES
from fxlora.compiler.graph_edit import meta_value
from fxlora.ops.moe_lora import local_routing

INNER = ("eager", "inductor")
#: the plain functions fxlora's graphs may call: the LoRA ops' workspaces, the compositions
#: :func:`composed` swaps in, the routing of a rank's own experts
GRAPH_FUNCTIONS = (*WORKSPACES, *fxlora.ops.COMPOSITIONS.values(), local_routing)

log = logging.getLogger(__name__)


@cache
def ops_digest() -> bytes:
    """A hash of the sources of fxlora's ops and of the kernels they launch: their fakes,
    references and kernels."""
    roots = (Path(fxlora.ops.__file__).parent, Path(fxlora.kernels.__file__).parent)
    return get_hash_for_files(tuple(str(p) for root in roots for p in sorted(root.rglob("*.py"))))


class OpsSalt(CustomGraphPass):
    """Inductor's post-grad custom pass for fxlora's graphs: runs the one configured before
    (``then``), if any, and adds :func:`ops_digest` to its ``uuid``, which Inductor's cache
    key holds."""

    def __init__(self, then: CustomGraphPass | None):
        self.then = then

    def __call__(self, graph: fx.Graph) -> None:
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Any:
        return (ops_digest(), None if self.then is None else self.then.uuid())


def config_patches(float8: bool, forks: bool = False) -> dict[str, Any]:
    """Inductor config patches for a graph of fxlora's; ``float8``: whether it reads float8
    data; ``forks``: whether it calls ``fxlora::lora_shrink``.

    - The cache key salted with :func:`ops_digest`, unless a plain callable is the post-grad
      pass (Inductor does not cache such compilations).
    - Autotuning only under max-autotune. Without it:
      - coordinate-descent tuning stays off, though torchao's quantisation configs switch it
        on process-wide (``set_inductor_config``): it compiles and times dozens of variants of
        each kernel in the main process on a graph's first run, minutes per graph on an FP8
        model, and fxlora compiles two variants of the decode step and of the prefill;
      - in a graph that reads float8 data, GEMMs from ATen's kernels only: Inductor otherwise
        times Triton templates against ATen for ``_scaled_mm``, compiling several kernels per
        GEMM shape for each graph and variant; ATen's kernel is the one the FP8 model runs
        eagerly. Elsewhere Inductor keeps its GEMM choices: for ``_int_mm`` (torchao's int8
        activations) they are needed, as cuBLAS's kernel takes only more than 16 rows.
    - With ``forks``, no reuse of a dead buffer for a later one, nor of an input buffer for a
      kernel's output: under capture ``fxlora::lora_shrink`` leaves its input to a side stream
      that reads it after the op returns, until ``fxlora::lora_delta`` joins. The caching
      allocator knows of that read (``record_stream``); Inductor's own reuse, in its
      generated code, would not.
    """
    config = torch._inductor.config
    patches: dict[str, Any] = {}
    if not (config.max_autotune or config.max_autotune_gemm):
        if config.coordinate_descent_tuning:
            _say_once("coordinate-descent tuning is on (torchao's quantisation configs set it); fxlora's graphs "
                      "compile without it, unless Inductor's max_autotune is on as well")  # fmt: skip
            patches["coordinate_descent_tuning"] = False
        if float8:
            patches["max_autotune_gemm_backends"] = "ATEN"
    if forks:
        patches |= {"allow_buffer_reuse": False, "inplace_buffers": False}
    configured = config.post_grad_custom_post_pass
    if configured is None or isinstance(configured, CustomGraphPass):
        patches["post_grad_custom_post_pass"] = OpsSalt(configured)
    # AOTAutograd's cache refuses a graph calling a plain function unless it is marked, and keys
    # a marked call by the value given: the ops' sources and the versions of the libraries the
    # functions trace into (transformers' activations, torchao's tensor subclasses)
    patches["unsafe_marked_cacheable_functions"] = config.unsafe_marked_cacheable_functions | {
        f"{f.__module__}.{f.__name__}": _functions_key() for f in GRAPH_FUNCTIONS
    }
    return patches


@cache
def _functions_key() -> str:
    versions = []
    for package in ("transformers", "torchao"):
        try:
            versions.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    return " ".join([ops_digest().hex(), *versions])


@cache
def _say_once(message: str) -> None:
    log.info(message)


def reads_float8(values: list[Any]) -> bool:
    """Whether a tensor among ``values``, or inside one that is a tensor subclass (a quantised
    weight), holds float8 data."""

    def float8(t: Any) -> bool:
        if not isinstance(t, torch.Tensor):  # e.g. a DTensor's device mesh, flattened with it
            return False
        if is_traceable_wrapper_subclass(t):
            return any(float8(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.dtype.is_floating_point and t.dtype.itemsize == 1

    return any(float8(v) for v in values)


def resolve(inner: str | None, device: torch.device) -> str:
    """``inner`` as given, or the default for ``device``: Inductor on CUDA, eager elsewhere."""
    if inner is None:
        return "inductor" if device.type == "cuda" else "eager"
    if inner not in INNER:
        raise ValueError(f"inner compiler {inner!r} is not one of {list(INNER)}")
    return inner


def composed(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, or where it calls on CUDA, or with a tensor-subclass argument (a quantised
    weight), an op of :data:`COMPOSITIONS`, a copy calling the composition instead (Inductor
    traces through a Python function, not into a custom op; a subclass computes the
    composition's ops as its own, or says which one it lacks)."""
    swap = {n: _composition(n.target) for n in gm.graph.nodes}
    swap = {n: c for n, c in swap.items() if c is not None and (_on_cuda(n) or _reads_subclass(n))}
    if not swap:
        return gm
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for n, composition in swap.items():
        copies[n].target = composition
    return fx.GraphModule(gm, graph)


def _composition(target: Any) -> Callable[..., Any] | None:
    """The composition of an op of :data:`COMPOSITIONS` called as its overload or its packet
    (``torch.ops.fxlora.moe_lora``, as the experts implementation of quantised experts
    calls it: the traced call of a module without adapters, which is no LoRA op)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    return fxlora.ops.COMPOSITIONS.get(target) if isinstance(target, torch._ops.OpOverload) else None


def _on_cuda(node: fx.Node) -> bool:
    value = meta_value(node)
    return isinstance(value, torch.Tensor) and value.is_cuda


def _reads_subclass(node: fx.Node) -> bool:
    values = (meta_value(a) for a in node.all_input_nodes)
    return any(is_traceable_wrapper_subclass(v) for v in values)


def compile_inner(gm: fx.GraphModule, inner: str) -> Callable[..., Any]:
    """The callable that runs ``gm`` (a variant of a graph Dynamo traced, compiled while
    Dynamo's tracing context is current). Inductor compiles a graph with a layer list region by
    region (:mod:`fxlora.compiler.regions`), each distinct region once."""
    if inner == "eager":
        return gm
    gm = composed(gm)
    with torch.no_grad():  # an inference graph: fxlora's ops have no backward
        stitched = regions.split(gm)
        distinct = stitched.regions if stitched is not None else []
        progress.expect(len(distinct))
        try:
            for i, region in enumerate(distinct, 1):
                with progress.step(f"inductor: region {i}/{len(distinct)}"):
                    region.compiled = _inductor(region.graph, region.example_inputs)
        except Exception as e:  # a region Inductor cannot take: the graph as a whole
            log.warning("compiling the graph whole, as a region failed: %s: %s", type(e).__name__, e)
            stitched = None
        if stitched is None:
            progress.expect(1)
            with progress.step("inductor: the whole graph"):
                compiled = _inductor(gm, [_traced_value(n) for n in gm.graph.nodes if n.op == "placeholder"])
        else:
            log.info("inductor compiled %s", stitched.describe())
            compiled = stitched

    def run(*args: Any) -> Any:
        with torch.no_grad():  # Inductor may finish compiling on the first call
            return compiled(*args)

    run.regions = stitched  # type: ignore[attr-defined]
    return run


def _traced_value(node: fx.Node) -> Any:
    value = meta_value(node)
    if value is None:
        raise RuntimeError(f"graph input {node.target!r} has no traced value for Inductor to trace from")
    return value


def _inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    # the graph is an inference graph: no input asks for gradients, whatever the grad mode
    example_inputs = [v.detach() if isinstance(v, torch.Tensor) else v for v in example_inputs]
    float8 = reads_float8([*example_inputs, *gm.parameters(), *gm.buffers()])  # inputs, or weights held
    forks = any(n.target is torch.ops.fxlora.lora_shrink.default for n in gm.graph.nodes)
    return compile_fx(gm, example_inputs, config_patches=config_patches(float8, forks))
