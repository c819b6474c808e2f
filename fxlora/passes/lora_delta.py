"""lora_delta: the LoRA delta added onto the output of a targeted linear that is not a plain
``F.linear`` of its weight.

Matches every linear pool target the passes before did not replace — ``input @ weight.T``
(Falcon's ``FalconLinear``), an ``F.linear`` of a tensor-subclass weight (torchao's quantised
weights), a forward that makes several linear calls, anything else its forward does — by its
boundary: the call nodes ``annotate`` attributed to the module or its submodules, one region
per call of the module. A region must have one output, of shape ``(..., out_features)``, and
read one input of shape ``(..., in_features)`` with the output's leading shape (parameters,
recognised by identity with the model's, are not inputs); a row-parallel layer's all-reduce
stays after the region.

Emits ``fxlora::lora_delta`` right after the output, adding in place, so every user of the
output reads the sum, as PEFT's wrapper adds the delta onto its base layer's; the base
computation keeps its traced form. Targets whose regions read the same input (a quantised
model's q, k and v; Falcon's ``query_key_value`` and ``dense_h_to_4h``) are joined in the pool
(:meth:`AdapterPool.join`) and served by one op over all their outputs, the multi-slice
layout, the later regions moved up behind the first one, where their inputs are ready. For
code captured in CUDA graphs (``PassContext.shrink_ahead``) the op's shrink, which reads only
the input, becomes ``fxlora::lora_shrink`` right before the regions, so that it runs beside
the base, and the op after them only expands. Records the modules it served; a target it
serves is no longer left as traced, whatever an earlier pass recorded.

Leaves alone, and records as skipped, a module whose region does not fit a linear. A region
that mutates anything, or reads a value computed after the first one, is not moved: it is
served where it was traced, on its own (recorded).
"""

from __future__ import annotations

import operator
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import PoolGroup, PoolTarget
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import (
    input_values,
    meta_value,
    module_calls,
    module_region,
    region_inputs,
    region_outputs,
    split_reduction,
)
from fxlora.compiler.operands import MAX_MEMBERS, lora_operands
from fxlora.compiler.rows import row_dim
from fxlora.errors import NotServed

OP = "fxlora::lora_delta"
# a region holding one of these (or a member's output of the fused one) was served by an earlier pass
_SERVED = (torch.ops.fxlora.lora_linear.default, torch.ops.fxlora.lora_linear_fused.default)


@dataclass(frozen=True)
class Region:
    """A targeted module's traced nodes, the one input they read and their one output."""

    target: PoolTarget
    nodes: list[fx.Node]
    x: fx.Node
    output: fx.Node


def lora_delta(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    values = input_values(gm, ctx)
    readers: dict[fx.Node, list[Region]] = defaultdict(list)
    for fqn, target in ctx.pool.targets.items():
        if target.info.kind != "linear":
            continue
        nodes = module_region(gm, fqn)
        if not nodes or any(_served(n) for n in nodes):
            continue
        try:
            regions = [_boundary(target, call, values) for call in module_calls(fqn, nodes)]
        except NotServed as why:
            ctx.leave_traced(fqn, str(why))
            continue
        for region in regions:
            readers[region.x].append(region)
    groups = []
    for x, regions in readers.items():
        try:
            rows = row_dim(gm, ctx, x, feature_dims=1)
        except NotServed as why:
            for r in regions:
                ctx.leave_traced(r.target.fqn, str(why))
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        regions.sort(key=lambda r: order[r.output])
        for i in range(0, len(regions), MAX_MEMBERS):
            groups += _serve(gm, ctx, x, rows, regions[i : i + MAX_MEMBERS])
    if groups:
        kinds = sorted({" + ".join(f.rpartition(".")[2] for f in g) for g in groups})
        served = [f for g in groups for f in g]
        ctx.record("served", served, f"LoRA delta onto the traced base of {len(served)} module(s): {'; '.join(kinds)}")
        if ctx.shrink_ahead:
            ctx.record("info", served, "each shrink issued before its traced base (fxlora::lora_shrink)")
    gm.graph.lint()
    gm.recompile()
    return gm


def _served(node: fx.Node) -> bool:
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.target in _SERVED


def _boundary(target: PoolTarget, nodes: list[fx.Node], values: dict[fx.Node, object]) -> Region:
    """The region's input and output; raises :class:`NotServed` when they do not fit a linear."""
    info = target.info
    nodes, _ = split_reduction(nodes)  # a row-parallel layer's partial output: the delta goes in before its all-reduce
    outputs = region_outputs(nodes)
    if len(outputs) != 1:
        raise NotServed(f"its traced region has {len(outputs)} outputs, not one")
    output = outputs[0]
    y = meta_value(output)
    if not isinstance(y, torch.Tensor) or y.dim() == 0 or not _is(y.shape[-1], info.out_features):
        shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise NotServed(f"its traced output {shape} is not (..., {info.out_features})")
    lead = str(tuple(y.shape[:-1]))
    candidates = []
    for a in region_inputs(nodes):
        v = meta_value(a)
        value = values.get(a)
        if a.op == "get_attr" or isinstance(value, torch.nn.Parameter) or (value is not None and value is info.weight):
            continue
        if isinstance(v, torch.Tensor) and v.dim() and _is(v.shape[-1], info.in_features) and str(tuple(v.shape[:-1])) == lead:
            candidates.append(a)
    if len(candidates) != 1:
        raise NotServed(
            f"its traced region reads {len(candidates)} inputs of shape (..., {info.in_features}) with its output's "
            f"leading shape {lead}, not one"
        )
    x = candidates[0]
    if _shares_memory(y, meta_value(x)):
        raise NotServed("its traced output shares memory with its input")
    return Region(target, nodes, x, output)


def _is(size: object, n: int) -> bool:
    """``size == n`` for a static size, without asking a symbolic one (which would guard)."""
    return isinstance(size, int) and size == n


def _shares_memory(a: torch.Tensor, b: object) -> bool:
    if not isinstance(b, torch.Tensor) or is_traceable_wrapper_subclass(a) or is_traceable_wrapper_subclass(b):
        return False  # a wrapper's storage is its inner tensors': a plain output is never one of them
    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


def _serve(gm: fx.GraphModule, ctx: PassContext, x: fx.Node, rows: int, regions: list[Region]) -> list[tuple[str, ...]]:
    """One op for ``regions`` (graph order; their input's rows along its dimension ``rows``)
    where they can be joined, else one op each; returns the names of each group served."""
    if len({r.target.fqn for r in regions}) == len(regions) > 1:  # a module called twice is served per call
        why = _cannot_group(gm, regions)
        if why is None:
            try:
                group = ctx.pool.join([r.target.fqn for r in regions])
            except NotServed as e:
                why = str(e)
        if why is None:
            _move_up(gm, regions)
            _insert(gm, ctx, x, rows, regions, group)
            return [group.fqns]
        fqns = [r.target.fqn for r in regions]
        ctx.record("info", fqns, f"not joined {', '.join(fqns)}: {why}")
    for r in regions:
        _insert(gm, ctx, x, rows, [r], r.target)
    return [(r.target.fqn,) for r in regions]


def _cannot_group(gm: fx.GraphModule, regions: list[Region]) -> str | None:
    """Why the later regions cannot run right after the first one's output, or None."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = position[regions[0].output]
    dtypes = {meta_value(r.output).dtype for r in regions}
    if len(dtypes) > 1:
        return f"their outputs differ in dtype ({', '.join(map(str, sorted(dtypes, key=str)))})"
    for r in regions[1:]:
        late = [a for a in region_inputs(r.nodes) if position[a] > first]
        if late:
            return f"{r.target.fqn} reads {late[0].name}, computed after {regions[0].target.fqn}"
        if not all(_pure(n) for n in r.nodes):
            return f"{r.target.fqn} mutates a tensor, so it stays where it was traced"
    return None


def _pure(node: fx.Node) -> bool:
    """Whether ``node`` writes nothing but its own output (so it may move earlier)."""
    if node.op == "call_method":
        return not (node.target.endswith("_") and not node.target.endswith("__"))
    if isinstance(node.target, torch._ops.OpOverload):
        return not node.target._schema.is_mutable
    name = getattr(node.target, "__name__", "")
    return not (name.startswith("i") and getattr(operator, name, None) is node.target) and node.target is not operator.setitem


def _move_up(gm: fx.GraphModule, regions: list[Region]) -> None:
    """Move the later regions' nodes, in order, to right after the first region's output."""
    point = regions[0].output
    for r in regions[1:]:
        for n in r.nodes:
            point.append(n)
            point = n


def _insert(
    gm: fx.GraphModule, ctx: PassContext, x: fx.Node, rows: int, regions: list[Region], factors: PoolTarget | PoolGroup
) -> None:
    """``lora_delta(x, [outputs], ...)`` right after the last region's output; with
    ``ctx.shrink_ahead``, its shrink (``lora_shrink``) right before the first region's
    first node, and the op only expands."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = max((r.output for r in regions), key=order.__getitem__)
    outputs = [r.output for r in regions]
    if ctx.shrink_ahead and all(_pure(n) for r in regions for n in r.nodes):  # the base leaves x as the shrink read it
        first = min((n for r in regions for n in r.nodes), key=order.__getitem__)
        with gm.graph.inserting_before(first):
            operands = lora_operands(gm, ctx, x, factors, rows)
            shrink = gm.graph.call_function(torch.ops.fxlora.lora_shrink.default, (x, *operands, len(regions)))
        with gm.graph.inserting_before(last.next):
            op = gm.graph.call_function(torch.ops.fxlora.lora_delta.default, (x, outputs, *operands, True))
        marked = [shrink, op]
    else:
        with gm.graph.inserting_before(last.next):
            op = gm.graph.call_function(torch.ops.fxlora.lora_delta.default, (x, outputs, *lora_operands(gm, ctx, x, factors, rows)))
        marked = [op]
    fqns = [r.target.fqn for r in regions]
    for node in marked:
        node.meta["fxlora_module"] = fqns[0] if len(fqns) == 1 else os.path.commonprefix([f + "." for f in fqns]).rpartition(".")[0]
        node.meta["example_value"] = None
    for fqn in fqns:
        ctx.rewritten[fqn] = OP
