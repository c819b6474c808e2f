"""fxlora::lora_grouped_delta against each row's LoRA delta for its group: rows of group ``g``
(segments of the grouped GEMM's rows by ``offsets``) with slot ``s`` add
``scaling[s] · (x @ A[s, g]ᵀ) @ B[s, g]ᵀ``; rows without an adapter, and rows past the last
offset, keep their values. The reference, and the composition over ``(slot, group)`` pairs (the
CUDA implementation; on the CPU its ``lora_delta`` is the reference's)."""

import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import nan_workspace

from fxlora.ops.lora_delta import add_pair_deltas
from fxlora.ops.lora_grouped_delta import lora_grouped_delta, lora_grouped_delta_composed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    groups = data.draw(st.integers(1, 4), label="groups")
    sizes = data.draw(st.lists(st.integers(0, 5), min_size=groups, max_size=groups), label="sizes")
    tail = data.draw(st.integers(0 if sum(sizes) else 1, 2), label="rows past the last offset")  # a graph has rows
    fin, fout, slots, max_rank = (data.draw(st.integers(1, n)) for n in (9, 7, 3, 4))
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=slots, max_size=slots), label="ranks")
    rows = sum(sizes) + tail
    row_slot = data.draw(st.lists(st.integers(-1, slots - 1), min_size=rows, max_size=rows), label="slots")
    x, y = torch.randn(rows, fin, generator=gen), torch.randn(rows, fout, generator=gen)
    lora_a = torch.randn(slots, groups, max_rank, fin, generator=gen)  # past a slot's rank: left as noise
    lora_b = torch.randn(slots, groups, fout, max_rank, generator=gen)
    scaling, rank = torch.rand(slots, generator=gen) + 0.5, torch.tensor(ranks, dtype=torch.int32)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    expected = y.clone()
    group = 0
    for i, s in enumerate(row_slot):
        while group < groups and i >= offsets[group]:
            group += 1
        if s >= 0 and group < groups:
            r = ranks[s]
            expected[i] += scaling[s] * (x[i] @ lora_a[s, group, :r].T) @ lora_b[s, group, :, :r].T
    return (x, y, offsets, torch.tensor(row_slot, dtype=torch.int32), [lora_a, lora_b, scaling, rank]), expected


@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_reference_adds_each_rows_delta_for_its_group(data):
    args, expected = case(data)
    y = args[1].clone()
    torch.testing.assert_close(lora_grouped_delta(*args), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(args[1], y)  # functional: the GEMM's output is left as it was


@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_composition_matches(data):
    args, expected = case(data)
    on = [a.to(DEVICE) if isinstance(a, torch.Tensor) else [t.to(DEVICE) for t in a] for a in args]
    with mock.patch.object(sys.modules[add_pair_deltas.__module__], "lora_workspace", nan_workspace):  # scratch holds anything
        torch.testing.assert_close(lora_grouped_delta_composed(*on).cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_op_is_the_composition():
    args, expected = case_fixed()
    on = [a.cuda() if isinstance(a, torch.Tensor) else [t.cuda() for t in a] for a in args]
    torch.testing.assert_close(lora_grouped_delta(*on).cpu(), expected, rtol=1e-4, atol=1e-4)


def case_fixed():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 8, generator=gen), torch.randn(7, 6, generator=gen)
    lora_a, lora_b = torch.randn(2, 3, 4, 8, generator=gen), torch.randn(2, 3, 6, 4, generator=gen)
    scaling, rank = torch.tensor([0.5, 2.0]), torch.tensor([4, 2], dtype=torch.int32)
    offsets, row_slot = torch.tensor([2, 2, 6], dtype=torch.int32), torch.tensor([0, 1, -1, 0, 1, 1, 0], dtype=torch.int32)
    expected = y.clone()
    for i, g in enumerate([0, 0, 2, 2, 2, 2, 3]):
        s = int(row_slot[i])
        if s >= 0 and g < 3:
            r = int(rank[s])
            expected[i] += scaling[s] * (x[i] @ lora_a[s, g, :r].T) @ lora_b[s, g, :, :r].T
    return (x, y, offsets, row_slot, [lora_a, lora_b, scaling, rank]), expected


def test_schema_and_fake():
    args, _ = case_fixed()
    torch.library.opcheck(torch.ops.fxlora.lora_grouped_delta.default, args, test_utils=("test_schema", "test_faketensor"))
