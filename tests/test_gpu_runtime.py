"""CUDA-only checks of the runtime, run by scripts/gpu_tests.sh: decode graphs of both
variants over every batch bucket against the same step run eagerly, adapters hot-swapped
between replays, no host synchronisation in a replay, the eager fallback when a capture
fails, and bf16 generation against PEFT's greedy choices."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora.adapters import read_adapter
from fxlora.runtime import Backend
from fxlora.runtime.cuda_graphs import GraphSet
from fxlora.testing import (
    assert_greedy_agrees,
    assert_matches_peft,
    lora_module_names,
    make_adapter,
    peft_model_with,
    reference_logits,
    tiny_model,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _served(dtype, family="llama", buckets=(1, 2, 4, 8)):
    torch._dynamo.reset()
    cpu_model = tiny_model(family, seed=2, hidden_size=64, intermediate_size=160, vocab_size=200)
    targets = lora_module_names(cpu_model)
    adapters = {
        n: make_adapter(
            cpu_model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets), seed=i, directory="", scale=0.3
        )
        for i, (n, r) in enumerate([("a", 8), ("b", 16), ("c", 4)])
    }
    model = copy.deepcopy(cpu_model).to("cuda", dtype)
    cm = fxlora.compile(
        model, adapters, max_loras=4, max_rank=16, max_batch_size=max(buckets), max_len=48, batch_buckets=list(buckets)
    )
    return cpu_model, model, adapters, cm


def _random_state(rt, gen):
    rows, cols = rt.max_batch_size, rt.max_len
    rt.ids.copy_(torch.randint(3, 200, (rows, 1), generator=gen))
    rt.positions.copy_(torch.randint(0, cols - 1, (rows, 1), generator=gen))
    visible = torch.rand(rows, 1, 1, cols, generator=gen) < 0.7
    visible[..., 0] = True
    rt.mask.copy_(torch.where(visible, 0.0, torch.finfo(rt.dtype).min))
    rt.column.fill_(int(torch.randint(0, cols, (), generator=gen)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_replay_matches_eager_over_buckets_and_swaps(dtype):
    cpu_model, _, _, cm = _served(dtype)
    rt = cm.prepare()
    assert set(rt.graphs.graphs) == {(v, b) for v in ("lora", "nolora") for b in rt.buckets}
    compiles = cm.compile_count
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for bucket in rt.buckets:
        for round in range(3):
            _random_state(rt, gen)
            slots = torch.randint(-1, 3, (rt.max_batch_size,), generator=gen, dtype=torch.int32)
            rt.slot_ids.copy_(slots)
            if round == 2:  # hot swap: new weights into the slot of "c"
                cm.unload_adapter("c")
                config = LoraConfig(r=8, lora_alpha=8, target_modules=lora_module_names(cpu_model))
                cm.load_adapter(make_adapter(cpu_model, config, seed=100 + bucket, directory=""), adapter_name="c")
            for variant in ("lora", "nolora"):
                replayed = rt.graphs.run((variant, bucket), rt._decode).clone()
                eager = rt._decode((variant, bucket))
                err = ((replayed.float() - eager.float()).norm() / eager.float().norm()).item()
                assert err < tol, (bucket, round, variant, err)
    assert cm.compile_count == compiles  # swaps and replays never retrace


def test_replay_does_not_synchronise():
    *_, cm = _served(torch.bfloat16)
    rt = cm.prepare()
    rt.slot_ids.copy_(torch.tensor([0, 1, -1, 2, 0, 0, 1, -1], dtype=torch.int32))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for key in rt.graphs.graphs:
            rt.graphs.run(key, rt._decode)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_failed_capture_falls_back_to_eager_with_a_warning(caplog):
    calls = []

    def step(key):
        calls.append(key)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing
        return torch.ones(2, device="cuda") * key

    graphs = GraphSet(torch.device("cuda"))
    rng = torch.cuda.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="fxlora"):
        graphs.capture([3], step, progress=False)
        assert torch.equal(graphs.run(3, step), torch.full((2,), 3.0, device="cuda"))
        graphs.run(3, step)
    assert not graphs.graphs and "capturing 3 failed" in graphs.fallback_reason
    # the device's random numbers go on from where they were (torch 2.11 left them unusable)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    torch.multinomial(torch.rand(8, device="cuda"), 2)
    assert sum("without CUDA graphs" in r.message for r in caplog.records) == 1


def test_bf16_generation_agrees_with_peft():
    _, model, adapters, cm = _served(torch.bfloat16)
    names = ["a", "b", None, "c", "a", None, "b", "c"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (8, 10), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[5, :2] = 0
    ids = ids * mask
    out = cm.generate(ids, mask, adapter_names=names, max_new_tokens=32, eos_token_id=())  # prefill from a graph
    assert ("prefill", "lora", 8, 16) in cm.prepare().graphs.graphs
    # PEFT's greedy choice at every step, given the same prefix
    full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], 1)
    fixed = out[:, : ids.shape[1]].ne(0).long()  # the prompt comes back left-padded
    full_mask[:, : ids.shape[1]] = fixed
    peft_model = peft_model_with(model, adapters)
    logits = reference_logits(model, peft_model, names, input_ids=out, attention_mask=full_mask)
    logits = logits[:, ids.shape[1] - 1 : -1].float()
    assert_greedy_agrees(out[:, ids.shape[1] :], logits, "PEFT")


@pytest.mark.parametrize("inference_mode", [False, True])
def test_call_replays_per_signature_with_inputs_copied_in_and_mutations_out(inference_mode):
    weight = torch.nn.Parameter(torch.randn(4, 4, device="cuda"), requires_grad=False)
    with torch.inference_mode(inference_mode):  # inference tensors keep no version counter
        _call_replays_per_signature(weight)


def _call_replays_per_signature(weight):
    calls = []

    def step(x, counter):
        calls.append(1)
        counter.add_(1)  # an input the function mutates
        return (x @ weight, counter * 2)

    graphs = GraphSet(torch.device("cuda"))
    counter = torch.zeros(3, device="cuda")
    outs = []
    for i in range(4):
        x = torch.randn(2, 4, device="cuda")
        out, doubled = graphs.call("k", step, (x, counter))
        torch.testing.assert_close(out, x @ weight)
        assert torch.equal(counter, torch.full((3,), i + 1.0, device="cuda"))
        assert torch.equal(doubled, counter * 2)
        outs.append((x, out))
    assert len(calls) == 2  # one eager call, one capture; the rest are replays
    for x, out in outs:  # earlier results are not overwritten by later replays
        torch.testing.assert_close(out, x @ weight)
    graphs.call("k", step, (torch.randn(5, 4, device="cuda"), counter))  # a new shape: a new graph
    assert len(graphs._calls) == 2


def test_torch_compile_backend_with_cuda_graphs_matches_eager_routing():
    _, model, adapters, _ = _served(torch.float32)
    options = dict(adapters={k: adapters[k] for k in ("a", "b")}, max_loras=4, max_rank=16)
    eager_backend = Backend.from_options(options)
    graphed_backend = Backend.from_options(dict(options, cuda_graphs=True))
    eager = torch.compile(model, backend=eager_backend)
    graphed = torch.compile(model, backend=graphed_backend)
    gen = torch.Generator().manual_seed(3)
    for i, names in enumerate([["a", None, "b", "a"], [None] * 4, ["b", "b", None, "a"], ["a", "c", None, "b"]]):
        if i == 3:  # hot swap while the graphs exist
            for backend in (eager_backend, graphed_backend):
                backend.pool.unload("b")
                backend.pool.load(read_adapter("c", adapters["c"]))
                backend.pool.load(read_adapter("b", adapters["b"]))
        ids = torch.randint(3, 200, (4, 9), generator=gen).cuda()
        with torch.no_grad(), fxlora.use_adapters(names):
            want = eager(input_ids=ids).logits
            got = graphed(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    graphs = graphed_backend.graphs
    assert graphs.enabled and len(graphs._calls) == 2  # lora and nolora, captured once each


def test_torch_compile_cuda_graphs_under_transformers_generate_with_a_static_cache():
    """transformers' own generate loop with its StaticCache (tensors marked static, written in
    place by the graphs) through the backend with CUDA graphs: the same tokens as without."""
    _, model, adapters, _ = _served(torch.float32)
    options = dict(adapters={k: adapters[k] for k in ("a", "b")}, max_loras=4, max_rank=16)
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(4)).cuda()
    outs = []
    for graphs in (False, True):
        torch._dynamo.reset()
        backend = Backend.from_options(dict(options, cuda_graphs=graphs))
        model.forward = torch.compile(type(model).forward.__get__(model), backend=backend)
        try:
            with torch.no_grad(), fxlora.use_adapters(["a", "b"]):
                outs.append(
                    model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static", pad_token_id=0)
                )
        finally:
            del model.forward
        if graphs:  # the cache's host-side length is only copied to the device: capturable
            assert backend.graphs.enabled, backend.graphs.fallback_reason
            assert backend.graphs._calls and not backend.graphs._refused
    assert torch.equal(outs[0], outs[1])


def test_concurrent_forward_calls_on_cuda_do_not_share_scratch():
    """Threads calling one compiled model on CUDA: the LoRA ops' workspaces (the shrink
    results) live in one arena, so calls must not overlap; each gets its own rows."""
    import threading

    _, model, _, cm = _served(torch.float32)
    ids = torch.randint(3, 200, (4, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    cases = [("a", None, "b", "c"), ("c", "c", None, "a"), ("b", "a", "a", None)]
    want = {names: cm(input_ids=ids, adapter_names=list(names)).logits for names in cases}
    errors = []

    def loop(names):
        try:
            for _ in range(50):
                out = cm(input_ids=ids, adapter_names=list(names)).logits
                torch.testing.assert_close(out, want[names], rtol=1e-5, atol=1e-5)
        except Exception as e:  # the test fails on any
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(names,)) for names in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_ten_thousand_replays_with_hot_swaps():
    """Decode replays with adapters swapped between generate calls: outputs stay those of
    the first call, with no recapture, no retrace and a graph pool of constant size."""
    _, _, adapters, cm = _served(torch.bfloat16, buckets=(1, 2, 4))
    rt = cm.prepare()
    ids = torch.randint(3, 200, (4, 4), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    names = ["a", "b", None, "c"]
    first = cm.generate(ids, adapter_names=names, max_new_tokens=40, eos_token_id=())
    graphs, pool_bytes, compiles = dict(rt.graphs.graphs), rt.graphs.pool_bytes, cm.compile_count
    replays = 0
    while replays < 10_000:
        cm.unload_adapter("b")
        cm.load_adapter(adapters["b"], adapter_name="b")
        out = cm.generate(ids, adapter_names=names, max_new_tokens=40, eos_token_id=())
        replays += 39
        assert torch.equal(out, first)
    assert rt.graphs.graphs == graphs and rt.graphs.pool_bytes == pool_bytes and cm.compile_count == compiles


def test_generate_with_an_end_token_does_not_synchronise_per_step():
    """One host sync per call, whatever its length: the prompt's token ids are checked against
    the vocabulary before anything reads them; the steps and their end-token checks add none."""
    *_, cm = _served(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 200, (5, 7), generator=gen).cuda()
    names = ["a", None, "b", "c", "a"]
    first = cm.generate(ids, adapter_names=names, max_new_tokens=30)  # traces and captures
    eos = int(first[0, 7 + 12])  # a token row 0 makes: it finishes there, the others go on
    expected = cm.generate(ids, adapter_names=names, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)

    def syncs(max_new_tokens):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = cm.generate(ids, adapter_names=names, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out, sum("synchronizing" in str(w.message) for w in caught)

    out, long_syncs = syncs(30)
    _, short_syncs = syncs(15)
    assert long_syncs == short_syncs == 1
    assert torch.equal(out, expected)
    row = out[0, 7:].tolist()
    assert row.index(eos) <= 12 and all(t == 0 for t in row[row.index(eos) + 1 :])  # padded after its end token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_short_prefills_replay_from_graphs_captured_on_first_use(dtype):
    """A short prefill replays from a CUDA graph captured on first use, at its rows' batch
    bucket and its prompts' length bucket: the same logits as that prefill run eagerly, one
    graph per (variant, rows, length) whatever the prompts, and in float32 generation that
    agrees with PEFT (in bf16 the 60 tokens here are too few for the near-tie statistics;
    ``test_bf16_generation_agrees_with_peft`` prefills from a graph too)."""
    _, model, adapters, cm = _served(dtype)
    rt = cm.prepare()
    decode_graphs = set(rt.graphs.graphs)
    gen = torch.Generator().manual_seed(7)
    # both prefill at 16 columns, rows at the bucket of 4: the second replays the first's graph with other slots
    for length, names in ((10, ["a", None, "c"]), (13, ["c", "b", None])):
        ids = torch.randint(3, 200, (3, length), generator=gen).cuda()
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        ids = ids * mask
        out = cm.generate(ids, mask, adapter_names=names, max_new_tokens=20, eos_token_id=())
        if dtype != torch.float32:
            continue
        full_mask = torch.cat([out[:, :length].ne(0).long(), torch.ones_like(out[:, length:])], 1)
        logits = reference_logits(model, peft_model_with(model, adapters), names, input_ids=out, attention_mask=full_mask)
        assert_greedy_agrees(out[:, length:], logits[:, length - 1 : -1], "PEFT")
    for variant, rows in (("lora", 3), ("nolora", 2)):
        cm.generate(ids[:rows], mask[:rows], adapter_names=[None] * rows if variant == "nolora" else names, max_new_tokens=4)
    added = set(rt.graphs.graphs) - decode_graphs
    assert added == {("prefill", "lora", 4, 16), ("prefill", "nolora", 2, 16)}
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for key in sorted(added):
        replayed = rt.graphs.run(key, rt._prefill).clone()
        eager = rt._prefill(key)
        err = ((replayed.float() - eager.float()).norm() / eager.float().norm()).item()
        assert err < tol, (key, err)
    assert "and 2 prefills" in cm.explain()


def test_a_failed_capture_on_first_use_leaves_that_key_eager(caplog):
    """``GraphSet.run_captured``: a capture that fails leaves its key eager with one warning,
    the set's other graphs replaying, the stream and the random numbers as they were; an error
    of the callable itself propagates and refuses nothing."""
    graphs = GraphSet(torch.device("cuda"))
    graphs.capture([1], lambda key: torch.ones(2, device="cuda") * key, progress=False)

    def step(key):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing
        return torch.ones(2, device="cuda") * key

    def broken(key):
        raise ValueError(f"bad input {key}")

    stream = torch.cuda.current_stream()
    with caplog.at_level(logging.WARNING, logger="fxlora"):
        for _ in range(2):
            assert torch.equal(graphs.run_captured(3, step), torch.full((2,), 3.0, device="cuda"))
    assert set(graphs.graphs) == {1} and graphs.enabled and torch.cuda.current_stream() == stream
    assert torch.equal(graphs.run(1, step), torch.ones(2, device="cuda"))
    assert sum("capturing it failed" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="bad input 4"):
        graphs.run_captured(4, broken)
    assert 4 not in graphs._refused and torch.cuda.current_stream() == stream
    torch.multinomial(torch.rand(8, device="cuda"), 2)


def test_bf16_logits_with_inductor_match_peft_by_per_token_kl():
    _, model, adapters, cm = _served(torch.bfloat16)
    names = ["a", "b", None, "c"]
    ids = torch.randint(3, 200, (4, 12), generator=torch.Generator().manual_seed(5)).cuda()
    out = cm(input_ids=ids, adapter_names=names).logits.float()
    ref = reference_logits(model, peft_model_with(model, adapters), names, input_ids=ids).float()
    kl = torch.nn.functional.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.max().item() <= 1e-3, kl.max().item()
    assert "both compiled by inductor" in cm.explain()



def test_a_dropped_compiled_model_releases_the_graphs_it_captured():
    """Captured collectives keep a process group from being destroyed (pytorch#115388): once
    the compiled model is dropped (and collected), the graphs of ``generate`` and of the
    stream's engine go with it, though the model it served lives on."""
    import gc
    import weakref

    _, model, _, cm = _served(torch.float32)
    ids = torch.randint(3, 200, (2, 6), device="cuda")
    cm.generate(ids, adapter_names=["a", None], max_new_tokens=3, eos_token_id=())
    cm.generate_batch([[5, 6, 7], [8]], ["b", None], max_new_tokens=3, eos_token_id=(), progress_bar=False)
    engine, runtime = weakref.ref(cm._engine[1]), weakref.ref(cm.prepare())
    assert runtime().graphs.graphs and engine().runner.graphs.graphs
    dropped = weakref.ref(cm)
    del cm
    gc.collect()
    assert dropped() is None and engine() is None and runtime() is None


def test_the_host_tier_pins_each_adapter_in_few_buffers_and_pages_from_them():
    """On CUDA the host tier holds an adapter's factors pinned, packed into buffers of up to
    ``PACK_BYTES`` (one for a small model's); adapters paged into the one slot from there in
    turn give PEFT's rows."""
    torch._dynamo.reset()
    cpu_model = tiny_model("llama", seed=2, hidden_size=64, intermediate_size=160, vocab_size=200)
    adapters = {
        n: make_adapter(cpu_model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"), seed=i, directory="", scale=0.3)
        for i, (n, r) in enumerate([("a", 8), ("b", 4)])
    }
    model = copy.deepcopy(cpu_model).to("cuda")
    cm = fxlora.compile(model, adapters, max_loras=1, max_rank=8)
    for name in adapters:
        factors = [t for f in cm.pool.adapters[name].modules.values() for t in (f.a, f.b)]
        assert all(t.is_pinned() for t in factors)
        assert len({t.untyped_storage().data_ptr() for t in factors}) == 1
    ids = torch.randint(3, 200, (2, 6), device="cuda")
    for name in ("b", "a", "b"):
        assert_matches_peft(cm, model, adapters, [name, None], input_ids=ids)
