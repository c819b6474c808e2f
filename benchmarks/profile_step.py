"""Where one decode step's time goes: the kernels of a replay of fxlora's ``nolora`` and ``lora``
decode graphs (``torch.profiler``), per inner compiler, and what ``lora`` adds kernel by kernel.
With ``--prefill N``, the same for a prefill of ``N``-token prompts instead (a ``generate``
call making one token, or with ``--stream`` a ``generate_batch`` call; a short prefill replays a
CUDA graph, none with ``--prefill-graph-tokens 0``), with the host's time too, by operator and
by Python function.

    python benchmarks/profile_step.py [--model llama|llama8b|qwen3_moe] [--batch 128 | --batch 1,128] [--inner inductor,eager]
                                      [--prefill 128 [--stream] [--prefill-graph-tokens 0]]
                                      [--quant none|fp8] [--trace T.json] [--out F.json]

The model, adapters and step are ``decode.py``'s (bf16, random weights, 16 rank-16 adapters
round-robin over the rows, context 512; with ``--quant fp8``, on ``generate.py``'s FP8 base),
compiled with one batch bucket per ``--batch`` (several: decode steps only). Each graph is replayed ``REPLAYS`` times under
the profiler; a kernel's time is its total over them divided by ``REPLAYS``. The printed table
groups kernels by name, largest first; the difference table lists what ``lora`` adds to
``nolora`` under the same inner compiler.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import pstats
import time
from collections.abc import Callable

import torch
import transformers
from decode import MAX_LEN, RANK, at_context, environment, make_adapters, spec, us
from generate import quantize
from torch.profiler import ProfilerActivity, profile

import fxlora
from fxlora.testing.models import fill_zero_weights

ADAPTERS, REPLAYS = 16, 20


def kernels(step: Callable[[], object], host: bool = False, trace: str | None = None) -> dict[str, list[float]]:
    """Per kernel name: [µs per step, launches per step] over ``REPLAYS`` calls of ``step``;
    with ``host``, also print the host's operators that take the most time; with ``trace``, write
    the profile there as a Chrome trace, with the Python stacks of the host's operators."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if host else [])]
    with profile(activities=activities, with_stack=trace is not None) as prof:
        for _ in range(REPLAYS):
            step()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            table[e.name][0] += e.time_range.elapsed_us() / REPLAYS
            table[e.name][1] += 1 / REPLAYS
    if trace is not None:
        prof.export_chrome_trace(trace)
    if host:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
        python_functions(step)
    return dict(table)


def python_functions(step: Callable[[], object], top: int = 25) -> None:
    """The host's Python functions that take the most time over ``REPLAYS`` calls of ``step``
    (cProfile, by own time): what the operators' times above are made of."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(REPLAYS):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    print(f"Python functions over {REPLAYS} calls, by own time:" + out.getvalue().split("\n\n", 1)[-1])


def print_table(title: str, table: dict[str, list[float]], top: int = 25) -> None:
    total = sum(t for t, _ in table.values())
    print(f"\n{title}: {total:.0f} us of kernels a step, {sum(n for _, n in table.values()):.0f} launches")
    print(f"{'us':>8} {'share':>6} {'calls':>6}  kernel")
    for name, (t, n) in sorted(table.items(), key=lambda kv: -abs(kv[1][0]))[:top]:
        print(f"{t:8.1f} {t / total:6.1%} {n:6.0f}  {name[:110]}")


def profile_batch(cm, rt, args, inner: str, batch: int, names: list[str], vocab: int, setup: float, results: dict) -> None:
    """Both variants' kernels at ``batch`` rows, and what ``lora`` adds, into ``results``."""
    prompts = torch.randint(3, vocab, (batch, args.prefill or 1), device="cuda")
    for variant in ("nolora", "lora"):
        if args.stream:
            step = functools.partial(cm.generate_batch, prompts.tolist(), names if variant == "lora" else None,
                                     max_new_tokens=1, eos_token_id=(), progress_bar=False)  # fmt: skip
            what = f"stream prefill of {batch} x {args.prefill} tokens"
        elif args.prefill:
            step = functools.partial(cm.generate, prompts, adapter_names=names if variant == "lora" else None,
                                     max_new_tokens=1, eos_token_id=())  # fmt: skip
            what = f"prefill of {batch} x {args.prefill} tokens"
        else:
            step, what = rt.graphs.graphs[(variant, batch)][0].replay, f"batch {batch}"
        trace = f"{args.trace.removesuffix('.json')}-{inner}-{variant}-{batch}.json" if args.trace else None
        table, replay = kernels(step, host=bool(args.prefill), trace=trace), us(step)
        results[f"{inner}/{variant}/{batch}"] = {"replay_us": replay, "setup_s": setup, "kernels": table}
        print_table(f"{inner} {variant}, {what} ({replay:.0f} us a call)", table)
    nolora, lora = results[f"{inner}/nolora/{batch}"]["kernels"], results[f"{inner}/lora/{batch}"]["kernels"]
    none = [0.0, 0.0]
    added = {k: [a - b for a, b in zip(lora.get(k, none), nolora.get(k, none))] for k in {*lora, *nolora}}
    print_table(f"{inner}, batch {batch}: lora minus nolora", {k: v for k, v in added.items() if abs(v[0]) > 0.5}, top=40)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("llama", "llama8b", "qwen3_moe"), default="llama")
    parser.add_argument("--batch", default="128", help="rows; decode steps take several, comma-separated")
    parser.add_argument("--inner", default="inductor,eager")
    parser.add_argument("--prefill", type=int, help="profile a prefill of prompts this long instead")
    parser.add_argument("--stream", action="store_true", help="the prefill of the request stream (generate_batch)")
    parser.add_argument("--prefill-graph-tokens", type=int, help="fxlora.compile's prefill_graph_tokens (0: eager prefills)")
    parser.add_argument("--trace", help="write each profile as a Chrome trace with Python stacks: F-<inner>-<variant>-<batch>.json")
    parser.add_argument("--quant", choices=("none", "fp8"), default="none")
    parser.add_argument("--out", default="profile_step.json")
    args = parser.parse_args()
    if (args.stream or args.prefill_graph_tokens is not None) and not args.prefill:
        parser.error("--stream and --prefill-graph-tokens profile a prefill: give --prefill N")
    batches = [int(b) for b in args.batch.split(",")]
    if args.prefill and len(batches) > 1:
        parser.error("a prefill profile takes one --batch")
    sp = spec(args.model)
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised there: the CPU takes over a minute for the MoE's experts
        model = transformers.AutoModelForCausalLM.from_config(sp.config, dtype=torch.bfloat16).eval()
    fill_zero_weights(model, 0.02)
    adapters = make_adapters(sp, ADAPTERS)  # from the unquantised weights' shapes
    quantize(model, args.quant)
    names = [f"ad{i % ADAPTERS}" for i in range(max(batches))]
    results = {}
    for inner in args.inner.split(","):
        start = time.perf_counter()
        cm = fxlora.compile(
            model, adapters, max_loras=ADAPTERS, max_rank=RANK, max_batch_size=max(batches),
            max_len=MAX_LEN, batch_buckets=batches, inner=inner,
            **({} if args.prefill_graph_tokens is None else {"prefill_graph_tokens": args.prefill_graph_tokens}),
        )  # fmt: skip
        with torch.no_grad():
            rt = None if args.stream else cm.prepare()
            setup = time.perf_counter() - start
            if rt is not None:
                rt.ids.random_(3, sp.config.vocab_size)
                at_context(rt)
                rt.slot_ids.copy_(torch.tensor(cm.pool.slot_ids(names), dtype=torch.int32))
            for batch in batches:
                profile_batch(cm, rt, args, inner, batch, names[:batch], sp.config.vocab_size, setup, results)
        del rt, cm
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    meta = {
        **environment(),
        "model": args.model,
        "batches": batches,
        "prefill": args.prefill,
        "stream": args.stream,
        "adapters": ADAPTERS,
        "quant": args.quant,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
