"""``CompiledModel.generate``: batched multi-adapter generation from the static KV cache,
token for token against ``transformers``' generate with PEFT, one row at a time."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora.testing import lora_module_names, make_adapter, peft_model_with, reference_generate, tiny_model

FAMILIES = ["llama", "gemma2", "phi3", "gpt2"]
MAX_NEW = 8


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    torch._dynamo.reset()
    model = tiny_model(request.param, seed=3)
    targets = lora_module_names(model)
    adapters = {
        name: make_adapter(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets), seed=i, directory="", scale=0.2)
        for i, (name, r) in enumerate([("a", 4), ("b", 8)])
    }
    cm = fxlora.compile(model, adapters, max_batch_size=4, max_len=32)
    return model, adapters, cm, peft_model_with(model, adapters)


def prompts(rows: int, length: int, vocab: int, seed: int, right: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(1, rows):  # unequal prompt lengths
        pad = int(torch.randint(0, length - 1, (), generator=gen))
        if right:
            mask[i, length - pad :] = 0
        else:
            mask[i, :pad] = 0
    return ids * mask, mask


@pytest.mark.parametrize("right", [False, True], ids=["left-padded", "right-padded"])
def test_greedy_equals_peft_per_adapter(setup, right):
    model, adapters, cm, peft_model = setup
    names = ["a", None, "b", "a"]
    ids, mask = prompts(4, 6, model.config.vocab_size, seed=int(right), right=right)
    out = cm.generate(ids, mask, adapter_names=names, max_new_tokens=MAX_NEW, eos_token_id=(), pad_token_id=0)
    ref = reference_generate(model, peft_model, names, ids, mask, MAX_NEW, None, 0)
    assert torch.equal(out[:, ids.shape[1] :], ref)
    # the prompt comes back left-padded
    assert torch.equal(out[:, : ids.shape[1]].ne(0).sum(1), mask.sum(1))


def test_rows_finish_independently(setup):
    model, adapters, cm, peft_model = setup
    names = ["b", "a", None]
    ids, mask = prompts(3, 5, model.config.vocab_size, seed=7)
    free = cm.generate(ids, mask, adapter_names=names, max_new_tokens=MAX_NEW, eos_token_id=(), pad_token_id=0)
    new = free[:, ids.shape[1] :]
    eos = int(new[0, 2])  # row 0 ends at its third token at the latest; the others go on until they make it
    end = int((new[0] == eos).nonzero()[0])
    out = cm.generate(ids, mask, adapter_names=names, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    ref = reference_generate(model, peft_model, names, ids, mask, MAX_NEW, eos, 0)
    got = torch.full_like(ref, 0)
    got[:, : out.shape[1] - ids.shape[1]] = out[:, ids.shape[1] :]
    assert torch.equal(got, ref)
    assert got[0, end] == eos and (got[0, end + 1 :] == 0).all()
    assert not torch.equal(got, torch.where(torch.arange(MAX_NEW) > end, 0, free[:, ids.shape[1] :]))


def test_sampling_is_reproducible(setup):
    model, adapters, cm, _ = setup
    names = ["a", "b"]
    ids, mask = prompts(2, 4, model.config.vocab_size, seed=11)

    def sample(seed, **kw):
        gen = torch.Generator().manual_seed(seed)
        return cm.generate(
            ids, mask, adapter_names=names, max_new_tokens=MAX_NEW, eos_token_id=(), do_sample=True, generator=gen, **kw
        )

    assert torch.equal(sample(5, temperature=0.7, top_p=0.9), sample(5, temperature=0.7, top_p=0.9))
    greedy = cm.generate(ids, mask, adapter_names=names, max_new_tokens=MAX_NEW, eos_token_id=())
    assert torch.equal(sample(6, top_k=1), greedy)
    draws = {tuple(sample(s, temperature=2.0)[:, ids.shape[1] :].flatten().tolist()) for s in range(4)}
    assert len(draws) > 1  # the generator does drive the draws


def test_hot_swap_needs_no_retrace(setup):
    model, adapters, cm, _ = setup
    names = ["c", None]
    ids, mask = prompts(2, 5, model.config.vocab_size, seed=13)
    cm.generate(ids, mask, adapter_names=["a", None], max_new_tokens=3, eos_token_id=())
    compiles = cm.compile_count
    config = LoraConfig(r=4, lora_alpha=4, target_modules=lora_module_names(model))
    new = make_adapter(model, config, seed=99, directory="", scale=0.2)
    cm.load_adapter(new, adapter_name="c")
    try:
        out = cm.generate(ids, mask, adapter_names=names, max_new_tokens=MAX_NEW, eos_token_id=(), pad_token_id=0)
        ref = reference_generate(model, peft_model_with(model, {"c": new}), names, ids, mask, MAX_NEW, None, 0)
        assert torch.equal(out[:, ids.shape[1] :], ref)
    finally:
        cm.unload_adapter("c")
    assert cm.compile_count == compiles


def test_prefill_at_its_graph_shape_equals_peft(setup, monkeypatch):
    """The layout a prefill replays from a CUDA graph at (rows up to the batch bucket, the
    prompts left-padded to a length bucket), run eagerly here: the same tokens as PEFT, and
    one set of static inputs per shape."""
    model, _, cm, peft_model = setup
    rt = cm.prepare()
    monkeypatch.setattr(rt.graphs, "enabled", True)
    monkeypatch.setattr(rt.graphs, "run_captured", lambda key, fn: fn(key))
    monkeypatch.setattr(rt.graphs, "run", lambda key, fn: fn(key))
    assert rt.prefill_shape(3, 6, MAX_NEW) == (4, 16)
    assert rt.prefill_shape(3, 6, 20) is None  # 16 + 20 columns exceed max_len=32
    assert rt.prefill_shape(1, 5, MAX_NEW) == (2, 16)  # one row prefills as two
    monkeypatch.setattr(rt, "prefill_graph_tokens", 4 * 16 - 1)
    assert rt.prefill_shape(3, 6, MAX_NEW) is None
    monkeypatch.setattr(rt, "prefill_graph_tokens", 4 * 16)
    names = ["b", None, "a"]
    for seed in (11, 12):
        ids, mask = prompts(3, 6, model.config.vocab_size, seed=seed)
        out = cm.generate(ids, mask, adapter_names=names, max_new_tokens=MAX_NEW, eos_token_id=(), pad_token_id=0)
        ref = reference_generate(model, peft_model, names, ids, mask, MAX_NEW, None, 0)
        assert torch.equal(out[:, ids.shape[1] :], ref)
        assert torch.equal(out[:, : ids.shape[1]].ne(0).sum(1), mask.sum(1))
    assert set(rt._prefill_inputs) == {(4, 16)}


def test_generate_errors(setup):
    model, adapters, cm, _ = setup
    ids, mask = prompts(2, 4, model.config.vocab_size, seed=1)
    with pytest.raises(ValueError, match="max_len=32"):
        cm.generate(ids, mask, adapter_names=["a", "b"], max_new_tokens=40)
    with pytest.raises(ValueError, match="max_batch_size=4"):
        cm.generate(ids.repeat(3, 1), adapter_names=None, max_new_tokens=2)
    with pytest.raises(fxlora.AdapterError, match="3 entries but the batch has 2 rows"):
        cm.generate(ids, mask, adapter_names=["a", "b", None], max_new_tokens=2)
    with pytest.raises(fxlora.AdapterError, match="nope"):
        cm.generate(ids, mask, adapter_names=["nope", None], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        cm.generate(ids, mask, max_new_tokens=2, do_sample=True, top_p=1.5)


def test_default_buckets_trace_the_decode_step_and_the_prefill_once():
    # a bucket of 1 would be a trace of its own (Dynamo specialises a size-1 dimension):
    # the default buckets start at 2 and a single row replays that bucket; its prefill runs
    # as two rows likewise
    torch._dynamo.reset()
    model = tiny_model("llama", seed=3)
    adapter = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), seed=1, directory="")
    cm = fxlora.compile(model, {"a": adapter}, max_batch_size=8, max_len=16)
    cm.prepare()
    assert cm.compile_count == 1
    ids, mask = prompts(1, 5, model.config.vocab_size, seed=5)
    out = cm.generate(ids, mask, adapter_names=["a"], max_new_tokens=4, eos_token_id=(), pad_token_id=0)
    ref = reference_generate(model, peft_model_with(model, {"a": adapter}), ["a"], ids, mask, 4, None, 0)
    assert torch.equal(out[:, ids.shape[1] :], ref)
    assert cm.compile_count == 2  # the prefill, of two rows
    ids, mask = prompts(3, 6, model.config.vocab_size, seed=6)
    out = cm.generate(ids, mask, adapter_names=["a", None, "a"], max_new_tokens=4, eos_token_id=(), pad_token_id=0)
    ref = reference_generate(model, peft_model_with(model, {"a": adapter}), ["a", None, "a"], ids, mask, 4, None, 0)
    assert torch.equal(out[:, ids.shape[1] :], ref)
    assert cm.compile_count == 2  # one prefill graph serves one row and three
