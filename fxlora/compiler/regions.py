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
where it is read (its producing nodes copied along), an item of a multi-output op stays with
the op, and a region whose inputs' sizes hold a symbol takes that symbol as an input too, as
Dynamo's graph does. Nodes keep their order: a node attributed to no module (one a pass
inserted) stays in the run it is in. A graph without a layer list, or one that does not split
cleanly (a value of unknown kind crossing, a symbol the graph does not take, a tensor held
in a node's arguments, a ``call_module``), is compiled whole.

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

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.compiler.graph_edit import meta_value

log = logging.getLogger(__name__)

_INDEX = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # the first numbered component of a module path
MIN_LAYERS = 2  # a graph with fewer repeated layers is compiled whole


@dataclass
class Region:
    """One distinct region: its graph, and the graph inputs it was first traced from."""

    graph: fx.GraphModule
    example_inputs: list[Any]
    compiled: Callable[..., Any] | None = None
    symbols: list[Any] = field(default_factory=list)  # the traced values of the size symbols it reads, in key order


@dataclass
class Step:
    region: Region
    inputs: list[int]  # slots read
    outputs: list[int]  # slots written, one per output of the region's graph
    frees: list[int] = field(default_factory=list)  # slots read for the last time here


class Stitched:
    """The graph module's computation as calls of compiled regions over a list of slots:
    the graph's inputs first, then its module's tensors, then the regions' outputs."""

    def __init__(self, steps: list[Step], slots: int, constants: dict[int, Any], output: Any):
        self.steps, self.slots, self.constants, self.output = steps, slots, constants, output
        self.regions = list({id(s.region): s.region for s in steps}.values())  # the distinct ones, in order

    def __call__(self, *args: Any) -> Any:
        env: list[Any] = [None] * self.slots
        env[: len(args)] = args
        for slot, value in self.constants.items():
            env[slot] = value
        for step in self.steps:
            for slot, value in zip(step.outputs, step.region.compiled(*[env[i] for i in step.inputs]), strict=True):
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


class _Unsplittable(Exception):
    """The graph does not split cleanly (the message says where); it is compiled whole."""


def split(gm: fx.GraphModule) -> Stitched | None:
    """``gm`` as regions (none compiled yet), or None where it is better compiled whole."""
    prefix = layer_list(gm)
    if prefix is None or any(n.op == "call_module" for n in gm.graph.nodes):
        return None
    try:
        return _Splitter(gm, prefix).stitched()
    except Exception as e:  # whatever stops the split, the graph is still compiled, whole
        log.warning("compiling the graph whole: %s: %s", type(e).__name__, e, exc_info=not isinstance(e, _Unsplittable))
        return None


class _Splitter:
    """Cuts a graph into runs and builds each run's graph."""

    def __init__(self, gm: fx.GraphModule, prefix: str):
        self.gm, self.prefix = gm, prefix
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # the mode the graph was traced in (Dynamo's; the tracing context may hold a later one)
        self.fake_mode = next((v.fake_mode for v in map(meta_value, placeholders) if hasattr(v, "fake_mode")), None)
        if self.fake_mode is None:
            raise _Unsplittable("its inputs have no traced values")
        self.values: dict[fx.Node, Any] = {n: meta_value(n) for n in placeholders}
        self.slot_of: dict[fx.Node, int] = {n: i for i, n in enumerate(placeholders)}
        self.constants: dict[int, Any] = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = operator.attrgetter(node.target)(gm)
                self.slot_of[node] = len(self.slot_of)
                self.constants[self.slot_of[node]] = value
                is_tensor = isinstance(value, torch.Tensor)
                self.values[node] = self.fake_mode.from_tensor(value, static_shapes=True) if is_tensor else value
        # the graph's inputs that are symbols, by symbol: a region whose inputs' sizes hold one takes it
        self.symbols = {v.node.expr: n for n, v in self.values.items() if isinstance(v, torch.SymInt)}
        self.run_of = self._runs()

    def value(self, node: fx.Node) -> Any:
        """``node``'s traced value; for an op a pass inserted without one, computed from its
        arguments' under the graph's fake mode (only ops and their items: anything else, such
        as an autocast context Dynamo recorded, would run for real)."""
        if node not in self.values:
            value = meta_value(node)
            if value is None and (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem):
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.value)
                with self.fake_mode:
                    value = node.target(*args, **kwargs)
            self.values[node] = value
        return self.values[node]

    def _runs(self) -> dict[fx.Node, int]:
        """Each computing node's run: a new one starts where the layer a node is attributed to
        changes; a node attributed to no module stays in the run it is in; an item of a
        multi-output op goes with the op."""
        run_of: dict[fx.Node, int] = {}
        run, current = 0, None
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            source = node.args[0] if node.target is operator.getitem else None
            if source in run_of and isinstance(self.value(source), (tuple, list)):
                run_of[node] = run_of[source]
                continue
            fqn = node.meta.get("fxlora_module")
            if fqn is not None:
                match = _INDEX.match(fqn)
                owner = int(match[2]) if match and match[1] == self.prefix else "outside"
                if current is not None and owner != current:
                    run += 1
                current = owner
            run_of[node] = run
        return run_of

    def stitched(self) -> Stitched:
        runs: dict[int, list[fx.Node]] = {}
        for node in self.gm.graph.nodes:  # in graph order
            if node in self.run_of:
                runs.setdefault(self.run_of[node], []).append(node)
        built = [_Run(self, nodes) for _, nodes in sorted(runs.items())]

        # the values each run hands on: read by a later run or the graph's output
        output_node = self.gm.graph.output_node()
        exported = {n for run in built for n in run.inputs if n in self.run_of}
        for source in output_node.all_input_nodes:
            if source in self.run_of:
                if not isinstance(self.value(source), torch.Tensor):
                    raise _Unsplittable(f"the graph returns node {source.name}, a {type(self.value(source)).__name__}")
                exported.add(source)

        distinct: dict[Any, Region] = {}
        steps: list[Step] = []
        for run in built:
            outputs = [n for n in run.nodes if n in exported]
            region_gm, example_inputs, key = run.finish(outputs)
            region = distinct.setdefault(key, Region(region_gm, example_inputs, symbols=run.symbols))
            for mine, first in zip(run.symbols, region.symbols, strict=True):
                # code compiled for the first run's sizes serves this run's while they stay equal:
                # a guard, so that sizes that part later retrace rather than run it
                torch._check(mine == first, lambda: "regions sharing code have sizes that differ")
            for n in outputs:
                self.slot_of[n] = len(self.slot_of)
            steps.append(Step(region, [self.slot_of[n] for n in run.inputs], [self.slot_of[n] for n in outputs]))
        output = fx.node.map_arg(output_node.args[0], lambda n: _Slot(self.slot_of[n]))
        _plan_frees(steps, output)
        return Stitched(steps, len(self.slot_of), self.constants, output)


class _Run:
    """The graph of one run: its nodes, a placeholder per value read from outside, a copy of
    each scalar it reads from another run."""

    def __init__(self, splitter: _Splitter, nodes: list[fx.Node]):
        self.splitter, self.nodes = splitter, nodes
        self.graph, self.env, self.inputs = fx.Graph(), {}, []
        for node in nodes:
            self.env[node] = self.rebuild(node)
        # every symbol the inputs' sizes hold, as an input of its own, where Inductor reads it (a mask's
        # past + new columns name no symbol Inductor could read off a size)
        symbols = dict.fromkeys(s for n in self.inputs for s in _in_order(self.splitter.value(n)))
        for symbol in symbols:  # in order of appearance, as the region's key names them (_expression)
            if symbol not in self.splitter.symbols:
                raise _Unsplittable(f"symbol {symbol} in a region's input sizes is no input of the graph")
            self.read(self.splitter.symbols[symbol])
        self.symbols = [self.splitter.value(self.splitter.symbols[s]) for s in symbols]  # their traced values

    def read(self, source: fx.Node) -> fx.Node:
        if source not in self.env:
            value = self.splitter.value(source)
            computed = source in self.splitter.run_of
            if computed and isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                self.env[source] = self.rebuild(source)  # a size or other scalar: computed again here
                return self.env[source]
            if computed and not isinstance(value, torch.Tensor):
                raise _Unsplittable(f"node {source.name} hands a {type(value).__name__} to another region")
            self.env[source] = self.graph.placeholder(f"arg{len(self.inputs)}")
            self.env[source].meta["example_value"] = value  # as Dynamo records it (AOTAutograd's cache reads it)
            self.inputs.append(source)
        return self.env[source]

    def rebuild(self, node: fx.Node) -> fx.Node:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.read)
        fx.node.map_aggregate((args, kwargs), _no_tensor)
        made = self.graph.create_node(node.op, node.target, args, kwargs, type_expr=node.type)
        made.meta = dict(node.meta)
        return made

    def finish(self, outputs: list[fx.Node]) -> tuple[fx.GraphModule, list[Any], Any]:
        """The run's graph module returning ``outputs``, its example inputs, and its key:
        what its compiled code depends on."""
        self.graph.output(tuple(self.env[n] for n in outputs))
        region_gm = fx.GraphModule(torch.nn.Module(), self.graph)
        example_inputs = [self.splitter.value(n) for n in self.inputs]
        storages: dict[Any, int] = {}
        symbols: dict[Any, Any] = {}
        described = tuple(_describe(v, storages, symbols) for v in example_inputs)
        hints = tuple(v.node.hint for v in self.symbols)  # runs share code only where their sizes agree now
        return region_gm, example_inputs, (region_gm.code, described, hints)


def _no_tensor(arg: Any) -> None:
    if isinstance(arg, torch.Tensor):  # a region's code would not hold its values
        raise _Unsplittable("a node holds a tensor in its arguments")


def _describe(value: Any, storages: dict[Any, int], symbols: dict[Any, Any]) -> Any:
    """What a region's compiled code may depend on of one input: for a tensor its type,
    dtype, device, sizes, strides, offset and which storage among the region's inputs it
    views (for a subclass, its layout and its inner tensors); for a scalar its expression.
    Size symbols are named by their first appearance among the region's inputs
    (:func:`_expression`): each layer's KV-cache pages have a block count of their own, which
    Dynamo traces as a symbol of its own, and the layers' regions are still one (the key holds
    the symbols' current values, and sharing guards them equal)."""
    if isinstance(value, torch.Tensor):
        described: tuple = (
            type(value).__name__, value.dtype, str(value.device), value.requires_grad,
            tuple(_expression(d, symbols) for d in value.shape), tuple(_expression(d, symbols) for d in value.stride()),
        )  # fmt: skip
        if is_traceable_wrapper_subclass(value):
            names, context = value.__tensor_flatten__()
            return (*described, repr(context), tuple(_describe(getattr(value, n), storages, symbols) for n in names))
        storage = StorageWeakRef(value.untyped_storage())
        return (*described, _expression(value.storage_offset(), symbols), storages.setdefault(storage, len(storages)))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbol", _expression(value, symbols))
    return ("constant", repr(value))


def _in_order(value: Any) -> list[Any]:
    """The size symbols of ``value`` in the order :func:`_describe` meets them."""
    if isinstance(value, torch.Tensor):
        inner = value.__tensor_flatten__()[0] if is_traceable_wrapper_subclass(value) else []
        parts = [*value.shape, *value.stride(), *([] if inner else [value.storage_offset()])]
        return [s for p in parts for s in _in_order(p)] + [s for n in inner for s in _in_order(getattr(value, n))]
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return sorted(free_symbols(value), key=str)
    return []


def _expression(size: Any, symbols: dict[Any, Any]) -> str:
    """``size`` as text, its symbols renamed ``r0, r1, ...`` in the order the region's inputs
    first show them (new ones within one expression by name): two regions whose inputs differ
    only in which symbols they hold get one key, and their code, which reads every size from
    its inputs, serves both."""
    if not isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(size)
    expr = size.node.expr
    for symbol in sorted(expr.free_symbols - symbols.keys(), key=str):
        symbols[symbol] = sympy.Symbol(f"r{len(symbols)}", **symbol.assumptions0)
    return str(expr.xreplace(symbols))


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
