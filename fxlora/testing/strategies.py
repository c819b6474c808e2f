"""Hypothesis strategies for property tests: model configs, LoRA adapter sets, mixed batches.

They draw what varies between real deployments: families and sizes, ranks 1..32, alphas,
rsLoRA, per-module rank/alpha patterns, target subsets (embeddings and output head
included), layer restrictions, and batches mixing adapters with ``None`` rows and padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from peft import LoraConfig

from fxlora.testing.models import FAMILIES, tiny_config


@st.composite
def model_configs(draw, families: Sequence[str] = tuple(FAMILIES)):
    """``(family, config)`` for a tiny random decoder of one of ``families``."""
    family = draw(st.sampled_from(list(families)))
    heads = draw(st.sampled_from([2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    config = tiny_config(
        family,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([1, heads])),
        num_hidden_layers=draw(st.integers(1, 2)),
        intermediate_size=draw(st.integers(16, 64)),
        vocab_size=draw(st.integers(40, 128)),
    )
    return family, config


@st.composite
def lora_configs(draw, targets: Sequence[str], layered: Sequence[str], max_rank: int = 32, num_layers: int = 2):
    """A ``LoraConfig`` over a subset of ``targets`` (short module names); ``layered`` are
    those inside numbered layers. Targets come as a list, a regex or ``"all-linear"``, with
    optional ``exclude_modules`` and ``layers_to_transform``."""
    ranks = st.integers(1, max_rank)
    alphas = st.sampled_from([1, 2, 8, 16, 32]) | st.floats(0.25, 64, allow_nan=False)
    style = draw(st.sampled_from(["list"] * 6 + ["regex", "all-linear", "exclude"]))
    exclude = None
    if style == "all-linear":
        chosen: list[str] | str = "all-linear"
        named = list(layered)
    else:
        named = draw(st.lists(st.sampled_from(list(targets)), min_size=1, max_size=len(targets), unique=True))
        chosen = named
        if style == "regex":  # PEFT full-matches a string against module FQNs
            chosen = r"(.*\.)?(" + "|".join(named) + ")"
        elif style == "exclude" and len(named) > 1:
            exclude = [named[-1]]
            named = named[:-1]
    layers = None
    if isinstance(chosen, list) and exclude is None and set(chosen) <= set(layered) and draw(st.booleans()):
        layers = draw(st.lists(st.integers(0, num_layers - 1), min_size=1, unique=True))
    pattern_keys = st.lists(st.sampled_from(named), max_size=2, unique=True) if named else st.just([])
    return LoraConfig(
        r=draw(ranks),
        lora_alpha=draw(alphas),
        use_rslora=draw(st.booleans()),
        fan_in_fan_out=draw(st.booleans()),  # PEFT corrects it per layer type; it only matters for merging
        target_modules=chosen,
        exclude_modules=exclude,
        layers_to_transform=layers,
        rank_pattern={k: draw(ranks) for k in draw(pattern_keys)},
        alpha_pattern={k: draw(alphas) for k in draw(pattern_keys)},
    )


def adapter_sets(
    targets: Sequence[str],
    layered: Sequence[str],
    min_size: int = 2,
    max_size: int = 5,
    max_rank: int = 32,
    num_layers: int = 2,
):
    """A list of 2..5 ``LoraConfig`` (each adapter its own targets and ranks)."""
    return st.lists(lora_configs(targets, layered, max_rank, num_layers), min_size=min_size, max_size=max_size)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    adapter_names: list[str | None]

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


@st.composite
def batches(draw, vocab_size: int, names: Sequence[str], max_batch: int = 5, max_len: int = 9, min_batch: int = 2):
    """Left-padded token batches whose rows each pick an adapter from ``names`` or ``None``."""
    rows = draw(st.integers(min_batch, max_batch))
    length = draw(st.integers(2, max_len))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    input_ids = torch.randint(3, vocab_size, (rows, length), generator=gen)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    for i in range(rows):
        pad = draw(st.integers(0, length - 1))
        input_ids[i, :pad], attention_mask[i, :pad] = 0, 0
    adapter_names = draw(st.lists(st.sampled_from([*names, None]), min_size=rows, max_size=rows))
    return Batch(input_ids, attention_mask, adapter_names)
