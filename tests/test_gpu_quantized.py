"""CUDA-only checks of LoRA on quantised dense bases, run by scripts/gpu_tests.sh: torchao int8
and int4 weight-only and FP8 (dynamic activations, per-row scales) linears, and bitsandbytes'
4-bit nf4 (QLoRA's base), in bf16 under the CUDA defaults (Inductor, CUDA graphs). A mixed
batch and one without adapters against PEFT (which wraps these layers), and a batched greedy
generate, its decode steps replayed from CUDA graphs, teacher-forced against the decomposition
oracle. (Quantised MoE experts: tests/test_gpu_moe.py.)"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora.testing import (
    assert_greedy_agrees,
    assert_matches_peft,
    decomposed_logits,
    make_adapter,
    quantized_model,
    tiny_model,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NAMES = ["a", None, "b", "a"]


def torchao_config(kind):
    pytest.importorskip("torchao")
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if kind == "int8":
        return Int8WeightOnlyConfig()
    if kind == "int4":  # tinygemm's kernel, in torch itself
        return Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d")
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())


def served(model, source):
    adapters = {
        n: make_adapter(source, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "down_proj"]),
                        seed=i, directory="", scale=0.4)
        for i, (n, r) in enumerate([("a", 8), ("b", 4)])
    }  # fmt: skip
    return adapters, fxlora.compile(model, adapters, max_loras=4, max_rank=16, max_batch_size=4, max_len=32)


def check_generate(cm, model, adapters):
    ids = torch.randint(3, 200, (4, 7), generator=torch.Generator().manual_seed(3)).cuda()
    # 48 tokens, so that one near-tie flip stays within the agreement floor: FP8 activations,
    # quantised from Inductor's fused kernels here and from eager ones in the oracle, can
    # round a value to the neighbouring float8
    new = 12
    tokens = cm.generate(ids, torch.ones_like(ids), adapter_names=NAMES, max_new_tokens=new, eos_token_id=())
    assert cm.prepare().graphs.graphs, "the decode steps were not captured"
    logits = decomposed_logits(model, adapters, NAMES, input_ids=torch.cat([ids, tokens[:, -new:]], dim=1))
    assert_greedy_agrees(tokens[:, -new:].cpu(), logits[:, -new - 1 : -1].cpu())


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_torchao_linears_in_bf16_with_cuda_graphs(kind):
    torch._dynamo.reset()
    source = tiny_model("llama", seed=5, dtype=torch.bfloat16, hidden_size=64, intermediate_size=128, vocab_size=200)
    model = quantized_model(source, torchao_config(kind), device_map="cuda")
    assert type(model.model.layers[0].self_attn.q_proj.weight).__module__.startswith("torchao")
    adapters, cm = served(model, source)
    ids = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(2)).cuda()
    for names in (NAMES, [None] * len(NAMES)):  # the lora variant, then nolora
        assert_matches_peft(cm, model, adapters, names, input_ids=ids)  # PEFT's TorchaoLoraLinear
    check_generate(cm, model, adapters)


def test_bitsandbytes_nf4_linears_in_bf16_with_cuda_graphs(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch._dynamo.reset()
    source = tiny_model("llama", seed=5, dtype=torch.bfloat16, hidden_size=64, intermediate_size=128, vocab_size=200)
    source.save_pretrained(tmp_path)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cuda").eval()
    adapters, cm = served(model, source)
    ids = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(2)).cuda()
    for names in (NAMES, [None] * len(NAMES)):  # the lora variant, then nolora
        assert_matches_peft(cm, model, adapters, names, input_ids=ids)  # PEFT's bitsandbytes Linear4bit
    check_generate(cm, model, adapters)
