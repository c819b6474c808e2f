"""Graph-editing steps the LoRA passes share: reading a call's arguments, traced values and
parameters, finding each call of a targeted module (:func:`base_calls`, :func:`module_calls`)
or its region by its boundary, and replacing a base call."""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import PoolTarget
from fxlora.errors import NotServed

if TYPE_CHECKING:
    from fxlora.compiler.context import PassContext

# Tensor methods that only change a tensor's dtype or device: a linear over ``W.float()`` is
# one over ``W`` as far as LoRA goes (PEFT adds the delta to ``W`` before the cast; fxlora adds
# it to the output, which differs by rounding only).
CASTS = {"type", "to", "float", "double", "half", "bfloat16"}
# Under tensor parallelism a linear computes on its DTensor weight's local shard, which the
# pool's factors are sliced to match (``fxlora.adapters.sharding``).
LOCAL_SHARD = "to_local"


def is_local_shard(node: Any) -> bool:
    """Whether ``node`` reads a DTensor's local shard: ``x.to_local()`` as Dynamo traces it, a
    method call, or before torch 2.13 a call of a function of its own named ``prim_to_local``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target == LOCAL_SHARD
    return node.op == "call_function" and getattr(node.target, "__name__", None) == f"prim_{LOCAL_SHARD}"


def base_calls(
    gm: fx.GraphModule,
    ctx: PassContext,
    kind: str,
    is_base: Callable[[fx.Node], bool],
    weight_of: Callable[[fx.Node], Any],
) -> tuple[list[tuple[PoolTarget, fx.Node]], dict[str, str]]:
    """The base call (``is_base``) of each call of each pool target of ``kind``
    (:func:`module_calls`), and, for each target whose calls are not such, why. A module
    called several times (a block applied again, a projection of a second input) has each call
    served, one LoRA op per call over the same pool tensors, when every call reads the
    module's own weight (``weight_of``: one parameter read, directly or through :data:`CASTS`,
    not a tensor each call computes); it is refused when one call makes several base calls
    (the delta belongs on the call's output) or the calls do not all read its weight. For a
    linear over a module's 2-D parameter (``ModuleInfo.parameter``) only the calls whose
    weight is that parameter count."""
    calls: dict[str, list[fx.Node]] = defaultdict(list)  # every target of ``kind`` with calls here
    for node in gm.graph.nodes:
        fqn = node.meta.get("fxlora_module")
        target = ctx.pool.targets.get(fqn) if node.op.startswith("call") else None
        if target is not None and target.info.kind == kind:
            calls[fqn] += [node] if node.op == "call_function" and is_base(node) else []
    values = None
    served, refused = [], {}
    for fqn, nodes in calls.items():
        target = ctx.pool.targets[fqn]
        if target.info.parameter is not None:
            values = input_values(gm, ctx) if values is None else values
            nodes = [n for n in nodes if reads_parameter(weight_of(n), target.info.weight, values)]
            if not nodes:
                refused[fqn] = (
                    f"no {kind} call of its forward reads its parameter {target.info.parameter!r} (directly or "
                    "through a dtype cast), which its LoRA adapts"
                )
                continue
        most = max((len(c) for c in module_calls(fqn, nodes)), default=0)
        if most > 1:
            refused[fqn] = f"one call of its forward makes {most} {kind} calls"
            continue
        weights = {_parameter(weight_of(n)) for n in nodes}
        if len(nodes) > 1 and (len(weights) > 1 or None in weights):
            refused[fqn] = f"its forward makes {len(nodes)} {kind} calls that do not all read its weight"
            continue
        served += [(target, n) for n in nodes]
    return served, refused


def module_calls(fqn: str, nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """``nodes`` of module ``fqn`` (and its submodules), split by the module's calls, in
    graph order: ``annotate`` keys each call from Dynamo's ``nn_module_stack``
    (``fxlora_module_call``, ``<module>@<n>`` for its n-th call), so a module called twice
    gives two lists. Its submodules' nodes carry their own keys: a region holding them is one
    call, or raises :class:`NotServed` when the module is called several times."""
    calls: dict[object, list[fx.Node]] = {}
    for n in nodes:
        if n.meta.get("fxlora_module") == fqn:
            calls.setdefault(n.meta.get("fxlora_module_call"), []).append(n)
    if len(calls) > 1 and any(n.meta.get("fxlora_module") != fqn for n in nodes):
        raise NotServed(f"it is called {len(calls)} times and its submodules' calls cannot be told apart")
    return list(calls.values()) if len(calls) > 1 else [nodes] if nodes else []


def _parameter(node: Any) -> object:
    """What names the parameter ``node`` reads, directly or through :data:`CASTS` and
    :func:`is_local_shard` (a graph input, or an attribute of the graph module), or None for a
    tensor computed in the graph."""
    read = parameter_read(node)
    if read is None:
        return None
    return read[0] if read[0].op == "placeholder" else read[0].target


def parameter_read(node: Any) -> list[fx.Node] | None:
    """The nodes that read a parameter into ``node`` — the graph input or attribute, then
    each cast (:data:`CASTS`) or local-shard read (:func:`is_local_shard`) up to ``node`` — or
    None when ``node`` is a tensor computed in the graph. Such a read may move earlier in the
    graph."""
    chain = []
    while isinstance(node, fx.Node) and ((node.op == "call_method" and node.target in CASTS) or is_local_shard(node)):
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")):
        return None
    return [node, *reversed(chain)]


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


def module_nodes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Every module's call nodes, as ``annotate`` attributed them to it or its submodules, in
    graph order: one walk of the graph for the regions of all its modules."""
    index: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        fqn = n.meta.get("fxlora_module") if n.op.startswith("call") else None
        if fqn is not None:
            parts = fqn.split(".")
            for depth in range(1, len(parts) + 1):
                index.setdefault(".".join(parts[:depth]), []).append(n)
    return index


def module_region(gm: fx.GraphModule, owner: str, index: dict[str, list[fx.Node]] | None = None) -> list[fx.Node]:
    """The call nodes ``annotate`` attributed to module ``owner`` or its submodules, in graph
    order, less the size arithmetic among them: values that are not tensors, computed from the
    region's inputs alone (SymInts under dynamic shapes), which code after the region may
    reuse, so they stay where they are. ``index``: :func:`module_nodes` of the graph as it is."""
    if index is not None:
        region = index.get(owner, [])
    else:
        inside = lambda fqn: fqn is not None and (fqn == owner or fqn.startswith(owner + "."))  # noqa: E731
        region = [n for n in gm.graph.nodes if n.op.startswith("call") and inside(n.meta.get("fxlora_module"))]
    nodes, sizes = set(region), set()
    for n in region:
        if not isinstance(meta_value(n), torch.Tensor) and all(a not in nodes or a in sizes for a in n.all_input_nodes):
            sizes.add(n)
    return [n for n in region if n not in sizes]


def is_collective(node: fx.Node) -> bool:
    """A torch.distributed functional collective, or the wait for one, in a traced graph."""
    name = getattr(node.target, "_qualified_op_name", None)  # an op packet
    if name is None and isinstance(node.target, torch._ops.OpOverload):
        name = node.target.name()
    return node.op == "call_function" and isinstance(name, str) and name.split("::")[0] in ("_c10d_functional", "c10d_functional")


_MOVES = {"view", "reshape", "flatten", "unflatten", "contiguous", "transpose", "permute", "narrow", "split", "chunk",
         "copy_", "redistribute", "to_local", "wait", "size", "stride", "dim", "numel", *CASTS}
_MOVES_FN = {operator.getitem, torch.reshape, torch.flatten, torch.narrow, torch.split, torch.chunk, torch.cat, torch.empty}


def moves_data(node: fx.Node) -> bool:
    """Whether ``node`` only moves, views, converts or allocates data, or reads its shape
    (views, casts, a tensor-parallel layer's collectives and DTensor conversions): a delta
    added to what it reads reaches what it makes unchanged."""
    if node.op == "call_method":
        return node.target in _MOVES
    name = getattr(node.target, "__name__", "")
    return node.target in _MOVES_FN or is_collective(node) or is_local_shard(node) or name == "from_local"


def split_reduction(region: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """``region`` as ``(compute, reduction)``: a tensor-parallel module's forward ends with
    the collective that sums the ranks' partial outputs (a copy of its result back into the
    tensor it reduced, a dtype cast); a LoRA op that replaces the computation keeps that
    reduction.
    Raises :class:`NotServed` when the region computes anything after its first collective."""
    first = next((i for i, n in enumerate(region) if is_collective(n)), len(region))
    compute, reduction = region[:first], region[first:]
    for n in reduction:
        if not (is_collective(n) or (n.op == "call_method" and (n.target == "copy_" or n.target in CASTS))):
            raise NotServed(f"its traced region computes after its collective ({n.target})")
    return compute, reduction


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


def reads_parameter(node: Any, parameter: Any, values: dict[fx.Node, object]) -> bool:
    """Whether ``node`` is ``parameter`` (by identity with the model's tensor), read directly
    or through :data:`CASTS` and :func:`is_local_shard`."""
    read = parameter_read(node)
    return read is not None and values.get(read[0]) is parameter
