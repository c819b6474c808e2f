"""``explain()``: what a compiled model serves and how, as a report read top to bottom.

Sections, in order: the adapter pool (slots used and free, each adapter), the graphs by role
with their LoRA ops and what the passes served or noticed, what is not served and why (the
passes' records of kind ``skipped``), memory, and a line for each term of :data:`GLOSSARY`
the report uses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxlora.adapters import AdapterPool
from fxlora.compiler.arena import Arena, hoisted
from fxlora.compiler.context import PassRecord
from fxlora.ops import LORA_OPS
from fxlora.passes import Variants

GLOSSARY = {
    "slot": "a place in the adapter pool holding one adapter; rows name adapters, the graphs read slots",
    "lora / nolora": "the two variants of every traced graph: with the LoRA ops, and the model's own "
    "computation as traced, which runs when no row has an adapter",
    "prologue": "the step at the start of a lora graph that sorts its tokens by slot, once for all its LoRA ops",
    "fused groups": "linears that read one input (q/k/v, gate/up) served by one LoRA launch for all of them",
    "traced base": "targeted linears that are not a plain F.linear (a quantised weight, "
    "input @ weight.T) keep their traced computation; fxlora::lora_delta adds the LoRA delta onto its output "
    "(modules joined by '+' share one launch)",
    "arena": "one buffer, planned once, that holds the graphs' temporary allocations",
    "region": "a run of a graph's nodes of one layer (or of none) that Inductor compiles as a graph of its own; "
    "layers whose regions are the same code share one compilation",
    "buckets": "decode batch sizes with graphs of their own; a batch runs in the smallest that fits it",
}


@dataclass
class GraphRecord:
    """What the compiler made of one traced graph, for the report."""

    index: int
    role: str  # "forward", "prefill" or "decode step": the call that traced it
    ops: Counter[str]
    prologues: int
    hoisted: dict[str, int]  # variant -> allocations placed in the arena
    records: list[PassRecord] = field(default_factory=list)  # what the passes did: its lines, and "Not served"
    inner: str = "eager"  # the inner compiler of both variants
    instances: int = 0  # other module instances Dynamo runs the graph for, each with variants of its own
    regions: dict[str, str] = field(default_factory=dict)  # variant -> how Inductor compiled it by region

    @classmethod
    def of(
        cls, index: int, role: str, variants: Variants, records: Iterable[PassRecord], inner: str = "eager"
    ) -> GraphRecord:
        lora_nodes = list(variants.lora.graph.nodes) if variants.lora is not None else []
        ops = Counter(n.target.name().removeprefix("fxlora::") for n in lora_nodes if n.target in LORA_OPS)
        prologues = sum(1 for n in lora_nodes if n.target is torch.ops.fxlora.batch_info.default)
        hoists = {v: _hoisted(g) for v, g in (("lora", variants.lora), ("nolora", variants.nolora)) if g is not None}
        return cls(index, role, ops, prologues, hoists, list(records), inner)

    def lines(self) -> Iterable[str]:
        by = "" if self.inner == "eager" else f"; both compiled by {self.inner}"
        if self.ops:
            ops = ", ".join(f"{n} x {op}" for op, n in sorted(self.ops.items()))
            yield f"  {self.role} graph {self.index}: lora runs {ops} after {self.prologues} prologue(s); nolora as traced{by}"
        else:
            yield f"  {self.role} graph {self.index}: no LoRA target here; nolora only{by}"
        if self.instances:
            yield f"    also runs for {self.instances} other instance(s) of its code, with variants of their own"
        for record in self.records:
            if record.kind != "skipped":  # what was served, and what else the passes tell
                yield f"    {record}"
        if self.regions:
            yield "    by region: " + "; ".join(f"{v} {how}" for v, how in self.regions.items())
        if any(self.hoisted.values()):
            yield "    arena: " + ", ".join(f"{n} allocation(s) of {v}" for v, n in self.hoisted.items())


def _hoisted(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is hoisted)


def report(
    title: str,
    pool: AdapterPool,
    arena: Arena,
    graphs: list[GraphRecord],
    not_traced: Iterable[str],
    notes: Iterable[str],
    runtime: Iterable[str],
    memory: dict[str, str],
) -> str:
    """The whole report; ``runtime``: lines on generation (buckets, CUDA graphs); ``memory``:
    further rows of the memory table (graph pool, KV cache)."""
    lines = [title, ""]
    lines += [f"note: {n}" for n in notes]
    used = len(pool.slot_of)
    lines.append(
        f"Adapter pool: {used} of {pool.max_loras} slots used, {pool.max_loras - used} free; "
        f"{len(pool.targets)} target modules; max rank {pool.max_rank}"
    )
    for name, slot in sorted(pool.slot_of.items(), key=lambda kv: kv[1]):
        a = pool.adapters[name]
        formats = sorted({getattr(f, "format", None) for f in a.modules.values()} - {None})
        experts = f"; experts LoRA as {', '.join(formats)}" if formats else ""
        lines.append(f"  slot {slot}: {name!r}, rank <= {a.max_rank}, {len(a.modules)} modules{experts}, from {a.source}")
    held = [n for n in pool.adapters if n not in pool.slot_of]
    if held:
        kept = sum(n in pool.host for n in held)
        bound = f" (max_cpu_loras={pool.max_cpu_loras})" if pool.max_cpu_loras is not None else ""
        lines.append(
            f"  on the host: {len(held)} more adapter(s), {kept} with their factors in host memory{bound}, the others "
            f"read again from their directories; e.g. {held[:4]}"
        )
    lines.append(
        f"  paged in {pool.misses} time(s), found in a slot {pool.hits} time(s) since start; host tier {_mib(pool.host_bytes)}"
    )
    lines += ["", "Graphs (each traced graph has a lora and a nolora variant):"]
    if graphs:
        for g in graphs:
            lines += g.lines()
    else:
        lines.append("  none yet: call the model once to trace it")
    lines += [f"  {line}" for line in runtime]
    skipped = [str(r) for g in graphs for r in g.records if r.kind == "skipped"]
    skipped += [f"{fqn}: targeted, but no traced graph calls it" for fqn in not_traced]
    lines += ["", "Not served:"] + ([f"  {line}" for line in dict.fromkeys(skipped)] or ["  nothing: every target runs its LoRA"])
    lines += ["", "Memory:", f"  adapter pool: {_mib(pool.nbytes)}"]
    if arena.nbytes:
        lines.append(f"  arena: {_mib(arena.nbytes)}, holding allocations that would take {_mib(arena.replaced_bytes)} side by side")
    elif graphs and all(g.inner == "inductor" for g in graphs):
        lines.append("  arena: not used: Inductor plans the graphs' memory")
    else:
        lines.append("  arena: not planned yet (generate or prepare() plans it)")
    lines += [f"  {k}: {v}" for k, v in memory.items()]
    body = "\n".join(lines)
    used = [(t, m) for t, m in GLOSSARY.items() if any(word in body for word in t.split(" / "))]
    return "\n".join([body, "", "Terms:", *(f"  {term}: {meaning}" for term, meaning in used)])


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
