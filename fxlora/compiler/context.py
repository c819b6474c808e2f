"""What the passes share: the adapter pool they wire in, the arena ``hoist`` plans into, and
the report ``explain()`` prints."""

from __future__ import annotations

from collections.abc import Iterable
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
    decode_attention: bool = False  # rewrite decode-step SDPA over the KV cache (for code run on CUDA)
    shrink_ahead: bool = False  # issue lora_delta's shrink before the traced base (for CUDA graphs' code)
    batch: object = None  # the input whose first dimension is the batch's rows (a real tensor), when known
    # module FQN as traced -> the module a reused graph runs for (another instance of its code)
    renamed: dict[str, str] | None = None
    left_traced: dict[str, str] = field(default_factory=dict)  # pool target FQN -> why a pass left it as traced

    def note(self, line: str) -> None:
        if line not in self.report:  # passes that look at the same calls may say the same thing
            self.report.append(line)

    def leave_traced(self, module: str, why: str, targets: Iterable[str] = ()) -> None:
        """A pass leaves ``module`` as traced: said in ``explain()``, and kept, for each of its
        pool ``targets`` (the module itself by default), for the error of a row whose adapter
        needs that LoRA."""
        self.note(f"skipped {module}: {why}")
        for target in targets or (module,):
            self.left_traced.setdefault(target, why)

    def served_after_all(self) -> None:
        """Forget the targets an earlier pass left as traced that a later one served
        (``lora_delta`` adds the delta onto what ``lora_linear`` could not replace)."""
        for fqn in sorted(self.left_traced.keys() & self.rewritten.keys()):
            del self.left_traced[fqn]
            self.report[:] = [line for line in self.report if not line.startswith(f"skipped {fqn}: ")]
