"""A LoRA op's operands, inserted into a graph: the bundles of :mod:`fxlora.ops.operands` as
nodes.

The factors' bundle is ``get_attr`` nodes of the pool's own tensors, made buffers of the graph
module (:func:`pool_nodes`). The batch bundle is the outputs of a ``fxlora::batch_info``
prologue over the op's tokens (:func:`batch_info_for`), which reads the graph's slot-ids
input (:data:`fxlora.compiler.rows.SLOT_IDS`, made on first use); each request inserts a
prologue of its own, tagged with its tokens' layout, and the ``batch_info`` pass keeps one per
layout. A linear op also takes the shrink's workspace as a node of its own
(:func:`lora_operands`), so that ``hoist`` can place it in the arena.
"""

from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxlora.adapters import PoolGroup, PoolTarget
from fxlora.compiler.graph_edit import fake_value, meta_shape
from fxlora.compiler.rows import SLOT_IDS, batch_placeholder
from fxlora.ops.delta_launcher import lora_workspace

if TYPE_CHECKING:
    from fxlora.compiler.context import PassContext

# Ops that serve several targets at once (fused linears, a joined lora_delta) take at most
# this many: the expands update at most four outputs (fxlora.kernels.sgmv.MAX_SLICES); more
# make several groups.
MAX_MEMBERS = 4
PROLOGUE_LAYOUT = "fxlora_layout"  # node.meta key of a prologue: its tokens' leading shape and row dimension


def pool_nodes(gm: fx.GraphModule, target: PoolTarget | PoolGroup) -> list[fx.Node]:
    """``get_attr`` nodes for one target's (or group's) ``lora_a, lora_b, scaling, rank``: the
    list a LoRA op takes as its ``lora`` bundle. The pool's own tensors become buffers of
    ``gm``, so in-place adapter loads reach the graph: persistent ones, as a set of names of
    non-persistent buffers would enter AOTAutograd's cache key in an order that changes from one
    process to the next."""
    stem = "fxlora_" + re.sub(r"\W", "_", target.fqn)
    nodes = []
    for field in ("lora_a", "lora_b", "scaling", "rank"):
        name = f"{stem}_{field}"
        if not hasattr(gm, name):
            gm.register_buffer(name, getattr(target, field))
        node = gm.graph.get_attr(name)
        nodes.append(node)
    return nodes


def slot_ids_placeholder(gm: fx.GraphModule, ctx: PassContext, tokens: fx.Node, rows_at: int) -> fx.Node:
    """The graph's slot-ids input, made on first use with the traced value of one id per row
    (an inner compiler traces the graph again from these values): as many as the batch input
    has rows, or else a count of their own (:func:`_free_size`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        if n.target == SLOT_IDS:
            return n
    where = gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before(None)
    with where:
        node = gm.graph.placeholder(SLOT_IDS)
    batch = batch_placeholder(gm, ctx)
    if batch is not None:
        fake_value(node, lambda t: torch.empty(t.shape[0], dtype=torch.int32, device=t.device), batch)
    else:  # rows the graph cannot see: a size of their own, which tokens may hold flattened
        fake_value(node, lambda t: torch.empty(_free_size(t, rows_at), dtype=torch.int32, device=t.device), tokens)
    return node


def _free_size(like: torch.Tensor, dim: int) -> int | torch.SymInt:
    """A new dynamic size in the trace's shape environment, hinted by ``like.shape[dim]`` (that
    size itself where the trace has no shape environment): the slot ids of a graph resumed
    after a graph break number the batch's rows, which its tokens need not show."""
    size, env = like.shape[dim], like.fake_mode.shape_env
    hint = size if isinstance(size, int) else size.node.hint
    if env is None or hint is None:
        return size
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(f"{SLOT_IDS}_rows")
    symbol = env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=hint, source=source)


def batch_info_for(
    gm: fx.GraphModule, ctx: PassContext, tokens: fx.Node, feature_dims: int, row_dim: int, slot_ids: fx.Node | None = None
) -> list[fx.Node]:
    """Insert a prologue for ``tokens`` (rows along ``row_dim``, from
    :func:`fxlora.compiler.rows.row_dim`) at the current insertion point; returns its outputs,
    a ``getitem`` each: the list a LoRA op takes as its ``batch`` bundle. ``slot_ids``: a slot
    per token of a graph's own making (tokens routed from the batch's), in place of the
    graph's per-row input; such a prologue is its own, never shared."""
    own = slot_ids is not None
    slot_ids = slot_ids if own else slot_ids_placeholder(gm, ctx, tokens, row_dim)
    node = gm.graph.call_function(
        torch.ops.fxlora.batch_info.default, (slot_ids, tokens, feature_dims, ctx.pool.max_loras, row_dim)
    )
    shape = meta_shape(tokens)
    layout = None if shape is None or own else f"{shape[: len(shape) - feature_dims]} rows {row_dim}"
    node.meta[PROLOGUE_LAYOUT] = layout
    outputs = []
    for i in range(len(node.target._schema.returns)):
        out = gm.graph.call_function(operator.getitem, (node, i))
        outputs.append(out)
    return outputs


def lora_operands(
    gm: fx.GraphModule,
    ctx: PassContext,
    x: fx.Node,
    factors: PoolTarget | PoolGroup,
    rows: int,
    workspace: bool = True,
    expert: int | None = None,
    slot_ids: fx.Node | None = None,
) -> tuple[list[fx.Node], list[fx.Node], fx.Node | None]:
    """What a linear LoRA op takes after its base operands, inserted at the current point:
    the factors' bundle (of one ``expert`` of an experts target: its slices), the batch info
    bundle of ``x``'s tokens (rows along its dimension ``rows``, or each token's slot in
    ``slot_ids``: :func:`batch_info_for`) and (``workspace``) the shrink's workspace."""
    lora = pool_nodes(gm, factors)
    lora_a = factors.lora_a
    if expert is not None:
        for i in (0, 1):
            lora[i] = gm.graph.call_function(torch.select, (lora[i], 1, expert))
        lora_a = lora_a.select(1, expert)
    scratch = None
    if workspace:
        scratch = gm.graph.call_function(lora_workspace, (x, lora[0]))
        fake_value(scratch, lambda xv: lora_workspace(xv, lora_a), x)
    return lora, batch_info_for(gm, ctx, x, 1, rows, slot_ids), scratch
