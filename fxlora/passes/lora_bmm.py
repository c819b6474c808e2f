"""lora_bmm: the LoRA of a 3-D parameter that is not an experts module's, read from what the
graph does with it.

Matches each 3-D parameter target (PEFT's ``target_parameters``) whose module is not one of
transformers' experts modules (those are ``lora_moe``'s): the graph's reads of the parameter
(by identity with the model's tensor, through dtype casts), and where each one goes. A
parameter ``P (experts, out, in)`` — the layout PEFT adapts, ``W[e] += scaling · B[e] @ A[e]``
— that enters ``torch.bmm`` / ``torch.matmul`` transposed, ``bmm(X, P.transpose(1, 2))``, is a
linear per expert: ``Y[e] = X[e] @ P[e]ᵀ``, each expert's delta the LoRA delta of ``X[e]``'s
tokens — of ``x`` where ``X`` repeats one input for every expert
(``x.reshape(1, -1, in).expand(experts, -1, -1)``: Inkling's shared experts), else of each
expert's own ``(tokens, in)`` slice, where its tokens are the batch's in order.

Emits, right after the matmul, one ``fxlora::lora_delta`` per expert that adds expert ``e``'s
delta in place onto ``Y[e]`` (a view of the matmul's output, so its users read the sum), over
``x`` flattened to ``(tokens, in)`` (or ``X[e]``) and expert ``e``'s slices of the target's pool
tensors.

Leaves alone, and records as skipped naming the parameter and the operation, a parameter the
graph uses any other way: another operation (a depthwise ``conv1d``), a matmul of the
parameter untransposed, or a matmul whose experts' tokens are not the batch's in order (tokens
routed to each): fxlora cannot read those as the linear per expert PEFT's delta adds to.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxlora.adapters import PoolTarget, experts
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import CASTS, fake_value, input_values, meta_value
from fxlora.compiler.operands import lora_operands
from fxlora.compiler.rows import row_dim
from fxlora.errors import NotServed

MATMULS = {torch.bmm, torch.matmul, torch.ops.aten.bmm.default}
_TRANSPOSES = ({1, 2}, {-1, -2}, {1, -1}, {2, -2})  # of a 3-D tensor's last two dimensions


def lora_bmm(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    values = input_values(gm, ctx)
    served = []
    for fqn, target in ctx.pool.targets.items():
        info = target.info
        if info.kind != "experts" or experts.is_experts(info.owner):
            continue
        reads = [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr") and values.get(n) is info.weight]
        uses = [u for r in reads for u in _uses(r)]
        if not uses:
            continue  # this graph does not read it
        inputs = []  # every matmul's experts' inputs and their rows, before anything is served
        try:
            for mm in (_matmul(fqn, u, info.experts) for u in uses):
                inputs.append((mm, _inputs(gm, ctx, target, mm)))
        except NotServed as why:
            for _, prepared in inputs:
                _erase(gm, prepared)
            ctx.leave_traced(fqn, str(why))
            continue
        for mm, prepared in inputs:
            _serve(gm, ctx, target, mm, prepared)
        ctx.rewritten[fqn] = "fxlora::lora_delta"
        served.append(fqn)
    if served:
        names = sorted({f.rpartition(".")[0].rpartition(".")[2] + "." + f.rpartition(".")[2] for f in served})
        ctx.record("served", served, f"LoRA of 3-D parameters in a batched matmul, a delta per expert: {', '.join(names)}")
    gm.graph.lint()
    gm.recompile()
    return gm


def _uses(node: fx.Node) -> list[fx.Node]:
    """Each node that reads ``node``, through dtype casts."""
    found = []
    for user in node.users:
        found += _uses(user) if user.op == "call_method" and user.target in CASTS else [user]
    return found


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
    raise NotServed(f"its 3-D parameter {fqn} enters {_name(user)}, which fxlora cannot read as a linear per expert")


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
