"""Launch parameters of the Triton LoRA kernels, as data: for each device, ordered lists of
shape classes and the parameters chosen for each class; the first class that holds wins.

A device is keyed by its compute capability (``"sm90"``: H100, H200). Any other device, and
Triton's interpreter, takes the ``"default"`` table. The entries were chosen with
``benchmarks/lora_tune.py`` and paired runs of the whole op (``docs/benchmarks.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cache, lru_cache

import torch


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int
    block_k: int
    split_k: int  # pieces of the reduction over K; a table gives the most, each piece >= block_k
    num_warps: int
    block_r: int = 64  # at most this many rank rows per program
    num_stages: int = 3  # software-pipelining depth of the loop over the features
    # Row blocks on the grid's slowest axis. Programs are dispatched in grid order, so the
    # ones whose row block finds no segment (most, at decode from a large pool) then come
    # after every busy one instead of between them. Decode sizes only: at prefill with one
    # adapter per token rows first are faster.
    rows_last: bool = False


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    num_warps: int
    tiles: int = 1  # column tiles per program, looped over with pipelined loads
    stages: int = 2
    rows_last: bool = False  # as ShrinkConfig.rows_last


@dataclass(frozen=True)
class TokenExpandConfig:
    """The per-token (BGMV) expand's: columns per program and warps."""

    block_n: int
    num_warps: int


@dataclass(frozen=True)
class Shape:
    """What launch parameters depend on. ``ranks``: for the shrink the rank rows of every
    slice (slices × max rank), for the expands the max rank. ``slices``: for the shrink the
    output slices that the base GEMM beside it writes in one launch (3 for a fused
    ``qkv_proj``, 1 where each slice has a GEMM of its own), for the expands the slices they
    update. ``segments``: entries of the segment list. ``columns``: the expands' widest output
    slice."""

    tokens: int
    k: int = 0
    ranks: int = 0
    slices: int = 1
    segments: int = 1
    columns: int = 0


@dataclass(frozen=True)
class When:
    """A shape class: the shapes for which every bound given holds (bounds inclusive)."""

    min_tokens: int = 0
    max_tokens: int | None = None
    min_ranks: int = 0
    max_ranks: int | None = None
    min_slices: int = 1
    min_tokens_per_segment: int = 0  # tokens >= this × segments
    max_tokens_per_segment: int | None = None  # tokens <= this × segments
    max_tokens_x_ranks: int | None = None
    min_columns: int = 0
    min_k: int = 0

    def holds(self, s: Shape) -> bool:
        return (
            self.min_tokens <= s.tokens
            and (self.max_tokens is None or s.tokens <= self.max_tokens)
            and self.min_ranks <= s.ranks
            and (self.max_ranks is None or s.ranks <= self.max_ranks)
            and self.min_slices <= s.slices
            and s.tokens >= self.min_tokens_per_segment * s.segments
            and (self.max_tokens_per_segment is None or s.tokens <= self.max_tokens_per_segment * s.segments)
            and (self.max_tokens_x_ranks is None or s.tokens * s.ranks <= self.max_tokens_x_ranks)
            and self.min_columns <= s.columns
            and self.min_k <= s.k
        )


@dataclass(frozen=True)
class LaunchTable:
    shrink: tuple[tuple[When, ShrinkConfig], ...]
    expand: tuple[tuple[When, ExpandConfig], ...]
    token_expand_serves: tuple[When, ...]  # the shapes whose expand is the per-token one (any class)
    token_expand: tuple[tuple[When, TokenExpandConfig], ...]


# Decode shrink: it runs beside a GEMM that holds nearly every SM, so many small programs
# (1-2 warps, shallow pipelines, at most 32 rank rows: little shared memory) fit beside the
# GEMM's blocks; more rank rows take more programs, not bigger ones.
_DECODE_WIDE_STEP = ShrinkConfig(16, 256, 16, 2, block_r=32, num_stages=1, rows_last=True)

SM90 = LaunchTable(
    shrink=(
        # Up to 8 tokens: one 256-wide step per program, the reduction split up to 16 ways.
        (When(max_tokens=8), _DECODE_WIDE_STEP),
        # Beside one GEMM over several slices, 33-64 tokens too: single-slice GEMMs there
        # differ by the kernel cuBLAS picks, which no shape tells, so they keep the next rows.
        (When(min_tokens=33, max_tokens=64, min_slices=2), _DECODE_WIDE_STEP),
        # Beside a multi-slice GEMM with at most 64 rank rows: 16 rank rows per program and a
        # 32-way split make many small programs that finish beside it; past 512 tokens such
        # small programs lose to the prefill classes below.
        (
            When(max_tokens=512, max_ranks=64, min_slices=2),
            ShrinkConfig(16, 128, 32, 1, block_r=16, num_stages=1, rows_last=True),
        ),
        # Other decode sizes up to 48 rank rows (rank 16 over up to three slices), 16 rank rows a
        # program: over K >= 8192 (a down_proj) a 32-way split of 256-wide steps, else an 8-way
        # split, two warps. Inside the whole op at 32 tokens over 16 adapters, weights from HBM
        # (`lora_tune.py in_context_8b`, H200): 39.5 against 44.5 us (down, K = 14,336) and 31.4
        # against 33.7 (q, k, v: three GEMMs, one shrink); o and gate/up level. The 8B's decode
        # step at batch 32: 6,782 to 6,589 us (lora / nolora 1.121 to 1.089); the 1B's and the
        # MoE model's level.
        (When(max_tokens=64, max_ranks=48, min_k=8192), ShrinkConfig(16, 256, 32, 1, block_r=16, num_stages=2, rows_last=True)),
        (When(max_tokens=64, max_ranks=48), ShrinkConfig(16, 256, 8, 2, block_r=16, num_stages=1, rows_last=True)),
        # Other decode sizes: one warp, a 16-way split (two pipelined 128-wide steps each at K = 4096).
        (When(max_tokens=64), ShrinkConfig(16, 128, 16, 1, block_r=32, num_stages=2, rows_last=True)),
        # Mid sizes: enough row blocks that an 8-way split of the reduction gives enough programs.
        (When(max_tokens=512), ShrinkConfig(16, 128, 8, 2)),
        # Past that, segments of a token or two each (an MoE block's token-expert pairs, a
        # (slot, expert) a segment): 16-row blocks of one warp, as 64-row blocks are mostly
        # masked there; 2.3-2.5x faster than the prefill rows at 1,024 pairs over 16 slots of
        # 64 experts (`lora_tune.py experts`, H200).
        (When(max_ranks=64, max_tokens_per_segment=2), ShrinkConfig(16, 64, 8, 1)),
        # Prefill: 64-row blocks, each program reading x once for up to 256 rank rows (several
        # slices' worth at large ranks), else once for up to 64.
        (When(min_ranks=65), ShrinkConfig(64, 64, 4, 8, block_r=256)),
        (When(), ShrinkConfig(64, 64, 8, 4)),
    ),
    expand=(
        # Up to 512 tokens: 16-row blocks of 128 columns, 256 past rank 32 (sweeps at decode
        # found no set clearly ahead); up to 64 tokens rows last, as the shrink's.
        (When(max_tokens=64, max_ranks=32), ExpandConfig(16, 128, 4, rows_last=True)),
        (When(max_tokens=64), ExpandConfig(16, 256, 4, rows_last=True)),
        # Outputs of 8,192 columns and more (gate/up): 512 columns per program, four pipelined
        # tiles, so the program's set-up (segment search, its rows' v) is paid a quarter as
        # often. Right after the GEMM, factors read from HBM: 1-5 µs less an expand at 128-512
        # tokens (H200); narrower outputs are level or slower with it.
        (When(max_tokens=512, max_ranks=32, min_columns=8192), ExpandConfig(16, 128, 4, tiles=4)),
        (When(max_tokens=512, max_ranks=32), ExpandConfig(16, 128, 4)),
        (When(max_tokens=512), ExpandConfig(16, 256, 4)),
        # Prefill up to rank 32: 1024 columns per program, so short segments (one adapter per
        # token) pay a program's set-up (segment search, its rows' v) less often.
        (When(max_ranks=32), ExpandConfig(16, 256, 4, tiles=4, stages=2)),
        # Several slices past rank 32: 64-row blocks of 8 tiles. Faster for qkv at prefill in
        # paired runs of the whole op, level for MLA and gate/up; the cause is not known.
        (When(min_slices=2), ExpandConfig(64, 64, 4, tiles=8, stages=2)),
        # Long segments (128 tokens each on average): 128-row blocks read each B tile half as often.
        (When(min_tokens_per_segment=128), ExpandConfig(128, 64, 8, tiles=4, stages=2)),
        (When(), ExpandConfig(64, 64, 4, tiles=4, stages=2)),
    ),
    # The per-token expand reads each token's rows of B on its own, so it wins while
    # tokens × rank is small; the segmented one reads each adapter's B once for its tokens.
    token_expand_serves=(
        When(max_ranks=16, max_tokens=64),
        When(max_ranks=64, max_tokens=16),
        When(min_ranks=65, max_tokens_x_ranks=512),
    ),
    token_expand=(
        # Narrow programs for a few tokens, so that enough of them run; past 32 tokens 256
        # columns, so the grid after the GEMM runs in one wave of dependent loads, not two.
        (When(max_tokens=4), TokenExpandConfig(64, 4)),
        (When(max_tokens=32), TokenExpandConfig(128, 2)),
        (When(), TokenExpandConfig(256, 2)),
    ),
)

# No other device has a table of its own yet: they run the H100's choices until one is tuned
# (benchmarks/lora_tune.py) and added under its own key.
TABLES: dict[str, LaunchTable] = {"sm90": SM90, "default": SM90}


@cache
def device_key(device: torch.device | None) -> str:
    """The key of ``device``'s table in :data:`TABLES`: ``"sm<major><minor>"`` where there is
    one, else ``"default"`` (also for CPU tensors, ``None`` and Triton's interpreter)."""
    if device is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "default"
    major, minor = torch.cuda.get_device_capability(device)
    key = f"sm{major}{minor}"
    return key if key in TABLES else "default"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``, for the launchers' arithmetic on the host: Triton's own ``cdiv`` and
    ``next_power_of_2`` are constexpr functions, which cost microseconds a call from Python."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); see :func:`cdiv`."""
    return 1 << max(n - 1, 0).bit_length()


#: lookups remembered, per table key: an op looks up its parameters on every call, from Python
#: (a prefill runs eagerly), and the tables are constants
LOOKUPS = 4096


def _first(rows, shape: Shape):
    for when, config in rows:
        if when.holds(shape):
            return config
    raise LookupError(f"no launch table class holds for {shape}")  # every list ends with When()


def shrink_config(
    tokens: int, k: int, ranks: int, gemm_slices: int = 1, device: torch.device | None = None, segments: int = 1
) -> ShrinkConfig:
    """The SGMV shrink's parameters for ``tokens`` rows of ``k`` features and ``ranks`` rank
    rows (every slice's); ``gemm_slices``: how many output slices the base GEMM beside the
    shrink writes in one launch (a fused ``qkv_proj``: 3; separate q, k and v GEMMs: 1);
    ``segments``: the segment list's entries the launch may read (``min(entries, tokens)``)."""
    return _shrink_config(device_key(device), tokens, k, ranks, gemm_slices, segments)


def expand_config(
    tokens: int, rank: int, segments: int = 1, slices: int = 1, columns: int = 0, device: torch.device | None = None
) -> ExpandConfig:
    """The SGMV expand's parameters for ``tokens`` rows, max rank ``rank``, ``segments``
    entries in the segment list and ``slices`` output slices, the widest ``columns`` wide."""
    return _expand_config(device_key(device), tokens, rank, segments, slices, columns)


def token_expand_serves(tokens: int, max_rank: int, device: torch.device | None = None) -> bool:
    """Whether the per-token (BGMV) expand serves ``tokens`` rows at ``max_rank``, rather than
    the segmented one."""
    return _token_expand_serves(device_key(device), tokens, max_rank)


def token_expand_config(tokens: int, device: torch.device | None = None) -> TokenExpandConfig:
    return _token_expand_config(device_key(device), tokens)


# the lookups, remembered per table key


@lru_cache(maxsize=LOOKUPS)
def _shrink_config(key: str, tokens: int, k: int, ranks: int, gemm_slices: int, segments: int) -> ShrinkConfig:
    config = _first(TABLES[key].shrink, Shape(tokens, k, ranks, gemm_slices, segments))
    return replace(config, split_k=max(1, min(config.split_k, k // config.block_k)))


@lru_cache(maxsize=LOOKUPS)
def _expand_config(key: str, tokens: int, rank: int, segments: int, slices: int, columns: int) -> ExpandConfig:
    return _first(TABLES[key].expand, Shape(tokens, ranks=rank, slices=slices, segments=segments, columns=columns))


@lru_cache(maxsize=LOOKUPS)
def _token_expand_serves(key: str, tokens: int, max_rank: int) -> bool:
    shape = Shape(tokens, ranks=max_rank)
    return any(when.holds(shape) for when in TABLES[key].token_expand_serves)


@lru_cache(maxsize=LOOKUPS)
def _token_expand_config(key: str, tokens: int) -> TokenExpandConfig:
    return _first(TABLES[key].token_expand, Shape(tokens))
