"""Regional compilation: Inductor compiles a decoder's layers as regions, identical ones once,
and the regions called in order compute what the whole graph does; a layer whose code differs
(an adapter on some layers only) is compiled apart; a graph without a layer list is compiled
whole."""

import torch
from peft import LoraConfig
from torch.fx.experimental.proxy_tensor import make_fx

import fxlora
from fxlora.compiler import regions
from fxlora.testing import make_adapter, tiny_model
from fxlora.testing.oracle import assert_matches_peft


def _regions(cm) -> str:
    return next(line for line in cm.explain().splitlines() if "by region:" in line).strip()


def test_identical_layers_compile_once():
    model = tiny_model("llama", seed=5, num_hidden_layers=4)
    a = make_adapter(model, LoraConfig(r=4, target_modules="all-linear"), 1, "")
    b = make_adapter(model, LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"]), 2, "")
    cm = fxlora.compile(model, adapters={"a": a, "b": b}, max_loras=2, max_rank=8, inner="inductor")
    ids = torch.randint(3, 96, (3, 6))
    assert_matches_peft(cm, model, {"a": a, "b": b}, ["b", None, "a"], input_ids=ids)
    # before the layers, four layers, after; the first layer's lora region computes the prologue
    assert _regions(cm) == "by region: lora 6 regions, 4 compiled; nolora 6 regions, 3 compiled"
    ids = torch.randint(3, 96, (2, 9))  # other sizes: the regions' code reads them from its inputs
    assert_matches_peft(cm, model, {"a": a, "b": b}, [None, "b"], input_ids=ids)


def test_a_layer_of_other_code_is_compiled_apart():
    model = tiny_model("llama", seed=6, num_hidden_layers=4)
    a = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"], layers_to_transform=[2]), 1, "")
    cm = fxlora.compile(model, adapters={"a": a}, max_loras=2, max_rank=4, inner="inductor")
    ids = torch.randint(3, 96, (2, 5))
    assert_matches_peft(cm, model, {"a": a}, ["a", None], input_ids=ids)
    # layers 0, 1 and 3 share their code; layer 2, with the LoRA ops and their prologue, has its own
    assert _regions(cm) == "by region: lora 6 regions, 4 compiled; nolora 6 regions, 3 compiled"


def test_a_graph_without_a_layer_list_is_compiled_whole():
    gm = make_fx(lambda x: torch.relu(x) * 2, tracing_mode="fake")(torch.randn(4, 8))
    assert regions.split(gm) is None


def test_each_slot_is_freed_after_its_last_read():
    step = lambda inputs, outputs: regions.Step(regions.Region(None, []), inputs, outputs)  # noqa: E731
    steps = [step([0, 1], [2]), step([2, 0], [3]), step([3], [4])]
    regions._plan_frees(steps, (regions._Slot(4), regions._Slot(1)))
    # slot 1 is returned; slot 0 last read by the second step; 2 and 3 by the step after their own
    assert [sorted(s.frees) for s in steps] == [[], [0, 2], [3]]
