"""A stream of requests in bf16: fxlora's continuous batching against fxlora's own static
batches and transformers' continuous batching, each system in a process of its own, one after
the other in one call.

    python benchmarks/stream.py [--model llama|llama8b] [--requests 256] [--adapters 16]
                                [--systems stream,stream-wide,static,transformers,transformers-compiled] [--profile] [--out stream.json]

The workload: ``--requests`` requests (seeded), prompts of 32-512 random tokens, 16-512 new
tokens each, no end token (every request makes all its tokens), all arriving at once, in that
order; request ``i`` names adapter ``ad{i % adapters}`` (rank 16 on every linear), or none with
``--adapters 0``. Useful tokens/s is the tokens the requests asked for over the time from the
first request's submission to the last one's result, after a warm-up (for the stream, the same
workload once, so every prefill shape its admissions make is compiled and captured; for static
batches, the same batches with two new tokens). Time to first token counts from
submission (every request is submitted at the start, so it includes the wait for a row); time
per output token is a request's (finish - first token) / (tokens - 1).

Systems: ``stream``: ``cm.generate_batch`` with ``max_batch_size=128`` and a paged KV cache of the
bytes a static cache of 128 rows of ``max_len`` takes; ``stream-wide``: the same bytes, up to 256
rows; ``static``: ``cm.generate`` over batches of 128 in arrival order, each left-padded and run
until its longest request's last token; ``transformers`` / ``transformers-compiled``: the base
model's ``continuous_batching_context_manager`` (defaults, and ``default_compile_level=2``),
``add_request`` per request with its own ``max_new_tokens`` (no adapters: transformers has none
per request).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import logging
import pstats
import subprocess
import sys
import time

import torch
import transformers

PROMPTS, NEW_TOKENS, MAX_LEN, ROWS = (32, 512), (16, 512), 1024, 128


def workload(requests: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(PROMPTS[0], PROMPTS[1] + 1, (requests,), generator=gen).tolist()
    news = torch.randint(NEW_TOKENS[0], NEW_TOKENS[1] + 1, (requests,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    return prompts, news


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(seconds: float, news: list[int], ttft: list[float] | None, tpot: list[float] | None) -> dict:
    out = {"seconds": seconds, "useful_tokens": sum(news), "useful_tok_s": sum(news) / seconds}
    if ttft:
        out |= {"ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99)}
    if tpot:
        out |= {"tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99)}
    return out


def run_system(system: str, model_name: str, requests: int, count: int, profile: bool = False) -> dict:
    from decode import make_adapters, spec

    from fxlora.testing.models import fill_zero_weights

    torch.manual_seed(0)
    sp = spec(model_name)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(sp.config, dtype=torch.bfloat16).eval()
    fill_zero_weights(model, 0.02)
    prompts, news = workload(requests, sp.config.vocab_size)
    names = [f"ad{i % count}" if count else None for i in range(requests)]
    result: dict = {"system": system, "requests": requests, "adapters": count}
    start = time.perf_counter()
    if system.startswith("stream") or system == "static":
        import fxlora

        adapters = make_adapters(sp, count) if count else {}
        cm = fxlora.compile(model, adapters, max_loras=max(count, 1), max_rank=16, max_batch_size=ROWS, max_len=MAX_LEN)
        if system == "static":
            result |= run_static(cm, prompts, news, names)
        else:
            rows = 2 * ROWS if system == "stream-wide" else ROWS
            static_bytes = ROWS * MAX_LEN * _token_bytes(model)
            options = dict(max_batch_size=rows, max_len=MAX_LEN, kv_cache_memory=static_bytes)
            cm._requests(options, None)  # the engine: paged cache, decode graphs traced and captured
            result["setup_s"] = time.perf_counter() - start
            # the whole workload once: every prefill shape its admissions make is compiled and captured
            cm.generate_batch(prompts, names, max_new_tokens=news, eos_token_id=(), progress_bar=False)
            result["warm_up_s"] = time.perf_counter() - start - result["setup_s"]
            torch.cuda.synchronize()
            timeline = Timeline(cm._engine[1])
            profiler = cProfile.Profile() if profile else None
            begin = time.perf_counter()
            with profiler or contextlib.nullcontext():
                outs = cm.generate_batch(prompts, names, max_new_tokens=news, eos_token_id=(), progress_bar=False)
                torch.cuda.synchronize()
            seconds = time.perf_counter() - begin
            if profiler is not None:  # the host's time by Python function, on stderr
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
            result["breakdown"] = timeline.report(seconds)
            assert all(len(o.generated_tokens) == n for o, n in zip(outs, news)), "a request made fewer tokens than asked"
            ttft = [o.first_token_time - begin for o in outs]
            tpot = [(o.finished_time - o.first_token_time) / (len(o.generated_tokens) - 1) for o in outs if len(o.generated_tokens) > 1]
            result |= summary(seconds, news, ttft, tpot)
            runner = cm._engine[1].runner
            result |= {
                "kv_cache_MiB": runner.cache.nbytes / 2**20, "static_kv_MiB": static_bytes / 2**20, "max_rows": rows,
                "blocks": runner.cache.allocator.num_blocks, "graph_pool_MiB": runner.graphs.pool_bytes / 2**20,
            }  # fmt: skip
    else:
        result |= run_transformers(model, prompts, news, compiled=system == "transformers-compiled")
        result["setup_s"] = result.pop("warm_up_s")
    result["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
    return result


class Timeline:
    """Where a stream's time goes: the device time of its decode windows and of its prefills
    (CUDA events, read once at the end), the host time of its turns, and what they held."""

    def __init__(self, engine) -> None:
        self.windows, self.prefills, self.turns = [], [], []
        self.kinds: list[tuple[bool, int, int]] = []  # per prefill: replayed from a graph, prompt tokens, padded tokens
        self.steps = self.row_steps = self.prefill_tokens = self.prefill_rows = 0
        runner = engine.runner
        decode, prefill, step = runner.decode, runner._prefill_group, engine.step

        def timed(events, fn, *args):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            end.record()
            events.append((start, end))
            return out

        def on_decode(rows, steps, *args):
            self.steps, self.row_steps = self.steps + steps, self.row_steps + rows * steps
            return timed(self.windows, decode, rows, steps, *args)

        def on_prefill(rows, prompts, *args):
            self.prefill_rows += len(rows)
            self.prefill_tokens += sum(map(len, prompts))
            longest, tokens = max(map(len, prompts)), sum(map(len, prompts))
            shape = runner._prefill_shape(len(rows), longest, tokens)
            padded = shape[0] * shape[1] if shape else len(rows) * -(-longest // 8) * 8
            self.kinds.append((shape is not None, tokens, padded))
            return timed(self.prefills, prefill, rows, prompts, *args)

        def on_step(*args, **kwargs):
            start = time.perf_counter()
            out = step(*args, **kwargs)
            self.turns.append(time.perf_counter() - start)
            return out

        runner.decode, runner._prefill_group, engine.step = on_decode, on_prefill, on_step

    def report(self, seconds: float) -> dict:
        ms = lambda events: sum(s.elapsed_time(e) for s, e in events)  # noqa: E731
        return {
            "decode_windows": len(self.windows), "decode_steps": self.steps, "mean_rows": self.row_steps / max(self.steps, 1),
            "decode_gpu_s": ms(self.windows) / 1e3, "decode_step_ms": ms(self.windows) / max(self.steps, 1),
            "prefills": len(self.prefills), "prefill_rows": self.prefill_rows, "prefill_tokens": self.prefill_tokens,
            "prefill_gpu_s": ms(self.prefills) / 1e3, "turns": len(self.turns), "host_turn_s": sum(self.turns),
            "other_s": seconds - (ms(self.windows) + ms(self.prefills)) / 1e3,
            "prefills_graph": self._prefills(ms, True), "prefills_eager": self._prefills(ms, False),
        }  # fmt: skip

    def _prefills(self, ms, graph: bool) -> dict:
        """The prefills replayed from a graph (or run eagerly): count, prompt and padded tokens, device time."""
        picked = [(kind, event) for kind, event in zip(self.kinds, self.prefills) if kind[0] == graph]
        return {"count": len(picked), "tokens": sum(k[1] for k, _ in picked), "padded_tokens": sum(k[2] for k, _ in picked),
                "gpu_s": ms([e for _, e in picked]) / 1e3}  # fmt: skip


def _token_bytes(model: torch.nn.Module) -> int:
    from fxlora.runtime.kv_cache import probe_shapes

    shapes = probe_shapes(model, torch.device("cuda"))
    return sum((kh * kd + vh * vd) * 2 for (kh, kd), (vh, vd) in shapes)


def run_static(cm, prompts: list[list[int]], news: list[int], names: list) -> dict:
    """Batches of ``ROWS`` in arrival order, each until its longest request's last token."""
    batches = [range(i, min(i + ROWS, len(prompts))) for i in range(0, len(prompts), ROWS)]

    def run(max_new: list[int]) -> list[float]:
        done = []
        for batch in batches:
            cm.generate([prompts[i] for i in batch], adapter_names=[names[i] for i in batch],
                        max_new_tokens=max(max_new[i] for i in batch), eos_token_id=(), pad_token_id=0)  # fmt: skip
            torch.cuda.synchronize()
            done.append(time.perf_counter())
        return done

    start = time.perf_counter()
    run([2] * len(prompts))  # compile, capture, and every prefill shape
    setup = time.perf_counter() - start
    begin = time.perf_counter()
    done = run(news)
    seconds = done[-1] - begin
    # a request's tokens are known when its batch returns: every token of a batch at its end
    ttft = [done[b] - begin for b, batch in enumerate(batches) for _ in batch]
    return {"setup_s": setup} | summary(seconds, news, ttft, None)


def run_transformers(model, prompts: list[list[int]], news: list[int], compiled: bool) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=max(news), do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(default_compile_level=2) if compiled else ContinuousBatchingConfig()
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb) as manager:
        warm = [manager.add_request(p, max_new_tokens=2, eos_token_id=-1) for p in prompts[:16]]
        for _ in warm:
            manager.get_result(timeout=600)
        warm_up = time.perf_counter() - start
        begin = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, news)]
        got = {}
        while len(got) < len(ids):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers' continuous batching returned no result in 600 s")
            got[out.request_id] = (out, time.perf_counter())
        seconds = time.perf_counter() - begin
    made = [len(got[i][0].generated_tokens) for i in ids]
    return {"warm_up_s": warm_up, "made_as_asked": made == news} | summary(seconds, news, [got[i][1] - begin for i in ids], None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("llama", "llama8b"), default="llama")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--systems", default="stream,stream-wide,static,transformers,transformers-compiled")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one system may take")
    parser.add_argument("--out", default="stream.json")
    parser.add_argument("--profile", action="store_true", help="the stream's host time by Python function (cProfile), on stderr")
    parser.add_argument("--system", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.system} %(name)s: %(message)s", stream=sys.stderr)
        print(json.dumps(run_system(args.system, args.model, args.requests, args.adapters, args.profile)))
        return
    systems = {}
    for system in args.systems.split(","):
        cmd = [sys.executable, __file__, "--model", args.model, "--requests", str(args.requests), "--adapters",
               str(args.adapters), "--system", system, *(["--profile"] if args.profile else [])]  # fmt: skip
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
            lines = proc.stdout.strip().splitlines()
            systems[system] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": f"exit status {proc.returncode}"}
        except subprocess.TimeoutExpired:
            systems[system] = {"error": f"over {args.timeout} s"}
        print(system, json.dumps(systems[system]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"systems": systems}, f, indent=1)
    static = systems.get("static", {}).get("useful_tok_s")
    print(f"{'system':>22} {'useful tok/s':>13} {'vs static':>10} {'TTFT p50/p99 s':>16} {'TPOT p50 ms':>12} {'setup s':>8}")
    for system, r in systems.items():
        if "useful_tok_s" not in r:
            print(f"{system:>22} {r.get('error')}")
            continue
        ratio = f"{r['useful_tok_s'] / static:10.2f}" if static else f"{'-':>10}"
        ttft = f"{r.get('ttft_p50_s', 0):.2f} / {r.get('ttft_p99_s', 0):.2f}"
        print(f"{system:>22} {r['useful_tok_s']:13.0f} {ratio} {ttft:>16} {r.get('tpot_p50_ms', 0):12.1f} {r.get('setup_s', 0):8.1f}")
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"), "model": args.model, "requests": args.requests, "adapters": args.adapters,
        "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "max_len": MAX_LEN, "rows": ROWS,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "systems": systems}, f, indent=1)


if __name__ == "__main__":
    main()
