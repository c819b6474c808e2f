"""fxlora::paged_decode_attention: the Triton kernel reading keys and values through a block
table against its reference (the pages gathered in each row's order, then transformers' SDPA
attention), drawn over head groupings, key and value head sizes that are not powers of two
(and differ), pages smaller and larger than the kernel's block of columns, permuted tables
whose unused entries name any block, and rows of their own lengths; pages the mask hides
are never read. On a machine without CUDA the kernel runs in Triton's interpreter (conftest
sets TRITON_INTERPRET=1), float32 and float16."""

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lora_cases import TOL

from fxlora.ops.paged_attention import (
    gather_pages,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)

kernel = pytest.importorskip("fxlora.kernels.decode_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.float16, torch.bfloat16]
MASKED = torch.finfo(torch.float32).min


def paged_case(gen, rows, kv_heads, group, dim, v_dim, block_size, max_blocks, spare):
    """Pages for ``rows`` rows of ``max_blocks`` blocks and ``spare`` more, a table naming them
    in a random order, and a query."""
    blocks = rows * max_blocks + spare
    k_pages = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    v_pages = torch.randn(blocks, block_size, kv_heads, v_dim, generator=gen)
    table = torch.randperm(blocks, generator=gen)[: rows * max_blocks].view(rows, max_blocks).to(torch.int32)
    q = torch.randn(rows, 1, kv_heads * group, dim, generator=gen).transpose(1, 2)  # strided, as the model's
    return q, k_pages, v_pages, table


@given(data=st.data())
def test_kernel_matches_reference(data):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    rows, kv_heads = data.draw(st.integers(1, 3), label="rows"), data.draw(st.integers(1, 2), label="kv_heads")
    group = data.draw(st.sampled_from([1, 2, 4]), label="group")
    dim = data.draw(st.sampled_from([16, 24, 32]), label="dim")
    v_dim = data.draw(st.sampled_from([dim, 16, 40]), label="v_dim")
    block_size = data.draw(st.sampled_from([1, 4, 16, 32]), label="block_size")
    block_n = data.draw(st.sampled_from([16, kernel.BLOCK_N]), label="BLOCK_N")  # a page may span several steps
    max_blocks = data.draw(st.integers(1, max(1, 96 // block_size)), label="max_blocks")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    q, k_pages, v_pages, table = paged_case(gen, rows, kv_heads, group, dim, v_dim, block_size, max_blocks, spare=3)
    columns = max_blocks * block_size
    mask = torch.full((rows, 1, 1, columns), MASKED)
    for r in range(rows):  # each row: padding, then its context up to its own length, maybe a window
        end = data.draw(st.integers(1, columns), label="length")
        start = data.draw(st.integers(0, end - 1), label="start")
        mask[r, 0, 0, start:end] = 0.0
        unused = torch.arange(max_blocks) * block_size >= end
        table[r, unused] = torch.randint(0, k_pages.shape[0], (int(unused.sum()),), generator=gen, dtype=torch.int32)
    q, k_pages, v_pages, mask = (t.to(dtype) for t in (q, k_pages, v_pages, mask))
    scale = dim**-0.5
    expected = paged_decode_attention_reference(q.float(), k_pages.float(), v_pages.float(), table, mask.float(), scale)
    args = (t.to(DEVICE) for t in (q.contiguous(), k_pages, v_pages, table, mask))
    with mock.patch.object(kernel, "BLOCK_N", block_n):
        got = kernel.paged_decode_attention(*args, scale, torch.finfo(dtype).min)
    torch.testing.assert_close(got.cpu().float(), expected, **TOL[dtype])


def test_ops_fake_and_schema():
    pages, table = torch.randn(7, 4, 2, 16), torch.tensor([[3, 0, 6], [1, 5, 2]], dtype=torch.int32)
    assert gather_pages(pages, table).shape == (2, 2, 12, 16)
    torch.library.opcheck(torch.ops.fxlora.gather_pages.default, (pages, table), test_utils=("test_schema", "test_faketensor"))
    q = torch.randn(2, 1, 4, 16).transpose(1, 2)
    v_pages, mask = torch.randn(7, 4, 2, 24), torch.zeros(2, 1, 1, 12)
    assert paged_decode_attention(q, pages, v_pages, table, mask, 0.25).shape == (2, 4, 1, 24)
    torch.library.opcheck(torch.ops.fxlora.paged_decode_attention.default, (q, pages, v_pages, table, mask, 0.25),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_boolean_mask_on_the_kernel_path():
    q, k_pages, v_pages, table = paged_case(torch.Generator().manual_seed(0), 2, 2, 2, 16, 16, 4, 10, spare=2)
    seen = torch.zeros(2, 1, 1, 40, dtype=torch.bool)
    seen[0, ..., :7], seen[1, ..., 3:40] = True, True
    expected = paged_decode_attention_reference(q, k_pages, v_pages, table, seen, 0.25)
    got = paged_decode_attention_triton(*(t.to(DEVICE) for t in (q, k_pages, v_pages, table, seen)), 0.25)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_nothing_reads_zeros_and_hidden_pages_are_never_read():
    q, k_pages, v_pages, table = paged_case(torch.Generator().manual_seed(1), 2, 2, 2, 16, 16, 4, 10, spare=2)
    mask = torch.full((2, 1, 1, 40), MASKED)
    mask[0, ..., 5:9], mask[0, ..., 20:23] = 0.0, 0.0  # the columns between them are read by no one
    visible = torch.zeros(k_pages.shape[:2], dtype=torch.bool)  # (block, slot)
    for n in [*range(5, 9), *range(20, 23)]:
        visible[table[0, n // 4], n % 4] = True
    poisoned = [p.masked_fill(~visible[..., None, None], float("nan")) for p in (k_pages, v_pages)]  # never-written memory
    got = kernel.paged_decode_attention(*(t.to(DEVICE) for t in (q, *poisoned, table, mask)), 0.25, MASKED).cpu()
    expected = paged_decode_attention_reference(q, k_pages, v_pages, table, mask, 0.25)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
