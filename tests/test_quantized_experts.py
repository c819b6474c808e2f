"""LoRA on quantised MoE experts, end to end through fxlora.compile: torchao int8 and float8
weight-only experts (transformers' ``TorchAoConfig`` with ``FqnToConfig`` on the experts'
parameters) run ``fxlora::moe_lora`` on the subclass's own GEMMs, with the deltas after each
GEMM. Checked against the exact decomposition (the quantised model's own eager experts loop
with the reference delta added onto each expert's GEMM; PEFT cannot run ``target_parameters``
on these weights), in float32 (1e-5 relative error per row); the nolora variant equals the
quantised model's eager loop bit for bit."""

import pytest
import torch
from peft import LoraConfig
from test_delta_on_top import inputs

import fxlora
from fxlora.compiler import experts_op
from fxlora.testing import assert_matches_decomposition, decomposed_logits, make_adapter, quantized_model, tiny_model
from fxlora.testing.oracle import row_errors

NAMES = ["a", None, "b"]
MOE_LORA = "fxlora::moe_lora"

pytest.importorskip("torchao")


def experts_config(kind):
    from torchao.quantization import Float8WeightOnlyConfig, FqnToConfig, Int8WeightOnlyConfig

    config = Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig()
    return FqnToConfig({rf"re:.*experts\.{p}": config for p in ("gate_up_proj", "down_proj")})


@pytest.fixture(scope="module")
def moe():
    return tiny_model("qwen3_moe", seed=2, intermediate_size=64, moe_intermediate_size=32)


def quantized_pair(moe, kind):
    """The quantised model to compile, and its twin running transformers' eager experts loop."""
    return [quantized_model(moe, experts_config(kind), experts_implementation="eager") for _ in range(2)]


def experts_adapters(moe):
    both = ["experts.gate_up_proj", "experts.down_proj"]
    return {
        "a": make_adapter(moe, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=both), seed=1, directory=""),
        "b": make_adapter(moe, LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=both[1:]), seed=2, directory=""),
    }


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantised_experts_carry_lora(moe, kind):
    torch._dynamo.reset()
    model, twin = quantized_pair(moe, kind)
    assert type(model.model.layers[0].mlp.experts.gate_up_proj).__module__.startswith("torchao")
    adapters = experts_adapters(moe)
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    assert model.config._experts_implementation == experts_op.NAME
    batch = inputs()
    out = assert_matches_decomposition(cm, twin, adapters, NAMES, **batch)
    # the oracle's experts deltas are there: without them the adapter rows are far off
    experts_only = decomposed_logits(twin, adapters, NAMES, **batch)
    with torch.no_grad():
        base = twin(**batch).logits
        nolora = cm(**batch, adapter_names=[None] * len(NAMES)).logits
    assert min(row_errors(experts_only, base, batch["attention_mask"])[i] for i in (0, 2)) > 1e-3
    assert torch.equal(nolora, base)
    # the row without an adapter: the other rows' routing sets how many tokens each expert's GEMM
    # takes, and a CPU GEMM's rounding of a row may depend on that
    torch.testing.assert_close(out[1], base[1], rtol=1e-5, atol=1e-6)
    experts = {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    assert {fqn for fqn, op in cm.backend.rewritten.items() if op == MOE_LORA} == experts
    held = {"int8": "Int8Tensor int8", "fp8": "Float8Tensor float8_e4m3fn"}[kind]  # the experts' quantisation, named
    assert (
        f"2 experts module(s) with quantised parameters (model.layers.*.mlp.experts: {held}) run fxlora::moe_lora on "
        "the quantised weights' own GEMMs" in cm.explain()
    ), cm.explain()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantised_experts_under_inductor(moe, kind):
    """Inductor compiles the experts as ``fxlora::moe_lora``'s composition (they read a tensor
    subclass): int8 weights have no transpose or grouped GEMM, so their own ``dequantize()``
    feeds the grouped GEMM, in float32 ``fxlora::grouped_mm`` (ATen's does not trace there).
    Both variants: a mixed batch runs ``lora``, a batch without adapters ``nolora``, the
    model's own traced experts call."""
    torch._dynamo.reset()
    model, twin = quantized_pair(moe, kind)
    adapters = experts_adapters(moe)
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8, inner="inductor")
    for names in (NAMES, [None] * len(NAMES)):
        assert_matches_decomposition(cm, twin, adapters, names, **inputs())


def test_the_op_on_quantised_experts_traces_its_computation(moe):
    """Traced through the subclass (AOTAutograd desugars a subclass input into its inner
    tensors), ``fxlora::moe_lora`` on quantised experts records its computation, not the
    empty tensor of its fake."""
    from fxlora.adapters import experts

    torch._dynamo.reset()
    model, _ = quantized_pair(moe, "int8")
    experts_op.serve_quantized(model, "torchao")
    module = model.model.layers[0].mlp.experts
    up, down = experts.experts_parameters(module).values()
    layout = getattr(module, experts_op.LAYOUT)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, moe.config.hidden_size, generator=generator)
    index = torch.randint(0, up.shape[0], (6, 2), generator=generator)
    weights = torch.rand(6, 2, generator=generator)

    def experts_call(hidden, index, weights, up, down):
        no_adapter = torch.full((hidden.shape[0],), -1, dtype=torch.int32)
        return torch.ops.fxlora.moe_lora(hidden, index, weights, up, None, down, None, [], [], no_adapter, layout)

    eager = experts_call(hidden, index, weights, up, down)
    traced = torch.compile(experts_call, backend="aot_eager", fullgraph=True)(hidden, index, weights, up, down)
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)


def test_hot_swapped_adapter_on_quantised_experts(moe):
    torch._dynamo.reset()
    model, twin = quantized_pair(moe, "int8")
    adapters = experts_adapters(moe)
    cm = fxlora.compile(model, adapters={"a": adapters["a"]}, max_loras=2, max_rank=8)
    batch = inputs()
    assert_matches_decomposition(cm, twin, adapters, ["a", None, "a"], **batch)
    compiles = cm.compile_count
    cm.load_adapter(adapters["b"], adapter_name="b")
    assert_matches_decomposition(cm, twin, adapters, NAMES, **batch)
    assert cm.compile_count == compiles


def test_greedy_generation_on_quantised_experts_matches_the_decomposition(moe):
    """Batched greedy generate against greedy decoding of each row's own prompt with the
    decomposition oracle (the whole sequence re-run each step), token for token."""
    torch._dynamo.reset()
    model, twin = quantized_pair(moe, "int8")
    adapters = experts_adapters(moe)
    cm = fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8, max_batch_size=4, max_len=24)
    batch = inputs()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    steps = 5
    tokens = cm.generate(ids, mask, adapter_names=NAMES, max_new_tokens=steps, pad_token_id=0)
    for row, name in enumerate(NAMES):
        sequence = ids[row][mask[row].bool()][None]
        for _ in range(steps):
            logits = decomposed_logits(twin, adapters, [name], input_ids=sequence)
            sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(tokens[row, -steps:], sequence[0, -steps:]), f"row {row} ({name!r})"


def test_experts_quantised_otherwise_are_refused_when_targeted(moe):
    """A float8 experts weight in a plain parameter (as transformers' fine-grained FP8 holds
    one) is no torchao subclass: LoRA on those experts is refused naming the parameter; without
    it the experts keep the model's implementation."""
    import copy

    torch._dynamo.reset()
    model = copy.deepcopy(moe)
    model.config.quantization_config = {"quant_method": "fp8"}
    model.set_experts_implementation("eager")
    experts = model.model.layers[1].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.to(torch.float8_e4m3fn), requires_grad=False)
    adapters = experts_adapters(moe)
    with pytest.raises(fxlora.QuantizationError, match=r"quantised \(fp8\).*'model\.layers\.1\.mlp\.experts\.gate_up_proj'.*float8"):
        fxlora.compile(model, adapters=adapters, max_loras=2, max_rank=8)
    assert model.config._experts_implementation == "eager"
    config, state = adapters["b"]  # LoRA on the torchao-free experts of layer 0 only: all experts keep the eager loop
    layer0 = {"b": (config, {k: v for k, v in state.items() if ".layers.1." not in k})}
    with pytest.raises(fxlora.QuantizationError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj', but the experts 'model\.layers\.1\.mlp\.experts'"):
        fxlora.compile(model, adapters=layer0, max_loras=2, max_rank=8)
    attention = {"a": make_adapter(moe, LoraConfig(r=4, target_modules=["q_proj"]), seed=3, directory="")}
    cm = fxlora.compile(model, adapters=attention, max_loras=2, max_rank=8)
    assert model.config._experts_implementation == "eager"
    assert "1 experts module(s) with quantised parameters (model.layers.*.mlp.experts) keep the model's experts implementation" in cm.explain()


def test_int8_experts_stored_transposed_are_refused():
    """GPT-OSS stores its experts (E, in, out): int8 weights there need a matmul Int8Tensor
    lacks, so neither the model's loop nor fxlora::moe_lora runs them. Refused at compile
    time, naming the method, the module and the missing op; the model stays as it was."""
    torch._dynamo.reset()
    dense = tiny_model("gpt_oss", seed=2)
    assert dense.model.layers[0].mlp.experts.is_transposed
    model = quantized_model(dense, experts_config("int8"), experts_implementation="eager")
    attention = {"a": make_adapter(dense, LoraConfig(r=2, target_modules=["q_proj"]), seed=1, directory="")}
    with pytest.raises(fxlora.QuantizationError, match=r"\(torchao FqnToConfig\).*'model\.layers\.0\.mlp\.experts' holds Int8Tensor.*aten\.mm"):
        fxlora.compile(model, attention, max_loras=2, max_rank=8)
    assert model.config._experts_implementation == "eager"


@pytest.mark.long
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_float8_experts_stored_transposed_serve_rows_without_adapters(inner):
    """GPT-OSS's float8 experts (E, in, out): the composition dequantises them (torchao's
    grouped GEMM refuses that layout on CUDA). Rows without an adapter, in a mixed batch and in
    ``nolora``, equal the quantised model's eager loop (the decomposition oracle does not
    read transposed experts)."""
    torch._dynamo.reset()
    dense = tiny_model("gpt_oss", seed=2)
    model, twin = (quantized_model(dense, experts_config("fp8"), experts_implementation="eager") for _ in range(2))
    both = ["experts.gate_up_proj", "experts.down_proj"]
    adapters = {"a": make_adapter(dense, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=both), seed=1, directory="")}
    cm = fxlora.compile(model, adapters, max_loras=2, max_rank=8, inner=inner)
    batch = inputs()
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        base = twin(**batch).logits
        nolora = cm(**batch, adapter_names=[None] * 3).logits
        mixed = cm(**batch, adapter_names=["a", None, "a"]).logits
    torch.testing.assert_close(nolora[mask], base[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[1][mask[1]], base[1][mask[1]], rtol=1e-5, atol=1e-6)
    assert (mixed[0][mask[0]] - base[0][mask[0]]).abs().max() > 1e-3  # the adapter's rows differ
