"""Which module of the model a traced call belongs to: the model's module tree, and the
module paths Dynamo records.

Dynamo records, on every node it traces inside a module's ``forward``, that module in
``nn_module_stack``: a key (``id(module)``, with ``@<n>`` for its n-th call) and a path from
the traced frame's root (``L['self'].model.layers[0]``). :func:`module_fqn` turns a path into
an FQN; :class:`ModuleTree` resolves an entry against the model itself, by identity first.
The ``annotate`` pass writes what they find onto the nodes.
"""

from __future__ import annotations

import re

import torch

# A Dynamo source's root: a local or global of the traced frame and any subscripts after it
# (``L['self']``, ``L['args'][0]``, ``L['kwargs']['model']``, ``G['model']``).
_ROOT = re.compile(r"^[LG]\[(['\"])[^'\"]*\1\](?:\[[^\]]*\])*\.?")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def module_fqn(path: str) -> str:
    """``L['self'].model.layers[0]._modules['mlp']`` -> ``model.layers.0.mlp``."""
    path = _ROOT.sub("", path)
    path = _INDEX.sub(r".\1", path).replace("._modules.", ".").lstrip(".")
    return path.removeprefix("_modules.")


def renamed(fqn: str, renames: dict[str, str]) -> str:
    """``fqn`` with its longest prefix found in ``renames`` replaced."""
    parts = fqn.split(".")
    for i in range(len(parts), 0, -1):
        new = renames.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return fqn


class AttributionError(RuntimeError):
    """No call of a traced graph could be attributed to a module of the model."""


class ModuleTree:
    """Every submodule of a model: its FQN by identity, and its type by FQN; and which
    modules hold each parameter."""

    def __init__(self, model: torch.nn.Module):
        named = list(model.named_modules(remove_duplicate=False))
        self._fqn = {id(m): name for name, m in reversed(named)}  # a shared module: its first name
        self._type = {name: type(m) for name, m in named}
        self._model = model
        self._owners = self._parameters()

    def _parameters(self) -> dict[int, tuple[torch.Tensor, list[tuple[str, str]]]]:
        """id(parameter) -> (the parameter, its (module FQN, attribute) holders); the
        parameter is kept so that an id reused by a later object never matches."""
        owners: dict[int, tuple[torch.Tensor, list[tuple[str, str]]]] = {}
        for name, m in self._model.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), (p, []))[1].append((name, attr))
        return owners

    def owners(self, tensor: object, reread: bool = False) -> list[tuple[str, str]]:
        """The ``(module FQN, attribute)`` pairs that hold ``tensor`` as a parameter; with
        ``reread``, read again from the model when ``tensor`` is new (a parameter replaced
        since)."""
        entry = self._owners.get(id(tensor))
        if reread and (entry is None or entry[0] is not tensor):
            self._owners = self._parameters()
            entry = self._owners.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else []

    def type_of(self, fqn: str) -> type | None:
        return self._type.get(fqn)

    def resolve(self, key: str, path: str, module_type: type | None) -> str | None:
        """The FQN of the ``nn_module_stack`` entry ``key: (path, module_type)``, or None."""
        ident = key.partition("@")[0]  # Dynamo adds "@<n>" to the key of a repeated call
        fqn = self._fqn.get(int(ident)) if ident.isdigit() else None
        if fqn is not None and self._matches(fqn, module_type):
            return fqn
        fqn = module_fqn(path)
        if fqn in self._type:
            return fqn if self._matches(fqn, module_type) else None
        parts = fqn.split(".")
        for i in range(1, len(parts)):  # the path has a prefix the tree lacks (``__self__.``)
            if self._matches(suffix := ".".join(parts[i:]), module_type):
                return suffix
        ending = [name for name in self._type if name.endswith("." + fqn) and self._matches(name, module_type)]
        return ending[0] if len(ending) == 1 else None

    def _matches(self, fqn: str, module_type: type | None) -> bool:
        found = self._type.get(fqn)
        return found is not None and (module_type is None or found is module_type)
