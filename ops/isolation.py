"""``check_isolation``: does any information cross a sequence boundary of a packed row?

Run it on any model (ours or not) and a packed batch. It perturbs the tokens of one sequence and
measures, for every other sequence of the batch:

- the largest change of its outputs (a forward leak),
- the largest change of the gradient reaching its input embeddings from the other sequences'
  outputs (a backward pass that mixes sequences even where the forward does not),
- the largest gradient flowing from the perturbed sequence's outputs into its inputs, and from its
  outputs into the perturbed sequence's inputs.

All must be exactly zero for a packing-safe model::

    capacity 12      seq 0 (5)         seq 1 (3)  seq 2 (3)  pad
    input_ids     [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 c1 c2 | 0 ]   perturb seq 0 ->
    outputs       [ changes ...    |   0      |   0      | 0 ]   must not change

Parameter gradients sum over every token of the batch, so they are not compared per sequence; the
per-token input gradients above are what isolation means for them.

Two things can make a safe model report tiny non-zero changes, and ``atol`` is for them. One is
backward kernels that sum with atomics: their last bits vary from run to run. The other is kernels
that form differences of cumulative sums running across boundaries. mamba-ssm's Mamba-2 chunk scan
does this with ``seq_idx``: an earlier sequence's dt changes the rounding of a later one's outputs,
about 3e-5 relative, though never through its content (``benchmarks/gpu/mamba2_rounding.py``). A
leak is orders of magnitude larger. Our Mamba-1 kernels report exactly zero outputs.

Example::

    >>> report = ops.check_isolation(lambda b: model(b["input_ids"], position_ids=b["position_ids"]).logits,
    ...                              batch, embedding=model.backbone.embedding)
    >>> assert report.ok, report
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .boundaries import cu_seqlens_to_position_ids, position_ids_to_seq_idx, seq_idx_to_position_ids

__all__ = ["check_isolation", "IsolationReport", "SequenceResult"]


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
    atol: float
    grads_checked: bool
    notes: List[str]

    def __bool__(self) -> bool:
        return self.ok

    def per_sequence(self) -> Dict[int, float]:
        """other sequence index -> worst change seen over all targets."""
        out: Dict[int, float] = {}
        for r in self.results:
            out[r.other] = max(out.get(r.other, 0.0), r.worst)
        return out

    def __str__(self) -> str:
        def f(v):
            return "-" if v is None else f"{v:.3e}"

        head = (f"isolation {'OK' if self.ok else 'LEAK'}: max |d output| = {f(self.max_output_change)}, "
                f"max |d grad| = {f(self.max_grad_change)} (atol {self.atol:g}); "
                f"{len(self.targets)} perturbed sequence(s), {len(self.sequences)} sequences")
        lines = [head, f"{'target':>6} {'seq':>5} {'row':>4} {'start':>6} {'len':>5} "
                       f"{'|d out|':>10} {'|d grad|':>10} {'grad leak':>10}"]
        for r in self.results:
            flag = "" if r.worst <= self.atol else "  <- leak"
            lines.append(f"{r.target:>6} {r.other:>5} {r.row:>4} {r.start:>6} {r.length:>5} "
                         f"{f(r.output_change):>10} {f(r.grad_change):>10} {f(r.grad_leak):>10}{flag}")
        for t, v in self.grad_into_target.items():
            if v > self.atol:
                lines.append(f"gradient from the other sequences into target {t}'s inputs: {v:.3e}  <- leak")
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
    atol: float = 0.0,
    seed: int = 0,
) -> IsolationReport:
    """Perturb one packed sequence at a time and report what changes in the others.

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
            gradients are read); found automatically when ``model_fn`` is, holds, or is a method of
            a module with an ``nn.Embedding``. Without one, gradients are not checked.
        vocab_size: range of replacement ids (default: the embedding's size, else max id + 1).
        noise_scale: std of the noise added to float inputs (times the input's std).
        check_grads: also compare gradients (one backward per loss, per target).
        atol: tolerance; 0 demands exact isolation (CPU and deterministic GPU kernels achieve it).
        seed: seed of the perturbations, of the random output projection and of ``model_fn``'s RNG.

    Returns:
        :class:`IsolationReport`: ``.ok``, ``.max_output_change``, ``.max_grad_change``,
        ``.results`` (one row per target and other sequence), ``str(report)`` a table.
    """
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
    if is_ids and check_grads:
        emb = embedding if embedding is not None else _find_embedding(model_fn, int(inp.max()) if inp.numel() else 0)
        if emb is None:
            notes.append("gradients not checked: no nn.Embedding found for input_ids (pass embedding=)")
    grads_on = check_grads and (not is_ids or emb is not None)

    gen = torch.Generator().manual_seed(seed)
    devices = [inp.device.index or 0] if inp.is_cuda else []

    captured: List[torch.Tensor] = []

    def hook(_m, _inp, out):
        leaf = out.detach().requires_grad_(True)
        captured.append(leaf)
        return leaf

    def run(b):
        captured.clear()
        handle = emb.register_forward_hook(hook) if (emb is not None and grads_on) else None
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
        if not grads_on:
            return out, None
        wrt = b[input_key] if not is_ids else (captured[0] if captured else None)
        if wrt is None:
            raise RuntimeError("check_isolation: the embedding module was not called by model_fn")
        return out, wrt

    seq_id_dev = seq_id.to(inp.device)
    out_b, wrt_b = run(batch)
    if out_b.shape[:2] != (B, L):
        raise ValueError(f"model_fn's output {tuple(out_b.shape)} does not start with (batch, seqlen) = {(B, L)}")
    proj = torch.randn(out_b.shape, generator=gen, dtype=torch.float64).to(out_b.device, out_b.dtype)

    def per_token(out):
        c = out * proj
        return c.reshape(B, L, -1).sum(-1)

    def token_max(x, mask):
        if x is None:
            return None
        v = x.detach().reshape(B, L, -1).abs().amax(-1)
        v = v[mask]
        return float(v.max()) if v.numel() else 0.0

    results: List[SequenceResult] = []
    grad_into: Dict[int, float] = {}
    max_out, max_grad = 0.0, 0.0 if grads_on else None
    for t in targets:
        tmask = seq_id_dev == t
        # perturbed batch
        pb = dict(batch)
        if is_ids:
            V = vocab_size or (emb.num_embeddings if emb is not None else int(inp.max()) + 1)
            V = max(int(V), 2)
            shift = torch.randint(1, V, inp.shape, generator=gen).to(inp.device)
            new = torch.where(tmask, (inp.long() + shift) % V, inp.long()).to(inp.dtype)
        else:
            std = float(inp.detach().float().std()) or 1.0
            noise = torch.randn(inp.shape, generator=gen, dtype=torch.float64).to(inp.device, inp.dtype)
            mask = tmask.reshape(B, L, *([1] * (inp.dim() - 2)))
            new = torch.where(mask, inp + noise_scale * std * noise, inp)
        pb[input_key] = new
        out_p, wrt_p = run(pb)
        d_out = (out_p.detach().float() - out_b.detach().float())
        g_b_oth = g_p_oth = g_b_tgt = None
        if grads_on:
            c_b, c_p = per_token(out_b), per_token(out_p)
            others = ~tmask
            g_b_oth = torch.autograd.grad(c_b[others].sum(), wrt_b, retain_graph=True, allow_unused=True)[0]
            g_b_tgt = torch.autograd.grad(c_b[tmask].sum(), wrt_b, retain_graph=True, allow_unused=True)[0]
            g_p_oth = torch.autograd.grad(c_p[others].sum(), wrt_p, allow_unused=True)[0]
            g_b_oth = torch.zeros_like(wrt_b) if g_b_oth is None else g_b_oth
            g_p_oth = torch.zeros_like(wrt_p) if g_p_oth is None else g_p_oth
            g_b_tgt = torch.zeros_like(wrt_b) if g_b_tgt is None else g_b_tgt
            grad_into[t] = token_max(g_b_oth, tmask)
            max_grad = max(max_grad, grad_into[t])
        d_grad = None if not grads_on else (g_p_oth.float() - g_b_oth.float())
        for j, (r, s, n) in enumerate(sequences):
            if j == t:
                continue
            m = seq_id_dev == j
            oc = token_max(d_out, m)
            gc = token_max(d_grad, m)
            gl = token_max(g_b_tgt, m)
            results.append(SequenceResult(t, j, r, s, n, oc, gc, gl))
            max_out = max(max_out, oc)
            if grads_on:
                max_grad = max(max_grad, gc, gl)
    for v in (max_out, max_grad):
        if v is not None and math.isnan(v):
            notes.append("NaN in the comparison")
    ok = (max_out <= atol) and (max_grad is None or max_grad <= atol) and not any("NaN" in n for n in notes)
    return IsolationReport(
        ok=ok, max_output_change=max_out, max_grad_change=max_grad, results=results, targets=targets,
        sequences=sequences, grad_into_target=grad_into, atol=atol, grads_checked=grads_on, notes=notes,
    )
