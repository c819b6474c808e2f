"""lora_moe: each targeted experts region of the graph becomes one ``fxlora::moe_lora`` call.

Matches each experts module whose ``gate_up_proj`` / ``up_proj`` or ``down_proj`` the pool
targets, by module boundary: the call nodes ``annotate`` attributed to it or its submodules,
whatever experts implementation traced them (``grouped_mm``, ``batched_mm``). The region must
have one output; its inputs are the hidden states, the routing (``top_k_index``,
``top_k_weights``) and the module's parameters, recognised by identity with the model's
tensors.

Emits one ``fxlora::moe_lora`` after the region, which takes over its users; the region's
nodes, dead then, are erased (``nolora``, copied before this pass, keeps the region exactly as
traced). Each projection's factors go in as one bundle (``pool_nodes``; an empty list for a
projection no adapter targets). The layout (transposed weights, the gate, the activation) is
the one whose gate computes as the module's own (:mod:`fxlora.compiler.experts_probe`), handed
to the op by name; before the region is touched, the op with no adapter is run against the
module's ``forward`` on a probe, since rows without an adapter run the op too.

Leaves alone, and records as skipped, a module whose layout, probe or region the op cannot
serve; size arithmetic computed from the region's inputs alone stays where it is.

Under tensor parallelism (experts sharded over their intermediate features) the region reads
its parameters' local shards and ends with the all-reduce of the ranks' partial outputs: the
op replaces the computation between them, on the shards, and the all-reduce then sums its
output, the LoRA deltas with it (:mod:`fxlora.adapters.sharding`). With experts split between
ranks (expert parallelism) the op runs this rank's experts on the routes to them
(``local_routing``; the routes number the model's experts or, where the router renumbered
them, this rank's: the probe tells which); the all-reduce adds the other ranks' experts.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from fxlora.adapters import experts
from fxlora.compiler.context import PassContext
from fxlora.compiler.experts_probe import choose_layout, prove_region
from fxlora.compiler.graph_edit import (
    fake_value,
    input_values,
    is_local_shard,
    meta_value,
    module_region,
    parameter_read,
    region_inputs,
    region_outputs,
    split_reduction,
)
from fxlora.compiler.operands import batch_info_for, pool_nodes
from fxlora.compiler.rows import row_dim
from fxlora.errors import NotServed
from fxlora.ops.moe_lora import local_routing

OP = "fxlora::moe_lora"


def lora_moe(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    groups: dict[str, dict[str, object]] = defaultdict(dict)  # experts FQN -> parameter -> pool target
    for fqn, target in ctx.pool.targets.items():
        if target.info.kind == "experts" and experts.is_experts(target.info.owner):  # other 3-D parameters: lora_parameters'
            owner, _, param = fqn.rpartition(".")
            groups[owner][param] = target
    values = input_values(gm, ctx)
    for owner, targets in groups.items():
        region = module_region(gm, owner)
        if not region:
            continue
        try:
            _rewrite(gm, ctx, owner, targets, region, values)
        except NotServed as why:
            ctx.leave_traced(owner, str(why), [f"{owner}.{p}" for p in targets])
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite(gm, ctx: PassContext, owner: str, targets: dict, region: list[fx.Node], values) -> None:
    module = next(iter(targets.values())).info.owner
    layout = choose_layout(module)
    # under tensor parallelism: the parameters' local shards stay (the op reads them) and so
    # does the reduction of the ranks' partial outputs, which then carries the op's output
    region = [n for n in region if not (is_local_shard(n) and parameter_read(n))]
    region, _ = split_reduction(region)
    outputs = region_outputs(region)
    if len(outputs) != 1:
        raise NotServed(f"its traced region has {len(outputs)} outputs, not one")
    hidden, top_k_index, top_k_weights, found, up_name = _match_inputs(region, module, values)
    rows = row_dim(gm, ctx, hidden, feature_dims=1)
    bundles = [_bundle(targets.get(n)) for n in (up_name, "down_proj")]
    shard = next(iter(targets.values())).info.shard
    mine = (shard.start, shard.length) if shard is not None and shard.dim == "experts" else None
    first = prove_region(module, layout, tuple(meta_value(n) for n in (hidden, top_k_index, top_k_weights)), *bundles, mine)
    output = outputs[0]
    with gm.graph.inserting_before(output.next):
        if mine is not None:  # the routes to this rank's experts only; the all-reduce adds the rest
            ours = (first, mine[1])
            routes = gm.graph.call_function(local_routing, (top_k_index, top_k_weights, *ours))
            weights_value = meta_value(top_k_weights)
            fake_value(routes, lambda i: local_routing(i, weights_value, *ours), top_k_index)
            top_k_index, top_k_weights = (gm.graph.call_function(operator.getitem, (routes, i)) for i in range(2))
            for i, node in enumerate((top_k_index, top_k_weights)):
                node.meta["example_value"] = routes.meta["example_value"][i]
        up_lora, down_lora = (pool_nodes(gm, targets[n]) if n in targets else [] for n in (up_name, "down_proj"))
        token_slot = batch_info_for(gm, ctx, hidden, 1, rows)[0]
        args = (
            hidden, top_k_index, top_k_weights,
            found["up"], found.get("up_bias"), found["down"], found.get("down_bias"),
            up_lora, down_lora, token_slot, layout.spec,
        )  # fmt: skip
        op = gm.graph.call_function(torch.ops.fxlora.moe_lora.default, args)
    op.meta.update({k: v for k, v in output.meta.items() if k in ("val", "example_value", "nn_module_stack")})
    op.meta["fxlora_module"] = owner
    output.replace_all_uses_with(op, delete_user_cb=lambda user: user is not op)
    for n in reversed(region):  # the region is dead now: its one output's users read the op
        gm.graph.erase_node(n)
    for p in targets:
        ctx.rewritten[f"{owner}.{p}"] = OP


def _bundle(target) -> list[torch.Tensor]:
    """A pool target's tensors as the op's ``lora`` bundle (empty: no adapter targets it)."""
    return [] if target is None else [target.lora_a, target.lora_b, target.scaling, target.rank]


def _match_inputs(
    region: list[fx.Node], module: torch.nn.Module, values: dict[fx.Node, object]
) -> tuple[fx.Node, fx.Node, fx.Node, dict[str, fx.Node], str]:
    """``(hidden, top_k_index, top_k_weights, parameter nodes, up parameter name)`` of the
    region; raises :class:`NotServed` when they cannot be told apart."""
    external = region_inputs(region)
    params = experts.experts_parameters(module)
    up_name = experts.up_name(module)
    wanted = {"up": params[up_name], "down": params["down_proj"]}
    if module.has_bias:
        wanted.update(zip(("up_bias", "down_bias"), experts.experts_biases(module), strict=True))
    by_tensor = {id(values[read[0]]): n for n in external if (read := parameter_read(n)) and read[0] in values}
    found = {k: by_tensor.get(id(v)) for k, v in wanted.items()}
    missing = [k for k, n in found.items() if n is None]
    if missing:
        raise NotServed(f"the traced region does not read its parameters {missing} directly")
    data = [n for n in external if n not in found.values() and isinstance(meta_value(n), torch.Tensor)]
    index = [n for n in data if not meta_value(n).dtype.is_floating_point]
    floats = [n for n in data if meta_value(n).dtype.is_floating_point]
    fin = experts.in_out(module, wanted["up"])[0]
    hidden = [n for n in floats if meta_value(n).dim() == 2 and meta_value(n).shape[-1] == fin]
    if len(index) != 1 or len(hidden) != 1 or len(floats) != 2:
        raise NotServed("its traced region's inputs are not (hidden states, top-k index, top-k weights)")
    top_k_weights = next(n for n in floats if n is not hidden[0])
    return hidden[0], index[0], top_k_weights, found, up_name
