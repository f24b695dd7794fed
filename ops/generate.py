"""After training: generate from many variable-length prompts (packed prefill, batched decoding) and evaluate a
held-out set through packed rows.

:func:`generate_packed` packs the prompts into rows with :mod:`packer_algos`, runs one packed forward per group of
rows (no padding between prompts, nothing leaks across them) that leaves every prompt's final conv and scan states
(the carry path of :mod:`ops.carry`, each prompt a piece that "continues after"), builds the model's own decoding
cache from those states and decodes all prompts together, one token per step, through the model's usual decode path
(mamba-ssm's ``InferenceParams`` with ``seqlen_offset > 0``; transformers' cache)::

    prompts      [ p0 p0 p0 p0 ]  [ p1 p1 ]  [ p2 p2 p2 ]         any lengths
    packed row   [ p0 p0 p0 p0 | p1 p1 | p2 p2 p2 | pad ]         one forward, the states of p0, p1, p2 kept
    decode       batch of 3 rows, one token per step from those states; a prompt leaves the batch when it stops
                 and, with ``batch_size``, waiting prompts (prefilled the same way) take the free rows

    >>> out = ops.generate_packed(model, [[5, 7, 9], [3], [8, 8, 8, 8]], max_new_tokens=16)
    >>> out[1]                                         # tensor([3, <16 new tokens>]) (fewer after a stop token)

:func:`evaluate_packed` gives each held-out sequence's summed loss, token count, mean loss and perplexity from
packed rows (the same numbers as running each sequence alone), and :class:`PackedEvalCallback` runs it from a
``transformers.Trainer`` (``packloader.hf.PackedTrainer``).

Models: a mamba-ssm ``MambaLMHeadModel`` with Mamba-1 mixers and transformers' ``MambaForCausalLM``,
``FalconMambaForCausalLM`` and ``Mamba2ForCausalLM``, each converted by :func:`ops.enable_packing`. Mamba-1 prompts get
their final states from the carry path; FalconMamba (whose norms the carry path does not take) and Mamba-2 from their
packed conv and scan (``output_final_state``), run in place of each mixer for the prefill call. mamba-ssm's Mamba-2
mixers and the hybrids with attention layers are refused by :func:`generate_packed`.
:func:`evaluate_packed` takes every model ``enable_packing`` converts. More: docs/generation.md.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from .states import host_to_device

__all__ = ["generate_packed", "evaluate_packed", "PackedEvalResult", "PackedEvalCallback", "pack_prompts"]

Prompts = Sequence[Union[Sequence[int], torch.Tensor]]

_DEFAULT_CAPACITY = 2048        # evaluate_packed: tokens per packed row when capacity=None (at least the longest)
_DEFAULT_GENERATE_CAPACITY = 256  # generate_packed's rows: a prefill of 64 GSM8K prompts takes 6.8 ms of H100 time
                                  # in rows of 256 (7.0 in 512, 12.7 in 2048: long rows leave the scan's grid small)
_DEFAULT_PREFILL_TOKENS = 65536  # tokens per packed forward when prefill_tokens=None
_SLOT_REFILL_DIVISOR = 4        # cuda_graph=True: a packed prefill joins once 1/this of the rows is free


# --------------------------------------------------------------------------------------------------
# input checks and packing


def _as_token_list(seqs, name: str) -> List[torch.Tensor]:
    """``seqs`` (token-id lists or 1-D integer tensors) as 1-D int64 CPU tensors; a clear error naming ``name``."""
    if isinstance(seqs, torch.Tensor):
        raise TypeError(f"{name} must be a list of token-id lists or 1-D tensors (one per sequence), got a tensor of "
                        f"shape {tuple(seqs.shape)}; pass list(tensor) for a batch of equal-length rows")
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__len__"):
        raise TypeError(f"{name} must be a list of token-id lists or 1-D tensors, got {type(seqs).__name__}")
    if len(seqs) == 0:
        raise ValueError(f"{name} is empty")
    out = []
    for i, s in enumerate(seqs):
        if isinstance(s, (str, bytes)):
            raise TypeError(f"{name}[{i}] is text; tokenize it first (token ids are expected)")
        t = s if isinstance(s, torch.Tensor) else torch.as_tensor(np.asarray(s))
        if t.dim() != 1:
            raise ValueError(f"{name}[{i}] must be 1-D (one sequence of token ids), got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name}[{i}] is empty: every sequence needs at least one token")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name}[{i}] must hold integer token ids, got dtype {t.dtype}")
        t = t.detach().to("cpu", torch.int64)
        if int(t.min()) < 0:
            raise ValueError(f"{name}[{i}] has a negative token id ({int(t.min())})")
        out.append(t)
    return out


def _check_vocab(seqs: List[torch.Tensor], vocab: Optional[int], name: str) -> None:
    if vocab is None:
        return
    for i, t in enumerate(seqs):
        if int(t.max()) >= vocab:
            raise ValueError(f"{name}[{i}] has token id {int(t.max())}, outside the model's vocabulary of {vocab}")


def _capacity(lengths: np.ndarray, capacity: Optional[int], what: str, default: int = _DEFAULT_CAPACITY) -> int:
    longest = int(lengths.max())
    if capacity is None:
        return max(longest, min(default, int(lengths.sum())))
    if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    if longest > capacity:
        i = int(lengths.argmax())
        raise ValueError(f"capacity={capacity} is shorter than {what}[{i}] ({longest} tokens); raise capacity "
                         f"(or leave it None: the longest {what[:-1]} at least)")
    return int(capacity)


def pack_prompts(lengths, capacity: int, algorithm: str = "bfd") -> List[List[int]]:
    """Rows of sequence indices (each row's sequences in the order they are laid out), from
    :func:`packer_algos.pack` on ``lengths`` (every length <= ``capacity``).

    Example::

        >>> pack_prompts([5, 3, 7, 2], capacity=10)
        [[2, 1], [0, 3]]
    """
    from packer_algos import pack
    plan = pack(np.asarray(lengths, dtype=np.int64), capacity=int(capacity), algorithm=algorithm)
    rows = []
    for b in range(plan.n_bins):
        items, _, _ = plan.bin(b)
        rows.append([int(i) for i in items])
    return rows


def _row_groups(rows: List[List[int]], lengths: np.ndarray, capacity: int, tokens_per_forward: int):
    """Consecutive groups of rows, each at most ``tokens_per_forward`` tokens (rows x capacity; one row at least)."""
    per = max(1, int(tokens_per_forward) // capacity)
    return [rows[i:i + per] for i in range(0, len(rows), per)]


def _packed_batch(seqs: List[torch.Tensor], rows: List[List[int]], device, pad_id: int = 0):
    """The packed tensors of ``rows`` (lists of indices into ``seqs``), each row as long as the group's fullest:
    ``input_ids`` / ``position_ids`` (R, L) on ``device`` (padding: its own segment, positions 0, 1, ...), ``seg``
    (per segment in ``cu_seqlens`` order: the sequence index, -1 for padding), ``flat_start`` (per sequence in
    ``order``: the flat index of its first token), ``order`` (the sequence indices in layout order), and the position
    ids on the host (``seqs`` are CPU tensors). Nothing here waits for the GPU: both go to the device asynchronously
    (a prefill that joins a running decode must not stall it)."""
    fills = [sum(int(seqs[i].numel()) for i in r) for r in rows]
    L = max(fills)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.int64)
    pos = torch.zeros((len(rows), L), dtype=torch.int64)
    seg, order, flat_start = [], [], []
    for r, row in enumerate(rows):
        c = 0
        for i in row:
            n = int(seqs[i].numel())
            ids[r, c:c + n] = seqs[i]
            pos[r, c:c + n] = torch.arange(n)
            seg.append(i)
            order.append(i)
            flat_start.append(r * L + c)
            c += n
        if c < L:
            pos[r, c:] = torch.arange(L - c)
            seg.append(-1)
    return host_to_device(ids, device), host_to_device(pos, device), pos, seg, order, flat_start


# --------------------------------------------------------------------------------------------------
# model families


@dataclass
class _Family:
    kind: str                  # "mamba_ssm" (MambaLMHeadModel, enable_packing) or "hf" (transformers)
    mixers: list               # the Mamba-1 mixers, in layer order
    falcon: bool = False       # transformers' FalconMamba (norms on dt, B, C)
    mamba2: bool = False       # transformers' Mamba2ForCausalLM


def _model_vocab(model) -> Optional[int]:
    head = getattr(model, "lm_head", None)
    w = getattr(head, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _family(model, what: str = "generate_packed") -> _Family:
    """Which decode path ``model`` takes, checking it was converted and its mixers carry states."""
    from .convert import is_mamba2_mixer
    from .hf import _falcon_norms, _mixer_kind, is_transformers_model
    from .modules.mamba_simple import PackedMamba
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if not hasattr(model, "lm_head"):
        raise ValueError(f"{what}: {type(model).__name__} has no lm_head; pass the language model "
                         "(MambaLMHeadModel / *ForCausalLM), not its backbone")
    if is_transformers_model(model):
        conv = model.__dict__.get("_packloader_conversion")
        if conv is None:
            raise ValueError(f"{what}: {type(model).__name__} is not converted; call ops.enable_packing(model) first "
                             "(an unconverted model ignores the packed boundaries and its prompts leak into each "
                             "other)")
        if conv.get("attention") is not None or "hybrid" in [_mixer_kind(m) for m in model.modules()]:
            raise NotImplementedError(
                f"{what}: {type(model).__name__} is a hybrid with attention layers; packed prefill needs every layer "
                "to give per-prompt states (Mamba-1, FalconMamba and Mamba-2 models only). Use model.generate()")
        layers = getattr(getattr(model, "backbone", model), "layers", None)
        mixers = [b.mixer for b in layers] if layers is not None else []
        kinds = {_mixer_kind(m) for m in mixers}
        if kinds == {"mamba2"}:
            return _Family("hf", mixers, mamba2=True)
        if not mixers or kinds != {"mamba1"}:
            raise NotImplementedError(f"{what}: {type(model).__name__}: only transformers' MambaForCausalLM, "
                                      "FalconMambaForCausalLM and Mamba2ForCausalLM (every layer one kind of mixer) "
                                      "are supported")
        falcon = bool(_falcon_norms(mixers[0]))
        return _Family("hf", mixers, falcon)
    conv = getattr(model, "_packloader_conversion", None)
    if conv is None or not hasattr(model, "backbone"):
        raise ValueError(f"{what}: expected a mamba-ssm MambaLMHeadModel converted by ops.enable_packing(model) or a "
                         f"converted transformers Mamba / FalconMamba / Mamba-2 model, got {type(model).__name__}"
                         + ("" if conv is not None else " (not converted: call ops.enable_packing(model) first)"))
    mixers = [b.mixer for b in model.backbone.layers]
    m2 = [i for i, m in enumerate(mixers) if is_mamba2_mixer(m)]
    if m2:
        raise NotImplementedError(
            f"{what}: layers {m2} are mamba-ssm Mamba-2 mixers; packed prefill needs each prompt's final states, which "
            "the carry path (ops.carry) gives for Mamba-1 mixers only (transformers' Mamba2ForCausalLM is supported). "
            "Use mamba-ssm's generate() (one prompt per row)")
    other = [f"{i} ({type(m).__name__})" for i, m in enumerate(mixers) if not isinstance(m, PackedMamba)]
    if other:
        raise NotImplementedError(f"{what}: layers {', '.join(other)} are not Mamba-1 mixers (attention?); packed "
                                  "prefill with per-prompt states needs every layer to be one")
    return _Family("mamba_ssm", mixers)


class _KeepPositions:
    """A forward pre-hook on the LM head that keeps only the given flat token positions of its input (the logits of
    the last prompt tokens: (1, P, vocab) instead of (rows, L, vocab))."""

    def __init__(self, head, flat_index: torch.Tensor):
        self.flat_index = flat_index
        self.handle = head.register_forward_pre_hook(self)

    def __call__(self, module, args):
        h = args[0]
        return (h.reshape(-1, h.shape[-1]).index_select(0, self.flat_index).unsqueeze(0),) + tuple(args[1:])

    def remove(self):
        self.handle.remove()


def _logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


# --------------------------------------------------------------------------------------------------
# packed prefill: last-token logits and every prompt's final states


def _carry_keys(seg: List[int]):
    """The carry keys of a prefill batch (one entry per segment in ``cu_seqlens`` order): every prompt is piece 0 of
    its own document and continues after (so its final states are kept); padding segments carry nothing."""
    n = len(seg)
    doc = torch.tensor([i if i >= 0 else -1 - k for k, i in enumerate(seg)], dtype=torch.int64)
    return {"piece_doc_ids": doc, "piece_index": torch.zeros(n, dtype=torch.int64),
            "has_initial_state": torch.zeros(n, dtype=torch.bool),
            "continues_after": torch.tensor([i >= 0 for i in seg], dtype=torch.bool)}


def _prefill_group(model, fam: _Family, seqs: List[torch.Tensor], rows: List[List[int]], device):
    """One packed forward over ``rows``: (the prompt indices in layout order, their last-token logits (P, vocab),
    their :class:`_PromptStates` in that order)."""
    from .carry import StateCache
    ids, pos, pos_host, seg, order, flat_start = _packed_batch(seqs, rows, device)
    last = host_to_device([s + int(seqs[i].numel()) - 1 for i, s in zip(order, flat_start)], device, torch.int64)
    keys = _carry_keys(seg)
    hook = _KeepPositions(model.lm_head, last) if hasattr(model, "lm_head") else None
    cache = StateCache()
    try:
        if fam.kind == "mamba_ssm":
            cache.step(dict(keys, position_ids=pos_host))
            with _positions_unchecked(model):
                logits = _logits_of(model(ids, position_ids=pos, carry=cache.pending_step))
        elif fam.falcon or fam.mamba2:
            logits, finals = _swapped_prefill(model, fam, ids, pos, seg)
        else:
            saved = model.__dict__.get("_packloader_state_cache")
            model.__dict__["_packloader_state_cache"] = cache
            try:
                logits = _logits_of(model(input_ids=ids, position_ids=pos, **keys))
            finally:
                if saved is None:
                    model.__dict__.pop("_packloader_state_cache", None)
                else:
                    model.__dict__["_packloader_state_cache"] = saved
    finally:
        if hook is not None:
            hook.remove()
    if hook is not None:
        logits = logits.reshape(-1, logits.shape[-1])
    else:
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, last)
    if not (fam.falcon or fam.mamba2):
        # the carry step's slots are the prompts' segments in layout order (padding carries nothing): ``order``
        finals = _PromptStates(_final_states(cache.pending_step, fam))
    return np.asarray(order, dtype=np.int64), logits, finals


@contextlib.contextmanager
def _positions_unchecked(model):
    """The converted mamba-ssm model's position check off for a forward over positions made here (checking them
    would wait for the GPU); its own setting back after."""
    validate = model.__dict__.get("_packloader_validate")
    model._packloader_validate = False
    try:
        yield
    finally:
        if validate is None:
            model.__dict__.pop("_packloader_validate", None)
        else:
            model._packloader_validate = validate


def _final_states(step, fam: _Family) -> List[tuple]:
    """Every mixer's final states (conv, ssm) of the carry step's slots, in layer order; an error naming the first
    mixer that left none (it did not take the carry path)."""
    kept = step.kept_layers if step is not None else ()
    for m in fam.mixers:
        if m.layer_idx not in kept:
            raise RuntimeError(f"generate_packed: the packed prefill left no states at layer {m.layer_idx} "
                               f"({type(m).__name__}); this mixer did not take the carry path")
    return [step.final_states(m.layer_idx) for m in fam.mixers]


def _last_inputs(x: torch.Tensor, pos: torch.Tensor, n_seg: int, k: int) -> torch.Tensor:
    """Each segment's last ``k`` inputs (n_seg, channels, k) of ``x`` (b, channels, L), oldest first, zeros before a
    shorter segment's first token: the conv state a decode step continues from."""
    from .states import sequence_spans
    start, length = sequence_spans(pos, n_seg)
    flat = start[:, None] + length[:, None] - k + torch.arange(k, device=x.device)
    inside = flat >= start[:, None]
    flat = torch.where(inside, flat, start[:, None])
    L = x.shape[2]
    return torch.where(inside[:, None, :], x[flat // L, :, flat % L].permute(0, 2, 1), 0.0)


def _falcon_mixer_prefill(mixer, hidden_states, pos, n_seg):
    """FalconMamba's mixer on packed rows (its eval-mode computation: norms on dt before dt_proj, on B and C):
    (output, conv states (n_seg, d_inner, w-1), scan states (n_seg, d_inner, d_state))."""
    import ops
    from .hf import _falcon_norms, _weightless_rms
    dtype = hidden_states.dtype
    d_inner, k = mixer.intermediate_size, mixer.conv_kernel_size - 1
    A = -torch.exp(mixer.A_log.float())
    conv_bias = mixer.conv1d.bias if getattr(mixer, "use_conv_bias", True) else None
    xz = mixer.in_proj(hidden_states)
    x = xz[..., :d_inner].transpose(1, 2).contiguous()
    z = xz[..., d_inner:].transpose(1, 2).contiguous()
    conv_fin = _last_inputs(x, pos, n_seg, k)
    xc = ops.packed_causal_conv1d(x, mixer.conv1d.weight.to(x.dtype), None if conv_bias is None else
                                  conv_bias.to(x.dtype), activation="silu", position_ids=pos, validate=False)
    dt, B, C = torch.split(mixer.x_proj(xc.transpose(1, 2)),
                           [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    if _falcon_norms(mixer) == "modules":
        B, C, dt = mixer.b_layernorm(B), mixer.c_layernorm(C), mixer.dt_layernorm(dt)
    else:
        B, C, dt = (_weightless_rms(t, mixer.rms_eps) for t in (B, C, dt))
    delta = torch.matmul(mixer.dt_proj.weight, dt.transpose(1, 2))
    y, ssm_fin = ops.packed_selective_scan(
        xc, delta, A, B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(), D=mixer.D.float(), z=z,
        delta_bias=mixer.dt_proj.bias.float(), delta_softplus=True, position_ids=pos, validate=False,
        has_initial_state=torch.zeros(n_seg, dtype=torch.bool, device=x.device), output_final_state=True)
    return mixer.out_proj(y.transpose(1, 2).to(dtype)), conv_fin, ssm_fin


def _mamba2_mixer_prefill(mixer, hidden_states, pos, n_seg):
    """transformers' Mamba2Mixer on packed rows (the computation of ``ops.hf``'s packed Mamba-2 path: the SSD
    recurrence as a selective scan with one A and dt per head), with every segment's final states in the layout of
    transformers' cache: conv (n_seg, conv_dim, w-1), scan (n_seg, heads, head_dim, d_state)."""
    import ops
    batch, seqlen, _ = hidden_states.shape
    dtype = hidden_states.dtype
    proj = mixer.in_proj(hidden_states)
    inner, conv_dim, heads, hd = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads, mixer.head_dim
    groups, dstate = mixer.n_groups, mixer.ssm_state_size
    if proj.shape[-1] != inner + conv_dim + heads:
        raise NotImplementedError(f"generate_packed: {type(mixer).__name__}.in_proj gives {proj.shape[-1]} features, "
                                  f"expected {inner + conv_dim + heads}; this Mamba-2 variant is not supported")
    gate, xBC, dt = proj.split([inner, conv_dim, heads], dim=-1)
    xBC = xBC.transpose(1, 2).contiguous()
    conv_fin = _last_inputs(xBC, pos, n_seg, mixer.conv_kernel_size - 1)
    xBC = ops.packed_causal_conv1d(xBC, mixer.conv1d.weight.to(xBC.dtype),
                                   None if mixer.conv1d.bias is None else mixer.conv1d.bias.to(xBC.dtype),
                                   activation=mixer.activation, position_ids=pos, validate=False)
    x, B, C = torch.split(xBC, [inner, groups * dstate, groups * dstate], dim=1)
    lo, hi = mixer.time_step_limit if mixer.time_step_limit is not None else (0.0, float("inf"))
    delta = F.softplus(dt.to(torch.promote_types(dt.dtype, torch.float32)) + mixer.dt_bias.float())
    if lo > 0.0 or hi != float("inf"):
        delta = delta.clamp(min=lo, max=hi)
    delta = delta.transpose(1, 2).repeat_interleave(hd, dim=1)
    A = (-torch.exp(mixer.A_log.float())).repeat_interleave(hd)[:, None].expand(heads * hd, dstate)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    from .contract import MAX_DSTATE
    # the CUDA scan takes d_state <= 16; Mamba-2's larger states run the reference scan on the GPU (the prefill only)
    backend = "reference" if x.is_cuda and dstate > MAX_DSTATE else None
    y, ssm_fin = ops.packed_selective_scan(
        x.to(cdt).contiguous(), delta.to(cdt).contiguous(), A.to(cdt).contiguous(),
        B.to(cdt).reshape(batch, groups, dstate, seqlen).contiguous(),
        C.to(cdt).reshape(batch, groups, dstate, seqlen).contiguous(), D=mixer.D.float().repeat_interleave(hd).to(cdt),
        position_ids=pos, validate=False, has_initial_state=torch.zeros(n_seg, dtype=torch.bool, device=x.device),
        output_final_state=True, backend=backend)
    y = mixer.norm(y.transpose(1, 2), gate)
    return mixer.out_proj(y.to(dtype)), conv_fin, ssm_fin.view(n_seg, heads, hd, dstate)


def _swapped_prefill(model, fam: _Family, ids, pos, seg):
    """Models whose mixers the carry path does not take (FalconMamba's norms, Mamba-2): the model's own forward with
    every mixer's forward replaced, for this call, by its packed computation that also returns each segment's final
    states. Returns (logits, the prompts' :class:`_PromptStates` in layout order)."""
    n_seg = len(seg)
    prompt_k = host_to_device([k for k, i in enumerate(seg) if i >= 0], ids.device, torch.int64)
    layers: List[tuple] = []
    run = _mamba2_mixer_prefill if fam.mamba2 else _falcon_mixer_prefill

    def packed_mixer(mixer):
        def forward(hidden_states, *args, **kwargs):
            out, conv_fin, ssm_fin = run(mixer, hidden_states, pos, n_seg)
            layers.append((conv_fin.index_select(0, prompt_k), ssm_fin.index_select(0, prompt_k)))
            return out
        return forward

    for m in fam.mixers:
        m.forward = packed_mixer(m)
    try:
        # the model's own (unconverted) code around the mixers: no boundaries reach it, our mixers use ``pos``
        logits = _logits_of(model(input_ids=ids, use_cache=False))
    finally:
        for m in fam.mixers:
            del m.forward
    return logits, _PromptStates(layers)


class _PromptStates:
    """The final states of P prefilled prompts, batched per layer: ``layers[li] = (conv (P, d, w-1), ssm (P, d, n))``
    (transformers' Mamba-2: ssm (P, heads, head_dim, n)), as the packed forward left them. ``rows`` (a device
    index, None: all in order) picks the prompts: a subset costs one gather a state when it is written, and no work
    per prompt."""

    def __init__(self, layers: List[tuple], rows: Optional[torch.Tensor] = None):
        self.layers = layers
        self.rows = rows

    def __len__(self) -> int:
        return int(self.layers[0][0].shape[0] if self.rows is None else self.rows.numel())

    def subset(self, rows: torch.Tensor) -> "_PromptStates":
        """The prompts ``rows`` (a device index into this object's prompts)."""
        return _PromptStates(self.layers, rows if self.rows is None else self.rows.index_select(0, rows))

    def layer(self, li: int):
        """(conv (P, d, w-1), ssm) of layer ``li``, of the prompts picked."""
        conv, ssm = self.layers[li]
        if self.rows is None:
            return conv, ssm
        return conv.index_select(0, self.rows), ssm.index_select(0, self.rows)

    @staticmethod
    def cat(parts: List["_PromptStates"]) -> "_PromptStates":
        if len(parts) == 1:
            return parts[0]
        return _PromptStates([tuple(torch.cat([p.layer(li)[j] for p in parts]) for j in range(2))
                              for li in range(len(parts[0].layers))])


def _captured(fn, device: torch.device):
    """(a CUDA graph of ``fn()``, its output): two warm-up runs on a side stream (Triton's first launches compile),
    then the capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class _GraphedPrefill:
    """``cuda_graph=True``'s packed prefill of mamba-ssm models: at most ``slots`` prompts in at most ``rows`` rows
    of ``length`` tokens, the forward captured once as a CUDA graph over fixed buffers and replayed for every group
    of prompts that fits. The eager prefill's host work (tens of milliseconds for 24 layers, whatever the prompt
    count) becomes one copy of the layout and one replay. Every slot needs a segment: the slots no prompt takes end
    in scratch rows of one-token segments. A run with rows=2, length=8, slots=4 and prompts a, b, c::

        row 0     [ a a a b b b b . ]    . padding (a segment of its own, no slot)
        row 1     [ c c c . . . . . ]
        scratch   [ s . . . . . . . ]    s: the unused slot 3 ends here

    ``capture=False`` runs the same forward eagerly on the same buffers (the CPU tests of it)."""

    def __init__(self, model, fam: _Family, rows: int, length: int, slots: int, device: torch.device,
                 capture: bool):
        from .carry import FixedLayoutStep
        self.model, self.fam, self.rows, self.length, self.slots = model, fam, rows, length, slots
        total = rows + -(-slots // length)                   # the rows, then the scratch rows
        n = total * length
        self.buf = torch.zeros(2 * n + 3 * slots, dtype=torch.int64, device=device)
        self.host = np.zeros(2 * n + 3 * slots, dtype=np.int64)
        self.ids, self.pos = self.buf[:n].view(total, length), self.buf[n:2 * n].view(total, length)
        self.start, self.span, self.last = (self.buf[2 * n + j * slots:2 * n + (j + 1) * slots] for j in range(3))
        self.step = FixedLayoutStep(self.start, self.span, (total, length))
        self._load([], [])
        self.graph = None
        if capture:
            self.graph, (self.logits, self.layers) = _captured(self._forward, device)

    def _load(self, seqs: List[torch.Tensor], rows: List[List[int]]) -> np.ndarray:
        """Lay ``rows`` (indices into ``seqs``) out in the buffers; returns the prompts in layout order."""
        total, L, K = self.ids.shape[0], self.length, self.slots
        n = total * L
        h = self.host
        ids, pos = h[:n].reshape(total, L), h[n:2 * n].reshape(total, L)
        start, span, last = (h[2 * n + j * K:2 * n + (j + 1) * K] for j in range(3))
        ids[:] = 0
        pos[:] = 0                                          # scratch rows: one-token segments
        pos[:self.rows] = np.arange(L)                      # empty rows: one padding segment each
        order = []
        for r, row in enumerate(rows):
            c = 0
            for i in row:
                m = int(seqs[i].numel())
                ids[r, c:c + m] = seqs[i].numpy()
                pos[r, c:c + m] = np.arange(m)
                start[len(order)], span[len(order)] = r * L + c, m
                order.append(i)
                c += m
            pos[r, c:] = np.arange(L - c)
        p = len(order)
        start[p:] = self.rows * L + np.arange(K - p)        # the unused slots: scratch tokens
        span[p:] = 1
        last[:] = start + span - 1
        self.buf.copy_(host_to_device(h, self.buf.device))
        return np.asarray(order, dtype=np.int64)

    def _forward(self):
        model = self.model
        self.step.reset()
        hook = _KeepPositions(model.lm_head, self.last)
        try:
            with _positions_unchecked(model):
                logits = _logits_of(model(self.ids, position_ids=self.pos, carry=self.step))
        finally:
            hook.remove()
        return logits.reshape(-1, logits.shape[-1]), _final_states(self.step, self.fam)

    def __call__(self, seqs: List[torch.Tensor], rows: List[List[int]]):
        """(the prompts in layout order, their last-token logits, their :class:`_PromptStates`): buffers the next
        call overwrites (read them, in stream order, before it)."""
        if len(rows) > self.rows or sum(len(r) for r in rows) > self.slots:
            raise RuntimeError(f"generate_packed: a prefill of {len(rows)} rows / {sum(len(r) for r in rows)} "
                               f"prompts for a graph of {self.rows} / {self.slots}")
        order = self._load(seqs, rows)
        if self.graph is None:
            logits, layers = self._forward()
        else:
            self.graph.replay()
            logits, layers = self.logits, self.layers
        p = len(order)
        return order, logits[:p], _PromptStates([(c[:p], s[:p]) for c, s in layers])


# --------------------------------------------------------------------------------------------------
# decoding caches


class _InferenceParams:
    """mamba-ssm's ``InferenceParams`` (``utils.generation``), for when mamba-ssm is not installed (the stand-in
    models of the tests): the fields its mixers read."""

    def __init__(self, max_seqlen: int, max_batch_size: int):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: dict = {}
        self.lengths_per_sample = None


def _new_inference_params(max_seqlen: int, batch: int):
    try:
        from mamba_ssm.utils.generation import InferenceParams
        return InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch)
    except ImportError:
        return _InferenceParams(max_seqlen, batch)


def _new_rows(conv: torch.Tensor, ssm: torch.Tensor, states: "_PromptStates", li: int, what: str):
    """Decode-cache rows (laid out like the cache's ``conv`` (b, d, w) / ``ssm`` (b, d, n)) holding layer ``li`` of
    the prefill's ``states``: conv's last w-1 columns are the last w-1 inputs (a decode step shifts left and appends
    the new input), its first column zeros."""
    c, s = states.layer(li)
    if conv.shape[1:-1] != c.shape[1:-1] or conv.shape[-1] < c.shape[-1] or ssm.shape[1:] != s.shape[1:]:
        raise RuntimeError(f"generate_packed: {what}: the decode cache's states {tuple(conv.shape)} / "
                           f"{tuple(ssm.shape)} do not fit the prefill's {tuple(c.shape)} / {tuple(s.shape)}")
    return F.pad(c.to(conv.dtype), (conv.shape[-1] - c.shape[-1], 0)), s.to(ssm.dtype)


def _fill_state(conv_dst: torch.Tensor, ssm_dst: torch.Tensor, states: "_PromptStates", li: int, what: str) -> None:
    """Write layer ``li`` of the prefill's final states into a decode cache's tensors (as many rows)."""
    new_conv, new_ssm = _new_rows(conv_dst, ssm_dst, states, li, what)
    if new_conv.shape[0] != conv_dst.shape[0]:
        raise RuntimeError(f"generate_packed: {what}: {new_conv.shape[0]} prefilled prompts for a decode cache of "
                           f"{conv_dst.shape[0]} rows")
    conv_dst.copy_(new_conv)
    ssm_dst.copy_(new_ssm)


class _MambaSSMDecoder:
    """Batched decoding through mamba-ssm's cache (``InferenceParams``, ``seqlen_offset > 0``: each mixer's
    ``step``)."""

    def __init__(self, model, fam: _Family, states: "_PromptStates", max_seqlen: int):
        b = len(states)
        self.model = model
        self.mixers = fam.mixers
        self.params = _new_inference_params(max_seqlen, b)
        for li, m in enumerate(fam.mixers):
            conv, ssm = m.allocate_inference_cache(b, max_seqlen)
            _fill_state(conv, ssm, states, li, f"layer {m.layer_idx}")
            self.params.key_value_memory_dict[m.layer_idx] = (conv, ssm)
        self.params.seqlen_offset = 1   # > 0: the mixers step from the cache

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens[:, None], inference_params=self.params, num_last_tokens=1)
        self.params.seqlen_offset += 1
        return _logits_of(out)[:, -1]

    def keep(self, idx: torch.Tensor) -> None:
        d = self.params.key_value_memory_dict
        for k, (conv, ssm) in list(d.items()):
            d[k] = (conv.index_select(0, idx).contiguous(), ssm.index_select(0, idx).contiguous())
        self.params.max_batch_size = int(idx.numel())

    def add(self, states: "_PromptStates") -> None:
        """Append rows decoding from the prefill's ``states``."""
        d = self.params.key_value_memory_dict
        for li, m in enumerate(self.mixers):
            conv, ssm = d[m.layer_idx]
            new_conv, new_ssm = _new_rows(conv, ssm, states, li, f"layer {m.layer_idx}")
            d[m.layer_idx] = (torch.cat([conv, new_conv]), torch.cat([ssm, new_ssm]))
        self.params.max_batch_size = int(d[self.mixers[0].layer_idx][0].shape[0])


class _FixedRows:
    """What the fixed-row decoders share: a step copies the tokens into the buffer the model reads, then replays the
    graph (or runs the forward, without one); a prefill's states are written into rows of the cache's tensors in
    place (the graph reads those tensors). A subclass gives ``_forward()`` and ``_layer_states()``: each layer's
    (conv, ssm, name)."""

    graph = None

    def _forward(self) -> torch.Tensor:
        raise NotImplementedError

    def _layer_states(self):
        raise NotImplementedError

    def _zero_states(self) -> None:
        """After the capture: its warm-up stepped the states."""
        for conv, ssm, _ in self._layer_states():
            conv.zero_()
            ssm.zero_()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """(slots, vocab) logits after ``tokens`` (slots,); with a graph, a buffer the next step overwrites."""
        self.tokens.copy_(tokens)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits

    def write(self, where: torch.Tensor, states: "_PromptStates") -> None:
        """Put the prefill's ``states`` into the rows ``where``."""
        for li, (conv, ssm, name) in enumerate(self._layer_states()):
            new_conv, new_ssm = _new_rows(conv, ssm, states, li, name)
            conv.index_copy_(0, where, new_conv)
            ssm.index_copy_(0, where, new_ssm)


class _SlotDecoder(_FixedRows):
    """mamba-ssm decoding over a fixed number of slots, each step one CUDA graph replay (``cuda_graph=True``).

    The cache holds ``slots`` rows for the whole generation: a prompt that stops frees its row, a waiting prompt's
    prefilled states are written into a free row, and every step decodes all rows (a free row's token and states are
    garbage that nobody reads; rows never mix). Shapes never change, so one graph captured before the first prompt
    arrives serves every step: all of a step's kernel launches become one replay. ``capture=False`` runs
    the same bookkeeping eagerly (the CPU tests of it)."""

    def __init__(self, model, fam: _Family, slots: int, max_seqlen: int, device: torch.device, capture: bool):
        self.model = model
        self.mixers = fam.mixers
        self.params = _new_inference_params(max_seqlen, slots)
        for m in fam.mixers:
            self.params.key_value_memory_dict[m.layer_idx] = m.allocate_inference_cache(slots, max_seqlen)
        self.params.seqlen_offset = 1   # > 0: the mixers step from the cache
        self.tokens = torch.zeros(slots, dtype=torch.int64, device=device)
        if capture:
            self.graph, self.logits = _captured(self._forward, device)
            self._zero_states()

    def _forward(self) -> torch.Tensor:
        out = self.model(self.tokens[:, None], inference_params=self.params, num_last_tokens=1)
        return _logits_of(out)[:, -1]

    def _layer_states(self):
        d = self.params.key_value_memory_dict
        return [(*d[m.layer_idx], f"layer {m.layer_idx}") for m in self.mixers]


class _HFSlotDecoder(_FixedRows):
    """transformers' decoding over a fixed number of slots (``cuda_graph=True``), as :class:`_SlotDecoder` does for
    mamba-ssm: a cache of ``slots`` rows made by transformers itself (a one-token forward with ``use_cache=True``),
    every step one CUDA graph replay of the model's one-token forward, whose converted Mamba-1 / FalconMamba / Mamba-2
    mixers run fused state updates in place on the cache's tensors (``ops.hf.fused_step_states``: a graph replays kernels,
    not transformers' Python). A prompt's prefilled states are written into its row of those tensors.
    ``capture=False`` runs the same bookkeeping eagerly (the CPU tests of it)."""

    def __init__(self, model, fam: _Family, slots: int, device: torch.device, capture: bool):
        from .hf import fused_step_states
        self.model = model
        self.layers = [m.layer_idx for m in fam.mixers]
        self.tokens = torch.zeros(slots, dtype=torch.int64, device=device)
        params = inspect.signature(model.forward).parameters
        cache_kw = "cache" if "cache" in params else "cache_params"
        out = model(input_ids=self.tokens[:, None], use_cache=True)
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = getattr(out, "cache_params", None)
        unfused = [m.layer_idx for m in fam.mixers if fused_step_states(m, cache) is None]
        if unfused:
            raise NotImplementedError(
                f"generate_packed: cuda_graph=True replays each layer's single-token step from a CUDA graph, but in "
                f"this transformers version ({type(cache).__name__} cache) layers {unfused} step through "
                "transformers' own code, which a graph cannot replay (use cuda_graph=False)")
        self.cache = cache
        self.kw = {cache_kw: cache, "use_cache": True}
        if "cache_position" in params:   # > 0 and past the conv window: a decode step (the fused step ignores it)
            self.kw["cache_position"] = torch.full((1,), max(fam.mixers[0].conv_kernel_size, 2), dtype=torch.int64,
                                                   device=device)
        if capture:
            self.graph, self.logits = _captured(self._forward, device)
            self._zero_states()

    def _forward(self) -> torch.Tensor:
        return _logits_of(self.model(input_ids=self.tokens[:, None], **self.kw))[:, -1]

    def _layer_states(self):
        return [(*_hf_layer_states(self.cache, layer), f"layer {layer}") for layer in self.layers]


class _EagerPrefill:
    """:func:`_prefill` with :class:`_PrefillGraphs`' call: the prefill of ``cuda_graph=True`` for transformers'
    models (packed, eager; their decode runs from graphs)."""

    def __init__(self, model, fam: _Family, cap: int, prefill_tokens: int, device: torch.device):
        self.model, self.fam, self.cap, self.prefill_tokens, self.device = model, fam, cap, prefill_tokens, device

    def __call__(self, seqs: List[torch.Tensor], take: List[int], algorithm: str):
        return _prefill(self.model, self.fam, seqs, take, self.cap, self.prefill_tokens, algorithm, self.device)


def _hf_layer_states(cache, layer: int):
    """(conv (b, d, w), ssm (b, d, n)) of ``layer`` in transformers' cache: 5.24+'s ``DynamicCache`` of linear
    attention layers, or 5.0-5.23's ``MambaCache``."""
    layers = getattr(cache, "layers", None)
    if layers is not None and hasattr(layers[layer], "conv_states"):
        lay = layers[layer]
        return lay.conv_states[0], lay.recurrent_states[0]
    if hasattr(cache, "conv_states") and hasattr(cache, "ssm_states"):
        return cache.conv_states[layer], cache.ssm_states[layer]
    raise NotImplementedError(f"generate_packed: this transformers version's cache ({type(cache).__name__}) is not "
                              "one packloader knows (MambaCache, or DynamicCache with conv / recurrent states)")


def _hf_set_layer_states(cache, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
    layers = getattr(cache, "layers", None)
    if layers is not None and hasattr(layers[layer], "conv_states"):
        layers[layer].conv_states[0] = conv
        layers[layer].recurrent_states[0] = ssm
    else:
        cache.conv_states[layer] = conv
        cache.ssm_states[layer] = ssm
        if hasattr(cache, "max_batch_size"):
            cache.max_batch_size = conv.shape[0]


class _HFDecoder:
    """Batched decoding through transformers' own cache path. The cache is made by transformers itself (a one-token
    forward with ``use_cache=True``), then its states are overwritten with the prefill's."""

    def __init__(self, model, fam: _Family, states: "_PromptStates", first_tokens: torch.Tensor):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "cache_params"
        self.takes_position = "cache_position" in params
        out = model(input_ids=first_tokens[:, None], use_cache=True)
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = getattr(out, "cache_params", None)
        if cache is None:
            raise NotImplementedError("generate_packed: this transformers version returned no cache from "
                                      f"{type(model).__name__}(..., use_cache=True)")
        self.cache = cache
        self.layers = [m.layer_idx for m in fam.mixers]
        for li, layer in enumerate(self.layers):
            conv, ssm = _hf_layer_states(cache, layer)
            _fill_state(conv, ssm, states, li, f"layer {layer}")
        self.position = max(fam.mixers[0].conv_kernel_size, 2)   # > 0 and past the conv window: a decode step

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        kw = {self.cache_kw: self.cache, "use_cache": True}
        if self.takes_position:
            kw["cache_position"] = torch.tensor([self.position], device=tokens.device)
        out = self.model(input_ids=tokens[:, None], **kw)
        self.position += 1
        return _logits_of(out)[:, -1]

    def _stacked(self) -> bool:
        """transformers 5.0's Mamba2Cache: one (layers, batch, ...) tensor for all layers' conv / ssm states."""
        return isinstance(getattr(self.cache, "conv_states", None), torch.Tensor)

    def keep(self, idx: torch.Tensor) -> None:
        if self._stacked():
            self.cache.conv_states = self.cache.conv_states.index_select(1, idx).contiguous()
            self.cache.ssm_states = self.cache.ssm_states.index_select(1, idx).contiguous()
            self.cache.batch_size = int(idx.numel())
            return
        for layer in self.layers:
            conv, ssm = _hf_layer_states(self.cache, layer)
            _hf_set_layer_states(self.cache, layer, conv.index_select(0, idx).contiguous(),
                                 ssm.index_select(0, idx).contiguous())

    def add(self, states: "_PromptStates") -> None:
        news = []
        for li, layer in enumerate(self.layers):
            conv, ssm = _hf_layer_states(self.cache, layer)
            news.append(_new_rows(conv, ssm, states, li, f"layer {layer}"))
        if self._stacked():
            if self.layers != list(range(len(self.layers))):
                raise NotImplementedError("generate_packed: a stacked Mamba2Cache whose layers are not 0..n-1")
            self.cache.conv_states = torch.cat([self.cache.conv_states, torch.stack([c for c, _ in news])], 1)
            self.cache.ssm_states = torch.cat([self.cache.ssm_states, torch.stack([s for _, s in news])], 1)
            self.cache.batch_size = int(self.cache.conv_states.shape[1])
            return
        for layer, (conv, ssm), (new_conv, new_ssm) in zip(self.layers, [_hf_layer_states(self.cache, layer)
                                                                          for layer in self.layers], news):
            _hf_set_layer_states(self.cache, layer, torch.cat([conv, new_conv]), torch.cat([ssm, new_ssm]))


# --------------------------------------------------------------------------------------------------
# sampling


def _check_sampling(temperature, top_k, top_p, seed):
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive int, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or isinstance(top_p, bool)
                              or not 0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)):
        raise ValueError(f"seed must be None or an int, got {seed!r}")


def _next_tokens(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
                 generator: Optional[torch.Generator]) -> torch.Tensor:
    """(b,) next tokens from (b, vocab) logits: argmax when ``temperature == 0``, else a draw from the softmax of
    ``logits / temperature`` restricted to the ``top_k`` most likely tokens and the smallest set whose probability
    reaches ``top_p``."""
    if temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / float(temperature)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, int(top_k), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs >= float(top_p)     # the tokens after the set reached top_p (never the first)
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------------------------------
# generate_packed


def generate_packed(model, prompts: Prompts, max_new_tokens: Union[int, Sequence[int]], *,
                    capacity: Optional[int] = None, temperature: float = 0.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None, seed: Optional[int] = None,
                    stop_token_ids: Optional[Sequence[int]] = None, eos_token_id: Optional[int] = None,
                    batch_size: Optional[int] = None, prefill_tokens: Optional[int] = None,
                    algorithm: str = "bfd", cuda_graph: bool = False) -> List[torch.Tensor]:
    """Generate a continuation of every prompt: packed prefill, then all prompts decoded together.

    The prompts are packed into rows of ``capacity`` tokens (:mod:`packer_algos`, no padding between prompts); one
    packed forward per group of rows gives each prompt's last-token logits and its final conv and scan states (the
    carry path, :mod:`ops.carry`); the model's decoding cache is filled with those states and all prompts of a batch
    decode together, one token per step, through the model's usual decode path (mamba-ssm: ``InferenceParams`` with
    ``seqlen_offset > 0``; transformers: its cache). A prompt leaves the batch when it has its ``max_new_tokens`` or
    produced a stop token, and a waiting prompt takes its place (``batch_size``). Greedy outputs equal generating each
    prompt alone (fp32; the decode path is the same, the prefill differs from a single-sequence forward only by
    rounding).

    Example::

        >>> import ops, transformers
        >>> model = ops.enable_packing(transformers.MambaForCausalLM(config)).eval()
        >>> outs = ops.generate_packed(model, [[12, 7, 99], [5, 5]], max_new_tokens=8, eos_token_id=0)
        >>> [o.tolist() for o in outs]            # each prompt, then its new tokens (up to and with a stop token)

    Args:
        model: a mamba-ssm ``MambaLMHeadModel`` (Mamba-1 mixers) or a transformers ``MambaForCausalLM`` /
            ``FalconMambaForCausalLM`` / ``Mamba2ForCausalLM``, converted by :func:`ops.enable_packing`. Run in eval
            mode under ``torch.no_grad`` (its mode is restored after). mamba-ssm's Mamba-2 mixers and hybrids with
            attention layers are refused.
        prompts: token-id lists or 1-D integer tensors, any lengths (>= 1 token each).
        max_new_tokens: new tokens per prompt, an int for all or one int per prompt (0: the prompt comes back as it
            is).
        capacity: tokens per packed row of the prefill (default: 256, or fewer when all prompts fit in fewer, but
            at least the longest prompt; shorter rows run side by side, longer rows leave the GPU idle). A prompt
            longer than ``capacity`` is an error.
        temperature: 0 (default) decodes greedily (argmax); > 0 samples from ``softmax(logits / temperature)``.
        top_k: sample among the ``top_k`` most likely tokens only (None: all).
        top_p: sample among the smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus;
            None or 1.0: all).
        seed: seeds the sampling generator: the same arguments give the same tokens. The draws depend on the batch
            (which prompts decode together), so a prompt sampled alone with the same seed gets other tokens.
        stop_token_ids: token ids that end a prompt's generation (the stop token is kept in the output).
        eos_token_id: one more stop token (e.g. the tokenizer's end of text); None: only ``stop_token_ids``.
        batch_size: the most prompts decoded together (default: all of them). Prompts enter in the given order;
            when prompts stop, waiting ones are prefilled (packed, as a group, once an eighth of the batch is free)
            and join the running batch (continuous batching).
        prefill_tokens: tokens per packed forward (rows x capacity; default 65536, one row at least); bounds the
            prefill's activation memory.
        algorithm: the :func:`packer_algos.pack` algorithm ("bfd", "ffd", "first_fit", "next_fit").
        cuda_graph: decode from a cache of ``batch_size`` fixed rows, each step one CUDA graph replay, and prefill
            through graphs too (one a power-of-two row count, the rows padded to it). mamba-ssm's
            ``generate(..., cg=True)`` does this for one padded batch; here it serves the whole stream of prompts. A
            stopped prompt's row is refilled by a waiting one; every step decodes all rows. The graphs are captured
            on first use (0.07-0.08 s for the decode of 24 layers on an H100) and kept on the model, as mamba-ssm
            keeps its own: a later call of the same shapes replays them; moving or replacing a parameter drops them.
            CUDA models only: mamba-ssm's ``MambaLMHeadModel``, and transformers' ``MambaForCausalLM`` /
            ``FalconMambaForCausalLM`` / ``Mamba2ForCausalLM`` (their decode from graphs, the prefill eager;
            transformers versions whose cache gives each layer ``conv_states`` / ``recurrent_states``, else
            NotImplementedError).

    Returns:
        one 1-D int64 tensor per prompt, on the model's device: the prompt followed by its new tokens.

    Raises:
        ValueError / TypeError: bad prompts (empty, not 1-D, not integers, token ids outside the vocabulary),
            ``max_new_tokens``, ``capacity``, sampling arguments or ``batch_size``, naming the argument; a model not
            converted by :func:`ops.enable_packing`.
        NotImplementedError: a model whose layers cannot give per-prompt states (mamba-ssm's Mamba-2, attention);
            ``cuda_graph=True`` on a model whose decode step a graph cannot replay (a transformers version, or a
            Mamba-2 variant, that steps Mamba through its own code).
    """
    fam = _family(model)
    seqs = _as_token_list(prompts, "prompts")
    n = len(seqs)
    _check_vocab(seqs, _model_vocab(model), "prompts")
    if isinstance(max_new_tokens, (int, np.integer)) and not isinstance(max_new_tokens, bool):
        budgets = [int(max_new_tokens)] * n
    elif isinstance(max_new_tokens, (list, tuple, np.ndarray, torch.Tensor)):
        budgets = [int(v) for v in max_new_tokens]
        if len(budgets) != n:
            raise ValueError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    else:
        raise TypeError(f"max_new_tokens must be an int or one int per prompt, got {type(max_new_tokens).__name__}")
    if any(b < 0 for b in budgets):
        raise ValueError(f"max_new_tokens must be >= 0, got {min(budgets)}")
    _check_sampling(temperature, top_k, top_p, seed)
    if batch_size is not None and (not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be None or a positive int, got {batch_size!r}")
    if prefill_tokens is not None and (not isinstance(prefill_tokens, (int, np.integer)) or prefill_tokens < 1):
        raise ValueError(f"prefill_tokens must be None or a positive int, got {prefill_tokens!r}")
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph must be a bool, got {type(cuda_graph).__name__}")
    stops = set(int(t) for t in (stop_token_ids or ()))
    if eos_token_id is not None:
        stops.add(int(eos_token_id))
    lengths = np.array([int(s.numel()) for s in seqs], dtype=np.int64)
    cap = _capacity(lengths, capacity, "prompts", _DEFAULT_GENERATE_CAPACITY)
    device = _model_device(model)
    if cuda_graph:
        _check_cuda_graph(fam, device)
    generator = None
    if seed is not None and temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed))
    stop_tensor = torch.tensor(sorted(stops), dtype=torch.int64, device=device) if stops else None
    todo = [i for i in range(n) if budgets[i] > 0]
    records: list = []          # (prompt indices on the host, tokens on the device) of every step
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if todo:
                run = _generate_in_slots if cuda_graph else _generate_stream
                run(model, fam, seqs, todo, budgets, cap, prefill_tokens or _DEFAULT_PREFILL_TOKENS, algorithm,
                    temperature, top_k, top_p, generator, stop_tensor, device,
                    len(todo) if batch_size is None else int(batch_size), records)
    finally:
        model.train(was_training)
    new_tokens: List[List[int]] = [[] for _ in range(n)]
    if records:                 # one read from the device for the whole generation
        for i, v in zip(np.concatenate([r[0] for r in records]).tolist(),
                        torch.cat([r[1] for r in records]).tolist()):
            if i >= 0:                                          # -1: a free row of the slot decoder
                new_tokens[i].append(v)
    return [torch.cat([seqs[i], torch.tensor(new_tokens[i], dtype=torch.int64)]).to(device) for i in range(n)]


def _prefill(model, fam, seqs, take, cap, prefill_tokens, algorithm, device):
    """Packed prefill of the prompts ``take``: (last-token logits (len(take), vocab), their :class:`_PromptStates`),
    in ``take``'s order."""
    sub = [seqs[i] for i in take]
    lengths = np.array([int(s.numel()) for s in sub], dtype=np.int64)
    return _in_take_order([_prefill_group(model, fam, sub, group, device) for group in
                           _row_groups(pack_prompts(lengths, cap, algorithm), lengths, cap, prefill_tokens)], device)


def _in_take_order(groups, device):
    """(logits, :class:`_PromptStates`) in ``take``'s order from the groups' (order, logits, states)."""
    order = np.concatenate([g[0] for g in groups])
    logits, states = torch.cat([g[1] for g in groups]), _PromptStates.cat([g[2] for g in groups])
    if not np.array_equal(order, np.arange(len(order))):     # back to ``take``'s order: one gather a tensor
        inv = np.empty_like(order)
        inv[order] = np.arange(len(order))
        inv_dev = host_to_device(inv, device, torch.int64)
        logits, states = logits.index_select(0, inv_dev), states.subset(inv_dev)
    return logits, states


class _PrefillGraphs:
    """The graphed prefills (:class:`_GraphedPrefill`) of one ``cuda_graph=True`` generation: rows of ``length``
    tokens, one graph per row count (1, 2, 4, ... up to ``max_rows``), captured on first use; ``__call__`` is
    :func:`_prefill`'s."""

    def __init__(self, model, fam: _Family, length: int, slots: int, max_rows: int, device: torch.device,
                 capture: bool):
        self.model, self.fam, self.length, self.slots, self.max_rows = model, fam, length, slots, max_rows
        self.device, self.capture = device, capture
        self.graphs: Dict[int, _GraphedPrefill] = {}

    def __call__(self, seqs: List[torch.Tensor], take: List[int], algorithm: str):
        sub = [seqs[i] for i in take]
        rows = pack_prompts(np.array([int(t.numel()) for t in sub], dtype=np.int64), self.length, algorithm)
        groups = []
        for i in range(0, len(rows), self.max_rows):
            part = rows[i:i + self.max_rows]
            count = min(self.max_rows, 1 << (len(part) - 1).bit_length())
            if count not in self.graphs:
                self.graphs[count] = _GraphedPrefill(self.model, self.fam, count, self.length, self.slots,
                                                     self.device, self.capture)
            order, logits, states = self.graphs[count](sub, part)
            if len(rows) > self.max_rows:       # the next replay of a graph overwrites its outputs
                states = _PromptStates([(c.clone(), s.clone()) for c, s in states.layers])
                logits = logits.clone()
            groups.append((order, logits, states))
        return _in_take_order(groups, self.device)


def _generate_stream(model, fam, seqs, todo, budgets, cap, prefill_tokens, algorithm, temperature, top_k, top_p,
                     generator, stop_tensor, device, batch_size, records):
    """Decode ``todo`` with at most ``batch_size`` prompts in flight: prompts that stop leave the batch, and waiting
    prompts (prefilled packed, a group at a time) take their places once an eighth of the batch is free.

    Which prompts go on is known on the host where only the budgets stop them (no stop tokens): then a decode step
    waits for nothing on the GPU, as mamba-ssm's own loop without an end token. With stop tokens each step reads
    back which prompts produced one (one sync a step)."""
    queue = list(todo)
    budget = np.asarray(budgets, dtype=np.int64)
    produced = np.zeros(len(budgets), dtype=np.int64)
    refill_at = max(1, batch_size // 8)
    max_seqlen = max(int(seqs[i].numel()) for i in todo) + max(budgets)
    decoder = None
    active = np.zeros(0, dtype=np.int64)                            # the prompts in the decode batch, by row
    tok = torch.zeros(0, dtype=torch.int64, device=device)

    def finished(ids: np.ndarray, t: torch.Tensor) -> np.ndarray:
        """The rows of ``ids`` that go on after producing ``t``."""
        produced[ids] += 1
        going = produced[ids] < budget[ids]
        if stop_tensor is not None:
            going &= ~torch.isin(t, stop_tensor).cpu().numpy()
        return np.flatnonzero(going)

    def on_device(idx: np.ndarray) -> torch.Tensor:
        return host_to_device(np.array(idx), device, torch.int64)

    while True:
        free = batch_size - active.size
        if queue and (active.size == 0 or free >= refill_at):
            take, queue = queue[:free], queue[free:]
            logits, states = _prefill(model, fam, seqs, take, cap, prefill_tokens, algorithm, device)
            ids = np.asarray(take, dtype=np.int64)
            t_new = _next_tokens(logits, temperature, top_k, top_p, generator)
            records.append((ids, t_new))
            keep = finished(ids, t_new)
            if keep.size:
                live = states
                if keep.size < ids.size:
                    keep_dev = on_device(keep)
                    live, t_new = states.subset(keep_dev), t_new.index_select(0, keep_dev)
                if decoder is None:
                    decoder = (_MambaSSMDecoder(model, fam, live, max_seqlen) if fam.kind == "mamba_ssm"
                               else _HFDecoder(model, fam, live, t_new))
                else:
                    decoder.add(live)
                active = np.concatenate([active, ids[keep]])
                tok = torch.cat([tok, t_new])
            continue
        if active.size == 0:
            return
        tok = _next_tokens(decoder.step(tok), temperature, top_k, top_p, generator)
        records.append((active, tok))        # ``active`` is replaced, never changed in place
        keep = finished(active, tok)
        if keep.size < active.size:
            keep_dev = on_device(keep)
            decoder.keep(keep_dev)
            tok = tok.index_select(0, keep_dev)
            active = active[keep]


def _check_cuda_graph(fam: _Family, device: torch.device) -> None:
    """``cuda_graph=True`` needs a CUDA model (the CPU tests replace this check); whether every layer's step is
    fused (what a graph can replay) is checked on the decoder's cache (:class:`_HFSlotDecoder`)."""
    if device.type != "cuda":
        raise ValueError(f"generate_packed: cuda_graph=True needs the model on a CUDA device, it is on {device}")


def _kept_graphs(model, device: torch.device) -> dict:
    """The CUDA graphs of earlier ``cuda_graph=True`` calls (decoders and prefills by their shapes), kept on the model
    as mamba-ssm keeps its own: a call of the same shapes replays them instead of capturing again. They read the
    parameters where they were: any parameter moved or replaced (``.to()``, new tensors) drops them all."""
    key = (device, tuple(p.data_ptr() for p in model.parameters()))
    kept = model.__dict__.get("_packloader_generate_graphs")
    if kept is None or kept["key"] != key:
        kept = model.__dict__["_packloader_generate_graphs"] = {"key": key}
    return kept


def _generate_in_slots(model, fam, seqs, todo, budgets, cap, prefill_tokens, algorithm, temperature, top_k, top_p,
                       generator, stop_tensor, device, batch_size, records):
    """``_generate_stream`` over the fixed rows of a :class:`_SlotDecoder` (transformers: :class:`_HFSlotDecoder`),
    with the same tokens. Waiting prompts are prefilled (packed, as a group, through :class:`_PrefillGraphs`;
    transformers: eagerly) once a quarter of the rows is free. A record's prompt index is -1 for a free row."""
    queue = list(todo)
    budget = np.asarray(budgets, dtype=np.int64)
    produced = np.zeros(len(budgets), dtype=np.int64)
    slots = min(batch_size, len(todo))
    refill_at = max(1, batch_size // _SLOT_REFILL_DIVISOR)
    max_seqlen = max(int(seqs[i].numel()) for i in todo) + max(budgets)
    kept = _kept_graphs(model, device)
    max_seqlen = 1 << (max_seqlen - 1).bit_length()
    capture = device.type == "cuda"
    if fam.kind == "mamba_ssm":
        decoder = kept.get(("decode", slots, max_seqlen))
        if decoder is None:
            decoder = kept[("decode", slots, max_seqlen)] = _SlotDecoder(model, fam, slots, max_seqlen, device,
                                                                         capture)
        max_rows = max(1, prefill_tokens // cap)
        prefill = kept.get(("prefill", cap, slots, max_rows))
        if prefill is None:
            prefill = kept[("prefill", cap, slots, max_rows)] = _PrefillGraphs(model, fam, cap, slots, max_rows,
                                                                               device, capture)
    else:   # transformers: the decode from graphs (its cache has no sequence length), the prefill eager
        decoder = kept.get(("decode", slots))
        if decoder is None:
            decoder = kept[("decode", slots)] = _HFSlotDecoder(model, fam, slots, device, capture)
        prefill = _EagerPrefill(model, fam, cap, prefill_tokens, device)
    owner = np.full(slots, -1, dtype=np.int64)          # the prompt decoding in each row, -1: free
    owner_now = owner.copy()                            # the records' copy: ``owner`` changes in place

    def on_device(idx: np.ndarray) -> torch.Tensor:
        return host_to_device(np.array(idx), device, torch.int64)

    tok = torch.zeros(slots, dtype=torch.int64, device=device)
    while True:
        free = np.flatnonzero(owner < 0)
        if queue and (free.size == slots or free.size >= refill_at):
            take, queue = queue[:free.size], queue[free.size:]
            logits, states = prefill(seqs, take, algorithm)
            ids = np.asarray(take, dtype=np.int64)
            t_new = _next_tokens(logits, temperature, top_k, top_p, generator)
            records.append((ids, t_new))
            produced[ids] += 1
            going = produced[ids] < budget[ids]
            if stop_tensor is not None:
                going &= ~torch.isin(t_new, stop_tensor).cpu().numpy()
            keep = np.flatnonzero(going)
            if keep.size:
                where = free[:keep.size]
                where_dev = on_device(where)
                if keep.size < ids.size:
                    keep_dev = on_device(keep)
                    states, t_new = states.subset(keep_dev), t_new.index_select(0, keep_dev)
                decoder.write(where_dev, states)
                tok = tok.index_copy(0, where_dev, t_new)   # not in place: the last step's record holds ``tok``
                owner[where] = ids[keep]
                owner_now = owner.copy()
            continue
        busy = np.flatnonzero(owner >= 0)
        if busy.size == 0:
            return
        tok = _next_tokens(decoder.step(tok), temperature, top_k, top_p, generator)
        records.append((owner_now, tok))
        ids = owner[busy]
        produced[ids] += 1
        done = produced[ids] >= budget[ids]
        if stop_tensor is not None:
            done |= torch.isin(tok, stop_tensor).cpu().numpy()[busy]
        if done.any():
            owner[busy[done]] = -1
            owner_now = owner.copy()


# --------------------------------------------------------------------------------------------------
# evaluation


@dataclass
class PackedEvalResult:
    """Per-sequence losses of :func:`evaluate_packed` (CPU tensors, in the order of the sequences given).

    Attributes:
        loss_sum: (n,) float64: each sequence's summed next-token cross-entropy (nats).
        num_tokens: (n,) int64: the tokens it was summed over (labels other than -100 after the first position).
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor

    @property
    def mean_loss(self) -> torch.Tensor:
        """(n,) float64: loss_sum / num_tokens (nan for a sequence without loss tokens)."""
        return self.loss_sum / self.num_tokens.to(torch.float64)

    @property
    def perplexity(self) -> torch.Tensor:
        """(n,) float64: exp(mean_loss)."""
        return torch.exp(self.mean_loss)

    @property
    def total_mean_loss(self) -> float:
        """The token-weighted mean loss of the whole set."""
        return float(self.loss_sum.sum() / max(int(self.num_tokens.sum()), 1))

    @property
    def total_perplexity(self) -> float:
        return math.exp(self.total_mean_loss)

    def metrics(self, prefix: str = "eval_packed") -> Dict[str, float]:
        """{prefix_loss, prefix_perplexity, prefix_tokens, prefix_sequences}: for a trainer's logs."""
        return {f"{prefix}_loss": self.total_mean_loss, f"{prefix}_perplexity": self.total_perplexity,
                f"{prefix}_tokens": int(self.num_tokens.sum()), f"{prefix}_sequences": int(self.num_tokens.numel())}


def _packed_logits(model, ids, pos):
    from .hf import is_transformers_model
    if is_transformers_model(model):
        return _logits_of(model(input_ids=ids, position_ids=pos))
    return _logits_of(model(ids, position_ids=pos))


def evaluate_packed(model, sequences: Prompts, labels: Optional[Prompts] = None, *, capacity: Optional[int] = None,
                    eval_tokens: Optional[int] = None, algorithm: str = "bfd") -> PackedEvalResult:
    """Each sequence's next-token loss, from packed rows (no padding between sequences, nothing leaks across them).

    The sequences are packed into rows of ``capacity`` tokens, run through the converted model with their
    ``position_ids`` in forwards of at most ``eval_tokens`` tokens, and each token's cross-entropy (log-softmax in
    float32, or float64 for a float64 model; summed in float64) goes to its sequence. The result equals running each
    sequence alone (fp32: within 1e-5).

    Example::

        >>> res = ops.evaluate_packed(model, held_out_token_lists, capacity=2048)
        >>> res.mean_loss[:3], res.perplexity[:3], res.total_perplexity

    Args:
        model: any model :func:`ops.enable_packing` converted whose forward returns logits (a mamba-ssm
            ``MambaLMHeadModel``, transformers' Mamba / FalconMamba / Mamba-2 models and hybrids), or any module
            whose ``forward(input_ids, position_ids=...)`` returns logits and isolates packed sequences. Evaluated
            in eval mode under ``torch.no_grad`` (its mode is restored after).
        sequences: token-id lists or 1-D integer tensors (>= 1 token each).
        labels: optional, one per sequence, of the same length: the target of position ``t`` is ``labels[t + 1]``
            (transformers' convention: labels are not shifted by the caller); -100 excludes a token (e.g. the
            prompt of a question-answer pair). Default: the sequence itself.
        capacity: tokens per packed row (default: 2048, at least the longest sequence, fewer when everything fits).
        eval_tokens: tokens per forward (rows x capacity; default 16384, one row at least): bounds the logits'
            memory (at most eval_tokens x vocab floats: the LM head runs on the scored positions only, where the
            model has an ``lm_head``).
        algorithm: the :func:`packer_algos.pack` algorithm.

    Returns:
        :class:`PackedEvalResult`: ``loss_sum``, ``num_tokens``, ``mean_loss``, ``perplexity`` per sequence, and
        ``total_mean_loss`` / ``total_perplexity`` / ``metrics()`` over the set.

    Raises:
        ValueError / TypeError: bad sequences or labels (empty, not 1-D, lengths that differ, token ids outside the
            vocabulary), a bad ``capacity`` / ``eval_tokens``, naming the argument; an unconverted model.
    """
    from .hf import is_transformers_model
    if is_transformers_model(model) or hasattr(model, "backbone"):
        if "_packloader_conversion" not in model.__dict__:
            raise ValueError(f"evaluate_packed: {type(model).__name__} is not converted; call "
                             "ops.enable_packing(model) first (an unconverted model lets packed sequences leak)")
    seqs = _as_token_list(sequences, "sequences")
    n = len(seqs)
    _check_vocab(seqs, _model_vocab(model), "sequences")
    if labels is None:
        labs = seqs
    else:
        if isinstance(labels, torch.Tensor) or len(labels) != n:
            raise ValueError(f"labels must be a list of {n} label sequences (one per sequence)")
        labs = []
        for i, l in enumerate(labels):
            t = l if isinstance(l, torch.Tensor) else torch.as_tensor(np.asarray(l))
            if t.dim() != 1 or t.numel() != seqs[i].numel():
                raise ValueError(f"labels[{i}] must be 1-D with the length of sequences[{i}] ({seqs[i].numel()}), "
                                 f"got shape {tuple(t.shape)}")
            labs.append(t.to("cpu", torch.int64))
    if eval_tokens is not None and (not isinstance(eval_tokens, (int, np.integer)) or eval_tokens < 1):
        raise ValueError(f"eval_tokens must be None or a positive int, got {eval_tokens!r}")
    lengths = np.array([int(s.numel()) for s in seqs], dtype=np.int64)
    cap = _capacity(lengths, capacity, "sequences")
    device = _model_device(model)
    rows = pack_prompts(lengths, cap, algorithm)
    loss_sum = torch.zeros(n, dtype=torch.float64, device=device)
    count = torch.zeros(n, dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for group in _row_groups(rows, lengths, cap, eval_tokens or 16384):
                ids, pos, _, _, order, flat_start = _packed_batch(seqs, group, device)
                R, L = ids.shape
                target = torch.full((R * L,), -100, dtype=torch.int64)
                owner = torch.zeros(R * L, dtype=torch.int64)
                for i, s in zip(order, flat_start):
                    m = int(seqs[i].numel())
                    target[s:s + m - 1] = labs[i][1:]       # position t predicts labels[t + 1]
                    owner[s:s + m] = i
                valid = target != -100
                where = valid.nonzero().squeeze(-1).to(device)
                if where.numel() == 0:
                    continue
                target, owner = target[valid].to(device), owner[valid].to(device)
                # the LM head runs on the scored positions only (a pre-hook): no logits for padding, for the last
                # token of each sequence or for tokens labelled -100
                hook = _KeepPositions(model.lm_head, where) if isinstance(getattr(model, "lm_head", None),
                                                                          torch.nn.Module) else None
                try:
                    logits = _packed_logits(model, ids, pos)
                finally:
                    if hook is not None:
                        hook.remove()
                logits = logits.reshape(-1, logits.shape[-1])
                if hook is None:
                    logits = logits.index_select(0, where)
                ct = torch.promote_types(logits.dtype, torch.float32)    # float32 at least; a float64 model: float64
                tok_loss = F.cross_entropy(logits.to(ct), target, reduction="none")
                loss_sum.index_add_(0, owner, tok_loss.to(torch.float64))
                count.index_add_(0, owner, torch.ones_like(owner))
    finally:
        model.train(was_training)
    return PackedEvalResult(loss_sum.cpu(), count.cpu())


class PackedEvalCallback:
    """A ``transformers.TrainerCallback`` that evaluates a held-out set with :func:`evaluate_packed` from a trainer's
    loop (``packloader.hf.PackedTrainer`` or any ``Trainer``).

    - ``trainer.evaluate()`` (and Trainer's own evaluation steps) gain ``{prefix}_loss``, ``{prefix}_perplexity``,
      ``{prefix}_tokens`` and ``{prefix}_sequences`` in their metrics;
    - with ``eval_steps``, it also evaluates every ``eval_steps`` optimizer steps by itself (no ``eval_dataset``
      needed) and logs the metrics through ``trainer.log`` (when attached with :meth:`attach`; else into
      ``state.log_history``).

    Example::

        cb = ops.PackedEvalCallback(held_out, capacity=2048, eval_steps=100)
        trainer = PackedTrainer(model=model, args=args, train_loader=loader)
        cb.attach(trainer)                          # trainer.add_callback(cb), logs through trainer.log
        trainer.train()                             # every 100 steps: eval_packed_loss, eval_packed_perplexity

    Args:
        sequences, labels, capacity, eval_tokens: as :func:`evaluate_packed`.
        eval_steps: evaluate every this many steps by itself (None: only when the trainer evaluates).
        prefix: the metrics' name prefix.

    It is a duck-typed ``TrainerCallback`` (every other ``on_*`` event does nothing), so ``import ops`` does not
    import transformers.
    """

    def __init__(self, sequences: Prompts, labels: Optional[Prompts] = None, *, capacity: Optional[int] = None,
                 eval_tokens: Optional[int] = None, eval_steps: Optional[int] = None, prefix: str = "eval_packed"):
        if eval_steps is not None and (not isinstance(eval_steps, int) or eval_steps < 1):
            raise ValueError(f"eval_steps must be None or a positive int, got {eval_steps!r}")
        self.sequences, self.labels = sequences, labels
        self.capacity, self.eval_tokens, self.eval_steps, self.prefix = capacity, eval_tokens, eval_steps, prefix
        self.trainer = None
        self.history: List[dict] = []

    def __getattr__(self, name):
        if name.startswith("on_"):     # the other TrainerCallback events: nothing to do
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def attach(self, trainer) -> "PackedEvalCallback":
        """Add this callback to ``trainer`` and log through ``trainer.log``."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def evaluate(self, model) -> Dict[str, float]:
        res = evaluate_packed(model, self.sequences, self.labels, capacity=self.capacity,
                              eval_tokens=self.eval_tokens)
        return res.metrics(self.prefix)

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        # Trainer.evaluate logs its metrics before this event: add ours to them (what evaluate() returns) and log
        # them too (log_history, the reporting integrations)
        if model is not None and metrics is not None:
            got = self.evaluate(model)
            metrics.update(got)
            if self.trainer is not None:
                self.trainer.log(dict(got))
            else:
                state.log_history.append(dict(got, step=state.global_step))
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.eval_steps and model is not None and state.global_step % self.eval_steps == 0:
            got = self.evaluate(model)
            self.history.append(dict(got, step=state.global_step))
            if self.trainer is not None:
                self.trainer.log(dict(got))
            else:
                state.log_history.append(dict(got, step=state.global_step))
        return control
