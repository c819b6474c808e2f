"""lora_linear: every targeted linear gets its LoRA one way, onto the output of each call of
its module, as PEFT's wrapper adds the delta onto its base layer's.

Matches, for each linear pool target the graph calls, the region of each call: the call nodes
``annotate`` attributed to the module or its submodules
(:func:`fxlora.compiler.graph_edit.module_region`, ``module_calls``), less a row-parallel
layer's closing all-reduce. A region has one output, of shape ``(..., out_features)``, and
reads one input, of shape ``(..., in_features)`` with the output's leading shape (parameters,
recognised by identity with the model's, are not inputs). A region whose whole work is one
plain linear — an ``F.linear`` (or ``Conv1D``'s ``addmm``) of the module's own plain weight,
the call's one such call (:func:`fxlora.compiler.graph_edit.base_calls`) — is that call; so is
each linear call that reads a target's 2-D parameter (``target_parameters``). Regions that
read one input form a group: q, k and v read the same hidden states, as do gate and up, MLA's
``q_a_proj`` and ``kv_a_proj_with_mqa``, a quantised model's projections. A group of up to
:data:`fxlora.compiler.operands.MAX_MEMBERS` is joined in the pool
(:meth:`AdapterPool.join`, the layout of neighbouring linears), so that one shrink and one
expand serve it.

Emits, for each group, or for each region where its group cannot be joined:

- plain linears: the base call replaced by ``fxlora::lora_linear``, or for a group one
  ``fxlora::lora_linear_fused`` that returns each member's output (every member keeps its
  GEMM); a parameter read a later member's weight needs moves up before the op. For code
  captured in CUDA graphs (``PassContext.shrink_ahead``) one ``fxlora::lora_linear_beside``
  per group or linear instead, whose delta, made on the side stream beside the GEMMs, the
  graph adds onto each member's output (a pointwise add Inductor fuses into its next reader);
- any other region (``input @ weight.T``, a torchao-quantised weight, a forward that makes
  several linear calls): ``fxlora::lora_delta`` right after its output, adding in place, the
  base computation kept in its traced form, a group's later regions moved up behind the first
  one. For code captured in CUDA graphs (``PassContext.shrink_ahead``) its shrink, which reads
  only the input, becomes ``fxlora::lora_shrink`` right before the regions, so that it runs
  beside the base, and the op after them only expands.

Records the groups and the modules it served. Leaves alone, and records as skipped, a module
whose region does not fit a linear or whose input's rows cannot be told
(:func:`fxlora.compiler.rows.row_dim`); a group it cannot join (a weight computed after the
first member, a region that mutates a tensor or reads a value computed after the first one,
members the pool does not hold side by side) is served a member at a time, with a note why.
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
from fxlora.compiler.calls import LINEAR, is_conv1d_addmm, linear_weight
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import (
    base_calls,
    call_arg,
    fake_value,
    input_values,
    meta_shape,
    meta_value,
    module_calls,
    module_nodes,
    module_region,
    moves_data,
    parameter_read,
    reads_wrapped_tensor,
    region_inputs,
    region_outputs,
    replace_with,
    split_reduction,
)
from fxlora.compiler.operands import MAX_MEMBERS, lora_operands
from fxlora.compiler.rows import row_dim
from fxlora.errors import NotServed


@dataclass(frozen=True)
class Region:
    """One call of a targeted module: its traced nodes, the one input they read, their one
    output, and ``linear``, the plain linear call that is all of its work, if it is one."""

    target: PoolTarget
    nodes: list[fx.Node]
    x: fx.Node
    output: fx.Node
    linear: fx.Node | None = None


def lora_linear(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    values, index = input_values(gm, ctx), module_nodes(gm)
    plain, refused = _plain_linears(gm, ctx)
    readers: dict[fx.Node, list[Region]] = defaultdict(list)
    for fqn, target in ctx.pool.targets.items():
        if target.info.kind != "linear":
            continue
        try:
            regions = _regions(gm, target, values, index, plain.get(fqn, []), refused.get(fqn))
        except NotServed as why:
            ctx.leave_traced(fqn, str(why))
            continue
        for region in regions:
            readers[region.x].append(region)
    fused, delta = [], []
    replaced: dict[fx.Node, fx.Node] = {}  # a plain linear served before -> what its users read now
    for x, regions in readers.items():
        while x in replaced:  # the input is a targeted linear served already
            x = replaced[x]
        try:
            rows = row_dim(gm, ctx, x, feature_dims=1)
        except NotServed as why:
            for r in regions:
                ctx.leave_traced(r.target.fqn, str(why))
            continue
        for fast in (True, False):
            part = [r for r in regions if (r.linear is not None) == fast]
            order = {n: i for i, n in enumerate(gm.graph.nodes)}  # as earlier groups left the graph
            part.sort(key=lambda r: order[r.output])
            for i in range(0, len(part), MAX_MEMBERS):
                served = _serve(gm, ctx, x, rows, part[i : i + MAX_MEMBERS], fast, replaced)
                (fused if fast else delta).extend(served)
    _report(ctx, fused, delta)
    gm.graph.lint()
    gm.recompile()
    return gm


def _plain_linears(gm: fx.GraphModule, ctx: PassContext) -> tuple[dict[str, list[fx.Node]], dict[str, str]]:
    """Each linear target's plain linear calls (one per call of its module, over its own plain
    weight of the pool's shape), and why a target's calls are not plain linears."""
    is_base = lambda n: (n.target in LINEAR or is_conv1d_addmm(n)) and not reads_wrapped_tensor(n)  # noqa: E731
    calls, refused = base_calls(gm, ctx, "linear", is_base, linear_weight)
    plain: dict[str, list[fx.Node]] = defaultdict(list)
    for target, node in calls:
        want = (target.info.out_features, target.info.in_features)
        shape = meta_shape(linear_weight(node))
        if shape is None or shape == (want[::-1] if node.target is torch.addmm else want):
            plain[target.fqn].append(node)
    return plain, refused


def _regions(
    gm: fx.GraphModule, target: PoolTarget, values: dict, index: dict, linears: list[fx.Node], refused: str | None
) -> list[Region]:
    """The regions of ``target``'s calls in ``gm`` (none if the graph does not call it; ``index``:
    its modules' nodes, :func:`module_nodes`); raises :class:`NotServed` when one does not fit
    a linear."""
    if target.info.parameter is not None:  # the module's linear calls that read the parameter
        if refused is not None:
            raise NotServed(refused)
        return [Region(target, [n], _linear_input(n), n, n) for n in linears]
    nodes = module_region(gm, target.fqn, index)
    regions = []
    for call in module_calls(target.fqn, nodes) if nodes else []:
        inside = set(call)
        linear = next((n for n in linears if n in inside), None)
        region = _plain_region(target, call, linear) if linear is not None else None
        regions.append(region or _boundary(target, call, values))
    return regions


def _plain_region(target: PoolTarget, call: list[fx.Node], linear: fx.Node) -> Region | None:
    """The call as its plain ``linear``, where the rest of the call only reads its weight and
    bias and moves data (views, casts, a tensor-parallel layer's collectives and DTensor
    conversions): the delta added to the linear's output then reaches the call's output as
    PEFT adds it there. Else None."""
    reads = {n for a in (linear_weight(linear), _linear_bias(linear)) for n in parameter_read(a) or ()}
    if all(n is linear or n in reads or moves_data(n) for n in call):
        return Region(target, [linear], _linear_input(linear), linear, linear)
    return None


def _linear_bias(node: fx.Node) -> object:
    return call_arg(node, 0, "input") if node.target is torch.addmm else call_arg(node, 2, "bias")


def _linear_input(node: fx.Node) -> fx.Node:
    return call_arg(node, 1, "mat1") if node.target is torch.addmm else call_arg(node, 0, "input")


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


def _serve(
    gm: fx.GraphModule, ctx: PassContext, x: fx.Node, rows: int, regions: list[Region], fast: bool, replaced: dict
) -> list[tuple[str, ...]]:
    """One op for ``regions`` (graph order; plain linears if ``fast``; their input ``x``'s rows
    along its dimension ``rows``) where they can be joined, else one op each; returns the names
    of each group served. A plain linear replaced goes into ``replaced``."""
    fqns = [r.target.fqn for r in regions]
    if len(set(fqns)) == len(regions) > 1:  # a module called twice on one input is served per call
        why = _cannot_fuse(gm, regions) if fast else _cannot_group(gm, regions)
        if why is None:
            try:
                group = ctx.pool.join(fqns)
            except NotServed as e:
                why = str(e)
        if why is None:
            if fast:
                replaced.update(_fuse(gm, ctx, x, rows, regions, group))
            else:
                _move_up(gm, regions)
                _add_delta(gm, ctx, x, rows, regions, group)
            return [group.fqns]
        ctx.record("info", fqns, f"{'not fused' if fast else 'not joined'} {', '.join(fqns)}: {why}")
    for r in regions:
        if fast and ctx.shrink_ahead:
            replaced.update(_fuse(gm, ctx, x, rows, [r], r.target))
        elif fast:
            replaced[r.linear] = _replace(gm, ctx, x, rows, r)
        else:
            _add_delta(gm, ctx, x, rows, [r], r.target)
    return [(f,) for f in fqns]


def _report(ctx: PassContext, fused: list[tuple[str, ...]], delta: list[tuple[str, ...]]) -> None:
    kinds = lambda groups: "; ".join(sorted({" + ".join(f.rpartition(".")[2] for f in g) for g in groups}))  # noqa: E731
    joint = [g for g in fused if len(g) > 1]
    if joint:
        text = f"fused groups: {kinds(joint)} ({len(joint)} in all, one shrink and one expand each)"
        ctx.record("served", [f for g in joint for f in g], text)
    if delta:
        served = [f for g in delta for f in g]
        ctx.record("served", served, f"LoRA delta onto the traced base of {len(served)} module(s): {kinds(delta)}")
        if ctx.shrink_ahead:
            ctx.record("info", served, "each shrink issued before its traced base (fxlora::lora_shrink)")


# -- plain linears: the base call becomes the LoRA op -----------------------------------------


def _cannot_fuse(gm: fx.GraphModule, regions: list[Region]) -> str | None:
    """Why the plain linears ``regions`` cannot become one op at the first one's place, or None."""
    if any(r.linear.target not in LINEAR for r in regions):
        return "a Conv1D's addmm is served on its own"
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = position[regions[0].linear]
    for r in regions[1:]:
        for a in (call_arg(r.linear, 1, "weight"), call_arg(r.linear, 2, "bias")):
            if isinstance(a, fx.Node) and position[a] > first and parameter_read(a) is None:
                return f"a weight is computed after the call of {regions[0].target.fqn}"
    return None


def _fuse(
    gm: fx.GraphModule, ctx: PassContext, x: fx.Node, rows: int, regions: list[Region], factors: PoolTarget | PoolGroup
) -> dict[fx.Node, fx.Node]:
    """One ``lora_linear_fused`` at the first member's place, or under ``ctx.shrink_ahead`` one
    ``lora_linear_beside`` and an add of its delta's columns onto each member's output; the
    members' users read what serves them (returned: each member's linear -> that node)."""
    graph = gm.graph
    first = regions[0].linear
    weights, biases = [linear_weight(r.linear) for r in regions], [_linear_bias(r.linear) for r in regions]
    position = {n: i for i, n in enumerate(graph.nodes)}
    for a in weights + biases:  # a parameter read (through casts, or a DTensor's local shard): safe earlier
        if isinstance(a, fx.Node) and position[a] > position[first]:
            for n in parameter_read(a):
                if position[n] > position[first]:
                    first.prepend(n)
    beside = ctx.shrink_ahead
    op = torch.ops.fxlora.lora_linear_beside.default if beside else torch.ops.fxlora.lora_linear_fused.default
    with graph.inserting_before(first):
        if first.target is torch.addmm:  # a Conv1D (served on its own) stores its weight transposed
            weights = [graph.call_function(torch.t, (weights[0],))]
        lora, batch, _ = lora_operands(gm, ctx, x, factors, rows, workspace=False)
        fused = graph.call_function(op, (x, weights, biases, lora, batch))
        fused.meta["fxlora_module"] = _common_module([r.target.fqn for r in regions])
        fused.meta["example_value"] = [meta_value(r.linear) for r in regions]
        parts = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(regions) + beside)]
        if beside:
            parts = _add_columns(graph, fused, regions, parts)
    for r, part in zip(regions, parts, strict=True):
        part.meta.update(r.linear.meta)  # the member's traced value and module
        r.linear.replace_all_uses_with(part)
        graph.erase_node(r.linear)
        ctx.rewritten[r.target.fqn] = op.name()
    return {r.linear: part for r, part in zip(regions, parts, strict=True)}


def _add_columns(graph: fx.Graph, op: fx.Node, regions: list[Region], parts: list[fx.Node]) -> list[fx.Node]:
    """Each member's output plus its columns of the delta (``lora_linear_beside``'s last part)."""
    *ys, delta = parts
    widths = [meta_shape(r.linear)[-1] if meta_shape(r.linear) else r.target.info.out_features for r in regions]  # this rank's
    fake_value(delta, lambda y: y.new_empty((*y.shape[:-1], sum(widths))), regions[0].linear)
    if "example_value" in delta.meta:
        op.meta["example_value"] = [*op.meta["example_value"], delta.meta["example_value"]]
    outs, col = [], 0
    for r, y, width in zip(regions, ys, widths, strict=True):
        y.meta.update(r.linear.meta)  # the member's base output: its traced value and module
        columns = delta
        if len(regions) > 1:
            columns = graph.call_function(torch.narrow, (delta, -1, col, width))
            fake_value(columns, lambda d, col=col, width=width: d.narrow(-1, col, width), delta)
        outs.append(graph.call_function(operator.add, (y, columns)))
        col += width
    return outs


def _replace(gm: fx.GraphModule, ctx: PassContext, x: fx.Node, rows: int, r: Region) -> fx.Node:
    """``lora_linear`` of ``x`` in place of one plain linear call (returned); a ``Conv1D``
    weight, stored transposed, goes in as ``weight.t()``."""
    node = r.linear
    weight, bias = linear_weight(node), _linear_bias(node)
    with gm.graph.inserting_before(node):
        if node.target is torch.addmm:
            weight = gm.graph.call_function(torch.t, (weight,))
        args = (x, weight, bias, *lora_operands(gm, ctx, x, r.target, rows))
    ctx.rewritten[r.target.fqn] = "fxlora::lora_linear"
    return replace_with(gm, node, torch.ops.fxlora.lora_linear.default, args)


# -- any other region: the delta onto its output -----------------------------------------------


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


def _add_delta(
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
        node.meta["fxlora_module"] = _common_module(fqns)
        node.meta["example_value"] = None
    for fqn in fqns:
        ctx.rewritten[fqn] = "fxlora::lora_delta"


def _common_module(fqns: list[str]) -> str:
    """The module that holds every one of ``fqns`` (the one itself, if one)."""
    return fqns[0] if len(fqns) == 1 else os.path.commonprefix([f + "." for f in fqns]).rpartition(".")[0]
