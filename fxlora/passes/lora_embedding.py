"""lora_embedding: targeted ``F.embedding`` calls become ``fxlora::lora_embedding``.

Matches the ``F.embedding`` / ``aten.embedding`` calls of modules the pool targets as
embeddings (``embed_tokens``).

Emits ``fxlora::lora_embedding(ids, weight, lora, batch)`` in each one's place (the pool
buffers' bundle and the tokens' batch info bundle). The delta joins the lookup inside the
module, so a module that rescales its output (Gemma's scaled word embedding) rescales the
delta too, as PEFT does. A lookup in a tensor-subclass weight — a DTensor under tensor
parallelism, replicated or split over its vocabulary (the lookup masks, reduces and gathers as
traced), or a quantised weight — keeps its traced form, which the op's ``F.embedding`` cannot
take: ``fxlora::lora_embedding_delta(ids, y, lora, batch)`` adds the delta onto the module's
output ``y``, from factors held whole on every process, where the rest of the module's call
only moves data (so the output is the lookup's, gathered).

Leaves alone, and records as skipped, calls with ``max_norm`` (which rewrites the weight),
calls whose ids' rows cannot be told, and a lookup in a tensor-subclass weight whose module
computes more after it (naming the weight's layout).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import PoolTarget, sharding
from fxlora.compiler.calls import EMBEDDING, embedding_args
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import (
    base_calls,
    call_arg,
    meta_value,
    module_calls,
    module_region,
    moves_data,
    parameter_read,
    reads_wrapped_tensor,
    region_outputs,
    replace_with,
)
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
        ids, weight = embedding_args(node)
        y = None  # the module's output, where the delta goes onto it
        try:
            if reads_wrapped_tensor(node):
                ids, y = _onto_output(gm, target, node)
            elif sharding.is_distributed(target.info.weight):  # a lookup in this rank's part: whole factors do not fit it
                raise NotServed("its weight is a DTensor looked up by its local part, which fxlora cannot add whole factors to")
            rows = row_dim(gm, ctx, ids, feature_dims=0)
        except NotServed as why:
            ctx.leave_traced(fqn, str(why))
            continue
        if y is not None:
            _add_onto(gm, ctx, target, ids, y, rows)
            continue
        with gm.graph.inserting_before(node):
            args = (ids, weight, pool_nodes(gm, target), batch_info_for(gm, ctx, ids, 0, rows))
        replace_with(gm, node, torch.ops.fxlora.lora_embedding.default, args)
        ctx.rewritten[fqn] = "fxlora::lora_embedding"
    gm.recompile()
    return gm


def _add_onto(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, ids: fx.Node, y: fx.Node, rows: int) -> None:
    """``lora_embedding_delta(ids, y, ...)`` right after ``y``, which its users read instead."""
    with gm.graph.inserting_before(y.next):
        args = (ids, y, pool_nodes(gm, target), batch_info_for(gm, ctx, ids, 0, rows))
        op = gm.graph.call_function(torch.ops.fxlora.lora_embedding_delta.default, args)
    op.meta.update(y.meta)
    y.replace_all_uses_with(op, delete_user_cb=lambda u: u is not op)
    ctx.rewritten[target.fqn] = "fxlora::lora_embedding_delta"


def _onto_output(gm: fx.GraphModule, target: PoolTarget, lookup: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``(ids, output)`` of the call of ``target``'s module that makes ``lookup`` (in a tensor-subclass
    weight), where the call only moves data besides: the ids it reads and its one output, a
    plain tensor; raises :class:`NotServed` naming the weight's layout otherwise."""
    weight = embedding_args(lookup)[1]
    w = meta_value(weight)
    placements = getattr(w, "placements", None)
    layout = f"DTensor ({', '.join(map(repr, placements))})" if placements is not None else type(w).__name__
    fqn = target.fqn
    call = next(c for c in module_calls(fqn, module_region(gm, fqn)) if lookup in c)
    reads = set(parameter_read(weight) or ())
    other = [n for n in call if n is not lookup and n not in reads and not moves_data(n)]
    if other:
        raise NotServed(f"its weight is a {layout}, whose lookup keeps its traced form, and its forward computes "
                        f"{getattr(other[0].target, '__name__', other[0].target)} after it, before the delta could be added")
    outputs = region_outputs(call)
    y = meta_value(outputs[0]) if len(outputs) == 1 else None
    if not isinstance(y, torch.Tensor) or is_traceable_wrapper_subclass(y) or y.shape[-1] != target.info.out_features:
        raise NotServed(f"its weight is a {layout}, and its forward's output is not one plain tensor of its whole "
                        f"{target.info.out_features} features to add the delta onto")  # fmt: skip
    ids, inside = embedding_args(lookup)[0], set(call)
    while isinstance(ids, fx.Node) and ids in inside:  # back through the call's conversions of its ids
        ids = ids.args[0]
    if not isinstance(ids, fx.Node) or meta_value(ids) is None or tuple(meta_value(ids).shape) != tuple(y.shape[:-1]):
        raise NotServed(f"its weight is a {layout}, and its forward's ids and output {tuple(y.shape)} do not match")
    return ids, outputs[0]
