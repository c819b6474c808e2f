"""Tensor parallelism on CPU: two gloo ranks under ``torch.distributed.run`` serve a model
sharded with transformers' own plan (``DistributedConfig(tp_plan="auto")``), and every rank's
logits and tokens equal the single-process fxlora run and the PEFT oracle.

Each case saves a tiny model and PEFT adapters to a temporary directory, runs the same script
in one process (the expectation) and on two ranks (``tests/tp_worker.py``), and compares.
The ranks run under ``tests/ranks.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from ranks import run_ranks
from safetensors.torch import save_file
from tp_worker import stream_tokens

import fxlora
from fxlora.testing import RTOL, make_adapter, peft_model_with, reference_generate, tiny_model

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

WORKER = Path(__file__).with_name("tp_worker.py")
DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def single_process(model, directory: Path, script: dict, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The worker's script in this process, unsharded."""
    cm = fxlora.compile(
        model,
        {name: str(directory / name) for name in script["adapters"]},
        max_loras=4,
        max_rank=16,
        target_modules=script["target_modules"],
        max_batch_size=4,
        max_len=32,
    )
    out = {}
    with torch.no_grad():
        out["first"] = cm(input_ids=ids, adapter_names=script["first"]).logits
        cm.load_adapter(str(directory / "c"), adapter_name="c")
        out["loaded"] = cm(input_ids=ids, adapter_names=script["loaded"]).logits
        cm.unload_adapter("a")
        out["unloaded"] = cm(input_ids=ids, adapter_names=script["unloaded"]).logits
        out["generated"] = cm.generate(ids, adapter_names=script["generate"], max_new_tokens=script["max_new_tokens"])
        cm._requests(dict(max_batch_size=3, max_len=32, block_size=4, window=3), None)
        out["stream"] = stream_tokens(cm, script["stream"])
        if script["embedding"]:
            cm = fxlora.compile(model, {"e": str(directory / "e")}, max_loras=2, max_rank=16)
            out["embedding"] = cm(input_ids=ids, adapter_names=script["embedding"]).logits
    return out


def close(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
CASES = {
    # a Llama-shaped model: q/k/v, gate/up and the output head column-parallel, o_proj and
    # down_proj row-parallel; adapters of different ranks and targets. Its graphs are rewritten
    # as for CUDA graphs (``shrink_ahead``): each plain linear's delta apart (lora_linear_beside)
    # and added to its rank's share of the output, before a row-parallel linear's all-reduce
    # sums the shares; the other cases keep the in-place ops that code run on the CPU gets
    "dense": dict(
        family="llama",
        adapters={
            "a": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
            "b": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
            "c": LoraConfig(r=6, lora_alpha=6, target_modules=[*DENSE, "lm_head"]),
        },
        target_modules=[*DENSE, "lm_head"],
        intermediate_size=49,  # gate/up and down_proj split unevenly: 25 features on one rank, 24 on the other
        widths={"model.layers.0.mlp.gate_proj": {25, 24}},
        embedding=True,  # an adapter on the embedding too, which transformers 5.2x's plan splits over its vocabulary
        as_on_cuda=True,
    ),
    # a Qwen3-MoE-shaped model: the experts sharded over their intermediate features (gate_up's
    # halves each split, down_proj split by input), the router replicated; PEFT's all-linear
    # on it adapts the experts and the router as target_parameters
    "moe": dict(
        family="qwen3_moe",
        adapters={
            "a": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
            "b": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "o_proj"], target_parameters=EXPERTS),
            "c": LoraConfig(r=6, lora_alpha=6, target_modules=["v_proj"], target_parameters=EXPERTS),
        },
        target_modules=None,
    ),
}
# Phi-3's plan: fused qkv_proj and gate_up_proj column-parallel with their outputs gathered,
# o_proj and down_proj row-parallel over an input each rank slices from a replicated one
CASES["phi3"] = dict(
    family="phi3",
    adapters={
        "a": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        "b": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["qkv_proj", "down_proj"]),
        "c": LoraConfig(r=6, lora_alpha=6, target_modules=["o_proj", "gate_up_proj"]),
    },
    target_modules=None,
    fused=False,  # q/k/v and gate/up are one linear each: nothing to fuse
)
# the same MoE model with its experts split between the ranks (expert parallelism), the rest
# tensor-parallel as above (Inductor under tensor parallelism runs in the two-GPU tests)
CASES["moe-ep"] = dict(CASES["moe"], distributed={"tp_size": 2, "ep_size": 2})


def peft_rows(model, directory: Path, names: list[str | None], ids: torch.Tensor) -> torch.Tensor:
    """Each row from PEFT with its own adapter alone (PEFT holds adapters of experts
    parameters one at a time), or from the model for ``None``."""
    out = None
    for name in dict.fromkeys(names):
        rows = [i for i, n in enumerate(names) if n == name]
        runner = model if name is None else peft_model_with(model, {name: str(directory / name)})
        logits = runner(input_ids=ids[rows]).logits
        out = logits.new_empty((len(names), *logits.shape[1:])) if out is None else out
        out[rows] = logits
    return out


def _run_case(case_name: str, tmp_path_factory) -> tuple:
    spec = CASES[case_name]
    directory = tmp_path_factory.mktemp(f"tp-{case_name}")
    model = tiny_model(spec["family"], seed=5, intermediate_size=spec.get("intermediate_size", 48))
    model.save_pretrained(directory / "model")
    for i, (name, config) in enumerate(spec["adapters"].items()):
        make_adapter(model, config, seed=10 + i, directory=str(directory / name), scale=0.3)
    make_adapter(model, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), seed=9, directory=str(directory / "e"))
    script = {
        "distributed": spec.get("distributed", {"tp_plan": "auto"}),
        "inner": spec.get("inner", "eager"),
        "as_on_cuda": spec.get("as_on_cuda", False),
        "adapters": ["a", "b"],
        "target_modules": spec["target_modules"],
        "first": ["a", None, "b", "a"],
        "loaded": ["c", "b", None, "a"],
        "unloaded": ["b", "c", "c", None],
        "generate": ["c", None, "b", "c"],
        "max_new_tokens": 5,
        "embedding": ["e", None, "e", None] if spec.get("embedding") else None,
        # the request stream: more requests than rows, adapters of both loads, none
        "stream": [[[5, 6, 7], "b", 4], [[8, 9], None, 6], [[10, 11, 12, 13], "c", 3], [[14], "b", 5], [[15, 16], "c", 2]],
    }
    (directory / "script.json").write_text(json.dumps(script))
    ids = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(7))
    save_file({"ids": ids}, directory / "inputs.safetensors")
    expected = single_process(model, directory, script, ids)
    with torch.no_grad():
        keys = ("first", "loaded", "unloaded") + (("embedding",) if script["embedding"] else ())
        oracle = {key: peft_rows(model, directory, script[key], ids) for key in keys}
    peft = peft_model_with(model, {n: str(directory / n) for n in ("b", "c")})
    oracle["generated"] = reference_generate(model, peft, script["generate"], ids, None, 5, None, 0)
    return case_name, run_ranks(WORKER, directory), expected, oracle


def check_mixed_batches_match_one_process_and_peft(case):
    _, ranks, expected, oracle = case
    for rank, (out, _) in enumerate(ranks):
        for key in ("first", "loaded", "unloaded"):
            assert close(out[key], expected[key]) < RTOL[torch.float32], (rank, key)
            assert close(out[key], oracle[key]) < RTOL[torch.float32], (rank, key)


def check_every_target_is_served_on_every_rank(case):
    name, ranks, _, _ = case
    for fqn, widths in CASES[name].get("widths", {}).items():  # each rank's slice, as the plan split it
        assert {report["local_out"][fqn] for _, report in ranks} == widths
    for _, report in ranks:
        assert report["not_served"] == []
        if CASES[name].get("as_on_cuda"):
            assert "fxlora::lora_linear_beside" in report["ops"]
        elif report["graphs"] == 1 and CASES[name].get("fused", True):  # q/k/v read one input, sharded or not
            assert "fxlora::lora_linear_fused" in report["ops"]  # (older transformers break the graph)
        assert ("fxlora::moe_lora" in report["ops"]) == name.startswith("moe")
        assert "note: tensor parallel: rank" in report["explain"] and "Not served:\n  nothing" in report["explain"]


def check_generate_matches_one_process_and_peft(case):
    _, ranks, expected, oracle = case
    for out, _ in ranks:
        assert torch.equal(out["generated"], expected["generated"])
        assert torch.equal(out["generated"][:, -5:], oracle["generated"])


def check_the_stream_follows_rank_0_and_matches_one_process(case):
    _, ranks, expected, _ = case
    for out, report in ranks:
        assert torch.equal(out["stream"], expected["stream"])
        rows = [[t for t in row.tolist() if t >= 0] for row in expected["stream"]]
        assert report["served"] == rows  # every rank's loop served the requests rank 0 added
        assert torch.equal(out["stream_served"], expected["stream"])  # generate_batch through them, on every rank
        # refused on every rank alike, rank 1 asking after rank 0's stop ended its loop too
        assert "load_adapter while cm.serve() runs under tensor parallelism" in report["load_while_serving"]
        assert "a call of the model while cm.serve() runs" in report["call_while_serving"]
        assert "generate while cm.serve() runs" in report["generate_while_serving"]
    assert ranks[0][1]["served_ids"] == [f"s{i}" for i in range(5)] and ranks[1][1]["served_ids"] == [None] * 5


def check_a_load_one_rank_fails_changes_nothing_on_any_rank(case):
    name, ranks, _, _ = case
    (_, first), (_, second) = ranks
    assert first["unchanged"] and second["unchanged"]
    assert second["failed_load"].startswith("AdapterError") and "missing" in second["failed_load"]
    assert first["failed_load"].startswith("AdapterError") and "rank 1 failed" in first["failed_load"]


def check_an_adapter_on_the_embedding_is_served(case):
    """Split over its vocabulary (transformers 5.2x's plan) or whole, as on one process."""
    name, ranks, expected, oracle = case
    if not CASES[name].get("embedding"):
        return
    for out, report in ranks:
        assert close(out["embedding"], expected["embedding"]) < RTOL[torch.float32]
        assert close(out["embedding"], oracle["embedding"]) < RTOL[torch.float32]
        op = "fxlora::lora_embedding_delta" if report["embedding_placements"] else "fxlora::lora_embedding"
        assert op in report["embedding_ops"], (report["embedding_placements"], report["embedding_ops"])


@pytest.mark.long
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_two_ranks_serve_the_sharded_model(case_name, tmp_path_factory):
    """One launch of the ranks per case (a minute or more on CPU), every check on it."""
    case = _run_case(case_name, tmp_path_factory)
    check_mixed_batches_match_one_process_and_peft(case)
    check_every_target_is_served_on_every_rank(case)
    check_generate_matches_one_process_and_peft(case)
    check_the_stream_follows_rank_0_and_matches_one_process(case)
    check_a_load_one_rank_fails_changes_nothing_on_any_rank(case)
    check_an_adapter_on_the_embedding_is_served(case)
