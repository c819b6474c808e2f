"""fxlora::grouped_mm: ATen's grouped GEMM behind an op of fxlora's own, against one matmul per
group, drawn over group sizes (empty groups and rows past the last offset included), widths
whose rows are no multiple of 16 bytes (zero-padded) and the dtypes Inductor cannot trace ATen's
op in; the op's schema and fake; and a graph compiled by
Inductor around it in float32, which ATen's own op does not compile in."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import DEVICE, TOL

from fxlora.ops.grouped_mm import grouped_mm, grouped_mm_reference, traceable_grouped_mm


def _case(data, dtype):
    groups = data.draw(st.integers(1, 5), label="groups")
    sizes = data.draw(st.lists(st.integers(0, 7), min_size=groups, max_size=groups), label="sizes")
    tail = data.draw(st.integers(0, 3), label="rows past the last group")
    fin, fout = data.draw(st.sampled_from([8, 16, 24, 5]), label="in"), data.draw(st.sampled_from([8, 32, 7]), label="out")  # odd: padded
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randn(sum(sizes) + tail, fin, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(groups, fin, fout, generator=gen) / fin**0.5).to(DEVICE, dtype)
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    return x, w, offsets, sum(sizes)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_op_matches_reference(data, dtype):
    x, w, offsets, grouped = _case(data, dtype)
    want = grouped_mm_reference(x.double(), w.double(), offsets)
    got = grouped_mm(x, w, offsets)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got[:grouped].double(), want[:grouped], **TOL[dtype])  # ATen leaves the tail unwritten


def test_schema_and_fake():
    x, w = torch.randn(6, 8, device=DEVICE), torch.randn(2, 8, 4, device=DEVICE)
    offsets = torch.tensor([2, 6], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.fxlora.grouped_mm.default, (x, w, offsets), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_inductor_compiles_it_where_aten_op_does_not(dtype):
    x, w = torch.randn(9, 16, device=DEVICE, dtype=dtype), torch.randn(3, 16, 8, device=DEVICE, dtype=dtype)
    offsets = torch.tensor([3, 3, 9], dtype=torch.int32, device=DEVICE)

    def fn(x, w, offsets):
        return traceable_grouped_mm(torch.relu(x), w, offsets) * 2

    with pytest.raises(Exception, match="BF16"):  # ATen's meta function admits only bfloat16
        torch.compile(lambda x, w, o: torch._grouped_mm(x, w, offs=o), backend="inductor", fullgraph=True)(x, w, offsets)
    got = torch.compile(fn, backend="inductor", fullgraph=True)(x, w, offsets)
    torch.testing.assert_close(got, fn(x, w, offsets), **TOL[dtype])
