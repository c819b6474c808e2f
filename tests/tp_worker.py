"""One rank of the tensor-parallel tests (``tests/test_tensor_parallel.py`` launches two of
these with ``torch.distributed.run``, gloo on CPU).

Loads the model saved in ``DIR/model`` sharded with transformers' own plan, compiles it with
the adapters ``DIR/a`` and ``DIR/b``, and runs the script ``DIR/script.json`` names: mixed
batches, a load, an unload, a load that fails on one rank only, a ``generate``, the stream, and a
mixed batch with an adapter on the embedding; with ``as_on_cuda``, every graph rewritten as for
CUDA graphs (``PassContext.shrink_ahead``). Each
rank writes what it saw to ``RESULTS/rank<N>.safetensors`` and ``RESULTS/rank<N>.json``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py DIR RESULTS
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import inspect
import json
import signal
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import fxlora
from fxlora.runtime.backend import Backend


def pool_state(cm: fxlora.CompiledModel) -> list[torch.Tensor]:
    return [t.clone() for target in cm.pool.targets.values() for t in (target.lora_a, target.lora_b, target.scaling)]


def distributed_config(options: dict) -> DistributedConfig:
    """``DistributedConfig(**options)``; before transformers 5.21, which has no ``ep_size``,
    expert parallelism over the tensor-parallel ranks is ``enable_expert_parallel``."""
    if "ep_size" in options and "ep_size" not in inspect.signature(DistributedConfig).parameters:
        return DistributedConfig(tp_size=options["tp_size"], enable_expert_parallel=True)
    return DistributedConfig(**options)


def stream_tokens(cm: fxlora.CompiledModel, requests: list) -> torch.Tensor:
    """``generate_batch`` over ``[prompt, adapter, max_new_tokens]`` requests, three rows at a
    time: every request's tokens, padded with -1 to the longest."""
    prompts, names, news = zip(*requests)
    outs = cm.generate_batch(list(prompts), list(names), max_new_tokens=list(news), eos_token_id=(), progress_bar=False)
    width = max(news)
    return torch.tensor([o.generated_tokens + [-1] * (width - len(o.generated_tokens)) for o in outs])


def main(directory: str, results: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's launcher asks where a rank waits
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    script = json.load(open(f"{directory}/script.json"))
    inputs = load_file(f"{directory}/inputs.safetensors")
    config = distributed_config(script["distributed"])
    if script["as_on_cuda"]:  # the passes as they rewrite code captured in CUDA graphs
        context = Backend._context
        Backend._context = lambda self, *args, **kwargs: dataclasses.replace(context(self, *args, **kwargs), shrink_ahead=True)
    model = AutoModelForCausalLM.from_pretrained(f"{directory}/model", distributed_config=config, dtype=torch.float32).eval()
    cm = fxlora.compile(
        model,
        {name: f"{directory}/{name}" for name in script["adapters"]},
        max_loras=4,
        max_rank=16,
        target_modules=script["target_modules"],
        max_batch_size=4,
        max_len=32,
        inner=script["inner"],
    )
    cm._requests(dict(max_batch_size=3, max_len=32, block_size=4, window=3), None)  # the stream's engine, small
    out, report = {}, {}
    with torch.no_grad():
        out["first"] = cm(input_ids=inputs["ids"], adapter_names=script["first"]).logits
        cm.load_adapter(f"{directory}/c", adapter_name="c")
        out["loaded"] = cm(input_ids=inputs["ids"], adapter_names=script["loaded"]).logits
        cm.unload_adapter("a")
        out["unloaded"] = cm(input_ids=inputs["ids"], adapter_names=script["unloaded"]).logits
        # a load whose adapter only rank 1 cannot read: no rank may change
        before, names = pool_state(cm), cm.adapter_names
        try:
            cm.load_adapter(f"{directory}/c" if rank == 0 else f"{directory}/missing", adapter_name="d")
            report["failed_load"] = "loaded"
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            report["failed_load"] = f"{type(e).__name__}: {e}"
        report["unchanged"] = cm.adapter_names == names and all(torch.equal(x, y) for x, y in zip(before, pool_state(cm)))
        report["not_served"] = sorted(set(cm.pool.targets) - set(cm.backend.rewritten))
        report["ops"] = sorted(set(cm.backend.rewritten.values()))
        report["explain"] = cm.explain()
        report["graphs"] = cm.compile_count
        report["local_out"] = {fqn: t.info.out_features for fqn, t in cm.pool.targets.items()}
        out["generated"] = cm.generate(
            inputs["ids"], adapter_names=script["generate"], max_new_tokens=script["max_new_tokens"]
        )
        out["stream"] = stream_tokens(cm, script["stream"])
        # the serving loop: requests added on rank 0 only, every rank's loop serving them
        with cm.serve(max_batch_size=2, max_len=32, block_size=4, window=2) as manager:
            ids = [manager.add_request(p, f"s{i}", n, adapter_name=a, eos_token_id=()) for i, (p, a, n) in enumerate(script["stream"])]
            report["served_ids"] = ids
            report["served"] = [manager.get_result(f"s{i}", timeout=120).generated_tokens for i in range(len(ids))]
            out["stream_served"] = stream_tokens(cm, script["stream"])  # generate_batch through the running loops
            if rank == 1:  # rank 0 leaves its block and stops every loop; this rank is still inside its own
                while manager.is_running():
                    time.sleep(0.01)
            for key, call in (
                ("load_while_serving", lambda: cm.load_adapter(f"{directory}/c", adapter_name="e2")),
                ("call_while_serving", lambda: cm(input_ids=inputs["ids"], adapter_names=script["first"])),
                ("generate_while_serving", lambda: cm.generate(inputs["ids"], adapter_names=script["generate"], max_new_tokens=2)),
            ):
                try:
                    call()
                    report[key] = "ran"
                except RuntimeError as e:
                    report[key] = str(e)
    # an adapter on the embedding, which the plan splits over its vocabulary (transformers 5.2x)
    if script["embedding"]:
        embedding = model.get_input_embeddings().weight
        report["embedding_placements"] = [repr(p) for p in getattr(embedding, "placements", ())]
        cm = fxlora.compile(model, {"e": f"{directory}/e"}, max_loras=2, max_rank=16)
        with torch.no_grad():
            out["embedding"] = cm(input_ids=inputs["ids"], adapter_names=script["embedding"]).logits
        report["embedding_ops"] = sorted(set(cm.backend.rewritten.values()))
    save_file({k: v.contiguous() for k, v in out.items()}, f"{results}/rank{rank}.safetensors")
    json.dump(report, open(f"{results}/rank{rank}.json", "w"))
    dist.barrier()  # no rank tears its group down while another's last collective is in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
