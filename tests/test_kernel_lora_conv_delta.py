"""fxlora::lora_conv_delta against PEFT's semantics for a 3-D convolution weight: each row
convolved with its adapter's adapted weight, ``W[c] + scaling · B[c] @ A[c]`` (transposed
where the module is), on the CPU and on CUDA (the same ATen code)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fxlora.ops import batch_info, lora_conv_delta


def case(data, device="cpu"):
    """The input, the base convolution's output, the factors, the rows' slots, the convolution's
    arguments and the expected output."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    rows, groups, per_group, kernel, length = (data.draw(st.integers(1, n)) for n in (4, 3, 3, 4, 7))
    out_per_group, stride, dilation, padding = (data.draw(st.integers(1, n)) for n in (2, 2, 2, 3))
    length = max(length, dilation * (kernel - 1) + 1)
    channels, transposed = groups * out_per_group, data.draw(st.booleans())
    num_slots, max_rank = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5))
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=num_slots, max_size=num_slots))
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=rows, max_size=rows))
    weight = torch.randn(channels, per_group, kernel, generator=gen)
    fin, fout = (per_group, kernel) if transposed else (kernel, per_group)  # PEFT's (in, out) of a 3-D parameter
    lora_a = torch.randn(num_slots, channels, max_rank, fin, generator=gen)  # past a slot's rank: left as noise
    lora_b = torch.randn(num_slots, channels, fout, max_rank, generator=gen)
    scaling, rank = torch.rand(num_slots, generator=gen), torch.tensor(ranks, dtype=torch.int32)
    x = torch.randn(rows, groups * per_group, length, generator=gen)
    args = ([stride], [padding], [dilation], groups)
    y = F.conv1d(x, weight, None, *args)
    expected = y.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            r = ranks[s]
            delta = (lora_b[s, :, :, :r] @ lora_a[s, :, :r]) * scaling[s]
            adapted = weight + (delta.transpose(-1, -2) if transposed else delta)
            expected[i] = F.conv1d(x[i : i + 1], adapted, None, *args)[0]
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    x, y, slot_ids = on(x, y, torch.tensor(slots, dtype=torch.int32))
    return x, y, on(lora_a, lora_b, scaling, rank), batch_info(slot_ids, x, 2, num_slots), (*args, transposed), expected


def check(data, device):
    x, y, lora, meta, args, expected = case(data, device)
    before = y.clone()
    out = lora_conv_delta(x, y, lora, list(meta), *args)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(y, before)  # functional: the base output is left as it was


@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_lora_conv_delta_matches_peft(data):
    check(data, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@given(data=st.data())
@settings(max_examples=20, deadline=None)
def test_lora_conv_delta_on_cuda(data):
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # fp32 against fp32, not TF32's 10-bit products
        check(data, "cuda")
