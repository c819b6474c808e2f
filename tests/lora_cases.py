"""Shared by the LoRA kernel tests: a linear with its pool factors and the LoRA formula token by
token; a hypothesis draw of one multi-slice case (pool factors in the kernels' layout, inputs,
batch info, slot assignments) and its reference result; and the global memory instructions of
a kernel compiled for Hopper, for checks of its access widths."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from fxlora.ops import LoraWeights
from fxlora.ops.batch_info import fast_token_segments, token_segments
from fxlora.ops.delta_launcher import lora_workspace
from fxlora.ops.lora_delta import sliced_delta_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make_case(gen, tokens, d_in, d_out, max_rank, ranks, slots, dtype, bias=True):
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    lora_a, lora_b = r(len(ranks), max_rank, d_in) / d_in**0.5, r(len(ranks), d_out, max_rank)
    for s, rank in enumerate(ranks):  # the pool zero-pads beyond each slot's rank
        lora_a[s, rank:], lora_b[s, :, rank:] = 0, 0
    scaling = torch.rand(len(ranks), generator=gen) * 2
    rank = torch.tensor(ranks, dtype=torch.int32)
    x, w = r(tokens, d_in), r(d_out, d_in) / d_in**0.5
    b = r(d_out) if bias else None
    slot_ids = torch.tensor(slots, dtype=torch.int32)
    return x, w, b, lora_a, lora_b, scaling, rank, slot_ids


def multi_slice(members: tuple[LoraWeights, ...]) -> LoraWeights:
    """The members' factors in the multi-slice layout: rank rows and output rows stacked,
    ``scaling`` and ``rank`` per (slot, member), slot-major."""
    a, b, scaling, rank = zip(*members, strict=True)
    return LoraWeights(torch.cat(a, 1), torch.cat(b, 1), torch.stack(scaling, 1).flatten(), torch.stack(rank, 1).flatten())


def per_token(x, w, b, lora_a, lora_b, scaling, rank, token_slot):
    out = F.linear(x, w, b).float()
    for t, s in enumerate(token_slot.tolist()):
        if s >= 0:
            r = int(rank[s])
            out[t] += scaling[s] * (lora_b[s, :, :r].float() @ (lora_a[s, :r].float() @ x[t].float()))
    return out


def pool_factors(gen, slots, slices, max_rank, d_in, widths, ranks, dtype):
    a = torch.randn(slots, slices * max_rank, d_in, generator=gen) / d_in**0.5
    b = torch.randn(slots, sum(widths), max_rank, generator=gen) / max_rank**0.5
    rank = torch.tensor(ranks, dtype=torch.int32)  # (slots * slices,)
    for s in range(slots):
        for i in range(slices):
            r = ranks[s * slices + i]
            a[s, i * max_rank + r : (i + 1) * max_rank] = 0
    scaling = torch.rand(slots * slices, generator=gen) + 0.5
    return a.to(dtype), b.to(dtype), scaling, rank


def reference(y, x, a, b, scaling, rank, token_slot, widths):
    y = y.clone()
    starts = [sum(widths[:i]) for i in range(len(widths))]
    sliced_delta_reference([y[:, c : c + w] for c, w in zip(starts, widths)], x, LoraWeights(a, b, scaling, rank), token_slot)
    return y


def inside_noise(gen, t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as a view into a larger tensor with noise before and after it along ``dim``, as
    a member of a joined pool group is: kernels must follow its strides."""
    pad = list(t.shape)
    pad[dim] = 3
    noise = lambda: torch.randn(pad, generator=gen).to(t.device, t.dtype)  # noqa: E731
    return torch.cat([noise(), t, noise()], dim).narrow(dim, 3, t.shape[dim])


def draw_assignment(data, tokens: int, slots: int) -> list[int]:
    """Per-token slots: mixed with -1 (no adapter), all -1, or all one adapter."""
    mode = data.draw(st.sampled_from(["mixed", "none", "one"]))
    if mode == "none":
        return [-1] * tokens
    if mode == "one":
        return [data.draw(st.integers(0, slots - 1))] * tokens
    return data.draw(st.lists(st.integers(-1, slots - 1), min_size=tokens, max_size=tokens))


@dataclass
class Case:
    """Kernel operands on ``DEVICE``; ``y_host`` (the output before the delta) and ``expected``
    on the host."""

    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scaling: torch.Tensor
    rank: torch.Tensor
    token_slot: torch.Tensor
    sorted_tokens: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    widths: tuple[int, ...]
    dtype: torch.dtype
    y_host: torch.Tensor
    expected: torch.Tensor
    store: bool = False
    parts: list[torch.Tensor] | None = None

    def outputs(self, data) -> torch.Tensor | list[torch.Tensor]:
        """What an expand updates, as drawn: ``y``, or with several slices one tensor per
        slice (as the members of a fused group have), which :meth:`check` reads back."""
        if len(self.widths) > 1 and data.draw(st.booleans(), label="an output per slice"):
            starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
            self.parts = [self.y[:, c : c + w].clone() for c, w in zip(starts, self.widths)]
            return self.parts
        return self.y

    def workspace(self, data) -> torch.Tensor | None:
        """The shrink's ``out`` as drawn: none (the shrink allocates zeros), or scratch as a
        graph hands it over (:func:`nan_workspace`)."""
        return nan_workspace(self.x, self.a) if data.draw(st.booleans(), label="workspace") else None

    def check(self) -> None:
        """``y`` holds the reference result; rows without an adapter are untouched (with
        ``store``: zero, as the reference holds them)."""
        if self.parts is not None:
            self.y = torch.cat(self.parts, 1)
        torch.testing.assert_close(self.y.cpu().float(), self.expected.float(), **TOL[self.dtype])
        if not self.store:
            untouched = (self.token_slot.cpu() < 0).tolist()
            assert torch.equal(self.y.cpu()[untouched], self.y_host[untouched])


def nan_workspace(*args, **kwargs) -> torch.Tensor:
    """:func:`lora_workspace` holding anything, as a graph's scratch may: NaN, so that an
    expand reading an entry the shrink did not write (or a split reduction adding into it)
    shows in its output."""
    return lora_workspace(*args, **kwargs).fill_(float("nan"))


def draw_case(data, slots: tuple[int, int] = (1, 4), tokens: tuple[int, int] = (1, 67), store: bool = False) -> Case:
    """Token counts 1..67, widths and inputs that are not multiples of the block sizes, ranks
    up to 64 (some slots at 0), 1 to 3 slices, float32 / float16 (and bfloat16 on CUDA);
    ``slots`` and ``tokens``: the ranges of the pool's slot count and of the token count.
    ``store``: for an expand that writes the delta alone, into an output holding NaN."""
    tokens, d_in = data.draw(st.integers(*tokens), label="tokens"), data.draw(st.integers(1, 80), label="d_in")
    width = st.integers(1, 70) | st.integers(1, 8).map(lambda m: 8 * m)  # some aligned for 16-byte access
    widths = tuple(data.draw(st.lists(width, min_size=1, max_size=3), label="widths"))
    max_rank, slots = data.draw(st.integers(1, 64), label="max_rank"), data.draw(st.integers(*slots), label="slots")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    slices = len(widths)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ranks = data.draw(st.lists(st.integers(0, max_rank), min_size=slots * slices, max_size=slots * slices))
    assignment = draw_assignment(data, tokens, slots)
    a, b, scaling, rank = pool_factors(gen, slots, slices, max_rank, d_in, widths, ranks, dtype)
    x = torch.randn(tokens, d_in, generator=gen).to(dtype)
    y = torch.randn(tokens, sum(widths), generator=gen).to(dtype)
    if store:
        y.fill_(float("nan"))
    # the ATen ops' list (per slot, or compact for a pool larger than the batch) or the one-launch
    # kernel's; of the fewest entries, or of one per slot as fxlora::batch_info's (the kernels read
    # the first min(tokens, slots))
    build = data.draw(st.sampled_from([token_segments, fast_token_segments]), label="segment list")
    entries = data.draw(st.sampled_from([None, slots]), label="entries")
    meta = build(torch.tensor(assignment, dtype=torch.int32, device=DEVICE), 1, slots, entries=entries)
    expected = reference(torch.zeros_like(y) if store else y, x, a, b, scaling, rank, meta[0].cpu(), widths)
    on = [t.to(DEVICE) for t in (x, y.clone(), a, b, scaling, rank)] + list(meta)
    if data.draw(st.booleans(), label="factors inside a larger tensor"):
        on[2], on[3] = inside_noise(gen, on[2], 1), inside_noise(gen, on[3], 1)
    return Case(*on, widths=widths, dtype=dtype, y_host=y, expected=expected, store=store)


_PTX_SCRIPT = """
import collections, importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs, options, multiples = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
for k in constexprs:
    signature[k] = "constexpr"
names = list(signature)
aligned = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if k.endswith("_ptr") or k.startswith(("stride", "y_off")) or k in multiples}
src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=aligned)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
print(json.dumps(collections.Counter(re.findall(r"(?:ld|st)\\.global[.\\w]*|cp\\.async\\.cg", ptx))))
"""


def ptx_memory_ops(
    module: str, kernel: str, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
    multiples: tuple[str, ...] = (),
) -> dict:
    """How often each global load / store instruction appears in ``kernel``'s PTX, compiled
    for sm_90 (no GPU needed) with 16-byte aligned pointers, strides and offsets, and the integer
    arguments named in ``multiples`` multiples of 16 (as Triton specialises them at run time when
    they are, e.g. 4096 features). A fresh interpreter compiles it: with ``TRITON_INTERPRET`` set
    the kernels here are Triton's interpreted ones."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    args = json.dumps([module, kernel, signature, constexprs, options, list(multiples)])
    done = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compiling {module}.{kernel} for sm_90 failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)
