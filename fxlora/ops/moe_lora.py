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
``layout`` (one operand: :attr:`ExpertsLayout.spec`) says whether the weights are stored
transposed, which gate turns the up projection into the down projection's input, its
activation, and the gate's own parameters (:data:`GATE_PARAMS`):

- ``"glu"``: ``act(first half) * second half`` (transformers' default ``_apply_gate``);
- ``"glu_clamped"``: the same over clamped halves, ``act(min(gate, limit)) · clamp(up, ±limit)``
  (HY-V4);
- ``"glu_interleaved_clamped"``: GPT-OSS's gate: even columns are the gate, odd the up
  half, both clamped to ``limit``, ``gate · sigmoid(alpha · gate) · (up + 1)``;
- ``"glu_concatenated_clamped"``: GPT-OSS's gate over concatenated halves (MiniMax-M3);
- ``"glu_softcapped"``: a SwiGLU whose linear factors are soft-capped, in float32,
  ``cap(gate, gate_cap) · sigmoid(gate) · cap(up, up_cap)`` with ``cap(x, c) = c · tanh(x / c)``
  (Inkling2);
- ``"act"``: experts without a gate: ``act(h)``.

With ``identity`` experts (LongCat-Flash's "zero-computation" experts) a route to an expert
numbered past the down projection's ``E`` adds ``w · x[t]``: it has no parameters and no LoRA.

``act`` is a ``transformers`` activation name (``ACT2FN``). The reference reads routing on
the host; it is the implementation on CPU and the oracle of the CUDA one.

On CUDA the op is :func:`moe_lora_composed`, which reads nothing of the routing on the host:
``fxlora::batch_info`` sorts the token–expert pairs by expert, the base GEMMs are grouped
GEMMs over the experts' segments (ATen's ``grouped_mm`` in bfloat16, ``fxlora::grouped_mm``
in other dtypes, which Inductor cannot trace ATen's in), and the LoRA deltas are
``fxlora::lora_delta`` over the pairs, the pool read as ``slots · E`` adapters and the pairs'
``(slot, expert)`` segments from ``fxlora::batch_info`` again. So it is capturable in a CUDA
graph and replays with any routing and adapters. Under Inductor the graph holds the
composition in place of the op (``fxlora.ops.COMPOSITIONS``): Inductor fuses its routing, gate and
routed sum as it does the model's own experts code, and only the GEMMs, the sorts and the
LoRA kernels stay calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from fxlora.kernels import sgmv
from fxlora.ops.batch_info import slot_groups
from fxlora.ops.grouped_mm import traceable_grouped_mm
from fxlora.ops.lora_delta import add_pair_deltas
from fxlora.ops.operands import LoraWeights, optional_weights

# each gate the op knows, and the parameters it takes, in order
GATE_PARAMS: dict[str, tuple[str, ...]] = {
    "glu": (),
    "glu_clamped": ("limit",),
    "glu_interleaved_clamped": ("alpha", "limit"),
    "glu_concatenated_clamped": ("alpha", "limit"),
    "glu_softcapped": ("gate_cap", "up_cap"),
    "act": (),
}
GATES = tuple(GATE_PARAMS)


@dataclass(frozen=True)
class ExpertsLayout:
    """How the op computes an experts module: weights stored ``(E, in, out)`` when
    ``transposed``, the ``gate``, its activation ``act`` (a ``transformers`` name, ``""`` for a
    gate with its own), the gate's ``params`` (:data:`GATE_PARAMS` names them), and whether
    routes past the down projection's experts go to ``identity`` experts. The op takes it as
    one string operand, :attr:`spec`."""

    transposed: bool
    gate: str
    act: str = ""
    params: tuple[float, ...] = ()
    identity: bool = False

    def __post_init__(self) -> None:
        if self.gate not in GATE_PARAMS:
            raise ValueError(f"unknown experts gate {self.gate!r}; known: {GATES}")
        if len(self.params) != len(GATE_PARAMS[self.gate]):
            raise ValueError(f"the {self.gate} gate takes {GATE_PARAMS[self.gate] or 'no parameters'}, got {self.params}")

    def param(self, name: str) -> float:
        return self.params[GATE_PARAMS[self.gate].index(name)]

    @property
    def spec(self) -> str:
        """The layout as the op's operand: ``transposed;gate;act;param,param;identity``."""
        fields = [str(int(self.transposed)), self.gate, self.act, ",".join(map(repr, self.params)), str(int(self.identity))]
        return ";".join(fields)

    @staticmethod
    def parse(spec: str) -> ExpertsLayout:
        """The layout of an operand :attr:`spec` made (plain string operations, which Dynamo
        folds when it traces the composition)."""
        transposed, gate, act, params, identity = spec.split(";")
        return ExpertsLayout(transposed == "1", gate, act, tuple(float(p) for p in params.split(",") if p), identity == "1")

    def __str__(self) -> str:
        named = [f"act={self.act!r}"] if self.act else []
        named += [f"{k}={v:g}" for k, v in zip(GATE_PARAMS[self.gate], self.params)]
        named += ["identity experts"] if self.identity else []
        return ", ".join([f"transposed={self.transposed}", f"gate={self.gate!r}", *named])


def apply_gate(h: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    from transformers.activations import ACT2FN

    gate = layout.gate
    if gate == "act":
        return ACT2FN[layout.act](h)
    g, up = (h[..., ::2], h[..., 1::2]) if gate == "glu_interleaved_clamped" else h.chunk(2, dim=-1)
    if gate == "glu":
        return ACT2FN[layout.act](g) * up
    if gate == "glu_softcapped":
        gate_cap, up_cap = layout.params
        g, up = g.float(), up.float()
        return ((torch.tanh(g / gate_cap) * gate_cap) * torch.sigmoid(g) * (torch.tanh(up / up_cap) * up_cap)).to(h.dtype)
    limit = layout.param("limit")
    g, up = g.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if gate == "glu_clamped":
        return ACT2FN[layout.act](g) * up
    return g * torch.sigmoid(g * layout.param("alpha")) * (up + 1)


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


def local_routing(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes for a rank holding experts ``first .. first + count - 1`` of the model's
    (expert parallelism): theirs renumbered from 0, every other route sent to expert 0 with
    weight 0, so it adds nothing. Shapes follow the inputs', whatever the routing."""
    local = top_k_index - first
    mine = (local >= 0) & (local < count)
    return torch.where(mine, local, 0), torch.where(mine, top_k_weights, 0.0)


def moe_lora_reference(
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
    layout: str,
) -> torch.Tensor:
    up, down = optional_weights(up_lora), optional_weights(down_lora)
    form = ExpertsLayout.parse(layout)
    transposed = form.transposed
    tokens, top_k = top_k_index.shape
    weighted = hidden.new_zeros(tokens, top_k, hidden.shape[-1])
    for e in torch.unique(top_k_index).tolist():
        j, token = (top_k_index == e).T.nonzero(as_tuple=True)  # by position, then token, as the eager loops order rows
        slots = token_slot[token]
        x = hidden[token]
        if form.identity and e >= down_weight.shape[0]:
            weighted[token, j] = x * top_k_weights[token, j, None].to(x.dtype)
            continue
        h = _expert_linear(x, up_weight[e], None if up_bias is None else up_bias[e], transposed)
        _add_lora(h, x, up, e, slots)
        g = apply_gate(h, form)
        o = _expert_linear(g, down_weight[e], None if down_bias is None else down_bias[e], transposed)
        _add_lora(o, g, down, e, slots)
        weighted[token, j] = o * top_k_weights[token, j, None].to(o.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)


moe_lora = torch.library.custom_op("fxlora::moe_lora", moe_lora_reference, mutates_args=())


def moe_lora_composed(
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
    layout: str,
) -> torch.Tensor:
    """The op as ATen ops around ``fxlora::batch_info`` and ``fxlora::lora_delta``: its CUDA
    implementation, and what Inductor compiles in its place."""
    up, down = optional_weights(up_lora), optional_weights(down_lora)
    form = ExpertsLayout.parse(layout)
    transposed = form.transposed
    tokens, top_k = top_k_index.shape
    routed = down_weight.shape[0]  # the experts with parameters; past them, identity experts
    experts = up_weight.shape[0]
    expert_ids = top_k_index.reshape(-1)
    if form.identity:  # every identity route as the first expert past the routed: sorted last, computed by none
        expert_ids = expert_ids.clamp(max=routed)
        experts, up_weight = routed + 1, up_weight[:routed]
    # the pairs grouped by expert: batch_info's stable sort with the experts as its slots (on
    # CUDA one launch, where torch.sort of a few hundred keys takes a radix sort of ~27 µs)
    order = torch.ops.fxlora.batch_info(expert_ids.to(torch.int32), expert_ids, 0, experts)[1].long()
    pair_expert = expert_ids.index_select(0, order)
    pair_token = torch.div(order, top_k, rounding_mode="floor")
    x = hidden.index_select(0, pair_token).to(up_weight.dtype)
    counts = torch.zeros(experts, dtype=torch.int32, device=hidden.device)
    counts = counts.scatter_add(0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)[:routed]  # identity pairs: past the last offset
    pair_slot = token_slot.index_select(0, pair_token) if up or down else None
    if form.identity:
        real = pair_expert < routed
        pair_expert = pair_expert.clamp(max=routed - 1)
        pair_slot = None if pair_slot is None else torch.where(real, pair_slot, -1)
    h = _grouped_linear(x, up_weight, offsets, up_bias, pair_expert, transposed)
    pairs = add_pair_deltas(h, x, up, pair_slot, pair_expert)
    g = apply_gate(h, form)
    o = _grouped_linear(g, down_weight, offsets, down_bias, pair_expert, transposed)
    add_pair_deltas(o, g, down, pair_slot, pair_expert, pairs)
    w = top_k_weights.reshape(-1)
    o = o * w[order, None].to(o.dtype)
    if form.identity:  # an identity pair adds its weighted input; its rows of o were never computed
        o = torch.where(real[:, None], o, x.to(o.dtype) * w[order, None].to(o.dtype))
    weighted = torch.empty_like(o).index_copy(0, order, o)  # back to (token, k) order
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _grouped_linear(x, weight, offsets, bias, pair_expert, transposed: bool):
    """Each segment of ``x`` (pairs sorted by expert, ``offsets`` their cumulative ends)
    times its expert's weight. A tensor subclass (a quantised weight) without a transpose or
    grouped GEMM of its own, as torchao's ``Int8Tensor`` (or ``Float8Tensor`` stored
    ``(E, in, out)`` on CUDA, a layout its grouped GEMM refuses), is dequantised by its own
    ``dequantize()`` first: every expert of the layer once per call, then one grouped GEMM
    (not one GEMM per expert over all pairs, E times the FLOPs and the launches)."""
    try:
        y = _grouped_mm(x, weight, offsets, transposed)
    except (NotImplementedError, AssertionError) as e:  # torchao asserts on a layout it lacks
        dequantize = getattr(weight, "dequantize", None)
        if dequantize is None:
            raise NotImplementedError(
                f"experts weights of type {type(weight).__name__} have neither a grouped GEMM nor dequantize()"
            ) from e
        y = _grouped_mm(x, dequantize(), offsets, transposed)
    return y if bias is None else y + bias[pair_expert]


def _grouped_mm(x, weight, offsets, transposed: bool):
    return traceable_grouped_mm(x, weight if transposed else weight.transpose(-2, -1), offsets)  # w: (E, in, out)


if sgmv is not None:
    moe_lora.register_kernel("cuda")(moe_lora_composed)



@moe_lora.register_fake
def moe_lora_fake(hidden, top_k_index, *args, **kwargs):
    return hidden.new_empty(top_k_index.shape[0], hidden.shape[-1])


_SERVED_SUBCLASSES: set[type] = set()


def serve_weights_of(subclass: type) -> None:
    """Let the op take experts weights of a tensor ``subclass`` (a quantised weight, say
    torchao's ``Int8Tensor``), whose own ops then compute the base GEMMs: on CUDA through
    :func:`moe_lora_composed` (the subclass's transpose and grouped GEMM, or its
    ``dequantize()`` then a grouped GEMM), elsewhere through the reference (its ``select``
    and ``F.linear`` per expert). Fake inputs trace the composition (the reference reads
    the routing on the host): a graph traced through the subclass, as AOTAutograd traces a
    graph whose inputs are subclasses, then computes the op rather than an empty tensor of
    its shape. fxlora's graphs hold the composition in the op's place already
    (``fxlora.ops.COMPOSITIONS``, :func:`fxlora.compiler.inner.composed`)."""
    if subclass in _SERVED_SUBCLASSES:
        return

    def rule(cls, func, types, args, kwargs):
        if is_fake(args[0]):
            return moe_lora_composed(*args, **kwargs)
        run = moe_lora_composed if args[0].is_cuda and sgmv is not None else moe_lora_reference
        return run(*args, **kwargs)

    torch.library.register_torch_dispatch("fxlora::moe_lora", subclass, rule)
    _SERVED_SUBCLASSES.add(subclass)
