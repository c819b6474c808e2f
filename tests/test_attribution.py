"""Which module a traced call belongs to, whatever Dynamo calls the model's root, and many
compiled models and batch shapes in one process through both entry points."""

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from peft import LoraConfig

import fxlora
from fxlora.adapters import AdapterPool, model_modules
from fxlora.compiler.context import PassContext
from fxlora.compiler.module_tree import AttributionError, ModuleTree, module_fqn
from fxlora.passes.annotate import annotate
from fxlora.testing import assert_matches_peft, make_adapter, tiny_model
from fxlora.testing.oracle import check_rows, peft_model_with, reference_logits


@pytest.mark.parametrize(
    "path",
    [
        "L['self'].model.layers[0].self_attn.q_proj",
        "L['args'][0].model.layers.0.self_attn.q_proj",  # a decorated forward: the model is its first argument
        "L['fn'].model.layers[0]._modules['self_attn']._modules['q_proj']",
        "L['mod'].model.layers.0.self_attn.q_proj",
        "L['kwargs']['model'].model.layers.0.self_attn.q_proj",
        "G['model'].model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.q_proj",
    ],
)
def test_module_fqn_strips_any_root(path):
    assert module_fqn(path) == "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def test_tree_resolves_by_identity_before_the_path(model):
    tree = ModuleTree(model)
    q = model.model.layers[1].self_attn.q_proj
    # the path is stale or odd; the key (Dynamo's id of the module) decides
    assert tree.resolve(str(id(q)), "L['whatever'].x", torch.nn.Linear) == "model.layers.1.self_attn.q_proj"
    assert tree.resolve(f"{id(q)}@2", "L['whatever'].x", torch.nn.Linear) == "model.layers.1.self_attn.q_proj"


def test_tree_resolves_paths_of_any_spelling(model):
    tree = ModuleTree(model)
    linear = torch.nn.Linear
    assert tree.resolve("k", "L['args'][0].model.layers[0].mlp.up_proj", linear) == "model.layers.0.mlp.up_proj"
    assert tree.resolve("k", "L['fn'].__self__.model.layers[0].mlp.up_proj", linear) == "model.layers.0.mlp.up_proj"
    assert tree.resolve("k", "L['self'].model.embed_tokens", torch.nn.Embedding) == "model.embed_tokens"
    # a frame resumed inside one layer names modules from that layer: unique endings resolve
    assert tree.resolve("k", "L['self'].lm_head", linear) == "lm_head"
    assert tree.resolve("k", "L['self'].mlp.up_proj", linear) is None  # one in every layer: ambiguous
    assert tree.resolve("k", "L['args'][0].model.layers[0].mlp.up_proj", torch.nn.Embedding) is None  # wrong type


def _linear_graph(path: str, key: str) -> fx.GraphModule:
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    node = graph.call_function(F.linear, (x, w))
    node.meta["nn_module_stack"] = {key: (path, torch.nn.Linear)}
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_annotate_uses_the_models_tree(model):
    pool = AdapterPool(2, 4, ["q_proj"])
    pool.register_modules(model_modules(model), complete=True)
    q = model.model.layers[0].self_attn.q_proj
    gm = annotate(_linear_graph("L['args'][0].model.layers[0].self_attn.q_proj", str(id(q))), PassContext(pool, modules=ModuleTree(model)))
    node = next(n for n in gm.graph.nodes if n.target is F.linear)
    assert node.meta["fxlora_module"] == "model.layers.0.self_attn.q_proj"


def test_annotate_fails_loudly_when_nothing_is_attributed(model):
    pool = AdapterPool(2, 4, ["q_proj"])
    pool.register_modules(model_modules(model), complete=True)
    gm = _linear_graph("L['self'].encoder.block[0].wq", "1")
    with pytest.raises(AttributionError, match=r"no call in the traced graph could be attributed.*transformers \d"):
        annotate(gm, PassContext(pool, modules=ModuleTree(model)))


def _wrap_forward(model: torch.nn.Module, keep_signature: bool) -> torch.nn.Module:
    """A user's decorator around the model's forward, as transformers' own deprecation shims are."""
    forward = type(model).forward

    def log_calls(*args, **kwargs):
        return forward(*args, **kwargs)

    wrapped = functools.wraps(forward)(log_calls) if keep_signature else log_calls
    model.forward = wrapped.__get__(model)
    return model


@pytest.mark.parametrize("keep_signature", [True, False])
def test_a_user_decorated_forward_end_to_end(keep_signature):
    model = _wrap_forward(tiny_model("qwen2", seed=5), keep_signature)
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, target_modules="all-linear"), 1, ""),
        "b": make_adapter(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), 2, ""),
    }
    cm = fxlora.compile(model, adapters=adapters)
    ids = torch.randint(3, 96, (3, 5))
    assert_matches_peft(cm, model, adapters, ["a", None, "b"], input_ids=ids)
    assert "nothing: every target runs its LoRA" in cm.explain()


FAMILIES = ["llama", "phi3", "gemma2"]  # rotary attention, fused projections, soft-capping
SHAPES = [(5, 4), (1, 3), (3, 6)]


@pytest.mark.long
def test_many_models_and_shapes_in_one_process():
    """Each model is called at several batch sizes and lengths through fxlora.compile and
    through torch.compile: no recompile limit is met, and every call matches PEFT."""
    torch._dynamo.reset()
    served = []
    for i, family in enumerate(FAMILIES):
        model = tiny_model(family, seed=i)
        adapters = {
            "a": make_adapter(model, LoraConfig(r=4, target_modules="all-linear"), 10 + i, ""),
            "b": make_adapter(model, LoraConfig(r=2, target_modules=["q_proj", "o_proj"]), 20 + i, ""),
        }
        peft_model = peft_model_with(model, adapters)
        cm = fxlora.compile(model, adapters=adapters)
        compiled = torch.compile(model, backend="fxlora", options={"adapters": adapters, "max_rank": 8})
        served.append((model, adapters, peft_model, cm, compiled))
    for model, adapters, peft_model, cm, compiled in served:
        for rows, length in SHAPES:
            ids = torch.randint(3, 96, (rows, length))
            names = [("a", "b", None)[r % 3] for r in range(rows)]
            assert_matches_peft(cm, model, adapters, names, peft_model=peft_model, input_ids=ids)
            with fxlora.use_adapters(names):
                out = compiled(input_ids=ids).logits
            check_rows(out, reference_logits(model, peft_model, names, input_ids=ids), names)
        assert cm.compile_count <= 4, cm.explain()  # rows and lengths of 1 are specialised; nothing else
    torch._dynamo.reset()


def test_adapter_rows_never_get_base_outputs_under_torch_compile(model):
    adapters = {"a": make_adapter(model, LoraConfig(r=4, target_modules=["q_proj"]), 0, "")}
    compiled = torch.compile(model, backend="fxlora", options={"adapters": adapters, "max_rank": 8})
    ids = torch.randint(3, 96, (2, 4))
    with fxlora.use_adapters(["a", None]):
        compiled(input_ids=ids)
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError, match="no fxlora graph ran"):
        with fxlora.use_adapters(["a", None]):  # the model runs eagerly: no LoRA anywhere
            compiled(input_ids=ids)
    with torch.compiler.set_stance("force_eager"), fxlora.use_adapters([None, None]):
        compiled(input_ids=ids)  # base rows only: nothing is missing


def test_modules_named_from_another_frame_than_the_models_are_refused_for_adapter_rows(model, monkeypatch):
    """A graph break inside a module, or torch.compile of a submodule, names the modules from
    the frame Dynamo compiled (``q_proj``, ``layers.0.self_attn.q_proj``): which layer's LoRA they
    need cannot be told, so adapter rows raise instead of getting base outputs; base rows run."""
    from transformers.models.llama import modeling_llama

    adapters = {"a": make_adapter(model, LoraConfig(r=4, target_modules=["q_proj"]), 0, "")}
    ids = torch.randint(3, 96, (2, 4))
    forward = modeling_llama.LlamaAttention.forward

    def broken(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    torch._dynamo.reset()
    with monkeypatch.context() as patch:
        patch.setattr(modeling_llama.LlamaAttention, "forward", broken)
        compiled = torch.compile(model, backend="fxlora", options={"adapters": adapters, "max_rank": 8})
        with pytest.raises(fxlora.LoraNotRunError, match="names module 'q_proj' from the frame it compiled"):
            with fxlora.use_adapters(["a", None]):
                compiled(input_ids=ids)
        with fxlora.use_adapters([None, None]):
            torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    torch._dynamo.reset()
    inner = torch.compile(model.model, backend="fxlora", options={"adapters": adapters, "max_rank": 8})
    with pytest.raises(fxlora.LoraNotRunError, match="'layers.0.self_attn.q_proj' from the frame"):
        with fxlora.use_adapters(["a", None]):
            inner(input_ids=ids)
    torch._dynamo.reset()


def test_a_targeted_module_dynamo_skips_raises_under_torch_compile(monkeypatch):
    """A targeted module whose code Dynamo does not compile (``torch.compiler.disable``) runs
    without its LoRA: rows whose adapter changes it raise, naming it, under ``torch.compile``
    as under ``fxlora.compile``; rows of adapters that leave it alone, and base rows, run."""
    model = tiny_model("llama", seed=3)
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), 1, ""),
        "b": make_adapter(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), 2, ""),
    }
    peft_model = peft_model_with(model, adapters)
    monkeypatch.setattr(model.lm_head, "forward", torch.compiler.disable(model.lm_head.forward))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxlora", options={"adapters": adapters, "max_rank": 8})
    ids = torch.randint(3, 96, (3, 5))
    with pytest.raises(fxlora.LoraNotRunError, match=r"'lm_head'.*ran outside the compiled graphs"):
        with fxlora.use_adapters(["a", None, "b"]):
            compiled(input_ids=ids)
    for names in (["b", None, "b"], [None, None, None]):
        with fxlora.use_adapters(names):
            out = compiled(input_ids=ids).logits
        check_rows(out, reference_logits(model, peft_model, names, input_ids=ids), names)
    torch._dynamo.reset()
