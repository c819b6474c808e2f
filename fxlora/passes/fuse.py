"""fuse: targeted linears that read the same input become one ``fxlora::lora_linear_fused``.

Matches the ``F.linear`` calls of linear pool targets over plain weights (one per call of each
module, :func:`fxlora.compiler.graph_edit.base_calls`) that read the same input node, with a
weight of the pool's shape: q, k and v read the same hidden states, as do gate and up, or
MLA's ``q_a_proj`` and ``kv_a_proj_with_mqa``. A block applied several times (a recurrent
layer) makes one set per application, each the same group of the pool; a set of more than
:data:`fxlora.compiler.operands.MAX_MEMBERS` makes several.

Emits, for each set, one ``fxlora::lora_linear_fused`` that returns each member's own output,
and a ``getitem`` per member that the member's users read: every member keeps its GEMM, and
its factors are one slice of the multi-slice layout the pool holds neighbouring linears in
(:meth:`AdapterPool.join`), so one shrink and one expand serve them all where each would
launch its own. A parameter read a member's weight needs (through casts or a DTensor's
``to_local``) moves up before the op. Records the groups it served.

Leaves alone, for ``lora_linear`` after it, a set the pool cannot join or in which a member's
weight is computed after the first member's call (recorded), and a linear that shares its
input with no other. Calls of tensor-subclass weights (torchao's quantised weights) are
``lora_delta``'s.
"""

from __future__ import annotations

import operator
import os
from collections import defaultdict

import torch
import torch.fx as fx

from fxlora.adapters import PoolTarget
from fxlora.compiler.calls import LINEAR, linear_weight
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import (
    base_calls,
    call_arg,
    meta_shape,
    meta_value,
    parameter_read,
    reads_wrapped_tensor,
)
from fxlora.compiler.operands import MAX_MEMBERS, lora_operands
from fxlora.compiler.rows import row_dim
from fxlora.errors import NotServed


def fuse(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    readers: dict[fx.Node, list[tuple[PoolTarget, fx.Node]]] = defaultdict(list)
    is_base = lambda n: n.target in LINEAR and not reads_wrapped_tensor(n)  # noqa: E731
    for target, node in base_calls(gm, ctx, "linear", is_base, linear_weight):
        x, weight = call_arg(node, 0, "input"), call_arg(node, 1, "weight")
        shape_fits = meta_shape(weight) == (target.info.out_features, target.info.in_features)
        # a module called twice on one input (rare) has its second call served on its own
        if isinstance(x, fx.Node) and shape_fits and all(t is not target for t, _ in readers[x]):
            readers[x].append((target, node))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    fused = []
    for x, members in readers.items():
        members.sort(key=lambda m: order[m[1]])
        for i in range(0, len(members), MAX_MEMBERS):
            if len(members[i : i + MAX_MEMBERS]) > 1:
                fused += _fuse(gm, ctx, x, members[i : i + MAX_MEMBERS])
    if fused:
        kinds = sorted({" + ".join(f.rpartition(".")[2] for f in group) for group in fused})
        text = f"fused groups: {'; '.join(kinds)} ({len(fused)} in all, one shrink and one expand each)"
        ctx.record("served", [f for group in fused for f in group], text)
    gm.graph.lint()
    gm.recompile()
    return gm


def _fuse(gm, ctx: PassContext, x: fx.Node, members: list[tuple[PoolTarget, fx.Node]]) -> list[tuple[str, ...]]:
    """Replace ``members`` (graph order) by one fused op; returns ``[their names]``, or ``[]``
    (and a note why) when they stay as they are."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # as earlier groups left the graph
    fqns = [t.fqn for t, _ in members]
    first = members[0][1]
    weights = [call_arg(n, 1, "weight") for _, n in members]
    biases = [call_arg(n, 2, "bias") for _, n in members]
    late = [a for a in weights + biases if isinstance(a, fx.Node) and position[a] > position[first]]
    reads = [parameter_read(a) for a in late]
    if any(r is None for r in reads):
        ctx.record("info", fqns, f"not fused {', '.join(fqns)}: a weight is computed after the call of {fqns[0]}")
        return []
    try:
        rows = row_dim(gm, ctx, x, feature_dims=1)
    except NotServed:  # lora_linear, next, reports each member
        return []
    try:
        group = ctx.pool.join(fqns)
    except NotServed as why:
        ctx.record("info", fqns, f"not fused {', '.join(fqns)}: {why}")
        return []
    for read in reads:  # a parameter read (through casts, or a DTensor's local shard): safe earlier
        for a in read:
            if position[a] > position[first]:
                first.prepend(a)
    graph = gm.graph
    with graph.inserting_before(first):
        lora, batch, _ = lora_operands(gm, ctx, x, group, rows, workspace=False)
        fused = graph.call_function(torch.ops.fxlora.lora_linear_fused.default, (x, weights, biases, lora, batch))
        fused.meta["fxlora_module"] = os.path.commonprefix([f + "." for f in fqns]).rpartition(".")[0]
        fused.meta["example_value"] = [meta_value(n) for _, n in members]
        parts = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(members))]
    for (target, node), part in zip(members, parts, strict=True):
        part.meta.update(node.meta)  # the member's traced value and module
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        ctx.rewritten[target.fqn] = "fxlora::lora_linear_fused"
    return [group.fqns]
