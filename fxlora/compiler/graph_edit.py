"""Graph-editing steps the LoRA passes share: wiring in pool tensors, replacing a base call,
finding a module's region by its boundary."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import PoolGroup, PoolTarget

if TYPE_CHECKING:
    from fxlora.compiler.context import PassContext


def base_calls(
    gm: fx.GraphModule, ctx: PassContext, kind: str, is_base: Callable[[fx.Node], bool]
) -> Iterator[tuple[PoolTarget, fx.Node]]:
    """The one base call (``is_base``) of each pool target of ``kind``; a module whose
    forward makes several is reported and left alone."""
    calls: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxlora_module")
        if node.op == "call_function" and fqn in ctx.pool.targets and is_base(node):
            calls[fqn].append(node)
    for fqn, nodes in calls.items():
        target = ctx.pool.targets[fqn]
        if target.info.kind != kind:
            continue
        if len(nodes) > 1:
            ctx.note(f"skipped {fqn}: its forward makes {len(nodes)} {kind} calls")
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


def reads_wrapped_tensor(node: fx.Node) -> bool:
    """Whether a traced value ``node`` reads is a tensor subclass wrapping others (torchao's
    quantised weights, DTensor): the LoRA ops' own base computations (``F.linear``,
    ``F.embedding``) cannot take one, so such a call keeps its traced form."""
    return any(is_traceable_wrapper_subclass(meta_value(a)) for a in node.all_input_nodes)


def module_region(gm: fx.GraphModule, owner: str) -> list[fx.Node]:
    """The call nodes ``annotate`` attributed to module ``owner`` or its submodules, in graph
    order, less the size arithmetic among them: values that are not tensors, computed from the
    region's inputs alone (SymInts under dynamic shapes), which code after the region may
    reuse, so they stay where they are."""
    inside = lambda fqn: fqn is not None and (fqn == owner or fqn.startswith(owner + "."))  # noqa: E731
    region = [n for n in gm.graph.nodes if n.op.startswith("call") and inside(n.meta.get("fxlora_module"))]
    nodes, sizes = set(region), set()
    for n in region:
        if not isinstance(meta_value(n), torch.Tensor) and all(a not in nodes or a in sizes for a in n.all_input_nodes):
            sizes.add(n)
    return [n for n in region if n not in sizes]


def region_outputs(region: list[fx.Node]) -> list[fx.Node]:
    """The nodes of ``region`` that a node outside it reads."""
    inside = set(region)
    return [n for n in region if any(u not in inside for u in n.users)]


def region_inputs(region: list[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``region`` that it reads, in order of first use."""
    inside = set(region)
    return list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))


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
