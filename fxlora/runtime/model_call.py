"""One call of the compiled model over a KV cache the runtime owns, as both runtimes make it.

The runtime passes every input a step needs (token ids, positions, a prepared 4-D mask, its
cache) and marks the batch and position dimensions dynamic, so one trace serves every batch
bucket and length. ``slot_ids`` (per row, on the device) run the ``lora`` graphs; ``None``
runs ``nolora``. Afterwards every module a graph holds must have run its LoRA.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from fxlora.runtime.backend import Backend, dynamo_errors, raise_recompile_limit
from fxlora.runtime.kv_cache import cache_keyword
from fxlora.runtime.routing import use_slots


class ModelCall:
    def __init__(self, model: torch.nn.Module, step: Callable[..., Any], backend: Backend):
        self.model, self.step, self.backend = model, step, backend
        forward = inspect.signature(model.forward).parameters
        self.extra = {k: v for k, v in (("logits_to_keep", 1), ("cache_position", None)) if k in forward}
        self.cache_keyword = cache_keyword(model)

    def __call__(
        self,
        cache: Any,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        columns: torch.Tensor,
        slot_ids: torch.Tensor | None,
        dynamic: list[tuple[torch.Tensor, tuple[int, ...]]] = (),
    ) -> torch.Tensor:
        """The logits of the last position of every row, ``(rows, vocab)``. ``columns``: the
        cache columns the step writes (``cache_position``, for models that read it);
        ``dynamic``: more tensors and the dimensions of theirs to trace as sizes."""
        raise_recompile_limit()
        extra = dict(self.extra)
        if "cache_position" in extra:
            extra["cache_position"] = columns
        for t, dims in ((ids, (0, 1)), (positions, (0, 1)), (mask, (0, 2)), (columns, (0,)), *dynamic):
            for d in dims:
                if t.shape[d] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, d)
        with use_slots(slot_ids, batch=ids) as selection, dynamo_errors(self.model):
            out = self.step(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,
                use_cache=True,
                **{self.cache_keyword: cache},
                **extra,
            )
        if slot_ids is not None:
            selection.require(set(self.backend.rewritten))
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[:, -1]
