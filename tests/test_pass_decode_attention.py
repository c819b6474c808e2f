"""The decode_attention pass on graphs Dynamo traced: transformers' repeat_kv + SDPA of a
decode step (one query position) becomes fxlora::decode_attention over the cached keys and
values as they are, or, over a paged cache's gathered keys and values, fxlora::paged_decode_attention
over the pages, with the same result; prefill attention and SDPA without a mask are left
alone."""

import torch
import torch.nn.functional as F

from fxlora.adapters import AdapterPool
from fxlora.compiler.context import PassContext
from fxlora.passes.decode_attention import decode_attention

OP = torch.ops.fxlora.decode_attention.default
PAGED = torch.ops.fxlora.paged_decode_attention.default


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:  # as transformers writes it
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, group, n, d).reshape(b, h * group, n, d)


def attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask, scale=0.3, dropout_p=0.0)


def paged_attention(q, k_pages, v_pages, table, mask):
    k = torch.ops.fxlora.gather_pages(k_pages, table)
    v = torch.ops.fxlora.gather_pages(v_pages, table)
    return attention(q, k, v, mask)


def two_tables(q, k_pages, v_pages, table, mask):
    k = torch.ops.fxlora.gather_pages(k_pages, table)
    v = torch.ops.fxlora.gather_pages(v_pages, table.flip(1))
    return attention(q, k, v, mask)


def no_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2)) + mask.sum()


def traced(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, dynamic=False)(*args)
    return graphs[0]


def inputs(positions: int):
    gen = torch.Generator().manual_seed(positions)
    q = torch.randn(3, 4, positions, 8, generator=gen)
    k, v = torch.randn(3, 2, 10, 8, generator=gen), torch.randn(3, 2, 10, 8, generator=gen)
    mask = torch.full((3, 1, positions, 10), torch.finfo(torch.float32).min)
    mask[0, ..., :4], mask[1, ..., 2:7], mask[2, ..., :10] = 0.0, 0.0, 0.0
    return q, k, v, mask


def paged_inputs():
    """``inputs(1)``'s query and mask over pages of 4 columns: 3 blocks a row, in a shuffled table."""
    gen = torch.Generator().manual_seed(1)
    q, _, _, mask = inputs(1)
    mask = torch.cat([mask, torch.full((3, 1, 1, 2), torch.finfo(torch.float32).min)], -1)
    k_pages, v_pages = torch.randn(11, 4, 2, 8, generator=gen), torch.randn(11, 4, 2, 8, generator=gen)
    table = torch.randperm(11, generator=gen)[:9].view(3, 3).to(torch.int32)
    return q, k_pages, v_pages, table, mask


def graph_inputs(gm, names, args):
    by_name = dict(zip(names, args, strict=True))
    return [by_name[n.target.removeprefix("L_").removesuffix("_")] for n in gm.graph.nodes if n.op == "placeholder"]


def rewrite(gm):
    ctx = PassContext(AdapterPool(1, 1, []), decode_attention=True)
    return decode_attention(gm, ctx), ctx


def test_decode_step_attention_reads_the_cache_as_it_is():
    args = inputs(1)
    gm, ctx = rewrite(traced(attention, *args))
    ops = [n for n in gm.graph.nodes if n.target is OP]
    assert len(ops) == 1
    assert [a.op for a in ops[0].args[1:3]] == ["placeholder", "placeholder"]  # the cache, not its expansion
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "expand"]
    torch.testing.assert_close(gm(*graph_inputs(gm, ("q", "k", "v", "mask"), args))[0], attention(*args), rtol=1e-5, atol=1e-6)
    assert [r.kind for r in ctx.records] == ["info"]


def test_prefill_and_unmasked_attention_stay():
    for fn, args in ((attention, inputs(3)), (no_mask, inputs(1))):
        gm, _ = rewrite(traced(fn, *args))
        assert not [n for n in gm.graph.nodes if n.target is OP]


def test_paged_decode_step_attention_reads_the_pages():
    args = paged_inputs()
    gm, ctx = rewrite(traced(paged_attention, *args))
    ops = [n for n in gm.graph.nodes if n.target is PAGED]
    assert len(ops) == 1 and not [n for n in gm.graph.nodes if n.target is OP]
    assert [a.op for a in ops[0].args[1:4]] == ["placeholder"] * 3  # the pages and the table, nothing gathered
    assert not [n for n in gm.graph.nodes if "gather_pages" in str(n.target) or n.target == "expand"]
    got = gm(*graph_inputs(gm, ("q", "k_pages", "v_pages", "table", "mask"), args))[0]
    torch.testing.assert_close(got, paged_attention(*args), rtol=1e-5, atol=1e-6)
    assert "from its pages" in str(ctx.records[0])


def test_keys_and_values_through_different_tables_are_attended_as_gathered():
    args = paged_inputs()
    gm, _ = rewrite(traced(two_tables, *args))
    assert not [n for n in gm.graph.nodes if n.target is PAGED]
    (op,) = [n for n in gm.graph.nodes if n.target is OP]
    assert all("gather_pages" in str(a.target) for a in op.args[1:3])
    got = gm(*graph_inputs(gm, ("q", "k_pages", "v_pages", "table", "mask"), args))[0]
    torch.testing.assert_close(got, two_tables(*args), rtol=1e-5, atol=1e-6)
