"""LoRA added onto bases that are not a plain F.linear, end to end through fxlora.compile:
Falcon's ``input @ weight.T`` linears, bitsandbytes' 4-bit linears, torchao int8 / int4 / float8 weight-only linears (loaded
through transformers' ``TorchAoConfig``) and compressed-tensors and fine-grained FP8 checkpoints loaded dequantised, in mixed batches (a, None, b) against PEFT (which
wraps both) and against the exact decomposition; rows without an adapter equal the model's
own output bit for bit, in the lora and the nolora variant. float32: 1e-5 relative error per
row (``fxlora.testing.RTOL``). Also the compile-time refusals, each naming the quantisation
method and the module."""

import copy

import pytest
import torch
from peft import LoraConfig
from transformers import AutoConfig, AutoModelForCausalLM

import fxlora
from fxlora.testing import (
    assert_matches_decomposition,
    assert_matches_peft,
    make_adapter,
    peft_model_with,
    quantized_model,
    reference_generate,
    tiny_model,
)

LORA_DELTA = torch.ops.fxlora.lora_delta.default
NAMES = ["a", None, "b"]


def inputs(rows=3, length=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    return dict(input_ids=ids, attention_mask=mask)


def adapters_for(model, subset):
    return {
        "a": make_adapter(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), seed=1, directory=""),
        "b": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=subset, use_rslora=True), seed=2, directory=""),
    }


def check_base_rows(cm, model, batch, out):
    """Rows without an adapter: the model's own output, bit for bit, in both variants."""
    with torch.no_grad():
        base = model(**batch).logits
        nolora = cm(**batch, adapter_names=[None] * len(NAMES)).logits
    assert torch.equal(out[1], base[1])
    assert torch.equal(nolora, base)


def delta_modules(cm):
    return {fqn for fqn, op in cm.backend.rewritten.items() if op == "fxlora::lora_delta"}


def test_falcon_linears_get_the_delta_onto_their_matmul():
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "falcon", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=96, bias=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    assert type(model.transformer.h[0].mlp.dense_h_to_4h).__name__ == "FalconLinear"
    adapters = adapters_for(model, ["query_key_value", "dense_4h_to_h"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    batch = inputs()
    out = assert_matches_peft(cm, model, adapters, NAMES, **batch)
    check_base_rows(cm, model, batch, out)
    assert delta_modules(cm) == {n for n, m in model.named_modules() if type(m).__name__ == "FalconLinear"}
    # query_key_value and dense_h_to_4h read the same layer norm: one op for both
    assert sum(n.target is LORA_DELTA for r in cm.backend.routers if r.lora is not None for n in r.lora.graph.nodes) == 3 * 2
    assert "query_key_value + dense_h_to_4h" in cm.explain()


QUANT_TYPES = ["int8", "int4", "fp8"]


def quant_type(name):
    pytest.importorskip("torchao")
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    if name == "int8":
        return Int8WeightOnlyConfig()
    if name == "fp8":
        return Float8WeightOnlyConfig()  # float8_e4m3 weights, per-row scales
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))  # dense int4, runs on CPU


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=5, intermediate_size=64)  # int4 groups of 32 need widths divisible by 32


@pytest.mark.parametrize("quant", QUANT_TYPES)
def test_torchao_linears_keep_their_quantised_matmul(llama, quant):
    torch._dynamo.reset()
    model = quantized_model(llama, quant_type(quant))
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert type(weight).__module__.startswith("torchao")
    adapters = adapters_for(llama, ["q_proj", "v_proj", "down_proj"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    batch = inputs()
    out = assert_matches_peft(cm, model, adapters, NAMES, **batch)  # PEFT's TorchaoLoraLinear
    assert_matches_decomposition(cm, model, adapters, NAMES, **batch)
    check_base_rows(cm, model, batch, out)
    quantized = {n for n, m in model.named_modules() if type(getattr(m, "weight", None)).__module__.startswith("torchao")}
    assert delta_modules(cm) == quantized and set(cm.backend.rewritten) == quantized
    report = cm.explain()
    method = type(quant_type(quant)).__name__
    assert f"quantised (torchao {method}): {len(quantized)} targeted linear(s) keep their quantised matmul" in report
    assert f"LoRA delta onto the traced base of {len(quantized)} module(s): " in report
    assert "q_proj + k_proj + v_proj" in report and "gate_proj + up_proj" in report


def test_torchao_linears_under_inductor(llama):
    """Inductor traces the quantised matmuls through the subclass: both variants against the
    decomposition (rows without an adapter, in a mixed batch and in ``nolora``, included)."""
    torch._dynamo.reset()
    model = quantized_model(llama, quant_type("int8"))
    adapters = adapters_for(llama, ["q_proj", "v_proj", "down_proj"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8, inner="inductor")
    for names in (NAMES, [None] * len(NAMES)):
        assert_matches_decomposition(cm, model, adapters, names, **inputs())


def test_torchao_quantize_without_transformers_is_served(llama):
    """Weights that ``torchao.quantize_`` replaced, with no quantization_config: named "torchao"."""
    import copy

    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    torch._dynamo.reset()
    model = copy.deepcopy(llama)
    quantize_(model.model, quant_type("int8"))
    adapters = adapters_for(llama, ["o_proj"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    batch = inputs(seed=1)
    out = assert_matches_decomposition(cm, model, adapters, NAMES, **batch)
    check_base_rows(cm, model, batch, out)
    assert "quantised (torchao): 14 targeted linear(s)" in cm.explain()


@pytest.fixture(scope="module")
def wide_llama():
    """bitsandbytes quantises in blocks of 64 values: every width at least that."""
    return tiny_model("llama", seed=5, hidden_size=64, intermediate_size=128)


def bitsandbytes_model(llama, tmp_path, warm=True, **options):
    """``llama`` quantised by bitsandbytes on the CPU. Its CPU backend repacks the 4-bit weights
    on the first forward (``warm`` runs it): a graph traced through that repack is no plain
    linear region, and a deep copy of a repacked model (as the PEFT oracle makes) computes
    something else, so the oracle gets a model of its own, copied before any forward."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    if not (tmp_path / "config.json").exists():
        llama.save_pretrained(tmp_path)
    config = BitsAndBytesConfig(**options)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu").eval()
    if warm:
        with torch.no_grad():
            model(**inputs())
    return model


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_bitsandbytes_4bit_linears_keep_their_quantised_matmul(wide_llama, tmp_path, storage):
    """QLoRA's base: nf4 weights through transformers' BitsAndBytesConfig, against PEFT's
    bitsandbytes LoRA layers; packed in bytes or in bfloat16 (``bnb_4bit_quant_storage``), the
    LoRA is kept in the layers' compute dtype, not in their storage's."""
    torch._dynamo.reset()
    nf4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)
    model = bitsandbytes_model(wide_llama, tmp_path, **nf4)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    adapters = adapters_for(wide_llama, ["q_proj", "v_proj", "down_proj"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    batch = inputs()
    out = assert_matches_peft(cm, bitsandbytes_model(wide_llama, tmp_path, warm=False, **nf4), adapters, NAMES, **batch)
    assert_matches_decomposition(cm, model, adapters, NAMES, **batch)
    check_base_rows(cm, model, batch, out)
    assert delta_modules(cm) == set(cm.backend.rewritten) and len(delta_modules(cm)) == 14
    assert "quantised (bitsandbytes): 14 targeted linear(s) keep their quantised matmul" in cm.explain()


def test_bitsandbytes_8bit_linears_are_refused_at_compile_time(llama, tmp_path):
    model = bitsandbytes_model(llama, tmp_path, load_in_8bit=True)
    with pytest.raises(fxlora.QuantizationError, match=r"quantised \(bitsandbytes\).*\(Linear8bitLt, weight Int8Params"):
        fxlora.compile(model, adapters=adapters_for(llama, ["q_proj"]), max_loras=2, max_rank=8)
    import bitsandbytes as bnb  # the same layer swapped in by hand, with no quantization_config

    model = copy.deepcopy(llama)
    old = model.model.layers[0].self_attn.q_proj
    new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=False, has_fp16_weights=False)
    new.weight = bnb.nn.Int8Params(old.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    model.model.layers[0].self_attn.q_proj = new
    with pytest.raises(fxlora.QuantizationError, match=r"quantised \(bitsandbytes\).*\(Linear8bitLt"):
        fxlora.compile(model, adapters=adapters_for(llama, ["q_proj"]), max_loras=2, max_rank=8)


def test_base_weights_an_adapter_carries_for_a_quantised_module_are_refused_by_name(llama):
    """PEFT saves an output head's weight beside its LoRA (save_embedding_layers): against a
    head torchao quantised, it cannot be told equal to the model's."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch._dynamo.reset()
    model = copy.deepcopy(llama)
    quantize_(model, Int8WeightOnlyConfig())  # every linear, the output head too
    config, state = make_adapter(llama, LoraConfig(r=4, target_modules=["lm_head", "q_proj"]), 4, "")
    state["base_model.model.lm_head.base_layer.weight"] = llama.lm_head.weight.detach().clone()
    with pytest.raises(fxlora.AdapterError, match=r"module 'lm_head': the adapter carries base weights.*quantised \(Int8Tensor\)"):
        fxlora.compile(model, adapters={"h": (config, state)}, max_loras=2, max_rank=8)


@pytest.mark.parametrize("base", ["torchao int8", "bitsandbytes nf4"])
def test_greedy_generation_on_a_quantised_base_matches_peft(base, llama, wide_llama, tmp_path):
    """Batched greedy generate, rows of different adapters and none, token for token against
    transformers' generate with PEFT over the same quantised base, one row at a time."""
    torch._dynamo.reset()
    if base == "torchao int8":
        source = llama
        model = oracle_base = quantized_model(llama, quant_type("int8"))
    else:
        source = wide_llama
        nf4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        model = bitsandbytes_model(wide_llama, tmp_path, **nf4)
        oracle_base = bitsandbytes_model(wide_llama, tmp_path, warm=False, **nf4)
    adapters = adapters_for(source, ["q_proj", "v_proj", "down_proj"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8, max_batch_size=4, max_len=24)
    batch = inputs()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tokens = cm.generate(ids, mask, adapter_names=NAMES, max_new_tokens=6, eos_token_id=2, pad_token_id=0)
    peft = peft_model_with(oracle_base, adapters)
    want = reference_generate(model, peft, NAMES, ids, mask, 6, 2, 0)
    assert torch.equal(tokens[:, -6:], want)


def test_the_request_stream_on_a_quantised_base_matches_peft(llama):
    """The request stream over a torchao int8 base: each request's tokens those of transformers'
    generate with PEFT over the same quantised base, that request alone."""
    torch._dynamo.reset()
    model = quantized_model(llama, quant_type("int8"))
    adapters = adapters_for(llama, ["q_proj", "v_proj", "down_proj"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15, 16, 17, 18]]
    cm._requests(dict(max_batch_size=2, max_len=24, block_size=4), None)  # fewer rows than requests: they queue
    names = [*NAMES, "a"]
    outs = cm.generate_batch(prompts, names, max_new_tokens=[5, 3, 6, 4], eos_token_id=(), progress_bar=False)
    peft = peft_model_with(quantized_model(llama, quant_type("int8")), adapters)
    for prompt, name, out in zip(prompts, names, outs):
        want = reference_generate(model, peft, [name], torch.tensor([prompt]), None, len(out.generated_tokens), None, 0)
        assert out.finish_reason == "length" and out.generated_tokens == want[0].tolist()


def test_a_packed_weight_of_another_method_is_refused_at_compile_time(llama):
    import copy

    model = copy.deepcopy(llama)
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    proj = model.model.layers[1].mlp.up_proj
    proj.weight = torch.nn.Parameter(proj.weight.to(torch.int8), requires_grad=False)  # as a packed weight is
    adapters = adapters_for(llama, ["up_proj"])
    with pytest.raises(fxlora.QuantizationError, match=r"quantised \(bitsandbytes\).*'model\.layers\.1\.mlp\.up_proj'"):
        fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)


def test_fine_grained_fp8_linears_are_refused_at_compile_time(llama):
    # transformers' FP8Linear holds a float8 weight in a plain parameter and runs a kernel of its own
    import copy

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = copy.deepcopy(llama)
    config = FineGrainedFP8Config()
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=config)
    model.to_empty(device="cpu")  # the FP8 linears were made on the meta device
    model.config.quantization_config = config
    adapters = adapters_for(llama, ["q_proj"])
    with pytest.raises(
        fxlora.QuantizationError,
        match=r"quantised \(fp8\).*'model\.layers\.0\.self_attn\.q_proj'.*float8.*FineGrainedFP8Config\(dequantize=True\)",
    ):
        fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)


def fine_grained_fp8_checkpoint(model, directory, block=16):
    """``model`` saved as a fine-grained FP8 checkpoint, as DeepSeek-V3 and Qwen3's FP8
    releases are: every linear but the head a float8 weight with one scale per ``block`` ×
    ``block`` tile (``weight_scale_inv``), scaled so the tile's largest weight is float8's
    largest; the config's ``quantization_config`` says ``fp8``."""
    import json

    from safetensors.torch import save_file

    model.save_pretrained(directory)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(".weight") and t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            rows, cols = t.shape
            tiles = t.float().reshape(rows // block, block, cols // block, block)
            scale = tiles.abs().amax(dim=(1, 3)) / 448
            tensors[name] = (tiles / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
        else:
            tensors[name] = t.contiguous()
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block], "activation_scheme": "dynamic"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_fine_grained_fp8_checkpoints_loaded_dequantised_are_served(llama, tmp_path):
    """The way out the refusal names: ``FineGrainedFP8Config(dequantize=True)`` (transformers'
    choice too on a machine without an FP8 GPU) loads the float8 tiles as plain linears."""
    from transformers import FineGrainedFP8Config

    torch._dynamo.reset()
    directory = fine_grained_fp8_checkpoint(llama, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear and q_proj.weight.dtype == torch.float32
    assert not torch.equal(q_proj.weight, llama.model.layers[0].self_attn.q_proj.weight)  # the float8 rounding
    adapters = adapters_for(llama, ["q_proj", "v_proj"])
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    batch = inputs()
    out = assert_matches_peft(cm, model, adapters, NAMES, **batch)
    check_base_rows(cm, model, batch, out)


def test_a_quantised_method_that_leaves_the_targets_alone_is_named(llama):
    import copy

    torch._dynamo.reset()
    model = copy.deepcopy(llama)
    model.config.quantization_config = {"quant_method": "fp8"}
    cm = fxlora.compile(model, adapters_for(llama, ["q_proj"]), max_loras=2, max_rank=8)
    assert "note: the base model is quantised (fp8); none of its targeted linears is quantised" in cm.explain()


def test_a_quantised_embedding_is_refused_at_compile_time(llama):
    import copy

    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    model = copy.deepcopy(llama)
    quantize_(model, quant_type("int8"), filter_fn=lambda m, fqn: fqn == "model.embed_tokens")
    adapter = make_adapter(llama, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), seed=3, directory="")
    with pytest.raises(fxlora.QuantizationError, match=r"quantised \(torchao\).*embedding 'model\.embed_tokens'"):
        fxlora.compile(model, {"a": adapter}, max_loras=2, max_rank=8)


def compressed_tensors_checkpoint(model, directory):
    """``model`` saved as an FP8 compressed-tensors checkpoint (``FP8_DYNAMIC``: float8 weights
    with per-channel scales, activations quantised per token at run time), as llm-compressor
    writes one; the scales from each row's largest weight."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="float-quantized"))
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight_scale"):
                m.weight_scale.copy_(m.weight.abs().amax(dim=1, keepdim=True).reshape(m.weight_scale.shape) / 448)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return directory


def test_compressed_tensors_fp8_checkpoints(llama, tmp_path):
    """As transformers loads it by default, compressed-tensors wraps each linear's forward to
    quantise its weight and input on every call: refused at compile time, naming the method,
    the module and the way out. Loaded with ``dequantize=True`` the model is dense and served
    (transformers 5.24; 5.17 keeps the quantising forward, and the model no quantization
    config: still refused, by the modules' own marks)."""
    import copy

    pytest.importorskip("compressed_tensors")
    from transformers import CompressedTensorsConfig

    torch._dynamo.reset()
    directory = compressed_tensors_checkpoint(copy.deepcopy(llama), tmp_path)
    adapters = adapters_for(llama, ["q_proj", "v_proj"])
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(fxlora.QuantizationError, match=r"quantised \(compressed-tensors\).*'model\.layers\.0\.self_attn\.q_proj'.*dequantize=True"):
        fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    config = CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=config).eval()
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    if getattr(model.model.layers[0].self_attn.q_proj, "quantization_scheme", None) is not None:
        # transformers 5.17 dequantises the weights but keeps the quantising forward: refused the same way
        with pytest.raises(fxlora.QuantizationError, match=r"quantised \(compressed-tensors\).*'model\.layers\.0\.self_attn\.q_proj'"):
            fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
        return
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    batch = inputs()
    out = assert_matches_peft(cm, model, adapters, NAMES, **batch)
    check_base_rows(cm, model, batch, out)
