"""Property-testing tools for fxlora and for users' own models: hypothesis strategies,
tiny random models and adapters, and the oracles: PEFT, merged weights and the exact
decomposition (the model's own output plus each module's reference delta)."""

from fxlora.testing.models import (
    FAMILIES,
    MOE_FAMILIES,
    layered_module_names,
    lora_module_names,
    make_adapter,
    per_expert_adapter,
    quantized_model,
    shared_outer,
    tiny_config,
    tiny_model,
)
from fxlora.testing.oracle import (
    GREEDY_AGREEMENT,
    KL_TOL,
    NEAR_TIE,
    NOISE_FACTOR,
    RTOL,
    assert_greedy_agrees,
    assert_matches_decomposition,
    assert_matches_peft,
    check_rows,
    decomposed_logits,
    merged_logits,
    merged_model,
    oracle_noise,
    peft_model_with,
    reference_generate,
    reference_logits,
    row_errors,
)

_STRATEGIES = ("Batch", "adapter_sets", "batches", "lora_configs", "model_configs")


def __getattr__(name: str):
    # the hypothesis strategies load on first use, so the rest works without hypothesis installed
    if name in _STRATEGIES:
        from fxlora.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "FAMILIES",
    "MOE_FAMILIES",
    "GREEDY_AGREEMENT",
    "KL_TOL",
    "NEAR_TIE",
    "NOISE_FACTOR",
    "RTOL",
    "Batch",
    "adapter_sets",
    "assert_greedy_agrees",
    "assert_matches_decomposition",
    "assert_matches_peft",
    "batches",
    "check_rows",
    "decomposed_logits",
    "layered_module_names",
    "lora_configs",
    "lora_module_names",
    "make_adapter",
    "per_expert_adapter",
    "quantized_model",
    "shared_outer",
    "merged_logits",
    "merged_model",
    "oracle_noise",
    "model_configs",
    "peft_model_with",
    "reference_generate",
    "reference_logits",
    "row_errors",
    "tiny_config",
    "tiny_model",
]
