"""End-to-end decode steps of a Llama-shaped ~1B model in bf16: fxlora's ``nolora`` and
``lora`` graphs against the same model captured by hand in one CUDA graph, PEFT eager with
``adapter_names``, and the bytes floor, side by side in one process.

    python benchmarks/decode.py [--out results.json] [--quick]

Random weights (hidden 2048, 16 layers, intermediate 8192, 32 heads / 8 KV heads, vocab
32000) and rank-16 adapters on every linear layer. One decode step at context 512: every
row attends to 512 cached positions. Times are medians in microseconds of a graph replay
(for fxlora and the hand-made graph) or of an eager call (PEFT). The floor is the bytes a
step must read (the weights, each used adapter's factors, the KV cache) at the
device-to-device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass

import torch
import transformers
import triton
import triton.testing
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

import fxlora
from fxlora.runtime.kv_cache import StaticKVCache

CONFIG = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=4096,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, CONTEXT = 16, 512
MAX_LEN = CONTEXT + 16


@dataclass
class Row:
    batch: int
    adapters: int
    hand_graph: float
    nolora: float
    lora: float | None
    peft_eager: float
    floor: float

    @property
    def ratios(self) -> dict[str, float | None]:
        return {
            "nolora/hand": self.nolora / self.hand_graph,
            "lora/nolora": None if self.lora is None else self.lora / self.nolora,
            "peft/fxlora": self.peft_eager / (self.lora or self.nolora),
            "hand/floor": self.hand_graph / self.floor,
        }


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def us(fn, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, rep=rep, return_mode="median") * 1e3


def make_adapters(model: torch.nn.Module, count: int) -> dict:
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS)
    gen = torch.Generator().manual_seed(0)
    adapters = {}
    for k in range(count):
        state = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS:
                prefix = f"base_model.model.{name}"
                state[f"{prefix}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=gen) / module.in_features**0.5
                state[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=gen) * 0.01
        adapters[f"ad{k}"] = (config, {k_: v.to(torch.bfloat16) for k_, v in state.items()})
    return adapters


def step_inputs(batch: int, device: str = "cuda") -> dict:
    """One decode token per row at column CONTEXT, attending to columns 0..CONTEXT."""
    mask = torch.full((batch, 1, 1, MAX_LEN), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=device)
    mask[..., : CONTEXT + 1] = 0
    return {
        "input_ids": torch.randint(3, CONFIG["vocab_size"], (batch, 1), device=device),
        "position_ids": torch.full((batch, 1), CONTEXT, device=device),
        "attention_mask": mask,
    }


def hand_graph(model, cache: StaticKVCache, batch: int, extra: dict) -> float:
    """What a user builds by hand: the unmodified model with a static cache, one CUDA graph."""
    inputs = step_inputs(batch)
    cache.select_rows(batch)
    cache.columns = torch.tensor([CONTEXT], device="cuda")
    call = lambda: model(**inputs, past_key_values=cache, use_cache=True, **extra)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    t = us(graph.replay)
    del graph
    return t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode.json")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 32 only")
    args = parser.parse_args()
    batches = [1, 32] if args.quick else [1, 8, 32, 128]
    counts = [0, 1, 4, 16]

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    adapters = make_adapters(model, max(counts))
    bandwidth = copy_bandwidth()
    weight_bytes = sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" not in n)
    adapter_bytes = sum(t.nbytes for t in adapters["ad0"][1].values())
    forward = __import__("inspect").signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    # fxlora: compile + capture of every bucket and both variants
    torch.cuda.synchronize()
    start = time.perf_counter()
    cm = fxlora.compile(model, adapters, max_loras=16, max_rank=RANK, max_batch_size=max(batches), max_len=MAX_LEN)
    with torch.no_grad():
        rt = cm.prepare()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - start
    graphs = len(rt.graphs.graphs)
    pool_mib, kv_mib = rt.graphs.pool_bytes / 2**20, rt.cache.nbytes / 2**20
    print(f"fxlora.compile + capture of {graphs} graphs ({len(rt.buckets)} buckets x 2 variants): {setup_s:.1f} s; "
          f"capture alone {rt.graphs.capture_seconds:.1f} s, graph pool {rt.graphs.pool_bytes / 2**20:.0f} MiB, "
          f"KV cache {rt.cache.nbytes / 2**20:.0f} MiB")

    results: dict[tuple[int, int], dict] = {}
    with torch.no_grad():
        for batch in batches:
            head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
            kv_bytes = 2 * batch * MAX_LEN * CONFIG["num_hidden_layers"] * CONFIG["num_key_value_heads"] * head_dim * 2
            bucket = rt.bucket_for(batch)
            rt.ids.random_(3, CONFIG["vocab_size"])
            rt.positions.fill_(CONTEXT)
            rt.mask.fill_(torch.finfo(torch.bfloat16).min)
            rt.mask[..., : CONTEXT + 1] = 0
            rt.column.fill_(CONTEXT)
            for k in counts:
                rt.slot_ids.fill_(-1)
                if k:
                    names = [f"ad{i % k}" for i in range(batch)]
                    rt.slot_ids[:batch].copy_(torch.tensor(cm.pool.slot_ids(names), dtype=torch.int32))
                nolora_graph = rt.graphs.graphs[("nolora", bucket)][0]
                lora_graph = rt.graphs.graphs[("lora", bucket)][0]
                results[(batch, k)] = {
                    "nolora": us(nolora_graph.replay),
                    "lora": us(lora_graph.replay) if k else None,
                    "floor": (weight_bytes + min(k, batch) * adapter_bytes + kv_bytes) / bandwidth * 1e6,
                }
    del rt, cm
    torch._dynamo.reset()
    torch.cuda.empty_cache()

    cache = StaticKVCache(config, max(batches), MAX_LEN, torch.bfloat16, "cuda")
    with torch.no_grad():
        for batch in batches:
            t = hand_graph(model, cache, batch, extra)
            for k in counts:
                results[(batch, k)]["hand_graph"] = t

    # PEFT, eager, with a mixed batch through adapter_names (changes `model` in place: last)
    first = next(iter(adapters.values()))[0]
    peft_model = get_peft_model(model, first, adapter_name="ad0")
    for name, (cfg, state) in adapters.items():
        if name != "ad0":
            peft_model.add_adapter(name, cfg)
        set_peft_model_state_dict(peft_model, state, adapter_name=name)
    peft_model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for batch in batches:
            inputs = step_inputs(batch)
            cache.select_rows(batch)
            cache.columns = torch.tensor([CONTEXT], device="cuda")
            for k in counts:
                names = [f"ad{i % k}" for i in range(batch)] if k else ["__base__"] * batch
                fn = lambda: peft_model(**inputs, past_key_values=cache, use_cache=True, adapter_names=names, **extra)  # noqa: B023, E731
                results[(batch, k)]["peft_eager"] = us(fn, rep=300)

    rows = [Row(batch=b, adapters=k, **v) for (b, k), v in sorted(results.items())]
    print(f"{'batch':>5} {'adapters':>8} {'hand graph':>10} {'nolora':>8} {'lora':>8} {'PEFT':>9} {'floor':>7} "
          f"{'nolora/hand':>11} {'lora/nolora':>11} {'PEFT/fxlora':>11} {'hand/floor':>10}")
    for r in rows:
        q = r.ratios
        lora = f"{r.lora:8.0f}" if r.lora is not None else f"{'-':>8}"
        ln = f"{q['lora/nolora']:11.3f}" if q["lora/nolora"] is not None else f"{'-':>11}"
        print(f"{r.batch:>5} {r.adapters:>8} {r.hand_graph:10.0f} {r.nolora:8.0f} {lora} {r.peft_eager:9.0f} "
              f"{r.floor:7.0f} {q['nolora/hand']:11.3f} {ln} {q['peft/fxlora']:11.1f} {q['hand/floor']:10.2f}")
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "setup_seconds": setup_s,
        "graphs": graphs,
        "graph_pool_MiB": pool_mib,
        "kv_cache_MiB": kv_mib,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": [{**asdict(r), **r.ratios} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
