"""lora_embedding: targeted ``F.embedding`` calls become ``fxlora::lora_embedding``.

Matches the ``F.embedding`` / ``aten.embedding`` calls of modules the pool targets as
embeddings (``embed_tokens``).

Emits ``fxlora::lora_embedding(ids, weight, lora, batch)`` in each one's place (the pool
buffers' bundle and the tokens' batch info bundle). The delta joins the lookup inside the
module, so a module that rescales its output (Gemma's scaled word embedding) rescales the
delta too, as PEFT does.

Leaves alone, and records as skipped, calls with ``max_norm`` (which rewrites the weight),
lookups in a tensor-subclass weight (a quantised embedding, which the op's ``F.embedding``
cannot take), and calls whose ids' rows cannot be told.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxlora.compiler.calls import EMBEDDING, embedding_args
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import base_calls, call_arg, meta_value, reads_wrapped_tensor, replace_with
from fxlora.compiler.operands import batch_info_for, pool_nodes
from fxlora.compiler.rows import row_dim
from fxlora.errors import NotServed


def lora_embedding(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    calls, refused = base_calls(gm, ctx, "embedding", lambda n: n.target in EMBEDDING, lambda n: embedding_args(n)[1])
    for fqn, why in refused.items():
        ctx.leave_traced(fqn, why)
    for target, node in calls:
        fqn = target.fqn
        if node.target is F.embedding and call_arg(node, 3, "max_norm") is not None:
            ctx.leave_traced(fqn, "embedding with max_norm renormalises its weight in place")
            continue
        if reads_wrapped_tensor(node):
            ctx.leave_traced(fqn, f"its weight is a {type(meta_value(embedding_args(node)[1])).__name__}, not a plain tensor")
            continue
        ids, weight = embedding_args(node)
        try:
            rows = row_dim(gm, ctx, ids, feature_dims=0)
        except NotServed as why:
            ctx.leave_traced(fqn, str(why))
            continue
        with gm.graph.inserting_before(node):
            args = (ids, weight, pool_nodes(gm, target), batch_info_for(gm, ctx, ids, 0, rows))
        replace_with(gm, node, torch.ops.fxlora.lora_embedding.default, args)
        ctx.rewritten[fqn] = "fxlora::lora_embedding"
    gm.recompile()
    return gm
