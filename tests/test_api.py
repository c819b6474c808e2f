"""The public API around the core: PeftModel input, the user's model left alone, the
Dynamo entry point in a fresh process, explain(), and the guard against LoRA that did not run."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import LoraConfig, get_peft_model

import fxlora
from fxlora.testing import make_adapter, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=7)


@pytest.fixture
def inputs():
    ids = torch.randint(3, 96, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return dict(input_ids=ids, attention_mask=mask)


def test_compile_leaves_the_model_unchanged(model, inputs, tmp_path):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(**inputs).logits
    adapter = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), 0, str(tmp_path / "a"))
    cm = fxlora.compile(model, adapters={"a": adapter})
    cm(**inputs, adapter_names=["a", None, "a"])
    cm.unload_adapter("a")
    assert not any(hasattr(m, "lora_A") for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(**inputs).logits, expected)


def test_a_peft_model_whose_layers_compute_otherwise_than_its_adapters_is_refused(model):
    """Merged into the base weights, fxlora would add the LoRA again; scaled at run time
    (set_scale), it would serve the config's scaling instead: both raise, naming why."""
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.merge_adapter()
    with pytest.raises(fxlora.AdapterError, match=r"\['default'\] of the PeftModel are merged.*unmerge_adapter\(\)"):
        fxlora.compile(peft_model)
    peft_model.unmerge_adapter()
    for layer in peft_model.modules():
        if hasattr(layer, "set_scale"):
            layer.set_scale("default", 3.0)
    with pytest.raises(fxlora.AdapterError, match="scales its LoRA by 6, not by its config's 2"):
        fxlora.compile(peft_model)


def test_a_peft_model_tying_its_heads_lora_to_the_embeddings_is_refused():
    if "ensure_weight_tying" not in LoraConfig.__dataclass_fields__:  # PEFT before 0.21.2
        pytest.skip("this PEFT has no ensure_weight_tying")
    tied = tiny_model("llama", seed=2, tie_word_embeddings=True)
    config = LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], ensure_weight_tying=True, init_lora_weights=False)
    with pytest.raises(fxlora.AdapterError, match="ensure_weight_tying=True on a model with tied embeddings"):
        fxlora.compile(get_peft_model(tied, config))


def test_compile_a_peft_model(model, inputs):
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False), adapter_name="v")
    peft_model.add_adapter("o", LoraConfig(r=2, lora_alpha=5, target_modules=["o_proj", "embed_tokens"], init_lora_weights=False))
    peft_model.eval()
    cm = fxlora.compile(peft_model)
    assert cm.adapter_names == ["v", "o"]
    names = ["o", "v", None]
    out = cm(**inputs, adapter_names=names).logits
    for i, name in enumerate(names):  # the PeftModel keeps working, and is the oracle
        if name is None:
            with peft_model.disable_adapter():
                ref = peft_model(**{k: v[i : i + 1] for k, v in inputs.items()}).logits
        else:
            peft_model.set_adapter(name)
            ref = peft_model(**{k: v[i : i + 1] for k, v in inputs.items()}).logits
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def test_outputs_keep_the_models_type(model, inputs):
    cm = fxlora.compile(model)
    assert type(cm(**inputs)) is type(model(**inputs))


def test_a_call_in_grad_mode_runs_the_graphs_compiled_without(model, inputs):
    adapter = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]), 3, "")
    cm = fxlora.compile(model, adapters={"a": adapter})
    names = ["a", None, "a"]
    expected = cm(**inputs, adapter_names=names).logits
    with torch.enable_grad():
        out = cm(**inputs, adapter_names=names).logits
    assert not out.requires_grad and cm.compile_count == 1
    assert torch.equal(out, expected)


def test_explain_reads_top_to_bottom(model, inputs, tmp_path):
    adapter = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]), 0, str(tmp_path / "a"))
    cm = fxlora.compile(model, adapters={"a": adapter}, max_loras=3, target_modules=["q_proj", "o_proj"])
    assert "none yet: call the model once to trace it" in cm.explain()
    cm(**inputs, adapter_names=["a", "a", None])
    text = cm.explain()
    sections = ["Adapter pool:", "Graphs (", "Not served:", "Memory:", "Terms:"]
    assert [text.index(s) for s in sections] == sorted(text.index(s) for s in sections)
    assert "Adapter pool: 1 of 3 slots used, 2 free; 5 target modules" in text
    assert "slot 0: 'a', rank <= 4, 3 modules" in text
    assert "forward graph 0: lora runs 1 x lora_embedding, 4 x lora_linear after 1 prologue(s)" in text
    body, terms = text.split("Terms:")
    for line in terms.strip().splitlines():  # every term explained is one the report uses
        term = line.strip().split(":")[0]
        assert any(t in body for t in term.split(" / ")), term
    for used in ("slot", "lora / nolora", "prologue", "arena"):
        assert f"\n  {used}: " in terms, used
    assert "buckets:" not in terms  # no runtime yet: the report says nothing of buckets
    cm.prepare()
    assert "\n  buckets: " in cm.explain().split("Terms:")[1]


def test_lora_skipped_by_eager_fallback_is_an_error(model, inputs, tmp_path):
    adapter = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj"]), 0, str(tmp_path / "a"))
    cm = fxlora.compile(model, adapters={"a": adapter})
    cm(**inputs, adapter_names=["a", None, None])
    with torch.compiler.set_stance("force_eager"):  # as when Dynamo gives up on a frame
        with pytest.raises(fxlora.LoraNotRunError, match="did not run"):
            cm(**inputs, adapter_names=["a", None, None])
        cm(**inputs, adapter_names=[None, None, None])  # base rows only: the eager model is right


def test_lora_a_pass_left_out_names_the_adapter_and_why(model, inputs, tmp_path):
    renorm = copy.deepcopy(model)
    renorm.get_input_embeddings().max_norm = 1e6  # a lookup that renormalises its weight in place
    adapter = make_adapter(renorm, LoraConfig(r=4, target_modules=["embed_tokens"]), 0, str(tmp_path / "a"))
    cm = fxlora.compile(renorm, adapters={"a": adapter})
    with pytest.raises(fxlora.LoraNotRunError, match=r"\['a'\].*'model\.embed_tokens'.*max_norm renormalises"):
        cm(**inputs, adapter_names=["a", None, None])
    cm(**inputs, adapter_names=[None, None, None])


def test_backend_entry_point_in_a_fresh_process(tmp_path):
    """backend="fxlora" resolves through the torch_dynamo_backends entry point."""
    script = textwrap.dedent(
        f"""
        import torch
        from peft import LoraConfig
        from fxlora.testing.models import tiny_model, make_adapter
        from fxlora.testing.oracle import peft_model_with, reference_logits, row_errors
        model = tiny_model("mistral")
        adapters = {{"a": make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 1, {str(tmp_path / "a")!r})}}
        compiled = torch.compile(model, backend="fxlora", options={{"adapters": adapters, "max_rank": 8}})
        ids = torch.randint(3, 96, (2, 4))
        from fxlora import use_adapters
        with torch.no_grad(), use_adapters(["a", None]):
            out = compiled(input_ids=ids).logits
        ref = reference_logits(model, peft_model_with(model, adapters), ["a", None], input_ids=ids)
        assert max(row_errors(out, ref)) < 1e-5, row_errors(out, ref)
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=os.environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_import_is_quiet_and_leaves_the_optional_stacks_out():
    """``import fxlora`` imports PEFT, torchao and bitsandbytes only when a call needs them:
    importing them is slow, and torchao and bitsandbytes print while they load."""
    code = "import sys, fxlora; print(*sorted(m for m in ('peft', 'torchao', 'bitsandbytes') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == ""
    assert result.stderr == ""


def test_backend_name_resolves_without_importing_fxlora():
    code = "import sys, torch._dynamo as d; f = d.lookup_backend('fxlora'); print(f.__module__, 'fxlora' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["fxlora.runtime.backend", "True"]


def test_a_model_dynamo_cannot_trace_gets_fxloras_error_naming_why_and_where():
    class Printing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)

        def forward(self, input_ids):
            x = self.q_proj(input_ids.float())
            print("tracing this stops a full graph")
            return x

    cm = fxlora.compile(Printing(), fullgraph=True)
    with pytest.raises(fxlora.TraceError) as info:
        cm(torch.randn(2, 8))
    message = str(info.value)
    assert "could not trace Printing at" in message and f"test_api.py:{Printing.forward.__code__.co_firstlineno + 2}" in message
    assert torch.__version__ in message and "Unsupported" in message
    assert isinstance(info.value.__cause__, torch._dynamo.exc.TorchDynamoException)
