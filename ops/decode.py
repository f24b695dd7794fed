"""Single-token decoding of a Mamba-1 mixer: the conv and scan state updates as fused custom ops.

Generation runs a mixer once per new token on ``(batch, 1, d_model)``. Between ``in_proj``, ``x_proj`` and
``out_proj`` (matmuls) the step has two pieces of per-channel work, each one kernel here::

    causal_conv1d_step      conv_state <- [conv_state[:, :, 1:], x]         (in place)
                            out = silu(sum_k conv_state[:, :, k] * w[:, k] + bias)
    selective_state_step    dt = softplus(dt_low @ dt_proj_weight.T + dt_bias)  (or dt given directly)
                            h <- h * exp(dt * A) + dt * B * x,  A = -exp(A_log)   (in place)
                            y = (h @ C + D * x) * silu(z)

Mamba-2's step (``mamba2_state_step``) is the state update with one ``A`` and one ``dt`` per head of ``headdim``
channels, ``B`` / ``C`` shared by the heads of a group::

    mamba2_state_step       dt = softplus(dt + dt_bias)                     (batch, heads)
                            h[:, head] <- h * exp(dt A) + dt x B[group]     (in place, (batch, heads, headdim, dstate))
                            y = h @ C[group] + D x   (* silu(z))

All three are ``torch.library.custom_op``s (``torch.ops.packloader.causal_conv1d_step`` /
``selective_state_step`` / ``mamba2_state_step``) that mutate their state argument and return a new tensor, with a fake implementation
(so ``torch.compile`` traces them) and three implementations picked as the other ops of :mod:`ops.backends` are.
The checked entry points :func:`causal_conv1d_step` / :func:`selective_state_step` call the op under
``torch.compile`` and its implementation directly in eager mode (the dispatcher's Python round trip of a custom op
costs tens of microseconds, more than the kernel at batch 1; same code, same results):

- the reference (every device but CUDA, any float dtype; also CUDA tensors under
  ``ops.use_backend("reference")``): the torch math of mamba-ssm's ``Mamba.step`` without its kernels, op for op
  and dtype for dtype (``PackedMamba.step`` ran exactly this before these ops existed);
- the Triton kernels (CUDA tensors of float32 / float16 / bfloat16): one program per (row, block of channels),
  arithmetic in float32 whatever the storage dtype, states read and written in place; no host sync and no
  allocation but the output, so a step is capturable by CUDA graphs (mamba-ssm's ``generate(..., cg=True)``,
  ``torch.compile(mode="reduce-overhead")``);
- a CUDA case the kernels cannot take (Triton missing, float64) raises ``KernelUnsupportedError`` naming the
  override, as the other ops do; nothing falls back silently.

Example::

    >>> import torch
    >>> from ops.decode import causal_conv1d_step, selective_state_step
    >>> b, d, n, w, r = 2, 8, 4, 4, 3
    >>> conv_state, ssm_state = torch.zeros(b, d, w), torch.zeros(b, d, n)
    >>> x = causal_conv1d_step(torch.randn(b, d), conv_state, torch.randn(d, w), torch.randn(d))
    >>> y = selective_state_step(ssm_state, x, torch.randn(b, r), torch.randn(d, n), torch.randn(b, n),
    ...                          torch.randn(b, n), D=torch.ones(d), z=torch.randn(b, d),
    ...                          dt_bias=torch.zeros(d), dt_proj_weight=torch.randn(d, r))
    >>> y.shape
    torch.Size([2, 8])

:func:`mamba_step` runs a whole Mamba-1 mixer step (``PackedMamba.step`` and converted transformers mixers call it).
The ops compute no gradients (generation runs under ``torch.no_grad`` / ``inference_mode``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from . import backends as _backends
from .contract import KERNEL_DTYPES

try:  # Triton ships with torch's CUDA wheels; a CPU-only install has none and runs the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = [
    "causal_conv1d_step",
    "selective_state_step",
    "causal_conv1d_step_ref",
    "selective_state_step_ref",
    "mamba_step",
    "mamba2_state_step",
    "mamba2_state_step_ref",
    "HAS_TRITON",
]

HAS_TRITON = triton is not None
MAX_DSTATE = 256   # the state kernel holds (channels, dstate) tiles in registers
MAX_WIDTH = 16     # the conv kernel holds (channels, width) tiles


def _ssm_float(t: torch.Tensor) -> torch.Tensor:
    """float32, but float64 stays float64 (as ``PackedMamba`` passes its SSM parameters)."""
    return t if t.dtype == torch.float64 else t.float()


# --------------------------------------------------------------------------------------------------
# references: the torch math of mamba-ssm's Mamba.step (no kernels), op for op


def causal_conv1d_step_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, silu: bool = True) -> torch.Tensor:
    """The conv step in torch ops: shift ``conv_state`` left by one, put ``x`` in its last column (in place), then
    the depthwise conv of the window (+ bias, silu). Arithmetic in ``conv_state``'s / ``weight``'s promoted dtype;
    returns ``x``'s dtype. Arguments as :func:`causal_conv1d_step`."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = (conv_state * weight).sum(-1)
    if bias is not None:
        out = out + bias
    if silu:
        out = F.silu(out)
    return out.to(x.dtype)


def selective_state_step_ref(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                             B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor] = None,
                             z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                             dt_proj_weight: Optional[torch.Tensor] = None, dt_softplus: bool = True) -> torch.Tensor:
    """The scan step in torch ops (updates ``ssm_state`` in place); returns ``x``'s dtype. Arguments as
    :func:`selective_state_step`."""
    dtype = x.dtype
    if dt_proj_weight is not None:
        dt = F.linear(dt, dt_proj_weight)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    A = -torch.exp(_ssm_float(A_log))
    dA = torch.exp(dt.unsqueeze(-1) * A)
    dB = dt.unsqueeze(-1) * B.unsqueeze(1)
    ssm_state.copy_(ssm_state * dA + x.unsqueeze(-1) * dB)
    y = (ssm_state.to(dtype) * C.unsqueeze(1)).sum(-1)
    if D is not None:
        y = y + D.to(dtype) * x
    if z is not None:
        y = y * F.silu(z)
    return y.to(dtype)


def mamba2_state_step_ref(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor] = None,
                          z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                          dt_softplus: bool = True) -> torch.Tensor:
    """Mamba-2's scan step in torch ops (updates ``ssm_state`` in place), arithmetic in float32 (float64 for
    float64), as mamba-ssm's ``selective_state_update`` computes it; returns ``x``'s dtype. Arguments as
    :func:`mamba2_state_step`."""
    heads, groups = ssm_state.shape[1], B.shape[1]
    dt = _ssm_float(dt)
    if dt_bias is not None:
        dt = dt + _ssm_float(dt_bias)
    if dt_softplus:
        dt = F.softplus(dt)
    dA = torch.exp(dt * -torch.exp(_ssm_float(A_log)))                         # (batch, heads)
    Bh = _ssm_float(B).repeat_interleave(heads // groups, dim=1)               # (batch, heads, dstate)
    Ch = _ssm_float(C).repeat_interleave(heads // groups, dim=1)
    xf = _ssm_float(x)
    h = _ssm_float(ssm_state) * dA[..., None, None] + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    ssm_state.copy_(h)
    y = (h * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + xf * (_ssm_float(D)[:, None] if D.dim() == 1 else _ssm_float(D))
    if z is not None:
        y = y * F.silu(_ssm_float(z))
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Triton kernels

if HAS_TRITON:

    @triton.jit
    def _softplus_f32(v):
        """log(1 + exp(v)) with log1p's accuracy where exp(v) is small; v itself above torch's threshold 20."""
        e = tl.exp(v)
        u = 1.0 + e
        small = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        return tl.where(v > 20.0, v, small)

    @triton.jit
    def _conv_step_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, dim, width,
                          sx_b, sx_d, ss_b, ss_d, ss_w, sw_d, sw_w, so_b, so_d,
                          HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
        row = tl.program_id(0)
        ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        k = tl.arange(0, BLOCK_W)
        mc = ch < dim
        mw = mc[:, None] & (k[None, :] < width)
        state = state_ptr + row * ss_b + ch[:, None] * ss_d
        # the window after the shift: column k is the old column k + 1, the last column the new input
        shifted = tl.load(state + (k[None, :] + 1) * ss_w, mask=mc[:, None] & (k[None, :] + 1 < width), other=0.0)
        xv = tl.load(x_ptr + row * sx_b + ch * sx_d, mask=mc, other=0.0).to(state_ptr.dtype.element_ty)
        window = tl.where(k[None, :] == width - 1, xv[:, None], shifted)
        tl.debug_barrier()  # every column is read before any is written (a channel's columns span threads)
        tl.store(state + k[None, :] * ss_w, window, mask=mw)
        w = tl.load(w_ptr + ch[:, None] * sw_d + k[None, :] * sw_w, mask=mw, other=0.0)
        acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + ch, mask=mc, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * so_b + ch * so_d, acc.to(out_ptr.dtype.element_ty), mask=mc)

    @triton.jit
    def _state_step_kernel(state_ptr, x_ptr, dt_ptr, dtw_ptr, dtb_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, z_ptr, out_ptr,
                           dim, dstate, rank,
                           ss_b, ss_d, ss_n, sx_b, sx_d, sdt_b, sdt_k, sw_d, sw_r, sa_d, sa_n,
                           sb_b, sb_n, sc_b, sc_n, sz_b, sz_d, so_b, so_d,
                           DT_PROJ: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                           HAS_D: tl.constexpr, HAS_Z: tl.constexpr, LOADS_FIRST: tl.constexpr, RANK: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        # one program: one row x BLOCK_D channels. LOADS_FIRST (few programs, latency-bound): every load is issued
        # before the dt projection, whose loop over the rank (RANK) is unrolled; else the projection comes first
        # (fewer registers held across it: more programs in flight)
        row = tl.program_id(0)
        ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        nn = tl.arange(0, BLOCK_N)
        mc = ch < dim
        mn = nn < dstate
        m2 = mc[:, None] & mn[None, :]
        sp = state_ptr + row * ss_b + ch[:, None] * ss_d + nn[None, :] * ss_n
        if LOADS_FIRST:
            h = tl.load(sp, mask=m2, other=0.0).to(tl.float32)
            bv = tl.load(b_ptr + row * sb_b + nn * sb_n, mask=mn, other=0.0).to(tl.float32)
            cv = tl.load(c_ptr + row * sc_b + nn * sc_n, mask=mn, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + row * sx_b + ch * sx_d, mask=mc, other=0.0).to(tl.float32)
        a = -tl.exp(tl.load(alog_ptr + ch[:, None] * sa_d + nn[None, :] * sa_n, mask=m2, other=0.0).to(tl.float32))
        if DT_PROJ:  # dt = dt_low @ W.T, the low-rank projection fused here
            dt = tl.zeros([BLOCK_D], dtype=tl.float32)
            if LOADS_FIRST:
                for r0 in tl.static_range(0, RANK, BLOCK_R):
                    rr = r0 + tl.arange(0, BLOCK_R)
                    mr = rr < RANK
                    low = tl.load(dt_ptr + row * sdt_b + rr * sdt_k, mask=mr, other=0.0).to(tl.float32)
                    w = tl.load(dtw_ptr + ch[:, None] * sw_d + rr[None, :] * sw_r, mask=mc[:, None] & mr[None, :],
                                other=0.0).to(tl.float32)
                    dt += tl.sum(w * low[None, :], axis=1)
            else:
                for r0 in range(0, rank, BLOCK_R):
                    rr = r0 + tl.arange(0, BLOCK_R)
                    mr = rr < rank
                    low = tl.load(dt_ptr + row * sdt_b + rr * sdt_k, mask=mr, other=0.0).to(tl.float32)
                    w = tl.load(dtw_ptr + ch[:, None] * sw_d + rr[None, :] * sw_r, mask=mc[:, None] & mr[None, :],
                                other=0.0).to(tl.float32)
                    dt += tl.sum(w * low[None, :], axis=1)
            # rounded to dt's dtype, as F.linear's output is (the reference, and mamba-ssm's step)
            dt = dt.to(dt_ptr.dtype.element_ty).to(tl.float32)
        else:
            dt = tl.load(dt_ptr + row * sdt_b + ch * sdt_k, mask=mc, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dtb_ptr + ch, mask=mc, other=0.0).to(tl.float32)
        if SOFTPLUS:
            dt = _softplus_f32(dt)
        if not LOADS_FIRST:
            bv = tl.load(b_ptr + row * sb_b + nn * sb_n, mask=mn, other=0.0).to(tl.float32)
            cv = tl.load(c_ptr + row * sc_b + nn * sc_n, mask=mn, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + row * sx_b + ch * sx_d, mask=mc, other=0.0).to(tl.float32)
            h = tl.load(sp, mask=m2, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every thread holding a copy of an element has read it before any writes it
        h = h * tl.exp(dt[:, None] * a) + (dt * xv)[:, None] * bv[None, :]
        tl.store(sp, h.to(state_ptr.dtype.element_ty), mask=m2)
        y = tl.sum(h * cv[None, :], axis=1)
        if HAS_D:
            y += xv * tl.load(d_ptr + ch, mask=mc, other=0.0).to(tl.float32)
        if HAS_Z:
            zv = tl.load(z_ptr + row * sz_b + ch * sz_d, mask=mc, other=0.0).to(tl.float32)
            y = y * zv * tl.sigmoid(zv)
        tl.store(out_ptr + row * so_b + ch * so_d, y.to(out_ptr.dtype.element_ty), mask=mc)


if HAS_TRITON:

    @triton.jit
    def _mamba2_state_step_kernel(state_ptr, x_ptr, dt_ptr, dtb_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, z_ptr, out_ptr,
                                  headdim, dstate, heads_per_group,
                                  ss_b, ss_h, ss_p, ss_n, sx_b, sx_h, sx_p, sdt_b, sdt_h, sdtb_h, sa_h,
                                  sb_b, sb_g, sb_n, sc_b, sc_g, sc_n, sd_h, sd_p, sz_b, sz_h, sz_p, so_b, so_h, so_p,
                                  HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
                                  HAS_Z: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        # one program: one row, one head, BLOCK_P of its channels; its dt and A are scalars
        row = tl.program_id(0)
        head = tl.program_id(1)
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        nn = tl.arange(0, BLOCK_N)
        group = head // heads_per_group
        mp = p < headdim
        mn = nn < dstate
        m2 = mp[:, None] & mn[None, :]
        sp = state_ptr + row * ss_b + head * ss_h + p[:, None] * ss_p + nn[None, :] * ss_n
        h = tl.load(sp, mask=m2, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + row * sb_b + group * sb_g + nn * sb_n, mask=mn, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + row * sc_b + group * sc_g + nn * sc_n, mask=mn, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + row * sx_b + head * sx_h + p * sx_p, mask=mp, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + row * sdt_b + head * sdt_h).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dtb_ptr + head * sdtb_h).to(tl.float32)
        if SOFTPLUS:
            dt = _softplus_f32(dt)
        decay = tl.exp(dt * -tl.exp(tl.load(alog_ptr + head * sa_h).to(tl.float32)))
        tl.debug_barrier()  # every thread holding a copy of an element has read it before any writes it
        h = h * decay + (dt * xv)[:, None] * bv[None, :]
        tl.store(sp, h.to(state_ptr.dtype.element_ty), mask=m2)
        y = tl.sum(h * cv[None, :], axis=1)
        if HAS_D:
            y += xv * tl.load(d_ptr + head * sd_h + p * sd_p, mask=mp, other=0.0).to(tl.float32)
        if HAS_Z:
            zv = tl.load(z_ptr + row * sz_b + head * sz_h + p * sz_p, mask=mp, other=0.0).to(tl.float32)
            y = y * zv * tl.sigmoid(zv)
        tl.store(out_ptr + row * so_b + head * so_h + p * so_p, y.to(out_ptr.dtype.element_ty), mask=mp)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _conv_launch(batch: int, dim: int) -> Tuple[int, int]:
    """(channels per program, warps) of the conv step, measured as :func:`_state_launch`'s choices."""
    if batch * dim < 65536:
        return 64, 4
    return (128, 4) if batch * dim < 262144 else (128, 2)


def _conv_step_triton(x, conv_state, weight, bias, silu, out, launch: Optional[Tuple[int, int]] = None):
    batch, dim = x.shape
    block, warps = launch if launch is not None else _conv_launch(batch, dim)
    grid = (batch, triton.cdiv(dim, block))
    width = conv_state.shape[2]
    _conv_step_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, out, dim, width,
        x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, SILU=bool(silu), BLOCK_D=block, BLOCK_W=max(2, _next_pow2(width)),
        num_warps=warps,
    )
    return out


class StateLaunch(NamedTuple):
    """How :func:`selective_state_step`'s kernel runs (``_state_launch`` picks it from the shape)."""
    fuse_dt_proj: bool   # project dt inside the kernel (each program reads its channels' rows of dt_proj_weight)
    loads_first: bool    # issue every load before the dt projection (latency-bound: few programs)
    block_d: int         # channels per program (one row each)
    num_warps: int


# Above this many dt_proj multiply-adds (batch x dim x rank) the fused projection's weight reads (each row's
# programs read all of dt_proj_weight) cost more than one matmul plus the kernel without it. The choices below
# were measured on an H100 (bf16, d_state 16): benchmarks/bench_decode_kernels.py.
_FUSED_DT_PROJ_MAX_MACS = 6_000_000


def _state_launch(batch: int, dim: int, rank: int) -> StateLaunch:
    """The launch for a (batch, dim) step with a dt projection of ``rank`` (0: dt given per channel)."""
    if batch < 8:   # few programs: short ones, every load in flight at once
        return StateLaunch(True, True, 16, 4)
    if rank and batch * dim * rank > _FUSED_DT_PROJ_MAX_MACS:
        return StateLaunch(False, False, 64, 2)
    return StateLaunch(True, False, 64, 4 if batch < 32 else 2)


def _state_step_triton(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_proj_weight, dt_softplus, out,
                       launch: Optional[StateLaunch] = None):
    batch, dim, dstate = ssm_state.shape
    block_n = max(16, _next_pow2(dstate))
    rank = dt.shape[1] if dt_proj_weight is not None else 0
    if launch is None:
        launch = _state_launch(batch, dim, rank)
    block_d = launch.block_d
    while block_d > 4 and block_d * block_n > 1024:   # a (channels, dstate) tile of at most 1024 states
        block_d //= 2
    fuse = dt_proj_weight is not None and launch.fuse_dt_proj
    if dt_proj_weight is not None and not fuse:   # one matmul; rounded to dt's dtype as the fused projection is
        ct = torch.promote_types(dt.dtype, dt_proj_weight.dtype)
        dt = F.linear(dt.to(ct), dt_proj_weight.to(ct)).to(dt.dtype)
    block_r = min(32, max(16, _next_pow2(rank)))
    w = dt_proj_weight if fuse else A_log   # placeholders for absent pointers
    zz = z if z is not None else x
    grid = (batch, triton.cdiv(dim, block_d))
    _state_step_kernel[grid](
        ssm_state, x, dt, w, dt_bias if dt_bias is not None else A_log, A_log, B, C,
        D if D is not None else A_log, zz, out,
        dim, dstate, rank,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), x.stride(0), x.stride(1),
        dt.stride(0), dt.stride(1), w.stride(0), w.stride(1), A_log.stride(0), A_log.stride(1),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), zz.stride(0), zz.stride(1), out.stride(0), out.stride(1),
        DT_PROJ=fuse, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        HAS_D=D is not None, HAS_Z=z is not None, LOADS_FIRST=launch.loads_first,
        RANK=rank if (fuse and launch.loads_first) else 0,
        BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=launch.num_warps,
    )
    return out


def _mamba2_state_step_triton(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_softplus, out):
    batch, heads, headdim, dstate = ssm_state.shape
    block_n = max(16, _next_pow2(dstate))
    block_p = max(1, min(_next_pow2(headdim), 1024 // block_n))   # a (channels, dstate) tile of at most 1024 states
    if D is not None and D.dim() == 1:
        sd_h, sd_p = D.stride(0), 0
    elif D is not None:
        sd_h, sd_p = D.stride(0), D.stride(1)
    else:
        sd_h = sd_p = 0
    zz = z if z is not None else x
    grid = (batch, heads, triton.cdiv(headdim, block_p))
    _mamba2_state_step_kernel[grid](
        ssm_state, x, dt, dt_bias if dt_bias is not None else A_log, A_log, B, C, D if D is not None else A_log, zz,
        out, headdim, dstate, heads // B.shape[1],
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1),
        dt_bias.stride(0) if dt_bias is not None else 0, A_log.stride(0),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2), sd_h, sd_p,
        zz.stride(0), zz.stride(1), zz.stride(2), out.stride(0), out.stride(1), out.stride(2),
        HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), HAS_D=D is not None, HAS_Z=z is not None,
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4 if block_p * block_n >= 512 else 2,
    )
    return out


def _kernel_or_reference(op: str, dtypes, **limits) -> bool:
    """True: run the Triton kernel; False: the reference (``use_backend("reference")``); else
    KernelUnsupportedError."""
    if _backends.get_backend() == "reference":
        return False
    reason = None
    if not HAS_TRITON:
        reason = "Triton is not installed (it ships with torch's CUDA wheels: pip install triton)"
    for name, dt in dtypes:
        if reason is None and dt not in KERNEL_DTYPES:
            reason = f"the kernel takes float32/float16/bfloat16 {name}, got {dt}"
    for name, (value, hi) in limits.items():
        if reason is None and value > hi:
            reason = f"the kernel takes {name} <= {hi}, got {value}"
    if reason is not None:
        raise _backends.KernelUnsupportedError(f"packloader ops: {op} on CUDA tensors: {reason}; "
                                               f"{_backends.HOW_TO_REFERENCE}")
    return True


# --------------------------------------------------------------------------------------------------
# the custom ops


@torch.library.custom_op("packloader::causal_conv1d_step", mutates_args=("conv_state",), device_types=None)
def _conv_step_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  silu: bool) -> torch.Tensor:
    """One token through the depthwise causal conv (``conv_state`` shifted in place); this body is the reference."""
    return causal_conv1d_step_ref(x, conv_state, weight, bias, silu)


@_conv_step_op.register_kernel("cuda")
def _conv_step_cuda(x, conv_state, weight, bias, silu):
    if not _kernel_or_reference("causal_conv1d_step", (("x", x.dtype), ("conv_state", conv_state.dtype),
                                                       ("weight", weight.dtype)),
                                width=(conv_state.shape[2], MAX_WIDTH)):
        return causal_conv1d_step_ref(x, conv_state, weight, bias, silu)
    return _conv_step_triton(x, conv_state, weight, bias, silu, torch.empty_like(x, memory_format=torch.contiguous_format))


@_conv_step_op.register_fake
def _conv_step_fake(x, conv_state, weight, bias, silu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("packloader::selective_state_step", mutates_args=("ssm_state",), device_types=None)
def _state_step_op(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                   dt_bias: Optional[torch.Tensor], dt_proj_weight: Optional[torch.Tensor],
                   dt_softplus: bool) -> torch.Tensor:
    """One token through the selective scan (``ssm_state`` updated in place); this body is the reference."""
    return selective_state_step_ref(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_proj_weight, dt_softplus)


@_state_step_op.register_kernel("cuda")
def _state_step_cuda(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_proj_weight, dt_softplus):
    if not _kernel_or_reference("selective_state_step", (("x", x.dtype), ("ssm_state", ssm_state.dtype)),
                                dstate=(ssm_state.shape[2], MAX_DSTATE)):
        return selective_state_step_ref(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_proj_weight, dt_softplus)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _state_step_triton(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_proj_weight, dt_softplus, out)


@_state_step_op.register_fake
def _state_step_fake(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_proj_weight, dt_softplus):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("packloader::mamba2_state_step", mutates_args=("ssm_state",), device_types=None)
def _mamba2_step_op(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                    B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                    dt_bias: Optional[torch.Tensor], dt_softplus: bool) -> torch.Tensor:
    """One token through Mamba-2's scan (``ssm_state`` updated in place); this body is the reference."""
    return mamba2_state_step_ref(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_softplus)


@_mamba2_step_op.register_kernel("cuda")
def _mamba2_step_cuda(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_softplus):
    if not _kernel_or_reference("mamba2_state_step", (("x", x.dtype), ("ssm_state", ssm_state.dtype)),
                                dstate=(ssm_state.shape[3], MAX_DSTATE)):
        return mamba2_state_step_ref(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_softplus)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _mamba2_state_step_triton(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_softplus, out)


@_mamba2_step_op.register_fake
def _mamba2_step_fake(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_softplus):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# --------------------------------------------------------------------------------------------------
# checked entry points


def _check(name: str, t: Optional[torch.Tensor], shape: Tuple[int, ...], device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the states on {device}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, activation: Optional[str] = "silu") -> torch.Tensor:
    """One decoding step of a depthwise causal conv1d; ``conv_state`` is updated in place.

    ``conv_state`` holds the last ``width`` inputs of every channel, oldest first (mamba-ssm's / causal-conv1d's
    layout). The step drops the oldest, appends ``x`` and returns the conv over that window::

        >>> conv_state = torch.zeros(1, 2, 3)
        >>> out = causal_conv1d_step(torch.ones(1, 2), conv_state, torch.ones(2, 3), activation=None)
        >>> conv_state[0, 0].tolist(), out.tolist()
        ([0.0, 0.0, 1.0], [[1.0, 1.0]])

    Args:
        x: (batch, dim), the new token's conv input.
        conv_state: (batch, dim, width), any strides; overwritten with the shifted window.
        weight: (dim, width), or nn.Conv1d's depthwise (dim, 1, width); ``weight[:, -1]`` multiplies ``x``.
        bias: (dim,), optional.
        activation: ``"silu"`` / ``"swish"`` or None.

    Returns:
        (batch, dim) in ``x``'s dtype.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if conv_state.dim() != 3:
        raise ValueError(f"conv_state must be (batch, dim, width), got {tuple(conv_state.shape)}")
    batch, dim, width = conv_state.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    _check("x", x, (batch, dim), conv_state.device)
    _check("weight", weight, (dim, width), conv_state.device)
    _check("bias", bias, (dim,), conv_state.device)
    if torch.compiler.is_compiling():
        return _conv_step_op(x, conv_state, weight, bias, activation is not None)
    # eager (CUDA-graph capture included): what the op would dispatch to, without the dispatcher's Python round trip
    # (tens of microseconds a call, per layer and token)
    impl = _conv_step_cuda if conv_state.is_cuda else causal_conv1d_step_ref
    return impl(x, conv_state, weight, bias, activation is not None)


def selective_state_step(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, *, D: Optional[torch.Tensor] = None,
                         z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                         dt_proj_weight: Optional[torch.Tensor] = None, dt_softplus: bool = True) -> torch.Tensor:
    """One decoding step of the selective scan; ``ssm_state`` is updated in place.

    ``dt = softplus(dt @ dt_proj_weight.T + dt_bias)``, ``A = -exp(A_log)``; then
    ``h = h * exp(dt A) + dt B x`` and ``y = (h C + D x) * silu(z)`` per channel::

        >>> h = torch.zeros(1, 2, 1)
        >>> y = selective_state_step(h, torch.ones(1, 2), torch.full((1, 2), 5.0), torch.zeros(2, 1),
        ...                          torch.ones(1, 1), torch.ones(1, 1), dt_softplus=False)
        >>> h.flatten().tolist(), y.tolist()      # dt = 5, A = -1: h = 5, y = h
        ([5.0, 5.0], [[5.0, 5.0]])

    Args:
        ssm_state: (batch, dim, dstate), any strides; overwritten with the new state.
        x: (batch, dim), the conv's output for this token.
        dt: (batch, rank) with ``dt_proj_weight`` (the low-rank time step, projected here), else (batch, dim).
        A_log: (dim, dstate); ``A = -exp(A_log)`` in float32 (float64 for float64).
        B, C: (batch, dstate); any strides (slices of ``x_proj``'s output are fine).
        D: (dim,) skip, added as ``D * x``; optional.
        z: (batch, dim) gate, ``y * silu(z)``; optional.
        dt_bias: (dim,) added to ``dt`` before the softplus; optional.
        dt_proj_weight: (dim, rank), the time step projection (``dt_proj.weight``); optional.
        dt_softplus: apply softplus to the time step.

    Returns:
        (batch, dim) in ``x``'s dtype.
    """
    if ssm_state.dim() != 3:
        raise ValueError(f"ssm_state must be (batch, dim, dstate), got {tuple(ssm_state.shape)}")
    batch, dim, dstate = ssm_state.shape
    dev = ssm_state.device
    _check("x", x, (batch, dim), dev)
    if dt_proj_weight is not None:
        if dt_proj_weight.dim() != 2 or dt_proj_weight.shape[0] != dim:
            raise ValueError(f"dt_proj_weight must be (dim={dim}, rank), got {tuple(dt_proj_weight.shape)}")
        _check("dt", dt, (batch, dt_proj_weight.shape[1]), dev)
    else:
        _check("dt", dt, (batch, dim), dev)
    _check("A_log", A_log, (dim, dstate), dev)
    _check("B", B, (batch, dstate), dev)
    _check("C", C, (batch, dstate), dev)
    _check("D", D, (dim,), dev)
    _check("z", z, (batch, dim), dev)
    _check("dt_bias", dt_bias, (dim,), dev)
    args = (ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_proj_weight, bool(dt_softplus))
    if torch.compiler.is_compiling():
        return _state_step_op(*args)
    return (_state_step_cuda if ssm_state.is_cuda else selective_state_step_ref)(*args)   # eager: as above


def mamba2_state_step(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                      B: torch.Tensor, C: torch.Tensor, *, D: Optional[torch.Tensor] = None,
                      z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                      dt_softplus: bool = True) -> torch.Tensor:
    """One decoding step of Mamba-2's scan; ``ssm_state`` is updated in place.

    Every head has one time step and one ``A = -exp(A_log)``; the ``heads // groups`` heads of a group share its
    ``B`` and ``C``. ``dt = softplus(dt + dt_bias)``, then per head ``h = h * exp(dt A) + dt x B`` and
    ``y = h C + D x`` (times ``silu(z)``)::

        >>> h = torch.zeros(1, 2, 1, 1)      # 2 heads of 1 channel, 1 state, 1 group
        >>> y = mamba2_state_step(h, torch.ones(1, 2, 1), torch.tensor([[5.0, 1.0]]), torch.zeros(2),
        ...                       torch.ones(1, 1, 1), torch.ones(1, 1, 1), dt_softplus=False)
        >>> h.flatten().tolist(), y.flatten().tolist()     # A = -1: h = dt
        ([5.0, 1.0], [5.0, 1.0])

    Args:
        ssm_state: (batch, heads, headdim, dstate), any strides; overwritten with the new state.
        x: (batch, heads, headdim), the conv's output for this token.
        dt: (batch, heads), before ``dt_bias`` and the softplus.
        A_log: (heads,); ``A = -exp(A_log)`` in float32 (float64 for float64).
        B, C: (batch, groups, dstate), ``groups`` dividing ``heads``; any strides.
        D: (heads,) or (heads, headdim) skip, added as ``D * x``; optional.
        z: (batch, heads, headdim) gate, ``y * silu(z)``; optional (transformers' Mamba-2 gates in its norm instead).
        dt_bias: (heads,), added to ``dt`` before the softplus; optional.
        dt_softplus: apply softplus to the time step.

    Returns:
        (batch, heads, headdim) in ``x``'s dtype.
    """
    if ssm_state.dim() != 4:
        raise ValueError(f"ssm_state must be (batch, heads, headdim, dstate), got {tuple(ssm_state.shape)}")
    batch, heads, headdim, dstate = ssm_state.shape
    dev = ssm_state.device
    _check("x", x, (batch, heads, headdim), dev)
    _check("dt", dt, (batch, heads), dev)
    _check("A_log", A_log, (heads,), dev)
    if not isinstance(B, torch.Tensor) or B.dim() != 3 or B.shape[0] != batch or B.shape[2] != dstate \
            or B.shape[1] < 1 or heads % B.shape[1]:
        raise ValueError(f"B must be (batch={batch}, groups, dstate={dstate}) with groups dividing heads={heads}, "
                         f"got {tuple(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__}")
    _check("B", B, tuple(B.shape), dev)
    _check("C", C, tuple(B.shape), dev)
    if D is not None and isinstance(D, torch.Tensor) and D.dim() == 2:
        _check("D", D, (heads, headdim), dev)
    else:
        _check("D", D, (heads,), dev)
    _check("z", z, (batch, heads, headdim), dev)
    _check("dt_bias", dt_bias, (heads,), dev)
    args = (ssm_state, x, dt, A_log, B, C, D, z, dt_bias, bool(dt_softplus))
    if torch.compiler.is_compiling():
        return _mamba2_step_op(*args)
    return (_mamba2_step_cuda if ssm_state.is_cuda else mamba2_state_step_ref)(*args)   # eager: as above


def mamba_step(mixer, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
               bc_dt_norm=None) -> torch.Tensor:
    """One decoding step of a Mamba-1 mixer (``PackedMamba`` or anything with its parameter names: mamba-ssm's
    ``Mamba``, transformers' ``MambaMixer``): in_proj, :func:`causal_conv1d_step`, x_proj,
    :func:`selective_state_step` (dt_proj fused), out_proj. States updated in place.

    Args:
        mixer: the module holding ``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``.
        hidden_states: (batch, 1, d_model).
        conv_state: (batch, d_inner, d_conv); ssm_state: (batch, d_inner, d_state).
        bc_dt_norm: optional ``f(dt, B, C) -> (dt, B, C)`` applied to ``x_proj``'s output (FalconMamba's RMS norms).

    Returns:
        (batch, 1, d_model) in ``hidden_states``' dtype (or what ``out_proj`` gives under autocast).
    """
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        raise ValueError(f"hidden_states must be (batch, 1, d_model): a step decodes one token at a time, got "
                         f"{tuple(hidden_states.shape)}")
    dtype = hidden_states.dtype
    x, z = mixer.in_proj(hidden_states.squeeze(1)).chunk(2, dim=-1)   # (batch, d_inner) each
    conv_bias = mixer.conv1d.bias
    x = causal_conv1d_step(x.to(dtype), conv_state, mixer.conv1d.weight, conv_bias, "silu")
    dt_rank = mixer.dt_proj.weight.shape[1]
    d_state = ssm_state.shape[2]
    dt, B, C = torch.split(mixer.x_proj(x), [dt_rank, d_state, d_state], dim=-1)
    if bc_dt_norm is not None:
        dt, B, C = bc_dt_norm(dt, B, C)
    y = selective_state_step(ssm_state, x, dt, mixer.A_log, B, C, D=mixer.D, z=z, dt_bias=mixer.dt_proj.bias,
                             dt_proj_weight=mixer.dt_proj.weight, dt_softplus=True)
    return mixer.out_proj(y).unsqueeze(1)
