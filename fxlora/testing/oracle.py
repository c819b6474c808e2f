"""The correctness oracles: PEFT, one adapter at a time, on the rows that use it; the model
with one adapter merged into a copy of its weights; and the exact decomposition, the model's
own output with each targeted module's reference delta added onto it.

For a mixed batch the reference output of a row is what PEFT gives with that row's adapter
active (the unmodified model for ``None`` rows), computed on the sub-batch of rows sharing
the adapter. The merged oracle needs no PEFT at all: ``W + scaling · B @ A`` per module. The
decomposition needs neither PEFT nor access to the weights: the model runs its own base
computation (a quantised matmul PEFT does not wrap, say) and forward hooks add
``scaling · (x Aᵀ) Bᵀ`` onto the output of every module the row's adapter touches.
Tolerances live here, one per dtype: float32 compares by relative error, float16 / bfloat16
by the KL divergence of the per-token log-probabilities.

In float32 a row's output also depends on the batch it runs in (other rows, other padding,
other GEMM shapes): for a badly conditioned adapter (say rank 1 with scaling 64) PEFT
itself moves by more than ``RTOL`` between its sub-batch and the whole batch. Where a row
misses ``RTOL``, :func:`check_rows` measures the oracle's own float32 noise
(:func:`oracle_noise`: that spread, and the distance to the same oracle run in float64) and
allows ``NOISE_FACTOR`` times it instead.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

log = logging.getLogger(__name__)

# Relative error per row (||out - ref|| / ||ref||), float32.
RTOL = {torch.float32: 1e-5}
# Per-token KL(ref || out) of the log-softmax, half precision.
KL_TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3}
# float32: a row may differ from the oracle by this many times the oracle's own spread.
NOISE_FACTOR = 4
# Half-precision greedy decoding: a token may differ from the oracle's choice only where the
# oracle's own logits nearly tie (within this fraction of their largest magnitude), and at
# least GREEDY_AGREEMENT of the tokens must be the oracle's.
NEAR_TIE = 0.01
GREEDY_AGREEMENT = 0.97


def peft_model_with(model: torch.nn.Module, adapters: Mapping[str, Any]) -> Any:
    """A PeftModel over a copy of ``model`` holding every adapter (directories, or
    ``(config, state_dict)`` pairs), each with the factors it was saved with
    (:func:`_hold_as_saved`)."""
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict
    from peft.utils import load_peft_weights

    peft_model = None
    for name, source in adapters.items():
        if isinstance(source, tuple):
            config, state = source
            if peft_model is None:
                peft_model = get_peft_model(copy.deepcopy(model), copy.deepcopy(config), adapter_name=name)
            else:
                peft_model.add_adapter(name, copy.deepcopy(config))
            set_peft_model_state_dict(peft_model, state, adapter_name=name)
        else:
            state = load_peft_weights(source)
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(copy.deepcopy(model), source, adapter_name=name)
            else:
                peft_model.load_adapter(source, adapter_name=name)
        _hold_as_saved(peft_model, name, state)
    if peft_model is None:
        raise ValueError("no adapters given")
    return peft_model.eval()


@torch.no_grad()
def _hold_as_saved(peft_model: Any, name: str, saved: Mapping[str, torch.Tensor]) -> None:
    """Make PEFT hold adapter ``name``'s factors as saved, wherever its loading changed them.

    On transformers 5, PEFT passes adapter keys through the model's checkpoint conversion
    rules, meant for checkpoints of an older layout. An adapter saved from the
    model as it is needs none, and a rule that does not expect the current names mangles
    them: Laguna's ``WeightRenaming("mlp.shared_expert.", "mlp.shared_experts.")`` is a
    pattern whose ``.`` matches the ``s`` of ``shared_experts``, so PEFT looks for
    ``shared_experts..down_proj`` and leaves those LoRA layers at their initial values. The
    oracle is PEFT's computation with the adapter's own factors, so those are copied in."""
    from peft import get_peft_model_state_dict

    held = get_peft_model_state_dict(peft_model, adapter_name=name)  # views of the model's parameters
    changed = [k for k, v in saved.items() if k in held and not torch.equal(held[k], v.to(held[k]))]
    for key in changed:
        held[key].copy_(saved[key])
    if changed:
        log.warning("PEFT loaded %d tensor(s) of adapter %r other than saved (e.g. %s): the oracle uses them as saved",
                    len(changed), name, changed[0])  # fmt: skip


def _rows(inputs: Mapping[str, Any], index: list[int]) -> dict[str, Any]:
    batch = inputs["input_ids"].shape[0]
    return {
        k: v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v
        for k, v in inputs.items()
    }


@torch.no_grad()
def reference_logits(
    model: torch.nn.Module,
    peft_model: Any,
    adapter_names: Sequence[str | None],
    *,
    whole_batch: bool = False,
    **inputs: Any,
) -> torch.Tensor:
    """Logits of every row from PEFT with the row's adapter, or from ``model`` for ``None``:
    run on the sub-batch of rows sharing it, or with ``whole_batch`` on all rows (keeping
    those rows), which changes nothing but float rounding."""

    def run(name: str | None) -> torch.nn.Module:
        if name is None:
            return model
        peft_model.set_adapter(name)
        return peft_model

    return _per_adapter_logits(run, adapter_names, whole_batch, inputs)


def _per_adapter_logits(
    run: Callable[[str | None], torch.nn.Module], adapter_names: Sequence[str | None], whole_batch: bool, inputs: dict
) -> torch.Tensor:
    """Each row's logits from ``run(its adapter name)``, called once per distinct name, on the
    rows sharing it, or with ``whole_batch`` on all rows (keeping those rows)."""
    out = None
    for name in dict.fromkeys(adapter_names):
        index = [i for i, n in enumerate(adapter_names) if n == name]
        logits = run(name)(**(inputs if whole_batch else _rows(inputs, index))).logits
        if whole_batch:
            logits = logits[index]
        if out is None:
            out = logits.new_empty((len(adapter_names), *logits.shape[1:]))
        out[index] = logits
    return out


@torch.no_grad()
def merged_model(model: torch.nn.Module, adapter: Any) -> torch.nn.Module:
    """A copy of ``model`` with ``adapter`` (anything :func:`fxlora.adapters.read_adapter`
    takes) folded into its weights: ``W += scaling * B @ A`` for every module (or 2-D
    parameter) it touches, and for every expert of an experts parameter it touches, in any of
    the experts formats."""
    from transformers.pytorch_utils import Conv1D

    from fxlora.adapters import ModuleInfo, placement, read_adapter

    merged = copy.deepcopy(model)
    for fqn, f in placement.resolve(read_adapter("merged", adapter), merged).modules.items():
        if f.kind == "experts":  # W[e] += scaling * B[e] @ A[e], on the stored layout
            owner, _, name = fqn.rpartition(".")
            module, weight = merged.get_submodule(owner), getattr(merged.get_submodule(owner), name)
            delta = f.scaling * (f.b.double() @ f.a.double())  # (E, out, in); a shared factor broadcasts
            delta = delta.transpose(-1, -2) if getattr(module, "is_transposed", False) else delta
            setattr(module, name, torch.nn.Parameter(weight + delta.to(weight.dtype), requires_grad=False))
            continue
        module = merged.get_submodule(fqn)
        delta = f.scaling * (f.b.double() @ f.a.double())  # (out, in); for an embedding (dim, vocab)
        if isinstance(module, (Conv1D, torch.nn.Embedding)):  # weights stored (in, out) / (vocab, dim)
            delta = delta.T
        info = ModuleInfo.of(module) or ModuleInfo.over_parameter(module)  # a router: its one 2-D parameter
        name = info.parameter or "weight"
        weight = getattr(module, name)
        # a new tensor, not in place: tied weights (lm_head and embed_tokens) stay the base's
        # in the other module, as with unmerged LoRA
        setattr(module, name, torch.nn.Parameter(weight + delta.to(weight.dtype), requires_grad=False))
    return merged.eval()


@torch.no_grad()
def merged_logits(
    model: torch.nn.Module,
    adapters: Mapping[str, Any],
    adapter_names: Sequence[str | None],
    *,
    whole_batch: bool = False,
    **inputs: Any,
) -> torch.Tensor:
    """Logits of every row from ``model`` with the row's adapter merged in (``None``: as is),
    run on the sub-batch of rows sharing it, or with ``whole_batch`` on all rows."""
    def run(name: str | None) -> torch.nn.Module:
        return model if name is None else merged_model(model, adapters[name])

    return _per_adapter_logits(run, adapter_names, whole_batch, inputs)


@torch.no_grad()
def decomposed_logits(
    model: torch.nn.Module,
    adapters: Mapping[str, Any],
    adapter_names: Sequence[str | None],
    *,
    whole_batch: bool = False,
    **inputs: Any,
) -> torch.Tensor:
    """Logits of every row from ``model`` as it is, with the reference delta of the row's
    adapter (anything :func:`fxlora.adapters.read_adapter` takes) added onto the output of
    every linear and embedding module it touches, as PEFT's wrappers add it onto their base
    layer's (``None``: no delta); run on the sub-batch of rows sharing the adapter, or with
    ``whole_batch`` on all rows. MoE experts LoRA goes onto the output of each expert's GEMM
    (:class:`ExpertsDeltas`): ``model`` must then run transformers' eager experts loop
    (``experts_implementation="eager"``), one ``F.linear`` per expert."""

    def run(name: str | None) -> Callable[..., Any]:
        if name is None:
            return model
        factors = _resolved(model, name, adapters[name])
        hooks = {fqn: functools.partial(_add_delta, f) for fqn, f in factors.items() if f.kind != "experts"}
        experts = ExpertsDeltas(model, {fqn: f for fqn, f in factors.items() if f.kind == "experts"})

        def call(**rows: Any) -> Any:
            handles = [model.get_submodule(fqn).register_forward_hook(hook, with_kwargs=True) for fqn, hook in hooks.items()]
            try:
                with experts:
                    return model(**rows)
            finally:
                for h in handles:
                    h.remove()

        return call

    return _per_adapter_logits(run, adapter_names, whole_batch, inputs)


def _resolved(model: torch.nn.Module, name: str, adapter: Any) -> dict[str, Any]:
    """The adapter's factors per module (or experts parameter) of ``model``."""
    from fxlora.adapters import placement, read_adapter

    factors = placement.resolve(read_adapter(name, adapter), model).modules
    for fqn, f in factors.items():
        if f.kind not in ("linear", "embedding", "experts"):
            raise ValueError(f"the decomposition oracle adds deltas onto module outputs; adapter {name!r} has {f.kind} LoRA on {fqn!r}")
    return factors


class ExpertsDeltas(TorchFunctionMode):
    """While active, ``scaling · (x A[e]ᵀ) B[e]ᵀ`` is added onto each ``F.linear(x, W)``
    whose ``W`` is expert ``e`` of an experts parameter the adapter touches (``factors``: the
    parameter's FQN -> its ``"experts"`` factors), found by value: a plain tensor equal to
    ``parameter[e]``, or a tensor subclass (a quantised weight) whose inner tensors equal
    those of ``parameter[e]``. Leaving the mode raises if an adapted parameter saw no such
    call: the model ran no per-expert ``F.linear`` the deltas could go onto."""

    def __init__(self, model: torch.nn.Module, factors: Mapping[str, Any]) -> None:
        super().__init__()
        self.experts = []  # (parameter FQN, expert, its weight, factors)
        for fqn, f in factors.items():
            owner, _, name = fqn.rpartition(".")
            module = model.get_submodule(owner)
            if module.is_transposed:
                raise ValueError(f"the decomposition oracle adds experts deltas onto F.linear; {owner!r} stores its weights transposed")
            weight = getattr(module, name)
            self.experts += [(fqn, e, weight[e], f) for e in range(weight.shape[0])]
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.linear and self.experts:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            for fqn, e, expert, f in self.experts:
                if _same_tensor(weight, expert):
                    a, b = (t[e if t.shape[0] > 1 else 0].to(x.device) for t in (f.a, f.b))
                    out = out + (F.linear(F.linear(x.to(a.dtype), a), b) * f.scaling).to(out.dtype)
                    self.seen.add(fqn)
                    break
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        missed = sorted({fqn for fqn, *_ in self.experts} - self.seen)
        if missed and exc[0] is None:
            raise AssertionError(
                f"the decomposition oracle found no per-expert F.linear of {missed}: run the oracle model with "
                "experts_implementation='eager'"
            )
        self.seen = set()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if type(a) is not type(b) or a.shape != b.shape:
        return False
    if not is_traceable_wrapper_subclass(a):
        if a.dtype.itemsize == 1:  # float8 has no equal: compare the bytes
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        return a.dtype == b.dtype and torch.equal(a, b)
    names = a.__tensor_flatten__()[0]
    return names == b.__tensor_flatten__()[0] and all(_same_tensor(getattr(a, n), getattr(b, n)) for n in names)


def _add_delta(f: Any, module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    x = args[0] if args else next(iter(kwargs.values()))  # the module's one input
    if f.kind == "embedding":  # PEFT: F.embedding(ids, A.T) @ B.T * scaling, times the module's own embed_scale
        delta = (F.embedding(x, f.a.T.to(x.device)) @ f.b.T.to(x.device)) * f.scaling
        scale = getattr(module, "embed_scale", None)
        if scale is not None:
            delta = delta * torch.as_tensor(scale).to(delta.dtype)
    else:  # PEFT: lora_B(lora_A(x)) * scaling, in the factors' dtype
        delta = F.linear(F.linear(x.to(f.a.dtype), f.a.to(x.device)), f.b.to(x.device)) * f.scaling
    return output + delta.to(output.dtype)


def check_rows(
    out: torch.Tensor,
    ref: torch.Tensor,
    adapter_names: Sequence[str | None],
    mask: torch.Tensor | None = None,
    tolerance: float | None = None,
    noise: Callable[[], list[float]] | None = None,
    oracle: str = "the oracle",
) -> None:
    """Raise unless every row of ``out`` is within the dtype's tolerance of ``ref``. A float32
    row that misses it may still pass within ``NOISE_FACTOR`` times the oracle's own float32
    noise for that row, ``noise()`` (see :func:`oracle_noise`)."""
    tol = tolerance if tolerance is not None else {**RTOL, **KL_TOL}[ref.dtype]
    errors = row_errors(out, ref, mask)
    tols = [tol] * len(errors)
    if noise is not None and ref.dtype == torch.float32 and any(not e <= tol for e in errors):
        tols = [max(tol, NOISE_FACTOR * n) for n in noise()]
    bad = [(i, adapter_names[i], e, t) for i, (e, t) in enumerate(zip(errors, tols, strict=True)) if not e <= t]
    if bad:
        detail = ", ".join(f"row {i} ({n!r}): {e:.3g} (allowed {t:.3g})" for i, n, e, t in bad)
        raise AssertionError(f"fxlora differs from {oracle} ({ref.dtype}): {detail}")


def oracle_noise(
    reference: Callable[..., torch.Tensor],
    exact: Callable[..., torch.Tensor] | None,
    adapter_names: Sequence[str | None],
    **inputs: Any,
) -> list[float]:
    """Per row, the float32 noise of an oracle, measured two ways, the larger kept: how far
    ``reference`` (:func:`reference_logits` or :func:`merged_logits` with its model and
    adapters bound) moves between the rows' sub-batches and the whole batch; and how far it
    is from ``exact``, the same oracle over a float64 copy of the model (skipped when that
    cannot run)."""
    mask = inputs.get("attention_mask")
    apart = reference(adapter_names, **inputs)
    noise = row_errors(reference(adapter_names, whole_batch=True, **inputs), apart, mask)
    if exact is not None:
        try:
            precise = exact(adapter_names, **inputs)
        except (RuntimeError, NotImplementedError):  # a kernel without float64 support
            return noise
        noise = [max(a, b) for a, b in zip(noise, row_errors(apart, precise, mask), strict=True)]
    return noise


def row_errors(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None = None) -> list[float]:
    """Per row: relative error ``||out - ref|| / ||ref||`` (float32) or the largest per-token
    KL (half precision), over the positions ``mask`` keeps."""
    errors = []
    for i in range(out.shape[0]):
        keep = mask[i].bool() if mask is not None else torch.ones(out.shape[1], dtype=torch.bool)
        o, r = out[i][keep].float(), ref[i][keep].float()
        if ref.dtype in KL_TOL:
            logp_r, logp_o = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
            errors.append((logp_r.exp() * (logp_r - logp_o)).sum(-1).max().item())
        else:
            errors.append(((o - r).norm() / r.norm().clamp_min(1e-30)).item())
    return errors


def assert_matches_peft(
    compiled: Any,
    model: torch.nn.Module,
    adapters: Mapping[str, Any],
    adapter_names: Sequence[str | None],
    *,
    peft_model: Any = None,
    tolerance: float | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """Run ``compiled`` (an ``fxlora.CompiledModel``) on a mixed batch and check every row
    against PEFT with that row's adapter. Returns the compiled logits. For a base PEFT does not
    wrap, :func:`assert_matches_decomposition`.

    ``adapters`` maps names to what was loaded (directories or ``(config, state_dict)``);
    pass ``peft_model`` to reuse one built by :func:`peft_model_with`."""
    used = {n for n in adapter_names if n is not None}
    if peft_model is None and used:
        peft_model = peft_model_with(model, {n: adapters[n] for n in used})
    with torch.no_grad():
        out = compiled(adapter_names=list(adapter_names), **inputs).logits
    reference = functools.partial(reference_logits, model, peft_model)

    def exact(names, **rows):
        model64 = copy.deepcopy(model).double()
        return reference_logits(model64, peft_model_with(model64, {n: adapters[n] for n in used}), names, **rows)

    check_rows(
        out,
        reference(adapter_names, **inputs),
        adapter_names,
        inputs.get("attention_mask"),
        tolerance,
        noise=lambda: oracle_noise(reference, exact if used else None, adapter_names, **inputs),
        oracle="the PEFT oracle",
    )
    return out


def assert_matches_decomposition(
    compiled: Any,
    model: torch.nn.Module,
    adapters: Mapping[str, Any],
    adapter_names: Sequence[str | None],
    *,
    tolerance: float | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """:func:`assert_matches_peft` against the exact decomposition (:func:`decomposed_logits`):
    ``model``'s own output plus the reference delta of each row's adapter on every module it
    touches. For bases PEFT does not wrap, such as quantised layers; ``model`` must be the
    model ``compiled`` serves (as it was before compiling). Returns the compiled logits."""
    with torch.no_grad():
        out = compiled(adapter_names=list(adapter_names), **inputs).logits
    reference = functools.partial(decomposed_logits, model, adapters)
    check_rows(
        out,
        reference(adapter_names, **inputs),
        adapter_names,
        inputs.get("attention_mask"),
        tolerance,
        noise=lambda: oracle_noise(reference, None, adapter_names, **inputs),
        oracle="the decomposition oracle",
    )
    return out


def assert_greedy_agrees(tokens: torch.Tensor, logits: torch.Tensor, oracle: str = "the oracle") -> None:
    """Half precision: raise unless the greedy ``tokens`` (rows, steps) are the oracle's choice
    given the same prefix, ``logits.argmax(-1)`` (the oracle's logits at the positions that
    predicted them, teacher-forced), except at near-ties: where they differ, the chosen token's
    logit is within ``NEAR_TIE`` of the best (relative to the largest logit magnitude), and at
    least ``GREEDY_AGREEMENT`` of the tokens agree. Different summation orders (another GEMM
    split, two ranks' all-reduce) flip such ties and nothing else."""
    logits = logits.float()
    agree = (logits.argmax(-1) == tokens).float().mean().item()
    gaps = (logits.max(-1).values - logits.gather(-1, tokens[..., None])[..., 0]) / logits.abs().amax(-1)
    far = [(tuple(i), round(gaps[tuple(i)].item(), 4)) for i in (gaps > NEAR_TIE).nonzero().tolist()]
    if far or agree < GREEDY_AGREEMENT:
        raise AssertionError(
            f"greedy tokens differ from {oracle}: {agree:.4f} agree (at least {GREEDY_AGREEMENT} needed); "
            f"(row, step) and gap where the choice was not a near-tie (allowed {NEAR_TIE}): {far}"
        )


@torch.no_grad()
def reference_generate(
    model: torch.nn.Module,
    peft_model: Any,
    adapter_names: Sequence[str | None],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
) -> torch.Tensor:
    """Greedy new tokens of every row, ``(rows, max_new_tokens)``: ``transformers``'
    ``generate`` on the row's own unpadded prompt, with PEFT and the row's adapter (the
    unmodified model for ``None``); after the end token, ``pad_token_id``."""
    out = torch.full((len(adapter_names), max_new_tokens), pad_token_id, dtype=torch.long)
    for i, name in enumerate(adapter_names):
        prompt = input_ids[i] if attention_mask is None else input_ids[i][attention_mask[i].bool()]
        runner = model
        if name is not None:
            peft_model.set_adapter(name)
            runner = peft_model
        tokens = runner.generate(
            input_ids=prompt[None],
            attention_mask=torch.ones_like(prompt)[None],
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )[0, prompt.numel() :]
        out[i, : tokens.numel()] = tokens.cpu()
    return out
