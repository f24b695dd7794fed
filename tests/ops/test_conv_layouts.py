"""ops.packed_causal_conv1d takes every layout and dtype mix that causal-conv1d accepts, and never hands a kernel a
layout it cannot take: x in fp32 / fp16 / bf16, weight and bias in fp32 or in x's dtype, channel-first, channel-last,
sliced views with padded strides, batch 1, odd dim and seqlen, widths 2-4, sequences shorter than the width, and any
strides of the incoming gradient.

The CPU tests check which layout reaches the kernel op (``kernel_layout``: the tensor itself, or a channel-first copy)
for every combination; the GPU test runs the whole matrix against float64 (outputs and every gradient).
"""
import itertools
import math
import random

import pytest
import torch

import ops
from ops.conv1d_interface import _is_dense_channel_last, kernel_layout

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make_x(layout: str, batch: int, dim: int, seqlen: int, dtype, device="cpu") -> torch.Tensor:
    """(batch, dim, seqlen) in one of the layouts a training loop hands the conv."""
    if layout == "channel-first":
        return torch.randn(batch, dim, seqlen, device=device).to(dtype)
    if layout == "channel-last":          # a transposed (batch, seqlen, dim) tensor, as Mamba-2 / HF pass it
        return torch.randn(batch, seqlen, dim, device=device).to(dtype).transpose(1, 2)
    if layout == "channel-last-padded":   # torch.randn(b, L, D + 64)[..., :D], transposed
        return torch.randn(batch, seqlen, dim + 64, device=device).to(dtype)[..., :dim].transpose(1, 2)
    if layout == "channel-first-padded":  # a slice of longer rows
        return torch.randn(batch, dim, seqlen + 64, device=device).to(dtype)[..., 3:seqlen + 3]
    if layout == "batch-strided":         # every other row of a larger batch
        return torch.randn(2 * batch, dim, seqlen, device=device).to(dtype)[::2]
    raise ValueError(layout)


LAYOUTS = ("channel-first", "channel-last", "channel-last-padded", "channel-first-padded", "batch-strided")


def lengths_row(seqlen: int, rng: random.Random):
    """1, 2, 3 (shorter than the conv), then lognormal lengths filling the row."""
    out, left = [], seqlen
    for n in (1, 2, 3):
        if n <= left:
            out.append(n)
            left -= n
    while left > 0:
        n = min(left, max(1, int(rng.lognormvariate(4.0, 1.0))))
        out.append(n)
        left -= n
    return out


def positions(rows, device):
    return torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows]).to(device)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch,dim,seqlen", [(1, 8, 13), (2, 7, 1), (3, 5, 64), (1, 1, 9)])
def test_kernel_layout_copies_only_what_the_kernels_cannot_take(layout, batch, dim, seqlen):
    x = make_x(layout, batch, dim, seqlen, torch.float32)
    k = kernel_layout(x)
    assert torch.equal(k, x)
    takes = x.is_contiguous() or _is_dense_channel_last(x)
    if takes:
        assert k.data_ptr() == x.data_ptr(), "a layout the kernels take must not be copied"
    else:
        assert k.is_contiguous(), "any other layout becomes channel-first contiguous"
    # what reaches the op is always one of its two layouts
    assert k.is_contiguous() or _is_dense_channel_last(k)
    # the dense layouts are taken as they are; padded rows are copied
    if layout in ("channel-first", "channel-last") and not (layout == "channel-last" and dim == 1):
        assert takes
    if layout == "channel-last-padded" and batch > 1:
        assert not takes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
def test_every_layout_matches_the_float64_result_on_cpu(layout, dtype, wdtype):
    # the reference path on the CPU: every layout and dtype mix gives the float64 result, in x's layout when dense
    rng = random.Random()
    batch, dim, seqlen, width = 2, 6, 40, 4
    x = make_x(layout, batch, dim, seqlen, dtype).requires_grad_()
    w = torch.randn(dim, width).to(wdtype).requires_grad_()
    b = torch.randn(dim).to(wdtype).requires_grad_()
    pos = positions([lengths_row(seqlen, rng) for _ in range(batch)], "cpu")
    y = ops.packed_causal_conv1d(x, w, b, "silu", position_ids=pos)
    g = torch.randn(batch, dim, seqlen)
    (y.float() * g).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = ops.causal_conv1d_ref(x64, w64, b64, "silu", position_ids=pos)
    (y64 * g.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 and wdtype == torch.float32 else 3e-2
    for name, got, want in (("out", y, y64), ("dx", x.grad, x64.grad), ("dweight", w.grad, w64.grad),
                            ("dbias", b.grad, b64.grad)):
        err = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
        assert err <= tol, f"{name}: relative error {err:.2e}"
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == wdtype and b.grad.dtype == wdtype


# --------------------------------------------------------------------------------------------------------------
# GPU: the whole matrix, the two cases that faulted included

MATRIX = list(itertools.product(
    DTYPES, ("same", "fp32"), LAYOUTS, ("channel-first", "channel-last"), (1, 2), ((256, 2048), (37, 333)),
    (2, 3, 4)))


@pytest.mark.gpu
def test_gpu_conv_layout_matrix():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (gpu marker); none on this machine")
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    bad = []
    for dtype, wkind, layout, glayout, batch, (dim, seqlen), width in MATRIX:
        wdtype = torch.float32 if wkind == "fp32" else dtype
        x = make_x(layout, batch, dim, seqlen, dtype, "cuda").requires_grad_()
        w = torch.randn(dim, width, device="cuda").to(wdtype).requires_grad_()
        b = torch.randn(dim, device="cuda").to(wdtype).requires_grad_()
        pos = positions([lengths_row(seqlen, rng) for _ in range(batch)], "cuda")
        y = ops.packed_causal_conv1d(x, w, b, "silu", position_ids=pos)
        g = (torch.randn(batch, dim, seqlen, device="cuda") if glayout == "channel-first"
             else torch.randn(batch, seqlen, dim, device="cuda").transpose(1, 2))
        dx, dw, db = torch.autograd.grad((y.float() * g.float()).sum(), (x, w, b))
        torch.cuda.synchronize()   # a fault surfaces here, naming the case below
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
        with ops.use_backend("reference"):
            y64 = ops.causal_conv1d_ref(x64, w64, b64, "silu", position_ids=pos)
        gx, gw, gb = torch.autograd.grad((y64 * g.double()).sum(), (x64, w64, b64))
        tol = 1e-5 if dtype == torch.float32 and wdtype == torch.float32 else 1e-2
        for name, got, want in (("out", y, y64), ("dx", dx, gx), ("dweight", dw, gw), ("dbias", db, gb)):
            err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            if not err <= tol or not math.isfinite(err):
                bad.append((dtype, wkind, layout, glayout, batch, dim, seqlen, width, name, f"{err:.2e}"))
    print(f"{len(MATRIX)} cases, {len(bad)} bad")
    assert not bad, bad[:10]
