"""The next token of every row, each row with its own settings, inside the captured step.

Greedy rows take the argmax. A sampled row scales its logits by its temperature, keeps its
``top_k`` most likely tokens and, of those, the fewest whose probability reaches its
``top_p`` (transformers' order and rule), and draws one by the Gumbel-max trick with noise
that is a hash of the row's seed, the index of the token it is drawing and the token id. The
draw depends on nothing but the row itself: a seeded request gives the same tokens whatever
else is in the batch, and no generator state lives on the host. Shapes follow the batch, so
the step replays from a CUDA graph with any settings in its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingRows:
    """Per-row settings of a batch (views of the runner's static buffers)."""

    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0: no limit
    top_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64


def suppress(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits`` with the ``tokens`` (rows, n; -1 pads) of the ``rows`` (bool) set to -inf:
    end tokens before a row's ``min_new_tokens``."""
    # a pad repeats its row's first entry, so that every write to one index writes one value (a
    # pad written as token 0 would undo the -inf of an end token 0 beside it); a row of pads alone
    # writes token 0's own logit back
    tokens = torch.where(tokens >= 0, tokens, tokens[:, :1])
    hide = rows[:, None] & (tokens >= 0)
    index = tokens.clamp(min=0)
    current = logits.gather(1, index)
    return logits.scatter(1, index, torch.where(hide, float("-inf"), current))


def pick(logits: torch.Tensor, rows: SamplingRows, draw: torch.Tensor, sampling: bool) -> torch.Tensor:
    """The next token of each row; ``draw`` (int64) numbers the row's draws (its new tokens so
    far), ``sampling``: whether any row samples (else every row is greedy)."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    if not sampling:
        return greedy
    vocab = logits.shape[-1]
    scaled = logits / rows.temperature.clamp(min=1e-6)[:, None]
    ordered, order = scaled.sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    keep = (rank[None, :] < rows.top_k[:, None]) | (rows.top_k[:, None] <= 0)
    probs = torch.where(keep, ordered, float("-inf")).softmax(-1)
    keep &= (probs.cumsum(-1) - probs) < rows.top_p[:, None]  # the first token always stays
    keep = keep.scatter(1, order, keep)
    noise = -torch.log(-torch.log(_uniform(rows.seed, draw, vocab)))
    sampled = torch.where(keep, scaled + noise, float("-inf")).argmax(-1)
    return torch.where(rows.greedy, greedy, sampled)


def _uniform(seed: torch.Tensor, draw: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) numbers in (0, 1), a hash of (seed, draw, token): multiply-xorshift rounds
    on int64 values kept below 2**32, by odd constants below 2**31, so no product overflows. The
    seed's halves go in one after the other, each mixed before the next, so that seeds whose
    halves merely trade bits (1 and 2**32) draw apart."""
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    h = _mixed((seed[:, None] & _MASK32) ^ ((draw[:, None] * 0x165667B1) & _MASK32))  # (rows, 1): cheap rounds
    h = _mixed(h ^ ((seed[:, None] >> 32) & _MASK32))
    return ((_mixed((h * 0x27D4EB2F + token[None, :]) & _MASK32) >> 8).float() + 0.5) / float(1 << 24)


def _mixed(h: torch.Tensor) -> torch.Tensor:
    """Three multiply-xorshift rounds and a final xorshift of 32-bit values held in int64."""
    for multiplier in (0x7FEB352D, 0x5BD1E995, 0x1B873593):
        h = ((h ^ (h >> 15)) * multiplier) & _MASK32
    return h ^ (h >> 16)
