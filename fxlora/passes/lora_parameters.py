"""lora_parameters: the LoRA of a 3-D parameter that is not an experts module's, read from
what the graph does with it.

Matches each 3-D parameter target (PEFT's ``target_parameters``) whose module is not one of
transformers' experts modules (those are ``lora_moe``'s): the graph's reads of the parameter
(by identity with the model's tensor, through dtype casts and shape round trips) in its
module's forward, and where each one goes. PEFT adapts the parameter only while its module
runs, so a read elsewhere (Jamba's Mamba mixer passing ``conv1d.weight`` to a function) keeps
the base weight in both, and is recorded as information. PEFT adapts ``P (experts, d1, d2)``
as ``P[e] += scaling · B[e] @ A[e]``, ``(out, in) = (d1, d2)``. Five uses are read:

- ``bmm(X, P.transpose(1, 2))`` (``torch.bmm`` / ``torch.matmul``) is a linear per expert:
  ``Y[e] = X[e] @ P[e]ᵀ``, each expert's delta the LoRA delta of ``X[e]``'s tokens — of ``x``
  where ``X`` repeats one input for every expert (``x.reshape(1, -1, in).expand(experts, -1,
  -1)``: Inkling's shared experts), else of each expert's own ``(tokens, in)`` slice, where its
  tokens are the batch's in order. Emits, right after the matmul, one ``fxlora::lora_delta``
  per expert that adds expert ``e``'s delta in place onto ``Y[e]`` (a view of the matmul's
  output, so its users read the sum), over ``x`` flattened to ``(tokens, in)`` (or ``X[e]``)
  and expert ``e``'s slices of the target's pool tensors.
- ``conv1d(x, P, ...)``, ``P`` a convolution weight ``(channels, in / groups, kernel)`` (the
  depthwise convolutions of Mamba-style layers), over ``x (rows, in, length)``: a convolution
  is linear in its weight, so ``fxlora::lora_conv_delta`` adds each row's
  ``conv1d(x_row, ΔW_row)`` onto the output, whose users then read the sum.
- ``P (1, d1, d2)`` combined by pointwise operations with the batch's rows (RWKV's time mix,
  ``hidden * P + shifted * (1 - P)``), followed until a result's first dimension is the rows:
  each read becomes ``fxlora::lora_weight_rows``, every row's adapted copy ``(rows, d1, d2)``,
  which broadcasts over its row as ``P`` did over all.
- ``F.linear(x, P[e])`` over the tokens routed to expert ``e``: ``x`` a piece of
  ``split(source[index], counts)``, or of what the previous experts' linears made of one
  (followed back through row-wise operations, chunks of the features, and the ``cat`` of a
  split's pieces in order: JetMoE's experts). Each routed token's slot is its source token's,
  ``token_slot[index]``, split as the tokens are (a prologue of the graph's own slots), and one
  ``fxlora::lora_delta`` per expert adds onto its linear's output.
- ``grouped_mm(x, P, offsets)``, a segment GEMM's (:func:`fxlora.adapters.experts.is_segment_gemm`:
  its pool factors are turned to ``x @ P[g]``), ``x`` the batch's tokens in another order
  (``source.index_select(0, index)`` or ``source[index]``, followed back as for routes): each
  row's slot is ``token_slot[index]``, and ``fxlora::lora_grouped_delta`` adds each row's
  delta for its group onto the GEMM's output, which its users read instead.

Leaves alone, and records as skipped naming the parameter and the operation, a parameter the
graph uses any other way (an ``einsum``, values that meet something other than the rows, a
matmul of the parameter untransposed, a batched matmul whose experts' tokens are not the
batch's in order, routed tokens it cannot follow back to their source, a convolution whose
rows are not its input's first dimension): fxlora cannot read those as the operation PEFT's
delta adds to.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxlora.adapters import PoolTarget, experts
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import CASTS, fake_value, input_values, meta_value
from fxlora.compiler.operands import batch_info_for, lora_operands, pool_nodes
from fxlora.compiler.rows import batch_placeholder, row_dim
from fxlora.errors import NotServed

MATMULS = {torch.bmm, torch.matmul, torch.ops.aten.bmm.default}
CONV1D = {torch.conv1d, torch.nn.functional.conv1d}
_SHAPE_METHODS = {"squeeze", "unsqueeze", "view", "reshape"}  # a use reads the parameter through these ...
_SHAPE_FUNCTIONS = {torch.squeeze, torch.unsqueeze, torch.reshape}  # ... where they give back its shape
WAYS = {  # each way a parameter is read -> the op it becomes, and how explain() says it
    "bmm": ("fxlora::lora_delta", "a batched matmul, a delta per expert"),
    "routes": ("fxlora::lora_delta", "linears over the tokens routed to each expert"),
    "conv": ("fxlora::lora_conv_delta", "a 1-D convolution"),
    "values": ("fxlora::lora_weight_rows", "products with its values, a copy per row"),
    "groups": ("fxlora::lora_grouped_delta", "grouped GEMMs over rows in segments"),
}
GROUPED_MMS = {torch.ops.fxlora.grouped_mm, torch.ops.fxlora.grouped_mm.default, torch._grouped_mm, getattr(F, "grouped_mm", None)} - {None}
_INDEX_SELECTS = {torch.index_select, torch.ops.aten.index_select.default}
_POINTWISE_FUNCTIONS = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg,
    torch.mul, torch.add, torch.sub, torch.div, torch.rsub, torch.neg, torch.sigmoid, torch.exp, torch.tanh,
}  # fmt: skip
_POINTWISE_METHODS = {"mul", "add", "sub", "div", "rsub", "neg", "sigmoid", "exp", "tanh"}
_ACTIVATIONS = {F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, torch.relu}  # row-wise, for _routed
_LINEARS = {torch._C._nn.linear, F.linear}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_TRANSPOSES = ({1, 2}, {-1, -2}, {1, -1}, {2, -2})  # of a 3-D tensor's last two dimensions


def lora_parameters(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    values = input_values(gm, ctx)
    served: dict[str, list[str]] = {way: [] for way in WAYS}
    for fqn, target in ctx.pool.targets.items():
        info = target.info
        if info.kind != "experts" or experts.is_experts(info.owner):
            continue
        reads = [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr") and values.get(n) is info.weight]
        fed = [(u, via) for r in reads for u, via in _uses(r)]
        outside = sorted({u.meta.get("fxlora_module") or "the model" for u, _ in fed if not _inside(u, target.module)})
        if outside:  # PEFT adapts the parameter only while its module runs
            ctx.record("info", (fqn,), f"{fqn} is read outside its module's forward (in {', '.join(outside)}), where "
                                       "PEFT applies no LoRA to it either: those reads keep the base weight")  # fmt: skip
        fed = [(u, via) for u, via in fed if _inside(u, target.module)]
        if not fed:
            continue  # this graph does not read it where PEFT adapts it
        uses = [u for u, _ in fed]
        if any(u.target in CONV1D for u in uses):
            serve = _by_conv
        elif all(map(_pointwise, uses)):
            serve = _by_values
        elif all(map(_expert_index, uses)):
            serve = _by_routes
        elif all(u.target in GROUPED_MMS for u in uses):
            serve = _by_groups
        else:
            serve = _by_matmul
        try:
            _check_uses(fqn, fed, info.weight.shape)
            way = serve(gm, ctx, target, fed)
        except NotServed as why:
            ctx.leave_traced(fqn, str(why))
            continue
        ctx.rewritten[fqn] = WAYS[way][0]
        served[way].append(fqn)
    for way, fqns in served.items():
        if fqns:
            names = sorted({f.rpartition(".")[0].rpartition(".")[2] + "." + f.rpartition(".")[2] for f in fqns})
            ctx.record("served", fqns, f"LoRA of 3-D parameters in {WAYS[way][1]}: {', '.join(names)}")
    gm.graph.lint()
    gm.recompile()
    return gm


def _by_conv(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, fed: list[tuple[fx.Node, fx.Node]]) -> str:
    """Serve a parameter that is a ``conv1d``'s weight; raises :class:`NotServed` (the graph
    as it was) where it is also used otherwise or a convolution cannot take the delta."""
    uses, fqn = [u for u, _ in fed], target.fqn
    convs = [u for u in uses if u.target in CONV1D]
    if len(convs) < len(uses):
        others = ", ".join(sorted({_name(u) for u in uses if u.target not in CONV1D}))
        raise NotServed(f"its 3-D parameter {fqn} enters conv1d and {others}: fxlora reads it only as a convolution's weight")
    for conv in convs:
        _check_conv(gm, ctx, fqn, conv)
    for conv in convs:
        _serve_conv(gm, ctx, target, conv)
    return "conv"


def _by_matmul(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, fed: list[tuple[fx.Node, fx.Node]]) -> str:
    """Serve a parameter that enters batched matmuls transposed; raises :class:`NotServed`
    (the graph as it was) naming a use that is not one."""
    inputs = []  # every matmul's experts' inputs and their rows, before anything is served
    try:
        for mm in (_matmul(target.fqn, u, target.info.experts) for u, _ in fed):
            inputs.append((mm, _inputs(gm, ctx, target, mm)))
    except NotServed:
        for _, prepared in inputs:
            _erase(gm, prepared)
        raise
    for mm, prepared in inputs:
        _serve(gm, ctx, target, mm, prepared)
    return "bmm"


def _by_values(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, fed: list[tuple[fx.Node, fx.Node]]) -> str:
    """Serve a parameter of one expert, ``(1, d1, d2)``, that pointwise operations combine with
    the batch's rows (``hidden * W + shifted * (1 - W)``): each read becomes every row's own
    adapted copy, ``(rows, d1, d2)``, which broadcasts over its row as ``W`` did over all.
    Raises :class:`NotServed` (the graph as it was) where the parameter has more experts, the
    rows are unknown, or its values meet something other than the rows' first dimension."""
    info, fqn, graph = target.info, target.fqn, gm.graph
    if info.weight.shape[0] != 1:
        raise NotServed(f"its 3-D parameter {fqn} of {info.weight.shape[0]} experts enters {_name(fed[0][0])}: "
                        "fxlora reads a parameter by its values only with one expert, (1, d1, d2)")  # fmt: skip
    batch = batch_placeholder(gm, ctx)
    if batch is None:
        raise NotServed(f"its 3-D parameter {fqn} is used by its values in a graph whose batch input is unknown")
    for use, _ in fed:
        _meets_rows(gm, ctx, fqn, use)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for via in dict.fromkeys(via for _, via in fed):
        users = [u for u, v in fed if v is via]
        with graph.inserting_before(min(users, key=order.__getitem__)):
            rows = batch_info_for(gm, ctx, batch, meta_value(batch).dim() - 1, 0)  # a token per row
            copies = graph.call_function(torch.ops.fxlora.lora_weight_rows.default,
                                         (via, pool_nodes(gm, target), rows, getattr(info.owner, "is_transposed", False)))  # fmt: skip
            copies.meta["fxlora_module"] = target.module
            count = meta_value(batch).shape[0]
            fake_value(copies, lambda w: w.new_empty((count, *w.shape)), via)  # noqa: B023
            own = graph.call_function(torch.select, (copies, 1, 0))
            fake_value(own, lambda c: c.select(1, 0), copies)
        for user in users:
            user.replace_input_with(via, own)
    return "values"


def _by_routes(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, fed: list[tuple[fx.Node, fx.Node]]) -> str:
    """Serve a parameter whose experts each run a linear over the tokens routed to them,
    ``F.linear(x, P[e])``, ``x`` a piece of ``split(source[index], sizes)`` (JetMoE's experts),
    followed back through what one experts' linears hand the next (:func:`_routed`): each
    routed token reads its source token's slot, ``token_slot[index]``, split as the tokens are,
    and expert ``e``'s ``lora_delta`` adds onto its linear's output. Raises
    :class:`NotServed` (the graph as it was) where a use is no such linear."""
    fqn, graph = target.fqn, gm.graph
    plans = []
    for use, _ in fed:
        (linear,) = use.users if len(use.users) == 1 else (None,)
        if linear is None or linear.target not in _LINEARS or len(linear.args) < 2 or linear.args[1] is not use:
            raise NotServed(f"its 3-D parameter {fqn} is indexed by expert for {_name(linear) if linear else 'several uses'}, "
                            "not one F.linear's weight")  # fmt: skip
        piece = _routed(gm, ctx, linear.args[0])
        if piece is None or piece[0] != "piece":
            raise NotServed(f"its 3-D parameter {fqn}'s expert {use.args[1]} runs F.linear over tokens fxlora cannot "
                            "follow back to the batch's rows")  # fmt: skip
        plans.append((use.args[1], linear, piece))
    split_slots: dict[fx.Node, fx.Node] = {}  # a split of routed tokens -> the same split of their slots
    order = {n: i for i, n in enumerate(graph.nodes)}
    for expert, linear, (_, source, index, split, k) in sorted(plans, key=lambda p: order[p[1]]):
        x = linear.args[0]
        with graph.inserting_before(linear.next):
            if split not in split_slots:
                token_slot = batch_info_for(gm, ctx, source, 1, row_dim(gm, ctx, source, feature_dims=1))[0]
                routed = graph.call_function(operator.getitem, (token_slot, index))
                fake_value(routed, lambda t: t[meta_value(index)], token_slot)  # noqa: B023
                split_slots[split] = graph.call_function(torch.split, (routed, split.args[1]), {"dim": 0})
                fake_value(split_slots[split], lambda t: torch.split(t, split.args[1], dim=0), routed)  # noqa: B023
            pieces = split_slots[split]
            slots = graph.call_function(operator.getitem, (pieces, k))
            fake_value(slots, lambda t: t[k], pieces)  # noqa: B023
            operands = lora_operands(gm, ctx, x, target, 0, expert=expert, slot_ids=slots)
            op = graph.call_function(torch.ops.fxlora.lora_delta.default, (x, [linear], *operands))
            op.meta["fxlora_module"], op.meta["example_value"] = target.module, None
    return "routes"


def _by_groups(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, fed: list[tuple[fx.Node, fx.Node]]) -> str:
    """Serve a segment GEMM's weight, ``grouped_mm(x, P, offsets)``, ``x`` the batch's tokens
    in another order (:func:`_routed`): each row reads its source token's slot,
    ``token_slot[index]``, and ``fxlora::lora_grouped_delta`` adds each row's delta onto the
    GEMM's output, whose users read the sum. Raises :class:`NotServed` (the graph as it was)
    where the parameter is not a segment GEMM's or its rows cannot be followed back."""
    fqn, graph = target.fqn, gm.graph
    if not experts.is_segment_gemm(target.info.owner):
        raise NotServed(f"its 3-D parameter {fqn} enters a grouped GEMM in a module fxlora did not prove to compute one")
    plans = []
    for use, via in fed:
        x, weight = use.args[:2]
        offsets = use.args[2] if len(use.args) > 2 else use.kwargs.get("offs", use.kwargs.get("offsets"))
        rows = _routed(gm, ctx, x)
        if weight is not via or offsets is None or rows is None or rows[0] != "whole":
            raise NotServed(f"its 3-D parameter {fqn} enters a grouped GEMM over rows fxlora cannot follow back to the batch's")
        plans.append((use, x, offsets, rows[1], rows[2]))
    for use, x, offsets, source, index in plans:
        with graph.inserting_before(use.next):
            token_slot = batch_info_for(gm, ctx, source, 1, row_dim(gm, ctx, source, feature_dims=1))[0]
            slots = graph.call_function(operator.getitem, (token_slot, index))
            fake_value(slots, lambda t: t[meta_value(index)], token_slot)  # noqa: B023
            op = graph.call_function(torch.ops.fxlora.lora_grouped_delta.default, (x, use, offsets, slots, pool_nodes(gm, target)))
            op.meta["fxlora_module"] = target.module
            fake_value(op, lambda y: torch.empty_like(y), use)
        use.replace_all_uses_with(op, delete_user_cb=lambda n: n is not op)  # noqa: B023
    return "groups"


def _expert_index(node: fx.Node) -> bool:
    """Whether ``node`` is ``P[e]``, one expert of the parameter by an int index."""
    return node.target is operator.getitem and isinstance(node.args[1], int)


def _routed(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, depth: int = 0) -> tuple | None:
    """Where the tokens of ``node`` come from: ``("whole", source, index)`` for
    ``source[index]`` (``source`` the batch's tokens, ``(tokens, features)``), ``("piece", source,
    index, split, k)`` for piece ``k`` of ``split`` over such tokens; followed back through
    linears, row-wise pointwise operations, chunks along the features, and the ``cat`` of every
    piece of one split in order. None where they cannot be told."""
    if not isinstance(node, fx.Node) or depth > 32:
        return None
    args, target = node.args, node.target
    if target is operator.getitem and isinstance(args[1], fx.Node):  # source[index]
        return _whole(gm, ctx, args[0], args[1])
    if (target in _INDEX_SELECTS or node.op == "call_method" and target == "index_select") and args[1:2] == (0,):
        return _whole(gm, ctx, args[0], args[2])  # source.index_select(0, index)
    if target is operator.getitem and isinstance(args[1], int) and isinstance(args[0], fx.Node):
        inner = args[0]
        if _is_split(inner, dim0=True):
            whole = _routed(gm, ctx, inner.args[0], depth + 1)
            return ("piece", whole[1], whole[2], inner, args[1]) if whole and whole[0] == "whole" else None
        if _is_split(inner, dim0=False):  # a chunk of the features: the same tokens
            return _routed(gm, ctx, inner.args[0], depth + 1)
        return None
    if target in _LINEARS | GROUPED_MMS or node.op == "call_method" and target in CASTS | {"contiguous"}:
        return _routed(gm, ctx, args[0], depth + 1)
    if target is torch.ops.fxlora.lora_grouped_delta.default:  # a GEMM served already: its rows are its input's
        return _routed(gm, ctx, args[0], depth + 1)
    if target in (torch.cat, torch.concat) and (args[1] if len(args) > 1 else node.kwargs.get("dim", 0)) == 0:
        pieces = [_routed(gm, ctx, n, depth + 1) for n in args[0]]
        first = pieces[0] if pieces else None
        if first and first[0] == "piece" and all(
            p and p[0] == "piece" and p[1:4] == first[1:4] and p[4] == k for k, p in enumerate(pieces)
        ) and len(pieces) == len(meta_value(first[3]) or ()):
            return ("whole", first[1], first[2])
        return None
    if _pointwise(node) or target in _ACTIVATIONS:
        rows = getattr(meta_value(node), "shape", (None,))[:1]
        found = {_routed(gm, ctx, a, depth + 1) for a in node.all_input_nodes
                 if getattr(meta_value(a), "shape", (None,))[:1] == rows}  # fmt: skip
        return found.pop() if len(found) == 1 else None
    return None


def _whole(gm: fx.GraphModule, ctx: PassContext, source: fx.Node, index: fx.Node) -> tuple | None:
    """``("whole", source, index)`` where ``source`` is the batch's tokens ``(tokens, features)``
    and ``index`` a 1-D integer tensor picking rows of it; None otherwise."""
    value, picked = meta_value(source), meta_value(index)
    if not (isinstance(value, torch.Tensor) and value.dim() == 2 and isinstance(picked, torch.Tensor) and picked.dim() == 1):
        return None
    try:
        return ("whole", source, index) if row_dim(gm, ctx, source, feature_dims=1) == 0 and not picked.is_floating_point() else None
    except NotServed:
        return None


def _is_split(node: fx.Node, dim0: bool) -> bool:
    """Whether ``node`` splits a tensor by sizes along its first dimension (``dim0``), or splits
    or chunks it along its last."""
    splits = node.target is torch.split or node.op == "call_method" and node.target == "split"
    chunks = node.target is torch.chunk or node.op == "call_method" and node.target == "chunk"
    if not (splits or chunks and not dim0):  # pieces of the tokens by sizes only: split
        return False
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    value = meta_value(node.args[0])
    last = isinstance(value, torch.Tensor) and dim in (-1, value.dim() - 1)
    return dim == 0 if dim0 else last and dim != 0


def _pointwise(node: fx.Node) -> bool:
    return node.target in _POINTWISE_FUNCTIONS or node.op == "call_method" and node.target in _POINTWISE_METHODS


def _meets_rows(gm: fx.GraphModule, ctx: PassContext, fqn: str, node: fx.Node) -> None:
    """Follow ``node`` (a pointwise use of the parameter's values) through pointwise operations
    while its first dimension stays 1, to where it meets the batch's rows as its first
    dimension; raises :class:`NotServed` naming the operation where it does not."""
    value = meta_value(node)
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        raise NotServed(f"its 3-D parameter {fqn} enters {_name(node)}, which gives no (rows, d1, d2) tensor")
    if value.shape[0] != 1:
        if row_dim(gm, ctx, node, feature_dims=2) != 0:
            raise NotServed(f"its 3-D parameter {fqn} enters {_name(node)}, whose first dimension is not the batch's rows")
        return
    for user in node.users:
        if not _pointwise(user):
            raise NotServed(f"its 3-D parameter {fqn}'s values enter {_name(user)} before they meet the batch's rows")
        _meets_rows(gm, ctx, fqn, user)


def _inside(node: fx.Node, module: str) -> bool:
    """Whether ``node`` was made in ``module``'s forward (or a submodule's)."""
    made_by = node.meta.get("fxlora_module") or ""
    return made_by == module or made_by.startswith(module + ".")


def _uses(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """Each node that reads ``node``'s values, through dtype casts and shape changes (a
    ``squeeze(1)`` then ``unsqueeze(1)``), and the node it reads them from."""
    found = []
    for user in node.users:
        passes_on = user.op == "call_method" and user.target in CASTS | _SHAPE_METHODS or user.target in _SHAPE_FUNCTIONS
        found += _uses(user) if passes_on and user.args[0] is node else [(user, node)]
    return found


def _check_uses(fqn: str, fed: list[tuple[fx.Node, fx.Node]], shape: torch.Size) -> None:
    """Raise :class:`NotServed` for a use that reads the parameter in another shape, and for a
    convolution that reads it other than as its weight."""
    for user, via in fed:
        value = meta_value(via)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else "?"
            raise NotServed(f"its 3-D parameter {fqn} enters {_name(user)} reshaped to {got}")
        if user.target in CONV1D and _conv_args(user)["weight"] is not via:
            raise NotServed(f"its 3-D parameter {fqn} enters conv1d as its input, not its weight")


def _name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def _matmul(fqn: str, user: fx.Node, experts: int) -> fx.Node:
    """The matmul ``bmm(X, P.transpose(1, 2))`` of 3-D ``X`` and output, ``experts`` of them,
    that a use of the parameter enters; raises :class:`NotServed` naming the operation it
    enters otherwise."""
    transposed = user.op == "call_method" and user.target == "transpose" or user.target is torch.transpose
    if transposed and set(user.args[1:3]) in _TRANSPOSES:
        if len(user.users) != 1:
            raise NotServed(f"its 3-D parameter {fqn} is transposed for {len(user.users)} operations, not one")
        (mm,) = user.users
        x = mm.args[0] if mm.args else None
        shapes = [getattr(meta_value(n), "shape", ()) for n in (x, mm)]
        if mm.target in MATMULS and len(mm.args) == 2 and mm.args[1] is user and not mm.kwargs and all(
            len(shape) == 3 and shape[0] == experts for shape in shapes
        ):
            return mm
        raise NotServed(f"its 3-D parameter {fqn}, transposed, enters {_name(mm)}: fxlora reads it only as the "
                        f"second operand of a batched matmul of ({experts}, tokens, in), a linear per expert")  # fmt: skip
    if user.target in MATMULS:
        raise NotServed(f"its 3-D parameter {fqn} enters {_name(user)} untransposed, as (experts, in, out), where "
                        "PEFT adapts it as (experts, out, in)")  # fmt: skip
    raise NotServed(f"its 3-D parameter {fqn} enters {_name(user)}, which fxlora cannot read as a linear per expert "
                    "or a 1-D convolution")  # fmt: skip


def _conv_args(conv: fx.Node) -> dict:
    """``conv``'s arguments by name, defaults filled in."""
    return _CONV_DEFAULTS | dict(zip(_CONV_ARGS, conv.args)) | dict(conv.kwargs)


def _check_conv(gm: fx.GraphModule, ctx: PassContext, fqn: str, conv: fx.Node) -> None:
    """Raise :class:`NotServed` naming why ``conv`` (a ``conv1d`` of the parameter) cannot take
    the delta: a padding by name, or rows that are not its input's first dimension."""
    args = _conv_args(conv)
    if isinstance(args["padding"], str):
        raise NotServed(f"its 3-D parameter {fqn} is the weight of a conv1d with padding={args['padding']!r}, "
                        "which fxlora does not serve: give the padding as a number")  # fmt: skip
    x = meta_value(args["input"])
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise NotServed(f"its 3-D parameter {fqn} is the weight of a conv1d over an input that is not "
                        "(rows, channels, length)")  # fmt: skip
    if row_dim(gm, ctx, args["input"], feature_dims=2) != 0:
        raise NotServed(f"the conv1d of its 3-D parameter {fqn}: its input's rows are not its first dimension")


def _serve_conv(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, conv: fx.Node) -> None:
    """``fxlora::lora_conv_delta`` onto ``conv``'s output, which its users read instead."""
    args, graph = _conv_args(conv), gm.graph
    triple = lambda v: list(v) if isinstance(v, (list, tuple)) else [v]  # noqa: E731
    users = list(conv.users)
    with graph.inserting_before(conv.next):
        factors, batch = pool_nodes(gm, target), batch_info_for(gm, ctx, args["input"], 2, 0)  # a token per row
        op = graph.call_function(
            torch.ops.fxlora.lora_conv_delta.default,
            (args["input"], conv, factors, batch, triple(args["stride"]), triple(args["padding"]),
             triple(args["dilation"]), args["groups"], getattr(target.info.owner, "is_transposed", False)),
        )  # fmt: skip
    fake_value(op, lambda t: t.clone(memory_format=torch.contiguous_format), conv)
    op.meta["fxlora_module"] = target.module
    for user in users:
        user.replace_input_with(conv, op)


def _inputs(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, mm: fx.Node) -> list[tuple[fx.Node, int]]:
    """Each expert's input to ``mm`` as a node of its own, inserted right after ``mm``, and
    its rows' dimension: the one input every expert reads, flattened to ``(tokens, in)``, or
    the expert's own slice. Raises :class:`NotServed` (leaving the graph as it was) when the
    rows cannot be told."""
    info, graph = target.info, gm.graph
    x, shared = mm.args[0], _shared(mm.args[0])
    made: list[tuple[fx.Node, int]] = []
    with graph.inserting_before(mm.next):
        if shared is not None:
            flat = graph.call_function(torch.reshape, (shared, (-1, info.in_features)))
            fake_value(flat, lambda t: t.reshape(-1, info.in_features), shared)
        for e in range(info.experts):
            x_e = flat if shared is not None else _select(graph, x, e)
            try:
                made.append((x_e, row_dim(gm, ctx, x_e, feature_dims=1)))
            except NotServed as why:
                _erase(gm, made + [(x_e, 0)])
                raise NotServed(f"the batched matmul of its 3-D parameter {target.fqn}: {why}") from None
    return made


def _erase(gm: fx.GraphModule, prepared: list[tuple[fx.Node, int]]) -> None:
    """Take the nodes :func:`_inputs` made out again."""
    for node in dict.fromkeys(n for n, _ in reversed(prepared)):
        if not node.users:
            gm.graph.erase_node(node)


def _serve(gm: fx.GraphModule, ctx: PassContext, target: PoolTarget, mm: fx.Node, inputs: list[tuple[fx.Node, int]]) -> None:
    """One ``lora_delta`` per expert onto its slice of ``mm``'s output, over its input."""
    graph = gm.graph
    with graph.inserting_before(inputs[-1][0].next):
        for e, (x_e, rows) in enumerate(inputs):
            y = _select(graph, mm, e)
            operands = lora_operands(gm, ctx, x_e, target, rows, expert=e)
            op = graph.call_function(torch.ops.fxlora.lora_delta.default, (x_e, [y], *operands))
            op.meta["fxlora_module"], op.meta["example_value"] = target.module, None


def _shared(x: fx.Node) -> fx.Node | None:
    """The ``(1, tokens, in)`` tensor that ``x`` repeats for every expert
    (``expand(experts, -1, -1)``), or None."""
    expands = x.op == "call_method" and x.target == "expand" or x.target is torch.ops.aten.expand.default
    source = x.args[0] if expands else None
    value = meta_value(source) if isinstance(source, fx.Node) else None
    return source if value is not None and value.dim() == 3 and value.shape[0] == 1 else None


def _select(graph: fx.Graph, node: fx.Node, e: int) -> fx.Node:
    """``node[e]``, with its traced value."""
    picked = graph.call_function(torch.select, (node, 0, e))
    fake_value(picked, lambda t: t.select(0, e), node)
    return picked
