"""Each pass on a hand-written FX graph, and the whole pipeline on a Dynamo-traced model."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from toy_graphs import toy_expected, toy_graph, toy_pool

import fxlora.passes
from fxlora.adapters import AdapterPool, model_modules
from fxlora.compiler.context import PassContext
from fxlora.compiler.graph_edit import module_nodes, module_region, parameter_read
from fxlora.compiler.module_tree import module_fqn
from fxlora.compiler.operands import MAX_MEMBERS
from fxlora.compiler.rows import SLOT_IDS
from fxlora.passes import PIPELINE, STAGES, run_pipeline
from fxlora.passes.annotate import annotate
from fxlora.passes.batch_info import batch_info
from fxlora.passes.lora_embedding import lora_embedding
from fxlora.passes.lora_linear import lora_linear
from fxlora.testing import lora_module_names, tiny_model

LORA_LINEAR = torch.ops.fxlora.lora_linear.default
LORA_LINEAR_FUSED = torch.ops.fxlora.lora_linear_fused.default
LORA_EMBEDDING = torch.ops.fxlora.lora_embedding.default
BATCH_INFO = torch.ops.fxlora.batch_info.default


@pytest.fixture
def toy():
    ids = torch.randint(0, 11, (3, 4))
    model, gm = toy_graph(ids)
    return model, gm, toy_pool(model), ids


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target)


def lines(ctx):
    """The passes' records as ``explain()`` prints them."""
    return [str(r) for r in ctx.records]


@pytest.mark.parametrize(
    "path, fqn",
    [
        ("L['self'].model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"),
        ("L['self'].model.layers[0]._modules['mlp']", "model.layers.0.mlp"),
        ("L['self'].lm_head", "lm_head"),
        ("model.layers.1.mlp", "model.layers.1.mlp"),
    ],
)
def test_module_fqn(path, fqn):
    assert module_fqn(path) == fqn


def test_annotate_attributes_calls_to_modules(toy):
    model, gm, pool, _ = toy
    annotate(gm, PassContext(pool))
    owners = {n.target: n.meta.get("fxlora_module") for n in gm.graph.nodes if n.op == "call_function"}
    assert owners[F.embedding] == "emb"
    linears = [n.meta["fxlora_module"] for n in gm.graph.nodes if n.target is F.linear]
    assert linears == ["lin1", "lin2"]


def test_annotate_reads_nn_module_stack(toy):
    _, gm, pool, _ = toy
    node = next(n for n in gm.graph.nodes if n.target is F.linear)
    node.meta["nn_module_stack"] = {"x": ("L['self'].blocks[3].proj", torch.nn.Linear)}
    annotate(gm, PassContext(pool))
    assert node.meta["fxlora_module"] == "blocks.3.proj"
    assert node.meta["fxlora_module_type"] is torch.nn.Linear


def test_lora_linear_rewrites_only_targets(toy):
    _, gm, pool, _ = toy
    ctx = PassContext(pool)
    lora_linear(annotate(gm, ctx), ctx)
    assert count(gm, LORA_LINEAR) == 1 and count(gm, F.linear) == 1  # lin2 has no LoRA
    assert ctx.rewritten == {"lin1": "fxlora::lora_linear"}
    # the graph reads the pool's own tensors, so in-place adapter loads reach it
    assert gm.fxlora_lin1_lora_a.data_ptr() == pool.targets["lin1"].lora_a.data_ptr()


def lin1_twice(gm, pool, weight_of, second_call=True):
    """``gm`` with lin1's linear made twice on its input, the second over ``weight_of(its weight)``,
    as a second call of lin1 (Dynamo's ``@1`` key) or, without ``second_call``, in the same call."""
    annotate(gm, PassContext(pool))
    first = next(n for n in gm.graph.nodes if n.meta.get("fxlora_module") == "lin1")
    with gm.graph.inserting_before(first.next):
        weight = weight_of(gm.graph, first.args[1])
        again = gm.graph.call_function(F.linear, (first.args[0], weight, first.args[2]))
        total = gm.graph.call_function(torch.add, (first, again))
    again.meta.update(first.meta)
    if second_call:
        again.meta["fxlora_module_call"] = f"{first.meta.get('fxlora_module_call')}@1"
    else:  # the sum is the call's output
        total.meta.update(first.meta)
    first.replace_all_uses_with(total, delete_user_cb=lambda u: u not in (again, total))
    gm.graph.lint()
    return gm


def test_lora_linear_serves_each_call_over_the_modules_weight(toy):
    _, gm, pool, _ = toy
    ctx = PassContext(pool)
    lora_linear(lin1_twice(gm, pool, lambda graph, w: w), ctx)
    assert count(gm, LORA_LINEAR) == 2 and ctx.rewritten == {"lin1": "fxlora::lora_linear"}


def test_lora_linear_adds_the_delta_onto_calls_over_other_weights(toy):
    """A second call of lin1 over a weight it computes is not a plain linear of its weight:
    each call gets the delta onto its output, as PEFT's wrapper adds it."""
    _, gm, pool, _ = toy
    ctx = PassContext(pool)
    gm = lora_linear(lin1_twice(gm, pool, lambda graph, w: graph.call_function(torch.mul, (w, 2.0))), ctx)
    assert count(gm, LORA_LINEAR) == 0 and count(gm, torch.ops.fxlora.lora_delta.default) == 2
    assert ctx.rewritten == {"lin1": "fxlora::lora_delta"} and not ctx.left_traced


def test_lora_linear_adds_the_delta_once_onto_a_call_of_two_linears(toy):
    """PEFT adds the delta once onto a call's output, however many linears the call makes."""
    _, gm, pool, _ = toy
    ctx = PassContext(pool)
    gm = lora_linear(lin1_twice(gm, pool, lambda graph, w: w, second_call=False), ctx)
    assert count(gm, LORA_LINEAR) == 0 and count(gm, torch.ops.fxlora.lora_delta.default) == 1
    assert ctx.rewritten == {"lin1": "fxlora::lora_delta"}
    assert not ctx.left_traced and not any(r.kind == "skipped" for r in ctx.records)


def test_lora_embedding_rewrites_the_lookup(toy):
    _, gm, pool, _ = toy
    ctx = PassContext(pool)
    lora_embedding(annotate(gm, ctx), ctx)
    assert count(gm, LORA_EMBEDDING) == 1 and count(gm, F.embedding) == 0
    assert ctx.rewritten == {"emb": "fxlora::lora_embedding"}


def test_batch_info_merges_prologues_of_one_layout(toy):
    _, gm, pool, _ = toy
    ctx = PassContext(pool)
    for p in (annotate, lora_linear, lora_embedding):
        gm = p(gm, ctx)
    assert count(gm, BATCH_INFO) == 2
    batch_info(gm, ctx)
    assert count(gm, BATCH_INFO) == 1
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["ids", SLOT_IDS]


def test_batch_info_keeps_prologues_of_different_layouts(toy):
    _, gm, pool, _ = toy
    ctx = PassContext(pool)
    for p in (annotate, lora_linear, lora_embedding):
        gm = p(gm, ctx)
    # make lin1 see the last position only, as an output head computing few logits does
    prologue = [n for n in gm.graph.nodes if n.target is BATCH_INFO][-1]
    prologue.meta["fxlora_layout"] = "(3, 1)"
    batch_info(gm, ctx)
    assert count(gm, BATCH_INFO) == 2


def test_pipeline_on_hand_written_graph(toy):
    model, gm, pool, ids = toy
    original = gm(ids)
    traced = [(n.op, n.target, n.args) for n in gm.graph.nodes]
    variants = run_pipeline(gm, PassContext(pool))
    lora, nolora = variants.lora, variants.nolora
    assert [(n.op, n.target, n.args) for n in gm.graph.nodes] == traced  # the caller's graph is left alone
    assert [(n.op, n.target) for n in nolora.graph.nodes] == [(op, target) for op, target, _ in traced]
    assert torch.equal(nolora(ids), original)
    assert variants.rewritten == {"emb", "lin1"}
    for names in (["one", None, "two"], [None, None, None], ["two", "two", "one"]):
        slots = torch.tensor(pool.slot_ids(names), dtype=torch.int32)
        torch.testing.assert_close(lora(ids, slots), toy_expected(model, pool, ids, names), rtol=1e-5, atol=1e-6)
    assert torch.equal(lora(ids, torch.full((3,), -1, dtype=torch.int32)), original)


def test_pipeline_without_targets_has_no_lora_variant(toy):
    _, gm, _, ids = toy
    variants = run_pipeline(gm, PassContext(AdapterPool(1, 1, [])))
    assert variants.lora is None and not variants.rewritten
    assert torch.equal(variants.nolora(ids), gm(ids))


def test_pipeline_holds_every_pass_once_in_stage_order():
    """One list runs the passes: the shared ones, then (nolora copied) the LoRA ones, then those
    of each variant; every file of fxlora/passes is one of its entries."""
    stages = [s for s, _ in PIPELINE]
    assert stages == sorted(stages, key=STAGES.index)
    files = {p.stem for p in Path(fxlora.passes.__file__).parent.glob("*.py")} - {"__init__"}
    assert sorted(p.__name__ for _, p in PIPELINE) == sorted(files)


def test_pipeline_on_a_traced_model():
    model = tiny_model("qwen3")
    targets = [t for t in lora_module_names(model) if t != "lm_head"]
    pool = AdapterPool(max_loras=2, max_rank=4, target_modules=targets)
    ctx = PassContext(pool)
    captured = {}

    def backend(gm, example_inputs):
        variants = run_pipeline(gm, ctx)
        captured["lora"], captured["nolora"] = variants.lora, variants.nolora
        return captured["nolora"]

    ids = torch.randint(3, 96, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        out = torch.compile(model, backend=backend)(input_ids=ids).logits
    assert torch.equal(out, ref)
    lora = captured["lora"]
    assert count(lora, LORA_LINEAR) == 2 * 2  # o and down, two layers
    assert count(lora, LORA_LINEAR_FUSED) == 2 * 2  # q+k+v and gate+up
    assert count(lora, LORA_EMBEDDING) == 1
    assert count(lora, BATCH_INFO) == 1
    assert "fxlora" not in captured["nolora"].code
    assert count(captured["nolora"], F.linear) == 2 * 7 + 1  # and lm_head
    assert set(ctx.rewritten) == set(pool.targets)
    (fused,) = [r for r in ctx.records if r.pass_name == "lora_linear" and r.kind == "served"]
    assert str(fused) == "fused groups: gate_proj + up_proj; q_proj + k_proj + v_proj (4 in all, one shrink and one expand each)"
    assert len(fused.modules) == 2 * 5
    layer = "model.layers.0"
    assert set(pool.groups) >= {
        tuple(f"{layer}.self_attn.{p}_proj" for p in "qkv"),
        tuple(f"{layer}.mlp.{p}_proj" for p in ("gate", "up")),
    }


def test_module_regions_from_one_walk_equal_a_scan_each():
    """The linear pass's index of every module's nodes (one walk of the graph) gives each
    module, and each parent of one, the region a scan of the graph for it gives."""
    model = tiny_model("qwen3")
    pool = AdapterPool(max_loras=2, max_rank=4, target_modules=lora_module_names(model))
    checked = []

    def backend(gm, example_inputs):
        annotate(gm, PassContext(pool))
        index = module_nodes(gm)
        owners = {n.meta["fxlora_module"] for n in gm.graph.nodes if n.meta.get("fxlora_module") is not None}
        for owner in sorted(owners | {o.rpartition(".")[0] for o in owners} | {"model.layers.1.mlp.up", "absent"}):
            assert module_region(gm, owner, index) == module_region(gm, owner), owner
            checked.append(owner)
        assert any(n.target is F.linear for n in module_region(gm, "model.layers.0.self_attn.q_proj", index))
        return gm

    with torch.no_grad():
        torch.compile(model, backend=backend)(input_ids=torch.randint(3, 96, (2, 5)))
    assert "model.layers.1.mlp" in checked and "model.layers.0.self_attn.q_proj" in checked


class _OutputFirst(torch.nn.Module):
    """q, k and v read one input, but the output projection, of the same width, was
    registered between q and k: the pool lays them out q, o, k, v."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q, self.o, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


def test_fuse_takes_only_neighbours_and_reports_the_rest():
    """Linears that read one input but are not neighbours in the pool's layout are served one
    by one, with a note saying why; which graph comes first never matters."""
    model = _OutputFirst()
    pool = AdapterPool(max_loras=2, max_rank=4, target_modules=["q", "k", "v", "o"])
    ctx = PassContext(pool)
    pool.register_modules(model_modules(model), complete=True)
    assert pool.targets["q"].stack.fqns == ("q", "o", "k", "v")

    def backend(gm, example_inputs):
        return run_pipeline(gm, ctx).nolora

    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 3, 16))
    assert pool.groups == {}
    assert any("not fused q, k, v" in line and "not neighbours" in line for line in lines(ctx))
    assert {ctx.rewritten[f] for f in "qkvo"} == {"fxlora::lora_linear"}


def test_fused_groups_fit_the_expands():
    sgmv = pytest.importorskip("fxlora.kernels.sgmv")
    assert MAX_MEMBERS == sgmv.MAX_SLICES


class _TimeMajor(torch.nn.Module):
    """Embeds and projects ``(seq, batch)`` tokens, as XLNet does; ``flatten`` runs the
    projection on the ``(seq·batch, hidden)`` flattening instead, or on the row-major one."""

    def __init__(self, flatten: str | None = None):
        super().__init__()
        self.emb, self.lin, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 6), torch.nn.Linear(6, 5)
        self.flatten = flatten

    def forward(self, ids):
        h = self.emb(ids.transpose(0, 1))  # (seq, batch, 8)
        if self.flatten == "time-major":
            h = self.lin(h.reshape(-1, 8)).view(ids.shape[1], ids.shape[0], 6)
        elif self.flatten == "row-major":
            h = self.lin(h.transpose(0, 1).reshape(-1, 8)).view(*ids.shape, 6).transpose(0, 1)
        else:
            h = self.lin(h)
        return self.head(torch.relu(h)).transpose(0, 1)  # (batch, seq, 5)


def _time_major_case(flatten):
    from peft import LoraConfig

    import fxlora
    from fxlora.testing import make_adapter, peft_model_with

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TimeMajor(flatten).eval()
    adapters = {n: make_adapter(model, LoraConfig(r=2, lora_alpha=4, target_modules=["emb", "lin"]), seed=i,
                                directory="") for i, n in enumerate("ab")}  # fmt: skip
    return model, adapters, fxlora.compile(model, adapters, max_loras=2, max_rank=4), peft_model_with(model, adapters)


@pytest.mark.parametrize("flatten", [None, "row-major"])
def test_rows_of_a_time_major_model_follow_the_batch_dimension(flatten):
    """With seq == batch every dimension has the batch's size; the rows are found by the
    traced symbol of the batch input's first dimension, each row against PEFT on its own."""
    model, adapters, cm, peft_model = _time_major_case(flatten)
    names = ["a", None, "b", "a"]
    for seq in (4, 6):
        ids = torch.randint(0, 11, (4, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            out = cm(ids, adapter_names=names)
            for i, name in enumerate(names):
                if name is None:
                    want = model(ids[i : i + 1])
                else:
                    peft_model.set_adapter(name)
                    want = peft_model(ids[i : i + 1])
                torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-6)
    assert cm.compile_count == 1 and set(cm.backend.rewritten) == {"emb", "lin"}


def test_rows_a_flattening_hides_are_not_served():
    """A ``(seq·batch, hidden)`` input in time-major order: no dimension of its own holds the
    rows, so the module keeps its base computation and a row that needs its LoRA says why."""
    from fxlora import LoraNotRunError

    model, _, cm, _ = _time_major_case("time-major")
    ids = torch.randint(0, 11, (3, 3))
    with torch.no_grad():
        assert torch.equal(cm(ids, adapter_names=[None, None, None]), model(ids))
        with pytest.raises(LoraNotRunError, match=r"'lin', did not run: fxlora left that module as traced, because "
                           r"cannot tell which of its input's token dimensions \(s\d+\*s\d+,\) hold the batch's s\d+ rows"):
            cm(ids, adapter_names=["a", None, "b"])
    assert cm.backend.rewritten == {"emb": "fxlora::lora_embedding"}


def test_a_parameter_read_follows_the_local_shard_in_both_traced_forms():
    """``w.to_local().float()`` reads ``w``: Dynamo traces ``to_local`` as a method call, or
    (before torch 2.13) as a call of a function of its own named ``prim_to_local``."""

    def prim_to_local(x):
        return x

    graph = torch.fx.Graph()
    w = graph.placeholder("w")
    method = graph.call_method("float", (graph.call_method("to_local", (w,)),))
    function = graph.call_method("float", (graph.call_function(prim_to_local, (w,)),))
    computed = graph.call_function(torch.neg, (w,))
    for node in (method, function):
        assert parameter_read(node) == [w, node.args[0], node]
    assert parameter_read(computed) is None
