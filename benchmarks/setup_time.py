"""Where fxlora's setup goes: the setup of ``generate.py`` (``fxlora.compile``, ``prepare()``
and the first call, which compiles the prefill graph), split by what the time is spent on.

    python benchmarks/setup_time.py [--model llama|llama8b|qwen3_moe] [--quant none|fp8] [--stream] [--out F.json]
                                    [--cprofile F.prof]

With ``--stream``, the request stream's setup instead: its engine (paged cache, decode graphs)
in place of ``prepare()``, and ``generate_batch`` calls.

Measured by wrapping, for this process only: each Inductor compile of a graph variant (and the
first run of what it returns), Triton's compiler (the compilations this process does itself:
fxlora's kernels on their first launch with each specialisation, and any of Inductor's kernels
not compiled in its worker pool) and Inductor's autotuning of its kernels' launch configs.
Run it with empty caches (``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` pointing at new
directories) for the cold setup, again with the same directories for the warm one. With
``--cprofile``, the setup (compile, engine or ``prepare()``, first call) also runs under
cProfile (the calling thread), its statistics written to that file (``pstats``) and the
functions with the most cumulative time printed and kept in the JSON.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import pstats
import time

import torch
import transformers
import triton
import triton.compiler.compiler
from decode import environment, make_adapters, spec
from generate import NEW, PROMPT, quantize
from torch._dynamo.utils import counters
from torch._inductor.runtime import triton_heuristics

import fxlora
from fxlora.runtime import routing
from fxlora.testing.models import fill_zero_weights

ADAPTERS, BATCH = 16, 32
CACHES = {  # Dynamo's counters of the two caches a compile of a graph may be served from
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
}


class Spies:
    """Counts and seconds by key, from the wrapped functions while they run."""

    def __init__(self) -> None:
        self.count: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self.graphs: list[dict] = []

    def timed(self, key: tuple, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.count[key] += 1
            self.seconds[key] += time.perf_counter() - start

    def install(self) -> None:
        compile_triton = triton.compiler.compiler.compile

        def triton_compile(src, *args, **kwargs):
            name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
            kind = "inductor" if name.startswith("triton_") else "fxlora"  # Inductor's kernels' prefix
            return self.timed(("triton compile", kind, name), compile_triton, src, *args, **kwargs)

        # the names Triton's launchers may reach the compiler by
        triton.compiler.compiler.compile = triton.compiler.compile = triton.compile = triton_compile
        benchmark = triton_heuristics.CachingAutotuner.benchmark_all_configs

        def autotune(tuner, *args, **kwargs):
            return self.timed(("autotune", "inductor", tuner.fn.__name__), benchmark, tuner, *args, **kwargs)

        triton_heuristics.CachingAutotuner.benchmark_all_configs = autotune
        compile_inner = routing.compile_inner

        def inner(graph, how):
            record = {"nodes": len(graph.graph.nodes), "compile_s": 0.0, "first_run_s": None}
            self.graphs.append(record)
            before = {k: dict(counters[k]) for k in CACHES}
            start = time.perf_counter()
            compiled = compile_inner(graph, how)
            record["compile_s"] = time.perf_counter() - start
            record["caches"] = [  # what the caches did for this compile
                f"{k} {n - before[group].get(k, 0)}" for group, keys in CACHES.items()
                for k, n in counters[group].items() if k in keys and n > before[group].get(k, 0)
            ]  # fmt: skip

            def run(*args):
                if record["first_run_s"] is not None:
                    return compiled(*args)
                start = time.perf_counter()
                out = compiled(*args)
                torch.cuda.synchronize()
                record["first_run_s"] = time.perf_counter() - start
                return out

            return run

        routing.compile_inner = inner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("llama", "llama8b", "qwen3_moe"), default="llama")
    parser.add_argument("--quant", choices=("none", "fp8"), default="none")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--stream", action="store_true", help="the request stream's engine and generate_batch calls")
    parser.add_argument("--out", default="setup_time.json")
    parser.add_argument("--cprofile", help="also profile the setup's host time with cProfile, its statistics to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    sp = spec(args.model)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(sp.config, dtype=torch.bfloat16).eval()
    fill_zero_weights(model, 0.02)
    adapters = make_adapters(sp, ADAPTERS)
    quantize(model, args.quant)
    spies = Spies()
    spies.install()
    phases = {}
    profiler = cProfile.Profile() if args.cprofile else None
    profiled = profiler if profiler is not None else contextlib.nullcontext()
    start = time.perf_counter()
    with profiled:
        cm = fxlora.compile(model, adapters, max_loras=ADAPTERS, max_rank=16, max_batch_size=args.max_batch_size,
                            max_len=PROMPT + NEW)  # fmt: skip
    phases["compile"] = time.perf_counter() - start
    start = time.perf_counter()
    with profiled:
        if args.stream:
            cm._requests({}, None)  # the engine: paged cache, decode graphs traced, compiled, captured
            runtime = cm._engine[1].runner
        else:
            runtime = cm.prepare()
    phases["prepare"] = time.perf_counter() - start
    phases["of which capture"] = runtime.graphs.capture_seconds
    prompts = torch.randint(3, sp.config.vocab_size, (BATCH, PROMPT), device="cuda")
    names = [f"ad{i % ADAPTERS}" for i in range(BATCH)]
    for call in ("first call", "second call"):
        start = time.perf_counter()
        if call == "first call" and profiler is not None:
            profiler.enable()
        if args.stream:
            cm.generate_batch(prompts.tolist(), names, max_new_tokens=NEW, eos_token_id=(), progress_bar=False)
        else:
            cm.generate(prompts, adapter_names=names, max_new_tokens=NEW, eos_token_id=())
        torch.cuda.synchronize()
        if call == "first call" and profiler is not None:
            profiler.disable()
        phases[call] = time.perf_counter() - start
    phases["setup"] = phases["compile"] + phases["prepare"] + phases["first call"]
    print("setup: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    print("graph variants compiled (in order):")
    for g in spies.graphs:
        print(f"  {g['nodes']:5} nodes: Inductor {g['compile_s']:6.1f} s, first run {g['first_run_s'] or 0:5.1f} s;"
              f" {', '.join(g['caches']) or 'no cache'}")  # fmt: skip
    by_kind: dict = collections.defaultdict(lambda: [0, 0.0])
    for key, n in spies.count.items():
        by_kind[key[:2]][0] += n
        by_kind[key[:2]][1] += spies.seconds[key]
    for (what, kind), (n, s) in sorted(by_kind.items()):
        print(f"{what} ({kind}): {n} in {s:.1f} s")
    print("by kernel, the longest:")
    for key, s in spies.seconds.most_common(15):
        print(f"  {spies.count[key]:4} {s:6.2f} s  {key[0]} {key[2][:70]}")
    host = host_profile(profiler, args.cprofile) if profiler is not None else None
    result = {
        "meta": {**environment(), "model": args.model, "quant": args.quant, "max_batch_size": args.max_batch_size,
                 "adapters": ADAPTERS, "stream": args.stream},  # fmt: skip
        "phases_s": phases,
        "graphs": spies.graphs,
        "by_kind": {f"{w} ({k})": {"count": n, "seconds": s} for (w, k), (n, s) in by_kind.items()},
        "kernels": [{"what": k[0], "kind": k[1], "name": k[2], "count": spies.count[k], "seconds": s}
                    for k, s in spies.seconds.most_common()],  # fmt: skip
        "host_profile": host,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def host_profile(profiler: cProfile.Profile, path: str, count: int = 60) -> str:
    """Write ``profiler``'s statistics to ``path``; print and return the ``count`` functions
    with the most cumulative time (the profiler's own overhead included)."""
    profiler.dump_stats(path)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(count)
    text = out.getvalue()
    print(text)
    return text


if __name__ == "__main__":
    main()
