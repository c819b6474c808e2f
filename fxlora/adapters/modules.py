"""What the adapter pool needs to know of a module that may carry LoRA (:class:`ModuleInfo`),
and every such module of a model (:func:`model_modules`): its kind, features, dtype and
device, and under tensor parallelism which slice of the whole module this rank computes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from fxlora.adapters import sharding
from fxlora.adapters.sharding import Sharding
from fxlora.errors import ShardingError


@dataclass(frozen=True, eq=False)
class ModuleInfo:
    """What the pool needs to know of a module that may carry LoRA. Under tensor parallelism
    the features are those this rank computes, and ``shard`` says which slice of the whole
    module they are (:mod:`fxlora.adapters.sharding`); ``unshardable`` says why a sharded
    module cannot carry LoRA, should it be targeted."""

    kind: Literal["linear", "embedding", "experts"]
    in_features: int  # for an embedding: num_embeddings
    out_features: int  # for an embedding: embedding_dim
    dtype: torch.dtype
    device: torch.device
    weight: torch.Tensor | None = field(default=None, repr=False)
    experts: int = 0  # for "experts": a 3-D parameter of this many experts (on this rank) ...
    owner: torch.nn.Module | None = field(default=None, repr=False)  # ... held by this experts module
    parameter: str | None = None  # a linear over this 2-D parameter of the module (:meth:`over_parameter`)
    shard: Sharding | None = None
    unshardable: str | None = None

    @property
    def all_experts(self) -> int:
        """How many experts the whole module has; an expert-parallel rank holds ``experts``."""
        return self.shard.size if self.shard is not None and self.shard.dim == "experts" else self.experts

    @property
    def whole(self) -> tuple[int, int]:
        """``(in, out)`` features of the whole module, which adapters are written for."""
        s = self.shard
        return (
            s.size if s is not None and s.dim == "in" else self.in_features,
            s.size if s is not None and s.dim == "out" else self.out_features,
        )

    @staticmethod
    def of(module: torch.nn.Module) -> ModuleInfo | None:
        from transformers.pytorch_utils import Conv1D

        if isinstance(module, Conv1D):  # a linear whose weight is stored (in, out)
            return ModuleInfo._linear(module.weight, out_dim=1, keep_weight=False)
        if isinstance(module, torch.nn.Linear):  # its features, whatever shape a quantised weight packs into
            dtype = module.weight.dtype
            if not dtype.is_floating_point or hasattr(module.weight, "quant_state"):
                # a packed weight (bitsandbytes' 4-bit, whose quant_storage may be a float dtype): LoRA in the
                # dtype the layer computes in
                dtype = getattr(module, "compute_dtype", None) or torch.get_default_dtype()
            return ModuleInfo._linear(module.weight, out_dim=0, features=(module.out_features, module.in_features), dtype=dtype)
        if isinstance(module, torch.nn.Embedding):  # whole factors, however the weight is split (DTensor: its whole shape)
            w = module.weight
            n, d = w.shape
            return ModuleInfo("embedding", n, d, w.dtype, w.device, w)
        return None

    @staticmethod
    def _linear(
        w: torch.Tensor,
        out_dim: int,
        keep_weight: bool = True,
        parameter: str | None = None,
        features: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> ModuleInfo:
        """A linear over ``w`` (output features along ``out_dim``), of ``features`` ``(out, in)``
        when given and ``w`` is not sharded, else of ``w``'s (local) shape."""
        if features is None or sharding.is_distributed(w):
            shape = sharding.local_tensor(w).shape
            features = (shape[out_dim], shape[1 - out_dim])
        shard, why = _sharding(w, out_dim, 1 - out_dim)
        weight = w if keep_weight else None
        fout, fin = features
        dtype = dtype or w.dtype
        return ModuleInfo("linear", fin, fout, dtype, w.device, weight, parameter=parameter, shard=shard, unshardable=why)

    @staticmethod
    def over_parameter(module: torch.nn.Module) -> ModuleInfo | None:
        """For a module of no kind :meth:`of` knows that holds one 2-D floating-point
        parameter ``W (out, in)`` of its own (an MoE router's ``weight``): the linear its
        forward may compute over it. PEFT's ``target_parameters`` LoRA of ``W`` adds
        ``scaling · B @ A`` to it, which is the linear LoRA of ``F.linear(x, W)``; the passes
        serve it only on an ``F.linear`` call of the module that reads ``W``."""
        found = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 2 and p.is_floating_point()]
        if len(found) != 1:
            return None
        name, w = found[0]
        return ModuleInfo._linear(w, out_dim=0, parameter=name)


def model_modules(model: torch.nn.Module) -> dict[str, ModuleInfo]:
    """Every linear (``nn.Linear``, transformers' ``Conv1D``) and embedding module of
    ``model``, the up and down parameters of every experts module, every other module's one
    2-D parameter (:meth:`ModuleInfo.over_parameter`) and its 3-D parameters, as PEFT's
    ``target_parameters`` reads them (``(experts, out, in)`` unless the module says
    ``is_transposed``)."""
    from fxlora.adapters import experts

    found = {}
    for name, m in model.named_modules():
        if (info := ModuleInfo.of(m)) is not None:
            found[name] = info
        elif experts.is_experts(m):
            for p, w in experts.experts_parameters(m).items():
                local = sharding.local_tensor(w)
                fin, fout = experts.in_out(m, local)
                shard, why = _sharding(w, *((2, 1) if m.is_transposed else (1, 2)), experts_dim=0)
                info = ModuleInfo("experts", fin, fout, w.dtype, w.device, w, local.shape[0], m, shard=shard, unshardable=why)
                found[f"{name}.{p}"] = info
        elif (info := ModuleInfo.over_parameter(m)) is not None:
            found[name] = info
        if not experts.is_experts(m):  # any other module's 3-D parameters: the passes read what the graph does with them
            for p, w in m.named_parameters(recurse=False):
                if w.dim() == 3 and w.is_floating_point():
                    fin, fout = experts.in_out(m, w)
                    why = "LoRA of a 3-D parameter outside an experts module is not served under tensor parallelism"
                    found[f"{name}.{p}"] = ModuleInfo(
                        "experts", fin, fout, w.dtype, w.device, w, w.shape[0], m, unshardable=why if sharding.is_distributed(w) else None
                    )
    for fqn, info in found.items():
        if info.unshardable is not None and (entry := sharding.plan_entry(model, fqn)) is not None:
            found[fqn] = dataclasses.replace(info, unshardable=f"{info.unshardable} (its tp_plan entry {entry})")
    return found


def _sharding(weight: torch.Tensor, out_dim: int, in_dim: int, experts_dim: int | None = None) -> tuple[Sharding | None, str | None]:
    """``(shard, None)``, or ``(None, why)`` for a layout whose LoRA fxlora cannot split."""
    try:
        return sharding.sharding_of(weight, out_dim, in_dim, experts_dim), None
    except ShardingError as e:
        return None, str(e)

