"""fxlora::moe_lora: its composition (grouped GEMMs + fxlora::lora_delta over (slot, expert)
segments, the CUDA implementation and what Inductor compiles) against the PyTorch
reference, over routing, expert counts, widths that are not multiples of the block sizes,
ranks, gates, layouts and batch mixes including all-None and all-one-adapter; the
composition compiled by Inductor; quantised experts weights. On a machine without CUDA the
kernels run in Triton's interpreter, float32 and float16."""

import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_cases import nan_workspace

from fxlora.ops import batch_info
from fxlora.ops.lora_delta import add_pair_deltas
from fxlora.ops.moe_lora import GATE_PARAMS, GATES, ExpertsLayout, moe_lora, moe_lora_composed

pytest.importorskip("fxlora.kernels.sgmv")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=2e-2, atol=2e-2), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the dtype's tolerance; in half precision the absolute part scales with the
    output's largest entry, since the composition rounds its intermediates (a rank-1 delta
    of scale 1.5 reaches ~30) and a small entry inherits the rounding of large terms."""
    tol = dict(TOL[dtype])
    if dtype != torch.float32:
        tol["atol"] *= max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float().cpu(), want.float(), **tol)


PARAMS = {"alpha": 1.702, "limit": 7.0, "gate_cap": 1.702, "up_cap": 7.0}


def layout(gate: str, transposed: bool, identity: int = 0) -> str:
    """The op's layout operand for ``gate``, with GPT-OSS's parameters where it takes some."""
    return ExpertsLayout(transposed, gate, "silu", tuple(PARAMS[p] for p in GATE_PARAMS[gate]), identity > 0).spec


def make_case(gen, tokens, top_k, experts, hidden, inter, slots, max_rank, ranks, gate, transposed, bias, dtype, identity=0):
    """A routed batch; with ``identity`` experts (LongCat-Flash's) past the ``experts`` the down
    projection has, which the up projection holds parameters (unused) and LoRA for too."""
    up_out = inter if gate == "act" else 2 * inter

    def w(*shape, fan):
        return (torch.randn(*shape, generator=gen) / fan**0.5).to(dtype)

    routed = experts + identity
    up = w(routed, hidden, up_out, fan=hidden) if transposed else w(routed, up_out, hidden, fan=hidden)
    down = w(experts, inter, hidden, fan=inter) if transposed else w(experts, hidden, inter, fan=inter)
    biases = (w(routed, up_out, fan=4), w(experts, hidden, fan=4)) if bias else (None, None)

    def pool(fin, fout, which, count):
        a = w(slots, count, max_rank, fin, fan=fin)
        b = w(slots, count, fout, max_rank, fan=max_rank)
        rank = torch.tensor(ranks[which], dtype=torch.int32)
        for s in range(slots):
            a[s, :, rank[s] :] = 0
            b[s, :, :, rank[s] :] = 0
        return a, b, torch.rand(slots, generator=gen) + 0.5, rank

    hidden_states = torch.randn(tokens, hidden, generator=gen).to(dtype)
    scores = torch.rand(tokens, routed, generator=gen)
    weights, index = scores.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return hidden_states, index, weights, up, biases[0], down, biases[1], pool(hidden, up_out, 0, routed), pool(inter, hidden, 1, experts)


def run(fn, case, slot_ids, slots, gate, transposed, lora_on, identity=0):
    x, index, weights, up, up_b, down, down_b, up_lora, down_lora = case
    device_case = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (x, index, weights, up, up_b, down, down_b)]
    lora = [[t.to(DEVICE) for t in factors] if on else [] for on, factors in zip(lora_on, (up_lora, down_lora))]
    token_slot = batch_info(slot_ids.to(DEVICE), device_case[0], 1, slots)[0]
    module = sys.modules[add_pair_deltas.__module__]  # the shrink's scratch as a graph may hand it over
    with mock.patch.object(module, "lora_workspace", nan_workspace):
        return fn(*device_case, *lora, token_slot, layout(gate, transposed, identity))


@settings(deadline=None)
@given(
    tokens=st.integers(1, 33),
    experts=st.integers(1, 6),
    hidden=st.integers(3, 40),
    inter=st.integers(2, 24),
    slots=st.integers(1, 4),
    max_rank=st.integers(1, 8),
    gate=st.sampled_from(GATES),
    transposed=st.booleans(),
    bias=st.booleans(),
    lora_on=st.sampled_from([(True, True), (True, False), (False, True)]),
    dtype=st.sampled_from(DTYPES),
    identity=st.sampled_from([0, 0, 1, 2]),
    data=st.data(),
)
def test_composition_matches_reference(tokens, experts, hidden, inter, slots, max_rank, gate, transposed, bias, lora_on, dtype, identity, data):
    top_k = data.draw(st.integers(1, experts + identity), label="top_k")
    ranks = [data.draw(st.lists(st.integers(0, max_rank), min_size=slots, max_size=slots), label="ranks") for _ in range(2)]
    mix = data.draw(st.sampled_from(["mixed", "none", "one"]), label="mix")
    if mix == "mixed":
        rows = data.draw(st.lists(st.integers(-1, slots - 1), min_size=tokens, max_size=tokens), label="rows")
    else:
        rows = [-1 if mix == "none" else slots - 1] * tokens
    slot_ids = torch.tensor(rows, dtype=torch.int32)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    case = make_case(gen, tokens, top_k, experts, hidden, inter, slots, max_rank, ranks, gate, transposed, bias, dtype, identity)
    got = run(moe_lora_composed, case, slot_ids, slots, gate, transposed, lora_on, identity)
    want = _reference(case, slot_ids, slots, gate, transposed, lora_on, identity)
    assert_close(got, want, dtype)


def _reference(case, slot_ids, slots, gate, transposed, lora_on, identity=0):
    """The op's CPU implementation, in float32."""
    x, index, weights, up, up_b, down, down_b, up_lora, down_lora = case
    f32 = [t.float() if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else t for t in (x, index, weights, up, up_b, down, down_b)]
    lora = [
        [t.float() if t.dtype.is_floating_point else t for t in factors] if on else []
        for on, factors in zip(lora_on, (up_lora, down_lora))
    ]
    token_slot = batch_info(slot_ids, f32[0], 1, slots)[0]
    return moe_lora(*f32, *lora, token_slot, layout(gate, transposed, identity))


@pytest.mark.parametrize("mix", ["none", "mixed", "one"])
def test_long_pair_lists_match_reference(mix):
    """More (slot, expert) pairs than the SGMV search reads at once (a list of 80 entries), with
    no adapter at all, mixed, and one adapter: the list's layouts that a decode step meets."""
    tokens, experts, top_k, slots, dtype = 24, 20, 4, 4, torch.float32
    gen = torch.Generator().manual_seed(7)
    rows = {"none": [-1] * tokens, "one": [2] * tokens}.get(mix) or torch.randint(-1, slots, (tokens,), generator=gen).tolist()
    slot_ids = torch.tensor(rows, dtype=torch.int32)
    case = make_case(gen, tokens, top_k, experts, 16, 8, slots, 4, [[4, 2, 0, 3], [1, 4, 4, 2]], "glu", False, False, dtype)
    got = run(moe_lora_composed, case, slot_ids, slots, "glu", False, (True, True))
    want = _reference(case, slot_ids, slots, "glu", False, (True, True))
    assert_close(got, want, dtype)


def test_absent_projection_is_an_empty_bundle():
    """A projection without LoRA passes an empty bundle: the schema, the fake and the
    reference agree on it."""
    gen = torch.Generator().manual_seed(0)
    case = make_case(gen, 5, 2, 3, 8, 4, 2, 2, [[2, 1], [1, 2]], "glu", False, False, torch.float32)
    x, index, weights, up, up_b, down, down_b, _, down_lora = case
    lora = [[], list(down_lora)]
    token_slot = batch_info(torch.tensor([0, -1, 1, 0, 1], dtype=torch.int32), x, 1, 2)[0]
    args = (x, index, weights, up, up_b, down, down_b, *lora, token_slot, layout("glu", False))
    torch.library.opcheck(torch.ops.fxlora.moe_lora.default, args, test_utils=("test_schema", "test_faketensor"))


def test_quantised_weights_compute_through_their_subclass():
    """torchao int8 experts weights (a tensor subclass without transpose or grouped GEMMs):
    the op (its torch_dispatch rule: the reference on CPU, the subclass's own ``F.linear`` per
    expert) and its composition (the subclass's own ``dequantize()``, then a grouped GEMM)
    agree with the reference over the dequantised weights, LoRA on both projections."""
    pytest.importorskip("torchao")
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig, quantize_

    from fxlora.ops.moe_lora import serve_weights_of

    gen = torch.Generator().manual_seed(3)
    slots = 3
    case = make_case(gen, 9, 2, 4, 16, 8, slots, 4, [[4, 2, 0], [1, 4, 3]], "glu", False, False, torch.float32)
    holder = torch.nn.Module()
    holder.up, holder.down = (torch.nn.Parameter(t, requires_grad=False) for t in (case[3], case[5]))
    quantize_(holder, FqnToConfig({"up": Int8WeightOnlyConfig(), "down": Int8WeightOnlyConfig()}), filter_fn=None)
    assert type(holder.up).__name__ == "Int8Tensor"
    serve_weights_of(type(holder.up))
    quantized = (*case[:3], holder.up, None, holder.down, None, *case[7:])
    dequantized = (*case[:3], holder.up.dequantize(), None, holder.down.dequantize(), None, *case[7:])
    slot_ids = torch.tensor([0, -1, 2, 1, 0, -1, 2, 2, 1], dtype=torch.int32)
    want = _reference(dequantized, slot_ids, slots, "glu", False, (True, True))
    for fn in (moe_lora, moe_lora_composed):
        got = run(fn, quantized, slot_ids, slots, "glu", False, (True, True))
        assert_close(got, want, torch.float32)


def test_composition_without_any_lora():
    """Both bundles empty (the experts of a quantised model, traced with no adapter): the
    composition is the base experts alone."""
    gen = torch.Generator().manual_seed(4)
    case = make_case(gen, 6, 2, 3, 8, 4, 2, 2, [[2, 1], [1, 2]], "glu", False, False, torch.float32)
    slot_ids = torch.full((6,), -1, dtype=torch.int32)
    got = run(moe_lora_composed, case, slot_ids, 2, "glu", False, (False, False))
    want = _reference(case, slot_ids, 2, "glu", False, (False, False))
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_composition_compiles_under_inductor(dtype):
    """Inductor traces the composition as it compiles it in the op's place on CUDA: its
    grouped GEMMs in float32 and float16 go through ``fxlora::grouped_mm`` (ATen's meta
    function admits only bfloat16)."""
    gen = torch.Generator().manual_seed(5)
    slots = 3
    case = make_case(gen, 10, 2, 4, 16, 8, slots, 4, [[4, 2, 0], [1, 4, 3]], "glu", False, True, dtype)
    slot_ids = torch.tensor([0, -1, 2, 1, 0, -1, 2, 2, 1, 0], dtype=torch.int32)
    compiled = torch.compile(moe_lora_composed, backend="inductor", fullgraph=True)
    got = run(compiled, case, slot_ids, slots, "glu", False, (True, True))
    want = _reference(case, slot_ids, slots, "glu", False, (True, True))
    assert_close(got, want, dtype)
