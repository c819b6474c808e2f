"""LoRA on MoE experts: every family's experts region becomes fxlora::moe_lora, mixed batches
match PEFT (target_parameters adapters) and the merged-weights oracle (every format), and
the nolora graph is the base model bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig

import fxlora
from fxlora.adapters import experts
from fxlora.compiler.experts_probe import choose_layout, prove_region
from fxlora.errors import AdapterError, LoraNotRunError, NotServed
from fxlora.testing import (
    MOE_FAMILIES,
    assert_matches_peft,
    check_rows,
    make_adapter,
    merged_logits,
    peft_model_with,
    per_expert_adapter,
    reference_generate,
    row_errors,
    shared_outer,
    tiny_model,
)
from fxlora.testing.models import fill_zero_weights
from fxlora.testing.oracle import RTOL

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# attention (MLA's projections in DeepSeek-V3) and dense MLPs / shared experts, by module name
DENSE = {
    "deepseek_v3": ["q_a_proj", "kv_a_proj_with_mqa", "o_proj", "down_proj"],  # MLA projections, dense + shared MLPs
    "qwen2_moe": ["q_proj", "v_proj", "gate_proj", "up_proj", "shared_expert_gate"],  # the shared expert and its gate
}
DENSE_DEFAULT = ["q_proj", "v_proj", "gate_proj", "up_proj"]


def _model(family: str, implementation: str = "grouped_mm", **kw):
    model = tiny_model(family, seed=1, **kw)
    model.set_experts_implementation(implementation)
    return model


def _adapters(model, family, ranks=(4, 2)):
    targets = [t for t in DENSE.get(family, DENSE_DEFAULT) if any(n.endswith("." + t) for n, _ in model.named_modules())]
    return {
        name: make_adapter(model, LoraConfig(r=r, lora_alpha=r + 1, target_modules=targets, target_parameters=EXPERTS),
                           seed=10 + i, directory="", scale=0.4)
        for i, (name, r) in enumerate(zip("ab", ranks))
    }  # fmt: skip


def _check_merged(cm, model, adapters, names, ids):
    out = cm(input_ids=ids, adapter_names=names).logits
    ref = merged_logits(model, adapters, names, input_ids=ids)
    errors = row_errors(out, ref)
    assert max(errors) < 10 * RTOL[torch.float32], errors  # merging rounds W + BA once more than LoRA does
    base = model(input_ids=ids).logits
    for i, n in enumerate(names):  # the adapters do change their rows; None rows are the base model
        error = row_errors(out[i : i + 1], base[i : i + 1])[0]
        assert error < RTOL[torch.float32] if n is None else error > 1e-3, (i, n, error)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_mixed_batch_matches_peft_and_merged(family):
    torch._dynamo.reset()
    model = _model(family)
    adapters = _adapters(model, family)
    cm = fxlora.compile(model, adapters, max_loras=3, max_rank=8)
    ids = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(0))
    names = ["a", None, "b", "a"]
    with torch.no_grad():
        assert_matches_peft(cm, model, adapters, names, input_ids=ids)
        _check_merged(cm, model, adapters, names, ids)
        assert torch.equal(cm(input_ids=ids).logits, model(input_ids=ids).logits)  # nolora: bit for bit
    explain = cm.explain()
    assert "x moe_lora" in explain and "target_parameters" in explain
    experts_targets = [f for f, t in cm.pool.targets.items() if t.info.kind == "experts"]
    assert experts_targets and all(cm.backend.rewritten.get(f) == "fxlora::moe_lora" for f in experts_targets)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_batched_mm_implementation(family):
    torch._dynamo.reset()
    model = _model(family, "batched_mm")
    adapters = _adapters(model, family)
    cm = fxlora.compile(model, adapters, max_loras=3, max_rank=8)
    ids = torch.randint(3, 96, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_matches_peft(cm, model, adapters, ["b", "a", None], input_ids=ids)
        assert torch.equal(cm(input_ids=ids).logits, model(input_ids=ids).logits)


def test_eager_experts_are_switched_to_a_traceable_implementation():
    torch._dynamo.reset()
    model = _model("olmoe", "eager")
    adapters = _adapters(model, "olmoe")
    cm = fxlora.compile(model, adapters, max_loras=2, max_rank=8)
    ids = torch.randint(3, 96, (2, 4))
    with torch.no_grad():
        assert_matches_peft(cm, model, adapters, ["a", "b"], input_ids=ids)
    assert model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("family, names", [("qwen3_moe", ("gate_proj", "up_proj", "down_proj")), ("mixtral", ("w1", "w3", "w2"))])
def test_formats_mixed_in_one_pool(family, names):
    """Per-expert modules, shared-outer (either factor shared) and target_parameters
    adapters served together, each row against the merged oracle of its adapter."""
    torch._dynamo.reset()
    model = _model(family)
    peft_style = _adapters(model, family, ranks=(3, 2))
    adapters = {
        "per_expert": per_expert_adapter(model, 2, seed=3, names=names),
        "shared_a": shared_outer(peft_style["a"], "A"),
        "shared_b": shared_outer(peft_style["b"], "B"),
        "peft": peft_style["a"],
    }
    cm = fxlora.compile(model, adapters, max_loras=4, max_rank=8)
    ids = torch.randint(3, 96, (5, 5), generator=torch.Generator().manual_seed(2))
    rows = ["per_expert", "shared_a", None, "peft", "shared_b"]
    with torch.no_grad():
        _check_merged(cm, model, adapters, rows, ids)
    explain = cm.explain()
    for fmt in ("per-expert modules", "shared-outer", "target_parameters"):
        assert fmt in explain


def test_hot_swap_without_retrace():
    torch._dynamo.reset()
    model = _model("qwen3_moe")
    adapters = _adapters(model, "qwen3_moe")
    cm = fxlora.compile(model, {"a": adapters["a"]}, max_loras=2, max_rank=8, target_modules=["q_proj", "v_proj", *EXPERTS])
    ids = torch.randint(3, 96, (2, 5))
    with torch.no_grad():
        cm(input_ids=ids, adapter_names=["a", None])
        compiles = cm.compile_count
        cm.load_adapter(adapters["b"], adapter_name="b")
        cm.unload_adapter("a")
        cm.load_adapter(adapters["a"], adapter_name="a")
        assert_matches_peft(cm, model, adapters, ["b", "a"], input_ids=ids)
    assert cm.compile_count == compiles


def test_experts_shape_mismatch_names_parameter_and_shapes():
    model = _model("qwen3_moe")
    config, state = _adapters(model, "qwen3_moe")["a"]
    bad = {k: (v[:, :-1] if "experts.lora_A" in k else v) for k, v in state.items()}
    with pytest.raises(AdapterError, match=r"experts\.down_proj has lora_A \(16, 23\).*needs"):
        fxlora.compile(model, {"bad": (config, bad)}, max_rank=8)


def test_target_parameters_through_torch_compile_names_the_way_out():
    model = _model("qwen3_moe")
    adapters = _adapters(model, "qwen3_moe")
    compiled = torch.compile(model, backend="fxlora", options={"adapters": adapters, "max_rank": 8})
    with pytest.raises(Exception, match="target_parameters.*fxlora.compile"), fxlora.use_adapters(["a"]):
        compiled(input_ids=torch.randint(3, 96, (1, 4)))
    torch._dynamo.reset()


@pytest.mark.long
@settings(deadline=None)
@given(
    family=st.sampled_from(sorted(MOE_FAMILIES)),
    experts=st.integers(2, 6),
    data=st.data(),
)
def test_property_mixed_batches(family, experts, data):
    """Random families, expert counts, top-k, ranks, adapter formats and batch mixes (None rows
    included) against the merged oracle."""
    top_k = data.draw(st.integers(1, experts), label="top_k")
    counts = {"deepseek_v3": "n_routed_experts", "gpt_oss": "num_local_experts", "mixtral": "num_local_experts"}
    overrides = {counts.get(family, "num_experts"): experts, "num_experts_per_tok": top_k}
    if family == "deepseek_v3":
        overrides.update(n_group=1, topk_group=1)
    torch._dynamo.reset()
    model = tiny_model(family, seed=data.draw(st.integers(0, 99), label="seed"), num_hidden_layers=2, **overrides)
    ranks = data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=2), label="ranks")
    adapters = _adapters(model, family, ranks=ranks)
    fmt = data.draw(st.sampled_from(["target_parameters", "shared A", "shared B", "per-expert"]), label="format of b")
    if fmt.startswith("shared"):
        adapters["b"] = shared_outer(adapters["b"], fmt[-1])
    elif fmt == "per-expert":
        adapters["b"] = per_expert_adapter(model, ranks[1], seed=5)
    rows = data.draw(st.lists(st.sampled_from(["a", "b", None]), min_size=1, max_size=4), label="rows")
    cm = fxlora.compile(copy.deepcopy(model), adapters, max_loras=2, max_rank=12)  # per-expert gate+up: 2 r
    ids = torch.randint(3, 96, (len(rows), data.draw(st.integers(1, 6), label="length")))
    with torch.no_grad():
        out = cm(input_ids=ids, adapter_names=rows).logits
        ref = merged_logits(model, adapters, rows, input_ids=ids)
    assert max(row_errors(out, ref)) < 10 * RTOL[torch.float32]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_generate_equals_peft_greedy(family):
    """Decode steps through the runtime (DeepSeek's cache holds compressed MLA latents)."""
    torch._dynamo.reset()
    model = _model(family)
    adapters = _adapters(model, family)
    cm = fxlora.compile(model, adapters, max_loras=2, max_rank=8, max_batch_size=4, max_len=32)
    ids = torch.randint(3, 96, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    names = ["a", None, "b"]
    out = cm.generate(ids, mask, adapter_names=names, max_new_tokens=8, eos_token_id=())
    peft_model = peft_model_with(model, adapters)
    assert torch.equal(out[:, -8:], reference_generate(model, peft_model, names, ids, mask, 8, None, 0))


def test_experts_with_a_gate_the_op_does_not_know_are_refused_at_compile_time():
    torch._dynamo.reset()
    model = _model("qwen3_moe", "eager")
    owner = next(n for n, m in model.named_modules() if n.endswith("mlp.experts"))
    model.get_submodule(owner).is_concatenated = False  # interleaved halves without GPT-OSS's gate: no known layout
    with pytest.raises(AdapterError, match=rf"experts module '{owner}' is targeted \(adapter\(s\) \['a', 'b'\]\), "
                       r"but its gate \(Qwen3MoeExperts._apply_gate, act_fn SiLUActivation\) is not one fxlora::moe_lora knows"):
        fxlora.compile(model, _adapters(model, "qwen3_moe"), max_loras=2, max_rank=8)
    assert model.config._experts_implementation == "eager"  # a refused compile leaves the model as it was


def _wrong_activation(monkeypatch):
    """Make lora_moe read every experts module's activation as GELU, whatever it is."""
    lora_moe = importlib.import_module("fxlora.passes.lora_moe")  # the package exports the pass by this name
    chosen = lora_moe.choose_layout
    monkeypatch.setattr(lora_moe, "choose_layout", lambda m: dataclasses.replace(chosen(m), act="gelu"))


def test_a_layout_the_probe_disproves_is_left_alone_and_named(monkeypatch):
    """Rows without an adapter run the op in a mixed batch: a layout that does not compute as
    the module does (here a wrong activation) must never replace the region."""
    torch._dynamo.reset()
    _wrong_activation(monkeypatch)
    model = _model("qwen3_moe")
    owners = [n for n, m in model.named_modules() if n.endswith("mlp.experts")]
    cm = fxlora.compile(model, _adapters(model, "qwen3_moe"), max_loras=2, max_rank=8)
    ids = torch.randint(3, 96, (2, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(cm(input_ids=ids, adapter_names=[None, None]).logits, model(input_ids=ids).logits)
        with pytest.raises(LoraNotRunError, match=r"did not run: fxlora left that module as traced, because "
                           r"fxlora::moe_lora with the layout read from it \(transposed=False, gate='glu', act='gelu'\) "
                           r"differs from Qwen3MoeExperts.forward by"):
            cm(input_ids=ids, adapter_names=["a", None])
    explain = cm.explain()
    assert all(f"skipped {o}: fxlora::moe_lora with the layout read from it" in explain for o in owners)
    assert not any(f"{o}.down_proj" in cm.backend.rewritten for o in owners)


def _probe_inputs(module, tokens=5, top_k=2):
    """What prove_region reads of the traced inputs (dtypes, top-k), and a pool bundle."""
    experts_count, out, fin = module.gate_up_proj.shape
    traced = (torch.empty(tokens, fin), torch.empty(tokens, top_k, dtype=torch.long), torch.empty(tokens, top_k))
    bundle = [torch.zeros(1, experts_count, 2, fin), torch.zeros(1, experts_count, out, 2), torch.zeros(1),
              torch.zeros(1, dtype=torch.int32)]  # fmt: skip
    return traced, bundle


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_region_probe_checks_the_op_against_the_modules_forward(family):
    model = _model(family)
    module = next(m for m in model.modules() if experts.is_experts(m))
    traced, bundle = _probe_inputs(module)
    layout = choose_layout(module)
    prove_region(module, layout, traced, bundle, [])
    wrong = [dataclasses.replace(layout, transposed=not layout.transposed)]
    wrong += [dataclasses.replace(layout, act="gelu")] if layout.act else [dataclasses.replace(layout, params=(1.0, *layout.params[1:]))]
    for bad in wrong:
        with pytest.raises(NotServed, match=rf"differs from {type(module).__name__}.forward|does not run"):
            prove_region(module, bad, traced, bundle, [])


EXPERTS_CLASSES = [  # (modeling module, config class, experts class, config fields, the layout's gate and act)
    ("hy_v4", "HYV4Config", "HYV4Experts", dict(num_local_experts=4, moe_intermediate_size=8), ("glu_clamped", "silu")),
    ("minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLExperts", dict(num_local_experts=4, intermediate_size=8),
     ("glu_concatenated_clamped", "")),
    ("gpt_oss", "GptOssConfig", "GptOssExperts", dict(num_local_experts=4, intermediate_size=8),
     ("glu_interleaved_clamped", "")),
    ("aria", "AriaTextConfig", "AriaExperts", dict(moe_num_experts=4, intermediate_size=8, hidden_act="gelu"),
     ("glu", "silu")),
    ("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeExperts", dict(num_experts=4, moe_intermediate_size=8), ("glu", "silu")),
    ("nemotron_h", "NemotronHConfig", "NemotronHExperts",
     dict(n_routed_experts=4, moe_intermediate_size=8, mlp_hidden_act="relu2"), ("act", "relu2")),
    ("inkling2", "Inkling2TextConfig", "Inkling2Experts", dict(n_routed_experts=4, moe_intermediate_size=8),
     ("glu_softcapped", "")),
]  # fmt: skip


@pytest.mark.parametrize("family, config_class, experts_class, fields, expected", EXPERTS_CLASSES)
def test_the_layout_is_what_the_module_computes(family, config_class, experts_class, fields, expected):
    """Each class's own gate picks the layout, and the op with it gives the module's forward
    output."""
    import transformers

    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    config = getattr(transformers, config_class)(hidden_size=16, num_attention_heads=2, **fields)
    config._experts_implementation = "eager"
    module = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), experts_class)(config)
    if not experts.is_experts(module):
        pytest.skip(f"{experts_class} is not a transformers experts module in {transformers.__version__}")
    torch.manual_seed(0)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layout = choose_layout(module)
    assert (layout.gate, layout.act) == expected
    up = experts.experts_parameters(module)["gate_up_proj" if module.has_gate else "up_proj"]
    fin, fout = experts.in_out(module, up)
    bundle = [torch.zeros(1, 4, 2, fin), torch.zeros(1, 4, fout, 2), torch.zeros(1), torch.zeros(1, dtype=torch.int32)]
    prove_region(module, layout, (torch.empty(3, fin), torch.empty(3, 2, dtype=torch.long), torch.empty(3, 2)), bundle, [])


def test_a_gate_the_op_does_not_know_is_refused_by_name():
    """Inkling2's experts with their softcapped SwiGLU swapped for a gate of no known form."""
    import transformers

    if not hasattr(transformers, "Inkling2TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no inkling2")
    from transformers.models.inkling2.modeling_inkling2 import Inkling2Experts

    class SquaredGate(torch.nn.Module):
        def forward(self, gate, up):
            return gate * up**2

    module = Inkling2Experts(transformers.Inkling2TextConfig(hidden_size=16, num_attention_heads=2, n_routed_experts=4, moe_intermediate_size=8))
    module.act_fn = SquaredGate()
    with pytest.raises(NotServed, match=r"its gate \(Inkling2Experts._apply_gate, act_fn SquaredGate\) is not one"):
        choose_layout(module)


def _aria(**overrides):
    from transformers import AriaTextConfig, AriaTextForCausalLM

    torch.manual_seed(0)
    config = AriaTextConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=16, intermediate_size=24, vocab_size=96, moe_num_experts=4, moe_topk=2,
                            moe_num_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)  # fmt: skip
    model = AriaTextForCausalLM(config).eval()
    fill_zero_weights(model, 0.5)
    if any(experts.is_experts(m) for m in model.modules()):  # an older transformers' Aria has its own MoE
        model.set_experts_implementation("grouped_mm")
    return model


def test_the_activation_is_the_modules_not_the_configs():
    """Aria's experts hard-code SiLU whatever the config's hidden_act names: the layout takes
    the activation the module computes, and every row, None rows included, matches."""
    torch._dynamo.reset()
    model = _aria(hidden_act="gelu")
    module = next((m for m in model.modules() if experts.is_experts(m)), None)
    if module is None:
        pytest.skip("this transformers' Aria has no transformers experts module")
    assert choose_layout(module).act == "silu" and model.config.hidden_act == "gelu"
    adapters = _adapters(model, "aria")
    cm = fxlora.compile(model, adapters, max_loras=2, max_rank=8)
    ids = torch.randint(3, 96, (4, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_matches_peft(cm, model, adapters, ["a", None, "b", None], input_ids=ids)
    experts_targets = [f for f, t in cm.pool.targets.items() if t.info.kind == "experts"]
    assert experts_targets and all(cm.backend.rewritten.get(f) == "fxlora::moe_lora" for f in experts_targets)


def _merge_per_expert_by_hand(model, adapter, names):
    """The per-expert format's meaning, written out independently of fxlora: expert e's gate
    LoRA changes the gate rows of its fused gate_up_proj (the first half, or the even rows
    when interleaved), its up LoRA the up rows, its down LoRA its down_proj."""
    config, state = adapter
    merged = copy.deepcopy(model)
    scaling = config.lora_alpha / config.r
    for fqn, module in merged.named_modules():
        if not hasattr(module, "gate_up_proj"):
            continue
        gate_up, down = module.gate_up_proj.data, module.down_proj.data
        for e in range(gate_up.shape[0]):
            for proj, name in zip(("gate", "up", "down"), names):
                prefix = f"base_model.model.{fqn}.{e}.{name}"
                delta = scaling * state[f"{prefix}.lora_B.weight"] @ state[f"{prefix}.lora_A.weight"]  # (out, in)
                w = down[e] if proj == "down" else gate_up[e]
                w = w.T if module.is_transposed else w  # as (out, in)
                if proj == "down":
                    w += delta
                elif module.is_concatenated:
                    half = w.shape[0] // 2
                    w[:half] += delta if proj == "gate" else 0
                    w[half:] += delta if proj == "up" else 0
                else:
                    w[0 if proj == "gate" else 1 :: 2] += delta
    return merged


@pytest.mark.parametrize("family, names", [("qwen3_moe", ("gate_proj", "up_proj", "down_proj")), ("gpt_oss", ("gate_proj", "up_proj", "down_proj")), ("mixtral", ("w1", "w3", "w2"))])
def test_per_expert_format_against_a_hand_merge(family, names):
    torch._dynamo.reset()
    model = _model(family)
    adapter = per_expert_adapter(model, 3, seed=8, names=names)
    cm = fxlora.compile(model, {"x": adapter}, max_loras=1, max_rank=8)
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = cm(input_ids=ids, adapter_names=["x", None]).logits
        want = _merge_per_expert_by_hand(model, adapter, names)(input_ids=ids).logits
    assert row_errors(out[:1], want[:1])[0] < 10 * RTOL[torch.float32]
    assert row_errors(out[:1], model(input_ids=ids[:1]).logits)[0] > 1e-3


def _longcat_flash():
    """LongCat-Flash, whose experts loop over the routing (transformers gives them no other
    implementation), with two identity ("zero-computation") experts beside four routed ones."""
    if "longcat_flash" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no LongCat-Flash")
    config = transformers.LongcatFlashConfig(
        hidden_size=32, head_dim=4, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=24,
        num_attention_heads=2, num_key_value_heads=2, ffn_hidden_size=48, expert_ffn_hidden_size=12, moe_topk=2,
        n_routed_experts=4, zero_expert_num=2, num_layers=2, vocab_size=99, routed_scaling_factor=1.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LongcatFlashForCausalLM(config).float().eval()
    fill_zero_weights(model, 0.5)
    return model


def test_longcat_flashs_loop_experts_with_identity_experts_match_peft():
    """Experts with no transformers implementation compute by fxlora::moe_lora, proven against
    their own loop; a route to an identity expert adds its weighted input, with no LoRA."""
    torch._dynamo.reset()
    model = _longcat_flash()
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj"], target_parameters=EXPERTS), seed=1, directory=""),
        "b": make_adapter(model, LoraConfig(r=2, use_rslora=True, target_parameters=EXPERTS[1:]), seed=2, directory=""),
    }  # fmt: skip
    ids = torch.randint(3, 99, (4, 7), generator=torch.Generator().manual_seed(3))
    names = ["a", None, "b", "a"]
    with torch.no_grad():  # PEFT over the experts' own loop, before fxlora gives them the op
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6  # up holds the identity experts' rows too
        want = {n: (model if n is None else peft_model_with(model, {n: adapters[n]}))(input_ids=ids).logits for n in set(names)}
    cm = fxlora.compile(model, adapters, max_loras=3, max_rank=8)
    with torch.no_grad():
        out = cm(input_ids=ids, adapter_names=names).logits
    for name in set(names):
        rows = [i for i, n in enumerate(names) if n == name]
        check_rows(out[rows], want[name][rows], [name] * len(rows))
    assert "Not served:\n  nothing" in cm.explain()
    assert "2 x moe_lora" in cm.explain()


class Sine(torch.nn.Module):
    def forward(self, x):
        return x.sin()


def test_loop_experts_the_op_cannot_compute_are_refused_by_name():
    torch._dynamo.reset()
    model = _longcat_flash()
    experts_module = model.model.layers[0].mlp.experts
    experts_module.act_fn = Sine()  # no activation the op knows
    adapter = make_adapter(model, LoraConfig(r=2, target_parameters=EXPERTS), seed=1, directory="")
    with pytest.raises(AdapterError, match=r"experts module 'model.layers.0.mlp.experts' is targeted .*its gate "
                       r"\(LongcatFlashExperts.forward, act_fn Sine\) is not one fxlora::moe_lora knows"):
        fxlora.compile(model, {"a": adapter}, max_loras=2, max_rank=4)
    assert "forward" not in vars(experts_module)  # a refused compile leaves the experts' loop ...
    assert not any(hasattr(experts_module, flag) for flag in ("has_gate", "is_transposed"))  # ... and no flag
