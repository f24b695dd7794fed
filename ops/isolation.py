"""``check_isolation``: does any information cross a sequence boundary of a packed row?

Run it on any model (ours or not) and a packed batch. It perturbs the tokens of one sequence and
measures, for every other sequence of the batch:

- the largest change of its outputs (a forward leak),
- the largest change of the gradient reaching its input embeddings from the other sequences'
  outputs (a backward pass that mixes sequences even where the forward does not),
- the largest gradient flowing from the perturbed sequence's outputs into its inputs, and from its
  outputs into the perturbed sequence's inputs.

For a packing-safe model in exact arithmetic all are zero::

    capacity 12      seq 0 (5)         seq 1 (3)  seq 2 (3)  pad
    input_ids     [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 c1 c2 | 0 ]   perturb seq 0 ->
    outputs       [ changes ...    |   0      |   0      | 0 ]   must not change

Parameter gradients sum over every token of the batch, so they are not compared per sequence; the
per-token input gradients above are what isolation means for them.

Real kernels are not exact arithmetic, and two things make a safe model show tiny non-zero changes.
The report tells them from a leak by itself, so nobody has to guess a tolerance:

1. **Run-to-run noise** (backward kernels that add with atomics: their last bits vary between two
   identical calls). ``check_isolation`` runs the unperturbed batch twice (forward and the same
   backward passes), and each perturbed batch twice too, and takes the largest difference between
   identical runs per quantity: the *noise floor* of the outputs and of the input gradients
   (``report.output_floor``, ``report.grad_floor``). A change counts only above
   ``limit = FLOOR_FACTOR * floor`` (4x: a change measured on one sequence is a maximum
   over fewer values than the floor, which is a maximum over the whole batch). With deterministic
   algorithms on (``torch.use_deterministic_algorithms(True)``, or ``deterministic=True``, which
   turns them on for the check) the limit is exactly 0, and a packing-safe model on deterministic
   kernels (ours on CPU and GPU) reports exactly 0 everywhere. ``atol=`` overrides the limit.
2. **Rounding that depends on another sequence** (not on its content in exact arithmetic).
   mamba-ssm's Mamba-2 chunk scan with ``seq_idx`` forms ``exp(dA_cumsum[m] - dA_cumsum[k])`` from
   cumulative sums that run across boundaries: an earlier sequence's dt cancels exactly in theory and
   changes only the rounding of a later one's outputs (``benchmarks/gpu/mamba2_rounding.py``).
   Every change above the limit is therefore probed: the same sequence is perturbed three more
   times, with its perturbation scaled by ``probe_scale`` = 1/16, by 2/16 and by -1/16, between the
   unperturbed input and the perturbed one (for ``input_ids``: on the embedding's output). A leak is
   a smooth function of its cause, so for small perturbations its effect is linear: element by
   element, the 2/16 probe changes the observed sequence twice as much as the 1/16 one (``P2 = 2
   P1``), the -1/16 one as much the other way (``P(-1) = -P1``), and all of them less than the full
   perturbation. Rounding is not linear: a small change of the earlier values flips the last bits of
   other elements, or none at all (a cumulative sum that stays in its binade rounds the same way),
   as much for a small perturbation as for a large one. A change ``c`` (full perturbation) is

   - ``"leak"`` if ``c`` exceeds ``rounding_rtol`` times the observed sequence's own magnitude
     ``s`` (its largest output, or largest input gradient), whatever the probes say; or if
     ``max|P2|`` is resolved (above ``4 * eps * s`` plus two noise floors), at most ``c / 2``, and
     ``max(max|P2 - 2 P1|, 2 max|P(-1) + P1|) <= max|P2| / 2`` (plus three noise floors);
   - ``"rounding"`` otherwise: small relative to the sequence, and gone under a small perturbation,
     not shrinking with it, or not linear in it.

   ``rounding_rtol`` defaults to 1e-6 for float64, 1e-2 for float32 (Triton kernels such as Mamba-2's
   compute fp32 products in TF32, 10-bit mantissas) and 5e-2 for 16-bit types (the lowest precision
   of the outputs and the perturbed input). Gradients from one sequence's outputs into another's
   inputs cannot be probed (they are no change of anything); they are rounding only up to
   ``min(64 * eps, rounding_rtol)`` of the gradient's own scale, otherwise a leak.

Each (perturbed, observed) pair and the report as a whole are classified ``"none"`` / ``"rounding"`` /
``"leak"``; ``report.ok`` is true unless something leaks (``allow_rounding=False``: unless anything
changes at all). The floors, limits, largest changes and the classification are in ``repr(report)``;
``str(report)`` adds a table. What it cannot see: a leak smaller than the limit (4x the noise floor;
none in deterministic mode); a leak so small that 1/8 of it is not resolved (about ``32 * eps`` of
the observed sequence's scale, 4e-6 in float32), which is called rounding; a leak that is not linear
in its cause and stays within ``rounding_rtol`` of the observed sequence (a step function of another
sequence, for example).

Cost: ``model_fn`` runs 2 + 2 x (perturbed sequences) times, plus 3 times for each perturbed sequence
whose perturbation changes anything above the limit; each run with one backward pass per loss.

Example::

    >>> report = ops.check_isolation(lambda b: model(b["input_ids"], position_ids=b["position_ids"]).logits,
    ...                              batch, embedding=model.backbone.embedding)
    >>> assert report.ok, report
    >>> report
    IsolationReport(ok=True, classification='none', max_output_change=0.000e+00, output_floor=0.000e+00, ...)
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .boundaries import cu_seqlens_to_position_ids, position_ids_to_seq_idx, seq_idx_to_position_ids

__all__ = ["check_isolation", "IsolationReport", "SequenceResult"]

NONE, ROUNDING, LEAK = "none", "rounding", "leak"
_RANK = {NONE: 0, ROUNDING: 1, LEAK: 2}
FLOOR_FACTOR = 4.0  # a change counts above this many noise floors (default mode)
PROBE_SCALE = 2.0 ** -4  # the probes perturb by this fraction of the full perturbation, and by twice that
PROBE_NOISE = 3.0  # floors of run-to-run noise allowed in the probes' comparisons
RESOLUTION_EPS = 4.0  # a probe change is resolved above this many eps of the sequence's scale
LINEARITY = 0.5  # max|P2 - 2 P1| and 2 max|P(-1) + P1| up to this fraction of max|P2|: linear
SHRINK = 0.5  # a leak's max|P2| (2/16 of the perturbation) is at most this fraction of the full change
DIRECT_EPS = 64.0  # direct cross-sequence gradients: rounding up to this many eps of their scale


def _worse(*kinds: str) -> str:
    return max(kinds, key=_RANK.__getitem__) if kinds else NONE


@dataclasses.dataclass
class SequenceResult:
    """One (perturbed sequence, other sequence) pair."""

    target: int  # index of the perturbed sequence (in batch order)
    other: int  # index of the observed sequence
    row: int
    start: int
    length: int
    output_change: float
    grad_change: Optional[float]  # change of d(loss of the others)/d(input of this sequence)
    grad_leak: Optional[float]  # |d(loss of the target)/d(input of this sequence)|
    output_probe: Optional[float] = None  # max|P2|: output change with the perturbation scaled by 2 * probe_scale
    grad_probe: Optional[float] = None  # the same for grad_change
    output_nonlinearity: Optional[float] = None  # max(max|P2 - 2 P1|, 2 max|P(-1) + P1|) (P1: at probe_scale)
    grad_nonlinearity: Optional[float] = None
    output_scale: float = 0.0  # largest |output| of this sequence (unperturbed)
    grad_scale: Optional[float] = None  # largest |d(loss of the others)/d(input)| over its tokens
    kind: str = NONE  # "none" / "rounding" / "leak": the worst of the three quantities
    why: str = ""  # what decided the kind

    @property
    def worst(self) -> float:
        vals = [self.output_change] + [v for v in (self.grad_change, self.grad_leak) if v is not None]
        return max(vals)


@dataclasses.dataclass
class IsolationReport:
    ok: bool
    max_output_change: float
    max_grad_change: Optional[float]
    results: List[SequenceResult]
    targets: List[int]
    sequences: List[tuple]  # (row, start, length) per sequence index
    grad_into_target: Dict[int, float]
    atol: Optional[float]  # the explicit override, None when the limits come from the floors
    grads_checked: bool
    notes: List[str]
    classification: str = NONE  # "none" / "rounding" / "leak" over all pairs
    output_floor: float = 0.0  # run-to-run noise of the outputs (unperturbed batch, twice)
    grad_floor: Optional[float] = None  # run-to-run noise of the input gradients
    output_limit: float = 0.0  # changes up to this are "none"
    grad_limit: Optional[float] = None
    deterministic: bool = False  # exact limits (deterministic algorithms on)
    rounding_rtol: float = 0.0
    probe_scale: float = 0.0
    grad_into_kind: Dict[int, str] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def leaks(self) -> List[SequenceResult]:
        return [r for r in self.results if r.kind == LEAK]

    def per_sequence(self) -> Dict[int, float]:
        """other sequence index -> worst change seen over all targets."""
        out: Dict[int, float] = {}
        for r in self.results:
            out[r.other] = max(out.get(r.other, 0.0), r.worst)
        return out

    def per_sequence_kind(self) -> Dict[int, str]:
        """other sequence index -> worst classification over all targets."""
        out: Dict[int, str] = {}
        for r in self.results:
            out[r.other] = _worse(out.get(r.other, NONE), r.kind)
        return out

    def __repr__(self) -> str:
        def f(v):
            return "None" if v is None else f"{v:.3e}"

        n_leak = sum(r.kind == LEAK for r in self.results) + sum(k == LEAK for k in self.grad_into_kind.values())
        n_round = sum(r.kind == ROUNDING for r in self.results)
        return (f"IsolationReport(ok={self.ok}, classification={self.classification!r}, "
                f"max_output_change={f(self.max_output_change)}, output_floor={f(self.output_floor)}, "
                f"output_limit={f(self.output_limit)}, max_grad_change={f(self.max_grad_change)}, "
                f"grad_floor={f(self.grad_floor)}, grad_limit={f(self.grad_limit)}, "
                f"deterministic={self.deterministic}, leaking_pairs={n_leak}, rounding_pairs={n_round}, "
                f"targets={self.targets}, sequences={len(self.sequences)})")

    def __str__(self) -> str:
        def f(v):
            return "-" if v is None else f"{v:.3e}"

        how = (f"atol {self.atol:g}" if self.atol is not None else
               "deterministic: exact" if self.deterministic else
               f"limit = {FLOOR_FACTOR:g} x the floor of two identical runs")
        head = (f"isolation {'OK' if self.ok else 'LEAK'} [{self.classification}]: "
                f"max |d output| = {f(self.max_output_change)} (noise floor {f(self.output_floor)}, "
                f"limit {f(self.output_limit)}), max |d grad| = {f(self.max_grad_change)} "
                f"(noise floor {f(self.grad_floor)}, limit {f(self.grad_limit)}); {how}; "
                f"{len(self.targets)} perturbed sequence(s), {len(self.sequences)} sequences")
        lines = [head, f"{'target':>6} {'seq':>5} {'row':>4} {'start':>6} {'len':>5} "
                       f"{'|d out|':>10} {'|d grad|':>10} {'grad leak':>10} {'probe out':>10} {'nonlin out':>10} "
                       f"{'probe grad':>10} {'nonlin grd':>10}"]
        for r in self.results:
            flag = {LEAK: f"  ({r.why}) <- leak", ROUNDING: f"  rounding ({r.why})", NONE: ""}[r.kind]
            lines.append(f"{r.target:>6} {r.other:>5} {r.row:>4} {r.start:>6} {r.length:>5} "
                         f"{f(r.output_change):>10} {f(r.grad_change):>10} {f(r.grad_leak):>10} "
                         f"{f(r.output_probe):>10} {f(r.output_nonlinearity):>10} {f(r.grad_probe):>10} "
                         f"{f(r.grad_nonlinearity):>10}{flag}")
        for t, v in self.grad_into_target.items():
            kind = self.grad_into_kind.get(t, NONE)
            if kind != NONE:
                lines.append(f"gradient from the other sequences into target {t}'s inputs: {v:.3e}  "
                             + ("<- leak" if kind == LEAK else "rounding"))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _output_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict):
        for k in ("logits", "hidden_states", "last_hidden_state"):
            if k in out:
                return out[k]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"model_fn must return a tensor (batch, seqlen, ...), or something with .logits; got {type(out)}")


def _modules_of(fn) -> List[nn.Module]:
    found: List[nn.Module] = []
    if isinstance(fn, nn.Module):
        found.append(fn)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        found.append(owner)
    code, glb = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is not None and isinstance(glb, dict):
        for name in code.co_names:
            v = glb.get(name)
            if isinstance(v, nn.Module):
                found.append(v)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, nn.Module):
            found.append(v)
    return found


def _find_embedding(fn, max_id: int) -> Optional[nn.Embedding]:
    for m in _modules_of(fn):
        for sub in m.modules():
            if isinstance(sub, nn.Embedding) and sub.num_embeddings > max_id:
                return sub
    return None


def _segments(batch: Dict[str, Any], shape) -> torch.Tensor:
    if batch.get("position_ids") is not None:
        return position_ids_to_seq_idx(torch.as_tensor(batch["position_ids"]))
    if batch.get("seq_idx") is not None:
        return position_ids_to_seq_idx(seq_idx_to_position_ids(torch.as_tensor(batch["seq_idx"])))
    if batch.get("cu_seqlens") is not None:
        return position_ids_to_seq_idx(cu_seqlens_to_position_ids(torch.as_tensor(batch["cu_seqlens"]), shape))
    raise ValueError("batch needs 'position_ids', 'seq_idx' or 'cu_seqlens' to know where sequences start")


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _default_rounding_rtol(dtypes) -> float:
    eps = max([_eps(d) for d in dtypes] + [0.0])
    if eps > 1e-4:  # float16, bfloat16
        return 5e-2
    if eps > 1e-10:  # float32 (TF32 products in Triton kernels)
        return 1e-2
    return 1e-6


def _classify_change(c: Optional[float], probe: Optional[float], nonlinearity: Optional[float], floor: float,
                     limit: float, scale: Optional[float], rtol: float, eps: float):
    """(kind, why) of a change ``c`` whose probes changed ``probe`` = max|P2| with ``nonlinearity`` = max|P2 - 2 P1|."""
    if c is None:
        return NONE, ""
    if math.isnan(c):
        return LEAK, "NaN"
    if c <= limit:
        return NONE, ""
    scale = scale or 0.0
    if c > rtol * scale:
        return LEAK, f"{c / scale:.1e} of the sequence's scale" if scale else "the sequence's scale is 0"
    if probe is None:
        return LEAK, "above the limit, not probed"
    if math.isnan(probe) or math.isnan(nonlinearity):
        return LEAK, "NaN in the probe"
    if probe <= RESOLUTION_EPS * eps * scale + 2 * floor:
        return ROUNDING, f"gone under a small perturbation, {c / scale:.1e} of scale"
    if probe > SHRINK * c + PROBE_NOISE * floor:
        return ROUNDING, f"does not shrink with the perturbation, {c / scale:.1e} of scale"
    if nonlinearity <= LINEARITY * probe + PROBE_NOISE * floor:
        return LEAK, f"linear in the perturbation: deviation {nonlinearity:.1e} of |P2| {probe:.1e}"
    return ROUNDING, f"not linear in the perturbation, {c / scale:.1e} of scale"


def _classify_direct(v: Optional[float], limit: float, scale: float, rtol: float):
    if v is None:
        return NONE, ""
    if math.isnan(v):
        return LEAK, "NaN"
    if v <= limit:
        return NONE, ""
    if v <= rtol * scale:
        return ROUNDING, f"gradient {v / scale:.1e} of scale"
    return LEAK, "gradient across the boundary"


@contextlib.contextmanager
def _deterministic_algorithms(turn_on: bool):
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if turn_on and not before:
        # warn_only: an op with no deterministic version warns instead of failing; the repeated run shows it
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        if turn_on and not before:
            torch.use_deterministic_algorithms(before, warn_only=warn_only)


def check_isolation(
    model_fn: Callable[[Dict[str, Any]], Any],
    batch: Dict[str, Any],
    *,
    targets: Optional[Sequence[int]] = None,
    max_targets: int = 4,
    input_key: Optional[str] = None,
    embedding: Optional[nn.Module] = None,
    vocab_size: Optional[int] = None,
    noise_scale: float = 1.0,
    check_grads: bool = True,
    atol: Optional[float] = None,
    deterministic: Optional[bool] = None,
    rounding_rtol: Optional[float] = None,
    allow_rounding: bool = True,
    seed: int = 0,
) -> IsolationReport:
    """Perturb one packed sequence at a time and report what changes in the others, telling leaks from
    run-to-run noise and from rounding (see the module docstring for the rules).

    Args:
        model_fn: ``model_fn(batch) -> output``: a tensor (batch, seqlen, ...) (or an object with
            ``.logits``, a dict with ``"logits"``, or a tuple whose first item is the tensor). Runs
            several times; the RNG is reseeded before every call so dropout masks repeat.
        batch: dict with the input (``"input_ids"`` integer (batch, seqlen), or a float tensor
            (batch, seqlen, ...) named by ``input_key``, e.g. ``"hidden_states"``) and the
            boundaries (``"position_ids"``, ``"seq_idx"`` or ``"cu_seqlens"``).
        targets: indices of the sequences to perturb (sequences numbered row by row, padding
            segments included); default: the first sequence of each row holding several, and the
            last sequence of the first such row, at most ``max_targets``.
        input_key: which batch entry to perturb (default ``"input_ids"`` if present, else the first
            float tensor of shape (batch, seqlen, ...)).
        embedding: the module turning ``input_ids`` into vectors (its output is where per-token
            gradients are read, and where the scaled-down probe perturbation is applied); found
            automatically when ``model_fn`` is, holds, or is a method of a module with an
            ``nn.Embedding``. Without one, gradients are not checked and changes of ``input_ids``
            models cannot be probed (every change above the limit counts as a leak).
        vocab_size: range of replacement ids (default: the embedding's size, else max id + 1).
        noise_scale: std of the noise added to float inputs (times the input's std).
        check_grads: also compare gradients (one backward per loss, per target).
        atol: explicit limit for every change (outputs and gradients), instead of the measured
            ``FLOOR_FACTOR`` x noise floor (or exactly 0 in deterministic mode). Changes above it are
            still probed and classified.
        deterministic: ``None`` (default): whether ``torch.are_deterministic_algorithms_enabled()``;
            ``True`` turns deterministic algorithms on for the check (warn-only) and makes every
            limit exact (0, unless ``atol``). The noise floor is measured and reported anyway; a note
            says so if two identical runs differ.
        rounding_rtol: largest change, relative to the observed sequence's own magnitude, that may be
            rounding (default by dtype: 1e-6 float64, 1e-2 float32, 5e-2 16-bit).
        allow_rounding: ``False``: a change classified as rounding also makes ``ok`` false.
        seed: seed of the perturbations, of the random output projection and of ``model_fn``'s RNG.

    Returns:
        :class:`IsolationReport`: ``.ok``, ``.classification``, ``.max_output_change`` /
        ``.output_floor`` / ``.output_limit``, ``.max_grad_change`` / ``.grad_floor`` /
        ``.grad_limit``, ``.results`` (one row per target and other sequence, each with its
        ``.kind``), ``repr(report)`` the numbers, ``str(report)`` a table.
    """
    det = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    with _deterministic_algorithms(deterministic is True):
        return _check(model_fn, batch, targets=targets, max_targets=max_targets, input_key=input_key,
                      embedding=embedding, vocab_size=vocab_size, noise_scale=noise_scale, check_grads=check_grads,
                      atol=atol, det=det, rounding_rtol=rounding_rtol, allow_rounding=allow_rounding, seed=seed)


def _check(model_fn, batch, *, targets, max_targets, input_key, embedding, vocab_size, noise_scale, check_grads,
           atol, det, rounding_rtol, allow_rounding, seed) -> IsolationReport:
    if input_key is None:
        if "input_ids" in batch:
            input_key = "input_ids"
        else:
            for k, v in batch.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2:
                    input_key = k
                    break
    if input_key is None or input_key not in batch:
        raise ValueError("check_isolation: no input to perturb; pass input_key=")
    if atol is not None and not atol >= 0:
        raise ValueError(f"check_isolation: atol must be >= 0 (or None to use the measured noise floor), got {atol}")
    inp = batch[input_key]
    B, L = inp.shape[:2]
    seg = _segments(batch, (B, L)).cpu()
    sequences: List[tuple] = []
    seq_id = torch.empty(B, L, dtype=torch.long)
    for r in range(B):
        row = seg[r]
        starts = [0] + [t for t in range(1, L) if int(row[t]) != int(row[t - 1])]
        for k, s in enumerate(starts):
            e = starts[k + 1] if k + 1 < len(starts) else L
            seq_id[r, s:e] = len(sequences)
            sequences.append((r, s, e - s))
    notes: List[str] = []
    if targets is None:
        by_row: Dict[int, List[int]] = {}
        for i, (r, _, _) in enumerate(sequences):
            by_row.setdefault(r, []).append(i)
        multi = [ids for ids in by_row.values() if len(ids) > 1]
        targets = []
        for ids in multi:
            targets.append(ids[0])
        if multi:
            targets = targets[: max(1, max_targets - 1)]
            if multi[0][-1] not in targets:
                targets.append(multi[0][-1])
        if not targets:
            notes.append("no row holds two sequences: nothing can leak inside a row")
    targets = list(targets)[:max(max_targets, 1)] if targets else []
    for t in targets:
        if not 0 <= t < len(sequences):
            raise ValueError(f"target {t} out of range: the batch holds {len(sequences)} sequences")

    is_ids = not inp.is_floating_point()
    emb = None
    if is_ids:
        emb = embedding if embedding is not None else _find_embedding(model_fn, int(inp.max()) if inp.numel() else 0)
        if emb is None and check_grads:
            notes.append("gradients not checked: no nn.Embedding found for input_ids (pass embedding=)")
    grads_on = check_grads and (not is_ids or emb is not None)

    gen = torch.Generator().manual_seed(seed)
    devices = [inp.device.index or 0] if inp.is_cuda else []

    captured: List[torch.Tensor] = []
    override: List[Optional[torch.Tensor]] = [None]

    def hook(_m, _inp, out):
        src = override[0] if (override[0] is not None and not captured) else out
        if src.shape != out.shape:
            raise RuntimeError(f"check_isolation: the embedding's output changed shape {tuple(src.shape)} -> "
                               f"{tuple(out.shape)} between calls")
        leaf = src.detach().requires_grad_(grads_on and src.is_floating_point())
        captured.append(leaf)
        return leaf

    def run(b, emb_out=None):
        captured.clear()
        override[0] = emb_out
        handle = emb.register_forward_hook(hook) if emb is not None else None
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                with torch.enable_grad():
                    if grads_on and not is_ids:
                        b = dict(b)
                        b[input_key] = b[input_key].detach().clone().requires_grad_(True)
                    out = _output_tensor(model_fn(b))
        finally:
            if handle is not None:
                handle.remove()
            override[0] = None
        e = captured[0] if captured else None
        if emb is not None and e is None and (grads_on or emb_out is not None):
            raise RuntimeError("check_isolation: the embedding module was not called by model_fn")
        wrt = (b[input_key] if not is_ids else e) if grads_on else None
        return out, wrt, e

    def absdiff(a, b):
        dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        return (a.detach().to(dt) - b.detach().to(dt)).abs()

    def token_max(x, mask):
        if x is None:
            return None
        v = x.detach().reshape(B, L, -1).abs().amax(-1)
        v = v[mask]
        return float(v.max()) if v.numel() else 0.0

    def signed_diff(a, b):
        dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        return a.detach().to(dt) - b.detach().to(dt)

    def per_token_max(x):
        return x.detach().reshape(B, L, -1).abs().amax(-1)

    def grad_of(c, sel, wrt, retain):
        g = torch.autograd.grad(c[sel].sum(), wrt, retain_graph=retain, allow_unused=True)[0]
        return torch.zeros_like(wrt) if g is None else g

    seq_id_dev = seq_id.to(inp.device)
    everything = torch.ones(B, L, dtype=torch.bool, device=inp.device)

    # the unperturbed batch, twice: the second run measures the run-to-run noise floor
    out_b, wrt_b, e_b = run(batch)
    if out_b.shape[:2] != (B, L):
        raise ValueError(f"model_fn's output {tuple(out_b.shape)} does not start with (batch, seqlen) = {(B, L)}")
    if is_ids and emb is not None and e_b is None:
        notes.append("the embedding was not called by model_fn: changes cannot be probed")
        emb = None
    out_b2, wrt_b2, _ = run(batch)
    output_floor = token_max(absdiff(out_b2, out_b), everything)
    proj = torch.randn(out_b.shape, generator=gen, dtype=torch.float64).to(out_b.device, out_b.dtype)

    def per_token(out):
        c = out * proj
        return c.reshape(B, L, -1).sum(-1)

    # per target, the gradients of the unperturbed runs: of the others' loss and of the target's loss
    g_oth: Dict[int, torch.Tensor] = {}
    g_tgt: Dict[int, torch.Tensor] = {}
    grad_floor = 0.0 if grads_on else None
    if grads_on and targets:
        c_b, c_b2 = per_token(out_b), per_token(out_b2)
        for i, t in enumerate(targets):
            tmask = seq_id_dev == t
            last = i == len(targets) - 1
            g_oth[t] = grad_of(c_b, ~tmask, wrt_b, True)
            g_tgt[t] = grad_of(c_b, tmask, wrt_b, not last)
            g2_oth = grad_of(c_b2, ~tmask, wrt_b2, True)
            g2_tgt = grad_of(c_b2, tmask, wrt_b2, not last)
            grad_floor = max(grad_floor, token_max(absdiff(g2_oth, g_oth[t]), everything),
                             token_max(absdiff(g2_tgt, g_tgt[t]), everything))
        del c_b, c_b2
    del out_b2, wrt_b2

    # each target perturbed, twice (the repeat measures the noise floor again, on the perturbed batch);
    # only per-token maxima are kept
    perturbed: Dict[int, dict] = {}
    for t in targets:
        tmask = seq_id_dev == t
        pb = dict(batch)
        delta = None
        if is_ids:
            V = vocab_size or (emb.num_embeddings if emb is not None else int(inp.max()) + 1)
            V = max(int(V), 2)
            shift = torch.randint(1, V, inp.shape, generator=gen).to(inp.device)
            pb[input_key] = torch.where(tmask, (inp.long() + shift) % V, inp.long()).to(inp.dtype)
        else:
            std = float(inp.detach().float().std()) or 1.0
            noise = torch.randn(inp.shape, generator=gen, dtype=torch.float64).to(inp.device, inp.dtype)
            mask = tmask.reshape(B, L, *([1] * (inp.dim() - 2)))
            delta = torch.where(mask, noise_scale * std * noise, torch.zeros_like(noise))
            pb[input_key] = inp + delta
        rec: dict = {"delta": delta}
        outs = []
        for _ in range(2):
            out_p, wrt_p, e_p = run(pb)
            g_p = grad_of(per_token(out_p), ~tmask, wrt_p, False) if grads_on else None
            outs.append((out_p.detach(), g_p))
            if e_p is not None and "emb_out" not in rec:
                rec["emb_out"] = e_p.detach()
            del out_p, wrt_p
        (o1, g1), (o2, g2) = outs
        rec["d_out"] = per_token_max(absdiff(o1, out_b))
        output_floor = max(output_floor, token_max(absdiff(o2, o1), everything))
        if grads_on:
            rec["d_grad"] = per_token_max(absdiff(g1, g_oth[t]))
            grad_floor = max(grad_floor, token_max(absdiff(g2, g1), everything))
        del outs, o1, o2, g1, g2
        perturbed[t] = rec

    if atol is not None:
        output_limit, grad_limit = float(atol), (float(atol) if grads_on else None)
    elif det:
        output_limit, grad_limit = 0.0, (0.0 if grads_on else None)
    else:
        output_limit = FLOOR_FACTOR * output_floor
        grad_limit = FLOOR_FACTOR * grad_floor if grads_on else None
    if det and (output_floor > 0 or (grad_floor or 0) > 0):
        notes.append(f"deterministic mode, yet two identical runs differ (outputs by {output_floor:.3e}, gradients "
                     f"by {grad_floor if grad_floor is not None else 0:.3e}): some kernel of the model is not "
                     "deterministic; changes are judged exactly all the same")

    probe_dtypes = [out_b.dtype, (e_b.dtype if e_b is not None else inp.dtype)]
    device_type = inp.device.type
    if torch.is_autocast_enabled(device_type):  # the caller runs the check under autocast
        probe_dtypes.append(torch.get_autocast_dtype(device_type))
    probe_scale = PROBE_SCALE
    rtol = _default_rounding_rtol(probe_dtypes) if rounding_rtol is None else float(rounding_rtol)
    grad_dtype = wrt_b.dtype if grads_on else out_b.dtype
    direct_rtol = min(DIRECT_EPS * _eps(grad_dtype), rtol)
    out_eps = _eps(out_b.dtype)
    can_probe = not is_ids or emb is not None
    if is_ids and not can_probe:
        notes.append("no embedding to scale the perturbation on: every change above the limit counts as a leak")

    out_scale_tok = per_token_max(out_b)
    results: List[SequenceResult] = []
    grad_into: Dict[int, float] = {}
    grad_into_kind: Dict[int, str] = {}
    max_out, max_grad = 0.0, 0.0 if grads_on else None
    for t in targets:
        rec = perturbed[t]
        tmask = seq_id_dev == t
        others = ~tmask
        d_out, d_grad = rec["d_out"], rec.get("d_grad")
        if grads_on:
            grad_into[t] = token_max(g_oth[t], tmask)
            kind, _ = _classify_direct(grad_into[t], grad_limit, token_max(g_oth[t], others) or 0.0, direct_rtol)
            grad_into_kind[t] = kind
            max_grad = max(max_grad, grad_into[t])
        tgt_scale = token_max(g_tgt[t], tmask) if grads_on else 0.0
        pairs = []
        for j, (r, s, n) in enumerate(sequences):
            if j == t:
                continue
            m = seq_id_dev == j
            oc, gc = token_max(d_out, m), token_max(d_grad, m)
            gl = token_max(g_tgt[t], m) if grads_on else None
            pairs.append((j, r, s, n, m, oc, gc, gl))
            max_out = max(max_out, oc)
            if grads_on:
                max_grad = max(max_grad, gc, gl)
        above = any(oc > output_limit or math.isnan(oc) or (gc is not None and (gc > grad_limit or math.isnan(gc)))
                    for (_, _, _, _, _, oc, gc, _) in pairs)
        d_out_probe = d_grad_probe = d_out_nonlin = d_grad_nonlin = None
        if above and can_probe:
            # the same perturbation, scaled down twice (1/16 and 2/16): a leak's effect is linear in it
            probes = []
            for k in (1, 2, -1):
                if is_ids:
                    e_q = e_b.detach().double() + k * probe_scale * (rec["emb_out"].double() - e_b.detach().double())
                    out_q, wrt_q, _ = run(batch, emb_out=e_q.to(e_b.dtype))
                else:
                    qb = dict(batch)
                    qb[input_key] = inp + (k * probe_scale) * rec["delta"]
                    out_q, wrt_q, _ = run(qb)
                dg = (signed_diff(grad_of(per_token(out_q), others, wrt_q, False), g_oth[t]) if grads_on else None)
                probes.append((signed_diff(out_q, out_b), dg))
                del out_q, wrt_q
            (o1, g1), (o2, g2), (om, gm) = probes
            # the larger of the two deviations from linearity: P2 - 2 P1 and P(-1) + P1
            d_out_probe = per_token_max(o2)
            d_out_nonlin = torch.maximum(per_token_max(o2 - 2 * o1), 2 * per_token_max(om + o1))
            if grads_on:
                d_grad_probe = per_token_max(g2)
                d_grad_nonlin = torch.maximum(per_token_max(g2 - 2 * g1), 2 * per_token_max(gm + g1))
            del probes, o1, o2, om, g1, g2, gm
        for (j, r, s, n, m, oc, gc, gl) in pairs:
            op, gp = token_max(d_out_probe, m), token_max(d_grad_probe, m)
            on, gn = token_max(d_out_nonlin, m), token_max(d_grad_nonlin, m)
            o_scale = token_max(out_scale_tok, m)
            g_scale = token_max(g_oth[t], m) if grads_on else None
            k_out, w_out = _classify_change(oc, op, on, output_floor, output_limit, o_scale, rtol, out_eps)
            k_grad, w_grad = _classify_change(gc, gp, gn, grad_floor or 0.0, grad_limit or 0.0, g_scale, rtol,
                                              _eps(grad_dtype))
            k_dir, w_dir = _classify_direct(gl, grad_limit or 0.0, tgt_scale, direct_rtol)
            kind = _worse(k_out, k_grad, k_dir)
            why = "; ".join(f"{name}: {w}" for name, k, w in (("out", k_out, w_out), ("grad", k_grad, w_grad),
                                                               ("grad leak", k_dir, w_dir)) if k == kind and w)
            results.append(SequenceResult(t, j, r, s, n, oc, gc, gl, op, gp, on, gn, o_scale, g_scale, kind, why))
    for v in (max_out, max_grad, output_floor, grad_floor):
        if v is not None and math.isnan(v):
            notes.append("NaN in the comparison")
            break
    classification = _worse(*[r.kind for r in results], *grad_into_kind.values())
    nan = any("NaN" in n for n in notes)
    if nan:
        classification = LEAK
    ok = classification == NONE or (classification == ROUNDING and allow_rounding)
    return IsolationReport(
        ok=ok, max_output_change=max_out, max_grad_change=max_grad, results=results, targets=targets,
        sequences=sequences, grad_into_target=grad_into, atol=atol, grads_checked=grads_on, notes=notes,
        classification=classification, output_floor=output_floor, grad_floor=grad_floor, output_limit=output_limit,
        grad_limit=grad_limit, deterministic=det, rounding_rtol=rtol, probe_scale=probe_scale,
        grad_into_kind=grad_into_kind,
    )
