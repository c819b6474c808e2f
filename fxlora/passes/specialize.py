"""specialize: split the rewritten graph into a ``lora`` and a ``nolora`` graph.

``lora`` is the rewritten graph, without the regions a LoRA op replaced (``lora_moe``).
``nolora`` is a copy in which every LoRA op is put back to the base call it replaced (same
target, same arguments; each output of a fused op to its member's call), or to the output of
the region it replaced, and every node the LoRA passes added (the batch-info prologue, pool
buffers, the slot-ids placeholder) is removed: it is the traced base computation, node for
node, so it matches the unmodified model bit for bit. A graph without LoRA ops has no
``lora`` variant.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxlora.passes.graph_edit import ADDED, BASE_CALL, REGION_OUTPUT, REPLACED, base_call

LORA_OPS = {
    torch.ops.fxlora.lora_linear.default,
    torch.ops.fxlora.lora_linear_fused.default,
    torch.ops.fxlora.lora_embedding.default,
    torch.ops.fxlora.moe_lora.default,
}


def specialize(gm: fx.GraphModule) -> tuple[fx.GraphModule | None, fx.GraphModule]:
    """Returns ``(lora, nolora)``."""
    if not any(n.target in LORA_OPS for n in gm.graph.nodes):
        return None, gm
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for node in list(graph.nodes):
        if REGION_OUTPUT in node.meta:
            node.replace_all_uses_with(copies[node.meta[REGION_OUTPUT]])
            graph.erase_node(node)
        elif BASE_CALL in node.meta:
            with graph.inserting_before(node):
                base = graph.call_function(*base_call(node, copies))
            base.meta = {k: v for k, v in node.meta.items() if k != BASE_CALL}
            node.replace_all_uses_with(base)
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node.meta.get(ADDED):
            graph.erase_node(node)
    graph.lint()
    nolora = fx.GraphModule(gm, graph)  # copies only the attributes the graph still reads
    for node in reversed(list(gm.graph.nodes)):
        if node.meta.get(REPLACED):
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, nolora
