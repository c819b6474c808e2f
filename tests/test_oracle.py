"""The oracles themselves (PEFT, the merged weights, the decomposition): they pass
fxlora on a mixed batch, fail it when the served adapter is not the one the oracle holds
(another adapter, or one module's factor off by 1%), and their allowance for float32
batch-composition noise stays small."""

import copy
import functools

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora.testing import (
    NEAR_TIE,
    assert_greedy_agrees,
    assert_matches_decomposition,
    assert_matches_peft,
    check_rows,
    decomposed_logits,
    make_adapter,
    merged_logits,
    oracle_noise,
    peft_model_with,
    reference_logits,
    tiny_model,
)

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: rows of different lengths
    return dict(input_ids=ids, attention_mask=mask)


def perturbed(adapter, module: str, factor: float):
    config, state = adapter
    return config, {k: v * factor if f"{module}.lora_B" in k else v for k, v in state.items()}


@pytest.mark.parametrize("r, alpha", [(8, 16), (1, 64)])  # ordinary, and badly conditioned
def test_oracle_passes_fxlora_and_fails_a_wrong_adapter(model, r, alpha):
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS)
    served = make_adapter(model, config, seed=1, directory="")
    cm = fxlora.compile(model, adapters={"a": served}, max_rank=8)
    names = ["a", None, "a"]
    inputs = batch(r)
    assert_matches_peft(cm, model, {"a": served}, names, **inputs)
    other = make_adapter(model, config, seed=2, directory="")
    out = cm(adapter_names=names, **inputs).logits

    def against_merged(adapter):
        merged = functools.partial(merged_logits, model, {"a": adapter})
        exact = functools.partial(merged_logits, copy.deepcopy(model).double(), {"a": adapter})
        noise = lambda: oracle_noise(merged, exact, names, **inputs)  # noqa: E731
        check_rows(out, merged(names, **inputs), names, inputs["attention_mask"], noise=noise, oracle="the merged oracle")

    against_merged(served)
    assert_matches_decomposition(cm, model, {"a": served}, names, **inputs)
    for wrong in (other, perturbed(served, "lm_head", 1.01), perturbed(served, "v_proj", 1.01)):
        with pytest.raises(AssertionError, match="differs from the PEFT oracle"):
            assert_matches_peft(cm, model, {"a": wrong}, names, **inputs)
        with pytest.raises(AssertionError, match="differs from the merged oracle"):
            against_merged(wrong)
        with pytest.raises(AssertionError, match="differs from the decomposition oracle"):
            assert_matches_decomposition(cm, model, {"a": wrong}, names, **inputs)


def test_decomposition_is_peft_for_modules_peft_wraps(model):
    """The decomposition oracle (the model's own forward, each module's delta added onto its
    output by a hook) against PEFT, embeddings included."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS + ["embed_tokens"])
    adapters = {"a": make_adapter(model, config, seed=4, directory=""), "b": make_adapter(model, config, seed=5, directory="")}
    names, inputs = ["a", None, "b"], batch(6)
    peft = reference_logits(model, peft_model_with(model, adapters), names, **inputs)
    check_rows(decomposed_logits(model, adapters, names, **inputs), peft, names, inputs["attention_mask"])
    assert torch.equal(decomposed_logits(model, adapters, [None], input_ids=inputs["input_ids"][:1]),
                       model(input_ids=inputs["input_ids"][:1]).logits)  # fmt: skip


def test_greedy_check_allows_near_ties_only():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, 32, generator=gen)
    best, runner_up = logits.topk(2, -1).indices.unbind(-1)

    def runner_up_behind_by(gap, steps):  # logits where the runner-up trails the best by gap · max |logit|
        out = logits.clone()
        for i, j in steps:
            out[i, j, runner_up[i, j]] = out[i, j, best[i, j]] - gap * out[i, j].abs().max()
        return out

    assert_greedy_agrees(best, logits)
    flipped = best.clone()
    flipped[1, 7] = runner_up[1, 7]
    assert_greedy_agrees(flipped, runner_up_behind_by(NEAR_TIE / 2, [(1, 7)]))
    with pytest.raises(AssertionError, match=r"\(1, 7\)"):
        assert_greedy_agrees(flipped, runner_up_behind_by(3 * NEAR_TIE, [(1, 7)]))
    steps = [(i, j) for i in range(4) for j in range(5)]  # 10% of the tokens, each a near tie: too many
    many = best.clone()
    many[:, :5] = runner_up[:, :5]
    with pytest.raises(AssertionError, match="agree"):
        assert_greedy_agrees(many, runner_up_behind_by(NEAR_TIE / 2, steps))
