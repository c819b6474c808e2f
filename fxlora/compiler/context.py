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
    skipped: dict[str, str] = field(default_factory=dict)  # target FQN -> why its LoRA is not served
    batch: object = None  # the input whose first dimension is the batch's rows (a real tensor), when known

    def note(self, line: str) -> None:
        if line not in self.report:  # passes that look at the same calls may say the same thing
            self.report.append(line)

    def skip(self, module: str, why: str, targets: list[str] | None = None) -> None:
        """``module`` stays as traced: report why, and keep the reason for each of its pool
        ``targets`` (default: the module itself), so a row that needs one hears it."""
        self.note(f"skipped {module}: {why}")
        for fqn in targets or [module]:
            self.skipped.setdefault(fqn, why)
