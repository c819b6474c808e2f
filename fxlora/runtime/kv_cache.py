"""A static KV cache the runtime owns: fixed addresses, rows chosen per batch bucket.

``StaticKVCache`` holds, per attention layer, keys and values of shape ``(max_batch_size,
heads, max_len, head_dim)``, allocated once. ``select_rows(b)`` points every layer at the
first ``b`` rows (aliases of the same memory, so a graph captured for bucket ``b`` keeps
valid addresses), and ``columns`` is the index tensor of the cache columns the current
step writes: ``arange(prompt_len)`` for a prefill, one column for a decode step. All rows
write the same columns; a row's padding is masked by the attention mask the runtime
builds, never stored as a shorter row.

It implements the ``transformers`` cache interface the attention layers use (``update``);
mask sizes and positions come from the runtime, which always passes ``position_ids`` and a
prepared attention mask.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.configuration_utils import PreTrainedConfig


def rows_of(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``t`` as a tensor of its own (not a view: Dynamo guards
    on a view's base and offset, which would retrace per bucket)."""
    out = t.new_empty(0)
    out.set_(t.untyped_storage(), t.storage_offset(), (rows, *t.shape[1:]), t.stride())
    return out


class _Layer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False

    def __init__(self, cache: StaticKVCache, keys: torch.Tensor, values: torch.Tensor, index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.all_keys, self.all_values = keys, values
        self.keys, self.values = keys, values
        self.max_cache_len = keys.shape[2]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for name, states, cached in (("keys", key_states, self.keys), ("values", value_states, self.values)):
            if states.shape[:2] != cached.shape[:2] or states.shape[-1] != cached.shape[-1]:
                raise ValueError(
                    f"fxlora KV cache layer {self.index}: {name} of shape {tuple(states.shape)} do not fit the "
                    f"cache's (rows, heads, columns, dim) = {tuple(cached.shape)}"
                )
        columns = self.cache.columns
        self.keys.index_copy_(2, columns, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, columns, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.max_cache_len

    def get_max_length(self) -> int:
        return self.max_cache_len


class StaticKVCache(Cache):
    """Keys and values for ``max_batch_size`` rows of ``max_len`` tokens, on ``device``."""

    def __init__(
        self,
        config: PreTrainedConfig,
        max_batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_shapes: list[tuple[tuple[int, int], tuple[int, int]]] | None = None,
    ):
        """``layer_shapes``: per layer, ``(heads, dim)`` of the keys and of the values it caches
        (:func:`probe_shapes`); by default read from the config's head counts and sizes."""
        shapes = layer_shapes or config_shapes(config)
        self.columns = torch.zeros(1, dtype=torch.long, device=device)
        layers = [
            _Layer(
                self,
                torch.zeros((max_batch_size, kh, max_len, kd), dtype=dtype, device=device),
                torch.zeros((max_batch_size, vh, max_len, vd), dtype=dtype, device=device),
                i,
            )
            for i, ((kh, kd), (vh, vd)) in enumerate(shapes)
        ]
        super().__init__(layers=layers)
        # (names of the transformers Cache's own properties, such as max_batch_size, are avoided)
        self.row_capacity, self.column_capacity = max_batch_size, max_len
        self.active_rows = max_batch_size

    @property
    def nbytes(self) -> int:
        return sum(layer.all_keys.nbytes + layer.all_values.nbytes for layer in self.layers)

    def tensors(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """The current rows' keys and values, each with its batch dimension."""
        return [(t, (0,)) for layer in self.layers for t in (layer.keys, layer.values)]

    def select_rows(self, rows: int) -> None:
        """Point every layer at the first ``rows`` rows."""
        if not 1 <= rows <= self.row_capacity:
            advice = f": compile with a larger max_batch_size= (max_batch_size={rows})" if rows > self.row_capacity else ""
            raise ValueError(f"a batch of {rows} rows does not fit the KV cache's {self.row_capacity} rows{advice}")
        self.active_rows = rows
        for layer in self.layers:
            layer.keys, layer.values = rows_of(layer.all_keys, rows), rows_of(layer.all_values, rows)


def config_shapes(config: PreTrainedConfig) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per layer ``((kv_heads, head_dim),) * 2`` from the config's attention sizes."""
    text = config.get_text_config(decoder=True)
    heads = _first_attr(text, "num_attention_heads", "n_head")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or _first_attr(text, "hidden_size", "n_embd") // heads
    return [((kv_heads, head_dim), (kv_heads, head_dim))] * _first_attr(text, "num_hidden_layers", "n_layer")


class _Probe(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.shapes: tuple | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: the probe only records what ``update`` is given."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.shapes = ((key_states.shape[1], key_states.shape[-1]), (value_states.shape[1], value_states.shape[-1]))
        return key_states, value_states

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return 1, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` from transformers
    5.24 on, ``past_key_values`` before (still accepted there, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def probe_shapes(model: torch.nn.Module, device: torch.device) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """What each attention layer of ``model`` caches, ``(heads, dim)`` of its keys and of its
    values, read off one eager token: models that cache something else than per-head keys and
    values (DeepSeek's compressed MLA latents) are sized right without knowing them."""
    text = model.config.get_text_config(decoder=True)
    layers = [_Probe() for _ in range(_first_attr(text, "num_hidden_layers", "n_layer"))]
    ids = torch.ones(1, 1, dtype=torch.long, device=device)
    model(input_ids=ids, use_cache=True, **{cache_keyword(model): Cache(layers=layers)})
    missing = [i for i, layer in enumerate(layers) if layer.shapes is None]
    if missing:
        raise ValueError(f"layers {missing} of the model wrote nothing to the KV cache: cannot size a static cache")
    return [layer.shapes for layer in layers]


def _first_attr(config: PreTrainedConfig, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"the model config has none of {names}: cannot size a KV cache for it")
