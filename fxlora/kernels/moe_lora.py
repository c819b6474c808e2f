"""``fxlora::moe_lora``: the routed experts of an MoE block, each token–expert pair with
the LoRA of its row's adapter for that expert.

For token ``t`` of slot ``s`` routed to experts ``e = top_k_index[t, j]`` with weights
``w = top_k_weights[t, j]``::

    h   = x[t] @ W_up[e]ᵀ (+ b_up[e])   +  scaling_up[s]   · (x[t] @ A_up[s, e]ᵀ) @ B_up[s, e]ᵀ
    g   = gate(h)
    o   = g @ W_down[e]ᵀ (+ b_down[e])  +  scaling_down[s] · (g @ A_down[s, e]ᵀ) @ B_down[s, e]ᵀ
    y[t] = Σ_j w · o

``W_up`` is the experts' ``gate_up_proj`` (or ``up_proj`` when the experts have no gate),
stored ``(E, out, in)``, or ``(E, in, out)`` when ``transposed``. The LoRA pools are
``A (slots, E, max_rank, in)``, ``B (slots, E, out, max_rank)``, ``scaling`` and ``rank`` per
slot; a parameter without LoRA passes ``None``. ``gate`` names how the up projection becomes
the down projection's input:

- ``"glu"``: ``act(first half) * second half`` (transformers' default ``_apply_gate``);
- ``"glu_interleaved_clamped"``: GPT-OSS's gate: even columns are the gate, odd the up
  half, both clamped to ``limit``, ``gate · sigmoid(alpha · gate) · (up + 1)``;
- ``"act"``: experts without a gate: ``act(h)``.

``act`` is a ``transformers`` activation name (``ACT2FN``). The reference reads routing on
the host; it is the implementation on CPU and the oracle of the CUDA one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.kernels.batch_info import slot_groups

GATES = ("glu", "glu_interleaved_clamped", "act")


def apply_gate(h: torch.Tensor, gate: str, act: str, alpha: float, limit: float) -> torch.Tensor:
    from transformers.activations import ACT2FN

    if gate == "glu":
        g, up = h.chunk(2, dim=-1)
        return ACT2FN[act](g) * up
    if gate == "glu_interleaved_clamped":
        g, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
        return g * torch.sigmoid(g * alpha) * (up + 1)
    if gate == "act":
        return ACT2FN[act](h)
    raise ValueError(f"unknown experts gate {gate!r}; known: {GATES}")


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ weight if transposed else F.linear(x, weight)
    return y if bias is None else y + bias


def _add_lora(y, x, lora, expert: int, slots: torch.Tensor) -> None:
    """``y[i] += scaling[s] · (x[i] @ A[s, e]ᵀ) @ B[s, e]ᵀ`` for the rows ``i`` of each slot ``s``."""
    if lora is None:
        return
    a, b, scaling, rank = lora
    for s, r, rows in slot_groups(slots, rank):
        delta = (x[rows].to(a.dtype) @ a[s, expert, :r].T) @ b[s, expert, :, :r].T
        y.index_add_(0, rows, (delta * scaling[s].to(delta.dtype)).to(y.dtype))


@torch.library.custom_op("fxlora::moe_lora", mutates_args=())
def moe_lora(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up_weight: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    up_lora_a: torch.Tensor | None,
    up_lora_b: torch.Tensor | None,
    up_scaling: torch.Tensor | None,
    up_rank: torch.Tensor | None,
    down_lora_a: torch.Tensor | None,
    down_lora_b: torch.Tensor | None,
    down_scaling: torch.Tensor | None,
    down_rank: torch.Tensor | None,
    token_slot: torch.Tensor,
    sorted_tokens: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    transposed: bool,
    gate: str,
    act: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    up_lora = None if up_lora_a is None else (up_lora_a, up_lora_b, up_scaling, up_rank)
    down_lora = None if down_lora_a is None else (down_lora_a, down_lora_b, down_scaling, down_rank)
    tokens, top_k = top_k_index.shape
    weighted = hidden.new_zeros(tokens, top_k, hidden.shape[-1])
    for e in torch.unique(top_k_index).tolist():
        token, j = (top_k_index == e).nonzero(as_tuple=True)
        slots = token_slot[token]
        x = hidden[token]
        h = _expert_linear(x, up_weight[e], None if up_bias is None else up_bias[e], transposed)
        _add_lora(h, x, up_lora, e, slots)
        g = apply_gate(h, gate, act, alpha, limit)
        o = _expert_linear(g, down_weight[e], None if down_bias is None else down_bias[e], transposed)
        _add_lora(o, g, down_lora, e, slots)
        weighted[token, j] = o * top_k_weights[token, j, None].to(o.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


@moe_lora.register_fake
def _(hidden, top_k_index, *args):
    return hidden.new_empty(top_k_index.shape[0], hidden.shape[-1])
