"""CUDA-only checks of the request stream, run by scripts/gpu_tests.sh: its decode steps replay
from CUDA graphs per (variant, sampling, bucket) and read the paged cache through
``fxlora::paged_decode_attention``; fp32 requests equal PEFT's greedy generation alone,
bf16 ones agree with PEFT's greedy choices; a seeded sampled request ignores its batch; no
retrace once warm."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora.testing import (
    assert_greedy_agrees,
    lora_module_names,
    make_adapter,
    peft_model_with,
    reference_generate,
    reference_logits,
    tiny_model,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NAMES = ["a", "b", None, "c"]


def _served(dtype, family="llama"):
    torch._dynamo.reset()
    cpu_model = tiny_model(family, seed=4, hidden_size=64, intermediate_size=160, vocab_size=200)
    cpu_model.lm_head.weight.data.mul_(4)  # peaked logits: few near-ties for half precision to flip
    targets = [t for t in lora_module_names(cpu_model) if "experts" not in t]
    # the experts carry LoRA too: served by fxlora::moe_lora, which captures in float32 (transformers'
    # own float32 experts loop reads its offsets on the host)
    experts = ["experts.gate_up_proj", "experts.down_proj"] if family != "llama" else None
    adapters = {
        n: make_adapter(cpu_model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, target_parameters=experts),
                        seed=i, directory="", scale=0.3)
        for i, (n, r) in enumerate([("a", 8), ("b", 16), ("c", 4)])
    }  # fmt: skip
    model = copy.deepcopy(cpu_model).to("cuda", dtype)
    cm = fxlora.compile(model, adapters, max_loras=4, max_rank=16, max_batch_size=8, max_len=96)
    return model, adapters, cm


def _requests(n: int, seed: int) -> tuple[list[list[int]], list[str | None], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (int(torch.randint(1, 40, (), generator=gen)),), generator=gen).tolist() for _ in range(n)]
    news = [int(torch.randint(1, 40, (), generator=gen)) for _ in range(n)]
    return prompts, [NAMES[i % 4] for i in range(n)], news


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_fp32_stream_equals_peft_alone_and_replays_from_graphs(family):
    model, adapters, cm = _served(torch.float32, family)
    prompts, names, news = _requests(20, seed=1)  # more requests than rows: they queue and join
    outs = cm.generate_batch(prompts, names, max_new_tokens=news, eos_token_id=(), progress_bar=False)
    peft_model = peft_model_with(model, adapters)
    for prompt, name, new, out in zip(prompts, names, news, outs):
        ref = reference_generate(model, peft_model, [name], torch.tensor([prompt], device="cuda"), None, new, None, 0)
        assert out.generated_tokens == ref[0].tolist(), out.request_id
    runner = cm._engine[1].runner
    if family == "llama":  # (in float32, transformers' own experts loop of nolora reads its offsets on the host)
        assert runner.graphs.enabled and any(key[0] == "lora" for key in runner.graphs.graphs)
    assert _paged_in_graphs(cm)
    compiles = cm.compile_count
    again = cm.generate_batch(prompts[:6], names[:6], max_new_tokens=news[:6], eos_token_id=(), progress_bar=False)
    assert [o.generated_tokens for o in again] == [o.generated_tokens for o in outs[:6]]
    assert cm.compile_count == compiles  # warm: no retrace


def _paged_in_graphs(cm) -> bool:
    return any(
        n.target is torch.ops.fxlora.paged_decode_attention.default
        for router in cm.backend.routers
        for gm in (router.lora, router.nolora)
        if gm is not None
        for n in gm.graph.nodes
    )


def test_bf16_stream_agrees_with_peft_as_generate_does():
    """Every bf16 token the stream makes is PEFT's greedy choice given the same prefix, but at
    near-ties; and the stream agrees with PEFT at least as often as ``cm.generate`` (the static
    batch) does on the same requests, less 2 points: a tiny random model's logits tie often."""
    model, adapters, cm = _served(torch.bfloat16)
    prompts, names, news = _requests(12, seed=2)
    outs = cm.generate_batch(prompts, names, max_new_tokens=news, eos_token_id=(), progress_bar=False)
    assert _paged_in_graphs(cm)
    static = [
        cm.generate([prompt], adapter_names=[name], max_new_tokens=new, eos_token_id=())[0, len(prompt) :].tolist()
        for prompt, name, new in zip(prompts, names, news)
    ]
    peft_model = peft_model_with(model, adapters)

    def agreement(tokens_of: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logits = [], []
        for prompt, name, made in zip(prompts, names, tokens_of):
            full = torch.tensor([prompt + made], device="cuda")
            logits.append(reference_logits(model, peft_model, [name], input_ids=full)[0, len(prompt) - 1 : -1].float())
            tokens.append(torch.tensor(made, device="cuda"))
        return torch.cat(tokens)[None], torch.cat(logits)[None]

    stream_tokens, stream_logits = agreement([o.generated_tokens for o in outs])
    static_tokens, static_logits = agreement(static)
    try:
        assert_greedy_agrees(stream_tokens, stream_logits, "PEFT")
    except AssertionError as e:  # allowed only when every difference is a near-tie ...
        assert "not a near-tie (allowed 0.01): []" in str(e), e
    rate = lambda tokens, logits: (logits.argmax(-1) == tokens).float().mean().item()  # noqa: E731
    assert rate(stream_tokens, stream_logits) >= rate(static_tokens, static_logits) - 0.02  # ... as often as generate's


def test_a_seeded_sampled_request_ignores_its_batch_on_cuda():
    _, _, cm = _served(torch.float32)
    prompt = [11, 12, 13, 14, 15]
    sampled = dict(do_sample=True, temperature=0.9, top_p=0.9, seed=77, eos_token_id=(), progress_bar=False)
    alone = cm.generate_batch([prompt], ["b"], max_new_tokens=24, **sampled)[0]
    prompts, names, news = _requests(9, seed=3)
    mixed = cm.generate_batch([*prompts, prompt], [*names, "b"], max_new_tokens=[*news, 24], **sampled)[-1]
    assert mixed.generated_tokens == alone.generated_tokens


def test_serving_turns_do_not_synchronise():
    """Once warm, a turn (a decode window, the last one's read through an event, admissions and
    their prefill, sampling rows among them) makes no synchronising CUDA call."""
    _, _, cm = _served(torch.bfloat16)
    requests = cm._requests({}, None)
    engine = requests.engine
    prompts, names, news = _requests(10, seed=5)

    def run(sync_mode: str) -> None:
        for i, (prompt, name, new) in enumerate(zip(prompts, names, news)):
            engine.add(requests.make(prompt, name, new, request_id=f"{sync_mode}{i}", eos_token_id=(),
                                     do_sample=i % 2 == 1, seed=i))  # fmt: skip
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            while engine.has_work:
                engine.forget(engine.step())
        finally:
            torch.cuda.set_sync_debug_mode("default")

    run("default")  # warm: every prefill shape of this workload captured
    run("error")
