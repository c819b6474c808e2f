"""Property tests over the dense families: mixed batches against the PEFT oracle, and the
invariants of routing, batching and hot-loading. Each family is compiled once; hypothesis
varies adapters and batches against it."""

import copy
import functools
import logging
import tempfile
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fxlora
from fxlora.adapters import NO_ADAPTER
from fxlora.runtime.routing import Router, use_slots
from fxlora.testing import (
    FAMILIES,
    RTOL,
    adapter_sets,
    assert_matches_peft,
    batches,
    check_rows,
    decomposed_logits,
    layered_module_names,
    lora_module_names,
    make_adapter,
    merged_logits,
    oracle_noise,
    row_errors,
    tiny_model,
)

MAX_LORAS, MAX_RANK = 6, 32
MERGED_RTOL = 1e-5  # float32: merging changes only the rounding of W + s·B·A


@dataclass
class Served:
    family: str
    model: torch.nn.Module
    cm: fxlora.CompiledModel
    targets: list[str]
    layered: list[str]

    def load(self, adapters: dict) -> None:
        for name in self.cm.adapter_names:
            self.cm.unload_adapter(name)
        for name, source in adapters.items():
            self.cm.load_adapter(source, adapter_name=name)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request):
    torch._dynamo.reset()  # every family starts with Dynamo's per-function recompile budget
    model = tiny_model(request.param, seed=len(request.param))
    targets = lora_module_names(model)
    cm = fxlora.compile(model, target_modules=targets, max_loras=MAX_LORAS, max_rank=MAX_RANK, dynamic=True)
    return Served(request.param, model, cm, targets, layered_module_names(model))


def draw_adapters(data, served: Served, directory: str) -> dict:
    configs = data.draw(adapter_sets(served.targets, served.layered, max_rank=MAX_RANK), label="configs")
    in_memory = data.draw(st.booleans(), label="in_memory")
    return {
        f"ad{i}": make_adapter(
            served.model, config, seed=data.draw(st.integers(0, 2**16)), directory="" if in_memory else f"{directory}/ad{i}"
        )
        for i, config in enumerate(configs)
    }


def merged_oracles(model, adapters):
    """The merged oracle over ``model``, and the float32 noise a row may show against it, per
    row: the larger of the merged oracle's own noise and the unmerged decomposition's
    (:func:`oracle_noise`, each against the merged oracle over a float64 copy of the model). The
    decomposition computes as fxlora does, ``x @ W + s·(x @ A) @ B``, and where a large scaling
    makes the adapter outweigh the base it rounds farther from the exact answer than merging
    does (rank 6, alpha 45, rsLoRA on every linear: 1.8e-5 against the merged oracle's 2.7e-6)."""
    merged = functools.partial(merged_logits, model, adapters)
    unmerged = functools.partial(decomposed_logits, model, adapters)

    def noise(adapter_names, **inputs) -> list[float]:
        precise = merged_logits(copy.deepcopy(model).double(), adapters, adapter_names, **inputs)
        exact = lambda *a, **k: precise  # noqa: E731
        pairs = zip(oracle_noise(merged, exact, adapter_names, **inputs), oracle_noise(unmerged, exact, adapter_names, **inputs))
        return [max(a, b) for a, b in pairs]

    return merged, noise


@given(data=st.data())
def test_mixed_batch_matches_peft(served, data):
    with tempfile.TemporaryDirectory() as tmp:
        adapters = draw_adapters(data, served, tmp)
        batch = data.draw(batches(served.model.config.vocab_size, list(adapters)))
        served.cm(**batch.inputs)  # traces this shape class if it is new
        compiles = served.cm.compile_count
        served.load(adapters)
        out = assert_matches_peft(served.cm, served.model, adapters, batch.adapter_names, **batch.inputs)
    base = served.model(**batch.inputs).logits
    for i, name in enumerate(batch.adapter_names):
        if name is None:  # rows without an adapter run the base computation exactly
            assert torch.equal(out[i], base[i]), f"row {i}"
    # loading adapters changed nothing Dynamo sees: no retrace
    assert served.cm.compile_count == compiles


@given(data=st.data())
def test_mixed_batch_matches_merged_weights(served, data):
    """The second oracle, without PEFT: each row equals the model with its adapter merged."""
    with tempfile.TemporaryDirectory() as tmp:
        adapters = draw_adapters(data, served, tmp)
        served.load(adapters)
        batch = data.draw(batches(served.model.config.vocab_size, list(adapters)))
        out = served.cm(**batch.inputs, adapter_names=batch.adapter_names).logits
        merged, noise = merged_oracles(served.model, adapters)
        check_rows(
            out,
            merged(batch.adapter_names, **batch.inputs),
            batch.adapter_names,
            batch.attention_mask,
            MERGED_RTOL,
            noise=lambda: noise(batch.adapter_names, **batch.inputs),
            oracle="the merged oracle",
        )


def lora_variant_logits(served: Served, inputs: dict, slot_ids: torch.Tensor) -> torch.Tensor:
    """The compiled model's logits with ``slot_ids`` as the rows' slots, asserting that every
    graph ran its ``lora`` variant and every target's LoRA op ran in a graph. A call of
    ``served.cm`` cannot do this: it resolves ``adapter_names`` itself, and rows without an
    adapter select ``nolora``; the compiled function is called as the generation runtime calls
    it, under slot ids of its own."""
    ran = []
    run = Router._run

    def noted(router, variants, variant, args):
        ran.append(variant)
        return run(router, variants, variant, args)

    with (
        torch.no_grad(),  # as CompiledModel.forward: the graphs compiled for its calls serve this one
        mock.patch.object(Router, "_run", noted),
        served.cm.backend.lock,
        use_slots(slot_ids, batch=inputs["input_ids"]) as selection,
    ):
        out = served.cm._compiled(**inputs).logits
    assert ran and set(ran) == {"lora"}, f"graph variants run: {ran}"
    selection.require(set(served.cm.backend.rewritten))  # no target ran outside the graphs
    return out


@given(data=st.data())
def test_no_adapter_is_bit_identical_to_the_model(served, data):
    with tempfile.TemporaryDirectory() as tmp:
        served.load(draw_adapters(data, served, tmp))
    batch = data.draw(batches(served.model.config.vocab_size, []))
    base = served.model(**batch.inputs).logits
    assert torch.equal(served.cm(**batch.inputs).logits, base)  # adapter_names=None: nolora graph
    assert torch.equal(served.cm(**batch.inputs, adapter_names=batch.adapter_names).logits, base)  # all None: nolora
    no_adapter = torch.full((len(batch.adapter_names),), NO_ADAPTER, dtype=torch.int32)
    # the lora graph with every row on "no adapter" (in a mixed batch, the rows without one)
    assert torch.equal(lora_variant_logits(served, batch.inputs, no_adapter), base)


@given(data=st.data())
def test_rows_are_independent(served, data):
    """A row alone equals the same row in a batch; permuting rows permutes outputs."""
    with tempfile.TemporaryDirectory() as tmp:
        adapters = draw_adapters(data, served, tmp)
        served.load(adapters)
        batch = data.draw(batches(served.model.config.vocab_size, list(adapters)))
        names, mask = batch.adapter_names, batch.attention_mask
        out = served.cm(**batch.inputs, adapter_names=names).logits
        i = data.draw(st.integers(0, len(names) - 1), label="row")
        alone = served.cm(input_ids=batch.input_ids[i : i + 1], attention_mask=mask[i : i + 1], adapter_names=[names[i]]).logits
        # in float32 a row may move by the oracles' own noise for it
        _, noise = merged_oracles(served.model, adapters)
        row_noise = lambda: noise(names, **batch.inputs)[i : i + 1]  # noqa: E731
        check_rows(out[i : i + 1], alone, [names[i]], mask[i : i + 1], RTOL[torch.float32], row_noise, "the row alone")
        perm = data.draw(st.permutations(range(len(names))), label="perm")
        permuted = served.cm(input_ids=batch.input_ids[perm], attention_mask=mask[perm], adapter_names=[names[p] for p in perm]).logits
    assert max(row_errors(permuted, out[perm], mask[perm])) <= RTOL[torch.float32]


def test_unload_load_reload_without_recompiles(served, tmp_path):
    from peft import LoraConfig

    some = served.layered
    ends = sorted(set(served.targets) - set(some))  # embeddings and the output head
    adapters = {
        "x": make_adapter(served.model, LoraConfig(r=4, lora_alpha=8, target_modules=some[:2]), 1, str(tmp_path / "x")),
        "y": make_adapter(served.model, LoraConfig(r=8, lora_alpha=4, target_modules=some[1:]), 2, ""),
        "z": make_adapter(served.model, LoraConfig(r=2, lora_alpha=2, target_modules=ends), 3, ""),
    }
    served.load(adapters)
    ids = torch.randint(3, served.model.config.vocab_size, (3, 5))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    names = ["x", "y", "z"]
    first = assert_matches_peft(served.cm, served.model, adapters, names, **inputs)
    compiles = served.cm.compile_count
    served.cm.unload_adapter("x")
    assert "x" not in served.cm.adapter_names
    with pytest.raises(fxlora.AdapterError, match="unknown adapter 'x'"):
        served.cm(**inputs, adapter_names=names)
    served.cm.unload_adapter("y")
    served.cm.load_adapter(adapters["y"], adapter_name="y")  # lands in the slot x held
    served.cm.load_adapter(adapters["x"], adapter_name="x")
    again = assert_matches_peft(served.cm, served.model, adapters, names, **inputs)
    assert row_errors(again, first) == [0.0, 0.0, 0.0]
    assert served.cm.compile_count == compiles


def test_entry_points_agree(served, tmp_path, caplog):
    from peft import LoraConfig

    adapters = {
        "p": make_adapter(served.model, LoraConfig(r=3, target_modules=served.targets[:3]), 5, str(tmp_path / "p")),
        "q": make_adapter(served.model, LoraConfig(r=5, lora_alpha=3, use_rslora=True, target_modules="all-linear"), 6, ""),
    }
    served.load(adapters)
    options = {"adapters": adapters, "max_loras": MAX_LORAS, "max_rank": MAX_RANK}
    compiled = torch.compile(served.model, backend="fxlora", options=options, dynamic=True)
    ids = torch.randint(3, served.model.config.vocab_size, (4, 6))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    names = ["q", None, "p", "q"]
    with fxlora.use_adapters(names):
        via_dynamo = compiled(**inputs).logits
    assert torch.equal(via_dynamo, served.cm(**inputs, adapter_names=names).logits)
    # asking for CUDA graphs on CPU: the same graphs run eagerly, with one warning
    graphed = torch.compile(served.model, backend="fxlora", options=dict(options, cuda_graphs=True), dynamic=True)
    with caplog.at_level(logging.WARNING, logger="fxlora"), fxlora.use_adapters(names):
        for _ in range(2):
            assert torch.equal(graphed(**inputs).logits, via_dynamo)
    assert [r.message for r in caplog.records if "CUDA graphs" in r.message] == [
        "running without CUDA graphs: the model is on cpu, not CUDA"
    ]


def test_time_major_model_matches_peft_with_seq_equal_to_batch():
    """XLNet runs its layers on ``(seq, batch, hidden)``: with as many positions as rows every
    token dimension has the batch's size, and each row still gets its own adapter."""
    from peft import LoraConfig
    from transformers import XLNetConfig, XLNetLMHeadModel

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = XLNetConfig(vocab_size=96, d_model=32, n_layer=2, n_head=2, d_inner=48, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    model = XLNetLMHeadModel(config).eval()
    adapters = {n: make_adapter(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"), seed=r,
                                directory="") for n, r in (("a", 4), ("b", 2))}  # fmt: skip
    cm = fxlora.compile(model, adapters, max_loras=2, max_rank=4)
    for rows, seq in ((4, 4), (3, 5)):
        ids = torch.randint(3, 96, (rows, seq), generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            assert_matches_peft(cm, model, adapters, ["a", None, "b", "a"][:rows], input_ids=ids)
    assert {f.rsplit(".", 1)[-1] for f in cm.backend.rewritten} == {"layer_1", "layer_2"}
