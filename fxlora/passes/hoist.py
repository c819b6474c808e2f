"""hoist: the graph's allocations become sites of one planned arena.

Runs on each variant, so ``lora`` and ``nolora`` get plans of their own, both placed from
offset 0 of the model's one arena; without an arena (Inductor plans the graph's memory
itself) it returns the graph unchanged.

Matches every ``torch.empty / zeros / ones / full / arange``, ``*_like`` and ``new_*`` call,
and every LoRA workspace the LoRA passes inserted (:data:`fxlora.compiler.arena.WORKSPACES`).

Emits ``hoisted(plan, site, kind, *args)`` in each one's place (see
:mod:`fxlora.compiler.arena`), with the site's lifetime: from the allocation to the last use
of any node that may alias it. Aliasing is read from the traced values (a view shares its
base's storage); a node without a traced value is assumed to alias its input.

Leaves alone allocations that reach the graph's output, since the next graph would overwrite
them (recorded), and every other node.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxlora.compiler.arena import WORKSPACES, Site, hoisted
from fxlora.compiler.context import PassContext

# call_function targets and call_method names, by their kind in fxlora.compiler.arena.KINDS
FUNCTIONS = {
    torch.empty: "empty",
    torch.zeros: "zeros",
    torch.ones: "ones",
    torch.full: "full",
    torch.arange: "arange",
    torch.empty_like: "empty_like",
    torch.zeros_like: "zeros_like",
    torch.ones_like: "ones_like",
    torch.full_like: "full_like",
}
METHODS = {"new_empty", "new_zeros", "new_ones", "new_full"}


def allocation_kind(node: fx.Node) -> str | None:
    if node.op == "call_function":
        return FUNCTIONS.get(node.target) or WORKSPACES.get(node.target)
    if node.op == "call_method" and node.target in METHODS:
        return node.target
    return None


def _storages(node: fx.Node) -> set[StorageWeakRef] | None:
    """Storages of the node's traced tensor value(s); None when it has no traced value."""
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None:
        return None
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return {StorageWeakRef(v.untyped_storage()) for v in vals if isinstance(v, torch.Tensor)}


def lifetime(node: fx.Node, order: dict[fx.Node, int]) -> int | None:
    """Index of the last node that uses ``node``'s memory; None if it reaches the output."""
    own = _storages(node) or set()
    end, seen, todo = order[node], {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return None
            end = max(end, order[user])
            if user in seen:
                continue
            shared = _storages(user)
            if shared is None or shared & own:  # may alias: follow its uses too
                seen.add(user)
                todo.append(user)
    return end


def hoist(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.arena is None:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites: list[tuple[fx.Node, str, Site]] = []
    kept = 0
    for node in gm.graph.nodes:
        kind = allocation_kind(node)
        if kind is None:
            continue
        end = lifetime(node, order)
        if end is None:
            kept += 1
            continue
        sites.append((node, kind, Site(order[node], end)))
    if not sites:
        return gm
    name = f"fxlora_arena_plan_{len(ctx.arena.plans)}"
    gm.add_submodule(name, ctx.arena.new_plan([s for _, _, s in sites], name))
    for index, (node, kind, _) in enumerate(sites):
        with gm.graph.inserting_before(node):
            plan = gm.graph.get_attr(name)
            new = gm.graph.call_function(hoisted, (plan, index, kind, *node.args), dict(node.kwargs))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    if kept:  # the arena's own count is read off the graph (explain)
        ctx.record("info", (), f"arena: {kept} allocation(s) left as they are (they reach the graph's output)")
    gm.graph.lint()
    gm.recompile()
    return gm
