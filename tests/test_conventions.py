"""The habits a transformers and PEFT user brings, and no silent base-model answers: adapter
keywords the model would swallow, transformers' PEFT methods on a compiled model, generate
reading the generation config, masks inferred or refused, PEFT's argument order."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from peft import LoraConfig
from transformers import GenerationConfig

import fxlora
from fxlora.testing import make_adapter, peft_model_with, reference_generate, tiny_model

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=21)


@pytest.fixture(scope="module")
def adapters(model):
    return {
        name: make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), seed)
        for seed, name in enumerate(["a", "b"])
    }


@pytest.fixture(scope="module")
def cm(model, adapters):
    return fxlora.compile(model, adapters=adapters, max_loras=4, max_batch_size=4, max_len=32)


def ids_of(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


# -- adapter arguments that would be swallowed ---------------------------------------------------
@pytest.mark.parametrize("keyword", ["adapter_name", "adapters", "lora_names"])
def test_a_misspelt_adapter_keyword_is_refused(cm, keyword):
    with pytest.raises(TypeError, match=f"unexpected keyword {keyword}=.*adapter_names="):
        cm(input_ids=ids_of(2, 5, 0), **{keyword: ["a", None]})
    with pytest.raises(TypeError, match=f"unexpected keyword {keyword}="):
        cm.generate(ids_of(2, 5, 0), max_new_tokens=2, **{keyword: ["a", None]})


@pytest.mark.parametrize("keyword", ["adapter_names", "adapter_name"])
def test_torch_compile_refuses_adapter_keywords_it_cannot_serve(model, adapters, keyword):
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="fxlora", options={"adapters": {"a": adapters["a"]}})
    ids = ids_of(2, 5, 1)
    with torch.no_grad():
        with pytest.raises(TypeError, match=f"unexpected keyword {keyword}=.*fxlora.use_adapters"):
            compiled(input_ids=ids, **{keyword: ["a", None]})
        with fxlora.use_adapters(["a", None]):
            served = compiled(input_ids=ids).logits  # the right spelling still serves
    assert not torch.equal(served[0], model(input_ids=ids).logits[0])


def test_calls_naming_no_adapter_warn_every_time(cm):
    ids = ids_of(2, 5, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm(input_ids=ids)
        cm(input_ids=ids)
        cm.generate(ids, max_new_tokens=2)
        cm(input_ids=ids, adapter_names=[None, None])  # named: the base model on purpose
        cm.generate(ids, adapter_names=[None, None], max_new_tokens=2)
    unnamed = [w for w in caught if issubclass(w.category, fxlora.AdapterWarning)]
    assert len(unnamed) == 3 and all("['a', 'b'] are loaded" in str(w.message) for w in unnamed)


# -- transformers' PEFT methods ---------------------------------------------------------------------
def test_transformers_adapter_methods_act_through_fxlora_under_torch_compile(model, adapters, tmp_path):
    torch._dynamo.reset()
    base_model = copy.deepcopy(model)
    compiled = torch.compile(base_model, backend="fxlora", options={"adapters": {"a": adapters["a"]}})
    late = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 5, str(tmp_path / "late"))
    ids, names = ids_of(3, 6, 3), ["a", None, "late"]
    with torch.no_grad(), fxlora.use_adapters(["a", None, "a"]):
        before = compiled(input_ids=ids).logits
    compiled.load_adapter(late, adapter_name="late")  # transformers' signature, fxlora's pool
    assert not any("lora" in n for n, _ in base_model.named_modules())
    with torch.no_grad(), fxlora.use_adapters(names):
        after = compiled(input_ids=ids).logits
    assert torch.equal(after[:2], before[:2])  # the other rows, bit for bit
    ref = peft_model_with(model, {"late": late})
    ref.set_adapter("late")
    torch.testing.assert_close(after[2:], ref(input_ids=ids[2:]).logits, rtol=1e-5, atol=1e-5)
    for method, args in (("set_adapter", ("a",)), ("add_adapter", (LoraConfig(r=2),)), ("disable_adapters", ())):
        with pytest.raises(fxlora.AdapterError, match=f"{method}\\(\\) on a model fxlora serves"):
            getattr(compiled, method)(*args)
    compiled.delete_adapter("late")
    with torch.no_grad(), pytest.raises(fxlora.AdapterError, match="late"), fxlora.use_adapters(names):
        compiled(input_ids=ids)


def test_transformers_load_adapter_on_a_compiled_model_loads_into_the_pool(model, adapters, tmp_path):
    cm = fxlora.compile(copy.deepcopy(model), adapters={"a": adapters["a"]}, max_loras=3)
    ids = ids_of(2, 5, 4)
    before = cm(input_ids=ids, adapter_names=["a", None]).logits
    path = make_adapter(model, LoraConfig(r=2, target_modules=["v_proj"]), 6, str(tmp_path / "c"))
    cm.model.load_adapter(path, adapter_name="c")
    assert cm.adapter_names == ["a", "c"]
    assert torch.equal(cm(input_ids=ids, adapter_names=["a", None]).logits, before)
    cm.model.delete_adapter("c")
    assert cm.adapter_names == ["a"]


def test_a_dropped_compiled_model_goes_with_its_engine_and_the_models_methods_refuse(model, adapters, tmp_path):
    served = copy.deepcopy(model)
    cm = fxlora.compile(served, adapters={"a": adapters["a"]}, max_loras=3, max_batch_size=4, max_len=32)
    cm(input_ids=ids_of(2, 5, 4), adapter_names=["a", None])
    cm.generate(ids_of(2, 5, 5), adapter_names=["a", None], max_new_tokens=2)
    with cm.serve(max_batch_size=2, block_size=4) as manager:
        manager.get_result(manager.add_request([5, 6], max_new_tokens=2, adapter_name="a"), timeout=60)
    dropped, engine = weakref.ref(cm), weakref.ref(cm._engine[1])
    del cm, manager
    gc.collect()
    assert dropped() is None and engine() is None  # the model it serves does not keep it alive
    path = make_adapter(model, LoraConfig(r=2, target_modules=["v_proj"]), 6, str(tmp_path / "c"))
    with pytest.raises(fxlora.AdapterError, match="load_adapter\\(\\): the fxlora compiled model that served this model was dropped"):
        served.load_adapter(path, adapter_name="c")
    again = fxlora.compile(served, adapters={"a": adapters["a"]}, max_loras=3)
    served.load_adapter(path, adapter_name="c")  # the model's methods serve the new compiled model
    assert again.adapter_names == ["a", "c"]


def test_a_model_holding_peft_layers_is_refused(model, adapters):
    from peft import inject_adapter_in_model

    injected = inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), copy.deepcopy(model))
    with pytest.raises(fxlora.AdapterError, match="holds PEFT adapter layers"):
        fxlora.compile(injected)


# -- PEFT's argument order and transformers' attributes ----------------------------------------------
def test_load_adapter_takes_peft_order_and_delete_adapter(cm, adapters, model, tmp_path):
    path = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 7, str(tmp_path / "d"))
    cm.load_adapter(path, adapter_name="d")
    cm.delete_adapter("d")
    cm.load_adapter(path, "d")  # positional, PEFT's order
    cm.delete_adapter(["d"])
    cm.load_adapter("d", path)  # fxlora's earlier order, told by the directory
    cm.unload_adapter("d")
    cm.load_adapter(path, "d")
    cm.delete_adapter(["d", "d"])  # named twice: deleted once
    assert "d" not in cm.adapter_names
    with pytest.raises(fxlora.AdapterError, match="adapter 'zzz': nope/x is not a directory"):
        cm.load_adapter("nope/x", "zzz")
    (tmp_path / "d2").mkdir()
    with pytest.raises(fxlora.AdapterError, match="d_v3 is not a directory"):  # a missing path: never read as a name
        cm.load_adapter(str(tmp_path / "d_v3"), adapter_name=str(tmp_path / "d2"))
    with pytest.raises(fxlora.AdapterError, match=r"\['nope'\] not loaded, so none was deleted"):
        cm.delete_adapter(["b", "nope"])
    with pytest.raises(fxlora.AdapterError, match="an adapter name or a list of names, got None"):
        cm.delete_adapter(None)
    with pytest.raises(fxlora.AdapterError, match=r"one adapter's name, got list \['a'\]"):
        cm.unload_adapter(["a"])
    with pytest.raises(fxlora.AdapterError, match=r"adapter_names\[1\] must be an adapter's name or None, got list"):
        cm(input_ids=ids_of(2, 4, 0), adapter_names=["a", ["a"]])
    with pytest.raises(fxlora.AdapterError, match="in row order, got set"):
        cm(input_ids=ids_of(2, 4, 0), adapter_names={"a", "b"})
    assert cm.adapter_names == ["a", "b"]


def test_compiled_model_exposes_the_models_attributes(cm, model):
    assert cm.config is model.config and cm.generation_config is model.generation_config
    assert cm.device == torch.device("cpu") and cm.dtype == torch.float32


# -- generate as transformers' generate ---------------------------------------------------------------
def base_generate(model, ids, mask=None, **kw):
    return model.generate(input_ids=ids, attention_mask=mask if mask is not None else torch.ones_like(ids), **kw)


def test_generate_reads_the_models_generation_config(cm, model):
    ids = ids_of(2, 5, 8)
    saved = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=5)
        draws = {tuple(cm.generate(ids, adapter_names=["a", None], generator=torch.Generator().manual_seed(s))[0, 5:].tolist())
                 for s in range(6)}  # fmt: skip
        assert all(len(d) == 5 for d in draws) and len(draws) > 1  # five sampled tokens, as transformers gives
        greedy = cm.generate(ids, adapter_names=[None, None], do_sample=False)
        assert torch.equal(greedy, base_generate(model, ids, do_sample=False, pad_token_id=0))
    finally:
        model.generation_config = saved


def test_generation_config_and_lengths_follow_transformers(cm, model):
    ids = ids_of(2, 6, 9)
    config = GenerationConfig(max_length=10, eos_token_id=None, pad_token_id=0)
    out = cm.generate(ids, adapter_names=[None, None], generation_config=config)
    assert out.shape == (2, 10)
    assert torch.equal(out, base_generate(model, ids, generation_config=config))
    first = int(cm.generate(ids, adapter_names=[None, None], max_new_tokens=1, eos_token_id=())[0, -1])
    # row 0's first token as its end token: min_new_tokens keeps it from ending there
    out = cm.generate(ids, adapter_names=[None, None], max_new_tokens=4, min_new_tokens=3, eos_token_id=first, pad_token_id=0)
    ref = base_generate(model, ids, max_new_tokens=4, min_new_tokens=3, eos_token_id=first, pad_token_id=0, do_sample=False)
    assert torch.equal(out, ref[:, : out.shape[1]]) and out[0, 6] != first


@pytest.mark.parametrize(
    "setting", [dict(repetition_penalty=1.2), dict(num_beams=2), dict(no_repeat_ngram_size=2), dict(min_p=0.1)]
)
def test_settings_fxlora_does_not_serve_are_refused_by_name(cm, setting):
    (key, value), = setting.items()
    with pytest.raises(fxlora.GenerationConfigError, match=f"{key}={value!r} \\(passed to generate\\) is not supported"):
        cm.generate(ids_of(1, 4, 0), max_new_tokens=2, **setting)
    with pytest.raises(fxlora.GenerationConfigError, match=f"{key}={value!r} \\(in the generation config\\)"):
        cm.generate(ids_of(1, 4, 0), generation_config=GenerationConfig(**setting), max_new_tokens=2)


def test_unknown_and_unserved_keywords_are_named(cm):
    ids = ids_of(1, 4, 0)
    with pytest.raises(TypeError, match="unknown keyword 'max_tokens'"):
        cm.generate(ids, max_tokens=3)
    with pytest.raises(TypeError, match="stop_strings"):
        cm.generate(ids, max_new_tokens=2, stop_strings=["x"])
    with pytest.raises(ValueError, match="leaves no room for new tokens"):
        cm.generate(ids, max_length=4)
    with pytest.raises(ValueError, match=rf"input_ids\[0, 2\] = {VOCAB + 5} is not a token id of the model"):
        cm.generate(torch.tensor([[5, 6, VOCAB + 5]]), max_new_tokens=2)


def test_the_serving_manager_takes_transformers_positional_order():
    """A transformers user's positional arguments mean the same to fxlora's manager: what it
    takes by position is a prefix of transformers' parameters; the rest are keywords."""
    import inspect

    from fxlora.runtime.serving import ServingManager

    theirs = pytest.importorskip("transformers.generation.continuous_batching").ContinuousBatchingManager
    for method in ("add_request", "get_result", "request_id_iter", "cancel_request", "stop"):
        mine = list(inspect.signature(getattr(ServingManager, method)).parameters.values())
        positional = [p.name for p in mine if p.kind is p.POSITIONAL_OR_KEYWORD]
        expected = [p.name for p in inspect.signature(getattr(theirs, method)).parameters.values()]
        assert positional == expected[: len(positional)], method


def test_sampling_settings_without_do_sample_warn(cm):
    with pytest.warns(UserWarning, match="do_sample is False, so temperature=0.5"):
        cm.generate(ids_of(1, 4, 0), adapter_names=["a"], max_new_tokens=2, temperature=0.5)


def test_streamer_gets_the_prompt_then_each_token(cm):
    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.clone())

        def end(self):
            self.ended = True

    ids, streamer = ids_of(1, 4, 10), Collect()
    out = cm.generate(ids, adapter_names=["b"], max_new_tokens=3, eos_token_id=(), streamer=streamer)
    assert streamer.ended and torch.equal(torch.cat([p.view(1, -1) for p in streamer.parts], 1), out)
    end = int(out[0, 5])  # the second new token as the end token: the call ends there, and so does the stream
    streamer = Collect()
    ended = cm.generate(ids, adapter_names=["b"], max_new_tokens=12, eos_token_id=end, pad_token_id=0, streamer=streamer)
    assert ended.shape[1] <= 6 and torch.equal(torch.cat([p.view(1, -1) for p in streamer.parts], 1), ended)


def test_a_list_of_token_lists_is_left_padded(cm, model, adapters):
    prompts = [[5, 6, 7, 8], [9, 10]]
    out = cm.generate(prompts, adapter_names=["a", None], max_new_tokens=3, eos_token_id=(), pad_token_id=0)
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    ref = reference_generate(model, peft_model_with(model, adapters), ["a", None], ids, mask, 3, None, 0)
    assert torch.equal(out[:, 4:], ref)


# -- masks ----------------------------------------------------------------------------------------------
def test_a_missing_mask_is_read_from_the_padding(cm, model, adapters):
    ids = ids_of(3, 6, 11)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    padded = ids * mask  # pad_token_id 0, never an end token here
    names = ["b", "a", None]
    out = cm.generate(padded, adapter_names=names, max_new_tokens=4, eos_token_id=(), pad_token_id=0)
    ref = reference_generate(model, peft_model_with(model, adapters), names, padded, mask, 4, None, 0)
    assert torch.equal(out[:, 6:], ref)


def test_padding_that_is_also_the_end_token_is_refused_without_a_mask(cm):
    ids = ids_of(2, 5, 12)
    ids[1, 0] = 2
    with pytest.raises(ValueError, match="row 1 of input_ids begins or ends with pad_token_id=2, which is also an end token"):
        cm.generate(ids, adapter_names=["a", None], max_new_tokens=2, eos_token_id=2, pad_token_id=2)


@pytest.mark.parametrize(
    "row, fragment",
    [([1, 0, 1, 1], "has padding between tokens"), ([0, 0, 0, 0], "is all 0"), ([1, 2, 1, 1], "0 \\(padding\\) and 1")],
)
def test_ill_formed_masks_are_refused(cm, row, fragment):
    ids = ids_of(2, 4, 13)
    mask = torch.tensor([[1, 1, 1, 1], row])
    with pytest.raises(ValueError, match=fragment):
        cm.generate(ids, mask, adapter_names=["a", None], max_new_tokens=2)


@pytest.mark.parametrize("eos", [-1, VOCAB, (3, -2)])
def test_end_tokens_outside_the_vocabulary_are_refused(cm, eos):
    with pytest.raises(fxlora.GenerationConfigError, match="eos_token_id=-?\\d+ is not a token id of the model"):
        cm.generate(ids_of(1, 4, 0), adapter_names=["a"], max_new_tokens=2, eos_token_id=eos)
