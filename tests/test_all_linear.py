"""PEFT's "all-linear" target rule, written once (``peft_format.all_linear_selects``) and read
by the pool, the adapter reader and placement, against PEFT's own expansion of the shorthand."""

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

from fxlora.adapters import AdapterPool, ModuleInfo, model_modules
from fxlora.adapters.peft_format import all_linear, all_linear_selects
from fxlora.testing import tiny_model


def peft_picks(model) -> set[str]:
    """The modules PEFT's ``"all-linear"`` names for ``model``."""
    return set(_maybe_include_all_linear_layers(LoraConfig(target_modules="all-linear"), model).target_modules)


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "qwen3_moe"])
def test_the_rule_picks_what_peft_picks(family):
    model = tiny_model(family)
    head = model.get_output_embeddings()
    ours = set()
    for fqn, module in model.named_modules():
        info = ModuleInfo.of(module)
        if info is not None and all_linear_selects("all-linear", info.kind, info.parameter, module is head):
            ours.add(fqn)
    assert ours == peft_picks(model)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_moe"])
def test_the_pool_targets_what_peft_picks(family):
    model = tiny_model(family)
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    pool = AdapterPool(max_loras=1, max_rank=4, target_modules="ALL-LINEAR", output_embedding=head)
    pool.register_modules(model_modules(model), complete=True)
    assert set(pool.targets) == peft_picks(model)


def test_the_shorthand_and_what_it_leaves_out():
    assert all_linear("all-linear") and all_linear("All-Linear")
    assert not all_linear(["all-linear"]) and not all_linear("q_proj") and not all_linear(None)
    assert all_linear_selects("all-linear", "linear")  # read without the model: a linear LoRA
    assert not all_linear_selects("all-linear", "embedding")
    assert not all_linear_selects("all-linear", "experts")
    assert not all_linear_selects("all-linear", "linear", parameter="weight")  # an MoE router
    assert not all_linear_selects("all-linear", "linear", output_embedding=True)
    assert not all_linear_selects(["q_proj"], "linear")
