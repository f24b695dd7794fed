"""``PackedMamba``: a drop-in for ``mamba_ssm.modules.mamba_simple.Mamba`` that trains on packed rows.

Same constructor, same parameter names, shapes, dtypes and initialisation as upstream's Mamba
(so a mamba-ssm checkpoint's ``state_dict`` loads unchanged); ``forward`` additionally takes the
sequence boundaries of a packed batch and resets the conv and the scan at every sequence start::

    hidden_states  (batch, seqlen, d_model)
    position_ids   [ 0 1 2 3 4 | 0 1 2 | 0 1 2 | 0 ]   (or seq_idx [0 0 0 0 0 1 1 1 2 2 2 3])

    >>> import torch, ops
    >>> layer = ops.PackedMamba(d_model=64)
    >>> h = torch.randn(1, 12, 64)
    >>> pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 0]])
    >>> out = layer(h, position_ids=pos)          # (1, 12, 64), no sequence sees another

Parameters (d_inner = expand * d_model, dt_rank = ceil(d_model / 16) when "auto")::

    in_proj.weight  (2*d_inner, d_model)   in_proj.bias (2*d_inner,) if bias
    conv1d.weight   (d_inner, 1, d_conv)   conv1d.bias  (d_inner,)   if conv_bias
    x_proj.weight   (dt_rank + 2*d_state, d_inner)
    dt_proj.weight  (d_inner, dt_rank)     dt_proj.bias (d_inner,)
    A_log           (d_inner, d_state) float32      D (d_inner,) float32
    out_proj.weight (d_model, d_inner)     out_proj.bias (d_model,) if bias
"""
from __future__ import annotations

import math
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..boundaries import resolve_boundaries, row_positions
from ..conv1d_interface import packed_causal_conv1d
from ..decode import mamba_step
from ..mamba_inner import packed_mamba_inner_fn, packed_mamba_inner_ref
from ..selective_scan_interface import packed_selective_scan

__all__ = ["PackedMamba"]


def _ssm_float(t: torch.Tensor) -> torch.Tensor:
    """The SSM parameters (A_log, D, dt bias) in float32 as upstream passes them, but a float64 module
    (the CPU reference, tests) stays in float64 instead of losing precision in a float32 round trip."""
    return t if t.dtype == torch.float64 else t.float()


class PackedMamba(nn.Module):
    """Mamba-1 mixer, packing-safe. Arguments as ``mamba_ssm.modules.mamba_simple.Mamba``:

    Args:
        d_model: model width.
        d_state: SSM state size per channel (16).
        d_conv: causal conv width (4).
        expand: d_inner = expand * d_model (2).
        dt_rank: rank of the dt projection; "auto" = ceil(d_model / 16).
        dt_min, dt_max: softplus(dt_proj.bias) is initialised log-uniformly in [dt_min, dt_max].
        dt_init: "random" (uniform +-dt_rank**-0.5 * dt_scale) or "constant" for dt_proj.weight.
        dt_scale, dt_init_floor: scale of that init; lower clamp of the initial dt.
        conv_bias: conv1d has a bias; bias: in_proj / out_proj have biases.
        use_fast_path: run the fused ``packed_mamba_inner_fn`` (one autograd Function around the kernel ops);
            False composes the functional ops with torch autograd (``packed_mamba_inner_ref``). Both run the
            compiled kernels on CUDA tensors and the reference elsewhere.
        layer_idx: index for inference caches.
        device, dtype: factory kwargs (A_log and D are always float32).
    """

    def __init__(
        self,
        d_model,
        d_state=16,
        d_conv=4,
        expand=2,
        dt_rank="auto",
        dt_min=0.001,
        dt_max=0.1,
        dt_init="random",
        dt_scale=1.0,
        dt_init_floor=1e-4,
        conv_bias=True,
        bias=False,
        use_fast_path=True,
        layer_idx=None,
        device=None,
        dtype=None,
    ):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(self.expand * self.d_model)
        self.dt_rank = math.ceil(self.d_model / 16) if dt_rank == "auto" else dt_rank
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx
        self.activation = "silu"
        self.validate_boundaries = True  # the boundaries given to forward are validated (see forward)

        self.in_proj = nn.Linear(self.d_model, 2 * self.d_inner, bias=bias, **factory_kwargs)
        self.conv1d = nn.Conv1d(
            self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
            padding=d_conv - 1, bias=conv_bias, **factory_kwargs,
        )
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False, **factory_kwargs)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory_kwargs)

        # dt_proj.weight: keeps the variance of dt at init
        std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        else:
            raise NotImplementedError(f"dt_init must be 'random' or 'constant', got {dt_init!r}")
        # dt_proj.bias: softplus(bias) = dt, dt log-uniform in [dt_min, dt_max] (clamped at the floor)
        log_lo, log_hi = math.log(dt_min), math.log(dt_max)
        dt = torch.exp(torch.rand(self.d_inner, **factory_kwargs) * (log_hi - log_lo) + log_lo)
        dt = dt.clamp(min=dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.dt_proj.bias._no_reinit = True

        # S4D-real init of A = -exp(A_log): row d is [1, 2, ..., d_state]; float32 always
        a = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=device)
        self.A_log = nn.Parameter(torch.log(a).expand(self.d_inner, self.d_state).contiguous())
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True

        self.out_proj = nn.Linear(self.d_inner, self.d_model, bias=bias, **factory_kwargs)

    # ---------------------------------------------------------------------------------------
    @classmethod
    def from_mamba(cls, mamba: nn.Module) -> "PackedMamba":
        """A PackedMamba sharing ``mamba``'s submodules and parameters (no copy, no allocation)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        for attr in ("d_model", "d_state", "d_conv", "expand", "d_inner", "dt_rank", "use_fast_path", "layer_idx"):
            setattr(self, attr, getattr(mamba, attr))
        self.activation = getattr(mamba, "activation", "silu")
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"PackedMamba supports the silu activation only, got {self.activation!r}")
        self.validate_boundaries = True
        self.A_log = mamba.A_log
        self.D = mamba.D
        self.in_proj = mamba.in_proj
        self.conv1d = mamba.conv1d
        self.act = getattr(mamba, "act", nn.SiLU())
        self.x_proj = mamba.x_proj
        self.dt_proj = mamba.dt_proj
        self.out_proj = mamba.out_proj
        self.train(mamba.training)
        return self

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_inner={self.d_inner}, d_state={self.d_state}, "
                f"d_conv={self.d_conv}, dt_rank={self.dt_rank}, use_fast_path={self.use_fast_path}")

    # ---------------------------------------------------------------------------------------
    def forward(self, hidden_states, position_ids=None, seq_idx=None, inference_params=None, cu_seqlens=None,
                carry=None, **kwargs):
        """
        Args:
            hidden_states: (batch, seqlen, d_model).
            position_ids: (batch, seqlen) ids restarting at 0 at every sequence start, or None.
            seq_idx: (batch, seqlen) segment numbers (the alternative), or None.
            inference_params: mamba-ssm's InferenceParams for generation; not with boundaries.
            cu_seqlens: (n_seqs + 1,) offsets over the flattened batch (a third alternative).
            carry: an :class:`ops.CarryStep` (``StateCache.step(batch)``): continued pieces start from the state of
                the piece before (earlier in this batch, with its gradient, or from the cache) and the pieces that
                continue in a later step leave their final states; ``layer_idx`` keys this layer's states. A batch
                without continuations runs as without it.

        Returns:
            (batch, seqlen, d_model), same dtype as hidden_states.
        """
        if (position_ids is not None and not isinstance(position_ids, torch.Tensor)
                and hasattr(position_ids, "key_value_memory_dict")):
            # upstream's signature is forward(hidden_states, inference_params=None): a positional cache
            inference_params, position_ids = position_ids, None
        batch, seqlen, _ = hidden_states.shape
        has_bounds = position_ids is not None or seq_idx is not None or cu_seqlens is not None
        if inference_params is not None:
            if has_bounds:
                raise ValueError(
                    "PackedMamba: inference_params (generation caches) cannot be combined with packed "
                    "boundaries (position_ids / seq_idx / cu_seqlens); generate one sequence per row"
                )
            return self._forward_inference(hidden_states, inference_params)
        cp_group = getattr(self, "_packloader_cp_group", None)
        if cp_group is not None:   # ops.context_parallel: this rank's chunk of every row
            from ..context_parallel import context_parallel_mamba_inner, ContextParallelError
            # (a converted model hands down seq_idx beside position_ids: the ids are what counts here)
            if carry is not None or (position_ids is None and (seq_idx is not None or cu_seqlens is not None)):
                raise ContextParallelError("PackedMamba (context-parallel): takes position_ids (the rows' ids over "
                                           "this rank's chunk), not seq_idx / cu_seqlens alone, nor carry")
            return context_parallel_mamba_inner(self, hidden_states, position_ids, cp_group,
                                                getattr(self, "_packloader_cp_recompute", False))
        # resolved once here and handed down as int32 position_ids; the ops below do not check again. Validation
        # (one host sync) runs when validate_boundaries is set, never under torch.compile; a model converted by
        # ops.enable_packing validates at its entry and switches it off in its mixers.
        pos, _ = resolve_boundaries(position_ids, seq_idx, cu_seqlens, (batch, seqlen), device=hidden_states.device,
                                    validate=self.validate_boundaries)
        A = -torch.exp(_ssm_float(self.A_log))
        args = (
            hidden_states, self.in_proj.weight, self.in_proj.bias, self.conv1d.weight, self.conv1d.bias,
            self.x_proj.weight, self.dt_proj.weight, self.out_proj.weight, self.out_proj.bias,
            A, _ssm_float(self.D), _ssm_float(self.dt_proj.bias), True,
        )
        if carry is not None and carry.has_continuations:
            from ..carry import carried_mamba_inner
            return carried_mamba_inner(self, hidden_states, pos if pos is not None else
                                       row_positions(batch, seqlen, hidden_states.device), carry)
        if self.use_fast_path:
            return packed_mamba_inner_fn(*args, position_ids=pos, validate=False)
        return packed_mamba_inner_ref(*args, position_ids=pos, validate=False)

    # ---------------------------------------------------------------------------------------
    # Generation (one sequence per row, no packing): upstream's cache layout.
    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        ssm_dtype = self.dt_proj.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size, initialize_states=False):
        if self.layer_idx is None:
            raise ValueError("PackedMamba: layer_idx must be set to use inference_params")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            cache[self.layer_idx] = self.allocate_inference_cache(batch_size, 0)
        conv_state, ssm_state = cache[self.layer_idx]
        if initialize_states:
            conv_state.zero_()
            ssm_state.zero_()
        return conv_state, ssm_state

    def _forward_inference(self, hidden_states, inference_params):
        batch, seqlen, _ = hidden_states.shape
        conv_state, ssm_state = self._get_states_from_cache(inference_params, batch)
        if inference_params.seqlen_offset > 0:
            out, _, _ = self.step(hidden_states, conv_state, ssm_state)
            return out
        # the prompt: one sequence per row through the packed ops (the kernels on CUDA tensors), keeping each row's
        # last d_conv conv inputs and its final scan state for the steps
        xz = self.in_proj(hidden_states).transpose(1, 2)
        x, z = xz.chunk(2, dim=1)
        conv_state.copy_(F.pad(x, (self.d_conv - x.shape[-1], 0)))
        conv_bias = self.conv1d.bias.to(x.dtype) if self.conv1d.bias is not None else None
        x = packed_causal_conv1d(x.contiguous(), self.conv1d.weight.to(x.dtype), conv_bias, "silu", validate=False)
        x_dbl = self.x_proj(x.transpose(1, 2))
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)
        A = -torch.exp(_ssm_float(self.A_log))
        y, last = packed_selective_scan(
            x, dt, A, B.transpose(1, 2), C.transpose(1, 2), _ssm_float(self.D), z.contiguous(),
            _ssm_float(self.dt_proj.bias), True, output_final_state=True, validate=False,
            has_initial_state=torch.zeros(batch, dtype=torch.bool, device=x.device),
        )
        ssm_state.copy_(last)
        return self.out_proj(y.transpose(1, 2))

    def step(self, hidden_states, conv_state, ssm_state):
        """One decoding step: hidden_states (batch, 1, d_model) -> (out (batch, 1, d_model), conv_state, ssm_state),
        the states (batch, d_inner, d_conv) / (batch, d_inner, d_state) updated in place.

        Runs the fused state updates of :mod:`ops.decode` (Triton kernels on CUDA tensors, the torch math of
        mamba-ssm's ``Mamba.step`` elsewhere): no host sync and no allocation but the outputs, so mamba-ssm's
        ``generate(..., cg=True)`` and ``torch.compile(mode="reduce-overhead")`` capture it. No gradients.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"step decodes one token at a time: hidden_states must be (batch, 1, d_model), got "
                             f"{tuple(hidden_states.shape)}")
        out = mamba_step(self, hidden_states, conv_state, ssm_state)
        return out, conv_state, ssm_state
