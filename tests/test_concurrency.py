"""Several threads on one compiled model: calls run correctly or wait, an adapter unloaded
under a call in flight stays intact until that call returns, and hot swaps between and
during calls keep outputs exact and the graphs, pool and arena as they were."""

from __future__ import annotations

import threading
import tracemalloc

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora import AdapterError
from fxlora.testing import make_adapter, peft_model_with, tiny_model
from fxlora.testing.oracle import check_rows, reference_logits


@pytest.fixture(scope="module")
def served():
    torch._dynamo.reset()
    model = tiny_model("llama", seed=11)
    adapters = {
        name: make_adapter(model, LoraConfig(r=r, target_modules="all-linear"), seed=i, directory="", scale=0.3)
        for i, (name, r) in enumerate([("a", 4), ("b", 2)])
    }
    cm = fxlora.compile(model, adapters, max_loras=3, max_rank=4, max_batch_size=2, max_len=24)
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    peft_model = peft_model_with(model, adapters)
    expected = {
        names: reference_logits(model, peft_model, list(names), input_ids=ids)
        for names in [("a", None), ("b", "a"), (None, "b")]
    }
    return model, adapters, cm, ids, expected


def run_threads(*targets, timeout: float = 600) -> list[BaseException]:
    """Run each target in a thread of its own (which starts in grad mode, unlike the tests);
    returns their errors."""
    errors: list[BaseException] = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the test, which fails on any
                errors.append(e)

        return run

    threads = [threading.Thread(target=guard(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


def test_concurrent_forward_calls_match_peft(served):
    _, _, cm, ids, expected = served

    def caller(names):
        def loop():
            for _ in range(40):
                out = cm(input_ids=ids, adapter_names=list(names)).logits
                check_rows(out, expected[names], list(names))

        return loop

    assert not run_threads(*(caller(names) for names in expected))


def test_concurrent_generate_calls_get_their_own_tokens(served):
    _, _, cm, ids, _ = served
    cases = [("a", None), ("b", "a"), (None, "b")]
    want = {names: cm.generate(ids, adapter_names=list(names), max_new_tokens=6, eos_token_id=()) for names in cases}
    got: dict[tuple, list[torch.Tensor]] = {names: [] for names in cases}

    def caller(names):
        def loop():
            for _ in range(6):
                got[names].append(cm.generate(ids, adapter_names=list(names), max_new_tokens=6, eos_token_id=()))

        return loop

    assert not run_threads(*(caller(names) for names in cases))
    for names in cases:
        assert all(torch.equal(out, want[names]) for out in got[names]), names


def test_unload_under_calls_in_flight_never_gives_a_wrong_row(served):
    """One thread serves "b" rows while another unloads and reloads "b": each call returns
    exact outputs, or, having started after an unload, raises AdapterError naming "b"."""
    _, adapters, cm, ids, expected = served
    names = ("b", "a")
    stop = threading.Event()
    answered, refused = [0], [0]

    def serve():
        while not stop.is_set():
            try:
                out = cm(input_ids=ids, adapter_names=list(names)).logits
            except AdapterError as e:
                assert "'b'" in str(e), e
                refused[0] += 1
                continue
            check_rows(out, expected[names], list(names))
            answered[0] += 1

    def swap():
        try:
            for _ in range(150):
                cm.unload_adapter("b")
                cm.load_adapter(adapters["b"], adapter_name="b")
        finally:
            stop.set()

    assert not run_threads(serve, swap)
    assert answered[0] > 0
    assert sorted(cm.adapter_names) == ["a", "b"]
    check_rows(cm(input_ids=ids, adapter_names=list(names)).logits, expected[names], list(names))


def test_an_unloaded_adapters_slot_is_zeroed_when_its_last_call_ends(served):
    _, adapters, cm, _, _ = served
    pool = cm.pool
    slots, _ = pool.acquire(["b"])  # a call in flight reading "b"
    slot = slots[0]
    target = next(iter(pool.targets.values()))
    cm.unload_adapter("b")
    assert target.lora_a[slot].abs().sum() > 0  # still intact for that call
    with pytest.raises(AdapterError, match="unknown adapter 'b'"):
        cm(input_ids=torch.ones(1, 3, dtype=torch.long), adapter_names=["b"])
    cm.load_adapter(adapters["b"], adapter_name="b")
    assert pool.slot_of["b"] != slot  # the draining slot is not handed out
    pool.release(slots)
    assert target.lora_a[slot].abs().sum() == 0
    cm.unload_adapter("b")
    cm.load_adapter(adapters["b"], adapter_name="b")


def test_hot_swap_soak(served):
    """Hot swaps between calls and from another thread during calls: outputs stay exact at
    every check, and no retrace, no pool or arena growth, no memory growth."""
    _, adapters, cm, ids, expected = served
    names = ("b", "a")
    cm(input_ids=ids, adapter_names=list(names))  # traced again if a test run in between reset Dynamo
    pool_bytes, arena_bytes, graphs = cm.pool.nbytes, cm.backend.arena.nbytes, cm.compile_count
    tracemalloc.start()
    try:
        for round_ in range(60):
            cm.unload_adapter("b")
            cm.load_adapter(adapters["b"], adapter_name="b")
            if round_ == 10:
                base = tracemalloc.take_snapshot()
            if round_ % 10 == 0:
                errors = run_threads(
                    lambda: [cm(input_ids=ids, adapter_names=list(names)) for _ in range(5)],
                    lambda: [cm.load_adapter(adapters["a"], adapter_name="c") or cm.unload_adapter("c") for _ in range(5)],
                )
                assert not errors, errors
                check_rows(cm(input_ids=ids, adapter_names=list(names)).logits, expected[names], list(names))
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
    finally:
        tracemalloc.stop()
    assert (cm.pool.nbytes, cm.backend.arena.nbytes, cm.compile_count) == (pool_bytes, arena_bytes, graphs)
    assert grown < 2**20, f"Python memory grew by {grown} bytes over 50 hot swaps"
