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

Every rank validates an adapter on its own; :func:`agree` makes a load fail on every rank or
on none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fxlora.errors import ShardingError


@dataclass(frozen=True)
class Sharding:
    """The slice ``[start, start + length)`` of a module's ``dim`` (its input or output
    features, of ``size`` in all) that this rank computes; ``placement`` as DTensor names it."""

    dim: Literal["in", "out"]
    start: int
    length: int
    size: int
    placement: str

    def factors(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slices of ``a (..., r, in)`` and ``b (..., out, r)``."""
        end = self.start + self.length
        if self.dim == "in":
            return a[..., self.start : end], b
        return a, b[..., self.start : end, :]

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole linear ``weight (out, in)``."""
        return weight.narrow(0 if self.dim == "out" else 1, self.start, self.length)


def is_distributed(weight: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(weight, DTensor)


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``weight``: its local shard if it is a DTensor."""
    return weight.to_local() if is_distributed(weight) else weight


def sharding_of(weight: torch.Tensor, out_dim: int, in_dim: int) -> Sharding | None:
    """How this rank holds ``weight`` (a DTensor) along its output (``out_dim``) and input
    (``in_dim``) dimensions: ``None`` when replicated (or not a DTensor); raises
    :class:`ShardingError` for any other layout (a mesh of several dimensions, a strided or
    other placement, a shard of some other dimension), which the caller names the module for."""
    if not is_distributed(weight):
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(weight.placements)
    text = ", ".join(str(p) for p in placements)
    if weight.device_mesh.ndim != 1:
        raise ShardingError(f"its weight is laid out over a {weight.device_mesh.ndim}-D device mesh ({text})")
    (p,) = placements
    if isinstance(p, Replicate):
        return None
    if type(p) is not Shard:  # _StridedShard (packed gate/up experts), Partial, ...
        raise ShardingError(f"its weight's placement {text} is not a plain shard of its input or output features")
    dim = p.dim % weight.dim()
    if dim not in (out_dim, in_dim):
        raise ShardingError(f"its weight is sharded along dimension {dim} ({text}), not its input or output features")
    local_shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, placements)
    return Sharding("out" if dim == out_dim else "in", offset[dim], local_shape[dim], weight.shape[dim], text)


def process_group(model: torch.nn.Module) -> object | None:
    """The process group of the tensor-parallel mesh ``model``'s parameters are sharded over,
    or None for a model that is not."""
    for p in model.parameters():
        if is_distributed(p) and p.device_mesh.ndim == 1:
            return p.device_mesh.get_group()
    return None


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


def type_of(message: str) -> type[Exception]:
    """The fxlora error type a message from :func:`agree` names, so every rank raises alike."""
    from fxlora.errors import AdapterError, QuantizationError

    kinds = {e.__name__: e for e in (AdapterError, QuantizationError, ShardingError)}
    return kinds.get(message.partition(":")[0], RuntimeError)
