"""Shared helpers of the ops tests: random packed layouts, per-sequence oracles, a tiny LM mirror."""
from __future__ import annotations

import collections
import math
import random
from typing import List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ops import PackedMamba, packed_causal_conv1d
from ops.mamba_inner import packed_mamba_inner_ref


def random_row(rng: random.Random, seqlen: int, *, max_len=None, pad=True, short_bias=True) -> List[int]:
    """Lengths of one packed row summing to seqlen (the last piece may be padding)."""
    lens, left = [], seqlen
    while left > 0:
        choices = [1, 2, 3] if short_bias and rng.random() < 0.4 else None
        hi = min(left, max_len or left)
        n = rng.choice([c for c in choices if c <= hi]) if choices and hi >= 1 else rng.randint(1, hi)
        lens.append(n)
        left -= n
    return lens


def positions(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def layouts(seqlen: int, batch: int, seed: int) -> List[List[int]]:
    """A batch mixing: random mixes with 1-length and short pieces, a one-sequence row, padding."""
    rng = random.Random(seed)
    rows = [random_row(rng, seqlen) for _ in range(batch)]
    rows[0] = [seqlen]  # a row that is one sequence
    if batch > 1:
        rows[1] = [1] * min(3, seqlen) + ([seqlen - 3] if seqlen > 3 else [])  # length-1 sequences
    return rows


def mixed_rows(rng: random.Random, batch: int, seqlen: int, width: int = 4) -> List[List[int]]:
    """Rows of segment lengths covering every case the ops must handle, then random mixes:
    row 0 one sequence; row 1 length-1 sequences first; row 2 only sequences shorter than the conv
    ``width``; row 3 random sequences followed by a padding tail (its own segment); more rows random.
    The rows cycle through these kinds when ``batch`` < 4 (the seed rotates the starting kind)."""
    kinds = ["one", "ones", "short", "padded", "random"]
    start = rng.randrange(4)
    rows = []
    for i in range(batch):
        kind = kinds[(start + i) % 4] if i < 4 else "random"
        if kind == "one":
            row = [seqlen]
        elif kind == "ones":
            k = min(seqlen, rng.randint(1, 4))
            row = [1] * k + (random_row(rng, seqlen - k) if seqlen > k else [])
        elif kind == "short":
            row, left = [], seqlen
            while left > 0:
                n = min(left, rng.randint(1, max(1, width - 1)))
                row.append(n)
                left -= n
        elif kind == "padded":
            pad = rng.randint(1, max(1, seqlen // 4))
            row = (random_row(rng, seqlen - pad) if seqlen > pad else []) + [pad]
        else:
            row = random_row(rng, seqlen)
        assert sum(row) == seqlen and min(row) >= 1
        rows.append(row)
    return rows


def spans(rows):
    out = []
    for r, row in enumerate(rows):
        s = 0
        for n in row:
            out.append((r, s, n))
            s += n
    return out


def channel_major(t: torch.Tensor) -> torch.Tensor:
    """t (b, d, L) with its values laid out as (d, b, L) in memory: the fused mixer's layout
    (ops.contract.is_channel_major)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def misaligned_copy(t: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """t's values in a dense tensor whose data starts one element past an aligned address (what a slice of a flat
    buffer, or of a batch-1 tensor along dim 1, gives): contiguous, or with ``transpose`` channel-last (the last two
    dims swapped in memory)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    if transpose:
        out = buf[1:].view(*t.shape[:-2], t.shape[-1], t.shape[-2]).transpose(-1, -2)
    else:
        out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % (2 * t.element_size()) != 0
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


# ---------------------------------------------------------------------------------------------
# A tiny mirror of mamba_ssm.models.mixer_seq_simple (same structure and forward signatures)

class Mamba(nn.Module):
    """Upstream-style Mamba-1 mixer: same parameters as PackedMamba, boundaries unknown to it."""

    def __init__(self, d_model, layer_idx=None, **kw):
        super().__init__()
        p = PackedMamba(d_model, layer_idx=layer_idx, **kw)
        for a in ("d_model", "d_state", "d_conv", "expand", "d_inner", "dt_rank", "use_fast_path", "layer_idx",
                  "activation", "validate_boundaries"):
            setattr(self, a, getattr(p, a))
        self.in_proj, self.conv1d, self.act = p.in_proj, p.conv1d, p.act
        self.x_proj, self.dt_proj = p.x_proj, p.dt_proj
        self.A_log, self.D = p.A_log, p.D
        self.out_proj = p.out_proj

    def forward(self, hidden_states, inference_params=None):
        return PackedMamba.forward(self, hidden_states)


class Mamba2(nn.Module):
    """Stand-in for mamba-ssm's Mamba2: a gated conv mixer that honours its seq_idx argument."""

    def __init__(self, d_model, layer_idx=None, d_conv=4, **kw):
        super().__init__()
        self.in_proj = nn.Linear(d_model, 2 * d_model, bias=False)
        self.conv1d = nn.Conv1d(d_model, d_model, d_conv, groups=d_model, padding=d_conv - 1)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.seen_seq_idx = []

    def forward(self, u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None):
        self.seen_seq_idx.append(seq_idx)
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x = packed_causal_conv1d(x.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, "silu",
                                 seq_idx=seq_idx).transpose(1, 2)
        return self.out_proj(x * F.silu(z))


class MHA(nn.Module):
    def __init__(self, d_model, layer_idx=None):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, inference_params=None):
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim, mixer):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = mixer

    def forward(self, hidden_states, residual=None, inference_params=None, **mixer_kwargs):
        residual = hidden_states + residual if residual is not None else hidden_states
        hidden_states = self.norm(residual)
        hidden_states = self.mixer(hidden_states, inference_params=inference_params, **mixer_kwargs)
        return hidden_states, residual


class MixerModel(nn.Module):
    def __init__(self, d_model, n_layer, vocab_size, mixers=("Mamba1",), **mixer_kw):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        kinds = [mixers[i % len(mixers)] for i in range(n_layer)]
        cls = {"Mamba1": Mamba, "Mamba2": Mamba2, "MHA": MHA}
        self.layers = nn.ModuleList(
            [Block(d_model, cls[k](d_model, layer_idx=i, **(mixer_kw if k == "Mamba1" else {})))
             for i, k in enumerate(kinds)])
        self.norm_f = nn.LayerNorm(d_model)

    def forward(self, input_ids, inference_params=None, **mixer_kwargs):
        hidden_states = self.embedding(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params=inference_params,
                                            **mixer_kwargs)
        residual = hidden_states + residual if residual is not None else hidden_states
        return self.norm_f(residual)


class MambaLMHeadModel(nn.Module):
    def __init__(self, d_model=16, n_layer=2, vocab_size=50, mixers=("Mamba1",), **mixer_kw):
        super().__init__()
        self.backbone = MixerModel(d_model, n_layer, vocab_size, mixers, **mixer_kw)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.backbone.embedding.weight

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0, **mixer_kwargs):
        hidden_states = self.backbone(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        CausalLMOutput = collections.namedtuple("CausalLMOutput", ["logits"])
        return CausalLMOutput(logits=self.lm_head(hidden_states))



# ---------------------------------------------------------------------------------------------
# packing-unpacking invariance of a (batch, seqlen, d) -> (batch, seqlen, d') function


def boundary_kwargs(form: str, rows) -> dict:
    """{"position_ids": ...} / {"seq_idx": ...} / {"cu_seqlens": ...} describing ``rows``."""
    from ops import position_ids_to_cu_seqlens, position_ids_to_seq_idx

    pos = positions(rows)
    if form == "position_ids":
        return {"position_ids": pos}
    if form == "seq_idx":
        return {"seq_idx": position_ids_to_seq_idx(pos)}
    if form == "cu_seqlens":
        return {"cu_seqlens": position_ids_to_cu_seqlens(pos)[0]}
    raise ValueError(form)


def out_and_grads(fn, inp, params, dout=None, **bounds):
    """(output, grad of inp (None for integer inputs), grads of params) of ``(fn(inp) * dout).sum()``;
    ``dout`` random when not given (returned as the 4th item)."""
    x = inp.detach().clone().requires_grad_(True) if inp.is_floating_point() else inp
    out = fn(x, **bounds)
    if dout is None:
        dout = torch.randn(out.shape, dtype=out.dtype)
    wrt = ([x] if x.requires_grad else []) + list(params)
    gs = list(torch.autograd.grad(out, wrt, dout, allow_unused=True))
    gx = gs.pop(0) if x.requires_grad else None
    return out.detach(), gx, gs, dout


def assert_packing_invariant(fn, inp, params, rows, form="position_ids", names=None, rtol=1e-9, atol=1e-11):
    """``fn(inp, **boundaries)`` on packed rows gives, for every sequence, the output (and the input
    gradient) of ``fn`` run on that sequence alone without boundaries, and parameter gradients equal
    to the sum over the sequences run alone. Returns (out, d inp, d params) of the packed run."""
    names = names or [f"param {i}" for i in range(len(params))]
    out, gx, gp, dout = out_and_grads(fn, inp, params, **boundary_kwargs(form, rows))
    acc = [None] * len(params)
    for b, s, n in spans(rows):
        o1, gx1, gp1, _ = out_and_grads(fn, inp[b:b + 1, s:s + n], params, dout[b:b + 1, s:s + n].contiguous())
        torch.testing.assert_close(out[b:b + 1, s:s + n], o1, rtol=rtol, atol=atol,
                                   msg=lambda m: f"output of sequence [{b}, {s}:{s + n}]: {m}")
        if gx is not None:
            torch.testing.assert_close(gx[b:b + 1, s:s + n], gx1, rtol=rtol, atol=atol,
                                       msg=lambda m: f"input grad of sequence [{b}, {s}:{s + n}]: {m}")
        for i, g in enumerate(gp1):
            if g is not None:
                acc[i] = g.clone() if acc[i] is None else acc[i] + g
    for name, g, a in zip(names, gp, acc):
        assert (g is None) == (a is None), name
        if g is not None:
            torch.testing.assert_close(g, a, rtol=rtol, atol=atol, msg=lambda m: f"grad of {name}: {m}")
    return out, gx, gp
