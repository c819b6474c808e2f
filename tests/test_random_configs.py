"""Random model configs: every family at drawn sizes (layers, heads, grouped KV heads, head
dims, widths, vocabularies), each compiled afresh and checked against the PEFT oracle."""

import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import fxlora
from fxlora.testing import (
    adapter_sets,
    assert_matches_peft,
    batches,
    layered_module_names,
    lora_module_names,
    make_adapter,
    model_configs,
)


@settings(max_examples=8)
@given(family_config=model_configs(), data=st.data())
def test_random_config_matches_peft(family_config, data):
    _, config = family_config
    torch._dynamo.reset()  # a fresh model class instance per example: start Dynamo's budget anew
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    model = AutoModelForCausalLM.from_config(config).eval()
    targets = lora_module_names(model)
    configs = data.draw(adapter_sets(targets, layered_module_names(model), max_size=3, max_rank=16, num_layers=config.num_hidden_layers))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"a{i}": make_adapter(model, c, seed=i, directory=f"{tmp}/a{i}") for i, c in enumerate(configs)}
        cm = fxlora.compile(model, adapters=adapters, max_loras=len(adapters), max_rank=16)
        batch = data.draw(batches(config.vocab_size, list(adapters), max_batch=4, max_len=6))
        assert_matches_peft(cm, model, adapters, batch.adapter_names, **batch.inputs)
