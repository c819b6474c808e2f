"""The passes, one a file, and the one ordered list that runs them.

A pass is a function ``(GraphModule, PassContext) -> GraphModule`` that rewrites in one
direction and leaves a valid graph, and records what it served, left as traced or noticed
(:class:`fxlora.compiler.context.PassRecord`). Passes import the graph toolkit
(:mod:`fxlora.compiler`) and the ops, never each other; a pass that has nothing to do for a
graph returns it unchanged.

:data:`PIPELINE` is the order. Each entry names the graph it rewrites: ``SHARED`` passes
rewrite the traced graph, after which a copy of it is kept as ``nolora`` — node for node the
traced base computation, so rows without an adapter compute what the model computes; ``LORA``
passes rewrite the other copy into ``lora``; ``EACH_VARIANT`` passes run on ``lora`` and
``nolora`` alike. :func:`run_pipeline` runs it on one traced graph into its :class:`Variants`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from fxlora.compiler import progress
from fxlora.compiler.calls import called_targets, instance_parameters
from fxlora.compiler.context import PassContext
from fxlora.ops import LORA_OPS
from fxlora.passes.annotate import annotate
from fxlora.passes.batch_info import batch_info
from fxlora.passes.decode_attention import decode_attention
from fxlora.passes.hoist import hoist
from fxlora.passes.lora_embedding import lora_embedding
from fxlora.passes.lora_linear import lora_linear
from fxlora.passes.lora_moe import lora_moe
from fxlora.passes.lora_parameters import lora_parameters

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

SHARED = "shared"  # the traced graph, before nolora is copied from it
LORA = "lora"  # the other copy, which becomes lora
EACH_VARIANT = "each variant"  # lora and nolora, one after the other
STAGES = (SHARED, LORA, EACH_VARIANT)

PIPELINE: tuple[tuple[str, Pass], ...] = (
    (SHARED, annotate),  # every call node: the module that made it
    (SHARED, decode_attention),  # decode-step SDPA over the KV cache, in code run on CUDA
    # nolora: a copy of the graph as it is here
    (LORA, lora_linear),  # linear targets: fxlora::lora_linear(_fused), or lora_delta onto a traced base
    (LORA, lora_embedding),  # F.embedding of targets: fxlora::lora_embedding
    (LORA, lora_moe),  # experts regions: fxlora::moe_lora
    (LORA, lora_parameters),  # other 3-D parameters: lora_delta per expert of a bmm, lora_conv_delta, lora_weight_rows
    (LORA, batch_info),  # the LoRA ops' prologues: one per token layout
    (EACH_VARIANT, hoist),  # allocations: sites of the model's one arena
)


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
    """A copy of ``gm`` whose Python code is generated when it first runs, or its code is read:
    the passes' ``recompile`` after each rewrite then costs nothing, where generating and
    compiling the code of a whole model's graph takes a tenth of a second or more each time."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    with _use_lazy_graph_module(True):
        return _make_graph_module(gm, graph)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> Variants:
    """Run :data:`PIPELINE` on a copy of ``gm`` (the caller's graph is left as it was): the
    shared passes, then ``nolora`` copied, the LoRA passes into ``lora``, and the passes of
    each variant. A target the graph calls that no pass served nor left with a reason is left
    as traced, because no pass recognised its calls."""
    progress.expect(len(PIPELINE))
    gm = copy_graph(gm)
    for p in stage(SHARED):
        gm = _run(p, gm, ctx)
    nolora = copy_graph(gm)
    called, instance = called_targets(gm, ctx), instance_parameters(gm, ctx)
    for p in stage(LORA):
        gm = _run(p, gm, ctx)
    lora = gm if any(n.target in LORA_OPS for n in gm.graph.nodes) else None
    with ctx.running("run_pipeline"):
        for fqn in sorted(called - ctx.rewritten.keys() - ctx.left_traced.keys()):
            ctx.leave_traced(fqn, "no LoRA pass recognises its calls")
    for p in stage(EACH_VARIANT):
        with progress.step(p.__name__), ctx.running(p.__name__):
            lora, nolora = p(lora, ctx) if lora is not None else None, p(nolora, ctx)
    return Variants(lora, nolora, frozenset(ctx.rewritten), dict(ctx.left_traced), instance)


def stage(name: str) -> list[Pass]:
    """The passes of one stage of :data:`PIPELINE`, in order."""
    return [p for s, p in PIPELINE if s == name]


def _run(p: Pass, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    with progress.step(p.__name__), ctx.running(p.__name__):
        return p(gm, ctx)


__all__ = ["PIPELINE", "Pass", "Variants", "run_pipeline"]
