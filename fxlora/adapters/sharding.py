"""Tensor parallelism: which slice of a module's LoRA factors this rank holds.

A model sharded with transformers' own plan (``DistributedConfig(tp_plan="auto")`` under
``torchrun``) holds ``DTensor`` parameters, and at inference each linear computes on its local
shard. LoRA factors are split to match, as S-LoRA does:

- column-parallel (weight ``Shard(0)``: q/k/v, gate/up, the output head): the rank computes a
  slice of the output columns, so it holds ``A`` whole and the matching rows of ``B``;
- row-parallel (weight ``Shard(1)``: o_proj, down_proj): the rank reads a slice of the input
  and computes a partial output that the layer's all-reduce sums, so it holds the matching
  columns of ``A`` and ``B`` whole. ``(x_r A_rᵀ) Bᵀ`` summed over ranks is ``(x Aᵀ) Bᵀ``: the
  delta added onto the partial output rides the layer's own reduction;
- replicated: whole.

MoE experts sharded over their intermediate features (transformers' ``moe_tp_experts``) are
the same two cases per expert: ``gate_up_proj`` column-parallel, each of its gate and up halves
split alike (``_StridedShard``), ``down_proj`` row-parallel. Experts split between ranks
(expert parallelism, ``ep_size``: each rank holds whole experts, and the module's all-reduce
sums what each rank's experts computed) keep those experts' factors.

Every rank validates an adapter on its own; :func:`one_outcome` makes a load (or a compile's
checks) fail on every rank or on none.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from fxlora.errors import ShardingError


@dataclass(frozen=True)
class Sharding:
    """Which part of a module's ``dim`` (its input or output features, of ``size`` in all)
    this rank computes: the slice ``[start, start + length)`` of each of ``pieces`` equal
    blocks (one, or the gate and up halves of a packed experts weight), in block order."""

    dim: Literal["in", "out", "experts"]
    start: int
    length: int
    size: int
    pieces: int = 1

    def factors(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's parts of ``a ([experts,] r, in)`` and ``b ([experts,] out, r)``; an
        experts dimension of 1 (one factor shared by every expert) is every rank's."""
        if self.dim == "experts":
            return tuple(t if t.shape[0] == 1 else self._take(t, 0) for t in (a, b))
        if self.dim == "in":
            return self._take(a, -1), b
        return a, self._take(b, -2)

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole linear ``weight (out, in)``."""
        return self._take(weight, 0 if self.dim == "out" else 1)

    def _take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        block = self.size // self.pieces
        parts = [t.narrow(dim, i * block + self.start, self.length) for i in range(self.pieces)]
        return parts[0] if self.pieces == 1 else torch.cat(parts, dim)


def is_distributed(weight: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(weight, DTensor)


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``weight``: its local shard if it is a DTensor."""
    return weight.to_local() if is_distributed(weight) else weight


def local_part(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole``, split as the DTensor ``like`` is (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def sharding_of(weight: torch.Tensor, out_dim: int, in_dim: int, experts_dim: int | None = None) -> Sharding | None:
    """How this rank holds ``weight`` (a DTensor) along its output (``out_dim``) and input
    (``in_dim``) dimensions: ``None`` when replicated (or not a DTensor). A plain shard, or a
    strided one (a packed gate/up weight whose halves are each sharded) of either dimension,
    or a plain shard of an experts weight's ``experts_dim`` (expert parallelism), is read; any
    other layout (a mesh of several dimensions, a partial placement, a shard of another
    dimension) raises :class:`ShardingError`, which the caller names the module for."""
    if not is_distributed(weight):
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(weight.placements)
    text = ", ".join(repr(p) for p in placements)
    if weight.device_mesh.ndim != 1:
        raise ShardingError(f"its weight is laid out over a {weight.device_mesh.ndim}-D device mesh ({text})")
    (p,) = placements
    if isinstance(p, Replicate):
        return None
    pieces = getattr(p, "split_factor", 1) if isinstance(p, _StridedShard) else 1
    if type(p) not in (Shard, _StridedShard):  # Partial, ...
        raise ShardingError(f"its weight's placement {text} is not a shard of its input or output features")
    dim = p.dim % weight.dim()
    if dim == experts_dim and pieces == 1:
        kind = "experts"
    elif dim in (out_dim, in_dim):
        kind = "out" if dim == out_dim else "in"
    else:
        raise ShardingError(f"its weight is sharded along dimension {dim} ({text}), not its input or output features")
    # each of the `pieces` blocks is split as torch.chunk splits it, the rank taking its chunk of each
    size, ranks, rank = weight.shape[dim], weight.device_mesh.size(), weight.device_mesh.get_local_rank()
    block = size // pieces
    chunk = -(-block // ranks)
    start = min(rank * chunk, block)
    length = min(chunk, block - start)
    if block * pieces != size or length * pieces != weight.to_local().shape[dim]:
        raise ShardingError(f"its weight's placement {text} does not split it as fxlora reads the placement")
    return Sharding(kind, start, length, size, pieces)


def plan_entry(model: torch.nn.Module, fqn: str) -> str | None:
    """The entry of ``model``'s tensor-parallel plan that lays out module ``fqn`` (its
    parameters too), as ``'key': 'style'``; None when none names it."""
    plan = getattr(model, "tp_plan", None) or {}
    names = (fqn, re.sub(r"\.\d+(\.|$)", r".*\1", fqn))  # the plan writes layer numbers as *
    for key, style in plan.items():
        if any(n == key or n.endswith("." + key) or key.startswith(n + ".") for n in names):
            return f"{key!r}: {style!r}"
    return None


def process_group(model: torch.nn.Module) -> object | None:
    """The process group of the tensor-parallel mesh ``model``'s parameters are sharded over,
    or None for a model that is not."""
    for p in model.parameters():
        if is_distributed(p) and p.device_mesh.ndim == 1:
            return p.device_mesh.get_group()
    return None


def describe(group: object, shards: list[Sharding | None]) -> str:
    """One line for ``explain()``: this rank, and how many of the pool's targets (``shards``,
    one per target) it holds a part of."""
    import torch.distributed as dist

    parts = sum(s is not None for s in shards)
    return (
        f"tensor parallel: rank {dist.get_rank(group)} of {dist.get_world_size(group)}; the pool holds this rank's part "
        f"of the LoRA of {parts} sharded target(s) and the whole LoRA of {len(shards) - parts} replicated one(s)"
    )


def agree(error: Exception | None, group: object | None) -> None:
    """Make one outcome of all ranks of ``group``: raise on every rank when any rank had an
    ``error`` (its own where it had one, else one naming the first failing rank and its
    message); return on every rank when none had. Without a group, raise ``error`` if any."""
    if group is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    flags = [torch.zeros_like(failed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, failed, group=group)
    failing = [rank for rank, flag in enumerate(flags) if flag.item()]
    if not failing:
        return
    first = failing[0]
    message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank(group) == first:
        text = f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
        message[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)
    dist.broadcast(message, group_src=first, group=group)
    if error is not None:
        raise error
    text = bytes(message.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    raise type_of(text)(f"rank {first} failed, so no rank changed anything: {text}")


MESSAGE_BYTES = 2048


@contextlib.contextmanager
def one_outcome(group: object | None) -> Iterator[None]:
    """Run the block on every rank of ``group`` and :func:`agree` on how it ended: an error on
    any rank raises on every rank; otherwise every rank goes on. Without a group, nothing is
    added."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - whatever failed here, the other ranks must hear of it
        agree(e, group)
        raise  # agree raised already; this line is for readers and linters
    agree(None, group)


def type_of(message: str) -> type[Exception]:
    """The fxlora error type a message from :func:`agree` names, so every rank raises alike."""
    from fxlora.errors import AdapterError, QuantizationError

    kinds = {e.__name__: e for e in (AdapterError, QuantizationError, ShardingError)}
    return kinds.get(message.partition(":")[0], RuntimeError)
