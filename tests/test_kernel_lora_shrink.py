"""fxlora::lora_shrink: its reference against the shrink written token by token, its Triton
implementation (in Triton's interpreter without CUDA) against the reference on the entries
the expands read, the pair ``lora_shrink`` + ``lora_delta(shrunk=True)`` against the LoRA
delta, its registration (schema, fake, functionalization), and on CUDA the pair captured in
a CUDA graph around a base GEMM, the shrink forked onto the side stream.

Tolerances (TOL): float32 1e-5 relative and absolute; float16 1e-2; bfloat16 2e-2."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import TOL, draw_case, nan_workspace, pool_factors, reference

from fxlora.kernels import sgmv
from fxlora.ops import lora_shrink
from fxlora.ops.batch_info import token_segments
from fxlora.ops.delta_launcher import lora_workspace
from fxlora.ops.lora_delta import lora_delta_triton
from fxlora.ops.lora_shrink import lora_shrink_triton

needs_triton = pytest.mark.skipif(sgmv is None, reason="needs Triton")


def read_by_expand(token_slot: torch.Tensor, rank: torch.Tensor, slices: int, width: int) -> torch.Tensor:
    """The workspace entries an expand reads: rows with an adapter, in each slice the columns
    below the slot's rank there."""
    token_slot, rank = token_slot.cpu(), rank.cpu()
    mask = torch.zeros(token_slot.numel(), slices * width, dtype=torch.bool)
    for t, s in enumerate(token_slot.tolist()):
        for i in range(slices if s >= 0 else 0):
            mask[t, i * width : i * width + int(rank[s * slices + i])] = True
    return mask


def operands(case):
    return [case.a, case.b, case.scaling, case.rank], [case.token_slot, case.sorted_tokens, case.seg_start, case.seg_len, case.seg_slot]


@given(tokens=st.integers(1, 9), slices=st.integers(1, 3), max_rank=st.integers(1, 6), slots=st.integers(1, 3), data=st.data())
def test_reference_is_the_shrink_token_by_token(tokens, slices, max_rank, slots, data):
    """Each adapter row's entries below its ranks hold ``x @ A.T``; every other entry keeps
    what the workspace held."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=slots * slices, max_size=slots * slices))
    a, b, scaling, rank = pool_factors(gen, slots, slices, max_rank, 7, [5] * slices, ranks, torch.float32)
    x = torch.randn(tokens, 7, generator=gen)
    token_slot = torch.tensor(data.draw(st.lists(st.integers(-1, slots - 1), min_size=tokens, max_size=tokens)), dtype=torch.int32)
    batch = list(token_segments(token_slot, 1, slots))
    workspace = nan_workspace(x, a)
    lora_shrink(x, [a, b, scaling, rank], batch, workspace, slices)
    read = read_by_expand(token_slot, rank, slices, max_rank)
    expected = torch.stack([a[max(s, 0)] @ x[t] for t, s in enumerate(token_slot.tolist())])
    torch.testing.assert_close(workspace[read], expected[read], **TOL[torch.float32])
    assert workspace[~read].isnan().all()


@needs_triton
@settings(deadline=None)
@given(data=st.data())
def test_triton_implementation_writes_what_the_expands_read(data):
    case = draw_case(data)
    lora, batch = operands(case)
    slices = len(case.widths)
    want = nan_workspace(case.x.cpu(), case.a.cpu())
    lora_shrink(case.x.cpu(), [t.cpu() for t in lora], [t.cpu() for t in batch], want, slices)
    got = nan_workspace(case.x, case.a)
    lora_shrink_triton(case.x, lora, batch, got, slices)
    read = read_by_expand(case.token_slot, case.rank, slices, case.a.shape[1] // slices)
    torch.testing.assert_close(got.cpu()[read], want[read], **TOL[case.dtype])


@needs_triton
@settings(deadline=None)
@given(data=st.data())
def test_the_pair_adds_the_lora_delta(data):
    """``lora_shrink``, then ``lora_delta(..., shrunk=True)`` onto one output per slice: the
    reference delta; rows without an adapter untouched. The delta alone, on scratch no shrink
    wrote, reads that scratch."""
    case = draw_case(data)
    lora, batch = operands(case)
    starts = [sum(case.widths[:i]) for i in range(len(case.widths))]
    parts = [case.y[:, c : c + w].clone() for c, w in zip(starts, case.widths, strict=True)]
    unshrunk = [p.clone() for p in parts]
    workspace = nan_workspace(case.x, case.a)
    lora_shrink_triton(case.x, lora, batch, workspace, len(case.widths))
    lora_delta_triton(case.x, parts, lora, batch, workspace, shrunk=True)
    case.parts = parts
    case.check()
    # the delta expands the workspace it is given, without a shrink of its own
    lora_delta_triton(case.x, unshrunk, lora, batch, nan_workspace(case.x, case.a), shrunk=True)
    read = read_by_expand(case.token_slot, case.rank, len(case.widths), case.a.shape[1] // len(case.widths))
    assert torch.cat(unshrunk, 1).isnan().any().item() == read.any().item()


def test_schema_fake_and_functionalization():
    gen = torch.Generator().manual_seed(0)
    a, b, scaling, rank = pool_factors(gen, 2, 2, 3, 5, [4, 2], [3, 1, 0, 2], torch.float32)
    x = torch.randn(2, 3, 5, generator=gen)
    token_slot = torch.tensor([0, 1, -1, 1, 0, 0], dtype=torch.int32)
    batch = list(token_segments(token_slot, 1, 2))
    args = (x, [a, b, scaling, rank], batch, lora_workspace(x, a), 2)
    torch.library.opcheck(
        torch.ops.fxlora.lora_shrink.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"),
    )
    schema = torch.ops.fxlora.lora_shrink.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == ["workspace"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_pair_in_a_cuda_graph_around_a_gemm(dtype):
    """Captured: the shrink forks onto the side stream before the base GEMM, the delta joins
    it before its expand; the shrink's input, freed meanwhile, is not handed to another
    allocation; replays with new inputs and slots give the reference result."""
    gen = torch.Generator().manual_seed(0)
    tokens, d_in, widths, slots, max_rank = 48, 256, (192, 64), 4, 16
    ranks = [16, 8, 0, 16, 4, 16, 12, 2]
    a, b, scaling, rank = (t.cuda() for t in pool_factors(gen, slots, 2, max_rank, d_in, widths, ranks, dtype))
    w = (torch.randn(sum(widths), d_in, generator=gen) / d_in**0.5).to(dtype).cuda()
    x = torch.empty(tokens, d_in, dtype=dtype, device="cuda")
    slot_ids = torch.empty(tokens, dtype=torch.int32, device="cuda")
    workspace = lora_workspace(x, a)

    reused = []

    def step():
        batch = list(torch.ops.fxlora.batch_info(slot_ids, x, 1, slots))
        xi = x * 1  # an intermediate freed right after the shrink, as a graph may free it
        torch.ops.fxlora.lora_shrink(xi, [a, b, scaling, rank], batch, workspace, 2)
        freed = xi.data_ptr()
        del xi
        reused.append(torch.empty_like(x).data_ptr() == freed)  # its memory, to the next allocation?
        y = F.linear(torch.relu(x), w)  # the base: reads x, does not need the shrink
        parts = list(y.split(widths, 1))
        torch.ops.fxlora.lora_delta(x, parts, [a, b, scaling, rank], batch, workspace, True)
        return y

    def fill(seed):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(tokens, d_in, generator=g).to(dtype))
        slot_ids.copy_(torch.randint(-1, slots, (tokens,), generator=g))

    fill(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert reused[0] and not reused[-1]  # eagerly the next allocation takes it; captured, it waits for the side stream
    for seed in (2, 3):
        fill(seed)
        graph.replay()
        base = F.linear(torch.relu(x), w).cpu()
        want = reference(base, x.cpu(), a.cpu(), b.cpu(), scaling.cpu(), rank.cpu(), slot_ids.cpu(), widths)
        torch.testing.assert_close(out.cpu().float(), want.float(), **TOL[dtype])
