"""PEFT ``target_parameters`` LoRA placed on the model: ``all-linear`` adapters on MoE models
(PEFT turns them into bare parameter names, the router's 2-D ``gate.weight`` and a rank
pattern for the fused ``gate_up_proj``), LoRA of a router's weight served as the router's
linear LoRA, each parameter's rank through PEFT's pattern lookup by its path, and refusals
that name the adapter, the module and the parameter."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig

import fxlora
from fxlora.adapters import placement, read_adapter
from fxlora.errors import AdapterError
from fxlora.testing import assert_matches_peft, make_adapter, tiny_model

ROWS = ["a", None, "b", "a"]
LINEAR_OPS = ("fxlora::lora_linear", "fxlora::lora_linear_fused")


def _model(family: str) -> torch.nn.Module:
    model = tiny_model(family, seed=1)
    model.set_experts_implementation("grouped_mm")
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 90, (len(ROWS), 7), generator=torch.Generator().manual_seed(0))


def _served(cm, parameter_linears: int, experts: int) -> None:
    """The routers' LoRA ran as linear LoRA, the experts' as moe_lora, and nothing was left out."""
    targets = cm.pool.targets
    routers = [f for f, t in targets.items() if t.info.parameter is not None]
    moe = [f for f, t in targets.items() if t.info.kind == "experts"]
    assert (len(routers), len(moe)) == (parameter_linears, experts)
    assert all(cm.backend.rewritten.get(f) in LINEAR_OPS for f in routers), cm.explain()
    assert all(cm.backend.rewritten.get(f) == "fxlora::moe_lora" for f in moe), cm.explain()
    assert set(targets) == set(cm.backend.rewritten), cm.explain()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_all_linear_adapters_on_moe_models_match_peft(family, tmp_path):
    model = _model(family)
    configs = {
        "a": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        "b": LoraConfig(r=2, lora_alpha=3, target_modules="all-linear", use_rslora=True),
    }
    adapters = {n: make_adapter(model, c, seed=i + 1, directory=str(tmp_path / n)) for i, (n, c) in enumerate(configs.items())}
    saved = read_adapter("a", adapters["a"]).config
    # what PEFT made of "all-linear" on these models: the cause of the fix
    assert {"gate_up_proj", "down_proj", "gate.weight"} <= set(saved.target_parameters)
    assert saved.rank_pattern == {r".*\.gate_up_proj": 8}

    cm = fxlora.compile(model, adapters, max_loras=4, max_rank=16)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=_ids())
    layers = model.config.num_hidden_layers
    _served(cm, parameter_linears=layers, experts=2 * layers)
    up = cm.pool.targets["model.layers.0.mlp.experts.gate_up_proj"]
    down = cm.pool.targets["model.layers.0.mlp.experts.down_proj"]
    slot_a, slot_b = cm.pool.slot_of["a"], cm.pool.slot_of["b"]
    # gate and up were two rank-r LoRA before transformers fused them: rank 2r, alpha 2·alpha
    assert (up.rank[slot_a], up.rank[slot_b], down.rank[slot_a]) == (8, 4, 4)
    assert up.scaling[slot_a] == pytest.approx(2.0) and up.scaling[slot_b] == pytest.approx(6 / 4**0.5)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_router_lora_is_the_routers_linear_lora(family):
    """Qwen2-MoE's router is F.linear(x, weight); DeepSeek-V3's casts both to float32 first.
    The patterns are keyed by the parameter's path, where PEFT looks them up."""
    model = _model(family)
    common = dict(target_modules=["o_proj"], target_parameters=["gate.weight"], alpha_pattern={"gate.weight": 5})
    configs = {
        "a": LoraConfig(r=2, lora_alpha=4, rank_pattern={"mlp.gate.weight": 3}, **common),
        "b": LoraConfig(r=4, lora_alpha=8, use_rslora=True, **common),
    }
    adapters = {n: make_adapter(model, c, seed=i + 1, directory="") for i, (n, c) in enumerate(configs.items())}
    cm = fxlora.compile(model, adapters, max_loras=4, max_rank=16)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=_ids())
    routers = [n for n, m in model.named_modules() if n.endswith("mlp.gate") and not isinstance(m, torch.nn.Linear)]
    _served(cm, parameter_linears=len(routers), experts=0)
    gate = cm.pool.targets[routers[0]]
    slot_a, slot_b = cm.pool.slot_of["a"], cm.pool.slot_of["b"]
    assert (gate.rank[slot_a], gate.rank[slot_b]) == (3, 4)
    assert gate.scaling[slot_a] == pytest.approx(5 / 3) and gate.scaling[slot_b] == pytest.approx(5 / 2)


def test_bare_parameter_names_beside_all_linear_match_peft():
    """On a model PEFT does not convert, "all-linear" stays a string beside bare parameter
    names: which wrapper is a linear module and which a parameter only the model tells."""
    model = _model("gpt_oss")
    config = dict(target_modules="all-linear", target_parameters=["gate_up_proj", "down_proj"])
    adapters = {
        "a": make_adapter(model, LoraConfig(r=2, lora_alpha=4, **config), seed=1, directory=""),
        "b": make_adapter(model, LoraConfig(r=4, lora_alpha=2, rank_pattern={"down_proj": 3}, **config), seed=2, directory=""),
    }
    cm = fxlora.compile(model, adapters, max_loras=4, max_rank=16)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=_ids())
    _served(cm, parameter_linears=0, experts=2 * model.config.num_hidden_layers)
    assert cm.pool.targets["model.layers.0.mlp.experts.down_proj"].rank[cm.pool.slot_of["b"]] == 3


def test_router_whose_forward_is_not_a_linear_over_its_weight_is_refused_by_name():
    model = _model("qwen3_moe")

    def matmul_forward(self, hidden_states):  # the router's own forward, with a matmul for F.linear
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = hidden_states @ self.weight.T
        top_value, indices = torch.topk(F.softmax(router_logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value.to(router_logits.dtype), indices

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.forward = types.MethodType(matmul_forward, module)
    config = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["gate.weight"])
    cm = fxlora.compile(model, {"a": make_adapter(model, config, seed=1, directory="")}, max_rank=8)
    with pytest.raises(fxlora.LoraNotRunError, match=r"\['a'\].*'model\.layers\.\d\.mlp\.gate'.*parameter 'weight'"):
        cm(input_ids=_ids(), adapter_names=ROWS[:2] * 2)
    assert "skipped model.layers.0.mlp.gate: no linear call" in cm.explain()
    cm(input_ids=_ids(), adapter_names=[None] * len(ROWS))  # base rows need no router LoRA


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)

    def forward(self, x):
        return self.embed(x)


@pytest.mark.parametrize(
    "targets, match",
    [
        (["embed.weight"], r"adapter 't'.*LoRA of embed\.weight \(Embedding's \(10, 6\) parameter\): not supported"),
    ],
)
def test_parameters_fxlora_cannot_serve_are_refused_by_name(targets, match):
    toy = _Toy()
    adapter = make_adapter(toy, LoraConfig(r=2, target_modules=[], target_parameters=targets), seed=1, directory="")
    with pytest.raises(AdapterError, match=match):
        placement.resolve(read_adapter("t", adapter), toy)


def test_wrapper_of_no_named_parameter_is_refused_by_name():
    model = _model("qwen3_moe")
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), seed=1, directory="")
    config.target_parameters = ["gate_up_proj"]  # names no parameter of q_proj, and q_proj is no longer a target
    config.target_modules = ["k_proj"]
    with pytest.raises(AdapterError, match=r"adapter 'x'.*'model\.layers\.0\.self_attn\.q_proj'.*neither a module"):
        placement.resolve(read_adapter("x", (config, state)), model)
