"""The hoist pass and the arena: allocations of traced graphs become views of one planned
buffer; outputs stay what they were, buffers alive at the same time never overlap, and the
arena is smaller than the allocations side by side."""

from __future__ import annotations

import itertools

import pytest
import torch

import fxlora
from fxlora.adapters import AdapterPool
from fxlora.compiler.arena import Arena
from fxlora.compiler.context import PassContext
from fxlora.passes.hoist import hoist


def compiled_with_arena(fn):
    """``fn`` traced by Dynamo with only the hoist pass; returns it compiled and its arena."""
    arena = Arena()

    def backend(gm, example_inputs):
        return hoist(gm, PassContext(AdapterPool(1, 1, []), arena=arena))

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=True), arena


def many_buffers(x):
    n, d = x.shape
    a = torch.zeros(n, d)  # dies after `b`
    a += x
    b = a * 2
    c = torch.full((n, d), 3.0)  # lives while d is made: may reuse a's bytes, not b's
    e = torch.empty_like(x).copy_(b + c)
    view = e[: n // 2]  # a view keeps e alive
    f = x.new_zeros((n, d))
    f.add_(1)
    g = torch.arange(n, dtype=torch.float32)
    h = torch.ones(d) * g.sum()
    return view.sum(0) + f.sum(0) + h


def escaping(x):
    keep = torch.zeros_like(x)  # returned: must stay a real allocation
    keep.add_(x)
    scratch = torch.empty(x.shape[0], 4)
    scratch.fill_(2.0)
    return keep, scratch.sum()


def sites(arena):
    return [(p, s) for p in arena.plans for s in p.placed]


def test_outputs_unchanged_and_live_buffers_disjoint():
    fn, arena = compiled_with_arena(many_buffers)
    for rows in (5, 9, 3):  # measure over shapes, the largest included
        fn(torch.randn(rows, 7))
    arena.plan(torch.device("cpu"))
    placed = sites(arena)
    assert len(placed) == 6  # zeros, full, empty_like, new_zeros, arange, ones
    for (p1, s1), (p2, s2) in itertools.combinations(placed, 2):
        if p1 is p2 and s1.start <= s2.end and s2.start <= s1.end:  # alive together
            assert s1.offset + s1.capacity <= s2.offset or s2.offset + s2.capacity <= s1.offset
    assert 0 < arena.nbytes < arena.replaced_bytes
    for rows in (9, 4, 12):  # 12 rows is more than measured: those sites allocate as before
        x = torch.randn(rows, 7)
        torch.testing.assert_close(fn(x), many_buffers(x), rtol=0, atol=0)


def test_arena_memory_is_actually_used():
    fn, arena = compiled_with_arena(many_buffers)
    fn(torch.randn(6, 7))
    arena.plan(torch.device("cpu"))
    arena.buffer.fill_(77)  # garbage left by an earlier graph must not leak into results
    x = torch.randn(6, 7)
    torch.testing.assert_close(fn(x), many_buffers(x), rtol=0, atol=0)
    assert (arena.buffer != 77).any()  # the graph's buffers were the arena's bytes
    arena.buffer = None  # without the buffer the graph must not silently depend on it
    torch.testing.assert_close(fn(x), many_buffers(x), rtol=0, atol=0)


def test_allocations_reaching_the_output_are_left_alone():
    fn, arena = compiled_with_arena(escaping)
    fn(torch.randn(3, 4))
    arena.plan(torch.device("cpu"))
    assert len(sites(arena)) == 1  # only the scratch
    x = torch.randn(3, 4)
    first, _ = fn(x)
    second, total = fn(torch.randn(3, 4))
    torch.testing.assert_close(first, x)  # not overwritten by the next call
    assert total.item() == 24.0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_real_model_decode_runs_from_the_arena(family):
    from peft import LoraConfig

    from fxlora.testing import lora_module_names, make_adapter, tiny_model

    torch._dynamo.reset()
    model = tiny_model(family)
    adapters = {"a": make_adapter(model, LoraConfig(r=4, target_modules=lora_module_names(model)), seed=0, directory="")}
    cm = fxlora.compile(model, adapters, max_batch_size=4, max_len=16)
    ids = torch.randint(3, 96, (3, 5))
    before = cm.generate(ids, adapter_names=["a", None, "a"], max_new_tokens=6, eos_token_id=())
    arena = cm.backend.arena
    assert 0 < arena.nbytes < arena.replaced_bytes
    assert "arena:" in cm.explain()
    arena.buffer.fill_(255)  # stale bytes from another call change nothing
    after = cm.generate(ids, adapter_names=["a", None, "a"], max_new_tokens=6, eos_token_id=())
    assert torch.equal(before, after)
