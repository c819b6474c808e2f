"""Which targeted modules a call runs, and whether their LoRA ran: a module the input does not
call needs none (as in PEFT); a module called twice is served at each call; a graph Dynamo
reuses for another instance of a layer serves that instance; a module that runs outside the
compiled graphs raises, naming it."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from transformers.modeling_outputs import CausalLMOutput

import fxlora
from fxlora.compiler.module_tree import ModuleTree
from fxlora.passes import Variants
from fxlora.runtime.instances import Instances
from fxlora.testing import assert_matches_peft, make_adapter

VOCAB, WIDTH, PIXELS = 32, 16, 8


class TwoWeights(torch.nn.Linear):
    """A linear whose forward also reads a weight of its own making: not one linear over its weight."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + F.linear(x, self.weight.flip(0))


class Block(torch.nn.Module):
    def __init__(self, graph_break: bool, out: type[torch.nn.Linear]):
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.o = out(WIDTH, WIDTH)
        self.graph_break = graph_break

    def forward(self, x):
        h = torch.relu(self.q(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.o(h)


class ToyLM(torch.nn.Module):
    """Embedding, a vision projection that only an image call runs, two blocks applied
    ``loops`` (1 or 2) times, a head. ``block_break``: a graph break inside each block, so Dynamo
    traces one block and reuses its graphs for the other."""

    def __init__(self, loops=1, block_break=False, out=torch.nn.Linear):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.vision = torch.nn.Linear(PIXELS, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(block_break, out) for _ in range(2)])
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.loops = loops

    def forward(self, input_ids, pixels=None):
        h = self.embed(input_ids)
        if pixels is not None:
            h = h + self.vision(pixels)[:, None]
        # no loop: a graph break in a block breaks this frame only around the block's call
        h = self.blocks[1](self.blocks[0](h))
        if self.loops == 2:
            h = self.blocks[1](self.blocks[0](h))
        return CausalLMOutput(logits=self.head(h))


class LoopBreakLM(ToyLM):
    """A graph break in the loop over the blocks: Dynamo gives up on this frame (for good: a
    class of its own keeps the other tests' code compiled), so ``embed`` and ``head`` run
    eagerly while each block is compiled in a frame of its own."""

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
            torch._dynamo.graph_break()
        return CausalLMOutput(logits=self.head(h))


ALL = ["q", "o", "vision", "head"]
ROWS = ["a", None, "b", "a"]


def compiled(model, tmp_path, targets=ALL):
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets), 1, str(tmp_path / "a")),
        "b": make_adapter(model, LoraConfig(r=2, lora_alpha=2, target_modules=["q"]), 2, str(tmp_path / "b")),
    }
    return fxlora.compile(model, adapters, max_loras=2, max_rank=4), adapters


def ids():
    return torch.randint(0, VOCAB, (len(ROWS), 5), generator=torch.Generator().manual_seed(1))


def test_a_module_the_input_does_not_call_needs_no_lora(tmp_path):
    model = ToyLM()
    cm, adapters = compiled(model, tmp_path)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=ids())  # the vision projection never runs
    assert "vision: targeted, but no traced graph calls it" in cm.explain()
    pixels = torch.randn(len(ROWS), PIXELS)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=ids(), pixels=pixels)  # now it runs, with its LoRA


def test_a_module_called_twice_is_served_at_each_call(tmp_path):
    model = ToyLM(loops=2)  # every block, so q and o, runs twice per forward
    cm, adapters = compiled(model, tmp_path)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=ids())
    lora = [r.lora for r in cm.backend.routers if r.lora is not None]
    ops = [n for g in lora for n in g.graph.nodes if n.target is torch.ops.fxlora.lora_linear.default]
    assert sorted(n.meta["fxlora_module"] for n in ops).count("blocks.0.q") == 2
    assert "Not served:\n  vision: targeted, but no traced graph calls it\n\n" in cm.explain()


def test_a_module_whose_call_makes_two_linears_gets_the_delta_on_its_output(tmp_path):
    model = ToyLM(out=TwoWeights)  # o's forward adds a linear over a flipped copy of its weight
    cm, adapters = compiled(model, tmp_path)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=ids())  # PEFT adds the delta onto o's output
    assert cm.backend.rewritten["blocks.0.o"] == "fxlora::lora_delta"


def test_a_graph_reused_for_another_instance_serves_it(tmp_path):
    model = ToyLM(block_break=True)  # Dynamo traces block 0's code and runs block 1 through the same graphs
    cm, adapters = compiled(model, tmp_path)
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=ids())
    assert "also runs for 1 other instance(s) of its code" in cm.explain()
    count = cm.compile_count
    assert_matches_peft(cm, model, adapters, ["b", "a", None, "a"], input_ids=ids())
    assert cm.compile_count == count  # the instances' variants are built once


def test_a_module_run_outside_the_graphs_raises_naming_it(tmp_path):
    model = LoopBreakLM()
    cm, adapters = compiled(model, tmp_path)
    with pytest.raises(fxlora.LoraNotRunError, match=r"'head'.*ran outside the compiled graphs.*torch._dynamo.graph_break"):
        cm(input_ids=ids(), adapter_names=ROWS)
    # rows whose adapter changes only q (in the blocks, which Dynamo still compiles) are served
    assert_matches_peft(cm, model, adapters, ["b", None, "b", "b"], input_ids=ids())


def test_instances_name_modules_by_the_parameters_a_call_passes():
    model = ToyLM()
    q0, q1 = model.blocks[0].q, model.blocks[1].q
    graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    traced = Variants(None, graph, frozenset(), frozenset({"blocks.0.q"}), ((1, "blocks.0.q", "weight"),))
    built = []
    instances = Instances(traced, ["x", q0.weight], ModuleTree(model), lambda renamed, inputs: built.append(renamed) or traced)
    assert instances.of(["y", q0.weight]) is traced and not built
    instances.of(["y", q1.weight])
    instances.of(["z", q1.weight])  # built once per instance
    assert built == [{"blocks.0.q": "blocks.1.q"}]
    assert instances.of(["y", torch.nn.Parameter(q1.weight.clone())]) is None  # a tensor no module holds



def test_a_parameter_replaced_after_compiling_is_followed(tmp_path):
    model = ToyLM(block_break=True)
    cm, adapters = compiled(model, tmp_path)
    cm(input_ids=ids(), adapter_names=ROWS)
    q = model.blocks[1].q
    q.weight = torch.nn.Parameter(q.weight + 1)  # block 1 now passes a parameter the first calls never saw
    assert_matches_peft(cm, model, adapters, ROWS, input_ids=ids())


def test_a_graph_run_for_modules_it_cannot_name_raises():
    selection = fxlora.runtime.Selection(names=("a",), watched=True, unknown=True)
    with pytest.raises(fxlora.LoraNotRunError, match="cannot name them"):
        selection.require({"blocks.1.q"})
    selection.require(set())  # no module of the row's adapter: nothing it could miss
