"""CUDA-only checks of MoE expert LoRA, run by scripts/gpu_tests.sh: the Triton path at real
sizes in every dtype against the reference, no host synchronisation, CUDA-graph capture and
replay with routing, assignments and adapter weights changed between replays, mixed bf16
batches of tiny MoE models against PEFT (float16 and float32 too, under Inductor), and decode
graphs against eager steps."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora.ops import batch_info
from fxlora.ops.moe_lora import ExpertsLayout, moe_lora, moe_lora_composed
from fxlora.testing import assert_matches_peft, make_adapter, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _case(tokens, dtype, experts=64, top_k=8, hidden=2048, inter=768, slots=4, rank=16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, fan):
        return (torch.randn(*shape, generator=gen) / fan**0.5).to("cuda", dtype)

    weights = dict(
        up=w(experts, 2 * inter, hidden, fan=hidden),
        down=w(experts, hidden, inter, fan=inter),
        up_lora=[w(slots, experts, rank, hidden, fan=hidden), w(slots, experts, 2 * inter, rank, fan=rank)],
        down_lora=[w(slots, experts, rank, inter, fan=inter), w(slots, experts, hidden, rank, fan=rank)],
    )
    for lora in (weights["up_lora"], weights["down_lora"]):
        lora += [torch.rand(slots, generator=gen).cuda() + 0.5, torch.tensor([rank, rank // 2, 0, 3][:slots], dtype=torch.int32).cuda()]
    return weights


def _routing(tokens, experts, top_k, gen, dtype):
    scores = torch.rand(tokens, experts, generator=gen)
    w, idx = scores.topk(top_k, dim=-1)
    return idx.cuda(), (w / w.sum(-1, keepdim=True)).to("cuda", dtype)


def _call(fn, x, idx, w, p, slot_ids, slots=4):
    token_slot = batch_info(slot_ids, x, 1, slots)[0]
    return fn(x, idx, w, p["up"], None, p["down"], None, p["up_lora"], p["down_lora"], token_slot, ExpertsLayout(False, "glu", "silu").spec)


def _reference(x, idx, w, p, slot_ids):
    """The CPU reference in float64."""
    d = {k: (v.double().cpu() if isinstance(v, torch.Tensor) else [t.cpu().double() if t.is_floating_point() else t.cpu() for t in v]) for k, v in p.items()}
    return _call(moe_lora, x.double().cpu(), idx.cpu(), w.double().cpu(), d, slot_ids.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 32, 128])
def test_composition_at_real_sizes(tokens, dtype):
    p = _case(tokens, dtype)
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, 2048, generator=gen)).to("cuda", dtype)
    idx, w = _routing(tokens, 64, 8, gen, dtype)
    slot_ids = torch.randint(-1, 4, (tokens,), generator=gen, dtype=torch.int32).cuda()
    out = _call(moe_lora_composed, x, idx, w, p, slot_ids)
    ref = _reference(x, idx, w, p, slot_ids)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype], err


def test_no_sync_and_graph_replay_with_new_routing_assignments_and_weights():
    tokens, dtype = 32, torch.bfloat16
    p = _case(tokens, dtype, experts=16, hidden=512, inter=256)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, 512, generator=gen).to("cuda", dtype)
    idx, w = _routing(tokens, 16, 4, gen, dtype)
    slot_ids = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    _call(moe_lora_composed, x, idx, w, p, slot_ids)  # compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _call(moe_lora_composed, x, idx, w, p, slot_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(moe_lora_composed, x, idx, w, p, slot_ids)
    for step in range(4):
        new_idx, new_w = _routing(tokens, 16, 4, gen, dtype)
        idx.copy_(new_idx)
        w.copy_(new_w)
        x.copy_(torch.randn(tokens, 512, generator=gen))
        slot_ids.copy_(torch.randint(-1, 4, (tokens,), generator=gen, dtype=torch.int32))
        if step == 2:  # a hot swap: new factors copied into slot 1 in place
            for t in (p["up_lora"][0], p["down_lora"][1]):
                t[1].copy_(torch.randn(t[1].shape, generator=gen) * 0.1)
        graph.replay()
        ref = _reference(x, idx, w, p, slot_ids)
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (step, err)


def _moe_served(family, dtype, **compile_kw):
    torch._dynamo.reset()
    cpu_model = tiny_model(family, seed=1, hidden_size=64, intermediate_size=96, vocab_size=200)
    cpu_model.set_experts_implementation("grouped_mm")
    dense = ["q_a_proj", "o_proj"] if family == "deepseek_v3" else ["q_proj", "v_proj"]
    adapters = {
        n: make_adapter(cpu_model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=dense, target_parameters=EXPERTS),
                        seed=i, directory="", scale=0.4)
        for i, (n, r) in enumerate([("a", 8), ("b", 4), ("c", 16)])
    }  # fmt: skip
    model = copy.deepcopy(cpu_model).to("cuda", dtype)
    return model, adapters, fxlora.compile(model, adapters, max_loras=4, max_rank=16, **compile_kw)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_mixed_batch_matches_peft(family):
    model, adapters, cm = _moe_served(family, torch.bfloat16)
    ids = torch.randint(3, 200, (5, 7), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        assert_matches_peft(cm, model, adapters, ["a", None, "b", "c", "a"], input_ids=ids)
    eager = fxlora.compile(model, adapters, max_loras=4, max_rank=16, inner="eager")
    with torch.no_grad():  # the FX graph itself is the model op for op; Inductor's fusions round differently
        torch.testing.assert_close(eager(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes_compile_under_inductor(dtype):
    """Inductor traces the experts' grouped GEMMs in float16 and float32 through
    ``fxlora::grouped_mm`` (ATen's meta function admits only bfloat16)."""
    model, adapters, cm = _moe_served("qwen3_moe", dtype)
    ids = torch.randint(3, 200, (5, 7), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        assert_matches_peft(cm, model, adapters, ["a", None, "b", "c", "a"], input_ids=ids)


def test_decode_graphs_match_eager_with_swaps():
    model, adapters, cm = _moe_served("qwen3_moe", torch.bfloat16, max_batch_size=8, max_len=32, batch_buckets=[1, 4, 8])
    rt = cm.prepare()
    assert set(rt.graphs.graphs) == {(v, b) for v in ("lora", "nolora") for b in rt.buckets}
    gen = torch.Generator().manual_seed(5)
    for bucket in rt.buckets:
        for swap in (False, True):
            if swap:
                cm.unload_adapter("b")
                cm.load_adapter(adapters["c"], adapter_name="b")  # other weights under the same name and slot
            rt.ids.copy_(torch.randint(3, 200, (8, 1), generator=gen))
            rt.positions.fill_(3)
            rt.mask.fill_(torch.finfo(rt.dtype).min)
            rt.mask[..., :4] = 0
            rt.column.fill_(3)
            rt.slot_ids.copy_(torch.randint(-1, 3, (8,), generator=gen, dtype=torch.int32))
            for variant in ("nolora", "lora"):
                key = (variant, bucket)
                replayed = rt.graphs.run(key, rt._decode).clone()
                eager = rt._decode(key)
                torch.testing.assert_close(replayed.float(), eager.float(), rtol=2e-2, atol=2e-2)


def _quantized_experts(kind):
    from torchao.quantization import Float8WeightOnlyConfig, FqnToConfig, Int8WeightOnlyConfig

    config = Float8WeightOnlyConfig() if kind == "fp8" else Int8WeightOnlyConfig()
    return FqnToConfig({rf"re:.*experts\.{p}": config for p in ("gate_up_proj", "down_proj")})


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantised_experts_in_bf16_with_cuda_graphs(kind):
    """torchao experts on CUDA under Inductor: float8 through the subclass's grouped GEMM, int8
    (no grouped GEMM) per expert. A mixed batch and one without adapters against the
    decomposition oracle (the quantised model's eager experts loop plus the reference deltas),
    and a batched greedy generate, its decode steps replayed from CUDA graphs, teacher-forced
    against the same oracle."""
    pytest.importorskip("torchao")
    from fxlora.compiler import experts_op
    from fxlora.testing import assert_greedy_agrees, assert_matches_decomposition, decomposed_logits, quantized_model

    torch._dynamo.reset()
    cpu_model = tiny_model("qwen3_moe", seed=1, dtype=torch.bfloat16, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, vocab_size=200)
    model, twin = (
        quantized_model(cpu_model, _quantized_experts(kind), experts_implementation="eager", device_map="cuda") for _ in range(2)
    )
    adapters = {
        n: make_adapter(cpu_model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj"], target_parameters=EXPERTS),
                        seed=i, directory="", scale=0.4)
        for i, (n, r) in enumerate([("a", 8), ("b", 4)])
    }  # fmt: skip
    cm = fxlora.compile(model, adapters, max_loras=4, max_rank=16, max_batch_size=4, max_len=32)
    assert model.config._experts_implementation == experts_op.NAME
    names = ["a", None, "b", "a"]
    ids = torch.randint(3, 200, (4, 7), generator=torch.Generator().manual_seed(2)).cuda()
    for rows in (names, [None] * len(names)):  # the lora variant, then nolora
        assert_matches_decomposition(cm, twin, adapters, rows, input_ids=ids)
    tokens = cm.generate(ids, torch.ones_like(ids), adapter_names=names, max_new_tokens=6, pad_token_id=0)
    assert cm.prepare().graphs.graphs, "the decode steps were not captured"
    sequence = torch.cat([ids, tokens[:, -6:]], dim=1)
    logits = decomposed_logits(twin, adapters, names, input_ids=sequence)
    assert_greedy_agrees(tokens[:, -6:].cpu(), logits[:, -7:-1].cpu())


def test_float8_experts_stored_transposed_in_bf16():
    """GPT-OSS's float8 experts (E, in, out), whose layout torchao's grouped GEMM refuses:
    the composition dequantises them. Rows without an adapter, in a mixed batch and in
    ``nolora``, against the quantised model's eager loop (per-token KL in bf16); the adapter's
    rows differ from it."""
    pytest.importorskip("torchao")
    from fxlora.testing import quantized_model
    from fxlora.testing.oracle import KL_TOL, row_errors

    torch._dynamo.reset()
    cpu_model = tiny_model("gpt_oss", seed=2, dtype=torch.bfloat16)
    model, twin = (
        quantized_model(cpu_model, _quantized_experts("fp8"), experts_implementation="eager", device_map="cuda") for _ in range(2)
    )
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS)
    adapters = {"a": make_adapter(cpu_model, config, seed=1, directory="", scale=1.0)}
    cm = fxlora.compile(model, adapters, max_loras=2, max_rank=8)
    ids = torch.randint(3, cpu_model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2)).cuda()
    base = twin(input_ids=ids).logits
    nolora = cm(input_ids=ids, adapter_names=[None] * 3).logits
    mixed = cm(input_ids=ids, adapter_names=["a", None, "a"]).logits
    assert max(row_errors(nolora, base)) <= KL_TOL[torch.bfloat16]
    assert row_errors(mixed[1:2], base[1:2])[0] <= KL_TOL[torch.bfloat16]
    assert max(row_errors(mixed[::2], base[::2])) > KL_TOL[torch.bfloat16]
