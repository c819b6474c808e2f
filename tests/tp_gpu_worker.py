"""One rank of the two-GPU tensor-parallel tests (``tests/test_gpu_tensor_parallel.py``):
NCCL, bf16, the model in ``DIR/model`` sharded with transformers' own plan. With one rank it
is the single-GPU run of the same script, the expectation.

The script (``DIR/script.json``): a mixed prefill over every adapter, decode steps replayed
from the captured graphs of both variants under changing adapter assignments (with CUDA's
sync debug mode set to error: a replayed step never waits on the host), a greedy
``generate`` and the same with an end token under that mode, the request stream
(``generate_batch`` and ``serve`` with requests added on rank 0 only, more requests than rows,
mixed adapters and none), and, where ``DIR/forced.safetensors`` holds another run's tokens,
this run's logits over them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_gpu_worker.py DIR RESULTS
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import fxlora


def load_model(directory: str, world: int) -> torch.nn.Module:
    if world == 1:
        return AutoModelForCausalLM.from_pretrained(f"{directory}/model", dtype=torch.bfloat16).cuda().eval()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    config = DistributedConfig(tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(f"{directory}/model", distributed_config=config, dtype=torch.bfloat16).eval()


def decode_state(rt, gen: torch.Generator, vocab: int) -> None:
    """Random tokens, positions, visible columns and write column: the same on every rank."""
    rows, cols = rt.max_batch_size, rt.max_len
    rt.ids.copy_(torch.randint(3, vocab, (rows, 1), generator=gen))
    rt.positions.copy_(torch.randint(0, cols - 1, (rows, 1), generator=gen))
    visible = torch.rand(rows, 1, 1, cols, generator=gen) < 0.7
    visible[..., 0] = True
    rt.mask.copy_(torch.where(visible, 0.0, torch.finfo(rt.dtype).min))
    rt.column.fill_(int(torch.randint(0, cols, (), generator=gen)))


START = time.perf_counter()


def stage(what: str) -> None:
    print(f"[rank {os.environ['RANK']} {time.perf_counter() - START:6.1f} s] {what}", file=sys.stderr, flush=True)


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows])


def forced_stream(cm, requests: list, tokens: torch.Tensor) -> torch.Tensor:
    """This run's logits at the positions that chose each request's ``tokens`` (its prompt,
    then those tokens, teacher-forced with its adapter), zero-padded to ``tokens``' width."""
    out = torch.zeros(*tokens.shape, cm.config.vocab_size)
    for i, (prompt, name, _) in enumerate(requests):
        new = [t for t in tokens[i].tolist() if t >= 0]
        ids = torch.tensor([prompt + new], device="cuda")
        logits = cm(input_ids=ids, adapter_names=[name]).logits[0, len(prompt) - 1 : -1]
        out[i, : len(new)] = logits.float().cpu()
    return out


def main(directory: str, results: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's launcher asks where a rank waits
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    script = json.load(open(f"{directory}/script.json"))
    ids = load_file(f"{directory}/inputs.safetensors")["ids"].cuda()
    model = load_model(directory, world)
    stage("loaded")
    cm = fxlora.compile(
        model,
        {name: f"{directory}/{name}" for name in script["adapters"]},
        max_loras=len(script["adapters"]),
        max_rank=16,
        max_batch_size=script["rows"],
        max_len=script["max_len"],
        batch_buckets=script["buckets"],
    )
    stage("compiled")
    vocab = model.config.vocab_size
    out, report = {}, {"world": world}
    with torch.no_grad():
        out["prefill"] = cm(input_ids=ids, adapter_names=script["prefill"]).logits.float()

        stage("prefill done")
        rt = cm.prepare()
        stage("decode graphs captured")
        report["graphs"] = sorted(f"{variant}-{rows}" for variant, rows in rt.graphs.graphs)
        report["fallback"] = rt.graphs.fallback_reason
        gen = torch.Generator().manual_seed(0)
        for step, names in enumerate(script["decode"]):
            decode_state(rt, gen, vocab)
            rt.slot_ids.fill_(-1)
            rt.slot_ids[: len(names)].copy_(torch.tensor(cm.pool.slot_ids(names), dtype=torch.int32))
            bucket = rt.bucket_for(len(names))
            for variant in ("lora", "nolora"):
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    logits = rt.graphs.run((variant, bucket), rt._decode)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                out[f"decode{step}-{variant}"] = logits[: len(names)].float()

        stage("replays done")
        new = script["max_new_tokens"]
        out["generated"] = cm.generate(ids, adapter_names=script["prefill"], max_new_tokens=new, eos_token_id=())
        eos = int(out["generated"][0, ids.shape[1] + new // 2])  # row 0 ends half-way, the others go on
        expected = cm.generate(ids, adapter_names=script["prefill"], max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out["ended"] = cm.generate(ids, adapter_names=script["prefill"], max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        report["ended_as_without_sync_checks"] = torch.equal(out["ended"], expected)
        report["generate_syncs"] = sum("synchronizing" in str(w.message) for w in caught)

        stage("generate done")
        requests = script["stream"]
        # the serving loop, with fewer rows than requests: they queue and join as rows free
        with cm.serve(max_batch_size=4, block_size=8, window=2) as manager:
            # rank 0's requests are every rank's: the other ranks' add_request returns None
            ids = [manager.add_request(p, f"s{i}", n, adapter_name=a, eos_token_id=()) for i, (p, a, n) in enumerate(requests)]
            report["served_ids"] = ids
            served = [manager.get_result(f"s{i}", timeout=240) for i in range(len(ids))]
        report["served_missing"] = [f"s{i}" for i, o in enumerate(served) if o is None]
        out["served"] = padded([o.generated_tokens if o is not None else [] for o in served])
        prompts, names, news = (list(x) for x in zip(*requests))
        outs = cm.generate_batch(prompts, names, max_new_tokens=news, eos_token_id=(), progress_bar=False)  # the same engine
        out["stream"] = padded([o.generated_tokens for o in outs])
        report["stream_errors"] = [o.error for o in outs if o.error]
        report["stream_graphs"] = sorted({key[0] for key in cm._engine[1].runner.graphs.graphs})
        stage("stream done")
        if os.path.exists(f"{directory}/forced.safetensors"):
            forced = load_file(f"{directory}/forced.safetensors")
            out["forced"] = cm(input_ids=forced["tokens"].cuda(), adapter_names=script["prefill"]).logits.float()
            out["forced_stream"] = forced_stream(cm, requests, forced["stream"])
            out["forced_served"] = forced_stream(cm, requests, forced["served"])
        report["explain"] = cm.explain()
    save_file({k: v.contiguous().cpu() for k, v in out.items()}, f"{results}/rank{rank}.safetensors")
    json.dump(report, open(f"{results}/rank{rank}.json", "w"))
    if world > 1:
        # a teardown that hangs is written down (the test reads it), with every thread's stack
        reached = ["started"]
        watchdog = threading.Timer(60, lambda: (open(f"{results}/rank{rank}.teardown", "w").write(reached[-1]),
                                                faulthandler.dump_traceback(all_threads=True), os._exit(0)))  # fmt: skip
        watchdog.start()
        # the captured graphs hold NCCL work: they go before the communicators do
        del rt, cm, manager  # (the model they served keeps none of them alive)
        gc.collect()
        alive = [type(o).__name__ for o in gc.get_objects() if type(o).__name__ in ("GraphSet", "StreamRunner", "CUDAGraph")]
        stage(f"graphs dropped; still alive: {alive}")
        torch.cuda.synchronize()
        dist.barrier()
        reached.append("barrier passed")
        stage("barrier passed")
        dist.destroy_process_group()
        watchdog.cancel()
    stage("done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past this point only teardown is left, which has been seen to hang after NCCL graph captures
