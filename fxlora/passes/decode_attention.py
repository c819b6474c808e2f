"""decode_attention: SDPA over a KV cache at a decode step becomes ``fxlora::decode_attention``,
or ``fxlora::paged_decode_attention`` over a paged cache.

Runs where the compiled code runs on CUDA (``PassContext.decode_attention``), on the graph
both variants come from, before ``nolora`` is copied; elsewhere it returns the graph
unchanged, so on CPU ``nolora`` stays the traced model op for op.

Matches ``scaled_dot_product_attention(q, key, value, attn_mask=mask, ...)`` where ``q`` has
one position per row, ``mask`` is a 4-D tensor with one row per batch row, ``is_causal``,
dropout and ``enable_gqa`` are off, and ``key`` / ``value`` are either the cached tensors
themselves or transformers' ``repeat_kv`` of them
(``x[:, :, None].expand(b, kv_heads, group, n, d).reshape(b, heads, n, d)``).

Emits ``fxlora::decode_attention(q, k, v, mask, scale)`` over the cached tensors as they are:
grouped-query heads are read once, not copied to every query head first, and on CUDA the
masked cache blocks are skipped; the ``repeat_kv`` nodes go once nothing reads them. When the
cached keys and values are ``fxlora::gather_pages(pages, block_table)`` of a paged cache, both
through the same block table, it emits ``paged_decode_attention`` over the pages and the
table instead, and the gathers go: the attention reads each row's blocks where they lie.
Records how many calls it served.

Leaves alone attention with a soft-cap or another score function (not an SDPA call), every
prefill (several query positions), and every other node.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import call_arg, meta_shape, meta_value, replace_with

SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
_NEW_AXIS = (slice(None), slice(None), None, slice(None), slice(None))
GATHER = {torch.ops.fxlora.gather_pages, torch.ops.fxlora.gather_pages.default}  # Dynamo records the packet
PAGED = torch.ops.fxlora.paged_decode_attention.default


def decode_attention(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.decode_attention:  # code that does not run on CUDA keeps the model's own SDPA
        return gm
    served = paged = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA]:
        q, mask = call_arg(node, 0, "query"), call_arg(node, 3, "attn_mask")
        q_shape, mask_value = meta_shape(q), meta_value(mask)
        if q_shape is None or len(q_shape) != 4 or q_shape[2] != 1 or not isinstance(mask_value, torch.Tensor):
            continue
        if mask_value.dim() != 4 or call_arg(node, 5, "is_causal", False) or call_arg(node, 4, "dropout_p", 0.0):
            continue
        if not all(isinstance(d, int) and d == 1 for d in mask_value.shape[1:3]):  # the kernel reads one mask row per batch row
            continue
        if call_arg(node, 7, "enable_gqa", False) or not isinstance(call_arg(node, 6, "scale"), (int, float, type(None))):
            continue
        kv = [_cached(call_arg(node, i, name), q_shape[1]) for i, name in ((1, "key"), (2, "value"))]
        if any(t is None for t in kv):
            continue
        scale = call_arg(node, 6, "scale")
        scale = float(scale) if scale is not None else q_shape[-1] ** -0.5
        old_kv = [call_arg(node, 1, "key"), call_arg(node, 2, "value")]
        pages = [_gathered(t) for t in kv]
        on_pages = all(p is not None for p in pages) and pages[0][1] is pages[1][1]  # one table for both
        if on_pages:
            (k_pages, table), (v_pages, _) = pages
            replace_with(gm, node, PAGED, (q, k_pages, v_pages, table, mask, scale))
        else:
            replace_with(gm, node, torch.ops.fxlora.decode_attention.default, (q, *kv, mask, scale))
        for n in old_kv:
            _erase_dead(gm, n)
        for n in dict.fromkeys(kv):  # a paged attention's gathers go, unless something else reads them
            if on_pages and not n.users:
                gm.graph.erase_node(n)
        served, paged = served + 1, paged + on_pages
    if served:
        ctx.record("info", (), f"decode attention: {served} SDPA call(s) over the KV cache read grouped heads as cached"
                   + (f", {paged} of them from its pages" if paged else ""))  # fmt: skip
        gm.graph.lint()
        gm.recompile()
    return gm


def _cached(node: fx.Node, heads: int) -> fx.Node | None:
    """The KV-cache tensor ``node`` is, or repeats to ``heads`` heads; None otherwise."""
    shape = meta_shape(node)
    if shape is None or len(shape) != 4:
        return None
    if shape[1] == heads and not _is_repeat(node):
        return node
    if not _is_repeat(node):
        return None
    source = node.args[0].args[0].args[0]
    source_shape = meta_shape(source)
    if source_shape is None or len(source_shape) != 4 or heads % source_shape[1]:
        return None
    if (source_shape[0], source_shape[2], source_shape[3]) != (shape[0], shape[2], shape[3]):
        return None
    return source


def _gathered(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(pages, block_table)`` when ``node`` is ``fxlora::gather_pages`` of them; None otherwise."""
    if node.op != "call_function" or node.target not in GATHER:
        return None
    return call_arg(node, 0, "pages"), call_arg(node, 1, "block_table")


def _is_repeat(node: fx.Node) -> bool:
    """``x[:, :, None].expand(...).reshape(...)``: transformers' ``repeat_kv``."""
    if not (node.op == "call_method" and node.target == "reshape"):
        return False
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return False
    index = expand.args[0]
    if not (isinstance(index, fx.Node) and index.op == "call_function" and index.target is operator.getitem):
        return False
    return tuple(index.args[1]) == _NEW_AXIS if isinstance(index.args[1], tuple) else False


def _erase_dead(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and the ``repeat_kv`` chain behind it once nothing reads them."""
    chain = [node]
    if _is_repeat(node):
        chain += [node.args[0], node.args[0].args[0]]
    for n in chain:
        if n.users:
            return
        gm.graph.erase_node(n)
