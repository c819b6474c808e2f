"""A request of the stream, and what it became: :class:`Sequence` and :class:`GenerationOutput`.

A :class:`Sequence` is one request inside the engine: its prompt, its adapter, its decoding
settings, the KV-cache blocks it holds, the row of the running batch it sits in, and the
tokens it has produced. It knows nothing of the model or the device; the scheduler moves it
between waiting, running and finished, and the runner reads it to fill the step's tensors.
:class:`GenerationOutput` is what a caller gets back, named as transformers' continuous
batching names it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

FINISH_REASONS = ("length", "stop", "cancelled", "error")


@dataclass(frozen=True)
class Decoding:
    """How one request decodes: its length limits, end tokens and sampling settings."""

    max_new_tokens: int
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class GenerationOutput:
    """One request's result: partial while it streams, final once ``finish_reason`` is set
    (``"length"``, ``"stop"``, ``"cancelled"`` or ``"error"``, with ``error`` saying why)."""

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    adapter_name: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    created_time: float = 0.0  # time.perf_counter() when the request was added
    first_token_time: float | None = None  # ... when its first token was known to the host
    finished_time: float | None = None

    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.created_time


class Sequence:
    """One request in the engine."""

    def __init__(self, request_id: str, prompt_ids: list[int], adapter_name: str | None, decoding: Decoding, streaming: bool):
        self.request_id, self.prompt_ids, self.adapter_name = request_id, list(prompt_ids), adapter_name
        self.decoding, self.streaming = decoding, streaming
        self.status = Status.WAITING
        self.generated: list[int] = []
        self.blocks: list[int] = []  # KV-cache blocks, in the order of the sequence's columns
        self.reserved = 0  # blocks the allocator keeps for this sequence's growth
        self.slot: int | None = None  # its adapter's pool slot while it runs (-1: none)
        self.row: int | None = None  # its row of the running batch
        self.unread = 0  # at most this many tokens it made on the device that the host has not read
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.passes = 0  # turns later requests went first while its adapter found no GPU slot
        self.created_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def length(self) -> int:
        """Tokens in the KV cache once its last generated token is written: prompt + generated."""
        return len(self.prompt_ids) + len(self.generated)

    @property
    def max_length(self) -> int:
        """The most tokens it can hold: its prompt and every new token it may make."""
        return len(self.prompt_ids) + self.decoding.max_new_tokens

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        self.finished_time = time.perf_counter()

    def output(self) -> GenerationOutput:
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            generated_tokens=list(self.generated),
            adapter_name=self.adapter_name,
            finish_reason=self.finish_reason,
            error=self.error,
            created_time=self.created_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
        )

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.status.value}, {len(self.prompt_ids)}+{len(self.generated)} tokens)"
