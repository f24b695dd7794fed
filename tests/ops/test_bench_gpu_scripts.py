"""The GPU machine's scripts (benchmarks/gpu/*.sh) are only run on a lent GPU; what can go wrong with them before
that is checked here: they parse, and their inline import checks of the compiled upstream extensions import torch
first (a bare ``selective_scan_cuda`` cannot find libc10.so and reports a working install as broken)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

GPU_SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "gpu").glob("*.sh"))
BARE_EXTENSIONS = {"selective_scan_cuda", "causal_conv1d_cuda"}   # torch extensions that do not import torch
IMPORTS_TORCH = {"torch", "causal_conv1d", "mamba_ssm", "ops"}


def test_there_are_gpu_scripts():
    assert len(GPU_SCRIPTS) >= 5, GPU_SCRIPTS


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_gpu_script_parses(script):
    got = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr


def _late_bare_imports(code: str):
    """The bare extensions that ``code`` (a ``python3 -c`` program) imports before anything imports torch."""
    torch_seen, bad = False, []
    for statement in re.split(r"[;\n]", code):
        m = re.match(r"\s*(?:import\s+(.+)|from\s+(\S+)\s+import\b)", statement)
        if not m:
            continue
        modules = [s.strip().split(" as ")[0].split(".")[0] for s in (m.group(1) or m.group(2)).split(",")]
        for name in modules:
            if name in BARE_EXTENSIONS and not torch_seen:
                bad.append(name)
            torch_seen = torch_seen or name in IMPORTS_TORCH
    return bad


def test_import_order_rule_catches_a_bare_extension_first():
    assert _late_bare_imports("import selective_scan_cuda, causal_conv1d; print('x')") == ["selective_scan_cuda"]
    assert _late_bare_imports("import torch, selective_scan_cuda, causal_conv1d") == []
    assert _late_bare_imports("import causal_conv1d, selective_scan_cuda; from mamba_ssm import x") == []


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_gpu_script_import_checks_import_torch_first(script):
    programs = re.findall(r'python3 -c "([^"]*)"', script.read_text())
    bad = {p: _late_bare_imports(p) for p in programs if _late_bare_imports(p)}
    assert not bad, f"{script.name}: import torch (or causal_conv1d / mamba_ssm) before {bad}"
