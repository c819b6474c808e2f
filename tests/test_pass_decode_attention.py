"""The decode_attention pass on graphs Dynamo traced: transformers' repeat_kv + SDPA of a
decode step (one query position) becomes fxlora::decode_attention over the cached keys and
values as they are, with the same result; prefill attention and SDPA without a mask are left
alone."""

import torch
import torch.nn.functional as F

from fxlora.adapters import AdapterPool
from fxlora.compiler.context import PassContext
from fxlora.compiler.decode_attention import decode_attention

OP = torch.ops.fxlora.decode_attention.default


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:  # as transformers writes it
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, group, n, d).reshape(b, h * group, n, d)


def attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask, scale=0.3, dropout_p=0.0)


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
    by_name = dict(zip(("q", "k", "v", "mask"), args, strict=True))
    graph_args = [by_name[n.target.removeprefix("L_").removesuffix("_")] for n in gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(gm(*graph_args)[0], attention(*args), rtol=1e-5, atol=1e-6)
    assert ctx.report


def test_prefill_and_unmasked_attention_stay():
    for fn, args in ((attention, inputs(3)), (no_mask, inputs(1))):
        gm, _ = rewrite(traced(fn, *args))
        assert not [n for n in gm.graph.nodes if n.target is OP]
