"""ops.decode: the single-token state updates (causal_conv1d_step, selective_state_step, mamba2_state_step),
PackedMamba.step and transformers' Mamba-2 step (ops.hf.mamba2_step).

CPU: the reference equals the torch step PackedMamba ran before (mamba-ssm's Mamba.step math) bit for bit, in
float64 and float32; the custom ops pass torch.library.opcheck (schema, fake impl, mutation); decoding step by step
equals a full forward; the ops trace under torch.compile(fullgraph=True); bad arguments are named.
GPU (gpu marker): the Triton kernels against the float64 reference (fp32 to 1e-5, bf16 / fp16 to their rounding),
CUDA-graph capture and replay equal eager, torch.compile(mode="reduce-overhead"), mamba-ssm's generate(cg=True) on a
converted model gives the unconverted model's tokens.
"""
from __future__ import annotations

import copy
import importlib.util
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import ops
from ops import PackedMamba
from ops import decode as dec
from ops.decode import causal_conv1d_step, mamba2_state_step, selective_state_step

F64 = torch.float64


def _previous_step(layer, hidden_states, conv_state, ssm_state):
    """PackedMamba.step as it was before ops.decode (the torch math of mamba-ssm's Mamba.step without kernels)."""
    dtype = hidden_states.dtype
    x, z = layer.in_proj(hidden_states.squeeze(1)).chunk(2, dim=-1)
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    x = (conv_state * layer.conv1d.weight[:, 0]).sum(-1)
    if layer.conv1d.bias is not None:
        x = x + layer.conv1d.bias
    x = F.silu(x).to(dtype)
    dt, B, C = torch.split(layer.x_proj(x), [layer.dt_rank, layer.d_state, layer.d_state], dim=-1)
    dt = F.softplus(F.linear(dt, layer.dt_proj.weight) + layer.dt_proj.bias.to(dt.dtype))
    A = -torch.exp(layer.A_log if layer.A_log.dtype == F64 else layer.A_log.float())
    dA = torch.exp(dt.unsqueeze(-1) * A)
    dB = dt.unsqueeze(-1) * B.unsqueeze(1)
    ssm_state.copy_(ssm_state * dA + x.unsqueeze(-1) * dB)
    y = (ssm_state.to(dtype) * C.unsqueeze(1)).sum(-1) + layer.D.to(dtype) * x
    y = y * F.silu(z)
    return layer.out_proj(y).unsqueeze(1)


def _layer(dtype=F64, d_model=16, d_state=8, d_conv=4, conv_bias=True, bias=False, device="cpu", layer_idx=0):
    layer = PackedMamba(d_model, d_state=d_state, d_conv=d_conv, conv_bias=conv_bias, bias=bias, layer_idx=layer_idx,
                        device=device)
    layer = layer.to(dtype)
    with torch.no_grad():   # move A_log / D / biases off their init so each matters
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.eval()


def _random_states(layer, batch, dtype, device="cpu"):
    conv = torch.randn(batch, layer.d_inner, layer.d_conv, dtype=dtype, device=device)
    ssm = torch.randn(batch, layer.d_inner, layer.d_state, dtype=dtype, device=device)
    return conv, ssm


# --------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("conv_bias,bias,d_conv", [(True, False, 4), (False, True, 3), (True, True, 2)])
def test_step_equals_the_previous_torch_step(seed, dtype, conv_bias, bias, d_conv):
    layer = _layer(dtype, d_state=5, d_conv=d_conv, conv_bias=conv_bias, bias=bias)
    conv, ssm = _random_states(layer, 3, dtype)
    conv_prev, ssm_prev = conv.clone(), ssm.clone()
    with torch.no_grad():
        for _ in range(3):   # several steps from random states: the states feed back
            h = torch.randn(3, 1, layer.d_model, dtype=dtype)
            out, c_ret, s_ret = layer.step(h, conv, ssm)
            expected = _previous_step(layer, h, conv_prev, ssm_prev)
            assert c_ret is conv and s_ret is ssm   # in place, the same tensors returned
            assert torch.equal(out, expected)
            assert torch.equal(conv, conv_prev) and torch.equal(ssm, ssm_prev)
    assert out.dtype == dtype and out.shape == (3, 1, layer.d_model)


def test_low_precision_states_match_the_previous_step(seed):
    """A bfloat16 module with bfloat16 states (mamba-ssm's generate allocates them in the model dtype)."""
    layer = _layer(torch.float32).to(torch.bfloat16)
    layer.A_log.data, layer.D.data = layer.A_log.data.float(), layer.D.data.float()
    conv, ssm = _random_states(layer, 2, torch.bfloat16)
    conv_prev, ssm_prev = conv.clone(), ssm.clone()
    h = torch.randn(2, 1, layer.d_model, dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer.step(h, conv, ssm)[0]
        expected = _previous_step(layer, h, conv_prev, ssm_prev)
    assert torch.equal(out, expected) and torch.equal(conv, conv_prev) and torch.equal(ssm, ssm_prev)


def test_ops_with_and_without_optional_arguments_against_float64_math(seed):
    """The two ops on their own: conv window and scan step written out as sums, every optional argument absent."""
    b, d, n, w = 2, 6, 3, 4
    x = torch.randn(b, d, dtype=F64)
    state = torch.randn(b, d, w, dtype=F64)
    weight = torch.randn(d, w, dtype=F64)
    window = torch.cat([state[:, :, 1:], x[:, :, None]], dim=-1)
    out = causal_conv1d_step(x, state, weight, None, activation=None)
    torch.testing.assert_close(out, (window * weight).sum(-1), rtol=1e-12, atol=1e-12)
    assert torch.equal(state, window)
    h = torch.randn(b, d, n, dtype=F64)
    dt, A_log, B, C = torch.rand(b, d, dtype=F64), torch.randn(d, n, dtype=F64), torch.randn(b, n, dtype=F64), \
        torch.randn(b, n, dtype=F64)
    expected_h = h * torch.exp(-dt[:, :, None] * torch.exp(A_log)) + dt[:, :, None] * B[:, None, :] * x[:, :, None]
    y = selective_state_step(h, x, dt, A_log, B, C, dt_softplus=False)
    torch.testing.assert_close(h, expected_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, (expected_h * C[:, None, :]).sum(-1), rtol=1e-12, atol=1e-12)


def _op_samples(dtype=F64, device="cpu", strided=False):
    b, d, n, w, r = 3, 8, 4, 4, 3
    g = dict(dtype=dtype, device=device)
    conv_state = torch.randn(b, d, w, **g)
    ssm_state = torch.randn(b, d, n, **g)
    if strided:   # channel-last states: any strides are taken
        conv_state = torch.randn(b, w, d, **g).transpose(1, 2)
        ssm_state = torch.randn(b, n, d, **g).transpose(1, 2)
    xdbl = torch.randn(b, r + 2 * n, **g)
    dt, B, C = torch.split(xdbl, [r, n, n], dim=-1)   # strided slices, as x_proj's output gives them
    f32 = dict(dtype=F64 if dtype == F64 else torch.float32, device=device)
    conv = [(torch.randn(b, d, **g), conv_state, torch.randn(d, w, **g), torch.randn(d, **g), True),
            (torch.randn(b, d, **g), conv_state.clone(), torch.randn(d, w, **g), None, False)]
    state = [(ssm_state, torch.randn(b, d, **g), dt, torch.randn(d, n, **f32), B, C, torch.randn(d, **f32),
              torch.randn(b, d, **g), torch.randn(d, **g), 0.3 * torch.randn(d, r, **g), True),
             (ssm_state.clone(), torch.randn(b, d, **g), torch.randn(b, d, **g), torch.randn(d, n, **f32), B, C,
              None, None, None, None, False)]
    return conv, state


def _mamba2_samples(dtype=F64, device="cpu", strided=False):
    """(ssm_state, x, dt, A_log, B, C, D, z, dt_bias, dt_softplus) argument lists: 2 groups of 2 heads of 3 channels,
    B / C / x strided views of one projection (as a conv output gives them), D per head or per channel."""
    b, heads, hd, n, groups = 3, 4, 3, 5, 2
    g = dict(dtype=dtype, device=device)
    f32 = dict(dtype=F64 if dtype == F64 else torch.float32, device=device)
    state = (torch.randn(b, heads, n, hd, **g).transpose(2, 3) if strided else torch.randn(b, heads, hd, n, **g))
    xbc = torch.randn(b, heads * hd + 2 * groups * n, **g)
    x = xbc[:, :heads * hd].view(b, heads, hd)
    B = xbc[:, heads * hd:heads * hd + groups * n].view(b, groups, n)
    C = xbc[:, heads * hd + groups * n:].view(b, groups, n)
    dt = torch.randn(b, heads + 1, **g)[:, 1:]
    return [(state, x, dt, torch.randn(heads, **f32), B, C, torch.randn(heads, **f32), torch.randn(b, heads, hd, **g),
             torch.randn(heads, **g), True),
            (state.clone(), x, dt, torch.randn(heads, **f32), B, C, torch.randn(heads, hd, **f32), None, None, False),
            (state.clone(), x, dt, torch.randn(heads, **f32), B[:, :1], C[:, :1], None, None, None, True)]


def test_mamba2_step_against_float64_math(seed):
    """Mamba-2's step written out per head and channel (group of each head, scalar dt and A per head), with and
    without D (per head, per channel), z, dt_bias and the softplus, one group or two."""
    for ssm_state, x, dt, A_log, B, C, D, z, dt_bias, softplus in _mamba2_samples():
        h0 = ssm_state.clone()
        y = mamba2_state_step(ssm_state, x, dt, A_log, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus)
        b, heads, hd, n = h0.shape
        per_group = heads // B.shape[1]
        for r in range(b):
            for hh in range(heads):
                step = dt[r, hh] + (dt_bias[hh] if dt_bias is not None else 0.0)
                step = F.softplus(step) if softplus else step
                decay = torch.exp(-step * torch.exp(A_log[hh]))
                grp = hh // per_group
                for p in range(hd):
                    h = h0[r, hh, p] * decay + step * x[r, hh, p] * B[r, grp]
                    torch.testing.assert_close(ssm_state[r, hh, p], h, rtol=1e-12, atol=1e-12)
                    out = (h * C[r, grp]).sum()
                    if D is not None:
                        out = out + x[r, hh, p] * (D[hh] if D.dim() == 1 else D[hh, p])
                    if z is not None:
                        out = out * F.silu(z[r, hh, p])
                    torch.testing.assert_close(y[r, hh, p], out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strided", [False, True])
def test_mamba2_opcheck_and_fake(seed, strided):
    from torch._subclasses.fake_tensor import FakeTensorMode

    for args in _mamba2_samples(strided=strided):
        torch.library.opcheck(torch.ops.packloader.mamba2_state_step.default, args)
    args = _mamba2_samples()[0]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = torch.ops.packloader.mamba2_state_step(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                                       for t in args])
    assert out.shape == args[1].shape and out.dtype == args[1].dtype


def test_mamba2_bad_arguments_are_named():
    state, x, dt, A_log, B, C, D, z, dt_bias, _ = _mamba2_samples(dtype=torch.float32)[0]
    with pytest.raises(ValueError, match=r"ssm_state must be \(batch, heads, headdim, dstate\)"):
        mamba2_state_step(state[0], x, dt, A_log, B, C)
    with pytest.raises(ValueError, match=r"x must have shape \(3, 4, 3\)"):
        mamba2_state_step(state, x[:, :2], dt, A_log, B, C)
    with pytest.raises(ValueError, match=r"dt must have shape \(3, 4\)"):
        mamba2_state_step(state, x, dt[:, :3], A_log, B, C)
    with pytest.raises(ValueError, match=r"B must be \(batch=3, groups, dstate=5\) with groups dividing heads=4"):
        mamba2_state_step(state, x, dt, A_log, torch.randn(3, 3, 5), C)
    with pytest.raises(ValueError, match=r"C must have shape \(3, 2, 5\)"):
        mamba2_state_step(state, x, dt, A_log, B, C[:, :1])
    with pytest.raises(ValueError, match=r"D must have shape \(4,\)"):
        mamba2_state_step(state, x, dt, A_log, B, C, D=torch.randn(5))
    with pytest.raises(ValueError, match=r"dt_bias must have shape \(4,\)"):
        mamba2_state_step(state, x, dt, A_log, B, C, dt_bias=torch.randn(2))


@pytest.mark.parametrize("strided", [False, True])
def test_opcheck(seed, strided):
    conv, state = _op_samples(strided=strided)
    for args in conv:
        torch.library.opcheck(torch.ops.packloader.causal_conv1d_step.default, args)
    for args in state:
        torch.library.opcheck(torch.ops.packloader.selective_state_step.default, args)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    conv, state = _op_samples()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        c = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in conv[0]]
        s = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in state[0]]
        out_c = torch.ops.packloader.causal_conv1d_step(*c)
        out_s = torch.ops.packloader.selective_state_step(*s)
    assert out_c.shape == conv[0][0].shape and out_c.dtype == conv[0][0].dtype and out_c.is_contiguous()
    assert out_s.shape == state[0][1].shape and out_s.dtype == state[0][1].dtype


def test_compiled_step_traces_without_graph_breaks(seed):
    """The step under torch.compile(fullgraph=True) (aot_eager: tracing and functionalization, no compiler run):
    the same outputs and in-place state updates as eager, three steps in a row."""
    layer = _layer(torch.float32)
    conv, ssm = _random_states(layer, 2, torch.float32)
    conv_e, ssm_e = conv.clone(), ssm.clone()
    compiled = torch.compile(lambda h, c, s: layer.step(h, c, s)[0], backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        for _ in range(3):
            h = torch.randn(2, 1, layer.d_model)
            got = compiled(h, conv, ssm)
            expected = layer.step(h, conv_e, ssm_e)[0]
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(conv, conv_e, rtol=0, atol=0)
            torch.testing.assert_close(ssm, ssm_e, rtol=1e-6, atol=1e-6)


def test_compiled_mamba2_step_traces_without_graph_breaks(seed):
    """mamba2_state_step under torch.compile(fullgraph=True) (aot_eager): eager's outputs and in-place states."""
    state, x, dt, A_log, B, C, D, z, dt_bias, _ = _mamba2_samples(dtype=torch.float32)[0]
    state_e = state.clone()
    fn = lambda s, xx: mamba2_state_step(s, xx, dt, A_log, B, C, D=D, z=z, dt_bias=dt_bias)   # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        xx = torch.randn_like(x)
        torch.testing.assert_close(compiled(state, xx), fn(state_e, xx), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state, state_e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch,prompt", [(1, 1), (3, 5), (2, 9)])
def test_decoding_step_by_step_equals_the_full_forward(seed, batch, prompt):
    """Prefill ``prompt`` tokens through inference_params, then one token at a time: float32 outputs equal the
    outputs of one forward over the whole sequence (prompts shorter and longer than the conv width)."""
    layer = _layer(torch.float32, d_model=24, d_state=16)
    L = prompt + 6
    h = torch.randn(batch, L, layer.d_model)
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    with torch.no_grad():
        full = layer(h)
        outs = [layer(h[:, :prompt], inference_params=params)]
        for t in range(prompt, L):
            params.seqlen_offset = t
            outs.append(layer(h[:, t:t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_converted_lm_decodes_as_its_full_forward(seed):
    """A converted (mirror) MambaLMHeadModel decoded the way mamba-ssm's generate() drives it."""
    from tests.ops._helpers import MambaLMHeadModel

    model = MambaLMHeadModel(d_model=16, n_layer=3, vocab_size=40).eval()
    ops.enable_packing(model)
    ids = torch.randint(0, 40, (2, 10))
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    with torch.no_grad():
        full = model(ids).logits
        got = [model(ids[:, :4], inference_params=params, num_last_tokens=1).logits]
        for t in range(4, 10):
            params.seqlen_offset = t
            got.append(model(ids[:, t:t + 1], position_ids=torch.full((2, 1), t), inference_params=params,
                             num_last_tokens=1).logits)
    torch.testing.assert_close(torch.cat(got, 1), full[:, 3:], rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
    conv, state = _op_samples(dtype=torch.float32)
    x, conv_state, w, bias, _ = conv[0]
    with pytest.raises(ValueError, match=r"weight must have shape \(8, 4\)"):
        causal_conv1d_step(x, conv_state, w[:, :3], bias)
    with pytest.raises(ValueError, match=r"x must have shape \(3, 8\)"):
        causal_conv1d_step(x[:2], conv_state, w, bias)
    with pytest.raises(ValueError, match="activation must be"):
        causal_conv1d_step(x, conv_state, w, bias, activation="relu")
    with pytest.raises(ValueError, match=r"conv_state must be \(batch, dim, width\)"):
        causal_conv1d_step(x, conv_state[0], w, bias)
    ssm_state, xs, dt, A_log, B, C, D, z, dt_bias, dtw, _ = state[0]
    with pytest.raises(ValueError, match=r"B must have shape \(3, 4\)"):
        selective_state_step(ssm_state, xs, dt, A_log, B[:, :2], C, D=D, z=z, dt_bias=dt_bias, dt_proj_weight=dtw)
    with pytest.raises(ValueError, match=r"dt must have shape \(3, 8\)"):
        selective_state_step(ssm_state, xs, dt, A_log, B, C)   # low-rank dt without dt_proj_weight
    with pytest.raises(ValueError, match=r"dt_proj_weight must be \(dim=8, rank\)"):
        selective_state_step(ssm_state, xs, dt, A_log, B, C, dt_proj_weight=dtw.T)
    with pytest.raises(TypeError, match="z must be a float tensor"):
        selective_state_step(ssm_state, xs, dt, A_log, B, C, z=torch.ones(3, 8, dtype=torch.long), dt_proj_weight=dtw)
    layer = _layer(torch.float32)
    with pytest.raises(ValueError, match="one token at a time"):
        layer.step(torch.randn(1, 2, layer.d_model), *_random_states(layer, 1, torch.float32))


_INTERPRETER_CHECK = r"""
import sys, torch
from ops import decode as dec
assert dec.HAS_TRITON
torch.manual_seed(0)
F64 = torch.float64
worst = 0.0
LAUNCHES = [None, dec.StateLaunch(True, True, 16, 4), dec.StateLaunch(True, False, 64, 4),
            dec.StateLaunch(False, False, 64, 2), dec.StateLaunch(False, True, 32, 2)]
for b, d, n, w, r, bias, proj, strided in [(2, 40, 16, 4, 5, True, True, False), (3, 70, 4, 3, 40, False, True, True),
                                           (1, 33, 7, 2, 3, True, False, False), (9, 40, 16, 4, 50, True, True, False),
                                           (5, 33, 16, 4, 20, True, True, True), (2, 24, 64, 4, 40, True, True, False)]:
    x = torch.randn(b, d)
    cs = torch.randn(b, w, d).transpose(1, 2) if strided else torch.randn(b, d, w)
    W, bb = torch.randn(d, w), (torch.randn(d) if bias else None)
    cs_k, cs_r = cs.clone(), cs.double()
    out = dec._conv_step_triton(x, cs_k, W, bb, True, torch.empty(b, d))
    ref = dec.causal_conv1d_step_ref(x.double(), cs_r, W.double(), None if bb is None else bb.double(), True)
    assert torch.equal(cs_k.double(), cs_r)
    worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
    dt, B, C = torch.split(torch.randn(b, r + 2 * n), [r, n, n], dim=-1)
    dt = dt if proj else torch.randn(b, d)
    Wd = 0.3 * torch.randn(d, r) if proj else None
    args = [dt, torch.randn(d, n), B, C, torch.randn(d), torch.randn(b, d), 0.5 * torch.randn(d), Wd, True]
    h = torch.randn(b, n, d).transpose(1, 2) if strided else torch.randn(b, d, n)
    h_r = h.double()
    y_r = dec.selective_state_step_ref(h_r, x.double(), *[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    for launch in LAUNCHES:   # fused dt projection or one matmul, loads first or not, tiles of 64 channels
        h_k = h.clone()
        y = dec._state_step_triton(h_k, x, *args, torch.empty(b, d), launch=launch)
        worst = max(worst, ((y.double() - y_r).abs().max() / y_r.abs().max()).item(),
                    ((h_k.double() - h_r).abs().max() / h_r.abs().max()).item())
for b, heads, hd, n, groups, dshape, gated, strided, bias in [
        (2, 4, 8, 16, 2, "h", False, False, True), (3, 6, 5, 7, 3, "hp", True, True, False),
        (1, 2, 64, 128, 1, None, False, False, True), (2, 8, 16, 256, 4, "h", True, True, True),
        (2, 4, 50, 128, 2, "hp", True, False, True)]:   # 7 blocks of 8 channels, the last partial
    h = torch.randn(b, heads, n, hd).transpose(2, 3) if strided else torch.randn(b, heads, hd, n)
    xbc = torch.randn(b, heads * hd + 2 * groups * n)
    x = xbc[:, :heads * hd].view(b, heads, hd)
    B = xbc[:, heads * hd:heads * hd + groups * n].view(b, groups, n)
    C = xbc[:, heads * hd + groups * n:].view(b, groups, n)
    D = None if dshape is None else (torch.randn(heads) if dshape == "h" else torch.randn(heads, hd))
    args = [torch.randn(b, heads + 3)[:, 1:heads + 1], torch.randn(heads), B, C, D,
            torch.randn(b, heads, hd) if gated else None, torch.randn(heads) if bias else None, True]
    h_r = h.double()
    y_r = dec.mamba2_state_step_ref(h_r, x.double(), *[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    h_k = h.clone()
    y = dec._mamba2_state_step_triton(h_k, x, *args, torch.empty(b, heads, hd))
    worst = max(worst, ((y.double() - y_r).abs().max() / y_r.abs().max()).item(),
                ((h_k.double() - h_r).abs().max() / h_r.abs().max()).item())
print("worst", worst)
"""


def test_triton_kernels_in_the_interpreter():
    """The Triton kernels' logic (shift, dt projection fused or by one matmul, loads before or after it, channel
    tails, strided states, every launch the shapes choose from; Mamba-2's heads, groups, d_state up to 256) on the CPU through Triton's interpreter, against the float64 reference; where Triton is installed."""
    import os
    import pathlib
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    res = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("worst")[-1])
    assert worst < 1e-5, worst


# --------------------------------------------------------------------------------------------------
# GPU


def _kernel_and_reference(op, args):
    """(the op's output on copies of ``args``, its float64 reference output, the two argument lists): the kernel, and
    float64 copies under ``use_backend("reference")`` (float64 on CUDA: the reference)."""
    ref_args = [a.double().clone() if isinstance(a, torch.Tensor) else a for a in args]
    kern_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = op(*kern_args)
    with ops.use_backend("reference"):
        expected = op(*ref_args)
    return out, expected, kern_args, ref_args


def _kernel_vs_reference(dtype, strided, cuda):
    conv, state = _op_samples(dtype, cuda, strided)
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    for args in conv:
        out, expected, kern_args, ref_args = _kernel_and_reference(torch.ops.packloader.causal_conv1d_step, args)
        torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol)
        torch.testing.assert_close(kern_args[1].double(), ref_args[1], rtol=0, atol=0)   # the shift is exact
    for args in state:
        out, expected, kern_args, ref_args = _kernel_and_reference(torch.ops.packloader.selective_state_step, args)
        # beyond the dtype's range (a float16 sample can reach it) the kernel's output is an infinity of the sign
        big = expected.abs() > torch.finfo(dtype).max
        assert torch.equal(out.double()[big], expected[big].sign() * float("inf"))
        scale = expected[~big].abs().max().item()
        torch.testing.assert_close(out.double()[~big], expected[~big], rtol=rtol, atol=rtol * scale)
        # the state is stored in the dtype too: beyond its range, an infinity of the sign
        big = ref_args[0].abs() > torch.finfo(dtype).max
        assert torch.equal(kern_args[0].double()[big], ref_args[0][big].sign() * float("inf"))
        hscale = ref_args[0][~big].abs().max().item()
        torch.testing.assert_close(kern_args[0].double()[~big], ref_args[0][~big], rtol=rtol, atol=rtol * hscale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_triton_kernels_match_the_float64_reference(seed, cuda, dtype, strided):
    from ops.decode import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    _kernel_vs_reference(dtype, strided, cuda)
    # a layer's real sizes, through the whole mixer step (dt_rank 48 > one block of the fused projection)
    layer = _layer(torch.float32, d_model=768, d_state=16, device=cuda)
    ref = copy.deepcopy(layer).double()
    conv, ssm = _random_states(layer, 4, torch.float32, cuda)
    conv_r, ssm_r = conv.double(), ssm.double()
    with torch.no_grad():
        for _ in range(4):
            h = torch.randn(4, 1, 768, device=cuda)
            out = layer.step(h, conv, ssm)[0]
            with ops.use_backend("reference"):
                expected = ref.step(h.double(), conv_r, ssm_r)[0]
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(ssm.double(), ssm_r, rtol=1e-5, atol=1e-5 * ssm_r.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_state_launch_matches_the_float64_reference(seed, cuda, dtype):
    """Each launch ``_state_launch`` chooses from (dt projection fused or one matmul, loads first or after, 16 or 64
    channels a program), and the default at a shape of each rule (batch 1, 16; 64 x 2048 x 64 takes the matmul),
    on the GPU against float64 math; mamba-ssm's strides (x, z and dt, B, C are views of the projections)."""
    from ops.decode import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    launches = [None] + [dec.StateLaunch(f, first, bd, w) for f in (True, False) for first in (True, False)
                         for bd, w in ((16, 4), (64, 2))]
    for batch, dim, rank in ((1, 1536, 48), (16, 1536, 48), (64, 2048, 64), (5, 100, 40)):
        assert dec._state_launch(64, 2048, 64).fuse_dt_proj is False
        xz = torch.randn(batch, 2 * dim, device=cuda, dtype=dtype)
        x_dbl = torch.randn(batch, rank + 32, device=cuda, dtype=dtype)
        dt, B, C = torch.split(x_dbl, [rank, 16, 16], dim=-1)
        args = [dt, torch.randn(dim, 16, device=cuda), B, C, torch.randn(dim, device=cuda), xz[:, dim:],
                0.5 * torch.randn(dim, device=cuda, dtype=dtype), rank ** -0.5 * torch.randn(dim, rank, device=cuda,
                                                                                           dtype=dtype), True]
        h0 = torch.randn(batch, dim, 16, device=cuda, dtype=dtype)
        h_r = h0.double()
        y_r = dec.selective_state_step_ref(h_r, xz[:, :dim].double(),
                                           *[a.double() if isinstance(a, torch.Tensor) else a for a in args])
        for launch in launches:
            h = h0.clone()
            y = dec._state_step_triton(h, xz[:, :dim], *args, torch.empty(batch, dim, device=cuda, dtype=dtype),
                                       launch=launch)
            torch.testing.assert_close(y.double(), y_r, rtol=rtol, atol=rtol * y_r.abs().max().item(),
                                       msg=lambda m: f"{batch}x{dim}x{rank} {launch}: {m}")
            torch.testing.assert_close(h.double(), h_r, rtol=rtol, atol=rtol * h_r.abs().max().item(),
                                       msg=lambda m: f"{batch}x{dim}x{rank} {launch} state: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_mamba2_kernel_matches_the_float64_reference(seed, cuda, dtype, strided):
    """mamba2_state_step's Triton kernel on the GPU against float64 math: the samples, and transformers' Mamba-2
    sizes (80 heads of 64 channels, 8 groups, d_state 128; batch 1 and 16)."""
    from ops.decode import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    samples = _mamba2_samples(dtype, cuda, strided)
    for batch in (1, 16):
        g = dict(device=cuda, dtype=dtype)
        samples.append((torch.randn(batch, 80, 64, 128, **g), torch.randn(batch, 80, 64, **g),
                        torch.randn(batch, 80, **g), torch.randn(80, device=cuda), torch.randn(batch, 8, 128, **g),
                        torch.randn(batch, 8, 128, **g), torch.randn(80, device=cuda), None,
                        torch.randn(80, **g), True))
    for args in samples:
        out, expected, kern_args, ref_args = _kernel_and_reference(torch.ops.packloader.mamba2_state_step, args)
        scale = expected.abs().max().item()
        torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * scale)
        hscale = ref_args[0].abs().max().item()
        torch.testing.assert_close(kern_args[0].double(), ref_args[0], rtol=rtol, atol=rtol * hscale)


@pytest.mark.gpu
def test_cuda_unsupported_cases_name_the_override(cuda):
    layer = _layer(F64, device=cuda)
    conv, ssm = _random_states(layer, 2, F64, cuda)
    h = torch.randn(2, 1, layer.d_model, dtype=F64, device=cuda)
    with pytest.raises(ops.KernelUnsupportedError, match=r'use_backend\("reference"\)'):
        with torch.no_grad():
            layer.step(h, conv, ssm)
    with torch.no_grad(), ops.use_backend("reference"):
        conv_p, ssm_p = conv.clone(), ssm.clone()
        assert torch.equal(layer.step(h, conv, ssm)[0], _previous_step(layer, h, conv_p, ssm_p))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(seed, cuda, dtype):
    """The step captured once in a CUDA graph, replayed on new inputs: the eager step's outputs and states."""
    layer = _layer(torch.float32, d_model=64, d_state=16, device=cuda).to(dtype)
    layer.A_log.data, layer.D.data = layer.A_log.data.float(), layer.D.data.float()
    batch = 3
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    conv, ssm = _random_states(layer, batch, dtype, cuda)
    conv_e, ssm_e = conv.clone(), ssm.clone()
    h_static = torch.randn(batch, 1, layer.d_model, dtype=dtype, device=cuda)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):   # warm-up (Triton compiles here, not during capture) on copies of the states
            for _ in range(2):
                layer.step(h_static, conv.clone(), ssm.clone())
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_static = layer.step(h_static, conv, ssm)[0]
        conv.copy_(conv_e), ssm.copy_(ssm_e)   # capture does not run the kernels; start from the same states
        for _ in range(4):
            h = torch.randn(batch, 1, layer.d_model, dtype=dtype, device=cuda)
            h_static.copy_(h)
            graph.replay()
            expected = layer.step(h, conv_e, ssm_e)[0]
            # the same kernels on the same inputs (cuBLAS may pick another algorithm inside a capture: not bitwise)
            torch.testing.assert_close(out_static, expected, rtol=tol, atol=tol)
            torch.testing.assert_close(ssm, ssm_e, rtol=tol, atol=tol)
            torch.testing.assert_close(conv, conv_e, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_reduce_overhead_compile_equals_eager(seed, cuda):
    layer = _layer(torch.float32, d_model=64, d_state=16, device=cuda)
    conv, ssm = _random_states(layer, 2, torch.float32, cuda)
    conv_e, ssm_e = conv.clone(), ssm.clone()
    torch._dynamo.mark_static_address(conv)
    torch._dynamo.mark_static_address(ssm)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: layer.step(h, conv, ssm)[0], mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(5):
            h = torch.randn(2, 1, layer.d_model, device=cuda)
            got = compiled(h).clone()
            expected = layer.step(h, conv_e, ssm_e)[0]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ssm, ssm_e, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(conv, conv_e, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is None, reason="mamba-ssm is not installed")
@pytest.mark.parametrize("cg", [False, True])
def test_mamba_ssm_generate_tokens_identical(cuda, cg):
    """mamba-ssm's MambaLMHeadModel and generate(): the converted model gives the unconverted model's greedy tokens
    (fp32 weights, TF32 off)."""
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(0)
    cfg = MambaConfig(d_model=256, n_layer=4, vocab_size=512, ssm_cfg={"layer": "Mamba1"}, rms_norm=True,
                      fused_add_norm=False, residual_in_fp32=True)
    model = MambaLMHeadModel(cfg, device=cuda, dtype=torch.float32).eval()
    converted = ops.enable_packing(copy.deepcopy(model))
    prompt = torch.randint(0, 512, (2, 12), device=cuda)
    kw = dict(max_length=12 + 24, cg=cg, top_k=1, return_dict_in_generate=True)
    expected = model.generate(prompt, **kw).sequences
    got = converted.generate(prompt, **kw).sequences
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------------
# Hugging Face generate, and the benchmark's smoke mode


def _hf_family_model(transformers, family, **kw):
    """A small transformers Mamba / FalconMamba / Mamba-2 language model (random weights moved off their init)."""
    if family == "mamba":
        model = transformers.MambaForCausalLM(transformers.MambaConfig(**kw))
    elif family == "falcon_mamba":
        model = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**kw))
    else:
        kw = dict(kw, head_dim=8, num_heads=2 * kw["hidden_size"] // 8, n_groups=2, chunk_size=8)
        model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**kw))
        with torch.no_grad():   # A_log, D, dt_bias and the norm start at constants: make each matter
            for name, p in model.named_parameters():
                if "A_log" in name or name.endswith(".D") or "dt_bias" in name or "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _count_fused_steps(monkeypatch, family):
    """A list that grows by one for every fused single-token step (ops.decode.mamba_step / ops.hf.mamba2_step)."""
    import ops.decode
    import ops.hf
    module, name = (ops.hf, "mamba2_step") if family == "mamba2" else (ops.decode, "mamba_step")
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2"])
def test_hf_generate_tokens_identical_after_conversion(family, monkeypatch):
    """transformers' greedy generate on a converted float32 model gives the unconverted model's tokens; where the
    transformers version's cache has the has_previous_state / layers API (5.x after 5.0), every single-token step
    runs through ops.decode (mamba_step; Mamba-2: ops.hf.mamba2_step), else transformers' own code."""
    transformers = pytest.importorskip("transformers", exc_type=ImportError)

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = _hf_family_model(transformers, family, vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                             expand=2, conv_kernel=4, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    converted = ops.enable_packing(copy.deepcopy(model))
    calls = _count_fused_steps(monkeypatch, family)
    prompt = torch.randint(1, 64, (3, 7))
    gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(prompt, **gen)
        assert not calls   # the unconverted model never reaches ops.decode
        got = converted.generate(prompt, **gen)
    assert expected.shape == (3, 19)
    assert torch.equal(got, expected)
    cache = transformers.DynamicCache(config=model.config) if hasattr(transformers, "DynamicCache") else None
    if cache is None or not (hasattr(cache, "has_previous_state") and hasattr(cache, "layers")):
        assert not calls   # 5.0's MambaCache: transformers' own code
        return
    assert len(calls) == 2 * 11   # two layers, every new token after the first
    # a step with gradients enabled runs transformers' code (ops.decode computes none)
    calls.clear()
    out = converted(prompt, use_cache=True)
    with warnings.catch_warnings():   # transformers >= 5.24 renames cache_params to cache (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        step = converted(prompt[:, :1], cache_params=out.cache_params, use_cache=True)
    assert not calls and step.logits.requires_grad


def _hf_teacher_forced(model, seq, prompt_len):
    """transformers' ``model`` stepping through ``seq`` from its cache after a prefill of ``prompt_len`` tokens:
    (logits of every step, the cache)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "cache_params"
    with torch.no_grad():
        out = model(input_ids=seq[:, :prompt_len], use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.cache_params
        logits = [model(input_ids=seq[:, t:t + 1], use_cache=True, **{cache_kw: cache}).logits
                  for t in range(prompt_len, seq.shape[1])]
    return torch.cat(logits, 1), cache


def test_hf_mamba2_step_equals_transformers_step(monkeypatch):
    """ops.hf.mamba2_step against transformers' own Mamba-2 single-token step, both stepping through the same tokens
    from their caches (float32): every step's logits and the final conv / scan states; then a variant the fused
    step does not compute (a clamped time step, which older transformers' steps apply) runs transformers' code."""
    transformers = pytest.importorskip("transformers", exc_type=ImportError)

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
              eos_token_id=None, pad_token_id=0)
    model = _hf_family_model(transformers, "mamba2", **kw)
    cache = transformers.DynamicCache(config=model.config) if hasattr(transformers, "DynamicCache") else None
    if cache is None or not (hasattr(cache, "has_previous_state") and hasattr(cache, "layers")):
        pytest.skip("this transformers version's Mamba-2 cache (5.0's) steps through transformers' own code")
    converted = ops.enable_packing(copy.deepcopy(model))
    calls = _count_fused_steps(monkeypatch, "mamba2")
    seq = torch.randint(1, 64, (3, 15))
    expected, cache_e = _hf_teacher_forced(model, seq, 6)
    assert not calls
    got, cache_g = _hf_teacher_forced(converted, seq, 6)
    assert len(calls) == 2 * 9
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the first layer's conv inputs are the same tensors (its shift is exact); the second's come through the first's
    # output, equal to float32 rounding
    assert torch.equal(cache_g.layers[0].conv_states[0], cache_e.layers[0].conv_states[0])
    for layer in range(2):
        torch.testing.assert_close(cache_g.layers[layer].conv_states[0], cache_e.layers[layer].conv_states[0],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache_g.layers[layer].recurrent_states[0], cache_e.layers[layer].recurrent_states[0],
                                   rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    clamped = ops.enable_packing(_hf_family_model(transformers, "mamba2", time_step_limit=(0.0, 0.05), **kw))
    calls.clear()
    _hf_teacher_forced(clamped, seq, 6)
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2"])
def test_hf_generate_on_cuda_tokens_identical(cuda, family, monkeypatch):
    """transformers' generate on CUDA (float32, TF32 off): the converted model's steps run the Triton kernels and give
    the unconverted model's greedy tokens."""
    transformers = pytest.importorskip("transformers", exc_type=ImportError)

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = _hf_family_model(transformers, family, vocab_size=256, hidden_size=128, state_size=16, num_hidden_layers=3,
                             expand=2, conv_kernel=4, eos_token_id=None, pad_token_id=0).to(cuda)
    model.generation_config.eos_token_id = None
    converted = ops.enable_packing(copy.deepcopy(model))
    calls = _count_fused_steps(monkeypatch, family)
    prompt = torch.randint(1, 256, (4, 9), device=cuda)
    gen = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(prompt, **gen)
        got = converted.generate(prompt, **gen)
    assert torch.equal(got, expected)
    cache = transformers.DynamicCache(config=model.config)
    if hasattr(cache, "has_previous_state") and hasattr(cache, "layers"):
        assert len(calls) == 3 * 19


def test_bench_generate_smoke(tmp_path):
    pytest.importorskip("transformers", exc_type=ImportError)
    import importlib.util as iu
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_generate.py"
    spec = iu.spec_from_file_location("bench_generate", path)
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "decode.json"
    result = bench.main(["--smoke", "--impl", "hf", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert [(r["batch"], r["cg"]) for r in saved["rows"]] == [(1, False), (3, False)]
    for r in saved["rows"]:
        assert r["identical"] and r["tokens_differing"] == 0
        assert r["unconverted_tok_s"] > 0 and r["converted_tok_s"] > 0
        # the models alternate in every timed round: one decode time each a round
        assert len(r["converted_decode_s_rounds"]) == len(r["unconverted_decode_s_rounds"]) == r["rounds"] == 2
        assert len(r["decode_ratio_rounds"]) == r["rounds"]
    # the low-precision diagnosis: logits against a float32 copy, both models through the same tokens; a broken
    # "converted" model (its out_proj scaled) shows a larger error than the unconverted one
    unconverted, converted = bench.hf_mamba2_models(32, 2, 64, torch.device("cpu"), torch.bfloat16, 0)
    seq = torch.randint(1, 64, (2, 12))
    err = bench.logit_errors((unconverted, converted), seq, 5)
    assert 0 <= err["unconverted_logit_err_vs_fp32"] < 0.1 * err["fp32_logit_mean_abs"]
    assert 0 <= err["converted_logit_err_vs_fp32"] < 0.1 * err["fp32_logit_mean_abs"]
    assert 0.5 < err["converted_argmax_agree_fp32"] <= 1
    with torch.no_grad():
        for block in converted.backbone.layers:
            block.mixer.out_proj.weight.mul_(3.0)
    bad = bench.logit_errors((unconverted, converted), seq, 5)
    assert bad["converted_logit_err_vs_fp32"] > 5 * bad["unconverted_logit_err_vs_fp32"]
    assert [(r["batch"], r["cg"]) for r in saved["mixer_step_us"]] == [(1, False), (3, False)]
    assert all(r["previous_torch_step_us"] > 0 and r["ops_decode_us"] > 0 for r in saved["mixer_step_us"])
