"""What the passes share: the adapter pool they wire in, the arena ``hoist`` plans into, what
the runtime tells them about the graph, and the records of what they did, which ``explain()``
and the runtime's errors read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fxlora.adapters import AdapterPool

if TYPE_CHECKING:
    from fxlora.compiler.arena import Arena
    from fxlora.compiler.module_tree import ModuleTree

Kind = Literal["served", "skipped", "info"]


@dataclass(frozen=True)
class PassRecord:
    """One thing a pass did: ``served`` modules (and how), ``skipped`` a module it left as
    traced (``text`` says why), or ``info``: anything else worth telling (a set it did not
    fuse, an allocation it left)."""

    kind: Kind
    pass_name: str
    modules: tuple[str, ...]
    text: str

    def __str__(self) -> str:
        return f"skipped {', '.join(self.modules)}: {self.text}" if self.kind == "skipped" else self.text


@dataclass
class PassContext:
    pool: AdapterPool
    records: list[PassRecord] = field(default_factory=list)  # what the passes did, in order, for explain()
    rewritten: dict[str, str] = field(default_factory=dict)  # module FQN -> op it became
    arena: Arena | None = None  # where ``hoist`` places allocations; None: leave them
    inputs: list | None = None  # the real values of the graph's placeholders (Dynamo's example inputs)
    modules: ModuleTree | None = None  # the traced model's module tree, when known
    decode_attention: bool = False  # rewrite decode-step SDPA over the KV cache (for code run on CUDA)
    # for code captured in CUDA graphs (decode steps, prefills): plain linears' delta made beside
    # their GEMMs (lora_linear_beside), and lora_delta's shrink issued before the traced base
    shrink_ahead: bool = False
    batch: object = None  # the input whose first dimension is the batch's rows (a real tensor), when known
    # module FQN as traced -> the module a reused graph runs for (another instance of its code)
    renamed: dict[str, str] | None = None
    left_traced: dict[str, str] = field(default_factory=dict)  # pool target FQN -> why a pass left it as traced
    pass_name: str = ""  # the pass running, which its records name

    @contextlib.contextmanager
    def running(self, name: str) -> Iterator[None]:
        """Records made in the block are pass ``name``'s."""
        outer, self.pass_name = self.pass_name, name
        try:
            yield
        finally:
            self.pass_name = outer

    def record(self, kind: Kind, modules: Iterable[str], text: str) -> None:
        """Record what the running pass did; once, when passes that look at the same calls say
        the same thing."""
        new = PassRecord(kind, self.pass_name, tuple(modules), text)
        if not any((r.kind, r.modules, r.text) == (new.kind, new.modules, new.text) for r in self.records):
            self.records.append(new)

    def leave_traced(self, module: str, why: str, targets: Iterable[str] = ()) -> None:
        """A pass leaves ``module`` as traced: recorded for ``explain()``, and kept, for each of
        its pool ``targets`` (the module itself by default), for the error of a row whose
        adapter needs that LoRA."""
        self.record("skipped", (module,), why)
        for target in targets or (module,):
            self.left_traced.setdefault(target, why)
