"""What the passes share: the adapter pool they wire in, the arena ``hoist`` plans into, and
the report ``explain()`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fxlora.adapters import AdapterPool

if TYPE_CHECKING:
    from fxlora.compiler.annotate import ModuleTree
    from fxlora.compiler.arena import Arena


@dataclass
class PassContext:
    pool: AdapterPool
    report: list[str] = field(default_factory=list)  # one line per decision, for explain()
    rewritten: dict[str, str] = field(default_factory=dict)  # module FQN -> op it became
    arena: Arena | None = None  # where ``hoist`` places allocations; None: leave them
    inputs: list | None = None  # the real values of the graph's placeholders (Dynamo's example inputs)
    modules: ModuleTree | None = None  # the traced model's module tree, when known
    # module FQN as traced -> the module a reused graph runs for (another instance of its code)
    renamed: dict[str, str] | None = None

    def note(self, line: str) -> None:
        if line not in self.report:  # passes that look at the same calls may say the same thing
            self.report.append(line)
