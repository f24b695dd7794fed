"""PackedMamba: a drop-in for mamba_ssm.modules.mamba_simple.Mamba.

- parameter names, shapes, dtypes and initialisation as upstream's Mamba (the expected list below is
  written from mamba-ssm 2.3.2's mamba_ssm/modules/mamba_simple.py); a state_dict saved from an
  upstream-layout module loads unchanged, and without boundaries PackedMamba computes what upstream's
  forward computes (checked against a float64 re-implementation of upstream's slow path);
- packing-unpacking invariance in float64: outputs and every parameter gradient equal the sum over the
  sequences run alone, fused and non-fused paths (the kernel ops on their CPU reference), all three boundary
  forms;
- generation (inference_params / step) equals the full forward.
"""
from __future__ import annotations

import io
import math
import random
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ops
from ops import PackedMamba

from .._helpers import Mamba as MirrorMamba
from .._helpers import assert_packing_invariant, mixed_rows, out_and_grads, positions

F64 = torch.float64


def expected_parameters(d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", bias=False, conv_bias=True):
    """(name, shape) in state_dict order, as mamba-ssm's Mamba registers them: A_log and D are the
    module's own parameters (listed first), then in_proj, conv1d, x_proj, dt_proj, out_proj."""
    d_inner = expand * d_model
    r = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
    out = [("A_log", (d_inner, d_state)), ("D", (d_inner,)), ("in_proj.weight", (2 * d_inner, d_model))]
    if bias:
        out.append(("in_proj.bias", (2 * d_inner,)))
    out.append(("conv1d.weight", (d_inner, 1, d_conv)))
    if conv_bias:
        out.append(("conv1d.bias", (d_inner,)))
    out += [("x_proj.weight", (r + 2 * d_state, d_inner)), ("dt_proj.weight", (d_inner, r)),
            ("dt_proj.bias", (d_inner,)), ("out_proj.weight", (d_model, d_inner))]
    if bias:
        out.append(("out_proj.bias", (d_model,)))
    return out


class UpstreamLayoutMamba(nn.Module):
    """The module layout of mamba-ssm's Mamba (same attributes, submodules and parameter order),
    with upstream's slow-path forward (nn.Conv1d truncated to seqlen, then the selective scan)
    re-implemented here in plain float64 PyTorch with a per-timestep loop. Written for this test."""

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", bias=False, conv_bias=True,
                 dtype=None):
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        self.use_fast_path, self.layer_idx = True, None
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias, dtype=dtype)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1,
                                bias=conv_bias, dtype=dtype)
        self.activation = "silu"
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, dtype=dtype)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, dtype=dtype)
        self.A_log = nn.Parameter(torch.log(torch.rand(self.d_inner, d_state) * 3 + 0.5))
        self.D = nn.Parameter(torch.randn(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, dtype=dtype)

    def forward(self, hidden_states):
        batch, seqlen, _ = hidden_states.shape
        xz = self.in_proj(hidden_states).transpose(1, 2)
        x, z = xz.chunk(2, dim=1)
        x = self.act(self.conv1d(x)[..., :seqlen])
        x_dbl = self.x_proj(x.transpose(1, 2))  # (b, l, r + 2n)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(dt @ self.dt_proj.weight.t() + self.dt_proj.bias)  # (b, l, d_inner)
        A = -torch.exp(self.A_log)
        h = torch.zeros(batch, self.d_inner, self.d_state, dtype=hidden_states.dtype)
        ys = []
        for t in range(seqlen):
            h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, :, t])[..., None] * B[:, t, None, :]
            ys.append((h * C[:, t, None, :]).sum(-1) + self.D * x[:, :, t])
        y = torch.stack(ys, 1) * F.silu(z.transpose(1, 2))
        return self.out_proj(y)


CONFIGS = [
    dict(d_model=16),
    dict(d_model=40, d_state=8, d_conv=3, expand=1, bias=True),
    dict(d_model=12, d_state=4, d_conv=2, dt_rank=5, conv_bias=False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_parameters_are_upstream_mambas(cfg):
    layer = PackedMamba(**cfg)
    got = [(n, tuple(p.shape)) for n, p in layer.state_dict().items()]
    assert got == expected_parameters(**cfg)
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in got]
    up = UpstreamLayoutMamba(**cfg)
    assert list(up.state_dict()) == list(layer.state_dict())
    for attr in ("d_model", "d_state", "d_conv", "expand", "d_inner", "dt_rank", "use_fast_path", "layer_idx",
                 "activation"):
        assert getattr(layer, attr) == getattr(up, attr), attr
    assert isinstance(layer.conv1d, nn.Conv1d) and layer.conv1d.groups == layer.d_inner
    assert layer.conv1d.padding == (layer.d_conv - 1,)


def test_dtype_and_device_factory_kwargs():
    layer = PackedMamba(16, dtype=torch.bfloat16, device="cpu")
    for name, p in layer.named_parameters():
        want = torch.float32 if name in ("A_log", "D") else torch.bfloat16  # upstream keeps A_log, D fp32
        assert p.dtype == want, name


def test_initialisation_follows_upstream(seed):
    layer = PackedMamba(32, d_state=6, dt_min=0.01, dt_max=0.05, dt_scale=2.0)
    torch.testing.assert_close(layer.A_log, torch.log(torch.arange(1, 7.0)).expand(64, 6))
    assert torch.equal(layer.D, torch.ones(64))
    dt = F.softplus(layer.dt_proj.bias)
    assert dt.min() >= 0.01 * (1 - 1e-5) and dt.max() <= 0.05 * (1 + 1e-5)
    assert dt.std() > 0  # random, log-uniform
    bound = layer.dt_rank ** -0.5 * 2.0
    assert layer.dt_proj.weight.abs().max() <= bound and layer.dt_proj.weight.abs().max() > bound / 2
    assert layer.A_log._no_weight_decay and layer.D._no_weight_decay and layer.dt_proj.bias._no_reinit
    const = PackedMamba(32, dt_init="constant")
    assert torch.all(const.dt_proj.weight == const.dt_rank ** -0.5)
    floor = PackedMamba(8, dt_min=1e-6, dt_max=1e-5, dt_init_floor=1e-3)
    torch.testing.assert_close(F.softplus(floor.dt_proj.bias), torch.full((16,), 1e-3))
    with pytest.raises(NotImplementedError, match="dt_init"):
        PackedMamba(8, dt_init="xavier")


def test_upstream_checkpoint_loads_and_computes_the_same(seed):
    """A state_dict saved (torch.save) from an upstream-layout Mamba loads unchanged (strict) and,
    without boundaries, PackedMamba's output and gradients equal upstream's forward, both paths."""
    cfg = dict(d_model=8, d_state=4, d_conv=4, expand=2, bias=True)
    up = UpstreamLayoutMamba(**cfg, dtype=F64).double()
    buf = io.BytesIO()
    torch.save(up.state_dict(), buf)
    buf.seek(0)
    layer = PackedMamba(**cfg).double()
    layer.load_state_dict(torch.load(buf), strict=True)
    h = torch.randn(2, 9, 8, dtype=F64)
    up_params = list(up.parameters())
    want, wgh, wgp, dout = out_and_grads(lambda x: up(x), h, up_params)
    for fast in (True, False):
        layer.use_fast_path = fast
        got, gh, gp, _ = out_and_grads(lambda x: layer(x), h, list(layer.parameters()), dout)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(gh, wgh, rtol=1e-9, atol=1e-11)
        for (name, _), a, b in zip(layer.named_parameters(), gp, wgp):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"grad of {name}: {m}")
    # and back: PackedMamba's state_dict loads into the upstream layout
    up2 = UpstreamLayoutMamba(**cfg, dtype=F64).double()
    up2.load_state_dict(layer.state_dict(), strict=True)


def test_mirror_models_state_dict_loads(seed):
    """The tiny MambaLMHeadModel mirror's Mamba mixer state_dict loads into PackedMamba unchanged."""
    mirror = MirrorMamba(16, d_state=4)
    layer = PackedMamba(16, d_state=4)
    layer.load_state_dict(mirror.state_dict(), strict=True)
    for (n1, p1), (n2, p2) in zip(layer.state_dict().items(), mirror.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("path", ["fused", "nonfused"])
@pytest.mark.parametrize("form", ["position_ids", "seq_idx", "cu_seqlens"])
def test_packing_invariance(seed, path, form):
    rng = random.Random(seed)
    layer = PackedMamba(8, d_state=4, bias=rng.random() < 0.5, conv_bias=rng.random() < 0.5).double()
    with torch.no_grad():  # away from the init values so every parameter matters
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    layer.use_fast_path = path == "fused"
    rows = mixed_rows(rng, 4, rng.choice([10, 17]))
    print("rows", rows)
    h = torch.randn(4, sum(rows[0]), 8, dtype=F64)
    names = [n for n, _ in layer.named_parameters()]
    assert_packing_invariant(lambda x, **b: layer(x, **b), h, list(layer.parameters()), rows, form, names=names)


def test_fused_and_nonfused_paths_agree(seed):
    layer = PackedMamba(8, d_state=4, bias=True).double()
    h = torch.randn(3, 12, 8, dtype=F64)
    pos = positions(mixed_rows(random.Random(seed), 3, 12))
    params = list(layer.parameters())
    layer.use_fast_path = True
    o1, gh1, gp1, dout = out_and_grads(lambda x: layer(x, position_ids=pos), h, params)
    layer.use_fast_path = False
    o2, gh2, gp2, _ = out_and_grads(lambda x: layer(x, position_ids=pos), h, params, dout)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh1, gh2, rtol=1e-10, atol=1e-12)
    for a, b in zip(gp1, gp2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_forward_without_boundaries_is_one_sequence_per_row(seed):
    layer = PackedMamba(8, d_state=4).double()
    h = torch.randn(2, 7, 8, dtype=F64)
    for fast in (True, False):
        layer.use_fast_path = fast
        plain = layer(h)
        torch.testing.assert_close(plain, layer(h, position_ids=torch.arange(7).expand(2, 7)), rtol=0, atol=0)
        torch.testing.assert_close(plain, layer(h, seq_idx=torch.zeros(2, 7, dtype=torch.int32)), rtol=0, atol=0)
        split = layer(h, position_ids=positions([[3, 4], [7]]))
        assert (split[0, 3:] - plain[0, 3:]).abs().max() > 1e-6


def test_generation_matches_the_full_forward(seed):
    """Prompt through inference_params (seqlen_offset 0), then one token at a time with step()."""
    layer = PackedMamba(8, d_state=4, layer_idx=0).double()
    h = torch.randn(2, 9, 8, dtype=F64)
    full = layer(h)
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    outs = [layer(h[:, :5], inference_params=params)]
    for t in range(5, 9):
        params.seqlen_offset = t
        outs.append(layer(h[:, t:t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-11)
    conv_state, ssm_state = params.key_value_memory_dict[0]
    assert conv_state.shape == (2, 16, 4) and ssm_state.shape == (2, 16, 4)
    # upstream's positional form forward(hidden_states, inference_params) works too
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    torch.testing.assert_close(layer(h[:, :5], params), full[:, :5], rtol=1e-9, atol=1e-11)
    assert 0 in params.key_value_memory_dict
    # a prompt shorter than the conv width
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    outs = [layer(h[:, :2], inference_params=params)]
    for t in range(2, 9):
        params.seqlen_offset = t
        outs.append(layer(h[:, t:t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-11)


def test_errors():
    layer = PackedMamba(8, d_state=4)
    h = torch.randn(1, 4, 8)
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    with pytest.raises(ValueError, match="inference_params .* cannot be combined with packed boundaries"):
        layer(h, position_ids=torch.tensor([[0, 1, 0, 1]]), inference_params=params)
    with pytest.raises(ValueError, match="layer_idx must be set"):
        layer(h, inference_params=params)
    with pytest.raises(ValueError, match="one token at a time"):
        layer.step(h, torch.zeros(1, 16, 4), torch.zeros(1, 16, 4))
    with pytest.raises(ops.BoundaryError, match=r"position_ids\[0, 3\] = 3 after 0"):
        layer(h, position_ids=torch.tensor([[0, 1, 0, 3]]))
    with pytest.raises(ops.BoundaryError, match=r"boundaries have shape \(1, 3\)"):
        layer(h, seq_idx=torch.zeros(1, 3, dtype=torch.long))
    layer.validate_boundaries = False  # the caller vouches for the ids: no check, no error
    layer(h, position_ids=torch.tensor([[0, 1, 0, 3]]))


def test_from_mamba_shares_parameters():
    mirror = MirrorMamba(8, d_state=4, layer_idx=3)
    layer = PackedMamba.from_mamba(mirror)
    assert layer.layer_idx == 3 and layer.d_inner == 16
    for (n1, p1), (n2, p2) in zip(layer.named_parameters(), mirror.named_parameters()):
        assert n1 == n2 and p1 is p2
    mirror.activation = "gelu"
    with pytest.raises(ValueError, match="silu activation only, got 'gelu'"):
        PackedMamba.from_mamba(mirror)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_module_on_cpu(seed, dtype):
    ref = PackedMamba(8, d_state=4).double()
    layer = PackedMamba(8, d_state=4, dtype=dtype)
    layer.load_state_dict(ref.state_dict())
    h = torch.randn(2, 10, 8, dtype=F64)
    pos = positions([[4, 6], [1, 9]])
    want = ref(h, position_ids=pos)
    for fast in (True, False):
        layer.use_fast_path = fast
        got = layer(h.to(dtype), position_ids=pos)
        assert got.dtype == dtype
        assert ((got.double() - want).norm() / want.norm()).item() <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_packed_mamba_under_cpu_autocast_matches_float32():
    # CPU autocast (Trainer's bf16=True on a CPU, TRL's default) casts the fused mixer's matmuls to bf16 like CUDA
    # autocast does: the result is within bf16 rounding of float32, and every parameter gets a float32 gradient
    import ops

    torch.manual_seed(torch.seed() % 2**31)
    m = ops.PackedMamba(d_model=32)
    h = torch.randn(2, 24, 32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4]] * 2)
    ref = m(h, position_ids=pos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(h, position_ids=pos)
    assert y.dtype == torch.bfloat16
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
    y.float().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), name
