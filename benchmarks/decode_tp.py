"""Decode steps of a tensor-parallel model: fxlora's ``nolora`` and ``lora`` graphs at tp=2
(two NCCL ranks, the model sharded with transformers' ``tp_plan="auto"``) against tp=1 on
the same machine, in bf16.

    python benchmarks/decode_tp.py [--model llama|qwen3_moe] [--out results.json] [--quick]

The launcher saves the model (random weights) once, then runs the same worker under
``torch.distributed.run`` with one process and with two, each in a process of its own. Every
run compiles with 16 adapters of rank 16 (``decode.py``'s shapes and seeds: the same factors
on every rank and in every run), captures the decode graphs of its batch buckets and times a
step at context 512 as ``decode.py`` does: every row attends to 512 cached positions. Times
are the mean of 200 back-to-back replays in microseconds, the slower rank's; the ranks replay
the same count, since their collectives meet. ``lora`` rows cycle over 16 adapters.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import transformers
from decode import CONTEXT, MAX_LEN, RANK, at_context, environment, make_adapters, spec
from transformers.distributed import DistributedConfig

import fxlora
from fxlora.testing.models import fill_zero_weights

ADAPTERS, REPLAYS = 16, 200
# NVLink multicast off: it can take a shared host's GPUs out of service
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def replay_us(graph: torch.cuda.CUDAGraph, group: bool) -> float:
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    if group:
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    t = torch.tensor(start.elapsed_time(end) * 1e3 / REPLAYS, device="cuda")
    if group:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(directory: str, model_name: str, batches: list[int], out: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    kw = {}
    if world > 1:
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
        kw["distributed_config"] = DistributedConfig(tp_plan="auto")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **kw).eval()
    if world == 1:
        model.cuda()
    sp = spec(model_name)
    adapters = make_adapters(sp, ADAPTERS)
    torch.cuda.synchronize()
    start = time.perf_counter()
    cm = fxlora.compile(
        model, adapters, max_loras=ADAPTERS, max_rank=RANK, max_batch_size=max(batches), max_len=MAX_LEN,
        batch_buckets=batches,
    )  # fmt: skip
    with torch.no_grad():
        rt = cm.prepare()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - start
    rows = []
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for batch in batches:
            rt.ids.copy_(torch.randint(3, model.config.vocab_size, rt.ids.shape, generator=gen))
            at_context(rt)
            rt.slot_ids.fill_(-1)
            names = [f"ad{i % ADAPTERS}" for i in range(batch)]
            rt.slot_ids[:batch].copy_(torch.tensor(cm.pool.slot_ids(names), dtype=torch.int32))
            nolora = replay_us(rt.graphs.graphs[("nolora", batch)][0], world > 1)
            lora = replay_us(rt.graphs.graphs[("lora", batch)][0], world > 1)
            rows.append({"batch": batch, "nolora_us": nolora, "lora_us": lora, "lora/nolora": lora / nolora})
    if int(os.environ["RANK"]) == 0:
        meta = {"tp": world, "setup_seconds": setup_s, "graphs": len(rt.graphs.graphs), "fallback": rt.graphs.fallback_reason}
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if world > 1:
        del rt, cm  # the captured graphs hold NCCL work: they go before the communicators do
        gc.collect()
        torch.cuda.synchronize()
        dist.barrier()
        dist.destroy_process_group()


def launch(args: argparse.Namespace, batches: list[int]) -> None:
    sp = spec(args.model)
    with tempfile.TemporaryDirectory(prefix="fxlora-tp-bench-") as directory:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(sp.config, dtype=torch.bfloat16)
        fill_zero_weights(model, 0.02)
        model.save_pretrained(directory)
        del model
        runs = {}
        for tp in (1, 2):
            out = os.path.join(directory, f"tp{tp}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", __file__,
                   "--worker", directory, "--model", args.model, "--batches", ",".join(map(str, batches)), "--out", out]  # fmt: skip
            subprocess.run(cmd, check=True, env={**os.environ, **NCCL_ENV}, timeout=400)
            runs[tp] = json.load(open(out))
    print(f"{'batch':>5} {'tp':>3} {'nolora us':>10} {'lora us':>9} {'lora/nolora':>11} {'lora tok/s':>10} {'tp2/tp1 tok/s':>13}")
    table = []
    for i, batch in enumerate(batches):
        one = runs[1]["rows"][i]["lora_us"]
        for tp in (1, 2):
            r = runs[tp]["rows"][i]
            scaling = one / r["lora_us"]
            table.append({**r, "tp": tp, "lora_tokens_per_s": batch / r["lora_us"] * 1e6, "lora_speedup_vs_tp1": scaling})
            print(f"{batch:>5} {tp:>3} {r['nolora_us']:10.0f} {r['lora_us']:9.0f} {r['lora/nolora']:11.3f} "
                  f"{batch / r['lora_us'] * 1e6:10.0f} {scaling:13.2f}")  # fmt: skip
    meta = {
        **environment(),
        "gpus": torch.cuda.device_count(),
        "model": args.model,
        "adapters": ADAPTERS,
        "context": CONTEXT,
        "runs": {tp: r["meta"] for tp, r in runs.items()},
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": table}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_tp.json")
    parser.add_argument("--model", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, [int(b) for b in args.batches.split(",")], args.out)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # only teardown is left, which has been seen to hang after NCCL graph captures
    else:
        launch(args, [1, 32] if args.quick else [1, 32, 128])


if __name__ == "__main__":
    main()
