"""fxlora::decode_attention: the Triton kernel against its reference (transformers' SDPA
attention over keys and values expanded to the query heads), drawn over head groupings,
head sizes that are not powers of two, cache lengths that are not multiples of the block,
left padding, a sliding window and rows whose context ends early. On a machine without CUDA
the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), float32 and
float16."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lora_cases import TOL

from fxlora.ops.decode_attention import decode_attention, decode_attention_reference

kernel = pytest.importorskip("fxlora.kernels.decode_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.float16, torch.bfloat16]


@given(data=st.data())
def test_kernel_matches_reference(data):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    rows, kv_heads = data.draw(st.integers(1, 3), label="rows"), data.draw(st.integers(1, 2), label="kv_heads")
    group = data.draw(st.sampled_from([1, 2, 4]), label="group")
    dim = data.draw(st.sampled_from([16, 24, 32]), label="dim")
    columns = data.draw(st.integers(1, 100), label="columns")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    q = torch.randn(rows, 1, kv_heads * group, dim, generator=gen).transpose(1, 2)  # strided, as the model's
    k, v = (torch.randn(rows, kv_heads, columns, dim, generator=gen) for _ in range(2))
    masked = torch.finfo(dtype).min
    mask = torch.full((rows, 1, 1, columns), masked)
    for r in range(rows):  # each row: padding, then its context up to its own end, maybe a window
        end = data.draw(st.integers(1, columns), label="end")
        start = data.draw(st.integers(0, end - 1), label="start")
        mask[r, 0, 0, start:end] = 0.0
    q, k, v, mask = (t.to(dtype) for t in (q, k, v, mask))
    scale = dim**-0.5
    expected = decode_attention_reference(q.float(), k.float(), v.float(), mask.float(), scale)
    got = kernel.decode_attention(q.to(DEVICE).contiguous(), k.to(DEVICE), v.to(DEVICE), mask.to(DEVICE), scale, masked)
    torch.testing.assert_close(got.cpu().float(), expected, **TOL[dtype])


def test_op_fake_and_schema():
    q = torch.randn(2, 1, 4, 16).transpose(1, 2)
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.zeros(2, 1, 1, 9)
    assert decode_attention(q, k, v, mask, 0.25).shape == (2, 4, 1, 16)
    torch.library.opcheck(torch.ops.fxlora.decode_attention.default, (q, k, v, mask, 0.25), test_utils=("test_schema", "test_faketensor"))


def test_boolean_mask_on_the_kernel_path():
    from fxlora.ops.decode_attention import decode_attention_triton

    q = torch.randn(2, 4, 1, 16)
    k, v = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    seen = torch.zeros(2, 1, 1, 40, dtype=torch.bool)
    seen[0, ..., :7], seen[1, ..., 3:40] = True, True
    expected = decode_attention_reference(q, k, v, seen, 0.25)
    got = decode_attention_triton(*(t.to(DEVICE) for t in (q, k, v, seen)), 0.25)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_nothing_reads_zeros():
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.full((2, 1, 1, 40), torch.finfo(torch.float32).min)
    mask[0, ..., 5:9] = 0.0
    got = kernel.decode_attention(*(t.to(DEVICE) for t in (q, k, v, mask)), 0.25, torch.finfo(torch.float32).min).cpu()
    torch.testing.assert_close(got[0], decode_attention_reference(q, k, v, mask, 0.25)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
