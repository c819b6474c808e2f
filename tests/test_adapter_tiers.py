"""Adapter tiers: any number of adapters registered, GPU slots a cache over a host tier. 40
adapters of different ranks and targets over 4 slots serve 100 requests chosen Zipf-like (and
base-model ones) arriving over time, each token for token PEFT's greedy generation alone, with
the pool's memory and the compiled graphs unchanged; direct calls page too; the host tier's
bound reads adapters again from their directories; a reload while another call reads the
adapter waits for nothing."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig

import fxlora
from fxlora.adapters import NO_ADAPTER, host_buffers, model_modules, pool, read_adapter
from fxlora.adapters.slots import Stack
from fxlora.errors import NoFreeSlot
from fxlora.testing import make_adapter, peft_model_with, reference_generate, reference_logits, tiny_model

TARGETS = [["q_proj", "v_proj"], ["k_proj", "o_proj", "down_proj"], ["q_proj", "up_proj", "gate_proj"], ["v_proj", "down_proj"]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=11)


@pytest.fixture(scope="module")
def many(model):
    """40 adapters: ranks 1-8, four target sets."""
    return {
        f"ad{i:02d}": make_adapter(
            model, LoraConfig(r=1 + i % 8, lora_alpha=2 + i % 5, target_modules=TARGETS[i % 4]), seed=100 + i, directory="", scale=0.3
        )
        for i in range(40)
    }  # fmt: skip


def zipf(n: int, count: int, gen: torch.Generator) -> list[str | None]:
    weights = torch.tensor([1 / (k + 1) ** 1.1 for k in range(count)] + [0.6])  # and base-model requests
    picks = torch.multinomial(weights, n, replacement=True, generator=gen).tolist()
    return [None if k == count else f"ad{k:02d}" for k in picks]


def test_a_stream_over_forty_adapters_in_four_slots_equals_peft(model, many):
    torch._dynamo.reset()
    targets = sorted({t for group in TARGETS for t in group})
    cm = fxlora.compile(model, adapters=many, max_loras=4, max_rank=8, target_modules=targets)
    assert cm.adapter_names == list(many) and len(cm.pool.slot_of) == 4  # the first four took the slots
    requests = cm._requests(dict(max_batch_size=4, max_len=32, block_size=4, window=2), None)
    engine, gen = requests.engine, torch.Generator().manual_seed(3)
    names = zipf(100, 40, gen)
    plan = []
    for i, name in enumerate(names):
        prompt = torch.randint(3, 96, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen).tolist()
        plan.append((f"q{i}", prompt, name, int(torch.randint(1, 7, (), generator=gen)), i // 4))  # four arrive a turn
    pool_bytes, compiled = cm.pool.nbytes, None
    done, turn = {}, 0
    while len(done) < len(plan):
        for request_id, prompt, name, new, arrival in plan:
            if arrival == turn:
                engine.add(requests.make(prompt, name, new, request_id=request_id, eos_token_id=()))
        events = engine.step()
        done.update({e.seq.request_id: e.seq.output() for e in events if e.finished})
        engine.forget(events)
        turn += 1
        if turn == 3:
            compiled = cm.compile_count  # decode and prefill traced by now
    assert cm.compile_count == compiled and cm.pool.nbytes == pool_bytes  # no retrace, no new pool memory
    assert cm.pool.misses > 4 and cm.pool.hits > 0  # adapters were paged in, and found resident
    peft = peft_model_with(model, many)
    for request_id, prompt, name, new, _ in plan:
        out = done[request_id]
        want = reference_generate(model, peft, [name], torch.tensor([prompt]), None, new, None, 0)[0].tolist()
        assert out.error is None and out.generated_tokens == want, (request_id, name)
    assert "on the host" in cm.explain() and "paged in" in cm.explain()


def test_direct_calls_page_adapters_in(model, many):
    torch._dynamo.reset()
    chosen = {k: many[k] for k in ("ad00", "ad05", "ad10", "ad15", "ad20")}
    cm = fxlora.compile(model, adapters=chosen, max_loras=2, max_rank=8)
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    peft = peft_model_with(model, chosen)
    for pair in (["ad10", "ad15"], ["ad00", None], ["ad20", "ad05"], ["ad10", "ad15"]):
        out = cm(input_ids=ids, adapter_names=pair).logits
        ref = reference_logits(model, peft, pair, input_ids=ids)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    tokens = cm.generate(ids, adapter_names=["ad05", "ad00"], max_new_tokens=4, eos_token_id=())
    assert torch.equal(tokens[:, 6:], reference_generate(model, peft, ["ad05", "ad00"], ids, None, 4, None, 0))
    with pytest.raises(fxlora.AdapterError, match="names 3 adapters but the pool has max_loras=2"):
        cm(input_ids=torch.cat([ids, ids[:1]]), adapter_names=["ad00", "ad05", "ad10"])


def test_the_host_tier_reads_adapters_again_beyond_its_bound(model, tmp_path):
    torch._dynamo.reset()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    dirs = {f"d{i}": make_adapter(model, config, seed=200 + i, directory=str(tmp_path / f"d{i}"), scale=0.3) for i in range(4)}
    cm = fxlora.compile(model, adapters=dirs, max_loras=1, max_cpu_loras=2, max_rank=8)
    assert len(cm.pool.host) == 2  # two keep their factors on the host; the others their directory
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(5))
    peft = peft_model_with(model, dirs)
    for name in ("d0", "d3", "d1", "d0"):
        out = cm(input_ids=ids, adapter_names=[name]).logits
        torch.testing.assert_close(out, reference_logits(model, peft, [name], input_ids=ids), rtol=1e-5, atol=1e-5)
        assert len(cm.pool.host) <= 2
    dropped = next(n for n in dirs if n not in cm.pool.host and n not in cm.pool.slot_of)
    for f in (tmp_path / dropped).iterdir():  # its directory gone: a call naming it fails, and names why
        f.unlink()
    with pytest.raises(fxlora.AdapterError, match=f"'{dropped}' .*its files are gone since it was loaded"):
        cm(input_ids=ids, adapter_names=[dropped])
    assert torch.equal(cm(input_ids=ids, adapter_names=["d3"]).logits, cm(input_ids=ids, adapter_names=["d3"]).logits)


def test_an_adapter_read_again_is_the_one_loaded_or_an_error(model, tmp_path, monkeypatch):
    """Read again from its directory (the host tier dropped it), an adapter comes from where it
    was loaded whatever the working directory is then, and files changed since are refused."""
    torch._dynamo.reset()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    for d in ("first", "second"):
        for i, n in enumerate(("a", "b")):
            make_adapter(model, config, seed=300 + 10 * i + len(d), directory=str(tmp_path / d / n), scale=0.3)
    monkeypatch.chdir(tmp_path / "first")
    cm = fxlora.compile(model, adapters={"a": "a", "b": "b"}, max_loras=1, max_cpu_loras=1, max_rank=8)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(13))
    cm(input_ids=ids, adapter_names=["b"])  # "a" leaves its slot, its factors dropped from the host tier
    assert "rank <= 4" in cm.explain()  # (a dropped adapter's modules keep their ranks)
    monkeypatch.chdir(tmp_path / "second")  # another "a" here: not the one loaded
    peft = peft_model_with(model, {"a": str(tmp_path / "first" / "a")})
    ref = reference_logits(model, peft, ["a"], input_ids=ids)
    torch.testing.assert_close(cm(input_ids=ids, adapter_names=["a"]).logits, ref, rtol=1e-5, atol=1e-5)
    cm(input_ids=ids, adapter_names=["b"])
    make_adapter(model, config, seed=999, directory=str(tmp_path / "first" / "a"), scale=0.3)  # rewritten in place
    with pytest.raises(fxlora.AdapterError, match="'a' .*first/a.*files changed since it was loaded"):
        cm(input_ids=ids, adapter_names=["a"])


def test_reloading_an_adapter_another_call_reads_needs_no_free_slot(model, many):
    torch._dynamo.reset()
    cm = fxlora.compile(model, adapters={k: many[k] for k in ("ad00", "ad01")}, max_loras=2, max_rank=8)
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(6))
    slots, _ = cm.pool.acquire(["ad00", "ad01"])  # a call in flight reads both slots
    try:
        cm.unload_adapter("ad00")
        cm.load_adapter(many["ad04"], adapter_name="ad00")  # registered at once: no slot needed now
        waited = {}
        thread = threading.Thread(target=lambda: waited.setdefault("out", cm(input_ids=ids, adapter_names=["ad00", None]).logits))
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()  # every slot is read: the call waits for one
    finally:
        cm.pool.release(slots)
    thread.join(timeout=60)
    ref = reference_logits(model, peft_model_with(model, {"ad00": many["ad04"]}), ["ad00", None], input_ids=ids)
    torch.testing.assert_close(waited["out"], ref, rtol=1e-5, atol=1e-5)


def test_slots_from_a_memory_budget(model, many):
    chosen = {k: many[k] for k in ("ad00", "ad04", "ad08")}  # q_proj and v_proj, ranks 1, 5, 1
    per_slot = 2 * 8 * ((32 + 32) + (32 + 16)) * 4 + 2 * 2 * 8  # two layers, two targets, rank 8, float32; scaling, rank
    cm = fxlora.compile(model, adapters=chosen, max_loras=None, lora_memory=2 * per_slot + 7, max_rank=8)
    assert cm.pool.max_loras == 2 and cm.pool.nbytes == 2 * per_slot and list(cm.pool.slot_of) == ["ad00", "ad04"]
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(8))
    out = cm(input_ids=ids, adapter_names=["ad08", None]).logits
    ref = reference_logits(model, peft_model_with(model, {"ad08": many["ad08"]}), ["ad08", None], input_ids=ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(fxlora.AdapterError, match="lora_memory=100 bytes hold no slot"):
        fxlora.compile(model, adapters=chosen, max_loras=None, lora_memory=100, max_rank=8)
    with pytest.raises(ValueError, match="max_loras= or as lora_memory="):
        fxlora.compile(model, adapters=chosen, lora_memory=10**6)
    # slots the device cannot give: named, and the pool left as it was; other errors as they are
    for kw, failure, expected in (
        (dict(max_loras=None, lora_memory=2**33), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"), fxlora.AdapterError),
        (dict(max_loras=4000), RuntimeError("DefaultCPUAllocator: can't allocate memory"), fxlora.AdapterError),
        (dict(max_loras=4), RuntimeError("something else"), RuntimeError),
    ):
        p = fxlora.adapters.AdapterPool(max_rank=8, **kw)
        p.load(read_adapter("ad00", many["ad00"]))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(Stack, "of", lambda *a, failure=failure: (_ for _ in ()).throw(failure))
            with pytest.raises(expected) as raised:
                p.register_modules(model_modules(model), complete=True)
        if expected is fxlora.AdapterError:
            setting = "lora_memory=8589934592: 1193046" if "lora_memory" in kw else "max_loras=4000: 4000"
            assert str(raised.value).startswith(f"{setting} slots of 7200 bytes over 4 targets at max_rank=8")
            assert f"could not be allocated ({type(failure).__name__}: {failure})" in str(raised.value)
        else:
            assert raised.value is failure
        assert not p.modules and not p.targets and not p._sets and p.max_loras == (kw["max_loras"] or 0)
    # a slot count no memory holds, really allocated: refused by name at registration, nothing
    # built per slot before
    p = fxlora.adapters.AdapterPool(max_loras=10**12, max_rank=8)
    p.load(read_adapter("ad00", many["ad00"]))
    with pytest.raises(fxlora.AdapterError, match=r"^max_loras=1000000000000: 1000000000000 slots of 7200 bytes"):
        p.register_modules(model_modules(model), complete=True)


def test_the_host_tier_never_drops_the_adapter_it_is_loading(model, many, tmp_path):
    torch._dynamo.reset()
    cm = fxlora.compile(model, adapters={"m": many["ad00"]}, max_loras=1, max_cpu_loras=1, max_rank=8)
    path = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), seed=7, directory=str(tmp_path / "d"))
    cm.load_adapter(path, adapter_name="d")  # one host place, held by "m" (in memory, never dropped)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(9))
    ref = reference_logits(model, peft_model_with(model, {"d": path}), ["d"], input_ids=ids)
    torch.testing.assert_close(cm(input_ids=ids, adapter_names=["d"]).logits, ref, rtol=1e-5, atol=1e-5)


def test_two_calls_waiting_for_one_adapter_place_it_once(model, many):
    torch._dynamo.reset()
    cm = fxlora.compile(model, adapters={k: many[k] for k in ("ad00", "ad04", "ad08")}, max_loras=1, max_rank=8)
    held, _ = cm.pool.acquire(["ad00"])  # the one slot is read
    results, threads = [], []
    for _ in range(2):
        threads.append(threading.Thread(target=lambda: results.append(cm.pool.acquire(["ad04"], timeout=30))))
        threads[-1].start()
    cm.pool.release(held)
    for t in threads:
        t.join(timeout=60)
    assert [slots for slots, _ in results] == [[0], [0]] and cm.pool.slot_of == {"ad04": 0} and cm.pool._pins == {0: 2}
    for slots, _ in results:
        cm.pool.release(slots)
    assert cm.pool._pins.total() == 0


def test_a_call_inside_calls_of_its_own_thread_holding_every_slot_fails_at_once(model, many):
    """Waiting is for other calls to end: where every slot is read by calls the waiting one runs
    inside (an enclosing call or block of the same thread), it fails at once, naming them; a
    slot another thread reads is waited for as before."""
    torch._dynamo.reset()
    cm = fxlora.compile(model, adapters={k: many[k] for k in ("ad00", "ad04", "ad08")}, max_loras=2, max_rank=8)
    p = cm.pool
    outer, _ = p.acquire(["ad00", "ad04"])
    start = time.perf_counter()
    with pytest.raises(NoFreeSlot, match=r"calls this one runs inside .*\['ad00', 'ad04'\]"):
        p.acquire(["ad08"], timeout=30)
    assert time.perf_counter() - start < 5 and p._pins == Counter({0: 1, 1: 1})
    # one slot read by another thread instead: the same call waits for it, and gets it
    p.release(outer[1:])
    results = []
    other = threading.Thread(target=lambda: results.append(p.acquire(["ad04"])))
    other.start()
    other.join(timeout=60)
    (theirs, _), = results
    waiter = threading.Thread(target=lambda: results.append(p.acquire(["ad08"], timeout=30)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # waiting: the other thread's call may end
    p.release(theirs)
    waiter.join(timeout=60)
    assert results[-1][0] == theirs
    p.release(results[-1][0])
    p.release(outer[:1])
    assert p._pins.total() == 0 and not p._owned


def test_a_use_adapters_block_inside_one_holding_every_slot_fails_at_once(model, many):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxlora", options={"adapters": {k: many[k] for k in ("ad00", "ad04", "ad08")}, "max_loras": 2})
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    with fxlora.use_adapters(["ad00", "ad04"]):
        compiled(input_ids=ids)
        start = time.perf_counter()
        with pytest.raises(NoFreeSlot, match=r"calls this one runs inside .*\['ad00', 'ad04'\]"):
            with fxlora.use_adapters(["ad08", None]):
                compiled(input_ids=ids)
        assert time.perf_counter() - start < 5
    with fxlora.use_adapters(["ad08", None]):  # the block's end gave its slots back
        out = compiled(input_ids=ids).logits
    peft = peft_model_with(model, {"ad08": many["ad08"]})
    torch.testing.assert_close(out, reference_logits(model, peft, ["ad08", None], input_ids=ids), rtol=1e-5, atol=1e-5)


def test_a_call_waiting_for_a_slot_keeps_the_slots_it_pinned_when_their_adapter_is_unloaded(model, many):
    """A call pins each adapter as it is placed and waits for the next one's slot with the lock
    released: an adapter it pinned that is unloaded (or loaded again) meanwhile stays in its
    slot for that call, whose rows read it there; its end gives every slot back."""
    torch._dynamo.reset()
    names = ("ad00", "ad04", "ad08")
    cm = fxlora.compile(model, adapters={k: many[k] for k in names}, max_loras=2, max_rank=8)
    p = cm.pool
    held, _ = p.acquire(["ad00"])  # slot 0 read by another call; ad04 holds slot 1
    a_slot, a_factors = p.slot_of["ad04"], [t.lora_a[p.slot_of["ad04"]].clone() for t in p.targets.values()]
    results = []
    waiter = threading.Thread(target=lambda: results.append(p.acquire(["ad04", None, "ad08"], timeout=30)))
    waiter.start()
    for _ in range(600):  # until it has pinned ad04 and waits for a slot for ad08
        if p._pins[a_slot]:
            break
        time.sleep(0.01)
    cm.unload_adapter("ad04")
    cm.load_adapter(many["ad04"], "ad04")  # again, new: it takes no slot the waiter holds
    p.release(held)  # slot 0 comes free: ad08 goes there
    waiter.join(timeout=60)
    (slots, modules), = results
    assert slots == [a_slot, NO_ADAPTER, p.slot_of["ad08"]] and modules == p.adapters["ad04"].modules.keys() | p.adapters["ad08"].modules.keys()
    assert all(torch.equal(t.lora_a[a_slot], f) for t, f in zip(p.targets.values(), a_factors))  # as it was pinned
    p.release(slots)
    assert p._pins.total() == 0 and not p._draining and "ad04" not in p.slot_of
    again, _ = p.acquire(["ad04"])  # the reloaded one pages in as any other
    p.release(again)
    assert p._pins.total() == 0


def test_the_host_tier_drops_the_adapter_used_least_recently_counting_calls_that_find_it_resident(model, tmp_path):
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    dirs = {n: make_adapter(model, cfg, seed=i, directory=str(tmp_path / n)) for i, n in enumerate("abcd")}
    torch._dynamo.reset()
    cm = fxlora.compile(model, adapters=dirs, max_loras=2, max_cpu_loras=2, max_rank=8)
    for name in "abcaadaab":  # "a" is read again from its directory at the fourth, then found in its slot
        slots, _ = cm.pool.acquire([name])
        cm.pool.release(slots)
    assert list(cm.pool.host) == ["a", "b"]  # "d", paged in before "a" was last used, was dropped for "b"


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_factors_packed_into_few_host_buffers_keep_their_values(data):
    """The host tier's copies of an adapter's factors (pinned on CUDA, in a few allocations):
    each equals its tensor, a group that fits in a buffer lies end to end in one, and no buffer
    holds more than ``PACK_BYTES`` but one tensor larger than that."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
    sizes = st.lists(st.tuples(st.integers(0, 24), st.integers(1, 40), st.sampled_from(dtypes)), min_size=1, max_size=4)
    shapes = data.draw(st.lists(sizes, min_size=1, max_size=6))
    groups, seed = [], 0
    for group in shapes:
        groups.append([])
        for rows, cols, dtype in group:
            seed += 1
            t = torch.randn(cols, rows, generator=torch.Generator().manual_seed(seed)).t()  # not contiguous
            groups[-1].append((t * 50).to(dtype) if dtype == torch.int8 else t.to(dtype))
    buffers = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_buffers, "PACK_BYTES", 2048)  # several buffers, and groups and tensors larger than one
        copies = host_buffers.packed_copies(groups, lambda n: buffers.append(torch.full((n,), 255, dtype=torch.uint8)) or buffers[-1])
    tensors = [t for group in groups for t in group]
    flat = [c for group in copies for c in group]
    assert [len(c) for c in copies] == [len(g) for g in groups]
    assert all(torch.equal(c, t) and c.dtype == t.dtype for c, t in zip(flat, tensors, strict=True))
    assert sum(b.numel() for b in buffers) < sum(t.nbytes for t in tensors) + 64 * len(tensors)
    for group in copies:  # end to end, each at the first address after the one before aligned to its dtype
        if sum(c.nbytes + c.element_size() for c in group) > 2048 - 64:
            continue
        held = [i for i, c in enumerate(group) if c.numel()]
        for before, i in zip(held, held[1:]):  # an empty tensor between them aligns too, for its dtype
            gap = group[i].data_ptr() - (group[before].data_ptr() + group[before].nbytes)
            assert 0 <= gap < max(c.element_size() for c in group[before + 1 : i + 1])
    for b in buffers:
        held = [c for c in flat if c.numel() and c.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()]
        assert b.numel() <= 2048 or len(held) <= 1


def test_an_adapter_laid_out_in_slot_order_pages_in_with_two_copies_a_stack(model, monkeypatch):
    """The host tier lays each adapter's factors out in slot order (on CUDA, as it pins them):
    an adapter that fills a layer's stacks (every member, rank ``max_rank``) goes into a slot
    in two copies a stack, one of partial targets in a copy per factor and a fill; either way
    the slot holds what it holds when written factor by factor."""
    linears = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {
        "full": make_adapter(model, LoraConfig(r=8, lora_alpha=16, target_modules=linears), seed=1, directory="", scale=0.3),
        "part": make_adapter(model, LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj", "up_proj"]), seed=2, directory="", scale=0.3),
    }
    cm = fxlora.compile(model, adapters=adapters, max_loras=1, max_rank=8, target_modules=linears)
    p = cm.pool

    def page_in(name):
        slots, _ = p.acquire([name])
        p.release(slots)
        tables = [t[:, 0].clone() for s in p._sets for t in (s.scaling, s.rank)]
        return [t[0].clone() for t in p.targets.values() for t in (t.lora_a, t.lora_b)] + tables

    expected = {name: page_in(name) for name in ("full", "part")}
    with monkeypatch.context() as m:  # as it lays adapters out on CUDA, into host memory here
        m.setattr(host_buffers, "pinned_bytes", lambda n: torch.empty(n, dtype=torch.uint8))
        m.setattr(pool.AdapterPool, "_on_cuda", lambda self: True)
        for name in adapters:
            p.adapters[name] = p._pinned(p.adapters[name])
    copies, foreach_copy = [], torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src, **kw: copies.append(len(dst)) or foreach_copy(dst, src, **kw))
    stacks = sum(len(s.stacks) for s in p._sets)
    for name in ("full", "part", "full"):
        got = page_in(name)
        assert all(torch.equal(g, e) for g, e in zip(got, expected[name], strict=True)), name
    assert stacks == 2 * model.config.num_hidden_layers and copies == [2 * stacks, 2 * 2 * model.config.num_hidden_layers, 2 * stacks]
