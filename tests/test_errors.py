"""Every kind of bad input raises AdapterError (adapters) or ValueError / TypeError (call
arguments) naming the culprit, and a failed load leaves the compiled model exactly as it was."""

import json
import math
import pickle
import re
import warnings

import pytest
import torch
from peft import IA3Config, LoraConfig
from safetensors.torch import save_file

import fxlora
from fxlora import AdapterError
from fxlora.adapters import read_adapter
from fxlora.testing import lora_module_names, make_adapter, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def cm(model, tmp_path_factory):
    good = make_adapter(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), 1, str(tmp_path_factory.mktemp("good"))
    )
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
        cm.load_adapter(source, adapter_name=name)
    message = str(info.value)
    assert repr(name) in message
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
    cm.load_adapter(path, adapter_name="from_bin")
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


def test_a_full_pool_holds_more_adapters_on_the_host(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    cm.load_adapter(path, adapter_name="second")
    cm.load_adapter(path, adapter_name="third")  # both slots taken (max_loras=2): held on the host
    try:
        assert cm.adapter_names[-2:] == ["second", "third"] and "third" not in cm.pool.slot_of
        first = cm(**ids, adapter_names=["third", None]).logits  # paged into the least recently used slot
        assert "third" in cm.pool.slot_of and torch.equal(cm(**ids, adapter_names=["second", None]).logits, first)
        three = {k: torch.cat([v, v[:1]]) for k, v in ids.items()}
        with pytest.raises(AdapterError, match="names 3 adapters but the pool has max_loras=2 GPU slots.*max_loras=3"):
            cm(**three, adapter_names=["good", "second", "third"])
    finally:
        cm.unload_adapter("second")
        cm.unload_adapter("third")


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


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_initialisations_that_rewrite_the_base_are_refused(cm, ids, model, tmp_path, init):
    path = adapter_dir(model, tmp_path)
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"init_lora_weights": init}))
    assert_load_fails(cm, ids, path, f"init_lora_weights={init!r}", "rewrites the base weights")


def test_config_fields_peft_does_not_know_warn(cm, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"use_future_feature": True}))
    with pytest.warns(fxlora.AdapterWarning, match=r"'late' .*\['use_future_feature'\]"):
        cm.load_adapter(path, adapter_name="late")
    cm.unload_adapter("late")


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


def test_whole_weights_saved_with_embedding_layers_are_refused_by_name(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    state["base_model.model.lm_head.weight"] = model.lm_head.weight.detach().clone()  # save_embedding_layers=True
    assert_load_fails(cm, ids, (config, state), "'lm_head.weight' is the whole weight of module 'lm_head'", "save_embedding_layers=False")


def test_tensors_of_several_adapters_in_one_file_are_refused(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    state = {k.replace(".weight", f".{name}.weight"): v for k, v in state.items() for name in ("first", "second")}
    assert_load_fails(cm, ids, (config, state), "the LoRA of several adapters", "['first', 'second']")


def test_output_head_factors_under_all_linear_are_refused_as_peft_ignores_them(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]), 0, "")
    config.target_modules = "all-linear"
    assert_load_fails(cm, ids, (config, state), "'lm_head', the model's output head", "'all-linear' leaves out")


def test_keys_without_peft_prefix_in_a_file_warn(model, tmp_path):
    from safetensors.torch import load_file

    path = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, str(tmp_path / "a"))
    file = tmp_path / "a" / "adapter_model.safetensors"
    save_file({k.removeprefix("base_model.model."): v for k, v in load_file(file).items()}, file)
    with pytest.warns(fxlora.AdapterWarning, match=r"lack PEFT's 'base_model.model.' prefix.*PEFT loads none of them"):
        read_adapter("a", path)


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
    with pytest.raises(ValueError, match="unknown fxlora option.*adapterz"):
        compiled(**ids)


@pytest.mark.parametrize("option", [{"cuda_graphs": "no"}, {"target_modules": 5}, {"target_modules": ["q_proj", 5]}])
def test_option_of_a_wrong_type(model, ids, option):
    compiled = torch.compile(model, backend="fxlora", options=option)
    with pytest.raises(TypeError, match=f"fxlora option '{next(iter(option))}' must be"):
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


@pytest.mark.parametrize("value", [-1, 2.5, True, "4096"])
def test_bad_prefill_graph_tokens(model, value):
    with pytest.raises(ValueError, match=r"prefill_graph_tokens must be an int >= 0 \(0: no prefill graphs\)"):
        fxlora.compile(model, prefill_graph_tokens=value)


def in_memory(model, **changes):
    """A valid in-memory adapter for q_proj with ``changes`` made to its config dict (a value of
    ``...`` removes the field)."""
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    config = config.to_dict()
    for field, value in changes.items():
        if value is ...:
            del config[field]
        else:
            config[field] = value
    return config, state


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(r=0), "config field r must be a positive int, got 0"),
        (dict(r=-2), "config field r must be a positive int, got -2"),
        (dict(r="2"), "config field r must be a positive int, got '2'"),
        (dict(r=True), "config field r must be a positive int, got True"),
        (dict(r=2.0), "config field r must be a positive int, got 2.0"),
        (dict(lora_alpha=math.nan), "config field lora_alpha must be a finite number, got nan"),
        (dict(lora_alpha=-math.inf), "config field lora_alpha must be a finite number, got -inf"),
        (dict(lora_alpha="16"), "config field lora_alpha must be a finite number, got '16'"),
        (dict(lora_alpha=False), "config field lora_alpha must be a finite number, got False"),
        (dict(rank_pattern={"q_proj": 0}), "config field rank_pattern['q_proj'] must be a positive int"),
        (dict(rank_pattern={"q_proj": "2"}), "config field rank_pattern['q_proj'] must be a positive int"),
        (dict(rank_pattern=["q_proj"]), "config field rank_pattern must be a dict"),
        (dict(rank_pattern={"q_(proj": 2}), "config field rank_pattern key must be a valid regular expression"),
        (dict(rank_pattern={"": 2}), "config field rank_pattern key must be a non-empty string"),
        (dict(alpha_pattern={"q_proj": math.nan}), "config field alpha_pattern['q_proj'] must be a finite number"),
        (dict(alpha_pattern={"[q": 4}), "config field alpha_pattern key must be a valid regular expression"),
        (dict(target_modules=...), "config has no target_modules (nor target_parameters)"),
        (dict(target_modules=None), "config has no target_modules (nor target_parameters)"),
        (dict(target_modules=7), "config field target_modules must be a list of module names or a regular"),
        (dict(target_modules=["q_proj", 7]), "config field target_modules must be a list of module names"),
        (dict(target_modules="q_proj("), "config field target_modules must be a valid regular expression"),
        (dict(exclude_modules="(k"), "config field exclude_modules must be a valid regular expression"),
        (dict(target_parameters="mlp.experts.gate_up_proj"), "config field target_parameters must be a list"),
        (dict(layers_to_transform="0"), "config field layers_to_transform must be a layer index"),
    ],
)
def test_config_fields_in_memory(cm, ids, model, changes, fragment):
    assert_load_fails(cm, ids, in_memory(model, **changes), "(<memory>)", fragment)


def test_config_fields_in_a_file_name_the_file(cm, ids, model, tmp_path):
    path = adapter_dir(model, tmp_path)
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "lora_alpha": "NaN"}))
    weights = str(tmp_path / "adapter" / "adapter_model.safetensors")
    assert_load_fails(cm, ids, path, weights, "config field lora_alpha must be a finite number, got 'NaN'")
    config_file.write_text(config_file.read_text().replace('"NaN"', "NaN"))  # JSON as Python writes it
    assert_load_fails(cm, ids, path, weights, "config field lora_alpha must be a finite number, got nan")


def test_config_fields_of_a_lora_config_object(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    config.lora_alpha = math.inf
    assert_load_fails(cm, ids, (config, state), "(<memory>)", "config field lora_alpha must be a finite number")


def test_target_parameters_alone_need_no_target_modules():
    from fxlora.adapters import read_adapter

    moe = tiny_model("qwen3_moe")
    config = LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    config, state = make_adapter(moe, config, 0, "")
    adapter = read_adapter("experts", ({**config.to_dict(), "target_modules": None}, state))
    assert adapter.modules


def tensor_of(kind, like):
    if kind == "meta":
        return like.to("meta")
    if kind == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return torch.zeros(like.shape)
    if kind == "int":
        return like.to(torch.int64)
    if kind == "complex":
        return like.to(torch.complex64)
    return like.to_sparse()


@pytest.mark.parametrize(
    "kind, fragment",
    [
        ("meta", "has no values (on the meta device, or fake)"),
        ("fake", "has no values (on the meta device, or fake)"),
        ("int", "has dtype torch.int64, not a floating-point dtype"),
        ("complex", "has dtype torch.complex64, not a floating-point dtype"),
        ("sparse", "is torch.sparse_coo, not a dense tensor"),
    ],
)
def test_tensors_without_usable_values(cm, ids, model, kind, fragment):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    key = next(k for k in state if "lora_A" in k)
    state[key] = tensor_of(kind, state[key])
    assert_load_fails(cm, ids, (config, state), key.removeprefix("base_model.model."), fragment)


def test_state_dict_that_is_not_a_mapping(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    assert_load_fails(cm, ids, (config, list(state.values())), "state_dict must map names to tensors, got list")


def test_state_dict_key_that_is_not_a_string(cm, ids, model):
    config, state = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 0, "")
    assert_load_fails(cm, ids, (config, {**state, 7: torch.ones(2)}), "state dict key 7 is not a string")


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [20, 100_000])
def test_deeply_nested_config_in_memory(cm, ids, model, depth):
    source = in_memory(model, layer_replication=nested(depth))
    assert_load_fails(cm, ids, source, "(<memory>)", "config nests more than 16 levels deep")


def test_cyclic_config_in_memory(cm, ids, model):
    config, state = in_memory(model)
    config["eva_config"] = cycle = {}
    cycle["next"] = cycle
    assert_load_fails(cm, ids, (config, state), "config nests more than 16 levels deep")


@pytest.mark.parametrize("depth, fragment", [(20, "nests more than 16 levels deep"), (100_000, "nests too deeply")])
def test_deeply_nested_config_file(cm, ids, model, tmp_path, depth, fragment):
    path = adapter_dir(model, tmp_path)
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config)[:-1] + ', "layer_replication": ' + "[" * depth + "]" * depth + "}")
    assert_load_fails(cm, ids, path, str(tmp_path / "adapter"), fragment)


def test_huge_config_file(cm, ids, model, tmp_path):
    from fxlora.adapters.peft_format import MAX_CONFIG_BYTES

    path = adapter_dir(model, tmp_path)
    with open(tmp_path / "adapter" / "adapter_config.json", "r+b") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: nothing is written, and nothing should be read
    assert_load_fails(cm, ids, path, "adapter_config.json", f"{MAX_CONFIG_BYTES + 1} bytes, more than")


@pytest.mark.parametrize("name", [None, "", 123])
def test_bad_adapter_name_on_load(cm, ids, model, name):
    message = assert_load_fails(cm, ids, in_memory(model), "is not a non-empty string", name=name)
    assert ("None stands for the base model" in message) == (name is None)


@pytest.mark.parametrize("name", [None, "", 123])
def test_bad_adapter_name_on_compile(model, name):
    with pytest.raises(AdapterError, match=f"adapter name {name!r} is not a non-empty string"):
        fxlora.compile(model, adapters={name: in_memory(model)})


def test_adapters_that_are_not_a_mapping_on_compile(model):
    with pytest.raises(TypeError, match="adapters must map adapter names to sources, got list"):
        fxlora.compile(model, adapters=[in_memory(model)])


@pytest.mark.parametrize("max_loras, error", [("8", TypeError), (True, TypeError), (0, ValueError)])
def test_bad_max_loras_on_compile(model, max_loras, error):
    with pytest.raises(error, match=f"max_loras must be .*got .*{max_loras!r}"):
        fxlora.compile(model, adapters={"a": in_memory(model)}, max_loras=max_loras)


def narrowed(config, state):
    """The adapter with lora_A's of a width no module has: it reads, but does not fit the model."""
    return config, {k: v[:, :7] if "lora_A" in k else v for k, v in state.items()}


@pytest.mark.parametrize("bad, fragment", [(dict(r=0), "config field r"), (dict(), "shape mismatch")])
def test_failed_compile_leaves_the_model_as_it_was(bad, fragment):
    moe = tiny_model("qwen3_moe")
    implementation = moe.config._experts_implementation
    source = in_memory(moe, **bad) if bad else narrowed(*in_memory(moe))
    with pytest.raises(AdapterError, match=fragment):
        fxlora.compile(moe, adapters={"x": source})
    assert moe.config._experts_implementation == implementation


@pytest.mark.parametrize(
    "adapters, fragment",
    [
        ({"x": "in_memory(model, r=0)"}, "adapter 'x' (<memory>): config field r must be a positive int, got 0"),
        ({None: "in_memory(model)"}, "adapter name None is not a non-empty string"),
        ({"": "in_memory(model)"}, "adapter name '' is not a non-empty string"),
    ],
)
def test_bad_adapter_in_torch_compile_options(model, ids, adapters, fragment):
    adapters = {name: eval(source, {"in_memory": in_memory, "model": model}) for name, source in adapters.items()}
    compiled = torch.compile(model, backend="fxlora", options={"adapters": adapters})  # options reach fxlora later
    for _ in range(2):  # the first call makes the backend; every call raises the error itself, not wrapped
        with pytest.raises(AdapterError) as info:
            compiled(**ids)
        assert type(info.value) is AdapterError
        assert fragment in str(info.value)


def test_adapters_option_that_is_not_a_mapping(model, ids):
    compiled = torch.compile(model, backend="fxlora", options={"adapters": [in_memory(model)]})
    with pytest.raises(TypeError, match="option 'adapters' must map adapter names to sources, got list"):
        compiled(**ids)


def test_batch_of_no_rows(cm, ids):
    for names in (None, []):
        with pytest.raises(ValueError, match="the batch has 0 rows"):
            cm(input_ids=ids["input_ids"][:0], adapter_names=names)


@pytest.mark.parametrize(
    "max_new_tokens, error, fragment",
    [
        (-3, ValueError, "max_new_tokens must be >= 1, got -3"),
        (0, ValueError, "max_new_tokens must be >= 1, got 0"),
        (2.5, TypeError, "max_new_tokens must be an int, got float 2.5"),
        (True, TypeError, "max_new_tokens must be an int, got bool True"),
        ("2", TypeError, "max_new_tokens must be an int, got str '2'"),
    ],
)
def test_generate_bad_max_new_tokens(small_runtime, max_new_tokens, error, fragment):
    with pytest.raises(error) as info:
        small_runtime.generate(torch.randint(3, 96, (1, 3)), max_new_tokens=max_new_tokens)
    assert fragment in str(info.value)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (3,)])
def test_generate_prompts_without_rows_or_tokens(small_runtime, shape):
    with pytest.raises(
        ValueError, match=re.escape(f"input_ids must be (rows, tokens) with at least one of each, got shape {shape}")
    ):
        small_runtime.generate(torch.randint(3, 96, shape), max_new_tokens=2)


def test_adapter_names_spelling(cm, ids):
    rows = ids["input_ids"].shape[0]
    with pytest.raises(AdapterError, match="got the string 'good'.*\\['good'\\]"):
        cm(**ids, adapter_names="good")
    with pytest.raises(AdapterError, match="got the string 'good'"), fxlora.use_adapters("good"):
        pass
    base = cm(**ids, adapter_names=[None] * rows).logits
    assert torch.equal(cm(**ids, adapter_names=["__base__"] * rows).logits, base)  # PEFT's spelling of None
    with pytest.raises(AdapterError, match="'__base__' is reserved"):
        cm.load_adapter(cm.pool.adapters["good"], adapter_name="__base__")


def test_a_call_naming_no_adapter_warns_each_time(cm, model, ids):
    fresh = fxlora.compile(model, adapters={"good": cm.pool.adapters["good"]}, max_loras=2, max_rank=8)
    with pytest.warns(fxlora.AdapterWarning) as caught:
        warnings.simplefilter("always")
        fresh(**ids)
        fresh(**ids)
        fresh(**ids, adapter_names=[None] * ids["input_ids"].shape[0])
    assert sum("names no adapters while ['good'] are loaded" in str(w.message) for w in caught) == 2
    assert all(w.filename == __file__ for w in caught)  # the warning points at the caller's line
