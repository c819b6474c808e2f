"""Read PEFT LoRA adapters into per-module factors with their scaling resolved.

An adapter comes from a saved PEFT directory (``adapter_config.json`` plus
``adapter_model.safetensors`` or ``adapter_model.bin``) or from memory as a config and a
state dict. Everything that can be checked without the model is checked here: the name,
the files, the PEFT type, unsupported features, the config's fields (ranks, alphas, patterns,
target modules), tensor names, dtypes, devices, ranks and finite values. Fitting the factors
to the model's modules is the pool's job.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxlora.errors import AdapterError, AdapterWarning

if TYPE_CHECKING:  # peft is imported when an adapter is read: importing it pulls in torchao and bitsandbytes
    from peft import LoraConfig

# Config fields whose truthy value asks for something other than plain LoRA.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias (lora_bias)",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "layer_replication",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing (arrow_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "megatron_config": "Megatron parallel layers (megatron_config)",
}
# initialisations under which PEFT, loading the adapter, rewrites the base weights too
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

_PREFIX = "base_model.model."
# `<module>.lora_A.weight`, also with an adapter name before `.weight` as in a PeftModel's
# own state_dict(); embeddings store bare `lora_embedding_A` / `lora_embedding_B` tensors.
_FACTOR_KEY = re.compile(
    r"^(?P<module>.+)\.(?:lora_(?P<ab>[AB])(?:\.(?P<an>[^.]+))?\.weight|lora_embedding_(?P<eab>[AB])(?:\.(?P<ean>[^.]+))?)$"
)
_BASE_KEY = re.compile(r"^(?P<module>.+)\.base_layer\.weight$")
_WHOLE_WEIGHT_KEY = re.compile(r"^(?P<module>.+)\.weight$")  # a module's own weight: save_embedding_layers
_FEATURE_KEYS = {
    "lora_magnitude_vector": "DoRA (lora_magnitude_vector)",
    "lora_B.bias": "LoRA bias (lora_B.bias)",
    "modules_to_save": "modules_to_save",
    "trainable_tokens": "trainable tokens",
}

# A PEFT config is a flat JSON object of a few kB whose deepest field (layer_replication)
# nests three levels; these bounds leave ample room and refuse hostile files before they
# exhaust memory or the interpreter's recursion limit.
MAX_CONFIG_BYTES = 16 * 2**20
MAX_CONFIG_DEPTH = 16

AdapterSource = Union[str, os.PathLike, tuple, Mapping, "LoraAdapter"]


@dataclass(frozen=True)
class LoraFactors:
    """One module's LoRA: ``delta = scaling * (x @ a.T) @ b.T``; for an embedding ``x`` is one-hot.

    ``"parameter"``: the factors of a PEFT ``target_parameters`` wrapper as saved, keyed by
    the wrapper's path, ``a (E·r, in)``, ``b (out, r·E)`` (``E`` 1 for a 2-D parameter). Only
    the model tells which parameter the wrapper adapts, and so its rank and scaling
    (:mod:`fxlora.adapters.placement`): ``scaling`` is None until then. A 3-D experts
    parameter's becomes ``"experts"``: ``a (E_a, r, in)``, ``b (E_b, out, r)`` per expert,
    ``E_a`` or ``E_b`` 1 when that factor is shared by all experts; a 2-D one's ``"linear"``."""

    kind: Literal["linear", "embedding", "parameter", "experts"]
    a: torch.Tensor  # (r, in_features); for an embedding (r, num_embeddings)
    b: torch.Tensor  # (out_features, r); for an embedding (embedding_dim, r)
    scaling: float | None  # None for "parameter": placing it on the model resolves it
    format: str | None = None  # how an "experts" LoRA was written, for explain()

    @property
    def rank(self) -> int:
        return self.a.shape[-2] if self.kind == "experts" else self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """A validated LoRA adapter: factors per module FQN (relative to the model PEFT wrapped)."""

    name: str
    source: str  # the file it came from, or "<memory>"
    config: LoraConfig
    modules: dict[str, LoraFactors]
    base_weights: dict[str, torch.Tensor]  # base weights PEFT saved beside embedding LoRA

    @property
    def max_rank(self) -> int:
        return max((f.rank for f in self.modules.values()), default=0)


def read_adapter(name: str, source: AdapterSource) -> LoraAdapter:
    """Read a PEFT LoRA adapter from a directory, a ``(config, state_dict)`` pair, a mapping
    with ``config`` and ``state_dict`` keys, or an existing :class:`LoraAdapter`."""
    check_name(name)
    if isinstance(source, LoraAdapter):
        return dataclasses.replace(source, name=name)
    if isinstance(source, (str, os.PathLike)):
        config_dict, state, where = _read_directory(name, Path(source))
    elif isinstance(source, tuple) and len(source) == 2:
        config_dict, state, where = _config_dict(name, source[0]), _state_dict(name, source[1]), "<memory>"
    elif isinstance(source, Mapping) and {"config", "state_dict"} <= set(source):
        config_dict, state = _config_dict(name, source["config"]), _state_dict(name, source["state_dict"])
        where = "<memory>"
    else:
        raise AdapterError(
            f"adapter {name!r}: expected a PEFT adapter directory, a (config, state_dict) pair or "
            f"{{'config': ..., 'state_dict': ...}}, got {type(source).__name__}"
        )
    config = _lora_config(name, where, config_dict)
    modules, base_weights = _factors(name, where, config, state)
    if not modules:
        raise AdapterError(f"adapter {name!r} ({where}): holds no LoRA weights")
    return LoraAdapter(name, where, config, modules, base_weights)


BASE_NAME = "__base__"  # PEFT's name for a base-model row; in adapter_names it means None


def check_name(name: object) -> None:
    """Adapter names are non-empty strings other than ``"__base__"``: ``None`` (or PEFT's
    ``"__base__"``) in ``adapter_names`` means the base model."""
    if not isinstance(name, str) or not name:
        hint = ": None stands for the base model in adapter_names" if name is None else ""
        raise AdapterError(f"adapter name {name!r} is not a non-empty string{hint}")
    if name == BASE_NAME:
        raise AdapterError(f"adapter name {name!r} is reserved: in adapter_names it means the base model, as in PEFT")


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def directory_stamp(path: Path) -> tuple:
    """What tells an adapter directory's files from others written there later: each file's
    size, modification time and inode."""
    stamp = []
    for file in ADAPTER_FILES:
        try:
            st = (path / file).stat()
        except OSError:
            continue
        stamp.append((file, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(stamp)


def _read_directory(name: str, path: Path) -> tuple[dict, dict[str, torch.Tensor], str]:
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a directory")
    config_file = path / "adapter_config.json"
    try:
        if (size := config_file.stat().st_size) > MAX_CONFIG_BYTES:
            raise AdapterError(f"adapter {name!r}: {config_file} is {size} bytes, more than {MAX_CONFIG_BYTES} allowed")
        config_dict = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"adapter {name!r}: missing {config_file}") from None
    except RecursionError:
        raise AdapterError(f"adapter {name!r}: cannot read {config_file}: it nests too deeply") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise AdapterError(f"adapter {name!r}: cannot read {config_file}: {e}") from None
    if not isinstance(config_dict, dict):
        raise AdapterError(f"adapter {name!r}: {config_file} does not hold a JSON object")
    safetensors_file, bin_file = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if safetensors_file.exists():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(safetensors_file)
        except (SafetensorError, OSError, ValueError) as e:
            raise AdapterError(f"adapter {name!r}: cannot read {safetensors_file}: {e}") from None
        return config_dict, state, str(safetensors_file)
    if bin_file.exists():
        try:
            state = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises many types for a bad file; all mean the same here
            raise AdapterError(f"adapter {name!r}: cannot read {bin_file}: {e}") from None
        if not isinstance(state, dict):
            raise AdapterError(f"adapter {name!r}: {bin_file} does not hold a state dict")
        return config_dict, state, str(bin_file)
    raise AdapterError(f"adapter {name!r}: missing weights: neither {safetensors_file} nor {bin_file} exists")


def _config_dict(name: str, config: Any) -> dict:
    from peft import PeftConfig

    try:
        if isinstance(config, PeftConfig):
            return config.to_dict()
    except RecursionError:
        raise AdapterError(f"adapter {name!r} (<memory>): its config nests too deeply") from None
    if isinstance(config, Mapping):
        return dict(config)
    raise AdapterError(f"adapter {name!r}: config must be a peft.LoraConfig or a dict, got {type(config).__name__}")


def _state_dict(name: str, state: Any) -> dict:
    if not isinstance(state, Mapping):
        kind = type(state).__name__
        raise AdapterError(f"adapter {name!r} (<memory>): state_dict must map names to tensors, got {kind}")
    return dict(state)


def _check_depth(name: str, where: str, config_dict: dict) -> None:
    """Refuse a config nested deeper than :data:`MAX_CONFIG_DEPTH` (a cycle included), without recursing."""
    stack: list[tuple[Any, int]] = [(config_dict, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise AdapterError(f"adapter {name!r} ({where}): its config nests more than {MAX_CONFIG_DEPTH} levels deep")
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in value)


_LISTS = (list, tuple, set, frozenset)


def _is_rank(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def _is_alpha(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_index(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _is_names(value: Any) -> bool:
    return isinstance(value, _LISTS) and all(isinstance(v, str) for v in value)


def _check_fields(name: str, where: str, config: dict) -> None:
    """The fields PEFT computes with or matches by: numbers of the right kind, patterns that compile."""

    def fail(field: str, value: Any, want: str) -> NoReturn:
        raise AdapterError(f"adapter {name!r} ({where}): config field {field} must be {want}, got {value!r}")

    def check_regex(field: str, value: str, pattern: str) -> None:
        try:
            re.compile(pattern)
        except re.error as e:
            fail(field, value, f"a valid regular expression ({e})")

    if "r" in config and not _is_rank(config["r"]):
        fail("r", config["r"], "a positive int")
    if "lora_alpha" in config and not _is_alpha(config["lora_alpha"]):
        fail("lora_alpha", config["lora_alpha"], "a finite number")
    patterns = (("rank_pattern", _is_rank, "a positive int"), ("alpha_pattern", _is_alpha, "a finite number"))
    for field, valid, want in patterns:
        pattern = config.get(field)
        if pattern is not None and not isinstance(pattern, Mapping):
            fail(field, pattern, "a dict of module patterns to values")
        for key, value in (pattern or {}).items():
            if not isinstance(key, str) or not key:
                fail(f"{field} key", key, "a non-empty string")
            check_regex(f"{field} key", key, rf"(.*\.)?({key})$")  # how PEFT matches a key to a module path
            if not valid(value):
                fail(f"{field}[{key!r}]", value, want)
    targets, parameters = config.get("target_modules"), config.get("target_parameters")
    if parameters is not None and not _is_names(parameters):
        fail("target_parameters", parameters, "a list of parameter names")
    if targets is None and not parameters:
        raise AdapterError(f"adapter {name!r} ({where}): config has no target_modules (nor target_parameters)")
    for field in ("target_modules", "exclude_modules"):
        value = config.get(field)
        if isinstance(value, str):
            check_regex(field, value, value)
        elif value is not None and not _is_names(value):
            fail(field, value, "a list of module names or a regular expression string")
    layers = config.get("layers_to_transform")
    if layers is not None and not (_is_index(layers) or isinstance(layers, _LISTS) and all(map(_is_index, layers))):
        fail("layers_to_transform", layers, "a layer index or a list of them")


def _lora_config(name: str, where: str, config_dict: dict) -> LoraConfig:
    _check_depth(name, where, config_dict)
    peft_type = str(config_dict.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.")
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name!r} ({where}): unsupported PEFT type {peft_type}: only LORA is supported")
    for key, feature in UNSUPPORTED_FEATURES.items():
        if config_dict.get(key):
            raise AdapterError(f"adapter {name!r} ({where}): unsupported PEFT feature: {feature}")
    if config_dict.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r} ({where}): unsupported PEFT feature: trained biases (bias={config_dict['bias']!r})")
    init = config_dict.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise AdapterError(
            f"adapter {name!r} ({where}): init_lora_weights={init!r}: PEFT rewrites the base weights when it loads such "
            "an adapter, and fxlora serves the base as it is: save the adapter as a plain LoRA (PEFT's "
            "path_initial_model_for_weight_conversion) to serve it"
        )
    _check_fields(name, where, config_dict)
    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    if unknown := sorted(k for k in config_dict if k not in known and k != "peft_type"):
        warnings.warn(
            f"adapter {name!r} ({where}): config fields this PEFT does not know are ignored: {unknown}",
            AdapterWarning,
            stacklevel=4,
        )
    dropped = {"peft_type", "runtime_config"}
    dropped |= {k for k in ("rank_pattern", "alpha_pattern") if config_dict.get(k) is None}  # null: none, PEFT's {}
    kwargs = {k: v for k, v in config_dict.items() if k in known and k not in dropped}
    try:
        return LoraConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise AdapterError(f"adapter {name!r} ({where}): invalid LoRA config: {e}") from None


def _factors(
    name: str, where: str, config: LoraConfig, state: dict[str, torch.Tensor]
) -> tuple[dict[str, LoraFactors], dict[str, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, str] = {}
    base_weights: dict[str, torch.Tensor] = {}
    names: set[str | None] = set()  # the adapter names within the keys (a PeftModel's state_dict() has them)
    unprefixed = []
    for key, tensor in state.items():
        if not isinstance(key, str):
            raise AdapterError(f"adapter {name!r} ({where}): state dict key {key!r} is not a string")
        if not key.startswith(_PREFIX):
            unprefixed.append(key)
        key = key.removeprefix(_PREFIX)
        for marker, feature in _FEATURE_KEYS.items():
            if marker in key:
                raise AdapterError(f"adapter {name!r} ({where}): unsupported PEFT feature: {feature} in tensor {key!r}")
        _check_tensor(name, where, key, tensor)
        if (m := _BASE_KEY.match(key)) is not None:
            base_weights[m["module"]] = tensor
            continue
        m = _FACTOR_KEY.match(key)
        if m is None and (whole := _WHOLE_WEIGHT_KEY.match(key)) is not None:
            raise AdapterError(
                f"adapter {name!r} ({where}): tensor {key!r} is the whole weight of module {whole['module']!r} (PEFT saves "
                "embedding layers so with save_embedding_layers, or after the vocabulary was resized): fxlora serves "
                "LoRA factors onto the model's own weights; save the adapter with save_embedding_layers=False"
            )
        if m is None:
            raise AdapterError(f"adapter {name!r} ({where}): unrecognised tensor {key!r}")
        module, ab = without_outer_wrappers(m["module"]), m["ab"] or m["eab"]
        kinds[module] = "linear" if m["ab"] else "embedding"
        halves.setdefault(module, {})[ab] = tensor
        names.add(m["an"] or m["ean"])
    if len(names) > 1:
        shown = sorted(n or "(none)" for n in names)
        raise AdapterError(
            f"adapter {name!r} ({where}): its tensors hold the LoRA of several adapters (named {shown} in their keys): "
            "give one adapter's, as PEFT's save_pretrained writes them"
        )
    if unprefixed and where != "<memory>":
        warnings.warn(
            f"adapter {name!r} ({where}): {len(unprefixed)} tensor key(s) lack PEFT's {_PREFIX!r} prefix (e.g. "
            f"{unprefixed[0]!r}): PEFT loads none of them and serves the base model; fxlora reads them as module paths",
            AdapterWarning,
            stacklevel=4,
        )

    modules: dict[str, LoraFactors] = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            missing = "A" if "A" not in ab else "B"
            raise AdapterError(f"adapter {name!r} ({where}): module {module!r} lacks its lora_{missing} tensor")
        a, b = ab["A"], ab["B"]
        if kinds[module] == "linear" and _may_wrap_parameter(config, module):
            if a.dim() != 2 or b.dim() != 2:
                raise AdapterError(
                    f"adapter {name!r} ({where}): target_parameters LoRA {module!r} has lora_A {tuple(a.shape)} and "
                    f"lora_B {tuple(b.shape)}, which are not (experts * r, in) and (out, r * experts)"
                )
            modules[module] = LoraFactors("parameter", a, b, None)
            continue
        if not all_linear_selects(config.target_modules, kinds[module]) and not selects_module(config, module):
            tying = getattr(config, "ensure_weight_tying", False)  # (PEFT 0.21.2 on)
            tied = " (ensure_weight_tying=True ties the output head's LoRA to the embedding's: not served)" if tying else ""
            raise AdapterError(
                f"adapter {name!r} ({where}): holds weights for module {module!r}, which its "
                f"target_modules / exclude_modules / layers_to_transform do not select{tied}"
            )
        modules[module] = module_factors(name, where, config, module, kinds[module], a, b)
    return modules, base_weights


def module_factors(name: str, where: str, config: LoraConfig, module: str, kind: str, a, b) -> LoraFactors:
    """The LoRA of ``module`` (a ``target_modules`` target), its rank checked against the config."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(
            f"adapter {name!r} ({where}): module {module!r} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, which are not (r, in) and (out, r)"
        )
    r, scaling = rank_and_scaling(config, module)
    if a.shape[0] != r:
        raise AdapterError(
            f"adapter {name!r} ({where}): module {module!r} has rank {a.shape[0]} (lora_A {tuple(a.shape)}) "
            f"but its config gives r={r}"
        )
    return LoraFactors(kind, a, b, scaling)


def selects_module(config: LoraConfig, module: str) -> bool:
    """Whether ``target_modules`` / ``exclude_modules`` / ``layers_to_transform`` select
    ``module``, as PEFT matches them."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return bool(check_target_module_exists(config, module))


def all_linear(target_modules: object) -> bool:
    """Whether ``target_modules`` is PEFT's ``"all-linear"`` shorthand (in any case)."""
    return isinstance(target_modules, str) and target_modules.lower() == "all-linear"


def all_linear_selects(
    target_modules: object, kind: str | None, parameter: str | None = None, output_embedding: bool = False
) -> bool:
    """PEFT's ``"all-linear"`` rule (``_maybe_include_all_linear_layers``): with that
    shorthand for ``target_modules``, every linear module — ``nn.Linear`` and its subclasses
    (bitsandbytes' ``Linear4bit``), transformers' ``Conv1D`` — but the model's output
    embedding. ``kind`` is the module's (``ModuleInfo.kind``), or, read without the model, that
    of the LoRA an adapter holds for it; ``parameter``: the module is a linear only as the
    ``F.linear`` of a 2-D parameter of its own (an MoE router, ``ModuleInfo.over_parameter``),
    which PEFT's rule, by type, does not pick; ``output_embedding``: the module is the model's
    output head (``get_output_embeddings()``), when known."""
    return all_linear(target_modules) and kind == "linear" and parameter is None and not output_embedding


def _check_tensor(name: str, where: str, key: str, tensor: Any) -> None:
    """A dense floating-point tensor with values: not meta or fake, not NaN or Inf."""
    culprit = f"adapter {name!r} ({where}): tensor {key!r}"
    if not isinstance(tensor, torch.Tensor):
        raise AdapterError(f"adapter {name!r} ({where}): entry {key!r} is not a tensor")
    if tensor.is_meta or isinstance(tensor, FakeTensor):
        raise AdapterError(f"{culprit} has no values (on the meta device, or fake): load the weights themselves")
    if tensor.layout != torch.strided:
        raise AdapterError(f"{culprit} is {tensor.layout}, not a dense tensor")
    if not tensor.is_floating_point():
        raise AdapterError(f"{culprit} has dtype {tensor.dtype}, not a floating-point dtype")
    if not torch.isfinite(tensor).all():
        raise AdapterError(f"{culprit} holds NaN or Inf values")


def unwrapped(path: str) -> str:
    """A PEFT wrapper path without its ``.base_layer`` parts: the module that owns the parameter."""
    return re.sub(r"(\.base_layer)+$", "", path)


def without_outer_wrappers(path: str) -> str:
    """``path`` without the ``.base_layer`` parts of its ancestors: a module inside a module whose
    parameter PEFT wraps (``head.base_layer.mlp.fc2``, where ``head`` holds a 3-D parameter) is
    the model's ``head.mlp.fc2``; the trailing ones, its own wrappers, stay."""
    parts = path.split(".")
    own = len(parts)
    while own > 0 and parts[own - 1] == "base_layer":
        own -= 1
    return ".".join([p for p in parts[:own] if p != "base_layer"] + parts[own:])


def targets_parameter(config: LoraConfig, key: str) -> bool:
    """Whether ``target_parameters`` names the parameter at path ``key``, as PEFT matches it:
    the whole path, or a suffix after a dot (a bare ``"gate_up_proj"`` names that parameter
    of every module)."""
    return any(key == e or key.endswith("." + e) for e in config.target_parameters or ())


def _may_wrap_parameter(config: LoraConfig, module: str) -> bool:
    """Whether ``module`` may be PEFT's wrapper of a ``target_parameters`` entry; which
    parameter it adapts, if any, only the model tells. Only those wrappers nest
    (``.base_layer``); a module ``target_modules`` names PEFT wraps as a module, and refuses
    to wrap its parameters as well (``"all-linear"`` names modules by their type, which only
    the model tells)."""
    entries = config.target_parameters or ()
    owner = unwrapped(module)
    if not entries or owner != module:
        return bool(entries)
    if not all_linear(config.target_modules) and selects_module(config, module):
        return False
    owners = [e.rpartition(".")[0] for e in entries]  # "" for a bare name: any module may hold it
    return any(not o or owner == o or owner.endswith("." + o) for o in owners)


def rank_and_scaling(config: LoraConfig, path: str) -> tuple[int, float]:
    """The rank and ``alpha / r`` (``/ sqrt(r)`` with rsLoRA) PEFT gives the module or
    parameter at ``path`` through ``rank_pattern`` / ``alpha_pattern``."""
    from peft.utils.other import get_pattern_key

    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), path), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), path), config.lora_alpha)
    return r, alpha / math.sqrt(r) if config.use_rslora else alpha / r
