"""Graph-editing steps the LoRA passes share: wiring in pool tensors, replacing a base call."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxlora.adapters import PoolGroup, PoolTarget

if TYPE_CHECKING:
    from fxlora.compiler.context import PassContext

def base_calls(
    gm: fx.GraphModule,
    ctx: PassContext,
    kind: str,
    is_base: Callable[[fx.Node], bool],
    weight_of: Callable[[fx.Node], Any],
) -> list[tuple[PoolTarget, fx.Node]]:
    """Every base call (``is_base``) of each pool target of ``kind``. A module whose forward
    makes several (a block applied again, a projection of a second input) has each served,
    one LoRA op per call over the same pool tensors, when every call reads the module's own
    weight (``weight_of``: one parameter read, not a tensor each call computes); otherwise it
    is reported and left alone."""
    calls: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxlora_module")
        if node.op == "call_function" and fqn in ctx.pool.targets and ctx.pool.targets[fqn].info.kind == kind and is_base(node):
            calls[fqn].append(node)
    served = []
    for fqn, nodes in calls.items():
        weights = {_parameter(weight_of(n)) for n in nodes}
        if len(nodes) > 1 and (len(weights) > 1 or None in weights):
            ctx.note(f"skipped {fqn}: its forward makes {len(nodes)} {kind} calls that do not all read its weight")
            continue
        served += [(ctx.pool.targets[fqn], n) for n in nodes]
    return served


def _parameter(node: Any) -> object:
    """What names the parameter ``node`` reads (a graph input, or an attribute of the graph
    module), or None for a tensor computed in the graph."""
    if isinstance(node, fx.Node) and node.op == "placeholder":
        return node
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return node.target
    return None


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
