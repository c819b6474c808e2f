"""A generate call's settings, read as ``transformers`` reads them.

The model's ``generation_config`` (or one passed in its place, filled from the model's where
it leaves a field unset), then transformers' own defaults, then the call's keywords, highest
last. fxlora serves what changes tokens through greedy or sampled decoding with end tokens and
length limits; any other setting that would change the answer (a repetition penalty, beams,
stop strings, ...) is refused by name, never dropped, wherever it came from.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fxlora.errors import GenerationConfigError

# transformers' defaults for the fields it fills when neither the model nor the call sets them
# (GenerationConfig._get_default_generation_params on transformers 5.24; older releases set
# them in the config itself)
DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "use_cache": True, "early_stopping": False,
    "num_beams": 1, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "num_return_sequences": 1,
    "output_scores": False, "return_dict_in_generate": False, "remove_invalid_values": False, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "output_attentions": False, "output_hidden_states": False, "output_logits": False, "renormalize_logits": False,
    "low_memory": False, "token_healing": False, "use_mtp": False,
}  # fmt: skip

SERVED = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "eos_token_id", "pad_token_id",
}  # fmt: skip
# Settings that do not change the tokens: how transformers would cache or compile (fxlora has
# its own cache and graphs), token ids used only by other model kinds, the version stamp, and
# settings that apply only to beam search or assisted decoding, which are refused themselves.
NEUTRAL = {
    "_from_model_config", "transformers_version", "bos_token_id", "decoder_start_token_id", "use_cache",
    "cache_implementation", "cache_config", "compile_config", "disable_compile", "max_cache_len", "low_memory",
    "prefill_chunk_size", "early_stopping", "length_penalty", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "is_assistant", "assistant_early_exit", "assistant_ensemble_weight",
}  # fmt: skip
SAMPLING_FLAGS = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class GenerationSettings:
    """What one generate call (or one request) decodes with."""

    max_new_tokens: int | None  # None: from max_length and the prompt's length
    max_length: int
    min_new_tokens: int | None
    min_length: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    def new_tokens(self, prompt_len: int) -> int:
        """The most new tokens for a prompt of ``prompt_len`` tokens."""
        return self.max_new_tokens if self.max_new_tokens is not None else self.max_length - prompt_len

    def min_tokens(self, prompt_len: int) -> int:
        """The fewest new tokens before an end token may end the row."""
        return self.min_new_tokens if self.min_new_tokens is not None else max(0, self.min_length - prompt_len)

    def check_tokens(self, vocab_size: int | None) -> None:
        for name, ids in (("eos_token_id", self.eos_token_ids), ("pad_token_id", (self.pad_token_id,))):
            for i in ids:
                if i is not None and (not isinstance(i, int) or i < 0 or (vocab_size is not None and i >= vocab_size)):
                    raise GenerationConfigError(
                        f"{name}={i!r} is not a token id of the model (0 <= id < vocab_size={vocab_size})"
                    )


def resolve(
    model_config: Any | None, generation_config: Any | None = None, **kwargs: Any
) -> GenerationSettings:
    """The settings of a call: ``generation_config`` (default: the model's ``model_config``),
    unset fields filled from the model's, then transformers' defaults, then ``kwargs`` (``None``
    leaves a field as it is; ``eos_token_id=()`` means no end token). Raises
    :class:`GenerationConfigError` naming a setting fxlora does not serve, and warns, as
    transformers does, of sampling settings given without ``do_sample``."""
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}")
    config = copy.deepcopy(generation_config if generation_config is not None else model_config or GenerationConfig())
    if generation_config is not None and model_config is not None:
        for key, value in model_config.to_dict().items():
            if getattr(config, key, None) is None and value is not None:
                setattr(config, key, value)
    given = {}
    for key, value in kwargs.items():
        if value is None:  # unset, as for a default argument
            continue
        if not hasattr(config, key):
            raise TypeError(f"unknown keyword {key!r}: it is neither an argument nor a GenerationConfig field")
        setattr(config, key, value)
        given[key] = value
    values = {key: getattr(config, key, None) for key in {*config.to_dict(), *DEFAULTS}}
    for key, value in values.items():
        default = DEFAULTS.get(key)
        if value is None or value == default or key in SERVED or key in NEUTRAL:
            continue
        where = "passed to generate" if key in given else "in the generation config"
        raise GenerationConfigError(
            f"{key}={value!r} ({where}) is not supported by fxlora's generate, which decodes greedily or by sampling "
            f"with temperature / top_k / top_p, min and max lengths and end tokens: pass {key}={default!r} to "
            "generate without it"
        )
    effective = {key: v if v is not None else DEFAULTS.get(key) for key, v in values.items()}
    do_sample = bool(effective["do_sample"])
    if not do_sample:
        flags = [f"{k}={values[k]!r}" for k in SAMPLING_FLAGS if values[k] is not None and values[k] != DEFAULTS[k]]
        if flags:
            warnings.warn(
                f"do_sample is False, so {', '.join(flags)} will not be used: generation is greedy. Pass "
                "do_sample=True to sample, or leave those settings unset",
                UserWarning,
                stacklevel=3,
            )
    max_new_tokens = values["max_new_tokens"]
    if max_new_tokens is None and "max_length" not in given and values["max_length"] in (None, DEFAULTS["max_length"]):
        max_new_tokens = DEFAULTS["max_length"]  # transformers: a default max_length counts new tokens
    settings = GenerationSettings(
        max_new_tokens=_count("max_new_tokens", max_new_tokens, 1),
        max_length=_count("max_length", effective["max_length"], 1),
        min_new_tokens=_count("min_new_tokens", values["min_new_tokens"], 0),
        min_length=_count("min_length", effective["min_length"], 0),
        do_sample=do_sample,
        temperature=float(effective["temperature"]),
        top_k=effective["top_k"] or None,
        top_p=float(effective["top_p"]),
        eos_token_ids=_token_ids(values["eos_token_id"]),
        pad_token_id=values["pad_token_id"],
    )
    if do_sample and not settings.temperature > 0:  # (NaN too)
        raise GenerationConfigError(f"temperature must be > 0 when sampling, got {settings.temperature}")
    if not 0 < settings.top_p <= 1:
        raise GenerationConfigError(f"top_p must lie in (0, 1], got {settings.top_p}")
    if settings.top_k is not None and (not isinstance(settings.top_k, int) or settings.top_k < 1):
        raise GenerationConfigError(f"top_k must be an int >= 1 (or 0 / None for none), got {settings.top_k!r}")
    return settings


def _count(name: str, value: Any, least: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < least:
        raise GenerationConfigError(f"{name} must be >= {least}, got {value}")
    return value


def _token_ids(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if hasattr(value, "tolist"):  # a tensor of ids
        value = value.tolist()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (Mapping, str)) or not isinstance(value, Sequence):
        raise GenerationConfigError(f"eos_token_id must be a token id or a sequence of them, got {value!r}")
    return tuple(value)
