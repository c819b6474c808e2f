"""The pass pipeline: an ordered list of ``GraphModule -> GraphModule`` passes, then
``specialize`` into the ``lora`` and ``nolora`` graphs, then ``hoist`` on each."""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

import fxlora.ops  # noqa: F401  (registers the fxlora:: ops the passes emit)
from fxlora.passes.annotate import annotate
from fxlora.passes.batch_info import batch_info
from fxlora.passes.context import PassContext
from fxlora.passes.fuse import fuse
from fxlora.passes.hoist import hoist
from fxlora.passes.lora_embedding import lora_embedding
from fxlora.passes.lora_linear import lora_linear
from fxlora.passes.lora_moe import lora_moe
from fxlora.passes.specialize import specialize

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

PIPELINE: list[Pass] = [annotate, fuse, lora_linear, lora_embedding, lora_moe, batch_info]


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule | None, fx.GraphModule]:
    """Run every pass in order on a copy of ``gm`` (the caller's graph is left as it was),
    split into ``(lora, nolora)``, and hoist each variant's allocations into the arena."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    gm = fx.GraphModule(gm, graph)
    for p in PIPELINE:
        gm = p(gm, ctx)
    lora, nolora = specialize(gm)
    return (hoist(lora, ctx) if lora is not None else None), hoist(nolora, ctx)


__all__ = ["PIPELINE", "PassContext", "hoist", "run_pipeline", "specialize"]
