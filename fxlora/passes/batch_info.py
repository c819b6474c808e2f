"""batch_info: one prologue per token layout, shared by every LoRA op of the graph.

Matches the ``fxlora::batch_info`` prologues the LoRA passes inserted, one per op
(:func:`fxlora.compiler.operands.batch_info_for`), each tagged with its tokens' leading shape
and row dimension. Emits nothing new: each prologue whose layout an earlier one has is
erased, its users reading the earlier one's outputs, so a decoder computes its batch metadata
once (twice when the output head sees only the last positions). Leaves every other node, and
a prologue of unknown layout, alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxlora.compiler.context import PassContext
from fxlora.compiler.operands import PROLOGUE_LAYOUT


def batch_info(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    first: dict[object, fx.Node] = {}
    prologues = [n for n in gm.graph.nodes if n.target is torch.ops.fxlora.batch_info.default]
    for node in prologues:
        layout = node.meta.get(PROLOGUE_LAYOUT)
        if layout is None or layout not in first:
            first[layout if layout is not None else id(node)] = node
            continue
        keep = {u.args[1]: u for u in first[layout].users}
        for user in list(node.users):
            user.replace_all_uses_with(keep[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm
