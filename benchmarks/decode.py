"""End-to-end decode steps in bf16: fxlora's ``nolora`` and ``lora`` graphs against the same
model captured by hand in one CUDA graph, PEFT eager, and the bytes floor, side by side in
one process.

    python benchmarks/decode.py [--model llama|llama8b|qwen3_moe] [--out results.json] [--quick | --batches 1,128] [--max-loras N]

``--max-loras``: the pool's slots, when it should hold more than the adapters the batch uses.

``llama``: a Llama-shaped ~1B model (hidden 2048, 16 layers, intermediate 8192, 32 heads / 8
KV heads, vocab 32000), rank-16 adapters on every linear layer; PEFT serves the mixed batch
through ``adapter_names``. ``qwen3_moe``: a Qwen3-MoE-shaped model (hidden 2048, 8 layers,
64 experts, top-8, expert intermediate 768, 32 heads / 4 KV heads of 128), rank-16 adapters
on the attention projections and the experts (``target_parameters``); PEFT cannot mix
adapters on experts, so it runs one adapter for the whole batch (the most it can do).

Random weights; one decode step at context 512: every row attends to 512 cached positions.
Times are medians in microseconds of a graph replay (fxlora, the hand-made graph) or of an
eager call (PEFT). The floor is the bytes a step must read at the device-to-device copy
bandwidth measured here: the weights (for MoE, the experts a uniform routing of the batch
is expected to touch), each used adapter's factors (likewise), and the KV cache.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import platform
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers
import triton
import triton.testing
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

import fxlora
from fxlora.runtime.kv_cache import StaticKVCache, cache_keyword, probe_shapes
from fxlora.testing.models import fill_zero_weights

RANK, CONTEXT = 16, 512
MAX_LEN = CONTEXT + 16


@dataclass
class Spec:
    config: transformers.PreTrainedConfig
    target_modules: list[str]
    target_parameters: list[str] = field(default_factory=list)
    batches: tuple[int, ...] = (1, 8, 32, 128)
    quick_batches: tuple[int, ...] = (1, 32)
    counts: tuple[int, ...] = (0, 1, 4, 16)
    peft_mixed: bool = True  # PEFT serves a mixed batch; else one adapter for every row


def spec(name: str) -> Spec:
    linears = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
        )  # fmt: skip
        return Spec(config, linears)
    if name == "llama8b":  # Llama-3-shaped 8B
        config = transformers.LlamaConfig(
            hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        )  # fmt: skip
        return Spec(config, linears)
    config = transformers.Qwen3MoeConfig(
        hidden_size=2048, num_hidden_layers=8, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=32000, max_position_embeddings=4096,
        decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return Spec(
        config, ["q_proj", "k_proj", "v_proj", "o_proj"], ["experts.gate_up_proj", "experts.down_proj"],
        batches=(1, 32, 128), quick_batches=(1, 32), counts=(0, 4, 16), peft_mixed=False,
    )  # fmt: skip


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


def environment() -> dict:
    """The card, versions and date a result was measured with (its JSON's ``meta``)."""
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def us(fn, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, rep=rep, return_mode="median") * 1e3


def make_adapters(spec: Spec, count: int) -> dict:
    """``count`` random PEFT adapters ``(config, state_dict)``, on the GPU; shapes from PEFT itself."""
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=spec.target_modules,
                        target_parameters=spec.target_parameters or None, init_lora_weights=False)  # fmt: skip
    with torch.device("meta"):
        meta = get_peft_model(transformers.AutoModelForCausalLM.from_config(spec.config), copy.deepcopy(config))
        shapes = {k: v.shape for k, v in get_peft_model_state_dict(meta).items()}
    gen = torch.Generator("cuda").manual_seed(0)
    adapters = {}
    for k in range(count):
        state = {}
        for key, shape in shapes.items():
            scale = 0.01 if "lora_B" in key else shape[-1] ** -0.5
            state[key] = (torch.randn(shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)
        adapters[f"ad{k}"] = (config, state)
    return adapters


def expected_experts(experts: int, top_k: int, rows: float) -> float:
    """Distinct experts ``rows`` tokens touch under uniform routing, in expectation."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def step_bytes(model, spec: Spec, adapters: dict, batch: int, k: int) -> float:
    """Bytes a decode step of ``batch`` rows over ``k`` adapters must read."""
    c = spec.config
    experts = getattr(c, "num_experts", 0)
    dense, per_expert = 0, 0
    for n, p in model.named_parameters():
        if "embed_tokens" in n:
            continue
        if ".experts." in n:
            per_expert += p.nbytes // experts
        else:
            dense += p.nbytes
    adapter = adapters["ad0"][1]
    adapter_dense = sum(t.nbytes for key, t in adapter.items() if ".experts." not in key)
    adapter_expert = sum(t.nbytes for key, t in adapter.items() if ".experts." in key) / max(experts, 1)
    total = dense
    if experts:
        total += per_expert * expected_experts(experts, c.num_experts_per_tok, batch)
    used = min(k, batch)
    if used:
        rows = batch / used
        touched = expected_experts(experts, c.num_experts_per_tok, rows) if experts else 0
        total += used * (adapter_dense + adapter_expert * touched)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    total += 2 * batch * MAX_LEN * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2
    return total


def step_inputs(batch: int, vocab: int, device: str = "cuda") -> dict:
    """One decode token per row at column CONTEXT, attending to columns 0..CONTEXT."""
    mask = torch.full((batch, 1, 1, MAX_LEN), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=device)
    mask[..., : CONTEXT + 1] = 0
    return {
        "input_ids": torch.randint(3, vocab, (batch, 1), device=device),
        "position_ids": torch.full((batch, 1), CONTEXT, device=device),
        "attention_mask": mask,
    }


def at_context(rt) -> None:
    """The runtime's step buffers for a step at column CONTEXT attending to columns 0..CONTEXT."""
    rt.positions.fill_(CONTEXT)
    rt.mask.fill_(torch.finfo(torch.bfloat16).min)
    rt.mask[..., : CONTEXT + 1] = 0
    rt.column.fill_(CONTEXT)


def hand_graph(model, cache: StaticKVCache, batch: int, extra: dict) -> float:
    """What a user builds by hand: the unmodified model with a static cache, one CUDA graph."""
    inputs = step_inputs(batch, model.config.vocab_size)
    cache.select_rows(batch)
    cache.columns = torch.tensor([CONTEXT], device="cuda")
    cache_kw = {cache_keyword(model): cache}
    call = lambda: model(**inputs, use_cache=True, **cache_kw, **extra)  # noqa: E731
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
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes")
    parser.add_argument("--batches", help="batch sizes, comma-separated (default: the model's)")
    parser.add_argument("--model", choices=("llama", "llama8b", "qwen3_moe"), default="llama")
    parser.add_argument(
        "--max-loras", type=int, default=0, help="pool slots (default: the most adapters a row of the table uses)"
    )
    args = parser.parse_args()
    sp = spec(args.model)
    batches = list(sp.quick_batches if args.quick else sp.batches)
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    counts = list(sp.counts)
    vocab = sp.config.vocab_size

    torch.manual_seed(0)
    config = sp.config
    with torch.device("cuda"):  # initialised there: the CPU takes over a minute for the MoE's experts
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    fill_zero_weights(model, 0.02)
    if hasattr(config, "num_experts"):
        model.set_experts_implementation("grouped_mm")  # capturable by hand too; fxlora would switch it anyway
    adapters = make_adapters(sp, max(counts))
    bandwidth = copy_bandwidth()
    forward = inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    # fxlora: compile + capture of every bucket and both variants
    torch.cuda.synchronize()
    start = time.perf_counter()
    max_loras = max(args.max_loras, max(counts))
    cm = fxlora.compile(
        model, adapters, max_loras=max_loras, max_rank=RANK, max_batch_size=max(batches), max_len=MAX_LEN
    )
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
            bucket = rt.bucket_for(batch)
            rt.ids.random_(3, vocab)
            at_context(rt)
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
                    "floor": step_bytes(model, sp, adapters, batch, k) / bandwidth * 1e6,
                }
    del rt, cm
    torch._dynamo.reset()
    torch.cuda.empty_cache()

    cache = StaticKVCache(config, max(batches), MAX_LEN, torch.bfloat16, "cuda", probe_shapes(model, "cuda"))
    with torch.no_grad():
        for batch in batches:
            t = hand_graph(model, cache, batch, extra)
            for k in counts:
                results[(batch, k)]["hand_graph"] = t

    # PEFT, eager (changes `model` in place: last): a mixed batch through adapter_names, or one
    # adapter for every row where PEFT cannot mix (LoRA on experts)
    served = adapters if sp.peft_mixed else {"ad0": adapters["ad0"]}
    peft_model = get_peft_model(model, copy.deepcopy(served["ad0"][0]), adapter_name="ad0")
    for name, (cfg, state) in served.items():
        if name != "ad0":
            peft_model.add_adapter(name, copy.deepcopy(cfg))
        set_peft_model_state_dict(peft_model, state, adapter_name=name)
    peft_model.to(torch.bfloat16).eval()
    cache_kw = {cache_keyword(model): cache}
    with torch.no_grad():
        for batch in batches:
            inputs = step_inputs(batch, vocab)
            cache.select_rows(batch)
            cache.columns = torch.tensor([CONTEXT], device="cuda")
            for k in counts:
                if sp.peft_mixed:
                    names = [f"ad{i % k}" for i in range(batch)] if k else ["__base__"] * batch
                    fn = lambda: peft_model(**inputs, use_cache=True, **cache_kw, adapter_names=names, **extra)  # noqa: B023, E731
                elif k:
                    fn = lambda: peft_model(**inputs, use_cache=True, **cache_kw, **extra)  # noqa: B023, E731
                else:
                    def fn():
                        with peft_model.disable_adapter():
                            return peft_model(**inputs, use_cache=True, **cache_kw, **extra)  # noqa: B023
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
        **environment(),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "setup_seconds": setup_s,
        "graphs": graphs,
        "graph_pool_MiB": pool_mib,
        "kv_cache_MiB": kv_mib,
        "model": args.model,
        "max_loras": max_loras,
        "peft": "mixed batch (adapter_names)" if sp.peft_mixed else "one adapter for every row",
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": [{**asdict(r), **r.ratios} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
