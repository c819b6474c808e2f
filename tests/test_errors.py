"""Every kind of bad input raises AdapterError naming the culprit, and a failed load
leaves the compiled model exactly as it was."""

import json
import pickle

import pytest
import torch
from peft import IA3Config, LoraConfig
from safetensors.torch import save_file

import fxlora
from fxlora import AdapterError
from fxlora.testing import lora_module_names, make_adapter, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def cm(model, tmp_path_factory):
    good = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), 1, str(tmp_path_factory.mktemp("good")))
    targets = [t for t in lora_module_names(model) if t != "embed_tokens"]
    return fxlora.compile(model, adapters={"good": good}, target_modules=targets, max_loras=2, max_rank=8)


@pytest.fixture
def ids():
    ids = torch.randint(3, 96, (2, 5))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def adapter_dir(model, tmp_path, **config):
    config.setdefault("target_modules", ["q_proj"])
    return make_adapter(model, LoraConfig(**config), 0, str(tmp_path / "adapter"))


def assert_load_fails(cm, ids, source, *fragments, name="bad"):
    before = cm(**ids, adapter_names=["good", None]).logits
    loaded = list(cm.adapter_names)
    with pytest.raises(AdapterError) as info:
        cm.load_adapter(name, source)
    message = str(info.value)
    assert f"'{name}'" in message
    for fragment in fragments:
        assert fragment in message, message
    # nothing half-registered, and the model keeps working as before
    assert cm.adapter_names == loaded
    assert torch.equal(cm(**ids, adapter_names=["good", None]).logits, before)
    return message


def test_adapter_error_is_a_value_error():
    assert issubclass(AdapterError, ValueError)


def test_missing_directory(cm, ids, tmp_path):
    assert_load_fails(cm, ids, str(tmp_path / "nope"), str(tmp_path / "nope"), "not a directory")


def test_missing_config(cm, ids, tmp_path):
    assert_load_fails(cm, ids, str(tmp_path), "adapter_config.json", "missing")


def test_corrupt_config(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    (tmp_path / "adapter" / "adapter_config.json").write_text("{not json")
    assert_load_fails(cm, ids, path, "adapter_config.json")


def test_missing_weights(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    assert_load_fails(cm, ids, path, "adapter_model.safetensors", "adapter_model.bin", "missing weights")


def test_corrupt_safetensors(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage")
    assert_load_fails(cm, ids, path, "adapter_model.safetensors", "cannot read")


def test_bin_weights_load_without_unpickling_code(cm, ids, model, tmp_path):
    from safetensors.torch import load_file

    path = adapter_dir(model, tmp_path)
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    torch.save(load_file(weights), tmp_path / "adapter" / "adapter_model.bin")
    weights.unlink()
    cm.load_adapter("from_bin", path)
    cm.unload_adapter("from_bin")


class _Exploit:
    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_bin_with_code_is_refused(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with open(tmp_path / "adapter" / "adapter_model.bin", "wb") as f:
        pickle.dump({"x": _Exploit()}, f)
    assert_load_fails(cm, ids, path, "adapter_model.bin", "cannot read")


def test_shape_mismatch_names_module_and_shapes(cm, ids, tmp_path):
    other = tiny_model("llama", hidden_size=48, num_attention_heads=4)
    path = make_adapter(other, LoraConfig(r=4, target_modules=["q_proj"]), 0, str(tmp_path / "a"))
    message = assert_load_fails(cm, ids, path, "model.layers.0.self_attn.q_proj", "(4, 48)", "(4, 32)")
    assert "shape" in message


def test_module_the_model_lacks(cm, ids, tmp_path):
    deeper = tiny_model("llama", num_hidden_layers=3)
    path = make_adapter(deeper, LoraConfig(r=4, target_modules=["o_proj"]), 0, str(tmp_path / "a"))
    assert_load_fails(cm, ids, path, "model.layers.2.self_attn.o_proj", "lacks")


def test_module_not_compiled_as_target(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path, target_modules=["embed_tokens"])
    assert_load_fails(cm, ids, path, "model.embed_tokens", "target_modules")


def test_rank_above_max_rank(cm, ids, model, tmp_path):
    assert_load_fails(cm, ids, adapter_dir(model, tmp_path, r=9), "rank 9", "max_rank=8")


def test_no_free_slot(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    cm.load_adapter("second", path)
    try:
        advice = "unload one (unload_adapter) or compile with a larger max_loras="
        assert_load_fails(cm, ids, path, "no free slot", "max_loras=2", advice, name="third")
    finally:
        cm.unload_adapter("second")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights(cm, ids, model, value):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["k_proj"]), 0, "")
    key = next(k for k in state if "lora_B" in k)
    state[key][0, 0] = value
    assert_load_fails(cm, ids, (config, state), key.removeprefix("base_model.model."), "NaN or Inf")


@pytest.mark.parametrize(
    "config, feature",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(lora_bias=True), "lora_bias"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ],
)
def test_unsupported_peft_features(cm, ids, model, tmp_path, config, feature):
    assert_load_fails(cm, ids, adapter_dir(model, tmp_path, **config), "unsupported PEFT feature", feature)


def test_unsupported_feature_in_tensors(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    state["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(32)
    assert_load_fails(cm, ids, (config, state), "DoRA")


def test_non_lora_peft_type(cm, ids, model, tmp_path):
    import copy

    from peft import get_peft_model

    get_peft_model(copy.deepcopy(model), IA3Config(target_modules=["q_proj"], feedforward_modules=[])).save_pretrained(
        tmp_path / "ia3"
    )
    assert_load_fails(cm, ids, str(tmp_path / "ia3"), "unsupported PEFT type IA3")


def test_weights_the_config_does_not_select(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    config.target_modules = {"k_proj"}
    assert_load_fails(cm, ids, (config, state), "model.layers.0.self_attn.q_proj", "do not select")


def test_rank_disagrees_with_config(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    config.r = 3
    assert_load_fails(cm, ids, (config, state), "rank 2", "r=3")


def test_unrecognised_tensor(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    state["base_model.model.model.layers.0.self_attn.q_proj.mystery"] = torch.ones(2)
    assert_load_fails(cm, ids, (config, state), "unrecognised tensor", "mystery")


def test_wrong_source_type(cm, ids):
    assert_load_fails(cm, ids, 42, "int")


def test_duplicate_name(cm, ids, model, tmp_path):
    assert_load_fails(cm, ids, adapter_dir(model, tmp_path), "already loaded", name="good")


def test_unknown_adapter_at_call(cm, ids):
    with pytest.raises(AdapterError, match="unknown adapter 'nobody'.*loaded: \\['good'\\]"):
        cm(**ids, adapter_names=["good", "nobody"])


def test_wrong_length_adapter_names(cm, ids):
    with pytest.raises(AdapterError, match="adapter_names has 3 entries but the batch has 2 rows"):
        cm(**ids, adapter_names=["good", None, None])


def test_wrong_length_under_torch_compile(model, ids):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    compiled = torch.compile(
        model, backend="fxlora", options={"adapters": {"a": (config, state)}, "max_loras": 2, "max_rank": 4}
    )
    with fxlora.use_adapters(["a", None, "a"]), pytest.raises(AdapterError, match="3 entries but the batch has 2 rows"):
        compiled(**ids)


def test_unknown_option(model, ids):
    compiled = torch.compile(model, backend="fxlora", options={"adapterz": {}})
    with pytest.raises(Exception, match="unknown fxlora option"):
        compiled(**ids)


def test_bad_compile_adapter_names_the_file(model, tmp_path):
    path = adapter_dir(model, tmp_path)
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "peft_type": "LOHA"}))
    with pytest.raises(AdapterError, match="adapter 'x'.*unsupported PEFT type LOHA"):
        fxlora.compile(model, adapters={"x": path})


def test_base_weights_that_differ_from_the_model(cm, ids, model, tmp_path):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["lm_head"]), 0, "")
    state["base_model.model.lm_head.base_layer.weight"] = torch.zeros(96, 32)
    assert_load_fails(cm, ids, (config, state), "lm_head", "base weights")


def test_save_file_roundtrip_of_corrupt_tensor_names(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    save_file({"junk": torch.ones(1)}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert_load_fails(cm, ids, path, "unrecognised tensor 'junk'")


@pytest.fixture(scope="module")
def small_runtime(model):
    """Generation for at most 4 rows of 8 tokens, decode graphs for 1 and 2 rows only."""
    adapter = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    return fxlora.compile(model, adapters={"a": adapter}, max_batch_size=4, max_len=8, batch_buckets=[1, 2])


def test_generate_beyond_max_batch_size_names_the_compile_argument(small_runtime):
    ids = torch.randint(3, 96, (5, 3))
    with pytest.raises(ValueError, match=r"5 rows .* max_batch_size=4: compile with a larger max_batch_size=") as info:
        small_runtime.generate(ids, max_new_tokens=2)
    assert "max_batch_size=5" in str(info.value)


def test_generate_beyond_max_len_names_the_compile_argument(small_runtime):
    ids = torch.randint(3, 96, (1, 5))
    with pytest.raises(ValueError, match=r"max_len=8: compile with a larger max_len=") as info:
        small_runtime.generate(ids, adapter_names=["a"], max_new_tokens=4)
    assert "max_len=9" in str(info.value)


def test_generate_beyond_the_largest_bucket_names_the_compile_argument(small_runtime):
    ids = torch.randint(3, 96, (3, 3))
    with pytest.raises(ValueError, match=r"largest batch bucket, 2: compile with batch_buckets= that include 3"):
        small_runtime.generate(ids, adapter_names=["a", None, "a"], max_new_tokens=2)
