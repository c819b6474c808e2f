"""Whole ``generate`` calls in bf16: fxlora (``lora`` with 16 adapters, or as many as
``--adapters`` says, and ``nolora``) against what a user would otherwise run, each system in
a process of its own, side by side in one call: one after the other, or with ``--gpus N`` up to
N at once, each on a GPU of its own (the same cards of one host; the systems share its CPUs).

    python benchmarks/generate.py [--model llama|llama8b|qwen3_moe] [--batches 1,32,128 | --quick] [--adapters 4,16]
                                  [--quant fp8] [--gpus N] [--stream] [--out results.json]

Systems: ``fxlora`` (``fxlora.compile`` with ``max_batch_size`` the largest batch: Inductor
inside both graphs, CUDA graphs per batch bucket; one process serves both variants, and
``lora`` once for each count of ``--adapters``, the rows cycling over that many adapters of
one pool); with ``--stream``, fxlora's calls are ``cm.generate_batch`` over the rows' prompts
(the request stream's engine: paged KV cache, its own decode and prefill graphs; ``setup_s``
includes building it), the rows all admitted at once;
``transformers``: the base model's own ``generate(cache_implementation="static")``, which
compiles its forward with ``torch.compile`` and captures it; ``peft``: a ``PeftModel`` with
the same adapters (the largest count) serving a mixed batch through ``adapter_names`` (eager; a few decode
steps, scaled), or for MoE one adapter for the whole batch (PEFT cannot mix adapters on
experts). Models, adapters (rank 16) and random weights as in ``benchmarks/decode.py``.
Prompts of 128 tokens, 128 new tokens, greedy, no end token: every call makes all of them.
``--quant fp8``: every system runs the same FP8 model, torchao's
``Float8DynamicActivationFloat8WeightConfig`` (per-row scales) on every linear but the output
head and, for MoE, ``Float8WeightOnlyConfig`` on the experts' parameters (``FqnToConfig``).

A system's decode rate is ``rows * (new - 1) / (t(new) - t(1))`` and its prefill rate
``rows * prompt / t(1)``, ``t(n)`` the median time of a call making ``n`` new tokens after
warm-up (of 11 calls for ``t(1)``, short and bound by the host at small batches; of 3 else).
``setup_s``: the first call, compile and capture included (for fxlora, compile,
``prepare()`` and that call, each in ``setup_parts_s``; ``first_call_s``: the first call of
each batch size and variant, which shows any later compile). ``peak_MiB``: the most device
memory the process held.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers

PROMPT, NEW = 128, 128
ADAPTERS = 16
PEFT_STEPS = 8
FIRST_TOKEN_REPEATS = 11  # t(1): a call of ~10 ms at batch 1 moves by a few percent from call to call


def timed(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rates(batch: int, t1: float, tn: float, new: int) -> dict:
    return {"decode_tok_s": batch * (new - 1) / (tn - t1), "prefill_tok_s": batch * PROMPT / t1}


def quantize(model: torch.nn.Module, quant: str) -> None:
    if quant == "none":
        return
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        FqnToConfig,
        PerRow,
        quantize_,
    )

    dense = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    quantize_(model, dense, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
    if hasattr(model.config, "num_experts"):
        # weight-only: Inductor (torch 2.11) cannot lower the dynamic config's scaled grouped GEMM
        experts = Float8WeightOnlyConfig()
        quantize_(model, FqnToConfig({rf"re:.*experts\.{p}": experts for p in ("gate_up_proj", "down_proj")}), filter_fn=None)
        model.set_experts_implementation("grouped_mm")  # the one transformers has that reads float8 experts


def run_system(
    system: str, model_name: str, batches: list[int], counts: list[int], quant: str = "none", stream: bool = False
) -> dict:
    from decode import make_adapters, spec

    from fxlora.testing.models import fill_zero_weights

    torch.manual_seed(0)
    sp = spec(model_name)
    with torch.device("cuda"):  # initialised there: the CPU takes over a minute for the MoE's experts
        model = transformers.AutoModelForCausalLM.from_config(sp.config, dtype=torch.bfloat16).eval()
    fill_zero_weights(model, 0.02)
    count = max(counts)
    adapters = make_adapters(sp, count)  # from the unquantised weights' shapes
    quantize(model, quant)
    vocab = sp.config.vocab_size
    prompts = {b: torch.randint(3, vocab, (b, PROMPT), device="cuda") for b in batches}
    results: dict = {"rows": {}}
    start = time.perf_counter()
    if system == "fxlora":
        import fxlora

        cm = fxlora.compile(model, adapters, max_loras=count, max_rank=16, max_batch_size=max(batches),
                            max_len=PROMPT + NEW)  # fmt: skip
        compiled = time.perf_counter()
        if stream:  # the request stream's engine: paged cache, decode graphs traced, compiled and captured
            cm._requests({}, None)
            runtime = cm._engine[1].runner
        else:
            runtime = cm.prepare()  # the decode step traced, compiled, run once per bucket and variant, captured
        prepared, captured = time.perf_counter(), runtime.graphs.capture_seconds
        for b in batches:
            names = {f"lora{k}": [f"ad{i % k}" for i in range(b)] for k in counts} | {"nolora": None}
            inputs = prompts[b].tolist()
            for variant, adapter_names in names.items():
                # no end token, as min_new_tokens=n makes it for transformers and PEFT: every call runs n steps
                if stream:
                    call = lambda n: cm.generate_batch(inputs, adapter_names, max_new_tokens=n, eos_token_id=(), progress_bar=False)  # noqa: B023, E731
                else:
                    call = lambda n: cm.generate(prompts[b], adapter_names=adapter_names, max_new_tokens=n, eos_token_id=())  # noqa: B023, E731
                first = time.perf_counter()
                call(NEW)
                # a first call that compiles (a new prefill shape Dynamo cannot share) shows here
                results.setdefault("first_call_s", {})[f"{variant}/{b}"] = time.perf_counter() - first
                if "setup_s" not in results:
                    results["setup_s"] = time.perf_counter() - start
                    results["setup_parts_s"] = {  # the first call compiles the prefill graph (and captures it)
                        "compile": compiled - start, "prepare": prepared - compiled,
                        "of which capture": captured,
                        "first call": results["setup_s"] - (prepared - start),
                    }  # fmt: skip
                t1, tn = timed(lambda: call(1), FIRST_TOKEN_REPEATS), timed(lambda: call(NEW))  # noqa: B023
                results["rows"][f"{variant}/{b}"] = rates(b, t1, tn, NEW)
        results["graph_pool_MiB"] = runtime.graphs.pool_bytes / 2**20
        results["explain"] = cm.explain()
    elif system == "transformers":
        if quant != "none" and hasattr(model.config, "num_experts"):
            # generate switches grouped_mm experts to batched_mm for decoding, whose expert
            # indexing torchao's float8 weights lack: keep grouped_mm, which reads them
            model._optimize_model_for_decode = contextlib.nullcontext
        for b in batches:
            def call(n):
                return model.generate(prompts[b], attention_mask=torch.ones_like(prompts[b]), max_new_tokens=n,  # noqa: B023
                                      min_new_tokens=n, do_sample=False, cache_implementation="static", pad_token_id=0)  # fmt: skip
            first = time.perf_counter()
            call(NEW)
            results.setdefault("setup_s_per_batch", {})[b] = time.perf_counter() - first
            t1, tn = timed(lambda: call(1), FIRST_TOKEN_REPEATS), timed(lambda: call(NEW))  # noqa: B023
            results["rows"][f"base/{b}"] = rates(b, t1, tn, NEW)
    elif system == "peft":
        from peft import get_peft_model, set_peft_model_state_dict

        served = adapters if sp.peft_mixed else {"ad0": adapters["ad0"]}
        peft_model = get_peft_model(model, served["ad0"][0], adapter_name="ad0")
        for name, (cfg, state) in served.items():
            if name != "ad0":
                peft_model.add_adapter(name, cfg)
            set_peft_model_state_dict(peft_model, state, adapter_name=name)
        peft_model.to(torch.bfloat16).eval()
        for b in batches:
            extra = {"adapter_names": [f"ad{i % count}" for i in range(b)]} if sp.peft_mixed else {}
            def call(n):
                return peft_model.generate(input_ids=prompts[b], attention_mask=torch.ones_like(prompts[b]),  # noqa: B023
                                           max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)  # noqa: B023
            call(2)
            t1, tn = timed(lambda: call(1), 1), timed(lambda: call(PEFT_STEPS), 1)  # noqa: B023
            results["rows"][f"peft/{b}"] = rates(b, t1, tn, PEFT_STEPS)
    results["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("llama", "llama8b", "qwen3_moe"), default="llama")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 32")
    parser.add_argument("--systems", default="fxlora,transformers,peft")
    parser.add_argument("--adapters", default=str(ADAPTERS), help="adapters the lora batches cycle over, e.g. 4,16")
    parser.add_argument("--quant", choices=("none", "fp8"), default="none")
    parser.add_argument("--gpus", type=int, default=1, help="run up to this many systems at once, one per GPU")
    parser.add_argument("--stream", action="store_true", help="fxlora through generate_batch (the request stream)")
    parser.add_argument("--out", default="generate.json")
    parser.add_argument("--system", help=argparse.SUPPRESS)  # the child process: one system
    args = parser.parse_args()
    if args.quick:
        args.batches = "1,32"
    batches = [int(b) for b in args.batches.split(",")]
    counts = [int(k) for k in args.adapters.split(",")]
    if args.system:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.system} %(name)s: %(message)s", stream=sys.stderr)
        print(json.dumps(run_system(args.system, args.model, batches, counts, args.quant, args.stream)))
        return
    # with --gpus N, up to N systems run at once, each on a GPU of its own
    if args.gpus < 1:
        parser.error("--gpus must be at least 1")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(max(torch.cuda.device_count(), 1))]
    devices = devices[: args.gpus]
    names, systems = args.systems.split(","), {}
    for wave in range(0, len(names), len(devices)):
        procs = {}
        try:
            for device, system in zip(devices, names[wave : wave + len(devices)], strict=False):
                cmd = [sys.executable, __file__, "--model", args.model, "--batches", args.batches, "--system", system,
                       "--adapters", args.adapters, "--quant", args.quant, *(["--stream"] if args.stream else [])]  # fmt: skip
                env = os.environ | ({"CUDA_VISIBLE_DEVICES": device} if args.gpus > 1 else {})
                # the child's log (fxlora's setup stages) goes straight to this process's stderr
                procs[system] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
            for system, proc in procs.items():
                out, _ = proc.communicate()
                lines = out.strip().splitlines()
                if proc.returncode or not lines:
                    print(f"{system} failed (exit status {proc.returncode}); its log is above", flush=True)
                    systems[system] = {"error": f"exit status {proc.returncode}"}
                    continue
                systems[system] = json.loads(lines[-1])
                print(f"{system}: done", flush=True)
                with open(args.out, "w") as f:  # what has run so far, should a later system not finish
                    json.dump({"systems": systems}, f, indent=1)
        finally:
            for proc in procs.values():
                proc.kill()  # none left running, should this process stop early
    rows = {}
    for result in systems.values():
        rows.update(result.get("rows", {}))
    print(f"{'batch':>5} {'system':>8} {'decode tok/s':>13} {'prefill tok/s':>14} {'vs transformers':>16} {'nolora / it':>12}")
    for b in batches:
        base = rows.get(f"base/{b}", {}).get("decode_tok_s")
        nolora = rows.get(f"nolora/{b}", {}).get("decode_tok_s")
        for system in ("nolora", *(f"lora{k}" for k in counts), "base", "peft"):
            r = rows.get(f"{system}/{b}")
            if r:
                ratio = f"{r['decode_tok_s'] / base:16.2f}" if base else f"{'-':>16}"
                slower = f"{nolora / r['decode_tok_s']:12.3f}" if nolora else f"{'-':>12}"
                print(f"{b:>5} {system:>8} {r['decode_tok_s']:13.0f} {r['prefill_tok_s']:14.0f} {ratio} {slower}")
    for system, result in systems.items():
        setup = result.get("setup_s", result.get("setup_s_per_batch"))
        parts = result.get("setup_parts_s")
        if parts:
            setup = f"{setup:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) + ")"
        print(f"{system}: setup {setup}, peak {result.get('peak_MiB', 0):.0f} MiB"
              + (f", graph pool {result['graph_pool_MiB']:.0f} MiB" if "graph_pool_MiB" in result else ""))  # fmt: skip
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
        "prompt": PROMPT, "new_tokens": NEW, "adapters": args.adapters, "quant": args.quant, "gpus": args.gpus,
        "stream": args.stream,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "systems": systems}, f, indent=1)


if __name__ == "__main__":
    main()
