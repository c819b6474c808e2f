"""Tensor parallelism on two GPUs (run by scripts/gpu_tests_tp.sh): two NCCL ranks serve a
bf16 model sharded with transformers' own plan (``DistributedConfig(tp_plan="auto")``) and
agree with the single-GPU fxlora run of the same weights and adapters.

Each case saves a small model and 16 PEFT adapters to a temporary directory and runs
``tests/tp_gpu_worker.py`` on two ranks, then on one (the expectation, which also scores the
two ranks' generated tokens by teacher forcing). Checked: per-token KL ≤ 1e-3 of the mixed
prefill and of decode steps replayed from both variants' CUDA graphs (collectives inside) under
changing adapter assignments; the graphs were captured on every rank; no host sync inside a
replayed step or a ``generate`` step; greedy tokens agree with the single GPU's choices, in
``generate`` and in the request stream (``generate_batch``, and ``serve`` with requests added on
rank 0 only), whose graphs hold the collectives too; every rank destroys its process group after.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from ranks import run_ranks
from safetensors.torch import save_file

from fxlora.testing import assert_greedy_agrees, make_adapter, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

WORKER = Path(__file__).with_name("tp_gpu_worker.py")
# NVLink multicast off: it can take a shared host's GPUs out of service
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ADAPTERS = 16
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
CASES = {
    "llama": dict(family="llama", targets=[dict(target_modules="all-linear")]),
    "qwen3_moe": dict(
        family="qwen3_moe",
        # each rank's experts keep 32 features: grouped_mm wants rows of a multiple of 16 bytes
        moe_intermediate_size=64,
        targets=[
            dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS),
            dict(target_modules=["v_proj"], target_parameters=EXPERTS),
            dict(target_modules=["q_proj", "o_proj"]),
        ],
    ),
}
SIZE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192, vocab_size=256)


def kl_per_token(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    spec = CASES[request.param]
    directory = tmp_path_factory.mktemp(f"tp-gpu-{request.param}")
    model = tiny_model(spec["family"], seed=5, **SIZE, **{k: v for k, v in spec.items() if k not in ("family", "targets")})
    model.save_pretrained(directory / "model")
    names = [f"ad{i}" for i in range(ADAPTERS)]
    for i, name in enumerate(names):
        r = (4, 8, 16)[i % 3]
        config = LoraConfig(r=r, lora_alpha=2 * r, use_rslora=i % 4 == 1, **spec["targets"][i % len(spec["targets"])])
        make_adapter(model, config, seed=20 + i, directory=str(directory / name), scale=0.3)
    gen = torch.Generator().manual_seed(11)
    prefill = [*names, None, "ad3", None, "ad7"]  # every adapter, rows without one, adapters on two rows
    script = {
        "adapters": names,
        "rows": 24,
        "buckets": [4, 24],
        "max_len": 64,
        "prefill": prefill,
        # decode steps: the assignment changes between replays, in the small bucket and the large
        "decode": [
            [names[int(i)] if i >= 0 else None for i in torch.randint(-1, ADAPTERS, (n,), generator=gen)]
            for n in (3, 20, 24, 4)
        ],
        "max_new_tokens": 16,
        # the stream: more requests than the serving loop's rows, prompts and lengths of all sizes
        "stream": [
            [torch.randint(3, SIZE["vocab_size"], (int(n),), generator=gen).tolist(), prefill[i % len(prefill)], int(m)]
            for i, (n, m) in enumerate(zip(torch.randint(1, 30, (10,), generator=gen), torch.randint(1, 24, (10,), generator=gen)))
        ],
    }
    (directory / "script.json").write_text(json.dumps(script))
    save_file({"ids": torch.randint(3, SIZE["vocab_size"], (len(prefill), 12), generator=gen)}, directory / "inputs.safetensors")
    ranks = run_ranks(WORKER, directory, ranks=2, limit_s=300, env=NCCL_ENV, results="tp2")
    first = ranks[0][0]
    save_file({k: first[k] for k in ("stream", "served")} | {"tokens": first["generated"]}, directory / "forced.safetensors")
    ((single, single_report),) = run_ranks(WORKER, directory, ranks=1, limit_s=300, env=NCCL_ENV, results="tp1")
    return script, ranks, single, single_report, directory / "tp2"


def test_mixed_batches_on_two_gpus_match_one_gpu_by_per_token_kl(case):
    script, ranks, single, _, _ = case
    keys = ["prefill", *(f"decode{i}-{v}" for i in range(len(script["decode"])) for v in ("lora", "nolora"))]
    for rank, (out, _) in enumerate(ranks):
        for key in keys:
            kl = kl_per_token(out[key], single[key])
            assert kl.max().item() <= 1e-3, (rank, key, kl.max().item())


def test_both_variants_are_captured_with_their_collectives_on_every_rank(case):
    script, ranks, _, single_report, _ = case
    expected = sorted(f"{v}-{b}" for v in ("lora", "nolora") for b in script["buckets"])
    for _, report in [*ranks, (None, single_report)]:
        assert report["graphs"] == expected and report["fallback"] is None
    for _, report in ranks:
        assert "note: tensor parallel: rank" in report["explain"] and "Not served:\n  nothing" in report["explain"]


def test_greedy_generate_on_two_gpus_agrees_with_one_gpu(case):
    script, ranks, single, _, _ = case
    (first, _), (second, _) = ranks
    assert torch.equal(first["generated"], second["generated"])  # rank 0's answer is every rank's
    prompt = first["generated"].shape[1] - script["max_new_tokens"]
    tokens = first["generated"][:, prompt:]
    logits = single["forced"][:, prompt - 1 : -1]  # the single GPU's logits over the two ranks' tokens
    assert_greedy_agrees(tokens, logits, "the single GPU")


def test_generate_with_an_end_token_does_not_synchronise_per_step_on_any_rank(case):
    script, ranks, _, _, _ = case
    new = script["max_new_tokens"]
    for out, report in ranks:
        assert report["ended_as_without_sync_checks"]
        assert report["generate_syncs"] == 1  # the prompt's vocabulary check, once per call
        row = out["generated"][0, -new:].tolist()
        eos = row[new // 2]  # the worker's end token: row 0 makes it half-way, the others go on
        ended = out["ended"][0, -new:].tolist()
        end = ended.index(eos)
        assert end <= new // 2 and ended[: end + 1] == row[: end + 1] and all(t == 0 for t in ended[end + 1 :])


def test_the_request_stream_on_two_gpus_agrees_with_one_gpu(case):
    script, ranks, single, single_report, _ = case
    (first, first_report), (second, second_report) = ranks
    for kind in ("stream", "served"):  # one schedule, rank 0's, on every rank
        assert torch.equal(first[kind], second[kind]), kind
    assert first_report["served_ids"] == [f"s{i}" for i in range(len(script["stream"]))]
    assert second_report["served_ids"] == [None] * len(script["stream"])
    for report in (first_report, second_report, single_report):
        assert report["stream_errors"] == [] and report["served_missing"] == [] and "lora" in report["stream_graphs"]
    for kind in ("stream", "served"):
        tokens, logits = first[kind], single[f"forced_{kind}"]
        assert (tokens >= 0).sum(1).tolist() == [new for _, _, new in script["stream"]], kind
        generated = tokens >= 0  # every request's tokens, scored as one row
        assert_greedy_agrees(tokens[generated][None], logits[generated][None], f"the single GPU ({kind})")


def test_every_rank_tears_its_process_group_down_after_serving(case):
    *_, results = case
    hung = {p.name: p.read_text() for p in results.glob("rank*.teardown")}
    assert not hung, f"destroy_process_group hung (the stage each rank reached): {hung}"
