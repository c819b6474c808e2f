"""``fxlora::moe_lora``: the routed experts of an MoE block, each token–expert pair with
the LoRA of its row's adapter for that expert.

For token ``t`` of slot ``s`` routed to experts ``e = top_k_index[t, j]`` with weights
``w = top_k_weights[t, j]``::

    h   = x[t] @ W_up[e]ᵀ (+ b_up[e])   +  scaling_up[s]   · (x[t] @ A_up[s, e]ᵀ) @ B_up[s, e]ᵀ
    g   = gate(h)
    o   = g @ W_down[e]ᵀ (+ b_down[e])  +  scaling_down[s] · (g @ A_down[s, e]ᵀ) @ B_down[s, e]ᵀ
    y[t] = Σ_j w · o

``W_up`` is the experts' ``gate_up_proj`` (or ``up_proj`` when the experts have no gate),
stored ``(E, out, in)``, or ``(E, in, out)`` when ``transposed``. Each projection's LoRA
pool comes as one bundle (:class:`fxlora.ops.operands.LoraWeights`): ``A (slots, E, max_rank,
in)``, ``B (slots, E, out, max_rank)``, ``scaling`` and ``rank`` per slot; a parameter without
LoRA passes an empty one. ``token_slot`` is each token's slot
(``fxlora::batch_info``'s first output); the op groups the token–expert pairs itself.
``gate`` names how the up projection becomes the down projection's input:

- ``"glu"``: ``act(first half) * second half`` (transformers' default ``_apply_gate``);
- ``"glu_clamped"``: the same over clamped halves, ``act(min(gate, limit)) · clamp(up, ±limit)``
  (HY-V4);
- ``"glu_interleaved_clamped"``: GPT-OSS's gate: even columns are the gate, odd the up
  half, both clamped to ``limit``, ``gate · sigmoid(alpha · gate) · (up + 1)``;
- ``"glu_concatenated_clamped"``: GPT-OSS's gate over concatenated halves (MiniMax-M3);
- ``"glu_softcapped"``: a SwiGLU whose linear factors are soft-capped, in float32,
  ``cap(gate, alpha) · sigmoid(gate) · cap(up, limit)`` with ``cap(x, c) = c · tanh(x / c)``
  (Inkling2: ``alpha`` and ``limit`` are the gate's and the up half's softcaps);
- ``"act"``: experts without a gate: ``act(h)``.

``act`` is a ``transformers`` activation name (``ACT2FN``). The reference reads routing on
the host; it is the implementation on CPU and the oracle of the CUDA one.

On CUDA (:func:`moe_lora_triton`) nothing depends on the routing's values on the host: the
token–expert pairs are sorted by expert on the device, the base GEMMs are grouped GEMMs
over the experts' segments (``grouped_mm``), and the LoRA deltas are the SGMV kernels of
:mod:`fxlora.ops.triton.sgmv` over a list of ``(slot, expert)`` segments (the pool read as
``slots · E`` adapters; at most one entry per pair, as ``fxlora::batch_info``'s), whose sizes
are fixed by the token count and ``top_k``.
So the op is capturable in a CUDA graph and replays with any routing and adapters. Its
scratch — the pair order (``routing``, from :func:`moe_routing_workspace`) and the LoRA
shrink results (``workspace``, from :func:`moe_workspace`) — comes in as arguments that the
graph allocates as nodes of their own, so the ``hoist`` pass places them in the arena.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.ops.batch_info import fast_token_segments, slot_groups
from fxlora.ops.operands import BatchInfo, LoraWeights, optional_weights
from fxlora.ops.triton import sgmv

GATES = ("glu", "glu_clamped", "glu_interleaved_clamped", "glu_concatenated_clamped", "glu_softcapped", "act")


def apply_gate(h: torch.Tensor, gate: str, act: str, alpha: float, limit: float) -> torch.Tensor:
    from transformers.activations import ACT2FN

    if gate == "act":
        return ACT2FN[act](h)
    if gate not in GATES:
        raise ValueError(f"unknown experts gate {gate!r}; known: {GATES}")
    g, up = (h[..., ::2], h[..., 1::2]) if gate == "glu_interleaved_clamped" else h.chunk(2, dim=-1)
    if gate == "glu":
        return ACT2FN[act](g) * up
    if gate == "glu_softcapped":
        g, up = g.float(), up.float()
        return ((torch.tanh(g / alpha) * alpha) * torch.sigmoid(g) * (torch.tanh(up / limit) * limit)).to(h.dtype)
    g, up = g.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if gate == "glu_clamped":
        return ACT2FN[act](g) * up
    return g * torch.sigmoid(g * alpha) * (up + 1)


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ weight if transposed else F.linear(x, weight)
    return y if bias is None else y + bias


def _add_lora(y: torch.Tensor, x: torch.Tensor, lora: LoraWeights | None, expert: int, slots: torch.Tensor) -> None:
    """``y[i] += scaling[s] · (x[i] @ A[s, e]ᵀ) @ B[s, e]ᵀ`` for the rows ``i`` of each slot ``s``."""
    if lora is None:
        return
    a, b, scaling, rank = lora
    for s, r, rows in slot_groups(slots, rank):
        delta = (x[rows].to(a.dtype) @ a[s, expert, :r].T) @ b[s, expert, :, :r].T
        y.index_add_(0, rows, (delta * scaling[s].to(delta.dtype)).to(y.dtype))


def moe_workspace(top_k_index: torch.Tensor, lora_a: torch.Tensor, *, device=None) -> torch.Tensor:
    """Scratch for the up and down LoRA shrink results, ``(2, pairs, max_rank)`` float32."""
    return torch.empty((2, top_k_index.numel(), lora_a.shape[-2]), dtype=torch.float32, device=device or lora_a.device)


def moe_routing_workspace(top_k_index: torch.Tensor, *, device=None) -> torch.Tensor:
    """Scratch for the pairs' order: sorted expert ids, permutation, token and pool id per pair."""
    return torch.empty((4, top_k_index.numel()), dtype=torch.int64, device=device or top_k_index.device)


def local_routing(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes for a rank holding experts ``first .. first + count - 1`` of the model's
    (expert parallelism): theirs renumbered from 0, every other route sent to expert 0 with
    weight 0, so it adds nothing. Shapes follow the inputs', whatever the routing."""
    local = top_k_index - first
    mine = (local >= 0) & (local < count)
    return torch.where(mine, local, 0), torch.where(mine, top_k_weights, 0.0)




@torch.library.custom_op("fxlora::moe_lora", mutates_args=("workspace", "routing"))
def moe_lora(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    up_lora: list[torch.Tensor],
    down_lora: list[torch.Tensor],
    token_slot: torch.Tensor,
    workspace: torch.Tensor,
    routing: torch.Tensor,
    transposed: bool,
    gate: str,
    act: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    up, down = optional_weights(up_lora), optional_weights(down_lora)
    tokens, top_k = top_k_index.shape
    weighted = hidden.new_zeros(tokens, top_k, hidden.shape[-1])
    for e in torch.unique(top_k_index).tolist():
        token, j = (top_k_index == e).nonzero(as_tuple=True)
        slots = token_slot[token]
        x = hidden[token]
        h = _expert_linear(x, up_weight[e], None if up_bias is None else up_bias[e], transposed)
        _add_lora(h, x, up, e, slots)
        g = apply_gate(h, gate, act, alpha, limit)
        o = _expert_linear(g, down_weight[e], None if down_bias is None else down_bias[e], transposed)
        _add_lora(o, g, down, e, slots)
        weighted[token, j] = o * top_k_weights[token, j, None].to(o.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


def moe_lora_triton(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    up_lora: list[torch.Tensor],
    down_lora: list[torch.Tensor],
    token_slot: torch.Tensor,
    workspace: torch.Tensor,
    routing: torch.Tensor,
    transposed: bool,
    gate: str,
    act: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    up, down = optional_weights(up_lora), optional_weights(down_lora)
    tokens, top_k = top_k_index.shape
    experts = up_weight.shape[0]
    expert_ids = top_k_index.reshape(-1)
    pair_expert, order, pair_token, pool_id = routing.unbind(0)
    torch.sort(expert_ids.long(), stable=True, out=(pair_expert, order))  # pairs grouped by expert
    torch.div(order, top_k, rounding_mode="floor", out=pair_token)
    x = hidden.index_select(0, pair_token).to(up_weight.dtype)
    counts = torch.zeros(experts, dtype=torch.int32, device=hidden.device)
    counts.scatter_add_(0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    # LoRA segments: pair -> slot * E + expert, or -1 for rows without an adapter
    pair_slot = token_slot.index_select(0, pair_token).long()
    torch.where(pair_slot >= 0, pair_slot * experts + pair_expert, pair_slot, out=pool_id)  # -1 stays -1
    slots = (up or down).lora_a.shape[0]
    pairs = BatchInfo(*fast_token_segments(pool_id, 1, slots * experts))  # at most one segment per pair

    h = _grouped_linear(x, up_weight, offsets, up_bias, pair_expert, transposed)
    _add_lora_segments(h, x, up, pairs, experts, workspace[0])
    g = apply_gate(h, gate, act, alpha, limit)
    o = _grouped_linear(g, down_weight, offsets, down_bias, pair_expert, transposed)
    _add_lora_segments(o, g, down, pairs, experts, workspace[1])
    o = o * top_k_weights.reshape(-1)[order, None].to(o.dtype)
    weighted = torch.empty_like(o).index_copy_(0, order, o)  # back to (token, k) order
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _grouped_linear(x, weight, offsets, bias, pair_expert, transposed: bool):
    """Each segment of ``x`` (pairs sorted by expert, ``offsets`` their cumulative ends)
    times its expert's weight."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    w = weight if transposed else weight.transpose(-2, -1)  # (E, in, out)
    fin, fout = w.shape[1:]
    align = 16 // x.element_size()
    pad_in, pad_out = -fin % align, -fout % align
    if pad_in or pad_out:  # grouped GEMMs read 16-byte rows: zero-pad odd widths (a copy; real models never need it)
        x, w = F.pad(x, (0, pad_in)), F.pad(w, (0, pad_out, 0, pad_in))
    y = grouped_mm(x, w, offs=offsets)[:, :fout]
    return y if bias is None else y + bias[pair_expert]


def _add_lora_segments(
    y: torch.Tensor, x: torch.Tensor, lora: LoraWeights | None, pairs: BatchInfo, experts: int, out: torch.Tensor
) -> None:
    """``y += scaling · (x @ A[s, e]ᵀ) @ B[s, e]ᵀ`` per pair, the pool read as ``slots · E`` adapters
    (``pairs``: the pairs' segments, as ``fxlora::batch_info``'s for tokens)."""
    if lora is None:
        return
    lora_a, lora_b, scaling, rank = lora
    slots, _, max_rank, fin = lora_a.shape
    per_pair_rank = rank.repeat_interleave(experts)
    per_pair_scaling = scaling.repeat_interleave(experts)
    a = lora_a.view(slots * experts, max_rank, fin)
    v = sgmv.lora_shrink(x.contiguous(), a, per_pair_rank, *pairs.segments, out=out)
    b = lora_b.view(slots * experts, lora_b.shape[2], max_rank)
    sgmv.lora_expand(y, v, b, per_pair_scaling, per_pair_rank, *pairs.segments)


if sgmv is not None:
    moe_lora.register_kernel("cuda")(moe_lora_triton)


@moe_lora.register_fake
def _(hidden, top_k_index, *args):
    return hidden.new_empty(top_k_index.shape[0], hidden.shape[-1])
