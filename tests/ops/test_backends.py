"""ops.backends: selection (set_backend / use_backend / PACKLOADER_OPS_BACKEND / backend=), clear errors
for kernel backends on CPU tensors, auto falling back to the reference on CPU; and ``import ops`` on a
machine without mamba-ssm, causal-conv1d, triton or a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ops
from ops import backends
from ops.backends import available_backends, get_backend, kernels_for, resolve_backend, set_backend, use_backend

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = not torch.cuda.is_available()


def test_defaults_are_auto():
    assert get_backend("selective_scan") == "auto" and get_backend("causal_conv1d") == "auto"


def test_set_backend_per_op_and_for_all():
    set_backend("reference")
    assert get_backend("selective_scan") == "reference" and get_backend("causal_conv1d") == "reference"
    set_backend("upstream")  # only the conv has an upstream backend: the scan keeps its choice
    assert get_backend("causal_conv1d") == "upstream" and get_backend("selective_scan") == "reference"
    set_backend("ref_kernel", op="selective_scan")
    assert get_backend("selective_scan") == "ref_kernel" and get_backend("causal_conv1d") == "upstream"
    set_backend("auto", op="causal_conv1d")
    assert get_backend("causal_conv1d") == "auto"
    set_backend(None)
    assert get_backend("selective_scan") == "auto"


def test_set_backend_errors():
    with pytest.raises(ValueError, match="unknown backend 'triton'"):
        set_backend("triton")
    with pytest.raises(ValueError, match=r"unknown backend 'upstream' for selective_scan; choose from \('auto', 'cuda', 'reference', 'ref_kernel'\)"):
        set_backend("upstream", op="selective_scan")
    with pytest.raises(ValueError, match="unknown op 'scan'; ops are"):
        set_backend("cuda", op="scan")
    with pytest.raises(ValueError, match="unknown op 'conv'"):
        get_backend("conv")
    assert get_backend("selective_scan") == "auto"  # failed calls changed nothing


def test_use_backend_restores_even_on_error():
    set_backend("ref_kernel", op="causal_conv1d")
    with use_backend("reference"):
        assert get_backend("selective_scan") == get_backend("causal_conv1d") == "reference"
        with use_backend("upstream", op="causal_conv1d"):
            assert get_backend("causal_conv1d") == "upstream"
        assert get_backend("causal_conv1d") == "reference"
    assert get_backend("causal_conv1d") == "ref_kernel" and get_backend("selective_scan") == "auto"
    with pytest.raises(RuntimeError, match="boom"):
        with use_backend("reference"):
            raise RuntimeError("boom")
    assert get_backend("selective_scan") == "auto"


@pytest.mark.parametrize(
    "value, scan, conv",
    [
        ("reference", "reference", "reference"),
        (" ref_kernel ", "ref_kernel", "ref_kernel"),
        ("auto", "auto", "auto"),
        ("upstream", "auto", "upstream"),  # no upstream packed Mamba-1 scan: the scan stays on auto
        ("causal_conv1d=upstream,selective_scan=ref_kernel", "ref_kernel", "upstream"),
        ("causal_conv1d = reference ,", "auto", "reference"),
        ("", "auto", "auto"),
    ],
)
def test_environment_variable(monkeypatch, value, scan, conv):
    monkeypatch.setenv(backends.ENV_VAR, value)
    assert get_backend("selective_scan") == scan and get_backend("causal_conv1d") == conv


@pytest.mark.parametrize(
    "value, message",
    [
        ("fastest", r"PACKLOADER_OPS_BACKEND='fastest': unknown backend for selective_scan"),
        ("conv=cuda", r"PACKLOADER_OPS_BACKEND: unknown op 'conv' in 'conv=cuda'"),
        ("selective_scan=upstream", r"unknown backend 'upstream' for selective_scan"),
    ],
)
def test_environment_variable_errors(monkeypatch, value, message):
    monkeypatch.setenv(backends.ENV_VAR, value)
    with pytest.raises(ValueError, match=message):
        get_backend("selective_scan")


def test_precedence(monkeypatch):
    """backend= keyword > set_backend > environment > auto."""
    monkeypatch.setenv(backends.ENV_VAR, "ref_kernel")
    x = torch.randn(1, 2, 3)
    assert resolve_backend("selective_scan", x) == "ref_kernel"
    set_backend("reference")
    assert resolve_backend("selective_scan", x) == "reference"
    assert resolve_backend("selective_scan", x, "ref_kernel") == "ref_kernel"


@pytest.mark.skipif(not CPU_ONLY, reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_auto_falls_back_to_the_reference_on_cpu(dtype):
    x = torch.randn(1, 2, 3).to(dtype)
    for op in backends.OPS:
        assert resolve_backend(op, x) == "reference"
        assert available_backends(op) == ["reference", "ref_kernel"]


def test_explicit_kernel_backends_on_cpu_tensors_fail_clearly():
    x = torch.randn(1, 4, 6)
    w = torch.randn(4, 3)
    for name in ("cuda", "upstream"):
        with pytest.raises(ValueError, match=rf"backend '{name}' for causal_conv1d needs CUDA tensors, got a tensor on cpu"):
            ops.packed_causal_conv1d(x, w, backend=name)
    with pytest.raises(ValueError, match="backend 'cuda' for selective_scan needs CUDA tensors"):
        ops.packed_selective_scan(x, x.abs(), -torch.rand(4, 2), torch.randn(1, 2, 6), torch.randn(1, 2, 6),
                                  backend="cuda")
    set_backend("cuda")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ops.packed_causal_conv1d(x, w)
    layer = ops.PackedMamba(4, d_state=2)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        layer(torch.randn(1, 5, 4))
    set_backend(None)
    layer.backend = "upstream"
    with pytest.raises(ValueError, match="backend 'upstream' for causal_conv1d needs CUDA tensors"):
        layer(torch.randn(1, 5, 4))


def test_kernels_for():
    from ops import _ref_kernels

    assert kernels_for("selective_scan", "ref_kernel") is _ref_kernels
    with pytest.raises(ValueError, match="backend 'reference' has no raw kernels"):
        kernels_for("selective_scan", "reference")


@pytest.mark.skipif(not CPU_ONLY, reason="checks the CPU-only behaviour")
def test_upstream_module_without_a_gpu():
    from ops import _upstream

    assert not _upstream.conv_available() and not _upstream.is_available()
    with pytest.raises(RuntimeError, match="causal-conv1d package \\(with CUDA\\) is not importable"):
        _upstream.load()


def test_lazy_exports():
    for name in ops.__all__:
        assert getattr(ops, name) is not None
    assert set(ops.__all__) <= set(dir(ops))
    with pytest.raises(AttributeError, match="module 'ops' has no attribute 'selective_scan_fn'"):
        ops.selective_scan_fn  # noqa: B018


IMPORT_CHECK = textwrap.dedent(
    """
    import sys
    for name in ("mamba_ssm", "causal_conv1d", "causal_conv1d_cuda", "selective_scan_cuda", "triton"):
        sys.modules[name] = None  # any import of these raises ImportError
    import torch
    assert not torch.cuda.is_available()
    import ops
    for name in ops.__all__:
        getattr(ops, name)
    from ops import _upstream
    assert not _upstream.conv_available()
    torch.manual_seed(0)
    layer = ops.PackedMamba(8, d_state=4)
    h = torch.randn(2, 10, 8, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], list(range(10))])
    out = layer(h, position_ids=pos)
    out.sum().backward()
    assert h.grad.shape == h.shape and layer.A_log.grad is not None
    x = torch.randn(2, 8, 10)
    ops.packed_causal_conv1d(x, torch.randn(8, 4), activation="silu", position_ids=pos)
    ops.packed_selective_scan(x, torch.rand(2, 8, 10), -torch.rand(8, 3), torch.randn(2, 3, 10),
                              torch.randn(2, 3, 10), seq_idx=ops.position_ids_to_seq_idx(pos))
    report = ops.check_isolation(lambda b: layer(b["h"], position_ids=b["position_ids"]),
                                 {"h": h.detach(), "position_ids": pos})
    assert report.ok, report
    for name in ("mamba_ssm", "causal_conv1d", "triton"):
        assert sys.modules[name] is None, name
    assert "ops._cuda" not in sys.modules, "the CUDA module is not even imported without a GPU"
    print("IMPORT-OK")
    """
)


def test_import_ops_without_optional_packages_or_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    env.pop(backends.ENV_VAR, None)
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "IMPORT-OK" in proc.stdout, proc.stdout + proc.stderr


def test_blocked_module_really_fails_to_import():
    """Sanity check of the subprocess trick above."""
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['mamba_ssm'] = None; import mamba_ssm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "import of mamba_ssm halted" in proc.stderr
