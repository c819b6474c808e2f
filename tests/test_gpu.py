"""CUDA-only checks, run by scripts/gpu_tests.sh on a GPU machine: end-to-end against the
PEFT oracle in every dtype, no host synchronisation, CUDA-graph capture and replay with
changing adapter assignments and swapped weights, and the kernels at real sizes."""

import copy

import pytest
import torch
from peft import LoraConfig

import fxlora
from fxlora.ops import LoraWeights, batch_info, lora_embedding, lora_linear, lora_linear_fused
from fxlora.ops.delta_launcher import lora_workspace
from fxlora.ops.lora_delta import lora_delta_reference
from fxlora.ops.lora_linear import lora_linear_triton
from fxlora.testing import assert_matches_peft, lora_module_names, make_adapter, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_end_to_end_on_cuda(family, dtype, tmp_path):
    torch._dynamo.reset()
    cpu_model = tiny_model(family, seed=1, hidden_size=64, intermediate_size=160, vocab_size=200)
    configs = {
        "a": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        "b": LoraConfig(r=16, lora_alpha=8, use_rslora=True, target_modules=lora_module_names(cpu_model)[:3]),
        "c": LoraConfig(r=4, target_modules=["embed_tokens", "lm_head"]),
    }
    adapters = {
        n: make_adapter(cpu_model, c, seed=i, directory=str(tmp_path / n)) for i, (n, c) in enumerate(configs.items())
    }
    model = copy.deepcopy(cpu_model).to("cuda", dtype)
    cm = fxlora.compile(model, adapters=adapters, max_loras=4, max_rank=16)
    ids = torch.randint(3, 200, (6, 12), device="cuda")
    mask = torch.ones_like(ids)
    mask[2, :5] = 0
    names = ["a", None, "b", "c", "a", "b"]
    assert_matches_peft(cm, model, adapters, names, input_ids=ids, attention_mask=mask)


def _case(tokens, d_in, d_out, slots, rank, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=gen)
    x = torch.randn(tokens, d_in, **kw).to(dtype)
    w = (torch.randn(d_out, d_in, **kw) / d_in**0.5).to(dtype)
    a = (torch.randn(slots, rank, d_in, **kw) / d_in**0.5).to(dtype)
    b = (torch.randn(slots, d_out, rank, **kw) / rank**0.5).to(dtype)
    scaling = torch.rand(slots, **kw) + 0.5
    ranks = torch.full((slots,), rank, dtype=torch.int32, device="cuda")
    return x, w, a, b, scaling, ranks


def _expected(x, w, a, b, scaling, ranks, slot_ids):
    token_slot = slot_ids.repeat_interleave(x.shape[0] // slot_ids.numel())
    y = torch.nn.functional.linear(x.double(), w.double())
    lora_delta_reference(y, x.double(), LoraWeights(a.double(), b.double(), scaling.double(), ranks), token_slot)
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, rank", [(1, 16), (8, 64), (16, 64), (32, 16), (64, 16), (64, 64), (2048, 16), (2048, 64)])
def test_lora_linear_at_real_sizes(tokens, rank, dtype):
    x, w, a, b, scaling, ranks = _case(tokens, 4096, 4096, 8, rank, dtype)
    slot_ids = torch.randint(-1, 8, (tokens,), device="cuda", dtype=torch.int32)
    out = lora_linear(x, w, None, [a, b, scaling, ranks], batch_info(slot_ids, x, 1, 8), lora_workspace(x, a))
    ref = _expected(x, w, a, b, scaling, ranks, slot_ids)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, slots", [(37, 1000), (2048, 1000), (2048, 3000)])
def test_lora_linear_with_a_large_pool(tokens, slots, dtype):
    """Pools far larger than a decode batch: a compact segment list (one entry per token) at
    37 tokens and at 2048 with 3000 slots, the per-slot list at 2048 with 1000; at 2048
    tokens longer than the segment search reads in one step (two steps), most segments one
    token long: a decode pattern at prefill size."""
    x, w, a, b, scaling, ranks = _case(tokens, 1024, 1024, slots, 16, dtype, seed=slots)
    slot_ids = torch.randint(-1, slots, (tokens,), device="cuda", dtype=torch.int32)
    out = lora_linear(x, w, None, [a, b, scaling, ranks], batch_info(slot_ids, x, 1, slots), lora_workspace(x, a))
    ref = _expected(x, w, a, b, scaling, ranks, slot_ids)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [5, 64, 2048])
@pytest.mark.parametrize("widths", [(4096, 1024, 1024), (1536, 576)], ids=["qkv", "mla"])
@pytest.mark.parametrize("members", [False, True], ids=["one_output", "fused_members"])
def test_multi_slice_mixed_ranks_at_real_sizes(widths, members, tokens, dtype):
    """Several slices in one launch, each slot and slice with its own rank below ``max_rank``
    (not multiples of 8) and ``B``'s padding columns filled with finite noise: the expands
    read them in 16-byte pieces, and they must not reach the output. The slices are the
    columns of one output, or (``fxlora::lora_linear_fused``) each member's own output."""
    slots, max_rank, slices, d_in = 6, 64, len(widths), 2048
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", generator=gen)
    x = torch.randn(tokens, d_in, **kw).to(dtype)
    w = (torch.randn(sum(widths), d_in, **kw) / d_in**0.5).to(dtype)
    ranks = torch.randint(1, max_rank + 1, (slots * slices,), **kw).int()
    ranks[1] = 0  # a slot that does not touch the first slice
    a = torch.randn(slots, slices * max_rank, d_in, **kw) / d_in**0.5
    for i, r in enumerate(ranks.tolist()):  # the pool's A: zero past each rank
        s, sl = divmod(i, slices)
        a[s, sl * max_rank + r : (sl + 1) * max_rank] = 0
    a, b = a.to(dtype), (torch.randn(slots, sum(widths), max_rank, **kw) / max_rank**0.5).to(dtype)
    scaling = torch.rand(slots * slices, **kw) + 0.5
    slot_ids = torch.randint(-1, slots, (tokens,), **kw).int()
    meta = batch_info(slot_ids, x, 1, slots)
    workspace = torch.empty(tokens, slices * max_rank, device="cuda")
    if members:
        outs = lora_linear_fused(x, list(w.split(widths)), [None] * slices, [a, b, scaling, ranks], meta)
        out = torch.cat(outs, -1)
    else:
        out = lora_linear_triton(x, w, None, [a, b, scaling, ranks], meta, workspace, slice_widths=widths)
    ref = torch.nn.functional.linear(x.double(), w.double())
    col = 0
    for i, width in enumerate(widths):
        part = ref[:, col : col + width]  # a view: the reference adds into ref
        factors = LoraWeights(
            a[:, i * max_rank : (i + 1) * max_rank].double(), b[:, col : col + width].double(),
            scaling[i::slices].double(), ranks[i::slices].contiguous(),
        )
        lora_delta_reference(part, x.double(), factors, slot_ids)
        col += width
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], err


@pytest.mark.parametrize("tokens", [4, 64])  # the per-token expand, the segmented one
def test_no_host_synchronisation(tokens):
    x, w, a, b, scaling, ranks = _case(tokens, 256, 320, 4, 16, torch.bfloat16)
    ids = torch.randint(0, 100, (4, 8), device="cuda")
    table = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    ea, eb = torch.randn(4, 16, 100, device="cuda", dtype=torch.bfloat16), b[:, :256]
    slot_ids = torch.tensor([0, -1, 3, 1], dtype=torch.int32, device="cuda")
    lora, embedding_lora = [a, b, scaling, ranks], [ea, eb.contiguous(), scaling, ranks]
    lora_linear(x, w, None, lora, batch_info(slot_ids, x, 1, 4), lora_workspace(x, a))  # warm up: compile kernels
    lora_embedding(ids, table, embedding_lora, batch_info(slot_ids, ids, 0, 4))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_linear(x, w, None, lora, batch_info(slot_ids, x, 1, 4), lora_workspace(x, a))
        lora_embedding(ids, table, embedding_lora, batch_info(slot_ids, ids, 0, 4))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("rows, tokens_per_row", [(4, 1), (16, 1), (16, 7)])
def test_cuda_graph_replay_with_new_assignments(rows, tokens_per_row):
    slots = 8
    x, w, a, b, scaling, ranks = _case(rows * tokens_per_row, 512, 768, slots, 16, torch.float32)
    slot_ids = torch.zeros(rows, dtype=torch.int32, device="cuda")
    lora = [a, b, scaling, ranks]
    lora_linear(x, w, None, lora, batch_info(slot_ids, x, 1, slots), lora_workspace(x, a))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_linear(x, w, None, lora, batch_info(slot_ids, x, 1, slots), lora_workspace(x, a))
    gen = torch.Generator().manual_seed(0)
    assignments = [[-1] * rows, [5] * rows] + [
        torch.randint(-1, slots, (rows,), generator=gen).tolist() for _ in range(4)
    ]
    for i, assignment in enumerate(assignments):
        slot_ids.copy_(torch.tensor(assignment, dtype=torch.int32))
        if i == 3:  # hot-swap a slot's weights in place, as load_adapter does
            a[2].copy_(torch.randn_like(a[2]) / 512**0.5)
        graph.replay()
        ref = _expected(x, w, a, b, scaling, ranks, slot_ids)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (assignment, err)
