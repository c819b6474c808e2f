"""The lora_linear pass on small Dynamo-traced modules: a plain F.linear of a module's weight
becomes fxlora::lora_linear (in code captured in CUDA graphs, fxlora::lora_linear_beside and
an add of its delta); linears that are not (``input @ weight.T``, torchao-quantised
weights, a linear followed by more work) get fxlora::lora_delta onto their output, joined when
they read one input; against PEFT per row (float32, 1e-5 relative), rows without an adapter bit
for bit the traced graph's."""

import operator

import pytest
import torch
from peft import LoraConfig

from fxlora.adapters import AdapterPool, model_modules, read_adapter
from fxlora.compiler.context import PassContext
from fxlora.compiler.module_tree import ModuleTree
from fxlora.passes import run_pipeline
from fxlora.testing import check_rows, make_adapter, peft_model_with

LORA_DELTA = torch.ops.fxlora.lora_delta.default
LORA_SHRINK = torch.ops.fxlora.lora_shrink.default
LORA_LINEAR = torch.ops.fxlora.lora_linear.default
LORA_LINEAR_FUSED = torch.ops.fxlora.lora_linear_fused.default
LORA_LINEAR_BESIDE = torch.ops.fxlora.lora_linear_beside.default


class MatmulLinear(torch.nn.Linear):
    """Falcon's FalconLinear: ``input @ weight.T``, then the bias."""

    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class InPlaceLinear(torch.nn.Linear):
    """A forward that scales its own result in place."""

    def forward(self, x):
        y = x @ self.weight.T
        return y.mul_(0.5)


class Block(torch.nn.Module):
    """``a`` and ``b`` read one input, ``a``'s output is used before ``b`` runs; ``c`` is a
    plain linear."""

    def __init__(self, first=MatmulLinear, second=MatmulLinear):
        super().__init__()
        self.a, self.b, self.c = first(8, 6), second(8, 4, bias=False), torch.nn.Linear(10, 8)

    def forward(self, h):
        ya = torch.relu(self.a(h))
        return self.c(torch.cat([ya, self.b(h)], -1)) + h


class Normed(torch.nn.Module):
    """``a`` and ``b`` read a normed input the graph computes (Inductor may write it once per
    op that reads it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = MatmulLinear(8, 8, bias=False), MatmulLinear(8, 4, bias=False), torch.nn.Linear(12, 8)

    def forward(self, h):
        x = torch.nn.functional.layer_norm(h * 2, (8,))
        return self.c(torch.cat([torch.relu(self.a(x)), self.b(x)], -1)) + h


class Scaled(torch.nn.Linear):
    """A plain F.linear of the weight, then more work: PEFT adds the delta after the scaling."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias) * 2


class Attention(torch.nn.Module):
    """q, k and v: plain linears that read one input, then o over their outputs."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4)
        self.o = torch.nn.Linear(16, 8)

    def forward(self, h):
        return self.o(torch.cat([torch.relu(self.q(h)), self.k(h) * 2, self.v(h)], -1)) + h


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = MatmulLinear(8, 8)

    def forward(self, h):
        return self.a(self.a(h))


def compile_toy(model, adapters, h, shrink_ahead=False):
    """The pipeline's variants for ``model`` traced by Dynamo on ``h``, its context and inputs
    (``shrink_ahead`` as the backend sets it for graphs run on CUDA)."""
    pool = AdapterPool(max_loras=3, max_rank=4)
    for name, adapter in adapters.items():
        pool.load(read_adapter(name, adapter))
    pool.register_modules(model_modules(model), complete=True)
    captured = {}

    def backend(gm, example_inputs):
        ctx = PassContext(pool, inputs=list(example_inputs), modules=ModuleTree(model), shrink_ahead=shrink_ahead)
        captured.update(variants=run_pipeline(gm, ctx), ctx=ctx, inputs=list(example_inputs))
        return captured["variants"].nolora

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(h)
    return captured["variants"], captured["ctx"], captured["inputs"], pool


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target)


def adapters_for(model, targets):
    return {
        "one": make_adapter(model, LoraConfig(r=2, lora_alpha=4, target_modules=targets), seed=1, directory=""),
        "two": make_adapter(model, LoraConfig(r=4, lora_alpha=2, target_modules=targets[:1]), seed=2, directory=""),
    }


def check_against_peft(model, adapters, variants, inputs, pool, h):
    peft_model = peft_model_with(model, adapters)
    base = model(h)
    for names in (["one", None, "two"], ["two", "two", "one"], [None, None, None]):
        out = variants.lora(*inputs, torch.tensor(pool.slot_ids(names), dtype=torch.int32))
        out = out[0] if isinstance(out, (tuple, list)) else out
        ref = torch.empty_like(out)
        for i, name in enumerate(names):
            if name is None:
                ref[i] = base[i]
            else:
                peft_model.set_adapter(name)
                ref[i] = peft_model(h[i : i + 1])[0]
        check_rows(out, ref, names)
        rows = [i for i, n in enumerate(names) if n is None]
        assert torch.equal(out[rows], base[rows])  # no adapter: the traced base, bit for bit


def test_matmul_linears_get_the_delta_joined_on_their_shared_input():
    torch.manual_seed(0)
    model = Block().eval()
    h = torch.randn(3, 5, 8)
    adapters = adapters_for(model, ["a", "b", "c"])
    variants, ctx, inputs, pool = compile_toy(model, adapters, h)
    assert count(variants.lora, LORA_DELTA) == 1  # a and b: one op over both outputs
    assert count(variants.lora, LORA_LINEAR) == 1  # c: a plain F.linear keeps the fused op
    assert ctx.rewritten == {"a": "fxlora::lora_delta", "b": "fxlora::lora_delta", "c": "fxlora::lora_linear"}
    assert ("a", "b") in pool.groups
    assert "LoRA delta onto the traced base of 2 module(s): a + b" in [str(r) for r in ctx.records if r.kind == "served"]
    assert not any(n.target is LORA_DELTA for n in variants.nolora.graph.nodes)
    check_against_peft(model, adapters, variants, inputs, pool, h)


def test_the_shrink_goes_before_the_base_for_code_run_on_cuda():
    """With ``shrink_ahead`` each delta's shrink is fxlora::lora_shrink right before the first
    node of its regions (under a CUDA graph it runs beside them), into the workspace the delta
    after them reads; the result is PEFT's, and is what Inductor compiles."""
    torch.manual_seed(0)
    model = Block().eval()
    h = torch.randn(3, 5, 8)
    adapters = adapters_for(model, ["a", "b", "c"])
    variants, ctx, inputs, pool = compile_toy(model, adapters, h, shrink_ahead=True)
    nodes = list(variants.lora.graph.nodes)
    (shrink,), (delta,) = [n for n in nodes if n.target is LORA_SHRINK], [n for n in nodes if n.target is LORA_DELTA]
    assert shrink.args[-1] == 2 and delta.args[-1] is True  # a and b: two slices; the delta only expands
    assert delta.args[0] is shrink.args[0] and delta.args[2:5] == shrink.args[1:4]  # same input, factors, scratch
    regions = [i for i, n in enumerate(nodes) if n.meta.get("fxlora_module") in ("a", "b")]
    assert nodes.index(shrink) < min(regions) and nodes.index(delta) > max(regions)
    assert "each shrink issued before its traced base (fxlora::lora_shrink)" in [str(r) for r in ctx.records]
    check_against_peft(model, adapters, variants, inputs, pool, h)


@pytest.mark.inductor
def test_plain_linears_in_captured_code_get_their_delta_beside_and_added_by_the_graph():
    """With ``shrink_ahead`` a group of plain linears (q, k, v) and a single one (o) each become
    one fxlora::lora_linear_beside, whose delta columns the graph adds onto each output; the
    result is PEFT's (rows without an adapter the traced base's, bit for bit), and so is
    Inductor's compilation of it."""
    from fxlora.compiler.inner import compile_inner

    torch.manual_seed(0)
    model = Attention().eval()
    h = torch.randn(3, 5, 8)
    adapters = adapters_for(model, ["q", "k", "v", "o"])
    variants, ctx, inputs, pool = compile_toy(model, adapters, h, shrink_ahead=True)
    assert count(variants.lora, LORA_LINEAR_BESIDE) == 2 and count(variants.lora, LORA_LINEAR_FUSED) == 0
    assert set(ctx.rewritten.values()) == {"fxlora::lora_linear_beside"} and ("q", "k", "v") in pool.groups
    adds = [n for n in variants.lora.graph.nodes if n.target is operator.add and n.args[1].op == "call_function"]
    assert len(adds) == 4  # one per linear: its output plus its columns of the delta
    check_against_peft(model, adapters, variants, inputs, pool, h)
    slots = torch.tensor(pool.slot_ids(["one", None, "two"]), dtype=torch.int32)
    with torch.no_grad():
        out = compile_inner(variants.lora, "inductor")(*inputs, slots)
    torch.testing.assert_close(out[0], variants.lora(*inputs, slots)[0], rtol=1e-5, atol=1e-6)


def test_inductor_keeps_the_shrinks_input_until_the_delta():
    """Under capture the shrink's side stream reads its input after the op returns: Inductor
    compiles a graph with ``lora_shrink`` without reusing any buffer in its code (by default it
    hands the shrink's copy of the normed input to the base GEMM's output), and computes what
    the graph does."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    from fxlora.compiler.inner import compile_inner

    torch.manual_seed(0)
    model = Normed().eval()
    h = torch.randn(3, 5, 8)
    variants, _, inputs, pool = compile_toy(model, adapters_for(model, ["a", "b", "c"]), h, shrink_ahead=True)
    slots = torch.tensor(pool.slot_ids(["one", None, "two"]), dtype=torch.int32)
    reused = lambda code: [line for line in code.splitlines() if "# reuse" in line]  # noqa: E731
    with torch.no_grad():
        _, (default,) = run_and_get_code(lambda: compile_fx(variants.lora, [*inputs, slots])(*inputs, slots))
        out, (code,) = run_and_get_code(lambda: compile_inner(variants.lora, "inductor")(*inputs, slots))
    assert "fxlora.lora_shrink" in code and reused(default) and not reused(code)
    torch.testing.assert_close(out[0], variants.lora(*inputs, slots)[0], rtol=1e-5, atol=1e-6)


def test_the_rewritten_graph_compiles_with_inductor():
    """Inductor, the inner compiler to come, functionalizes the in-place op soundly."""
    torch.manual_seed(0)
    model = Block().eval()
    h = torch.randn(3, 5, 8)
    variants, _, inputs, pool = compile_toy(model, adapters_for(model, ["a", "b", "c"]), h)
    torch._dynamo.reset()
    compiled = torch.compile(variants.lora, backend="inductor")
    for names in (["one", None, "two"], [None, None, None]):
        slots = torch.tensor(pool.slot_ids(names), dtype=torch.int32)
        torch.testing.assert_close(compiled(*inputs, slots)[0], variants.lora(*inputs, slots)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shrink_ahead", [False, True], ids=["one_op", "shrink_ahead"])
def test_a_region_that_mutates_is_served_where_it_was_traced(shrink_ahead):
    """... and, a region that writes a tensor, its shrink stays in its delta (it might write
    the input the shrink reads)."""
    torch.manual_seed(0)
    model = Block(second=InPlaceLinear).eval()
    h = torch.randn(3, 5, 8)
    adapters = adapters_for(model, ["b", "a"])
    variants, ctx, inputs, pool = compile_toy(model, adapters, h, shrink_ahead)
    assert count(variants.lora, LORA_DELTA) == 2
    assert [n.meta["fxlora_module"] for n in variants.lora.graph.nodes if n.target is LORA_SHRINK] == ["a"] * shrink_ahead
    assert any(str(r).startswith("not joined a, b: b mutates a tensor") for r in ctx.records if r.kind == "info")
    check_against_peft(model, adapters, variants, inputs, pool, h)


def test_a_linear_followed_by_more_work_gets_the_delta_onto_the_modules_output():
    """Replacing the F.linear by the fused op would scale the delta too."""
    torch.manual_seed(0)
    model = Block(first=Scaled, second=torch.nn.Linear).eval()
    h = torch.randn(3, 5, 8)
    adapters = adapters_for(model, ["a", "b", "c"])
    variants, ctx, inputs, pool = compile_toy(model, adapters, h)
    assert ctx.rewritten == {"a": "fxlora::lora_delta", "b": "fxlora::lora_linear", "c": "fxlora::lora_linear"}
    check_against_peft(model, adapters, variants, inputs, pool, h)


class Chain(torch.nn.Module):
    """``b`` reads ``a``'s output: serving ``a`` first replaces the node ``b`` reads."""

    def __init__(self, second=torch.nn.Linear):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), second(8, 8), torch.nn.Linear(8, 8)

    def forward(self, h):
        return self.c(self.b(self.a(h))) + h


@pytest.mark.parametrize("second", [torch.nn.Linear, Scaled], ids=["plain", "scaled"])
def test_a_targeted_linear_that_reads_another_ones_output(second):
    torch.manual_seed(0)
    model = Chain(second).eval()
    h = torch.randn(3, 5, 8)
    adapters = adapters_for(model, ["a", "b", "c"])
    variants, ctx, inputs, pool = compile_toy(model, adapters, h)
    assert set(ctx.rewritten) == {"a", "b", "c"}
    check_against_peft(model, adapters, variants, inputs, pool, h)


def test_a_module_called_twice_gets_the_delta_on_each_call():
    """``a(a(h))``: one region without its calls told apart would have one output and one
    input, and one delta where PEFT adds two."""
    torch.manual_seed(0)
    model = Twice().eval()
    h = torch.randn(3, 5, 8)
    adapters = adapters_for(model, ["a"])
    variants, ctx, inputs, pool = compile_toy(model, adapters, h)
    assert count(variants.lora, LORA_DELTA) == 2 and ctx.rewritten == {"a": "fxlora::lora_delta"}
    check_against_peft(model, adapters, variants, inputs, pool, h)


@pytest.mark.parametrize("shrink_ahead", [False, True], ids=["one_op", "shrink_ahead"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_torchao_weights_are_left_to_lora_delta(quantization, shrink_ahead):
    """The fused ops would hand the quantised weight to F.linear inside them; the traced F.linear of the quantised weight stays, and the delta goes onto it."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup, quantize_

    torch.manual_seed(0)
    model = Block(first=torch.nn.Linear, second=torch.nn.Linear).eval()
    model.a, model.b, model.c = torch.nn.Linear(32, 6), torch.nn.Linear(32, 4, bias=False), torch.nn.Linear(10, 32)
    adapters = adapters_for(model, ["a", "b", "c"])
    config = Int8WeightOnlyConfig() if quantization == "int8" else IntxWeightOnlyConfig(torch.int4, PerGroup(32))
    quantize_(model, config, filter_fn=lambda m, fqn: fqn in ("a", "b"))
    assert type(model.a.weight).__module__.startswith("torchao")
    h = torch.randn(3, 5, 32)
    variants, ctx, inputs, pool = compile_toy(model, adapters, h, shrink_ahead)
    assert count(variants.lora, LORA_DELTA) == 1 and count(variants.lora, LORA_LINEAR_FUSED) == 0
    assert count(variants.lora, LORA_SHRINK) == shrink_ahead
    plain = "fxlora::lora_linear_beside" if shrink_ahead else "fxlora::lora_linear"
    assert ctx.rewritten == {"a": "fxlora::lora_delta", "b": "fxlora::lora_delta", "c": plain}
    check_against_peft(model, adapters, variants, inputs, pool, h)
