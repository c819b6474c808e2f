"""The request stream (continuous batching over a paged KV cache): every request's tokens
against PEFT's greedy ``generate`` of that request alone, over drawn request sets, arrival
turns and cancellations, on a dense and an MoE model; seeded sampling that ignores the batch;
bad requests that fail alone; the serving loop's API from other threads."""

from __future__ import annotations

import threading
import time
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig
from transformers import GenerationConfig

import fxlora
from fxlora.runtime import runner
from fxlora.runtime.runner import PREFILL_ALIGN, PREFILL_PADDING, PREFILL_SMALL, prefill_groups
from fxlora.runtime.sampler import _uniform, suppress
from fxlora.runtime.serving import Requests
from fxlora.testing import lora_module_names, make_adapter, peft_model_with, reference_generate, tiny_model

NAMES = ["a", "b", None]
STREAM = dict(max_batch_size=3, max_len=32, block_size=4, window=3)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "deepseek_v3"])  # dense, MoE, MLA
def served(request):
    torch._dynamo.reset()
    model = tiny_model(request.param, seed=5)
    targets = [t for t in lora_module_names(model) if "experts" not in t]
    adapters = {
        name: make_adapter(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets), seed=i, directory="", scale=0.3)
        for i, (name, r) in enumerate([("a", 4), ("b", 2)])
    }
    cm = fxlora.compile(model, adapters, max_loras=4, max_batch_size=4, max_len=32)
    requests = cm._requests(STREAM, None)
    return model, adapters, cm, requests, peft_model_with(model, adapters)


def expected(served, prompt: list[int], name: str | None, max_new: int, eos: int | None) -> list[int]:
    model, _, _, _, peft_model = served
    tokens = reference_generate(model, peft_model, [name], torch.tensor([prompt]), None, max_new, eos, 0)[0].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


def drive(requests: Requests, arrivals: dict[int, list], cancels: dict[int, list[str]]) -> dict[str, object]:
    """Run the engine turn by turn, adding requests and cancelling them at the given turns;
    returns every finished output by request id."""
    engine, done, turn = requests.engine, {}, 0
    try:
        while turn <= max([*arrivals, *cancels, 0]) or engine.has_work:
            for seq in arrivals.get(turn, []):
                engine.add(seq)
            for request_id in cancels.get(turn, []):
                engine.cancel(request_id)
            events = engine.step()
            done.update({e.seq.request_id: e.seq.output() for e in events if e.finished})
            engine.forget(events)
            turn += 1
    except BaseException:
        engine.forget(engine.fail_all("error", "the test failed"))  # the next example starts clean
        raise
    allocator = engine.runner.cache.allocator
    assert allocator.free == allocator.num_blocks - 1  # every block came back
    return done


@given(data=st.data())
def test_every_request_equals_peft_alone(served, data):
    check_requests(served, data)


@settings(max_examples=10)
@given(data=st.data())
def test_every_request_equals_peft_alone_over_prefills_split_by_length(served, data):
    with mock.patch.object(runner, "PREFILL_SMALL", 0), mock.patch.object(runner, "PREFILL_PADDING", 1.0):
        check_requests(served, data)


def check_requests(served, data) -> None:
    """Draw requests with arrivals and cancellations; each one's tokens are PEFT's alone."""
    model, _, cm, requests, _ = served
    vocab = model.config.vocab_size
    n = data.draw(st.integers(1, 7), label="requests")
    arrivals, plan, cancels = {}, {}, {}
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=12), label="prompt")
        name = data.draw(st.sampled_from(NAMES), label="adapter")
        max_new = data.draw(st.integers(1, 8), label="max_new_tokens")
        eos = data.draw(st.none() | st.integers(3, vocab - 1), label="eos")
        turn = data.draw(st.integers(0, 4), label="arrival turn")
        seq = requests.make(prompt, name, max_new, request_id=f"r{i}", eos_token_id=eos if eos is not None else ())
        arrivals.setdefault(turn, []).append(seq)
        plan[seq.request_id] = (prompt, name, max_new, eos)
        if data.draw(st.booleans(), label="cancelled") and data.draw(st.booleans()):
            cancels.setdefault(turn + data.draw(st.integers(0, 2), label="cancel after"), []).append(seq.request_id)
    done = drive(requests, arrivals, cancels)
    assert set(done) == set(plan)
    cancelled = {r for ids in cancels.values() for r in ids}
    for request_id, (prompt, name, max_new, eos) in plan.items():
        out, ref = done[request_id], expected(served, prompt, name, max_new, eos)
        assert out.adapter_name == name and out.prompt_ids == prompt and out.error is None
        if out.finish_reason == "cancelled":
            assert request_id in cancelled and out.generated_tokens == ref[: len(out.generated_tokens)]
        else:
            assert out.generated_tokens == ref, (request_id, out)
            assert out.finish_reason == ("stop" if eos is not None and ref[-1] == eos else "length")


def test_a_cancel_of_an_ended_request_leaves_a_later_one_with_its_id(served):
    """A cancel asked while the request is in flight but taken in after it ended, its id read
    and used again by a new request, ends nothing: the new request runs to its length."""
    _, _, _, requests, _ = served
    engine, first_done = requests.engine, None
    engine.add(requests.make([5, 6, 7], "a", 2, request_id="x", eos_token_id=()))
    while first_done is None:
        events = engine.step()
        first_done = next((e for e in events if e.finished and e.seq.request_id == "x"), None)
    engine.cancel("x")  # still in flight here: its end is not handed on yet
    engine.forget(events)
    engine.add(requests.make([8, 9], "b", 4, request_id="x", eos_token_id=()))
    done = drive(requests, {}, {})
    assert first_done.seq.output().finish_reason == "length"
    assert done["x"].finish_reason == "length" and done["x"].generated_tokens == expected(served, [8, 9], "b", 4, None)


def test_a_prefills_padding_rows_read_no_adapter(served):
    """One prompt prefills as two rows (Dynamo specialises one): the padding row reads no
    adapter, so its LoRA is no work, and the prompt's tokens are PEFT's."""
    _, _, cm, requests, _ = served
    r, seen = requests.engine.runner, []
    prefill = r._prefill

    def spy(ids, keep, slots, slot_ids):
        seen.append(slot_ids.tolist())
        return prefill(ids, keep, slots, slot_ids)

    with mock.patch.object(r, "_prefill", spy):
        done = drive(requests, {0: [requests.make([5, 6, 7], "b", 3, request_id="p", eos_token_id=())]}, {})
    assert seen == [[cm.pool.slot_of["b"], -1]]
    assert done["p"].generated_tokens == expected(served, [5, 6, 7], "b", 3, None)


def test_generate_batch_in_input_order_with_a_bad_input(served):
    model, _, cm, _, _ = served
    prompts = [[5, 6, 7], [], [8, 9, 10, 11], [12] * 40, [13, 14]]
    names = ["a", "b", "nope", None, "b"]
    outs = cm.generate_batch(prompts, names, max_new_tokens=[4, 4, 4, 4, 6], eos_token_id=(), progress_bar=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "prompt is empty" in outs[1].error and "unknown adapter 'nope'" in outs[2].error and "max_len=32" in outs[3].error
    assert all(o.request_id in o.error for o in outs if o.error)
    for i in (0, 4):
        assert outs[i].generated_tokens == expected(served, prompts[i], names[i], [4, 4, 4, 4, 6][i], None)


def test_a_seeded_sampled_request_ignores_the_rest_of_the_batch(served):
    model, _, cm, requests, _ = served
    prompt, sampled = [9, 8, 7, 6], dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95, seed=1234)
    alone = cm.generate_batch([prompt], ["a"], max_new_tokens=8, eos_token_id=(), progress_bar=False, **sampled)[0]
    others = [[3, 4, 5], [10, 11], [20, 21, 22, 23, 24]]
    mixed = cm.generate_batch(
        [others[0], prompt, *others[1:]], [None, "a", "b", "a"], max_new_tokens=[3, 8, 5, 2], eos_token_id=(),
        do_sample=[True, True, False, True], seed=[1, 1234, None, 2], temperature=1.3, top_k=40, top_p=0.95,
        progress_bar=False,
    )  # fmt: skip
    assert mixed[1].generated_tokens == alone.generated_tokens
    draws = {tuple(cm.generate_batch([prompt], ["a"], max_new_tokens=8, eos_token_id=(), do_sample=True, seed=s,
                                     progress_bar=False)[0].generated_tokens) for s in range(5)}  # fmt: skip
    assert len(draws) > 1  # the seed drives the draws
    greedy = cm.generate_batch([prompt], ["a"], max_new_tokens=8, eos_token_id=(), do_sample=True, top_k=1, progress_bar=False)
    assert greedy[0].generated_tokens == expected(served, prompt, "a", 8, None)


def test_limits_past_the_runners_integers_mean_what_their_largest_useful_values_do(served):
    """A ``min_new_tokens`` past ``max_new_tokens`` holds every end token back, a ``top_k`` past
    the vocabulary keeps every token: served as those, whatever their size."""
    model, _, cm, _, _ = served
    prompts, kw = [[9, 8, 7], [5, 6]], dict(max_new_tokens=6, eos_token_id=[3, 4], do_sample=True, seed=7, progress_bar=False)
    huge = cm.generate_batch(prompts, ["a", None], min_new_tokens=2**63, top_k=2**63, **kw)
    plain = cm.generate_batch(prompts, ["a", None], min_new_tokens=6, top_k=0, **kw)
    assert [o.generated_tokens for o in huge] == [o.generated_tokens for o in plain] and all(o.error is None for o in huge)


def test_an_end_token_of_id_0_is_held_back_before_min_new_tokens():
    """End-token lists are padded with -1 up to the runner's width: the pads never undo the hold
    on a real end token 0 (the scatter used to write token 0's logit back over it)."""
    logits = torch.randn(4, 10)
    tokens = torch.tensor([[0, -1, -1], [5, 0, -1], [-1, -1, -1], [0, -1, -1]])
    held = suppress(logits, tokens, torch.tensor([True, True, True, False]))
    assert torch.isinf(held[0, 0]) and torch.isinf(held[1, 0]) and torch.isinf(held[1, 5])
    assert torch.equal(held[2], logits[2]) and torch.equal(held[3], logits[3])  # no end token; not held back
    assert torch.equal(held[0, 1:], logits[0, 1:]) and held[1].isinf().sum() == 2


def test_seeds_whose_halves_trade_bits_draw_apart():
    seeds = torch.tensor([1, 2**32, 3 * 2**32 + 2, 5, 5 * 2**32, -1])
    noise = _uniform(seeds, torch.zeros(len(seeds), dtype=torch.int64), 64)
    assert len({tuple(row.tolist()) for row in noise}) == len(seeds)


def test_requests_wait_for_blocks_and_none_fails(served):
    model, _, cm, _, _ = served
    requests = cm._requests({**STREAM, "max_batch_size": 4, "kv_cache_memory": _bytes_for_blocks(cm, 7)}, None)
    plan = [([3 + i] * (4 + i), NAMES[i % 3], 6) for i in range(6)]  # 10 tokens each at least: 3 blocks of 4
    done = drive(requests, {0: [requests.make(p, n, m, request_id=f"w{i}", eos_token_id=()) for i, (p, n, m) in enumerate(plan)]}, {})
    for i, (p, n, m) in enumerate(plan):
        assert done[f"w{i}"].generated_tokens == expected(served, p, n, m, None)
    cm._requests(STREAM, None)  # back to the module's engine


def _bytes_for_blocks(cm, blocks: int) -> int:
    from fxlora.runtime.kv_cache import probe_shapes
    from fxlora.runtime.paged_cache import PagedKVCache

    shapes = probe_shapes(cm.model, cm.device)
    return blocks * PagedKVCache.block_bytes(shapes, STREAM["block_size"], cm.dtype)


def test_bad_requests_are_refused_by_name(served):
    model, _, cm, requests, _ = served
    cases = [
        (dict(input_ids=[]), ValueError, "prompt is empty"),
        (dict(input_ids=[5, 500]), ValueError, "token 500"),
        (dict(input_ids=[5], adapter_name="nope"), fxlora.AdapterError, "unknown adapter 'nope'"),
        (dict(input_ids=[5] * 30, max_new_tokens=5), ValueError, "exceeds max_len=32"),
        (dict(input_ids=[5], max_new_tokens=2, do_sample=True, top_p=1.5), fxlora.GenerationConfigError, "top_p"),
        (dict(input_ids=[5], max_new_tokens=2, repetition_penalty=1.2), fxlora.GenerationConfigError, "repetition_penalty"),
        (dict(input_ids=[5], max_new_tokens=2, seed=1.5), TypeError, "seed must be an int"),
        (dict(input_ids=[5], max_new_tokens=2, do_sample=True, seed=2**64), ValueError, r"seed must lie in \[-2\*\*63, 2\*\*63\)"),
        (dict(input_ids=[5], max_new_tokens=2, do_sample=True, temperature=float("nan")), fxlora.GenerationConfigError,
         "temperature must be > 0 when sampling, got nan"),
        (dict(input_ids=[5], adapter_names=["a"]), TypeError, "unexpected keyword adapter_names=.*adapter_name="),
    ]
    for kwargs, error, fragment in cases:
        with pytest.raises(error, match=fragment) as info:
            requests.make(request_id="bad", **kwargs)
        assert "request 'bad'" in str(info.value)


def test_the_serving_loop(served):
    model, adapters, cm, _, _ = served
    prompts = {f"s{i}": ([4 + i, 5, 6 + i], NAMES[i % 3], 3 + i) for i in range(5)}
    with cm.serve(**STREAM) as manager:
        ids = {}
        threads = [
            threading.Thread(target=lambda k=k, v=v: ids.__setitem__(k, manager.add_request(v[0], k, v[2], k == "s1",
                             adapter_name=v[1], eos_token_id=())))  # fmt: skip
            for k, v in prompts.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        streamed = list(manager.request_id_iter("s1", timeout=60))
        assert streamed[-1].is_finished() and all(not o.is_finished() for o in streamed[:-1])
        lengths = [len(o.generated_tokens) for o in streamed]
        assert lengths == sorted(lengths) and lengths[-1] == prompts["s1"][2]
        assert manager.get_result("s3", timeout=60).generated_tokens == expected(served, *prompts["s3"], None)
        rest = {o.request_id: o for o in (manager.get_result(timeout=60) for _ in range(3))}
        assert set(rest) == {"s0", "s2", "s4"}
        for k, out in rest.items():
            assert out.generated_tokens == expected(served, *prompts[k], None)
        streamed = manager.add_request([9, 8], max_new_tokens=7, streaming=True, eos_token_id=())
        outs = [manager.get_result(streamed, timeout=60)]  # as in transformers: its partial results, then the final one
        while not outs[-1].is_finished():
            outs.append(manager.get_result(streamed, timeout=60))
        assert len(outs) > 1 and [len(o.generated_tokens) for o in outs] == sorted(len(o.generated_tokens) for o in outs)
        assert outs[-1].generated_tokens == expected(served, [9, 8], None, 7, None)
        long = manager.add_request([7, 8, 9], adapter_name="a", max_new_tokens=25, eos_token_id=())
        manager.cancel_request(long)
        out = manager.get_result(long, timeout=60)
        assert out.finish_reason == "cancelled" and out.generated_tokens == expected(served, [7, 8, 9], "a", 25, None)[: len(out.generated_tokens)]
        with pytest.raises(KeyError, match="no request 'zzz'"):
            manager.get_result("zzz", timeout=1)
    assert not manager.is_running()
    with pytest.raises(RuntimeError, match="not running"):
        manager.add_request([5])


def test_stop_lets_the_requests_in_flight_end_and_a_hard_stop_cancels_them(served):
    model, _, cm, _, _ = served
    idle = cm.serve(**STREAM)
    assert idle.get_result() is None and list(idle) == []  # never started: nothing comes, at once
    with cm.serve(**STREAM) as manager:
        mine = manager.add_request([7, 8, 9], "mine", 12, eos_token_id=())  # transformers' order: the id, then the count
        numpy_ids = manager.add_request([np.int64(5), np.int64(6)], max_new_tokens=3, adapter_name="a", eos_token_id=())
        with pytest.raises(ValueError, match="keep_for_next_session"):
            manager.stop(keep_for_next_session=True)
    assert mine == "mine" and not manager.is_running()  # leaving the block stopped it after the requests ended
    out = manager.get_result(mine, timeout=60)
    assert out.finish_reason == "length" and out.generated_tokens == expected(served, [7, 8, 9], None, 12, None)
    assert manager.get_result(numpy_ids, timeout=60).generated_tokens == expected(served, [5, 6], "a", 3, None)
    with cm.serve(**STREAM) as manager:
        cut = manager.add_request([7, 8, 9], max_new_tokens=25, eos_token_id=())
        manager.stop(hard_stop=True)
    out = manager.get_result(cut, timeout=60)
    assert out.finish_reason == "cancelled" and len(out.generated_tokens) < 25


def test_a_reader_woken_by_the_loops_end_gets_the_last_result(served, monkeypatch):
    """The loop's end cancels what is in flight and closes in one step under the results'
    lock: a reader waiting by id never sees the loop closed without that request's result."""
    model, _, cm, requests, _ = served
    fail_all = requests.engine.fail_all

    def slow_fail_all(*args):
        time.sleep(0.3)  # the window in which a woken reader used to find the loop closed, the result not yet there
        return fail_all(*args)

    with cm.serve(**STREAM) as manager:
        cut = manager.add_request([7, 8, 9], max_new_tokens=25, streaming=True, eos_token_id=())
        outs = []
        reader = threading.Thread(target=lambda: outs.extend(manager.request_id_iter(cut, timeout=60)))
        reader.start()
        monkeypatch.setattr(requests.engine, "fail_all", slow_fail_all)
        manager.stop(hard_stop=True)
    reader.join(timeout=60)
    assert outs and outs[-1].finish_reason == "cancelled"


def test_generate_batch_through_a_running_loop_keeps_its_results_from_other_readers(served):
    model, _, cm, _, _ = served
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    with cm.serve(**STREAM) as manager:
        taken, reading = [], threading.Event()

        def read_any():
            while not reading.is_set():
                if (out := manager.get_result(timeout=0.05)) is not None:
                    taken.append(out.request_id)

        reader = threading.Thread(target=read_any)
        reader.start()
        try:
            outs = cm.generate_batch(prompts, ["a", None, "b"], max_new_tokens=4, eos_token_id=(), progress_bar=False)
        finally:
            reading.set()
            reader.join(timeout=60)
    assert taken == [] and [o.generated_tokens for o in outs] == [
        expected(served, p, n, 4, None) for p, n in zip(prompts, ["a", None, "b"])
    ]


def test_generate_batch_refuses_what_it_serves_otherwise_for_the_whole_call(served):
    model, _, cm, _, _ = served
    prompts = [[5, 6, 7], [8, 9]]
    ok = cm.generate_batch(prompts, max_new_tokens=2, warmup=True, persistent_manager=True, record_timestamps=False,
                           continuous_batching_config=None, progress_bar=False)  # fmt: skip
    assert [len(o.generated_tokens) for o in ok] == [2, 2]
    for kw, error, match in (
        (dict(warmup=False), ValueError, "warmup=False"),
        (dict(persistent_manager=False), ValueError, "persistent_manager=False"),
        (dict(record_timestamps=True), ValueError, "record_timestamps=True"),
        (dict(continuous_batching_config=GenerationConfig()), ValueError, "continuous_batching_config="),
        (dict(adapter_name="a"), TypeError, "adapter_names="),
        (dict(request_id=["x", "y"]), TypeError, "request_id="),
    ):
        with pytest.raises(error, match=match):
            cm.generate_batch(prompts, max_new_tokens=2, progress_bar=False, **kw)
    with pytest.raises(TypeError, match="pass generation_config= by keyword"):
        cm.generate_batch(prompts, GenerationConfig(max_new_tokens=2))
    outs = cm.generate_batch(prompts, max_new_tokens=[2, 2.0], progress_bar=False)  # equal values of another type
    assert outs[0].error is None and "max_new_tokens must be an int" in outs[1].error


def test_an_adapter_unloaded_while_serving_keeps_its_running_requests(served, tmp_path):
    model, _, cm, requests, _ = served
    targets = [t for t in lora_module_names(model) if "experts" not in t]
    late = make_adapter(model, LoraConfig(r=2, target_modules=targets), seed=9, directory="", scale=0.3)
    cm.load_adapter(late, adapter_name="late")
    engine = requests.engine
    try:
        running = requests.make([6, 7, 8], "late", 8, request_id="keeps", eos_token_id=())
        engine.add(running)
        engine.forget(engine.step())  # admitted, prefilled, a window decoded
        waiting = requests.make([9, 10], "late", 3, request_id="refused", eos_token_id=())
        cm.unload_adapter("late")
        done = drive(requests, {0: [waiting]}, {})
    finally:
        if "late" in cm.adapter_names:
            cm.unload_adapter("late")
    model_ref = reference_generate(model, peft_model_with(model, {"late": late}), ["late"], torch.tensor([[6, 7, 8]]), None, 8, None, 0)
    assert running.generated == model_ref[0].tolist()
    assert done["refused"].finish_reason == "error" and "unknown adapter 'late'" in done["refused"].error


def test_cancels_of_ids_not_in_flight_are_dropped_and_waiting_ones_end_at_once(served):
    model, _, cm, requests, _ = served
    engine = requests.engine
    engine.cancel("later")  # not in flight: ignored, so a later request of that id runs
    rows = engine.runner.max_rows
    for i in range(rows + 1):  # one more than the rows: the last waits
        engine.add(requests.make([5 + i, 6], "a", 8, request_id="later" if i == rows else f"c{i}", eos_token_id=()))
    engine.forget(engine.step())
    assert [s.request_id for s in engine.scheduler.waiting] == ["later"]
    engine.cancel("later")
    events = engine.step()
    assert [(e.seq.request_id, e.seq.finish_reason) for e in events if e.finished][:1] == [("later", "cancelled")]
    engine.forget(events)
    done = drive(requests, {}, {})
    assert sorted(done) == [f"c{i}" for i in range(rows)]


def test_generate_batch_from_two_threads_each_gets_its_own(served):
    model, _, cm, _, _ = served
    prompts = [[[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]]
    outs = {}
    threads = [
        threading.Thread(target=lambda k=k: outs.__setitem__(k, cm.generate_batch(prompts[k], ["a", None], max_new_tokens=4,
                                                                                eos_token_id=(), progress_bar=False)))  # fmt: skip
        for k in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k in range(2):
        for prompt, name, out in zip(prompts[k], ["a", None], outs[k]):
            assert out.generated_tokens == expected(served, prompt, name, 4, None)


@given(st.lists(st.integers(1, 600), min_size=1, max_size=40))
def test_prefill_groups_take_every_prompt_once_with_bounded_padding(lengths):
    groups = prefill_groups(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    longest = [max(lengths[i] for i in group) for group in groups]
    assert longest == sorted(longest, reverse=True)  # longest first
    for group in groups:
        width = -(-max(lengths[i] for i in group) // PREFILL_ALIGN) * PREFILL_ALIGN
        padded, tokens = len(group) * width, sum(lengths[i] for i in group)
        assert padded <= max(PREFILL_SMALL, PREFILL_PADDING * tokens)


@given(st.lists(st.integers(1, 600), min_size=1, max_size=40))
def test_a_prefill_graph_holds_its_prompts_within_bounded_padding(lengths):
    """Each prefill group's graph shape (where it takes one) holds every prompt, keeps
    Inductor's alignment and pads within the bound of the eager prefill's padding."""
    from types import SimpleNamespace

    from fxlora.runtime.generation import default_buckets

    buckets = default_buckets(128)
    state = SimpleNamespace(graphs=SimpleNamespace(enabled=True), prefill_graph_tokens=4096, max_rows=128,
                            bucket_for=lambda rows: next(b for b in buckets if b >= rows))  # fmt: skip
    for group in prefill_groups(lengths):
        longest, tokens = max(lengths[i] for i in group), sum(lengths[i] for i in group)
        shape = runner.StreamRunner._prefill_shape(state, len(group), longest, tokens)
        if shape is None:
            continue
        rows, length = shape
        eager = len(group) * -(-longest // PREFILL_ALIGN) * PREFILL_ALIGN
        assert rows >= max(len(group), 2) and length >= longest and length % PREFILL_ALIGN == 0
        assert rows * length <= 4096 and rows * length <= max(PREFILL_SMALL, PREFILL_PADDING * eager)


def test_a_serving_size_other_than_the_compiles_takes_its_own_batch_buckets():
    model = tiny_model("llama", seed=5)
    adapters = {"a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), seed=1, directory="", scale=0.3)}
    cm = fxlora.compile(model, adapters, max_loras=2, max_batch_size=8, max_len=32, batch_buckets=[4, 8])
    assert cm._requests(dict(block_size=4), None).engine.runner.buckets == [4, 8]  # the compile's size: its buckets
    prompts = [[3 + i] * (2 + i) for i in range(5)]
    with cm.serve(max_batch_size=3, block_size=4) as manager:  # another size: buckets of its own
        assert manager.engine.runner.buckets == [2, 3]
        ids = [manager.add_request(p, max_new_tokens=4, adapter_name="a" if i % 2 else None, eos_token_id=()) for i, p in enumerate(prompts)]
        outs = [manager.get_result(i, timeout=60) for i in ids]
    peft_model = peft_model_with(model, adapters)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        name = "a" if i % 2 else None
        assert out.generated_tokens == reference_generate(model, peft_model, [name], torch.tensor([prompt]), None, 4, None, 0)[0].tolist()
    with pytest.raises(ValueError, match=r"batch buckets \[4, 8\] must lie in 1..max_batch_size=3"):
        cm.serve(max_batch_size=3, buckets=(4, 8))
    assert cm._requests(dict(max_batch_size=6, buckets=(2,), block_size=4), None).engine.runner.buckets == [2, 6]


@pytest.mark.parametrize(("family", "inner"), [("llama", "inductor"), ("qwen3_moe", "eager")])
def test_graphs_built_as_on_cuda_equal_peft_alone(family, inner):
    """The passes as they rewrite code captured in CUDA graphs (``shrink_ahead``: plain linears
    become ``lora_linear_beside`` and an add of their delta), run here on the CPU references,
    compiled by Inductor (which fuses the add into the next kernel) or run as rewritten: every
    request's tokens are PEFT's alone."""
    import dataclasses

    from fxlora.runtime.backend import Backend

    context = Backend._context
    as_on_cuda = lambda self, *args, **kwargs: dataclasses.replace(context(self, *args, **kwargs), shrink_ahead=True)  # noqa: E731
    model = tiny_model(family, seed=5)
    targets = [t for t in lora_module_names(model) if "experts" not in t]
    adapters = {
        name: make_adapter(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets), seed=i, directory="", scale=0.3)
        for i, (name, r) in enumerate([("a", 4), ("b", 2)])
    }
    with mock.patch.object(Backend, "_context", as_on_cuda):
        cm = fxlora.compile(model, adapters, max_loras=4, max_batch_size=4, max_len=32, inner=inner)
        prompts, names = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]], ["a", None, "b", "a"]
        outs = cm.generate_batch(prompts, names, max_new_tokens=6, eos_token_id=(), progress_bar=False)
    assert "fxlora::lora_linear_beside" in set(cm.backend.rewritten.values())
    peft_model = peft_model_with(model, adapters)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.generated_tokens == reference_generate(model, peft_model, [name], torch.tensor([prompt]), None, 6, None, 0)[0].tolist()
