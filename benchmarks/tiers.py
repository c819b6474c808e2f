"""Adapters in a host tier behind the GPU slots, in bf16: the request stream with 256 adapters over 16
or 64 GPU slots against all 256 resident, one adapter's copy into a slot, decode steps with copies in
flight, and a decode step's cost against the pool's slot count; a process per slot count, one after
the other in one call.

    cd benchmarks && python tiers.py [--slots 256,16,64] [--adapters 256] [--requests 256] [--max-new 256]
                                     [--dists zipf,uniform] [--prefill-graph-tokens 0] [--timeout 300]
                                     [--budget 450] [--out tiers.json]

Model: decode.py's Llama-shaped 1B (random weights) in bf16; ``--adapters`` rank-16 adapters on every
linear, all given to ``fxlora.compile(..., max_loras=slots)``: those without a GPU slot wait in the
host tier (pinned host memory) until a request names them.

The stream (stream.py's method): ``--requests`` seeded requests, prompts of 32-512 random tokens,
16 to ``--max-new`` new tokens (256 by default where stream.py has 512, to keep the call short;
``--max-new 512`` is stream.py's workload), no end token, all submitted at once to
``cm.generate_batch`` (128 rows, a paged KV cache of 128 x 1024 tokens). Request ``i`` names its
adapter Zipf-like (``p(rank k) ~ k^-1.1``, ranks mapped to adapters by a seeded permutation) or
uniformly: the same draws in every process. Prefills run eagerly by default
(``--prefill-graph-tokens 0``: no per-shape captures, to keep the call short; an eager prefill costs
the host more, and a tiered stream admits in more turns, ``admitting_turns``: 4096, stream.py's
setting, is closer to serving). Each distribution runs once as a warm-up (compiles; it also leaves
the slots as a stream leaves them), then timed: useful tok/s, and TTFT from submission split into
requests whose adapter was copied in from the host when they were admitted (not in a slot as the
admitting turn began, or paged in during it; recorded by wrapping the scheduler's ``admit`` and the
pool's ``acquire`` in this process) and the others; the ratio is useful tok/s over that of the
process with every adapter resident, same distribution.

Decode steps (before the stream): rows 0..n-1 of the stream's runner set up as the engine places
admitted rows (no prefill: the cache holds whatever its blocks hold), at 512 tokens of context, their
``(lora, bucket)`` graph replayed in windows of 8 as the engine does; 64 steps timed by CUDA events,
median of 3. Cost against slots: batch 1, 32, 128 with no adapter, rows over 16 adapters (fewer with
fewer rows), and rows over as many adapters as the pool has slots (at most one a row).

Copies (processes with a host tier): ``pool.acquire([name], stream=copy_stream)`` of an adapter in no
slot, as the scheduler pages one in, released at once with its fence on the copy stream (so the next
copy into that slot waits for no decode step). One copy: its device time on the copy stream (CUDA
events) with its ~800 operations queued behind a sleep (twice the longest host time of a copy) first
("queued": the share of copies whose every operation was queued before the first ran), the span of
copies issued back to back by the host (the host's launches pace them), the host time of the call, and
the floor: one pinned-to-device copy of as many bytes. In flight: 128 rows over 8 adapters, 64 steps
timed alone, then again while the host pages adapters in, one after the other, until the steps end;
the ratio of step times (target <= 1.05).

A process prints its result as one JSON line after each stage, so one cut off by ``--timeout`` keeps
what it printed; ``--budget`` (seconds) bounds the whole call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import subprocess
import sys
import time

import torch
import transformers

PROMPTS, NEW_MIN, MAX_LEN, ROWS = (32, 512), 16, 1024, 128
ZIPF_S, CONTEXT, STEPS, REPEATS = 1.1, 512, 64, 3
BATCHES, ROW_ADAPTERS, COPIES = (1, 32, 128), 8, 16


def workload(requests: int, vocab: int, max_new: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """stream.py's workload with 16 to ``max_new`` new tokens (its very draws at 512)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(PROMPTS[0], PROMPTS[1] + 1, (requests,), generator=gen).tolist()
    news = torch.randint(NEW_MIN, max_new + 1, (requests,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    return prompts, news


def adapter_names(requests: int, count: int, dist: str, seed: int = 0) -> list[str]:
    """Each request's adapter ``ad{k}``: ``zipf`` (rank ``r`` drawn with weight ``r^-ZIPF_S``, ranks
    given to adapters by a seeded permutation) or ``uniform``."""
    gen = torch.Generator().manual_seed(seed + 1)
    if dist == "uniform":
        picks = torch.randint(0, count, (requests,), generator=gen)
    elif dist == "zipf":
        weights = torch.arange(1, count + 1, dtype=torch.float64).pow(-ZIPF_S)
        ranks = torch.multinomial(weights, requests, replacement=True, generator=gen)
        picks = torch.randperm(count, generator=gen)[ranks]
    else:
        raise ValueError(f"unknown distribution {dist!r}: zipf or uniform")
    return [f"ad{k}" for k in picks.tolist()]


def event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def run_slots(slots: int, args: argparse.Namespace) -> None:
    """Everything for one slot count; prints the result so far as a JSON line after each stage."""
    from decode import make_adapters, spec

    import fxlora
    from fxlora.testing.models import fill_zero_weights

    result: dict = {"slots": slots, "adapters": args.adapters}

    def emit(stage: str) -> None:
        result["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
        print(json.dumps(result), flush=True)
        logging.getLogger("tiers").info("%s done at %.1f s", stage, time.perf_counter() - start)

    torch.manual_seed(0)
    sp = spec("llama")
    start = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(sp.config, dtype=torch.bfloat16).eval()
    fill_zero_weights(model, 0.02)
    adapters = make_adapters(sp, args.adapters)
    cm = fxlora.compile(model, adapters, max_loras=slots, max_rank=16, max_batch_size=ROWS, max_len=MAX_LEN,
                        prefill_graph_tokens=args.prefill_graph_tokens)  # fmt: skip
    del adapters  # the pool holds them: in slots, and pinned on the host
    torch.cuda.empty_cache()
    result["load_s"] = time.perf_counter() - start
    cm._requests({}, None)  # the stream's engine: paged cache, decode graphs traced and captured
    result["setup_s"] = time.perf_counter() - start
    engine, pool = cm._engine[1], cm.pool
    result |= {"slot_MiB": pool.nbytes / 2**20, "host_tier_MiB": pool.host_bytes / 2**20}
    emit("setup")
    names = list(pool.adapters)
    result["decode_ms"] = decode_costs(engine.runner, pool, names)
    emit("decode steps")
    if slots < len(names):
        result["copies"] = copy_costs(engine.runner, pool, names)
        emit("copies")
    admissions = Admissions(engine)
    prompts, news = workload(args.requests, sp.config.vocab_size, args.max_new)
    for dist in args.dists.split(","):
        chosen = adapter_names(args.requests, args.adapters, dist)
        begin = time.perf_counter()
        cm.generate_batch(prompts, chosen, max_new_tokens=news, eos_token_id=(), progress_bar=False)
        result[dist] = {"warm_up_s": time.perf_counter() - begin} | stream_pass(cm, admissions, prompts, news, chosen)
        emit(f"stream {dist}")


class Admissions:
    """Per request id: whether its adapter was copied in from the host tier when it was admitted
    (not in a GPU slot as the admitting turn began, or paged in during that turn); and how many
    turns admitted requests (each prefills them)."""

    def __init__(self, engine) -> None:
        self.copied: dict[str, bool] = {}
        self.turns = 0
        self._paged: set[str] = set()
        scheduler, pool = engine.scheduler, engine.scheduler.pool
        admit, acquire = scheduler.admit, pool.acquire

        def on_acquire(names, *args, **kwargs):
            misses = pool.misses
            out = acquire(names, *args, **kwargs)
            if pool.misses > misses:
                self._paged.update(n for n in names if n is not None)
            return out

        def on_admit(*args, **kwargs):
            resident, self._paged = set(pool.slot_of), set()
            admitted, failed = admit(*args, **kwargs)
            self.turns += bool(admitted)
            for seq in admitted:
                name = seq.adapter_name
                self.copied[seq.request_id] = name is not None and (name not in resident or name in self._paged)
            return admitted, failed

        scheduler.admit, pool.acquire = on_admit, on_acquire


def stream_pass(cm, admissions: Admissions, prompts: list[list[int]], news: list[int], names: list[str]) -> dict:
    from stream import percentile, summary

    pool = cm.pool
    torch.cuda.synchronize()
    hits, misses, turns = pool.hits, pool.misses, admissions.turns
    begin = time.perf_counter()
    outs = cm.generate_batch(prompts, names, max_new_tokens=news, eos_token_id=(), progress_bar=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    assert all(len(o.generated_tokens) == n for o, n in zip(outs, news)), "a request made fewer tokens than asked"
    ttft = [o.first_token_time - begin for o in outs]
    made = [(o, len(o.generated_tokens)) for o in outs]
    tpot = [(o.finished_time - o.first_token_time) / (n - 1) for o, n in made if n > 1]
    copied = [admissions.copied[o.request_id] for o in outs]
    out = summary(seconds, news, ttft, tpot) | {
        "adapters_named": len(set(names)), "page_ins": pool.misses - misses, "hits": pool.hits - hits,
        "copied_requests": sum(copied), "admitting_turns": admissions.turns - turns,
    }  # fmt: skip
    for label, flag in (("copied", True), ("resident", False)):
        part = [t for t, c in zip(ttft, copied) if c == flag]
        if part:
            out |= {f"ttft_{label}_p50_s": percentile(part, 0.5), f"ttft_{label}_p99_s": percentile(part, 0.99)}
    return out


class SteadyBatch:
    """Rows ``0..n-1`` of the stream's runner decoding at ``CONTEXT`` tokens, row ``i`` on adapter
    ``names[i]`` (pinned while the batch lives), placed as the engine places admitted rows."""

    def __init__(self, runner, pool, names: list[str | None]) -> None:
        from fxlora.runtime.block_allocator import blocks_for
        from fxlora.runtime.sequence import Decoding

        self.runner, self.pool, self.n, self.lora = runner, pool, len(names), any(names)
        self.slots, _ = pool.acquire(names)
        allocator, per_row = runner.cache.allocator, blocks_for(CONTEXT + 2 * STEPS, runner.cache.block_size)
        allocator.promise(per_row * self.n)
        self.blocks = [[allocator.take() for _ in range(per_row)] for _ in range(self.n)]
        runner.place(list(range(self.n)), [Decoding(max_new_tokens=1 << 30)] * self.n, self.slots, self.blocks)

    def steps(self, count: int) -> None:
        window = self.runner.window
        for done in range(0, count, window):
            self.runner.decode(self.n, min(window, count - done), self.lora, False)

    def timed(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Events around ``STEPS`` steps from ``CONTEXT`` tokens, after a window of warm-up."""
        r, n = self.runner, self.n
        r.lengths[:n], r.count[:n], r.next_ids[:n], r.active[:n] = CONTEXT, 1, 1, True
        self.steps(r.window)
        start, end = event(), event()
        start.record()
        self.steps(STEPS)
        end.record()
        return start, end

    def step_ms(self) -> float:
        times = []
        for _ in range(REPEATS):
            start, end = self.timed()
            end.synchronize()
            times.append(start.elapsed_time(end) / STEPS)
        return statistics.median(times)

    def close(self) -> None:
        self.runner.stop(list(range(self.n)))
        self.runner.cache.allocator.release([b for row in self.blocks for b in row], 0)
        self.pool.release(self.slots)


def decode_costs(runner, pool, names: list[str]) -> dict:
    """ms a decode step takes at each batch: no adapter; rows over 16 adapters; rows over as many as the slots."""
    out = {}
    for n in BATCHES:
        spread = min(n, pool.max_loras)
        rows = {"nolora": [None] * n, "lora_16": [names[i % min(n, 16)] for i in range(n)],
                "lora_spread": [names[i % spread] for i in range(n)]}  # fmt: skip
        out[str(n)] = {"spread_adapters": spread}
        for label, row_names in rows.items():
            batch = SteadyBatch(runner, pool, row_names)
            try:
                out[str(n)][label] = batch.step_ms()
            finally:
                batch.close()
    return out


def copy_costs(runner, pool, names: list[str]) -> dict:
    """One adapter's copy from the host tier into a slot, and decode steps with copies in flight."""
    side = torch.cuda.Stream()
    others = itertools.cycle(names[ROW_ADAPTERS:])

    def page_in() -> None:
        slots, _ = pool.acquire([next(n for n in others if n not in pool.slot_of)], stream=side)
        with torch.cuda.stream(side):  # its fence on the copy stream: no later copy into the slot waits for decode
            pool.release(slots)

    misses = pool.misses
    spans, host = [], []
    for _ in range(COPIES):  # back to back, as the host issues them
        start, end = event(), event()
        began = time.perf_counter()
        start.record(side)
        page_in()
        end.record(side)
        host.append(time.perf_counter() - began)
        spans.append((start, end))
    torch.cuda.synchronize()
    start, end = event(), event()
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    sleep = int(1e7 / start.elapsed_time(end) * (2e3 * max(host) + 5))  # cycles: twice the longest issue, in ms
    queued, device = [], []
    for _ in range(COPIES):  # each behind a sleep on the copy stream, so that its operations run back to back
        side.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep)
        start, end = event(), event()
        start.record(side)
        page_in()
        end.record(side)
        queued.append(not start.query())
        device.append((start, end))
    torch.cuda.synchronize()
    assert pool.misses - misses == 2 * COPIES, "a copy found its adapter in a slot"
    nbytes = sum(f.a.nbytes + f.b.nbytes for f in pool.adapters[names[-1]].modules.values())
    out = {
        "adapter_MiB": nbytes / 2**20, "copy_ms": statistics.mean(s.elapsed_time(e) for s, e in device),
        "queued": sum(queued) / COPIES, "copy_span_ms": statistics.mean(s.elapsed_time(e) for s, e in spans),
        "copy_host_ms": 1e3 * statistics.mean(host), "floor_ms": copy_floor(nbytes, side),
    }  # fmt: skip
    out["copy_GBps"] = nbytes / out["copy_ms"] / 1e6
    batch = SteadyBatch(runner, pool, [names[i % ROW_ADAPTERS] for i in range(ROWS)])
    try:
        alone, busy, counts, during = [], [], [], []
        for _ in range(REPEATS):
            start, end = batch.timed()
            end.synchronize()
            alone.append(start.elapsed_time(end) / STEPS)
            start, end = batch.timed()
            first, last, copies = event(), event(), 0
            first.record(side)
            while not end.query():  # the steps run: page adapters in, one after the other
                page_in()
                copies += 1
            last.record(side)
            torch.cuda.synchronize()
            busy.append(start.elapsed_time(end) / STEPS)
            counts.append(copies)
            during.append(first.elapsed_time(last) / max(copies, 1))
    finally:
        batch.close()
    return out | {
        "rows": ROWS, "row_adapters": ROW_ADAPTERS, "step_ms_alone": statistics.median(alone),
        "step_ms_copying": statistics.median(busy), "ratio": statistics.median(busy) / statistics.median(alone),
        "copies_in_window": statistics.median(counts), "copy_span_ms_during_decode": statistics.median(during),
    }  # fmt: skip


def copy_floor(nbytes: int, stream: torch.cuda.Stream) -> float:
    """ms of one pinned-to-device copy of ``nbytes`` on ``stream`` (median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):
        start, end = event(), event()
        with torch.cuda.stream(stream):
            start.record()
            device.copy_(host, non_blocking=True)
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_child(cmd: list[str], timeout: float) -> dict:
    """The child's last JSON line, with an ``error`` if it failed or was cut off."""
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
        out, error = proc.stdout, f"exit status {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired as e:
        out, error = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "", f"over {timeout:.0f} s"
    for line in reversed(out.splitlines()):
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict):
            return result | ({"error": error} if error else {})
    return {"error": error or "no result"}


def table(systems: dict, adapters: int, dists: list[str]) -> None:
    resident = next((r for r in systems.values() if r.get("slots", 0) >= adapters), {})

    def p50_99(r: dict, key: str) -> str:
        return f"{r.get(f'{key}_p50_s', float('nan')):.2f} / {r.get(f'{key}_p99_s', float('nan')):.2f}"

    print(f"\n{'slots':>5} {'dist':>8} {'useful tok/s':>12} {'/ resident':>10} {'page-ins':>8} {'copied':>6} "
          f"{'TTFT p50/p99 s: all':>20} {'copied':>12} {'resident':>12}")  # fmt: skip
    for slots, r in systems.items():
        if "error" in r:
            print(f"{slots:>5} {r['error']}")
        for dist in dists:
            d, base = r.get(dist), resident.get(dist, {}).get("useful_tok_s")
            if d:
                ratio = f"{d['useful_tok_s'] / base:10.2f}" if base else f"{'-':>10}"
                print(f"{slots:>5} {dist:>8} {d['useful_tok_s']:12.0f} {ratio} {d['page_ins']:8d} "
                      f"{d['copied_requests']:6d} {p50_99(d, 'ttft'):>20} {p50_99(d, 'ttft_copied'):>12} "
                      f"{p50_99(d, 'ttft_resident'):>12}")  # fmt: skip
    print(f"\n{'slots':>5} {'copy ms':>8} {'queued':>6} {'span ms':>8} {'host ms':>8} {'floor ms':>8} {'GB/s':>6} "
          f"{'step ms alone':>13} {'copying':>8} {'ratio':>6} {'copies':>6}")  # fmt: skip
    for slots, r in systems.items():
        if c := r.get("copies"):
            print(f"{slots:>5} {c['copy_ms']:8.2f} {c['queued']:6.2f} {c['copy_span_ms']:8.2f} "
                  f"{c['copy_host_ms']:8.2f} {c['floor_ms']:8.2f} {c['copy_GBps']:6.1f} {c['step_ms_alone']:13.3f} "
                  f"{c['step_ms_copying']:8.3f} {c['ratio']:6.3f} {c['copies_in_window']:6.0f}")  # fmt: skip
    print(f"\n{'slots':>5} {'batch':>5} {'nolora ms':>9} {'lora, 16 adapters':>17} {'lora, spread':>12} "
          f"{'(adapters)':>10}")  # fmt: skip
    for slots, r in systems.items():
        for batch, d in r.get("decode_ms", {}).items():
            print(f"{slots:>5} {batch:>5} {d['nolora']:9.3f} {d['lora_16']:17.3f} {d['lora_spread']:12.3f} "
                  f"{d['spread_adapters']:10d}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", default="256,16,64", help="GPU slot counts, a process each, in this order")
    parser.add_argument("--adapters", type=int, default=256)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-new", type=int, default=256, help="new tokens of a request: 16 to this")
    parser.add_argument("--dists", default="zipf,uniform")
    parser.add_argument("--prefill-graph-tokens", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=300, help="seconds one process may take")
    parser.add_argument("--budget", type=int, default=450, help="seconds the whole call may take")
    parser.add_argument("--out", default="tiers.json")
    parser.add_argument("--system", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system is not None:
        form = f"%(asctime)s slots={args.system} %(name)s: %(message)s"
        logging.basicConfig(level=logging.INFO, format=form, stream=sys.stderr)
        logging.getLogger("fxlora.adapters.pool").setLevel(logging.WARNING)  # not a line per load and eviction
        run_slots(args.system, args)
        return
    deadline, systems = time.monotonic() + args.budget, {}
    meta = {
        "torch": torch.__version__, "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
        "model": "llama", "adapters": args.adapters, "rank": 16, "requests": args.requests, "prompts": PROMPTS,
        "new_tokens": (NEW_MIN, args.max_new), "zipf_s": ZIPF_S, "max_len": MAX_LEN, "rows": ROWS,
        "prefill_graph_tokens": args.prefill_graph_tokens, "context": CONTEXT, "steps": STEPS, "repeats": REPEATS,
    }  # fmt: skip
    for slots in args.slots.split(","):
        left = deadline - time.monotonic()
        if left < 60:
            systems[slots] = {"error": f"not run: {left:.0f} s of the {args.budget} s budget left"}
        else:
            began = time.monotonic()
            cmd = [sys.executable, __file__, *sys.argv[1:], "--system", slots]
            systems[slots] = run_child(cmd, min(args.timeout, left))
            systems[slots]["wall_s"] = time.monotonic() - began
        print(slots, json.dumps(systems[slots]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "systems": systems}, f, indent=1)
    table(systems, args.adapters, args.dists.split(","))
    meta["gpu"] = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "systems": systems}, f, indent=1)


if __name__ == "__main__":
    main()
