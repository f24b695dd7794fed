"""``enable_packing(model)``: make a mamba-ssm ``MambaLMHeadModel`` train on packed batches, in place.

After conversion::

    model(input_ids, position_ids=batch["position_ids"])      # or seq_idx=..., or cu_seqlens=...

threads the boundaries to every mixer:

- each Mamba-1 mixer (``mamba_ssm.modules.mamba_simple.Mamba``) is replaced by
  :class:`ops.PackedMamba` built around the *same* submodules and parameters (no copy: optimizer
  state, tied weights and ``state_dict`` names are unchanged);
- each Mamba-2 mixer keeps mamba-ssm's own forward, which takes ``seq_idx`` (its conv and SSD
  kernels reset there); it is given a class that also accepts ``position_ids`` and converts;
- the model (``MambaLMHeadModel``) or backbone (``MixerModel``) gets a class whose forward accepts
  ``position_ids`` / ``seq_idx`` / ``cu_seqlens``, resolves and validates them once per batch (validation
  is skipped under ``torch.compile``: it needs a host sync) and passes the resolved int32 ``position_ids``
  and ``seq_idx`` down through mamba-ssm's ``**mixer_kwargs`` (Block -> mixer): Mamba-1 mixers read
  ``position_ids``, Mamba-2 mixers ``seq_idx``; neither checks them again.

Without boundaries the converted model computes exactly what it did before. Attention mixers
(``MHA``) and Mamba-3 are not packing-safe here: conversion refuses them unless ``strict=False``
(check the result with :func:`ops.check_isolation`).
"""
from __future__ import annotations

import collections
import inspect
import sys
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from .boundaries import resolve_boundaries
from .modules.mamba_simple import PackedMamba

__all__ = ["enable_packing", "is_mamba1_mixer", "is_mamba2_mixer"]


def _upstream_class(module_name: str, cls_name: str):
    mod = sys.modules.get(module_name)  # never import mamba_ssm ourselves: only if the model did
    return getattr(mod, cls_name, None) if mod is not None else None


_M1_ATTRS = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "d_state", "dt_rank", "d_inner")


def is_mamba1_mixer(m: nn.Module) -> bool:
    """mamba-ssm's Mamba (or a class named ``Mamba`` with its parameters), not yet converted."""
    if isinstance(m, PackedMamba):
        return False
    up = _upstream_class("mamba_ssm.modules.mamba_simple", "Mamba")
    if up is not None and isinstance(m, up):
        return True
    return type(m).__name__ == "Mamba" and all(hasattr(m, a) for a in _M1_ATTRS)


def is_mamba2_mixer(m: nn.Module) -> bool:
    """mamba-ssm's Mamba2 / Mamba2Simple (or a class of that name), packed or not."""
    for mod, name in (("mamba_ssm.modules.mamba2", "Mamba2"), ("mamba_ssm.modules.mamba2_simple", "Mamba2Simple")):
        up = _upstream_class(mod, name)
        if up is not None and isinstance(m, up):
            return True
    return any(c.__name__ in ("Mamba2", "Mamba2Simple") for c in type(m).__mro__)


class _PackedMamba2Mixin:
    """Mamba-2 forward that also accepts ``position_ids`` (converted to mamba-ssm's ``seq_idx``).

    A converted model hands down both, resolved: ``seq_idx`` is then used as given, with no further work or
    check. Called directly with ``position_ids`` only, the mixer converts (and validates) them itself."""

    _packloader_packed = True

    def forward(self, u, *args, position_ids=None, seq_idx=None, carry=None, **kwargs):
        _refuse_carry(carry, "a Mamba-2 mixer")
        if position_ids is not None or seq_idx is not None:
            if kwargs.get("inference_params") is not None:
                raise ValueError("Mamba-2 with inference_params cannot take packed boundaries")
            seqlen = kwargs.get("seqlen", args[0] if args else None)
            if seqlen is None:
                batch, seqlen = u.shape[0], u.shape[1]
            else:
                batch = u.shape[0] // seqlen
            if seq_idx is None:
                _, seq_idx = resolve_boundaries(position_ids, None, None, (batch, seqlen), device=u.device,
                                                need_seq_idx=True)
            else:
                seq_idx = seq_idx.to(device=u.device, dtype=torch.int32).contiguous()
        return super().forward(u, *args, seq_idx=seq_idx, **kwargs)


CausalLMOutput = collections.namedtuple("CausalLMOutput", ["logits"])  # what MambaLMHeadModel.forward returns


def _resolve_for_model(model, input_ids, position_ids, seq_idx, cu_seqlens):
    """Once per batch: (position_ids, seq_idx), int32, validated unless switched off (or compiling)."""
    if model.__dict__.get("_packloader_cp_group") is not None and position_ids is None:
        from .context_parallel import ContextParallelError
        raise ContextParallelError("a context-parallel model takes position_ids (this rank's chunk of the rows' ids, "
                                   "from ops.shard_batch): seq_idx / cu_seqlens cannot say that a chunk continues "
                                   "the rank before")
    return resolve_boundaries(
        position_ids, seq_idx, cu_seqlens, shape=tuple(input_ids.shape[:2]), device=input_ids.device,
        validate=model._packloader_validate, need_seq_idx=True,
    )


class _PackedLMMixin:
    """``MambaLMHeadModel.forward`` plus packed boundaries.

    ``position_ids`` is a named parameter of upstream's forward (unused there) and would stop at the top, so
    with boundaries this forward runs the backbone itself, handing it the resolved ``position_ids`` and
    ``seq_idx`` as mixer kwargs, then the LM head (what upstream's forward does after its backbone).
    """

    _packloader_packed = True

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0, *,
                seq_idx=None, cu_seqlens=None, **mixer_kwargs):
        if inference_params is not None:
            # generation: mamba-ssm's GenerationMixin passes position_ids (for Transformer
            # compatibility) with the caches; upstream ignores them, and so do we. Packed boundaries
            # given explicitly cannot be honoured by the recurrent caches.
            if seq_idx is not None or cu_seqlens is not None:
                raise ValueError("enable_packing: inference_params (generation) cannot be combined with packed "
                                 "boundaries (seq_idx / cu_seqlens); generate one sequence per row")
            return super().forward(input_ids, position_ids=position_ids, inference_params=inference_params,
                                   num_last_tokens=num_last_tokens, **mixer_kwargs)
        if position_ids is None and seq_idx is None and cu_seqlens is None:
            return super().forward(input_ids, num_last_tokens=num_last_tokens, **mixer_kwargs)
        pos, seq = _resolve_for_model(self, input_ids, position_ids, seq_idx, cu_seqlens)
        hidden_states = self.backbone(input_ids, position_ids=pos, seq_idx=seq, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        return CausalLMOutput(logits=self.lm_head(hidden_states))


_BOUNDARY_KWARGS = ("position_ids", "seq_idx", "cu_seqlens")


def _refuse_carry(carry, what: str) -> None:
    """A layer that cannot carry a state across pieces raises on a batch with continuations (instead of silently
    starting them from zero); a plan without any is ignored."""
    if carry is not None and carry.has_continuations:
        from .carry import CarryError
        raise CarryError(f"{what} cannot carry its state across the pieces of a document (overflow='carry'); only "
                         "Mamba-1 mixers (ops.PackedMamba) do. Pack with overflow='split' for this model")


class _BoundaryBlindMixin:
    """For mixers left unconverted (``strict=False``): drop the boundary kwargs their forward does
    not take, so the model still runs (and :func:`ops.check_isolation` can measure their leak)."""

    _packloader_packed = True
    _packloader_accepts: tuple = ()

    def forward(self, *args, **kwargs):
        _refuse_carry(kwargs.pop("carry", None), f"{type(self).__name__} (left unconverted)")
        for k in _BOUNDARY_KWARGS:
            if k in kwargs and k not in self._packloader_accepts:
                kwargs.pop(k)
        return super().forward(*args, **kwargs)


class _PackedBackboneMixin:
    """``MixerModel.forward`` plus packed boundaries (see :class:`_PackedLMMixin`)."""

    _packloader_packed = True

    def forward(self, input_ids, inference_params=None, *, position_ids=None, seq_idx=None, cu_seqlens=None,
                **mixer_kwargs):
        if position_ids is None and seq_idx is None and cu_seqlens is None:
            return super().forward(input_ids, inference_params=inference_params, **mixer_kwargs)
        if inference_params is not None:
            raise ValueError("enable_packing: inference_params (generation) cannot be combined with packed boundaries")
        pos, seq = _resolve_for_model(self, input_ids, position_ids, seq_idx, cu_seqlens)
        return super().forward(input_ids, position_ids=pos, seq_idx=seq, **mixer_kwargs)


_CLASS_CACHE: Dict[tuple, type] = {}


def _swap_class(m: nn.Module, mixin: type, prefix: str, attrs: Optional[dict] = None) -> None:
    cls = type(m)
    if getattr(cls, "_packloader_packed", False):
        return
    key = (cls, mixin)
    new = _CLASS_CACHE.get(key)
    if new is None:
        new = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": __name__, **(attrs or {})})
        _CLASS_CACHE[key] = new
    m.__class__ = new


def _accepted_kwargs(fn) -> tuple:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return _BOUNDARY_KWARGS
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return _BOUNDARY_KWARGS
    return tuple(p.name for p in params if p.name in _BOUNDARY_KWARGS)


def _accepts_var_kwargs(fn) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def _is_mixer_slot(parent: nn.Module, name: str) -> bool:
    return name == "mixer"


def enable_packing(model: nn.Module, *, strict: bool = True, validate: bool = True,
                   allow_unprotected_attention: bool = False) -> nn.Module:
    """Convert ``model`` in place so it trains on packed batches; returns ``model``.

    Args:
        model: a ``MambaLMHeadModel`` (mamba-ssm ``models.mixer_seq_simple``), its ``MixerModel``
            backbone, or any module containing Mamba-1 / Mamba-2 mixers. For the first two, the
            forward gains ``position_ids=`` / ``seq_idx=`` / ``cu_seqlens=``; for other modules
            only the mixers are converted (pass ``position_ids`` or ``seq_idx`` to them yourself).
            A Hugging Face transformers Mamba / FalconMamba / Mamba-2 model is converted by
            :func:`ops.hf.enable_packing_hf` (its forward then takes ``position_ids=`` / ``seq_idx=``
            / ``cu_seq_lens_q=``); so are the SSM layers of transformers' Bamba, NemotronH,
            GraniteMoeHybrid, FalconH1 and Zamba2 (their attention left to transformers).
        strict: raise on mixers that are not packing-safe (attention, Mamba-3, unknown classes
            sitting in a ``.mixer`` slot). With ``strict=False`` they keep their computation and
            are handed only the boundary kwargs their forward accepts (so the model runs, and
            :func:`ops.check_isolation` shows what leaks). A conversion that raises changes nothing.
        validate: validate the boundaries once per batch (one host sync).
        allow_unprotected_attention: transformers hybrids only (Bamba, NemotronH, GraniteMoeHybrid,
            FalconH1, Zamba2): when their configured ``attn_implementation`` cannot isolate packed
            sequences, convert the SSM layers anyway and warn, naming the attention layers left
            unprotected (default: refuse, changing nothing).

    Returns:
        the same model object. Parameters are shared, never copied; ``state_dict`` keys unchanged.
        Generation (``inference_params``, as mamba-ssm's ``generate`` calls it, ``position_ids``
        included) runs as before conversion.

    Raises:
        NotImplementedError: unsafe mixers with ``strict=True``; a Block / backbone whose forward does
            not pass ``**mixer_kwargs`` on (mamba-ssm < 2.0).
        ValueError: no Mamba-1 / Mamba-2 mixer in ``model``.
        TypeError: ``model`` is itself an upstream Mamba-1 mixer (use ``PackedMamba.from_mamba``).

    Example::

        model = MambaLMHeadModel(config, device="cuda", dtype=torch.bfloat16)
        ops.enable_packing(model)
        logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
    """
    if isinstance(model, PackedMamba):
        return model
    from .hf import is_transformers_model  # never imports transformers itself

    if is_transformers_model(model):  # Hugging Face Mamba / FalconMamba / Mamba-2: ops/hf.py
        from .hf import enable_packing_hf

        return enable_packing_hf(model, strict=strict, validate=validate,
                                 allow_unprotected_attention=allow_unprotected_attention)
    if is_mamba1_mixer(model):
        raise TypeError(
            "enable_packing converts a model in place and cannot replace the Mamba mixer it was given "
            "itself; pass the model that contains it, or use ops.PackedMamba.from_mamba(mixer)"
        )
    if is_mamba2_mixer(model):
        _swap_class(model, _PackedMamba2Mixin, "Packed")
        return model
    # 1. find every mixer and check everything before changing anything: a refused conversion
    #    leaves the model as it was
    found = []  # (kind, parent, name, child, full name)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if is_mamba1_mixer(child):
                found.append(("mamba1", parent, name, child, full))
            elif isinstance(child, PackedMamba):
                found.append(("packed", parent, name, child, full))
            elif is_mamba2_mixer(child):
                found.append(("mamba2", parent, name, child, full))
            elif _is_mixer_slot(parent, name):
                found.append(("unsafe", parent, name, child, full))
    unsafe = [f"{full} ({type(child).__name__})" for kind, _, _, child, full in found if kind == "unsafe"]
    if unsafe and strict:
        raise NotImplementedError(
            "enable_packing: these mixers are not packing-safe and would leak across sequences: "
            + ", ".join(unsafe)
            + ". Pass strict=False to convert the rest anyway (then run ops.check_isolation)."
        )
    if not found:
        raise ValueError(
            f"enable_packing: found no Mamba-1 or Mamba-2 mixer in {type(model).__name__}; it converts mamba-ssm's "
            "MambaLMHeadModel / MixerModel or any module containing Mamba / Mamba2 mixers"
        )
    is_lm = hasattr(model, "backbone")
    is_backbone = hasattr(model, "layers") and hasattr(model, "embedding")
    if is_lm or is_backbone:
        backbone = model.backbone if is_lm else model
        for i, layer in enumerate(getattr(backbone, "layers", [])):
            if not _accepts_var_kwargs(type(layer).forward):
                raise NotImplementedError(
                    f"enable_packing: {type(layer).__name__}.forward (layer {i}) does not pass **mixer_kwargs "
                    "to its mixer; mamba-ssm >= 2.0 is needed to thread the boundaries through"
                )
        if not _accepts_var_kwargs(type(backbone).forward):
            raise NotImplementedError(
                f"enable_packing: {type(backbone).__name__}.forward does not take **mixer_kwargs; "
                "mamba-ssm >= 2.0 is needed"
            )
    # 2. convert
    replaced: List[str] = []
    mamba2: List[str] = []
    for kind, parent, name, child, full in found:
        if kind == "mamba1":
            setattr(parent, name, PackedMamba.from_mamba(child))
            replaced.append(full)
        elif kind == "packed":
            replaced.append(full)
        elif kind == "mamba2":
            _swap_class(child, _PackedMamba2Mixin, "Packed")
            mamba2.append(full)
        elif not getattr(type(child), "_packloader_packed", False):
            _swap_class(child, _BoundaryBlindMixin, "BoundaryBlind",
                        {"_packloader_accepts": _accepted_kwargs(type(child).forward)})
    if is_lm or is_backbone:
        _swap_class(model, _PackedLMMixin if is_lm else _PackedBackboneMixin, "Packed")
        model._packloader_validate = validate
        for m in model.modules():
            if isinstance(m, PackedMamba):
                m.validate_boundaries = False  # the model validates at its entry; its mixers do not check again
    model._packloader_conversion = {"mamba1": replaced, "mamba2": mamba2, "left_unsafe": unsafe}
    return model
