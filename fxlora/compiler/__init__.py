"""The compiler: a traced FX graph in, its ``lora`` and ``nolora`` variants out.

``annotate`` attributes every call to its module; for code that runs on CUDA,
``decode_attention`` then serves decode-step attention from the KV cache as cached. That
graph, copied before any LoRA pass, is ``nolora``: node for node the traced base computation. The LoRA passes then
rewrite the other copy in order, each leaving a valid graph, into ``lora``. ``hoist`` turns
each variant's allocations into sites of the model's one arena.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

import fxlora.ops  # noqa: F401  (registers the fxlora:: ops the passes emit)
from fxlora.compiler import progress
from fxlora.compiler.annotate import annotate, called_targets, instance_parameters
from fxlora.compiler.batch_info import batch_info
from fxlora.compiler.context import PassContext
from fxlora.compiler.decode_attention import decode_attention
from fxlora.compiler.fuse import fuse
from fxlora.compiler.hoist import hoist
from fxlora.compiler.lora_delta import lora_delta
from fxlora.compiler.lora_embedding import lora_embedding
from fxlora.compiler.lora_linear import lora_linear
from fxlora.compiler.lora_moe import lora_moe

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

# The LoRA passes, in order: each rewrites what the ones before left.
PIPELINE: list[Pass] = [fuse, lora_linear, lora_delta, lora_embedding, lora_moe, batch_info]

LORA_OPS = {
    torch.ops.fxlora.lora_delta.default,
    torch.ops.fxlora.lora_linear.default,
    torch.ops.fxlora.lora_linear_fused.default,
    torch.ops.fxlora.lora_shrink.default,
    torch.ops.fxlora.lora_embedding.default,
    torch.ops.fxlora.moe_lora.default,
}


@dataclass(frozen=True)
class Variants:
    """What the compiler makes of one traced graph."""

    lora: fx.GraphModule | None  # None: no module of this graph carries LoRA
    nolora: fx.GraphModule
    rewritten: frozenset[str]  # the modules whose LoRA ``lora`` runs
    # the targets whose module the graph calls but ``lora`` leaves as traced -> why
    left_traced: Mapping[str, str] = field(default_factory=dict)
    # (input index, module FQN, attribute): a parameter of each module the graph calls that
    # could carry LoRA, by which a call tells which instance of the traced code it runs
    instance: tuple[tuple[int, str, str], ...] = ()


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> Variants:
    """Annotate a copy of ``gm`` (the caller's graph is left as it was), serve its decode
    attention if ``ctx`` asks, keep a copy of it as
    ``nolora``, run the LoRA passes on the other into ``lora``, and hoist each variant's
    allocations into the arena."""
    progress.expect(1 + ctx.decode_attention + len(PIPELINE) + 1)
    with progress.step("annotate"):
        gm = annotate(copy_graph(gm), ctx)
    if ctx.decode_attention:
        with progress.step("decode_attention"):
            gm = decode_attention(gm, ctx)
    nolora = copy_graph(gm)
    called, instance = called_targets(gm, ctx), instance_parameters(gm, ctx)
    for p in PIPELINE:
        with progress.step(p.__name__):
            gm = p(gm, ctx)
    lora = gm if any(n.target in LORA_OPS for n in gm.graph.nodes) else None
    ctx.served_after_all()
    for fqn in sorted(called - ctx.rewritten.keys() - ctx.left_traced.keys()):
        ctx.leave_traced(fqn, "no LoRA pass recognises its calls")
    with progress.step("hoist"):
        lora, nolora = hoist(lora, ctx) if lora is not None else None, hoist(nolora, ctx)
    return Variants(lora, nolora, frozenset(ctx.rewritten), dict(ctx.left_traced), instance)


__all__ = ["LORA_OPS", "PIPELINE", "PassContext", "Variants", "hoist", "run_pipeline"]
