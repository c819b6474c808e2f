"""Which dimension of a LoRA op's input holds the batch's rows, read from the traced shapes.

The runtime names the batch input (``PassContext.batch``: the tensor whose first dimension it
counts rows by). Its first dimension gives the rows' size as the graph traced it, a symbol
under dynamic shapes, and the dimension of the op's input that is that size holds the rows:
the first for the usual ``(batch, seq, hidden)``, the second for a time-major ``(seq, batch,
hidden)`` (XLNet). A flattened ``(batch·seq, hidden)`` is followed back through reshapes to
the shape it came from. Where no dimension or more than one can be the rows,
:func:`row_dim` raises :class:`NotServed`. Without a known batch input
(``torch.compile(backend="fxlora")``, or a graph that resumes after a graph break) the first
dimension is taken, as the runtime counts rows.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import sympy
import torch
import torch.fx as fx

from fxlora.compiler.graph_edit import meta_value
from fxlora.errors import NotServed

if TYPE_CHECKING:
    from fxlora.compiler.context import PassContext

SLOT_IDS = "fxlora_slot_ids"  # the graph's input of per-row slot ids, which the LoRA ops' prologues read

_SEARCH_LIMIT = 256  # nodes followed back; a flattening sits a few calls before its LoRA ops

# Calls that keep their first argument's elements in order while reshaping it.
_RESHAPE_METHODS = {"view", "reshape", "flatten", "contiguous"}
_RESHAPE_FUNCTIONS = {
    torch.reshape, torch.flatten,
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
}  # fmt: skip
# Calls that may move tokens along their dimension without changing its size.
_REORDERING = {
    "index_select", "gather", "take_along_dim", "sort", "argsort", "msort", "flip", "fliplr", "flipud", "roll",
    "transpose", "t", "permute", "swapaxes", "swapdims", "movedim", "scatter", "index", "index_put",
}  # fmt: skip


def row_dim(gm: fx.GraphModule, ctx: PassContext, tokens: fx.Node, feature_dims: int) -> int:
    """The leading dimension of ``tokens`` that indexes the batch's rows; raises
    :class:`NotServed` when the traced shapes cannot tell which one it is."""
    rows = _rows(gm, ctx)
    val = meta_value(tokens)
    if rows is None or not isinstance(val, torch.Tensor):
        return 0  # the runtime's own convention: rows first
    lead = [_expr(d) for d in val.shape[: val.dim() - feature_dims]]
    if rows == 1:
        return 0  # one row: every token is its
    exact = [i for i, d in enumerate(lead) if d == rows]
    mentions = [i for i, d in enumerate(lead) if _mentions(d, rows)]
    if len(exact) == 1 and mentions == exact:
        return exact[0]
    if not exact and len(lead) == 1 and _could_flatten(lead[0], rows) and _rows_outermost(tokens, rows):
        return 0
    shape = tuple(val.shape[: val.dim() - feature_dims])
    if not mentions and not (len(lead) == 1 and _could_flatten(lead[0], rows)):
        raise NotServed(f"its input's token dimensions {shape} do not hold the batch's {rows} rows")
    raise NotServed(f"cannot tell which of its input's token dimensions {shape} hold the batch's {rows} rows")


def _rows(gm: fx.GraphModule, ctx: PassContext):
    """The batch's row count as the graph traced it (a sympy expression), or None when the
    graph does not read the batch input."""
    batch = batch_placeholder(gm, ctx)
    return None if batch is None else _expr(meta_value(batch).shape[0])


def batch_placeholder(gm: fx.GraphModule, ctx: PassContext) -> fx.Node | None:
    """The placeholder of the batch input (``PassContext.batch``), when the graph reads it."""
    if ctx.batch is None or ctx.inputs is None:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and n.target != SLOT_IDS]
    for node, value in zip(placeholders, ctx.inputs):
        val = meta_value(node)
        if value is ctx.batch and isinstance(val, torch.Tensor) and val.dim() > 0:
            return node
    return None


def _expr(size) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return size.node.shape_env.simplify(size.node.expr)
    return sympy.Integer(int(size))


def _mentions(size: sympy.Expr, rows: sympy.Expr) -> bool:
    if rows.free_symbols:
        return bool(rows.free_symbols & size.free_symbols)
    return size == rows


def _could_flatten(size: sympy.Expr, rows: sympy.Expr) -> bool:
    """Whether ``size`` may be the rows times other sizes."""
    if rows.free_symbols:
        return _mentions(size, rows)
    return bool(size.is_Integer) and int(size) % int(rows) == 0


def _rows_outermost(tokens: fx.Node, rows: sympy.Expr) -> bool:
    """Whether flattened ``tokens`` keep each row's tokens together, rows outermost.

    Followed back to where the flattening happened — a shape in which the rows are a
    dimension of their own, and only dimensions of size 1 may come before it — through
    reshapes and through the token-wise computation in between (a linear, the gate of an MLP:
    the input with the same token dimension). One expert of an ``(experts, tokens, …)`` batch
    (``select`` along its first dimension) is followed back, through computation along the
    experts, to the ``expand`` that repeats one ``(1, tokens, …)`` tensor for every expert;
    anything else on that way (a reshape, which may spread the tokens over the experts) ends
    the search. Calls that may move tokens within that dimension (indexing by a tensor, sort,
    flip, roll, transposes) end it too: unknown."""
    node = tokens
    expert = False  # following one expert's slice back to where every expert got the same tokens
    for _ in range(_SEARCH_LIMIT):
        val = meta_value(node)
        lead = None
        if isinstance(val, torch.Tensor):
            sizes = [_expr(d) for d in val.shape]
            at = [i for i, d in enumerate(sizes) if d == rows]
            if at:
                return (
                    not expert
                    and len(at) == 1
                    and all(d == 1 for d in sizes[: at[0]])
                    and not any(_mentions(d, rows) for i, d in enumerate(sizes) if i != at[0])
                )
            lead = sizes[0] if sizes else None
        if node.op not in ("call_function", "call_method") or _reorders(node):
            return False
        reshape = (node.op == "call_method" and node.target in _RESHAPE_METHODS) or (
            node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS
        )
        inputs = [a for a in node.all_input_nodes if meta_value(a) is not None]
        one_expert = node.target in (torch.select, "select") and len(node.args) > 1 and node.args[1] == 0
        repeated = expert and node.op == "call_method" and node.target == "expand" and _first_size(node.args[0]) == 1
        if (one_expert and expert) or (reshape and expert):
            return False
        expert = (expert or one_expert) and not repeated
        if reshape or one_expert or repeated or node.target is operator.getitem or lead is None:
            source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        else:  # token-wise: the input that has these tokens
            source = next((a for a in inputs if _first_size(a) == lead), None)
        if source is None:
            return False
        node = source
    return False


def _reorders(node: fx.Node) -> bool:
    if node.target is operator.getitem:  # indexing by a tensor picks tokens in its order
        index = node.args[1] if len(node.args) > 1 else None
        parts = index if isinstance(index, (tuple, list)) else (index,)
        return any(isinstance(i, fx.Node) and isinstance(meta_value(i), torch.Tensor) for i in parts)
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
    return name.lstrip("_").rstrip("_") in _REORDERING


def _first_size(node: fx.Node):
    val = meta_value(node)
    return _expr(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() > 0 else None
