"""Regional compilation: Inductor compiles a decoder's repeated layer once, not once a layer.

A variant's graph holds each layer's code over again, and Inductor's time grows with the
graph (re-tracing it with fake tensors, symbolic-shape arithmetic, fusion, code generation).
:func:`split` cuts the graph into *regions*, runs of consecutive nodes attributed to one layer
of the model's layer list (the numbered module list most nodes belong to) or to no layer
(what comes before, between and after). Each region becomes a graph of its own whose inputs
are everything it reads from outside: graph inputs, the graph module's tensors (pool factors),
earlier regions' tensors. Regions with the same code over inputs of the same metadata (sizes
as symbols, strides, dtypes, aliasing, tensor-subclass layout) are one :class:`Region`, which
the inner compiler compiles once; :class:`Stitched` calls the compiled regions in order.

A value crosses from region to region only as a tensor: a size or other scalar is recomputed
where it is read (its producing nodes copied along), and an item of a multi-output op stays
with the op. A graph without a layer list, or one that does not split cleanly (a value of
unknown kind crossing, a ``call_module``), is compiled whole.

What regions cost: Inductor fuses nothing across a region's border (the residual add closing a
layer and the norm opening the next are two kernels), and a call runs one Python call per
region, which a captured CUDA graph does not replay.
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

log = logging.getLogger(__name__)

_INDEX = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # the first numbered component of a module path
MIN_LAYERS = 2  # a graph with fewer repeated layers is compiled whole


@dataclass
class Region:
    """One distinct region: its graph, and the graph inputs it was first traced from."""

    graph: fx.GraphModule
    example_inputs: list[Any]
    count: int = 0  # how many of the graph's regions it serves
    compiled: Callable[..., Any] | None = None


@dataclass
class Step:
    region: Region
    inputs: list[int]  # slots read
    outputs: list[int]  # slots written, one per output of the region's graph
    frees: list[int] = field(default_factory=list)  # slots read for the last time here


class Stitched:
    """The graph module's computation as calls of compiled regions over a list of slots:
    the graph's inputs first, then its module's tensors, then the regions' outputs."""

    def __init__(self, steps: list[Step], slots: int, constants: dict[int, Any], output: Any, regions: list[Region]):
        self.steps, self.slots, self.constants, self.output, self.regions = steps, slots, constants, output, regions

    def __call__(self, *args: Any) -> Any:
        env: list[Any] = [None] * self.slots
        env[: len(args)] = args
        for slot, value in self.constants.items():
            env[slot] = value
        for step in self.steps:
            results = step.region.compiled(*[env[i] for i in step.inputs])
            for slot, value in zip(step.outputs, results, strict=True):
                env[slot] = value
            for slot in step.frees:
                env[slot] = None
        return _rebuild(self.output, env)

    def describe(self) -> str:
        return f"{len(self.steps)} regions, {len(self.regions)} compiled"


@dataclass(frozen=True)
class _Slot:
    index: int


def _rebuild(structure: Any, env: list[Any]) -> Any:
    if isinstance(structure, _Slot):
        return env[structure.index]
    if isinstance(structure, (tuple, list)):
        return type(structure)(_rebuild(s, env) for s in structure)
    if isinstance(structure, dict):
        return {k: _rebuild(v, env) for k, v in structure.items()}
    return structure


def layer_list(gm: fx.GraphModule) -> str | None:
    """The path of the module list whose numbered members own the most nodes of ``gm``
    (``model.layers``), if it has at least :data:`MIN_LAYERS` of them."""
    members: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        match = _INDEX.match(node.meta.get("fxlora_module") or "")
        if match:
            members.setdefault(match[1], set()).add(int(match[2]))
    if not members:
        return None
    prefix, indices = max(members.items(), key=lambda item: len(item[1]))
    return prefix if len(indices) >= MIN_LAYERS else None


def _value(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _traced(node: fx.Node, fake_mode: Any, known: dict[fx.Node, Any]) -> Any:
    """``node``'s traced value: from ``known`` (the graph's inputs and tensors), or its
    metadata, or for a node a pass inserted without one, computed from its arguments' under
    ``fake_mode`` (and kept in its metadata)."""
    if node in known:
        return known[node]
    value = _value(node)
    if value is None and node.op in ("call_function", "call_method"):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _traced(n, fake_mode, known))
        with fake_mode:
            value = node.target(*args, **kwargs) if node.op == "call_function" else getattr(args[0], node.target)(*args[1:], **kwargs)
        node.meta["val"] = value
    return value


def _runs(gm: fx.GraphModule, prefix: str) -> dict[fx.Node, int]:
    """Each computing node's run: a new one starts where the layer a node is attributed to
    changes; a node attributed to no module (one a pass inserted) goes to the run of its
    latest input, or stays where it is if it writes anything; an item of a multi-output op
    goes with the op."""
    run_of: dict[fx.Node, int] = {}
    run, current = -1, object()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, fx.Node) and source in run_of:
            run_of[node] = run_of[source]
            continue
        fqn = node.meta.get("fxlora_module")
        if fqn is None and not node.is_impure():  # as early as its inputs allow: shared prologues
            run_of[node] = max((run_of.get(a, 0) for a in node.all_input_nodes), default=0)
            continue
        if fqn is not None:
            match = _INDEX.match(fqn)
            owner = int(match[2]) if match and match[1] == prefix else "outside"
            if owner != current:
                run, current = run + 1, owner
        run_of[node] = max(run, 0)
    return run_of


def _scalar(value: Any) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _describe(value: Any, aliases: dict[Any, int], index: int) -> Any:
    """What a region's compiled code may depend on of one input: for a tensor its type,
    dtype, device, sizes, strides, offset and which earlier input shares its storage (for a
    subclass, its layout and its inner tensors); for a scalar its expression."""
    if isinstance(value, torch.Tensor):
        described: tuple = (
            type(value).__name__, value.dtype, value.device.type, value.requires_grad,
            tuple(map(str, value.shape)), tuple(map(str, value.stride())),
        )  # fmt: skip
        if is_traceable_wrapper_subclass(value):
            names, context = value.__tensor_flatten__()
            inner = tuple(_describe(getattr(value, n), {}, 0) for n in names)
            return (*described, repr(context), inner)
        storage = StorageWeakRef(value.untyped_storage())
        return (*described, str(value.storage_offset()), aliases.setdefault(storage, index))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbol", str(value.node.expr))
    return ("constant", repr(value))


class _Unsplittable(Exception):
    pass


def split(gm: fx.GraphModule) -> Stitched | None:
    """``gm`` as regions (none compiled yet), or None where it is better compiled whole."""
    prefix = layer_list(gm)
    if prefix is None:
        return None
    if any(n.op == "call_module" for n in gm.graph.nodes):
        return None
    try:
        return _split(gm, prefix)
    except _Unsplittable as e:
        log.info("compiling the graph whole: %s", e)
        return None


def _split(gm: fx.GraphModule, prefix: str) -> Stitched:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # the mode the graph was traced in (Dynamo's; the tracing context may hold a later one)
    fake_mode = next((v.fake_mode for v in map(_value, placeholders) if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        raise _Unsplittable("its inputs have no traced values")
    run_of = _runs(gm, prefix)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    slot_of: dict[fx.Node, int] = {n: i for i, n in enumerate(placeholders)}
    values: dict[fx.Node, Any] = {n: _value(n) for n in placeholders}
    constants: dict[int, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            tensor = _fetch(gm, node.target)
            slot_of[node] = len(slot_of)
            constants[slot_of[node]] = tensor
            values[node] = fake_mode.from_tensor(tensor, static_shapes=True) if isinstance(tensor, torch.Tensor) else tensor
    runs: dict[int, list[fx.Node]] = {}
    for node, run in run_of.items():
        runs.setdefault(run, []).append(node)

    # each run's graph: its nodes, a placeholder per value read from outside, a copy of each
    # scalar it reads from another run
    built: list[tuple[fx.Graph, dict[fx.Node, fx.Node], list[fx.Node], list[fx.Node]]] = []
    for run in sorted(runs):
        nodes = sorted(runs[run], key=order.__getitem__)
        graph, env, inputs = fx.Graph(), {}, []

        def read(source: fx.Node, graph=graph, env=env, inputs=inputs) -> fx.Node:
            if source not in env:
                value = _traced(source, fake_mode, values)
                if source in run_of and _scalar(value):
                    env[source] = copy(source, graph, env, inputs)  # a size or other scalar: computed again
                    return env[source]
                if not isinstance(value, torch.Tensor) and source in run_of:
                    raise _Unsplittable(f"node {source.name} hands a {type(value).__name__} to another region")
                env[source] = graph.placeholder(f"arg{len(inputs)}")
                env[source].meta["example_value"] = value  # as Dynamo records it (AOTAutograd's cache reads it)
                inputs.append(source)
            return env[source]

        def copy(node: fx.Node, graph=graph, env=env, inputs=inputs) -> fx.Node:
            def read_here(source: fx.Node) -> fx.Node:
                return read(source, graph, env, inputs)

            args = fx.node.map_arg(node.args, read_here)
            kwargs = fx.node.map_arg(node.kwargs, read_here)
            made = graph.create_node(node.op, node.target, args, kwargs, type_expr=node.type)
            made.meta = dict(node.meta)
            return made

        for node in nodes:
            env[node] = copy(node)
        built.append((graph, env, inputs, nodes))

    # the values each run hands on: read by a later run or the graph's output
    output_node = gm.graph.output_node()
    exported = {n for _, _, inputs, _ in built for n in inputs if n in run_of}
    for source in output_node.all_input_nodes:
        if source in run_of:
            if not isinstance(_value(source), torch.Tensor):
                raise _Unsplittable(f"the graph returns node {source.name}, a {type(_value(source)).__name__}")
            exported.add(source)

    distinct: dict[Any, Region] = {}
    steps: list[Step] = []
    for graph, env, inputs, nodes in built:
        outputs = [n for n in nodes if n in exported]
        graph.output(tuple(env[n] for n in outputs))
        region_gm = fx.GraphModule(torch.nn.Module(), graph)
        example_inputs = [_traced(n, fake_mode, values) for n in inputs]
        aliases: dict[Any, int] = {}
        key = (region_gm.code, tuple(_describe(v, aliases, i) for i, v in enumerate(example_inputs)))
        region = distinct.setdefault(key, Region(region_gm, example_inputs))
        region.count += 1
        for n in outputs:
            slot_of[n] = len(slot_of)
        steps.append(Step(region, [slot_of[n] for n in inputs], [slot_of[n] for n in outputs]))

    output = fx.node.map_arg(output_node.args[0], lambda n: _Slot(slot_of[n]))
    _plan_frees(steps, output)
    return Stitched(steps, len(slot_of), constants, output, list(distinct.values()))


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _plan_frees(steps: Sequence[Step], output: Any) -> None:
    """Each slot is dropped after the step that reads it last, unless the output holds it."""
    kept: set[int] = set()
    fx.node.map_aggregate(output, lambda s: kept.add(s.index) if isinstance(s, _Slot) else None)
    last: dict[int, Step] = {}
    for step in steps:
        for slot in step.inputs:
            last[slot] = step
    for slot, step in last.items():
        if slot not in kept:
            step.frees.append(slot)
