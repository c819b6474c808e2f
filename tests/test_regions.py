"""Regional compilation: Inductor compiles a decoder's layers as regions, identical ones once,
and the regions called in order compute what the whole graph does, under dynamic shapes and
with writes into the graph's inputs between them; a layer whose code differs (an adapter on
some layers only) is compiled apart; a graph without a layer list is compiled whole, and so is
one whose split would have to run a recorded context manager to learn its value."""

import pytest
import torch
import torch.fx as fx
from peft import LoraConfig
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxlora
from fxlora.compiler import regions
from fxlora.compiler.inner import compile_inner
from fxlora.compiler.module_tree import module_fqn
from fxlora.testing import make_adapter, tiny_model
from fxlora.testing.oracle import assert_matches_peft

pytestmark = pytest.mark.inductor  # Inductor compiles the graphs of nearly every test here


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


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, h, mask, cache, at):
        cache.index_copy_(0, at, h[:1])  # a write into a graph input (a KV cache) that the next layer reads
        return torch.relu(self.proj(h) + mask.sum(-1, keepdim=True) + cache.sum(0))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(4)])

    def forward(self, h, past, new, cache, at):
        mask = torch.cat([past, new], dim=1)  # (rows, past + new): a sum of symbols, read by every layer
        for layer in self.layers:
            h = layer(h, mask, cache, at)
        return h * 2


def test_regions_compute_what_the_graph_does_under_dynamic_shapes():
    compiled = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:  # as annotate attributes nodes, by Dynamo's module paths
            if node.op.startswith("call") and node.meta.get("nn_module_stack"):
                node.meta["fxlora_module"] = module_fqn(list(node.meta["nn_module_stack"].values())[-1][0])
        compiled.append(compile_inner(gm, "inductor"))
        return compiled[-1]

    model = _Model()
    run = torch.compile(model, backend=backend, dynamic=True)
    for rows, past, new in ((3, 5, 2), (2, 7, 3)):
        args = (torch.randn(rows, 4), torch.randn(rows, past), torch.randn(rows, new), torch.randn(6, 4), torch.tensor([rows]))
        expected_cache = args[3].clone()
        with torch.no_grad():
            expected = model(args[0], args[1], args[2], expected_cache, args[4])
            torch.testing.assert_close(run(*args), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(args[3], expected_cache, rtol=1e-5, atol=1e-5)
    # the mask's prologue with the first layer, two identical layers, the last with the doubling
    assert [c.regions.describe() for c in compiled] == ["4 regions, 3 compiled"]


def test_a_context_across_layers_stops_the_split_without_being_entered():
    # a context manager Dynamo records as calls (autocast) with no traced value: the split must
    # not run it to learn its value, as that would enter it for real
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = FakeTensorMode().from_tensor(torch.randn(2, 4))
    context = graph.call_function(_enter_autocast, ("cpu", torch.bfloat16, True, None))
    h = x
    for i in range(3):
        h = graph.call_function(torch.relu, (h,))
        h.meta["fxlora_module"] = f"layers.{i}"
    graph.call_function(_exit_autocast, (context,))
    graph.output((h,))
    assert regions.split(fx.GraphModule(torch.nn.Module(), graph)) is None
    assert not torch.is_autocast_enabled("cpu")


def test_a_graph_without_a_layer_list_is_compiled_whole():
    gm = make_fx(lambda x: torch.relu(x) * 2, tracing_mode="fake")(torch.randn(4, 8))
    assert regions.split(gm) is None


def test_each_slot_is_freed_after_its_last_read():
    step = lambda inputs, outputs: regions.Step(regions.Region(None, []), inputs, outputs)  # noqa: E731
    steps = [step([0, 1], [2]), step([2, 0], [3]), step([3], [4])]
    regions._plan_frees(steps, (regions._Slot(4), regions._Slot(1)))
    # slot 1 is returned; slot 0 last read by the second step; 2 and 3 by the step after their own
    assert [sorted(s.frees) for s in steps] == [[], [0, 2], [3]]


class _PagedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, h, pages):
        return torch.relu(self.proj(h) + pages.sum(0))


class _PagedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_PagedLayer() for _ in range(4)])

    def forward(self, h, pages):
        for layer, p in zip(self.layers, pages):
            h = layer(h, p)
        return h * 2


def test_layers_whose_inputs_hold_symbols_of_their_own_compile_once():
    """Each layer's KV-cache pages: a tensor of its own whose block count Dynamo traces as a
    symbol of its own. The layers' regions differ only in which symbols they read: one code."""
    compiled = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op.startswith("call") and node.meta.get("nn_module_stack"):
                node.meta["fxlora_module"] = module_fqn(list(node.meta["nn_module_stack"].values())[-1][0])
        compiled.append(compile_inner(gm, "inductor"))
        return compiled[-1]

    model = _PagedModel()
    run = torch.compile(model, backend=backend)
    for blocks in ((6,) * 4, (9,) * 4, (5, 7, 5, 7)):  # other block counts reuse the code while the layers' agree
        h, pages = torch.randn(3, 4), [torch.randn(b, 4) for b in blocks]
        for p in pages:
            torch._dynamo.maybe_mark_dynamic(p, 0)
        with torch.no_grad():
            torch.testing.assert_close(run(h, pages), model(h, pages), rtol=1e-5, atol=1e-5)
    symbols = {str(s) for step in compiled[0].regions.steps for v in step.region.example_inputs for s in getattr(v, "shape", ())}
    assert len(symbols) > 1, symbols  # the pages' sizes are symbols of their own
    # three layers alike, the last with the doubling; sizes that part retrace, sharing less
    assert [c.regions.describe() for c in compiled] == ["4 regions, 2 compiled", "4 regions, 3 compiled"]
