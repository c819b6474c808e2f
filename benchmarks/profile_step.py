"""Where one decode step's time goes: the kernels of a replay of fxlora's ``nolora`` and ``lora``
decode graphs (``torch.profiler``), per inner compiler, and what ``lora`` adds kernel by kernel.

    python benchmarks/profile_step.py [--model llama|qwen3_moe] [--batch 128] [--inner inductor,eager] [--out F.json]

The model, adapters and step are ``decode.py``'s (bf16, random weights, 16 rank-16 adapters
round-robin over the rows, context 512), compiled with one batch bucket, ``--batch``. Each
graph is replayed ``REPLAYS`` times under the profiler; a kernel's time is its total over
them divided by ``REPLAYS``. The printed table groups kernels by name, largest first; the
difference table lists what ``lora`` adds to ``nolora`` under the same inner compiler.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
import transformers
from decode import MAX_LEN, RANK, at_context, environment, make_adapters, spec, us
from torch.profiler import ProfilerActivity, profile

import fxlora
from fxlora.testing.models import fill_zero_weights

ADAPTERS, REPLAYS = 16, 20


def kernels(graph: torch.cuda.CUDAGraph) -> dict[str, list[float]]:
    """Per kernel name: [µs per step, launches per step] over ``REPLAYS`` replays."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            table[e.name][0] += e.time_range.elapsed_us() / REPLAYS
            table[e.name][1] += 1 / REPLAYS
    return dict(table)


def print_table(title: str, table: dict[str, list[float]], top: int = 25) -> None:
    total = sum(t for t, _ in table.values())
    print(f"\n{title}: {total:.0f} us of kernels a step, {sum(n for _, n in table.values()):.0f} launches")
    print(f"{'us':>8} {'share':>6} {'calls':>6}  kernel")
    for name, (t, n) in sorted(table.items(), key=lambda kv: -abs(kv[1][0]))[:top]:
        print(f"{t:8.1f} {t / total:6.1%} {n:6.0f}  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--inner", default="inductor,eager")
    parser.add_argument("--out", default="profile_step.json")
    args = parser.parse_args()
    sp = spec(args.model)
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised there: the CPU takes over a minute for the MoE's experts
        model = transformers.AutoModelForCausalLM.from_config(sp.config, dtype=torch.bfloat16).eval()
    fill_zero_weights(model, 0.02)
    adapters = make_adapters(sp, ADAPTERS)
    names = [f"ad{i % ADAPTERS}" for i in range(args.batch)]
    results = {}
    for inner in args.inner.split(","):
        start = time.perf_counter()
        cm = fxlora.compile(
            model, adapters, max_loras=ADAPTERS, max_rank=RANK, max_batch_size=args.batch,
            max_len=MAX_LEN, batch_buckets=[args.batch], inner=inner,
        )  # fmt: skip
        with torch.no_grad():
            rt = cm.prepare()
            setup = time.perf_counter() - start
            rt.ids.random_(3, sp.config.vocab_size)
            at_context(rt)
            rt.slot_ids.copy_(torch.tensor(cm.pool.slot_ids(names), dtype=torch.int32))
            for variant in ("nolora", "lora"):
                graph = rt.graphs.graphs[(variant, args.batch)][0]
                table, replay = kernels(graph), us(graph.replay)
                results[f"{inner}/{variant}"] = {"replay_us": replay, "setup_s": setup, "kernels": table}
                print_table(f"{inner} {variant}, batch {args.batch} (replay {replay:.0f} us)", table)
        nolora, lora = results[f"{inner}/nolora"]["kernels"], results[f"{inner}/lora"]["kernels"]
        none = [0.0, 0.0]
        added = {k: [a - b for a, b in zip(lora.get(k, none), nolora.get(k, none))] for k in {*lora, *nolora}}
        print_table(f"{inner}: lora minus nolora", {k: v for k, v in added.items() if abs(v[0]) > 0.5}, top=40)
        del rt, cm
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    meta = {
        **environment(),
        "model": args.model,
        "batch": args.batch,
        "adapters": ADAPTERS,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
