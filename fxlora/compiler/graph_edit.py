"""Graph-editing steps the LoRA passes share: wiring in pool tensors, replacing a base call."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxlora.adapters import PoolGroup, PoolTarget

if TYPE_CHECKING:
    from fxlora.compiler.context import PassContext

# Tensor methods that only change a tensor's dtype or device: a linear over ``W.float()`` is
# one over ``W`` as far as LoRA goes (PEFT adds the delta to ``W`` before the cast; fxlora adds
# it to the output, which differs by rounding only).
CASTS = {"type", "to", "float", "double", "half", "bfloat16"}


def base_calls(
    gm: fx.GraphModule, ctx: PassContext, kind: str, is_base: Callable[[fx.Node], bool]
) -> Iterator[tuple[PoolTarget, fx.Node]]:
    """The one base call (``is_base``) of each pool target of ``kind``; a module whose
    forward makes several is reported and left alone. For a linear over a module's 2-D
    parameter (``ModuleInfo.parameter``) only a call whose weight is that parameter counts."""
    calls: dict[str, list[fx.Node]] = defaultdict(list)  # every target with calls here, not yet rewritten
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxlora_module")
        if node.op.startswith("call") and fqn in ctx.pool.targets and fqn not in ctx.rewritten:
            calls[fqn] += [node] if node.op == "call_function" and is_base(node) else []
    values = None
    for fqn, nodes in calls.items():
        target = ctx.pool.targets[fqn]
        if target.info.kind != kind:
            continue
        if target.info.parameter is None and not nodes:
            continue
        if target.info.parameter is not None:
            values = input_values(gm, ctx) if values is None else values
            nodes = [n for n in nodes if reads_parameter(call_arg(n, 1, "weight"), target.info.weight, values)]
            if not nodes:
                ctx.leave_traced(
                    fqn,
                    f"no {kind} call of its forward reads its parameter {target.info.parameter!r} (directly or "
                    "through a dtype cast), which its LoRA adapts",
                )
                continue
        if len(nodes) > 1:
            ctx.leave_traced(fqn, f"its forward makes {len(nodes)} {kind} calls")
            continue
        yield target, nodes[0]


def pool_nodes(gm: fx.GraphModule, target: PoolTarget | PoolGroup) -> list[fx.Node]:
    """``get_attr`` nodes for one target's (or group's) ``lora_a, lora_b, scaling, rank``: the
    list a LoRA op takes as its ``lora`` bundle. The pool's own tensors become buffers of
    ``gm``, so in-place adapter loads reach the graph."""
    target.wired = True
    stem = "fxlora_" + re.sub(r"\W", "_", target.fqn)
    nodes = []
    for field in ("lora_a", "lora_b", "scaling", "rank"):
        name = f"{stem}_{field}"
        if not hasattr(gm, name):
            gm.register_buffer(name, getattr(target, field), persistent=False)
        node = gm.graph.get_attr(name)
        nodes.append(node)
    return nodes


def call_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def replace_with(gm: fx.GraphModule, node: fx.Node, op: Callable, args: tuple) -> fx.Node:
    """Replace ``node`` by ``op(*args)``, which takes over its metadata."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def meta_value(node: Any) -> Any:
    """The traced (fake) value of ``node``, or None."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def meta_shape(node: Any) -> tuple | None:
    val = meta_value(node)
    return tuple(val.shape) if hasattr(val, "shape") else None


def fake_value(node: fx.Node, compute: Callable[[Any], Any], source: fx.Node) -> None:
    """Give an inserted ``node`` the traced value ``compute(source's traced value)``, computed
    under the trace's fake mode (no memory is touched); nothing if ``source`` has none."""
    val = source.meta.get("val", source.meta.get("example_value"))
    mode = getattr(val, "fake_mode", None)
    if mode is not None:
        with mode:
            node.meta["example_value"] = compute(val)


def input_values(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, object]:
    """The real tensors behind placeholders (Dynamo's example inputs) and ``get_attr`` nodes."""
    values: dict[fx.Node, object] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, ctx.inputs or ()):
        values[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                values[node] = gm.get_parameter(node.target)
            except AttributeError:
                continue
    return values


def reads_parameter(node: Any, parameter: Any, values: dict[fx.Node, object]) -> bool:
    """Whether ``node`` is ``parameter`` (by identity with the model's tensor), read directly
    or through :data:`CASTS`."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in CASTS:
        node = node.args[0]
    return isinstance(node, fx.Node) and values.get(node) is parameter
