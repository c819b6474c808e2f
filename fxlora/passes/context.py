"""What the passes share: the adapter pool they wire in and the report ``explain()`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field

from fxlora.adapters import AdapterPool


@dataclass
class PassContext:
    pool: AdapterPool
    report: list[str] = field(default_factory=list)  # one line per decision, for explain()
    rewritten: dict[str, str] = field(default_factory=dict)  # module FQN -> op it became

    def note(self, line: str) -> None:
        self.report.append(line)
