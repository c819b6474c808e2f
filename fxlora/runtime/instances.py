"""The variants of one traced graph for each module instance it runs for.

Dynamo compiles code, not modules: the frame of a module's own code (a layer's ``forward``
entered or resumed after a graph break) gives one graph, which later calls of the same code
reuse for other instances of the module, passing their parameters as inputs. The passes
wired the traced instance's pool factors into that graph. :class:`Instances` tells the
instances apart by the parameters a call passes (one per module that may carry LoRA,
compared by identity) and builds each other instance its own variants once, with the
graph's modules renamed to that instance's.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxlora.compiler.module_tree import ModuleTree
from fxlora.passes import Variants


class Instances:
    """One traced graph's variants: those of the traced instance, and of each other instance
    a call runs it for."""

    def __init__(
        self,
        traced: Variants,
        example_inputs: Sequence[Any],
        modules: ModuleTree | None,
        rebuild: Callable[[dict[str, str], list[Any]], Variants],
    ):
        """``rebuild(renamed, inputs)``: the variants of the same graph with its modules
        renamed (module FQN as traced -> this instance's), ``inputs`` the call's."""
        self.traced = traced
        self.modules = modules
        self._rebuild = rebuild
        self._index = [i for i, _, _ in traced.instance]
        self._params = tuple(example_inputs[i] for i in self._index)
        self._others: dict[tuple[int, ...], tuple[tuple[Any, ...], Variants | None]] = {}

    def of(self, args: Sequence[Any]) -> Variants | None:
        """The variants for the instance ``args`` run; None when that instance's modules
        cannot be named (its LoRA cannot be served, and the caller must not assume any)."""
        if not self._index:
            return self.traced
        params = tuple(args[i] for i in self._index)
        if all(map(operator.is_, params, self._params)):
            return self.traced
        key = tuple(map(id, params))
        known = self._others.get(key)
        if known is None or not all(map(operator.is_, params, known[0])):
            known = self._others[key] = (params, self._build(args, params))
        return known[1]

    def _build(self, args: Sequence[Any], params: tuple[Any, ...]) -> Variants | None:
        renamed: dict[str, str] = {}
        for (_, fqn, attr), now, then in zip(self.traced.instance, params, self._params, strict=True):
            owner = fqn if now is then else self._owner(now, fqn, attr)
            if owner is None or renamed.setdefault(fqn, owner) != owner:
                return None
        return self._rebuild({old: new for old, new in renamed.items() if old != new}, list(args))

    def _owner(self, param: Any, fqn: str, attr: str) -> str | None:
        """The one module of ``fqn``'s type that holds ``param`` as its ``attr``."""
        if self.modules is None or not isinstance(param, torch.Tensor):
            return None
        kind = self.modules.type_of(fqn)
        owners = [o for o, a in self.modules.owners(param, reread=True) if a == attr and self.modules.type_of(o) is kind]
        return owners[0] if len(owners) == 1 else None
