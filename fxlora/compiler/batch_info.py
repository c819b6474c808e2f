"""batch_info: one prologue per token layout, shared by every LoRA op of the graph.

The LoRA passes ask :func:`batch_info_for` for the metadata of their op's tokens; each
request inserts a ``fxlora::batch_info(slot_ids, tokens, feature_dims, num_slots)`` node
reading the graph's ``fxlora_slot_ids`` placeholder (the per-row slot ids the runtime
passes). This pass then merges requests whose tokens have the same leading shape into the
first one, so a decoder computes its metadata once (twice when the output head sees only
the last positions). It leaves every other node alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import fake_value, meta_shape

SLOT_IDS = "fxlora_slot_ids"
_LAYOUT = "fxlora_layout"


def slot_ids_placeholder(gm: fx.GraphModule, tokens: fx.Node) -> fx.Node:
    """The graph's slot-ids input, made on first use with the traced value of one id per
    row of ``tokens`` (an inner compiler traces the graph again from these values)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        if n.target == SLOT_IDS:
            return n
    where = gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before(None)
    with where:
        node = gm.graph.placeholder(SLOT_IDS)
    fake_value(node, lambda t: torch.empty(t.shape[0], dtype=torch.int32, device=t.device), tokens)
    return node


def batch_info_for(gm: fx.GraphModule, ctx: PassContext, tokens: fx.Node, feature_dims: int) -> list[fx.Node]:
    """Insert a prologue for ``tokens`` at the current insertion point; returns its outputs,
    a ``getitem`` each: the list a LoRA op takes as its ``batch`` bundle."""
    slot_ids = slot_ids_placeholder(gm, tokens)
    node = gm.graph.call_function(
        torch.ops.fxlora.batch_info.default, (slot_ids, tokens, feature_dims, ctx.pool.max_loras)
    )
    shape = meta_shape(tokens)
    node.meta[_LAYOUT] = None if shape is None else str(shape[: len(shape) - feature_dims])
    outputs = []
    for i in range(len(node.target._schema.returns)):
        out = gm.graph.call_function(operator.getitem, (node, i))
        outputs.append(out)
    return outputs


def batch_info(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    first: dict[object, fx.Node] = {}
    prologues = [n for n in gm.graph.nodes if n.target is torch.ops.fxlora.batch_info.default]
    for node in prologues:
        layout = node.meta.get(_LAYOUT)
        if layout is None or layout not in first:
            first[layout if layout is not None else id(node)] = node
            continue
        keep = {u.args[1]: u for u in first[layout].users}
        for user in list(node.users):
            user.replace_all_uses_with(keep[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    if prologues:
        ctx.note(f"batch_info: {len(first)} prologue(s) shared by {len(prologues)} LoRA op(s)")
    gm.graph.lint()
    gm.recompile()
    return gm
