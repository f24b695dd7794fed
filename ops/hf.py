"""``enable_packing`` for Hugging Face transformers' Mamba, FalconMamba and Mamba-2 models and Mamba-2 hybrids.

:func:`ops.enable_packing` hands a transformers model here (detected by its class's module, never by
importing transformers). Supported, transformers >= 5.0 (tested: 5.0.0 and 5.23.0):

==========================================  ===========================================================
model                                        mixers run on packed rows by
==========================================  ===========================================================
``MambaForCausalLM`` / ``MambaModel``        ``ops.packed_mamba_inner_fn`` (our packed conv + scan,
                                             fused on the GPU, the reference on the CPU)
``FalconMambaForCausalLM`` / ``...Model``    ``ops.packed_causal_conv1d`` + ``ops.packed_selective_scan``
                                             (with FalconMamba's RMS norms on B, C and dt between them)
``Mamba2ForCausalLM`` / ``Mamba2Model``      transformers' own forward given ``seq_idx`` where mamba-ssm's
                                             kernels serve it (CUDA, mamba-ssm and causal-conv1d
                                             installed); elsewhere ``ops.packed_causal_conv1d`` +
                                             ``ops.packed_selective_scan`` (the SSD recurrence as a
                                             scan with one A per head), because transformers' PyTorch
                                             path cannot use ``seq_idx`` (5.23 refuses it, 5.0 drops it)
hybrids ``BambaForCausalLM``,                the Mamba-2 layers as ``Mamba2ForCausalLM``'s (transformers'
``NemotronHForCausalLM`` (not in 5.0),       forward with ``seq_idx`` where mamba-ssm serves it, else the
``GraniteMoeHybrid``,                        packed conv + scan; FalconH1's muP multipliers and optional
``FalconH1``, ``Zamba2`` (``*ForCausalLM``   norm included); the attention layers stay transformers' own,
/ ``*Model``)                                fed the boundaries it isolates with (see below)
==========================================  ===========================================================

Hybrids: attention. The converted hybrid passes ``position_ids`` on (derived from ``seq_idx`` /
``cu_seq_lens_q`` when only those are given), drops an all-ones ``attention_mask`` (a mask with zeros
is refused: transformers' attention would then ignore the packing) and, for flash attention, has every
attention layer add ``cu_seq_lens_q/k`` + ``max_length_q/k`` to its own keyword arguments. Which
``attn_implementation`` then isolates packed rows (checked by ``tests/ops/test_hf_hybrids.py`` in 5.0.0
and 5.23.0, flash attention there with a CPU stand-in for the kernel, and on CUDA by its GPU test):

=====================================  ==========================  ===============================
model                                  eager / sdpa                flash_attention_2 / _3
=====================================  ==========================  ===============================
Bamba, FalconH1, Zamba2                5.23: yes; 5.0: no          yes (varlen from cu_seq_lens)
NemotronH                              5.23: yes                   yes
GraniteMoeHybrid                       no (mask w/o position_ids)  yes
=====================================  ==========================  ===============================

Where it does not, ``enable_packing`` refuses with the layers and the implementation named, or, with
``allow_unprotected_attention=True``, converts the SSM layers, warns, and records the attention
layers in ``model._packloader_conversion["left_unsafe"]``. Any other implementation is refused.

After conversion::

    model(input_ids, position_ids=batch["position_ids"], labels=batch["labels"])   # or seq_idx=...,
                                                                                    # or cu_seq_lens_q=...

Why the model level: transformers' ``MambaForCausalLM.forward`` passes none of these keyword
arguments to its backbone (they end in the loss function), and ``MambaModel`` passes none to its
blocks, so a mixer never sees them. The converted model (or backbone) takes them out of ``**kwargs``,
resolves them once per batch into ``(position_ids, seq_idx)``, and each converted block hands them
to its mixer. The block receives them as a keyword argument of its own call, so gradient
checkpointing (which replays a block's forward with the keyword arguments it was first given)
recomputes with the same boundaries::

    MambaForCausalLM.forward(input_ids, position_ids=...)       pops + resolves the boundaries once
      MambaModel.forward(...)                                    (unchanged)
        MambaBlock.__call__  -> forward(..., packloader_boundaries=(pos, seq))   [checkpointed here]
          mixer._packloader_boundaries = (pos, seq) while the block runs
          MambaMixer.forward(hidden_states, ...)                 packed path

Without boundaries the converted model runs transformers' own code, unchanged; generation
(``cache_params``) too, except a Mamba-1 / FalconMamba mixer's single-token step on a filled cache, which runs
``ops.decode``'s fused state updates (``_mamba1_decode_step``: the same math, our Triton kernels). Conversion swaps classes only: parameters, ``state_dict`` keys and
checkpoints are untouched. Hybrids carry the boundaries the same way (a shared slot set by the
model's forward, lent to the SSM mixers by every converted layer on the way, as a keyword argument of
that layer's call so checkpointing replays it, Zamba2's nested layers included). Other hybrids (Jamba,
whose SSM layers are Mamba-1 mixers of its own class) are refused with the layers named.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .boundaries import (cu_seqlens_to_position_ids, position_ids_to_cu_seqlens, position_ids_to_seq_idx,
                         resolve_position_ids)

__all__ = ["is_transformers_model", "enable_packing_hf", "BOUNDARY_KWARGS"]

# keyword arguments that carry (or describe) packed boundaries in transformers' padding-free path and
# in packloader's batches; the converted model consumes all of them
BOUNDARY_KWARGS = ("position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens",
                   "max_length_q", "max_length_k", "max_seqlen")

_MAMBA1_MIXERS = ("MambaMixer", "FalconMambaMixer")
_MAMBA2_MIXERS = ("Mamba2Mixer",)
# the Mamba-2 mixers of transformers' hybrid SSM / attention models (same parameters as Mamba2Mixer; FalconH1 adds
# muP multipliers and an optional gated norm)
_HYBRID_MIXERS = ("BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "FalconH1Mixer",
                  "Zamba2MambaMixer")
_MAMBA1_ATTRS = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj")
_MAMBA2_ATTRS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "num_heads", "head_dim",
                 "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")


def _from_transformers(cls: type) -> bool:
    return (cls.__module__ or "").split(".")[0] == "transformers"


def is_transformers_model(model: nn.Module) -> bool:
    """True when ``model``'s class (or a base class) comes from transformers (no import of it)."""
    if "transformers" not in sys.modules:
        return False
    return any(_from_transformers(c) for c in type(model).__mro__)


def _hf_names(m: nn.Module) -> set:
    return {c.__name__ for c in type(m).__mro__ if _from_transformers(c)}


def _mixer_kind(m: nn.Module) -> Optional[str]:
    names = _hf_names(m)
    if names & set(_MAMBA1_MIXERS) and all(hasattr(m, a) for a in _MAMBA1_ATTRS):
        return "mamba1"
    if names & set(_MAMBA2_MIXERS) and all(hasattr(m, a) for a in _MAMBA2_ATTRS):
        return "mamba2"
    if names & set(_HYBRID_MIXERS) and all(hasattr(m, a) for a in _MAMBA2_ATTRS):
        return "hybrid"
    return None


def _looks_like_ssm(m: nn.Module) -> bool:
    return isinstance(m, nn.Module) and hasattr(m, "A_log") and any(_from_transformers(c) for c in type(m).__mro__)


def _looks_like_attention(m: nn.Module) -> bool:
    return any(_from_transformers(c) and c.__name__.endswith("Attention") for c in type(m).__mro__)


# --------------------------------------------------------------------------------------------------
# boundaries: resolved once per batch at the model level


class _BoundarySlot:
    """Shared by a converted model and its blocks: the boundaries of the batch being run."""

    __slots__ = ("value",)

    def __init__(self):
        self.value: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def __deepcopy__(self, memo):  # a copied model gets its own, empty slot
        return _BoundarySlot()

    def run(self, bounds, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` with these boundaries in the slot; the outer ones (a nested call's caller) again
        after."""
        outer = self.value
        self.value = bounds
        try:
            return fn(*args, **kwargs)
        finally:
            self.value = outer


def _batch_shape(args, kwargs) -> Tuple[int, int, torch.device]:
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        raise ValueError("enable_packing: packed boundaries need input_ids or inputs_embeds")
    return int(x.shape[0]), int(x.shape[1]), x.device


def _resolve(kwargs: dict, batch: int, seqlen: int, device, validate: bool, need_seq_idx: bool = True):
    """Pop every boundary kwarg; return int32 ``(position_ids, seq_idx)`` (``seq_idx`` None unless
    ``need_seq_idx``: only Mamba-2 mixers read it), or None when none was given."""
    given = {k: kwargs.pop(k) for k in BOUNDARY_KWARGS if k in kwargs}
    pos, seq = given.get("position_ids"), given.get("seq_idx")
    cu = given.get("cu_seq_lens_q", given.get("cu_seqlens"))
    if cu is None:
        cu = given.get("cu_seq_lens_k")
    if pos is None and seq is None and cu is None:
        return None
    if pos is None and seq is None:
        pos = cu_seqlens_to_position_ids(cu.to(device), shape=(batch, seqlen))
    pos = resolve_position_ids(pos, seq, batch, seqlen, device=device, validate=validate)
    return pos, (position_ids_to_seq_idx(pos) if need_seq_idx else None)


def _pop_carry(model, kwargs: dict, pos: Optional[torch.Tensor]):
    """The batch's carry plan (``ops.CarryStep``) from the carry keys in ``kwargs`` (``piece_doc_ids``,
    ``piece_index``, ``has_initial_state``, ``continues_after``: what ``PackedDataLoader(overflow="carry")`` adds),
    against the model's state cache (``model._packloader_state_cache``, made on first use); None without them."""
    from .carry import CARRY_KEYS, StateCache
    keys = {k: kwargs.pop(k) for k in CARRY_KEYS if k in kwargs}
    if not keys:
        return None
    if len(keys) != len(CARRY_KEYS) or pos is None:
        raise ValueError(f"enable_packing: the carry keys {CARRY_KEYS} come together, with the boundaries; got "
                         f"{sorted(keys)}" + ("" if pos is not None else " without position_ids"))
    cache = model.__dict__.get("_packloader_state_cache")
    if cache is None:
        cache = model.__dict__["_packloader_state_cache"] = StateCache()
    return cache.step(dict(keys, position_ids=pos))


def _model_forward(self, base_forward, args, kwargs):
    """Forward of a converted ``*ForCausalLM`` / ``*Model``."""
    if self.__dict__.get("_packloader_cp_group") is not None:   # ops.context_parallel
        from .context_parallel import ContextParallelError
        if kwargs.get("position_ids") is None:
            raise ContextParallelError(f"{type(self).__name__} (context-parallel) takes position_ids: this rank's "
                                       "chunk of the rows' ids, from ops.shard_batch")
        if kwargs.get("labels") is not None:
            raise ContextParallelError(f"{type(self).__name__} (context-parallel): compute the loss from "
                                       "ops.shard_batch's labels (already shifted across the chunks), not labels=")
    if all(kwargs.get(k) is None for k in BOUNDARY_KWARGS):
        _pop_carry(self, kwargs, None)
        for k in BOUNDARY_KWARGS:  # given as None (generation passes position_ids=None): not boundaries
            kwargs.pop(k, None)
        return base_forward(self, *args, **kwargs)
    batch, seqlen, device = _batch_shape(args, kwargs)
    bounds = _resolve(kwargs, batch, seqlen, device, getattr(self, "_packloader_validate", True),
                      getattr(self, "_packloader_need_seq_idx", True))
    if bounds is None:  # only max_length_* given: nothing to isolate
        return base_forward(self, *args, **kwargs)
    if kwargs.get("cache_params") is not None or kwargs.get("use_cache"):
        raise ValueError(
            "enable_packing: packed boundaries (position_ids / seq_idx / cu_seq_lens_q) cannot be combined with "
            "cache_params / use_cache=True: a recurrent cache holds one sequence per row. Generate one sequence "
            "per row, without boundaries."
        )
    kwargs["use_cache"] = False  # an eval forward would otherwise build a cache and take the cache path
    bounds = (bounds[0], bounds[1], _pop_carry(self, kwargs, bounds[0]))
    return self._packloader_slot.run(bounds, base_forward, self, *args, **kwargs)


def _block_call(self, base_call, args, kwargs):
    bounds = self._packloader_slot.value
    if bounds is not None:
        kwargs["packloader_boundaries"] = bounds
    return base_call(self, *args, **kwargs)


def _block_forward(self, base_forward, args, kwargs):
    bounds = kwargs.pop("packloader_boundaries", None)
    mixer = self.mixer
    outer = mixer.__dict__.get("_packloader_boundaries")
    mixer.__dict__["_packloader_boundaries"] = bounds
    try:
        return base_forward(self, *args, **kwargs)
    finally:
        mixer.__dict__["_packloader_boundaries"] = outer


# --------------------------------------------------------------------------------------------------
# mixers


def _mask(x: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """transformers' zeroing of padding positions ((batch, seqlen) mask), where a mask is given."""
    if attention_mask is None or attention_mask.dim() != 2:
        return x
    return (x * attention_mask[:, :, None]).to(x.dtype)


def _to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def _falcon_norms(mixer) -> Optional[str]:
    """How a FalconMamba mixer normalises dt, B and C: ``"modules"``, ``"eps"`` or None (plain Mamba)."""
    if all(hasattr(mixer, n) for n in ("b_layernorm", "c_layernorm", "dt_layernorm")):
        return "modules"
    if "FalconMambaMixer" in _hf_names(mixer):
        if hasattr(mixer, "rms_eps"):
            return "eps"
        raise NotImplementedError(
            f"enable_packing: this transformers version's {type(mixer).__name__} normalises dt, B and C in a way "
            "packloader does not know (no *_layernorm modules, no rms_eps)"
        )
    return None


def _falcon_fused_training(mixer, hidden_states: torch.Tensor) -> bool:
    """Whether transformers would run this FalconMamba mixer through mamba-ssm's fused ``mamba_inner_fn``:
    training, on CUDA, with mamba-ssm and causal-conv1d installed (the packed path runs without a cache)."""
    return (mixer.training and hidden_states.is_cuda and importlib.util.find_spec("mamba_ssm") is not None
            and importlib.util.find_spec("causal_conv1d") is not None)


def _weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _mamba1_packed(mixer, hidden_states, pos, attention_mask):
    """Mamba-1 (and FalconMamba) mixer forward on packed rows; (batch, seqlen, d_model) out."""
    import ops

    dtype = hidden_states.dtype
    hidden_states = _mask(hidden_states, attention_mask)
    A = -torch.exp(mixer.A_log.float())
    conv_bias = mixer.conv1d.bias if getattr(mixer, "use_conv_bias", True) else None
    has_norms = _falcon_norms(mixer)
    if not has_norms and attention_mask is None:
        return ops.packed_mamba_inner_fn(
            hidden_states, mixer.in_proj.weight, mixer.in_proj.bias, mixer.conv1d.weight, conv_bias,
            mixer.x_proj.weight, mixer.dt_proj.weight, mixer.out_proj.weight, mixer.out_proj.bias,
            A, mixer.D.float(), mixer.dt_proj.bias.float(), True, position_ids=pos, validate=False,
        ).to(dtype)
    # composed path: FalconMamba's norms on dt, B, C sit between x_proj and the scan (and a padding
    # mask is applied after the conv, as transformers does)
    d_inner = mixer.intermediate_size
    xz = mixer.in_proj(hidden_states)
    x = xz[..., :d_inner].transpose(1, 2).contiguous()
    z = xz[..., d_inner:].transpose(1, 2).contiguous()
    x = ops.packed_causal_conv1d(x, mixer.conv1d.weight.to(x.dtype), _to(conv_bias, x.dtype), activation="silu",
                                 position_ids=pos, validate=False)
    if attention_mask is not None and attention_mask.dim() == 2:
        x = x * attention_mask[:, None, :].to(x.dtype)
    dt, B, C = torch.split(mixer.x_proj(x.transpose(1, 2)),
                           [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    # transformers' FalconMamba normalises dt in two places: its PyTorch path before dt_proj (over the rank), its
    # fused training path (mamba-ssm's mamba_inner_fn, used on CUDA when mamba-ssm is installed) after dt_proj
    # (over d_inner). The converted mixer computes what the unconverted one computes on the same device.
    dt_after = bool(has_norms) and _falcon_fused_training(mixer, hidden_states)
    if has_norms == "modules":  # transformers >= 5.1
        B, C = mixer.b_layernorm(B), mixer.c_layernorm(C)
        if not dt_after:
            dt = mixer.dt_layernorm(dt)
    elif has_norms == "eps":  # transformers 5.0: a weightless RMS norm with mixer.rms_eps
        B, C = (_weightless_rms(t, mixer.rms_eps) for t in (B, C))
        if not dt_after:
            dt = _weightless_rms(dt, mixer.rms_eps)
    delta = torch.matmul(mixer.dt_proj.weight, dt.transpose(1, 2))  # (b, d_inner, l)
    if dt_after:
        eps = mixer.rms_eps if hasattr(mixer, "rms_eps") else mixer.dt_layernorm.eps
        delta = _weightless_rms(delta.transpose(1, 2), eps).transpose(1, 2)
        if has_norms == "modules":
            delta = delta * mixer.dt_layernorm.weight.to(delta.dtype)[:, None]
    y = ops.packed_selective_scan(
        x, delta, A, B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(), D=mixer.D.float(), z=z,
        delta_bias=mixer.dt_proj.bias.float(), delta_softplus=True, position_ids=pos, validate=False,
    )
    return mixer.out_proj(y.transpose(1, 2).to(dtype))


def _mamba2_packed(mixer, hidden_states, pos, attention_mask):
    """Mamba-2 mixer forward on packed rows through the packed conv and scan (any device).

    The SSD recurrence of head ``h`` is a selective scan whose channels ``h*head_dim .. +head_dim``
    share one time step ``dt[h]`` and one decay ``A[h]`` (broadcast over the state), with B and C
    grouped as transformers groups them (head ``h`` reads group ``h // (num_heads / n_groups)``).
    """
    import ops

    batch, seqlen, _ = hidden_states.shape
    dtype = hidden_states.dtype
    hidden_states = _mask(hidden_states, attention_mask)
    if hasattr(mixer, "ssm_in_multiplier"):  # FalconH1's muP multipliers, before and after in_proj
        hidden_states = hidden_states * mixer.ssm_in_multiplier
    proj = mixer.in_proj(hidden_states)
    if getattr(mixer, "mup_vector", None) is not None:
        proj = proj * mixer.mup_vector
    inner, conv_dim, heads, hd = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads, mixer.head_dim
    groups, dstate = mixer.n_groups, mixer.ssm_state_size
    extra = proj.shape[-1] - (inner + conv_dim + heads)
    if extra != 0:
        raise NotImplementedError(
            f"enable_packing: {type(mixer).__name__}.in_proj gives {proj.shape[-1]} features, expected "
            f"{inner + conv_dim + heads} (gate, conv channels, heads); this Mamba-2 variant is not supported"
        )
    gate, xBC, dt = proj.split([inner, conv_dim, heads], dim=-1)
    xBC = xBC.transpose(1, 2).contiguous()
    xBC = ops.packed_causal_conv1d(xBC, mixer.conv1d.weight.to(xBC.dtype), _to(mixer.conv1d.bias, xBC.dtype),
                                   activation=mixer.activation, position_ids=pos, validate=False)
    if attention_mask is not None and attention_mask.dim() == 2:
        xBC = xBC * attention_mask[:, None, :].to(xBC.dtype)
    x, B, C = torch.split(xBC, [inner, groups * dstate, groups * dstate], dim=1)
    limit = mixer.time_step_limit
    if limit is None:  # transformers 5.0's Zamba2: its PyTorch path clamps dt at time_step_min
        limit = (getattr(mixer, "time_step_min", 0.0), float("inf"))
    lo, hi = limit
    delta = F.softplus(dt.to(torch.promote_types(dt.dtype, torch.float32)) + mixer.dt_bias.float())
    if lo > 0.0 or hi != float("inf"):
        delta = delta.clamp(min=lo, max=hi)
    delta = delta.transpose(1, 2).repeat_interleave(hd, dim=1)  # (b, heads*hd, l)
    A = (-torch.exp(mixer.A_log.float())).repeat_interleave(hd)[:, None].expand(heads * hd, dstate)
    D = mixer.D.float().repeat_interleave(hd)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # transformers scans in fp32 at least
    y = ops.packed_selective_scan(
        x.to(cdt).contiguous(), delta.to(cdt).contiguous(), A.to(cdt).contiguous(),
        B.to(cdt).reshape(batch, groups, dstate, seqlen).contiguous(),
        C.to(cdt).reshape(batch, groups, dstate, seqlen).contiguous(),
        D=D.to(cdt), position_ids=pos, validate=False,
    )
    if getattr(mixer, "mamba_rms_norm", True):
        y = mixer.norm(y.transpose(1, 2), gate)
    else:  # FalconH1 without its gated norm: the gate alone
        y = y.transpose(1, 2) * F.silu(gate)
    return mixer.out_proj(y.to(dtype))


def _hf_mamba2_passes_seq_idx(mixer) -> bool:
    """Whether this transformers version's Mamba-2 forward hands ``seq_idx`` to its kernels: through
    ``**kwargs`` to the kernel-wrapper functions (``mamba2_split_conv1d_scan_combined``, in the versions
    that have them), or as its own ``seq_idx`` argument (5.0's ``BambaMixer`` and
    ``GraniteMoeHybridMambaLayer``). 5.0's ``Mamba2Mixer``, ``FalconH1Mixer`` and ``Zamba2MambaMixer``
    pass ``seq_idx=None`` to their kernels."""
    for c in type(mixer).__mro__:
        if c.__name__ in _MAMBA2_MIXERS + _HYBRID_MIXERS and _from_transformers(c):
            mod = sys.modules.get(c.__module__)
            try:
                params = inspect.signature(c.forward).parameters
            except (TypeError, ValueError):
                return False
            takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            return (takes_kwargs and hasattr(mod, "mamba2_split_conv1d_scan_combined")) or "seq_idx" in params
    return False


def _mamba2_kernels_serve(mixer, hidden_states: torch.Tensor) -> bool:
    """transformers' Mamba-2 forward honours ``seq_idx`` only through mamba-ssm's / causal-conv1d's
    kernels (its PyTorch path ignores it), and only in versions that pass it on."""
    return (hidden_states.is_cuda and importlib.util.find_spec("mamba_ssm") is not None
            and importlib.util.find_spec("causal_conv1d") is not None and _hf_mamba2_passes_seq_idx(mixer))


def _split_mixer_args(args, kwargs):
    """(cache_params, attention_mask) from a transformers mixer call, whatever the version's order."""
    cache = kwargs.get("cache_params", args[0] if args else None)
    mask = kwargs.get("attention_mask")
    if mask is None:
        for a in args[1:]:
            if isinstance(a, torch.Tensor) and a.dim() == 2:
                mask = a
    return cache, mask


def _packed_call(mixer, args, kwargs):
    """``(boundaries, hidden_states, attention_mask)`` when a packed batch reaches ``mixer``, None when it runs as
    transformers wrote it (no boundaries were handed to it)."""
    bounds = mixer.__dict__.get("_packloader_boundaries")
    if bounds is None:
        return None
    cache, mask = _split_mixer_args(args[1:], kwargs)
    if cache is not None:
        raise ValueError("enable_packing: a packed batch reached a mixer together with cache_params")
    return bounds, args[0], mask


def _mamba1_forward(self, base_forward, args, kwargs):
    call = _packed_call(self, args, kwargs)
    if call is None:
        out = _mamba1_decode_step(self, args, kwargs)
        return base_forward(self, *args, **kwargs) if out is None else out
    bounds, hidden_states, mask = call
    carry = bounds[2] if len(bounds) > 2 else None
    if self.__dict__.get("_packloader_cp_group") is not None:   # ops.context_parallel
        return _outside_cpu_autocast(_mamba1_context_parallel, self, hidden_states, (bounds[0], carry), mask)
    if carry is not None and carry.has_continuations:
        return _outside_cpu_autocast(_mamba1_carried, self, hidden_states, (bounds[0], carry), mask)
    return _outside_cpu_autocast(_mamba1_packed, self, hidden_states, bounds[0], mask)


def _decode_step_inputs(args, kwargs):
    """``(hidden_states, cache)`` of a mixer call that is a single-token step ops.decode can run: one token,
    no padding mask, gradients off; None otherwise."""
    hidden_states = args[0] if args else kwargs.get("hidden_states")
    cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
    mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    if (mask is not None or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3
            or hidden_states.shape[1] != 1 or torch.is_grad_enabled()):
        return None
    return hidden_states, cache


def _mamba1_decode_step(mixer, args, kwargs):
    """A single-token step on a filled transformers cache through ``ops.decode``'s fused state updates (what
    transformers' recurrent form computes: conv update, x_proj, FalconMamba's norms before dt_proj, state update),
    or None where transformers' own code runs: not such a step, a padding mask, gradients enabled, a quantized model,
    or a cache without the ``has_previous_state`` / ``layers[i].conv_states`` API (5.0's ``MambaCache``)."""
    inputs = _decode_step_inputs(args, kwargs)
    fused = None if inputs is None else fused_step_states(mixer, inputs[1])
    if fused is None:
        return None
    from .decode import mamba_step
    conv, ssm, norm = fused
    return mamba_step(mixer, inputs[0], conv, ssm, bc_dt_norm=norm)


def _mamba2_decode_step(mixer, args, kwargs):
    """transformers' ``Mamba2Mixer`` single-token step through ``ops.decode``'s fused kernels (:func:`mamba2_step`),
    or None where transformers' own code runs (as :func:`_mamba1_decode_step`)."""
    inputs = _decode_step_inputs(args, kwargs)
    fused = None if inputs is None else fused_step_states(mixer, inputs[1])
    if fused is None:
        return None
    return mamba2_step(mixer, inputs[0], fused[0], fused[1])


def _mamba2_step_fusable(mixer) -> bool:
    """Whether :func:`mamba2_step` computes this Mamba-2 mixer's step as transformers would: silu conv of a width the
    kernel takes, ``in_proj`` giving exactly (gate, conv channels, heads) (no extra MLP), no clamp of the time step
    (the recurrent form of transformers 5.24 and mamba-ssm's step ignore ``time_step_limit``; older versions' torch
    step clamps), plain (not quantized) projections, a state the kernel takes."""
    from .decode import MAX_DSTATE, MAX_WIDTH
    inner, conv_dim, heads = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads
    limit = getattr(mixer, "time_step_limit", None)
    return (getattr(mixer, "activation", None) in ("silu", "swish")
            and type(mixer.in_proj) is nn.Linear and type(mixer.out_proj) is nn.Linear
            and mixer.in_proj.out_features == inner + conv_dim + heads
            and inner == heads * mixer.head_dim and heads % mixer.n_groups == 0
            and mixer.conv1d.weight.shape[-1] <= MAX_WIDTH
            and (limit is None or tuple(float(v) for v in limit) == (0.0, float("inf")))
            and mixer.ssm_state_size <= MAX_DSTATE and callable(getattr(mixer, "norm", None)))


def mamba2_step(mixer, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
    """One decoding step of transformers' ``Mamba2Mixer`` (its recurrent form: ``in_proj``, conv update, the state
    update per head, the gated RMS norm, ``out_proj``), the conv and state updates as ``ops.decode``'s fused
    kernels (:func:`ops.decode.causal_conv1d_step`, :func:`ops.decode.mamba2_state_step`), in place on the cache's
    tensors.

    Args:
        mixer: a ``Mamba2Mixer`` (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm``, ``out_proj``).
        hidden_states: (batch, 1, hidden_size).
        conv_state: (batch, conv_dim, conv_kernel); ssm_state: (batch, heads, head_dim, state_size).

    Returns:
        (batch, 1, hidden_size) in ``hidden_states``' dtype.
    """
    from .decode import causal_conv1d_step, mamba2_state_step
    batch, dtype = hidden_states.shape[0], hidden_states.dtype
    inner, conv_dim, heads = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads
    groups, dstate = mixer.n_groups, mixer.ssm_state_size
    gate, xBC, dt = mixer.in_proj(hidden_states.squeeze(1)).split([inner, conv_dim, heads], dim=-1)
    xBC = causal_conv1d_step(xBC, conv_state, mixer.conv1d.weight, mixer.conv1d.bias, "silu")
    x, B, C = xBC.split([inner, groups * dstate, groups * dstate], dim=-1)
    y = mamba2_state_step(ssm_state, x.view(batch, heads, mixer.head_dim), dt, mixer.A_log,
                          B.view(batch, groups, dstate), C.view(batch, groups, dstate), D=mixer.D,
                          dt_bias=mixer.dt_bias, dt_softplus=True)
    y = mixer.norm(y.view(batch, 1, inner), gate.view(batch, 1, inner))
    return mixer.out_proj(y.to(dtype))


def fused_step_states(mixer, cache):
    """``(conv_state, ssm_state, bc_dt_norm)`` where a Mamba-1 / FalconMamba / Mamba-2 ``mixer``'s single-token step
    on ``cache`` runs as ``ops.decode``'s fused state updates, in place on those two tensors of the cache; None where
    transformers' own code runs it: no cache, a cache without the ``has_previous_state`` / ``layers[i].conv_states``
    API (5.0's ``MambaCache``), an empty or recording layer, a quantized model, norms other than FalconMamba's
    modules, a Mamba-2 variant :func:`mamba2_step` does not compute (or, on CUDA, states its kernels do not take),
    a hybrid model's mixer, a conv under accelerate's hooks. (``generate_packed(cuda_graph=True)`` replays these
    steps from a CUDA graph, so it needs them fused.)"""
    if (cache is None or hasattr(getattr(mixer, "config", None), "_is_quantized")
            or not (hasattr(cache, "has_previous_state") and hasattr(cache, "layers"))):
        return None
    kind = mixer.__dict__.get("_packloader_step_kind")
    if kind is None:   # what the mixer's class allows, found once (a decode step runs this for every layer)
        kind = _mixer_kind(mixer)
        if kind == "mamba2" and not _mamba2_step_fusable(mixer):
            kind = None
        elif kind == "mamba1":
            kind = {"modules": "falcon", None: "mamba1"}.get(_falcon_norms(mixer))
        elif kind != "mamba2":   # a hybrid's mixer, anything else: transformers' code
            kind = None
        if getattr(mixer.conv1d, "_hf_hook", None) is not None:   # accelerate's offload hooks: its forward only
            kind = None
        kind = mixer.__dict__["_packloader_step_kind"] = kind or "unfused"
    if kind == "unfused":
        return None
    idx = mixer.layer_idx
    if not cache.has_previous_state(idx) or getattr(cache.layers[idx], "record_past", False):
        return None
    layer = cache.layers[idx]
    conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
    if conv.shape[-1] != mixer.conv1d.weight.shape[-1]:
        return None
    if kind == "mamba2" and conv.is_cuda and not _mamba2_kernels_take(conv, ssm):
        return None   # (Mamba-1 raises KernelUnsupportedError naming the override instead, as it did before)
    return conv, ssm, (_FalconStepNorms(mixer) if kind == "falcon" else None)


def _mamba2_kernels_take(conv: torch.Tensor, ssm: torch.Tensor) -> bool:
    """Whether ops.decode's Triton kernels take these CUDA states (else transformers' Mamba-2 step runs, as before
    packloader had a fused one)."""
    from .contract import KERNEL_DTYPES
    from .decode import HAS_TRITON
    return HAS_TRITON and conv.dtype in KERNEL_DTYPES and ssm.dtype in KERNEL_DTYPES


class _FalconStepNorms:
    """FalconMamba's RMS norms of dt, B and C (its modules), as ``mamba_step``'s ``bc_dt_norm``."""

    def __init__(self, mixer):
        self.mixer = mixer

    def __call__(self, dt, B, C):
        m = self.mixer
        return m.dt_layernorm(dt), m.b_layernorm(B), m.c_layernorm(C)


def _mamba1_carried(mixer, hidden_states, pos_and_carry, attention_mask):
    """A Mamba-1 mixer on a batch with continuations (``ops.carry``); FalconMamba's norms and padding masks are not
    carried yet: refused rather than run from zero."""
    from .carry import CarryError, carried_mamba_inner
    if _falcon_norms(mixer) or attention_mask is not None:
        raise CarryError(f"{type(mixer).__name__}: carrying states across pieces is not supported with FalconMamba's "
                         "norms or a padding attention_mask; pack with overflow='split'")
    pos, carry = pos_and_carry
    return carried_mamba_inner(mixer, hidden_states, pos, carry).to(hidden_states.dtype)


def _mamba1_context_parallel(mixer, hidden_states, pos_and_carry, attention_mask):
    """A Mamba-1 mixer over this rank's chunk of every row (``ops.context_parallel``)."""
    from .context_parallel import ContextParallelError, context_parallel_mamba_inner
    pos, carry = pos_and_carry
    if _falcon_norms(mixer) or attention_mask is not None or carry is not None:
        raise ContextParallelError(f"{type(mixer).__name__}: context parallelism does not take FalconMamba's norms, a "
                                   "padding attention_mask or carried states")
    return context_parallel_mamba_inner(mixer, hidden_states, pos, mixer._packloader_cp_group,
                                        mixer.__dict__.get("_packloader_cp_recompute", False)).to(hidden_states.dtype)


def _outside_cpu_autocast(fn, mixer, hidden_states, pos, mask):
    """Run a packed mixer path; under CPU (non-CUDA) autocast, with autocast off in the parameters' dtype.

    CPU autocast (Trainer's ``bf16=True`` on a CPU, TRL's default) would hand the packed ops a mix of
    bfloat16 activations and float32 weights; the ops take one dtype (their CUDA path handles CUDA
    autocast itself). The mixer then computes in its parameters' dtype and returns that dtype.
    """
    dev = hidden_states.device.type
    if dev == "cuda" or not torch.is_autocast_enabled(dev):
        return fn(mixer, hidden_states, pos, mask)
    dtype = mixer.in_proj.weight.dtype
    with torch.autocast(dev, enabled=False):
        return fn(mixer, hidden_states.to(dtype), pos, mask)


def _mamba2_forward(self, base_forward, args, kwargs):
    call = _packed_call(self, args, kwargs)
    if call is None:
        out = _mamba2_decode_step(self, args, kwargs)
        return base_forward(self, *args, **kwargs) if out is None else out
    bounds, hidden_states, mask = call
    from .convert import _refuse_carry
    _refuse_carry(bounds[2] if len(bounds) > 2 else None, f"{type(self).__name__} (Mamba-2)")
    if _mamba2_kernels_serve(self, hidden_states):
        for k in BOUNDARY_KWARGS:
            kwargs.pop(k, None)
        return base_forward(self, *args, seq_idx=bounds[1].contiguous(), **kwargs)
    return _outside_cpu_autocast(_mamba2_packed, self, hidden_states, bounds[0], mask)


# --------------------------------------------------------------------------------------------------
# hybrid SSM / attention models: Bamba, NemotronH, GraniteMoeHybrid, FalconH1, Zamba2
#
# Their Mamba-2 mixers are converted; their attention layers stay transformers' own, which isolates packed
# sequences only where transformers' packed-attention support sees the boundaries:
#   eager / sdpa: masking_utils.create_causal_mask builds a per-sequence causal mask from position_ids when
#       the model hands it position_ids, no 2D attention_mask and no cache (5.23: Bamba, NemotronH, FalconH1,
#       Zamba2; not GraniteMoeHybrid, whose mask gets no position_ids; not 5.0's Bamba / FalconH1 / Zamba2,
#       whose legacy _update_causal_mask ignores them). Verified by tests/ops/test_hf_hybrids.py.
#   flash_attention_2 / _3: varlen attention from cu_seq_lens_q/k + max_length_q/k, which each converted
#       attention layer adds to its own keyword arguments (transformers' own detection from position_ids works
#       for one row per batch only, and 5.0's FalconH1 / Zamba2 pass no kwargs from the model to the layers).
#       Verified on the CPU with a stand-in for the kernel, and by the GPU test where flash-attn is installed.

_MASK_ATTENTION = ("eager", "sdpa")
_FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")
_MASK_SEES_POSITION_IDS = ("BambaModel", "NemotronHModel", "FalconH1Model", "Zamba2Model")
_PACKING_ONLY_KWARGS = tuple(k for k in BOUNDARY_KWARGS if k != "position_ids")


def _attn_implementation(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"


def _attention_gap(backbone: nn.Module, impl: str) -> Optional[str]:
    """None when transformers' attention in ``backbone`` isolates packed sequences under ``impl`` (see
    above); otherwise the reason it does not."""
    if impl in _FLASH_ATTENTION:
        return None
    if impl in _MASK_ATTENTION:
        if not _hf_names(backbone) & set(_MASK_SEES_POSITION_IDS):
            return f"{type(backbone).__name__} builds its attention mask without position_ids"
        if hasattr(backbone, "_update_causal_mask"):
            return (f"this transformers version's {type(backbone).__name__} builds a plain causal mask "
                    "(_update_causal_mask) that ignores packed rows")
        masking = sys.modules.get("transformers.masking_utils")
        if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
            return "this transformers version's mask builder does not detect packed rows"
        return None
    return "packloader has not verified that it isolates packed sequences"


def _hybrid_model_forward(self, base_forward, args, kwargs):
    """Forward of a converted hybrid ``*ForCausalLM`` / ``*Model``: resolves the boundaries once, lends them
    to the SSM layers (through the shared slot) and hands transformers the ``position_ids`` (and, for flash
    attention, ``cu_seq_lens_*``) its attention isolates packed sequences with."""
    slot: _BoundarySlot = self._packloader_slot
    if slot.value is not None:  # the converted *ForCausalLM around this backbone resolved the batch
        return base_forward(self, *args, **kwargs)
    packing = [k for k in _PACKING_ONLY_KWARGS if kwargs.get(k) is not None]
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        pos = kwargs.get("position_ids")
        mask = kwargs.get("attention_mask")
        if (not packing and kwargs.get("past_key_values") is None and isinstance(pos, torch.Tensor)
                and pos.dim() == 2 and pos.shape[1] > 1 and not (isinstance(mask, torch.Tensor) and not bool(mask.all()))
                and bool((pos[:, 1:] != pos[:, :-1] + 1).any())):
            packing = ["position_ids restarting within a row"]  # a packed row, not a prefill
        if packing:
            raise ValueError(
                f"enable_packing: packed boundaries ({', '.join(packing)}) cannot be combined with past_key_values / "
                "use_cache=True: a recurrent cache holds one sequence per row. Generate one sequence per row, "
                "without boundaries (or pass use_cache=False)."
            )
        return base_forward(self, *args, **kwargs)  # generation / cached inference: transformers' own code
    for k in _PACKING_ONLY_KWARGS:
        if k in kwargs and kwargs[k] is None:
            kwargs.pop(k)
    if not packing and kwargs.get("position_ids") is None:
        return base_forward(self, *args, **kwargs)
    batch, seqlen, device = _batch_shape(args, kwargs)
    given = {k: kwargs.pop(k) for k in BOUNDARY_KWARGS if k in kwargs}
    bounds = _resolve(dict(given), batch, seqlen, device, getattr(self, "_packloader_validate", True))
    pos = bounds[0]
    from .convert import _refuse_carry
    _refuse_carry(_pop_carry(self, kwargs, pos), f"{type(self).__name__} (a hybrid)")
    kwargs["position_ids"] = given["position_ids"] if given.get("position_ids") is not None else pos.long()
    varlen = None
    if _attn_implementation(self) in _FLASH_ATTENTION:
        cu, max_len = position_ids_to_cu_seqlens(pos)
        varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    bounds = (bounds[0], bounds[1], varlen)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if not bool(mask.all()):
            raise ValueError(
                "enable_packing: a padding attention_mask (with zeros) cannot be combined with packed boundaries: "
                "transformers' attention would then mask padding only and let packed sequences see each other. "
                "Give padding its own segment in position_ids (as PackedDataLoader does) and pass no attention_mask."
            )
        kwargs["attention_mask"] = None  # all ones: no padding; None lets the mask builder see the packing
    kwargs["use_cache"] = False  # an eval forward would otherwise build a cache (and the mask builder skip packing)
    return slot.run(bounds, base_forward, self, *args, **kwargs)


def _hybrid_block_forward(self, base_forward, args, kwargs):
    """A layer of a converted hybrid (each of ``backbone.layers``, and each module between one and a mixer or
    attention layer): receives the boundaries as a keyword argument of its own call (so gradient
    checkpointing, which replays the layer's forward in the backward pass, replays them) and puts them in
    the slot its mixers and attention layers read while it runs."""
    bounds = kwargs.pop("packloader_boundaries", None)
    return self._packloader_slot.run(bounds, base_forward, self, *args, **kwargs)


def _hybrid_attention_forward(self, base_forward, args, kwargs):
    """An attention layer of a converted hybrid: under flash attention, the varlen keyword arguments of the
    batch's boundaries (whatever the layers above passed on)."""
    bounds = self._packloader_slot.value
    if bounds is not None and bounds[2] is not None:
        kwargs.update(bounds[2])
    return base_forward(self, *args, **kwargs)


def _hybrid_mixer_forward(self, base_forward, args, kwargs):
    bounds = self._packloader_slot.value
    if bounds is None:
        return base_forward(self, *args, **kwargs)
    if "hidden_states" in kwargs:
        hidden_states, rest = kwargs["hidden_states"], args
    else:
        hidden_states, rest = args[0], args[1:]
    cache, mask = _split_mixer_args(rest, kwargs)
    if cache is not None:
        raise ValueError("enable_packing: a packed batch reached a mixer together with a cache")
    if _mamba2_kernels_serve(self, hidden_states):
        for k in BOUNDARY_KWARGS:
            kwargs.pop(k, None)
        return base_forward(self, *args, seq_idx=bounds[1].contiguous(), **kwargs)
    return _outside_cpu_autocast(_mamba2_packed, self, hidden_states, bounds[0], mask)


# --------------------------------------------------------------------------------------------------
# class swapping


_CLASS_CACHE: Dict[tuple, type] = {}


def _wrap(impl, base):
    def method(self, *args, **kwargs):
        return impl(self, base, args, kwargs)

    try:  # keep the signature transformers introspects (loss kwargs, generation inputs)
        method.__signature__ = inspect.signature(base)
    except (TypeError, ValueError):
        pass
    method.__name__ = getattr(base, "__name__", "forward")
    method.__qualname__ = method.__name__
    method.__doc__ = getattr(base, "__doc__", None)
    return method


# what each converted module's forward becomes, by its role in the model
_ROLE_FORWARD = {
    "model": _model_forward,
    "block": _block_forward,
    "mamba1": _mamba1_forward,
    "mamba2": _mamba2_forward,
    "hybrid_model": _hybrid_model_forward,
    "hybrid_block": _hybrid_block_forward,
    "hybrid": _hybrid_mixer_forward,
    "hybrid_attention": _hybrid_attention_forward,
}


def _swap(m: nn.Module, role: str) -> None:
    cls = type(m)
    if getattr(cls, "_packloader_packed", False):
        return
    key = (cls, role)
    new = _CLASS_CACHE.get(key)
    if new is None:
        attrs = {"_packloader_packed": True, "__module__": __name__,
                 "forward": _wrap(_ROLE_FORWARD[role], cls.forward)}
        if role in ("block", "hybrid_block"):   # blocks also pass the boundaries into their own call
            attrs["__call__"] = _wrap(_block_call, cls.__call__)
        new = type(f"Packed{cls.__name__}", (cls,), attrs)
        _CLASS_CACHE[key] = new
    m.__class__ = new


def _backbone_of(model: nn.Module) -> Optional[nn.Module]:
    """The ``*Model`` holding ``layers`` (each with a ``mixer``): the model itself or its ``backbone``."""
    for cand in (model, getattr(model, "backbone", None)):
        layers = getattr(cand, "layers", None) if cand is not None else None
        if isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(hasattr(b, "mixer") for b in layers):
            return cand
    return None


def _hybrid_backbone(model: nn.Module) -> Optional[nn.Module]:
    """The ``*Model`` of a hybrid (its ``layers`` hold at least one hybrid Mamba-2 mixer), or None."""
    for cand in (model, getattr(model, "model", None), getattr(model, "backbone", None)):
        layers = getattr(cand, "layers", None) if isinstance(cand, nn.Module) else None
        if isinstance(layers, nn.ModuleList) and any(_mixer_kind(m) == "hybrid" for m in layers.modules()):
            return cand
    return None


def _enable_packing_hybrid(model: nn.Module, backbone: nn.Module, validate: bool,
                           allow_unprotected_attention: bool) -> nn.Module:
    prefix = "" if backbone is model else next(n for n, m in model.named_children() if m is backbone) + "."
    mixers, other_ssm, attention, attention_names = [], [], [], []
    for name, m in backbone.named_modules():
        kind = _mixer_kind(m)
        if kind == "hybrid":
            mixers.append((name, m))
        elif _looks_like_ssm(m):
            other_ssm.append(f"{prefix}{name} ({type(m).__name__})")
        elif _looks_like_attention(m):
            attention.append(f"{prefix}{name} ({type(m).__name__})")
            attention_names.append(name)
    if other_ssm:
        raise NotImplementedError(
            f"enable_packing: {type(model).__name__} has SSM layers of a class packloader does not convert: "
            + ", ".join(other_ssm[:8]) + ". Nothing was changed."
        )
    for name, m in mixers:
        act = getattr(m, "activation", "silu")
        if act not in ("silu", "swish"):
            raise NotImplementedError(
                f"enable_packing: {prefix}{name} ({type(m).__name__}) uses activation {act!r}; the packed conv "
                "supports silu only. Nothing was changed."
            )
    impl = _attn_implementation(model)
    gap = _attention_gap(backbone, impl) if attention else None
    if gap is not None:
        shown = ", ".join(attention[:8]) + (" ..." if len(attention) > 8 else "")
        good = [i for i in _MASK_ATTENTION + _FLASH_ATTENTION if _attention_gap(backbone, i) is None]
        if not allow_unprotected_attention:
            raise NotImplementedError(
                f"enable_packing: {type(model).__name__}'s attention layers ({shown}) do not isolate packed sequences "
                f"with attn_implementation={impl!r}: {gap}. Nothing was changed. Load the model with "
                f"attn_implementation= one of {good} (these isolate packed rows in this transformers version), or "
                "pass allow_unprotected_attention=True to convert the SSM layers only (the attention layers then mix "
                "packed sequences; ops.check_isolation measures it)."
            )
        warnings.warn(
            f"enable_packing: converted the SSM layers of {type(model).__name__}; its attention layers ({shown}) "
            f"remain unprotected with attn_implementation={impl!r} ({gap}): packed sequences see each other there",
            stacklevel=3,
        )
    slot = _BoundarySlot()
    for top in ([model] if backbone is model else [model, backbone]):
        _swap(top, "hybrid_model")
        top.__dict__["_packloader_slot"] = slot
        top.__dict__["_packloader_validate"] = validate
    modules = dict(backbone.named_modules())
    leaves = [(n, m, "hybrid") for n, m in mixers] + [(n, modules[n], "hybrid_attention") for n in attention_names]
    for layer in backbone.layers:  # every layer (its call carries the boundaries; see _hybrid_block_forward)
        _swap(layer, "hybrid_block")
        layer.__dict__["_packloader_slot"] = slot
    for name, m, role in leaves:
        parts = name.split(".")  # layers.<i>[.<sub>...].<leaf>: every layer on the way refills the slot
        for depth in range(2, len(parts)):
            block = modules[".".join(parts[:depth])]
            _swap(block, "hybrid_block")
            block.__dict__["_packloader_slot"] = slot
        _swap(m, role)
        m.__dict__["_packloader_slot"] = slot
    model.__dict__["_packloader_conversion"] = {
        "mamba1": [], "mamba2": [prefix + n for n, _ in mixers], "attention": impl,
        "left_unsafe": attention if gap is not None else [],
    }
    return model


def enable_packing_hf(model: nn.Module, *, strict: bool = True, validate: bool = True,
                      allow_unprotected_attention: bool = False) -> nn.Module:
    """Convert a transformers Mamba / FalconMamba / Mamba-2 model or a Mamba-2 hybrid in place (see the
    module docstring).

    Args:
        model: ``MambaForCausalLM``, ``MambaModel``, ``FalconMambaForCausalLM``, ``FalconMambaModel``,
            ``Mamba2ForCausalLM`` or ``Mamba2Model``, or ``Bamba``, ``NemotronH``, ``GraniteMoeHybrid``,
            ``FalconH1``, ``Zamba2`` (``*ForCausalLM`` / ``*Model``), or subclasses.
        strict: a transformers model with layers this cannot protect (SSM layers of other
            classes) is refused either way; ``strict`` is accepted for the same signature as
            :func:`ops.enable_packing`.
        validate: check the boundaries once per batch (one host sync).
        allow_unprotected_attention: for a hybrid whose ``attn_implementation`` does not isolate
            packed sequences (table above): convert the SSM layers and warn instead of refusing.

    Returns:
        ``model``, converted: ``model(input_ids, position_ids=...)`` (or ``seq_idx=`` /
        ``cu_seq_lens_q=``) isolates the packed sequences; the record of what was converted is
        ``model._packloader_conversion``.

    Raises:
        NotImplementedError: an unsupported transformers model, naming its SSM and attention layers; a
            hybrid whose attention does not isolate packed sequences (without the flag above).
    """
    version = getattr(sys.modules.get("transformers"), "__version__", "0")
    if int(version.split(".")[0]) < 5:
        raise NotImplementedError(
            f"enable_packing: transformers {version} is too old; packing Hugging Face Mamba models needs "
            "transformers >= 5.0 (tested with 5.0.0 and 5.23.0)"
        )
    hybrid = _hybrid_backbone(model)
    if hybrid is not None:
        return _enable_packing_hybrid(model, hybrid, validate, allow_unprotected_attention)
    backbone = _backbone_of(model)
    layers = list(backbone.layers) if backbone is not None else []
    kinds = [_mixer_kind(b.mixer) for b in layers]
    if backbone is None or any(k is None for k in kinds):
        ssm = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
               if _looks_like_ssm(m) and _mixer_kind(m) is None]
        attn = [f"{n} ({type(m).__name__})" for n, m in model.named_modules() if _looks_like_attention(m)]
        detail = []
        if ssm:
            detail.append("SSM layers of another class: " + ", ".join(ssm[:8]) + (" ..." if len(ssm) > 8 else ""))
        if attn:
            detail.append("attention layers: " + ", ".join(attn[:8]) + (" ..." if len(attn) > 8 else "")
                          + " (whether they isolate packed sequences depends on their attn_implementation)")
        raise NotImplementedError(
            f"enable_packing: {type(model).__name__} is not supported: it converts transformers' Mamba, FalconMamba "
            f"and Mamba-2 models (*ForCausalLM / *Model, every layer a MambaMixer / FalconMambaMixer / Mamba2Mixer) "
            f"and the Mamba-2 layers of the hybrids Bamba, NemotronH, GraniteMoeHybrid, FalconH1 and Zamba2"
            + (". Found " + "; ".join(detail) if detail else "")
            + ". Nothing was changed. For such a model, transformers' own padding-free path "
              "(DataCollatorWithFlattening(return_seq_idx=True), attn_implementation='flash_attention_2', mamba-ssm "
              "kernels on a GPU) is the alternative; measure what it leaks with ops.check_isolation."
        )
    for i, b in enumerate(layers):
        mixer = b.mixer
        if kinds[i] == "mamba1":
            _falcon_norms(mixer)  # raises for an unknown FalconMamba variant
        act = getattr(mixer, "activation", "silu")
        if act not in ("silu", "swish"):
            raise NotImplementedError(
                f"enable_packing: layer {i} ({type(mixer).__name__}) uses activation {act!r}; the packed conv "
                "supports silu only. Nothing was changed."
            )
    slot = _BoundarySlot()
    tops = [model] if backbone is model else [model, backbone]
    for top in tops:
        _swap(top, "model")
        top.__dict__["_packloader_slot"] = slot
        top.__dict__["_packloader_validate"] = validate
    mamba1: List[str] = []
    mamba2: List[str] = []
    prefix = "" if backbone is model else next(n for n, m in model.named_children() if m is backbone) + "."
    for i, (b, kind) in enumerate(zip(layers, kinds)):
        _swap(b, "block")
        b.__dict__["_packloader_slot"] = slot
        _swap(b.mixer, kind)
        (mamba1 if kind == "mamba1" else mamba2).append(f"{prefix}layers.{i}.mixer")
    for top in tops:
        top.__dict__["_packloader_need_seq_idx"] = bool(mamba2)
    model.__dict__["_packloader_conversion"] = {"mamba1": mamba1, "mamba2": mamba2, "left_unsafe": []}
    return model
