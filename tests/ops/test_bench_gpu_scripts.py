"""The GPU machine's scripts (benchmarks/gpu/*.sh) are only run on a lent GPU; what can go wrong with them before
that is checked here: they parse, and their inline import checks of the compiled upstream extensions import torch
first (a bare ``selective_scan_cuda`` cannot find libc10.so and reports a working install as broken); the benchmarks
that call the compiled extension directly pass every argument its binding declares."""
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


# ---- the benchmarks that call the compiled extension directly (ext.scan_fwd(...)) run only on a GPU: their calls
# must pass every parameter the binding declares (pybind11 without py::arg defaults takes no fewer) ----

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))
BINDING = Path(__file__).resolve().parents[2] / "ops" / "csrc" / "binding.cpp"


def _binding_arity() -> dict:
    """{name: parameter count} of the functions binding.cpp exposes with m.def (none has defaults there)."""
    text = BINDING.read_text()
    exposed = re.findall(r'm\.def\("(\w+)",\s*&(\w+)', text)
    assert exposed, "no m.def in binding.cpp"
    arity = {}
    for name, fn in exposed:
        m = re.search(r"^\w[\w:<>]*\s+" + fn + r"\(([^)]*)\)\s*\{", text, re.M)
        assert m, f"binding.cpp: no definition of {fn}"
        arity[name] = len([p for p in m.group(1).split(",") if p.strip()])
    return arity


def test_benchmarks_call_the_binding_with_every_argument():
    import ast
    arity = _binding_arity()
    calls = 0
    for path in BENCHMARKS:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ext"
                    and node.func.attr in arity):
                calls += 1
                assert not node.keywords, f"{path.name}:{node.lineno}: keywords (the binding takes positions)"
                assert len(node.args) == arity[node.func.attr], (
                    f"{path.name}:{node.lineno}: ext.{node.func.attr} with {len(node.args)} arguments, the binding "
                    f"takes {arity[node.func.attr]}")
    assert calls >= 3   # bench_scan_segments.py's scan_fwd (twice) and scan_bwd


# ---- ab_kernels.sh's table (ab_summary.py): the medians and ratios of rounds run alternately ----

def _ab_summary():
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "ab_summary.py"
    spec = importlib.util.spec_from_file_location("ab_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_json(path, rows):
    import json
    path.write_text(json.dumps({"rows": [{"op": o, "impl": i, "phase": p, "ms": ms, "note": ""}
                                         for o, i, p, ms in rows]}))


def test_ab_summary_medians_and_ratio_per_row(tmp_path, capsys):
    import json
    ab = _ab_summary()
    scan = ("selective_scan", "ours (packed, position_ids)")
    for r, (b, w) in enumerate([(7.3, 6.4), (7.5, 6.1), (7.4, 6.3)], start=1):
        _bench_json(tmp_path / f"base_{r}.json", [(*scan, "bwd", b), (*scan, "fwd", 1.3), ("conv", "x", "fwd", 0.2)])
        _bench_json(tmp_path / f"work_{r}.json", [(*scan, "bwd", w), (*scan, "fwd", 1.4)])
    # round 10 sorts after round 2 (numerically): the times stay in run order
    _bench_json(tmp_path / "base_10.json", [(*scan, "bwd", 7.0), (*scan, "fwd", 1.3)])
    _bench_json(tmp_path / "work_10.json", [(*scan, "bwd", 6.0), (*scan, "fwd", 1.4)])
    assert ab.main([str(tmp_path)]) == 0
    rows = {(r["phase"]): r for r in json.loads((tmp_path / "ab.json").read_text())["rows"]}
    assert set(rows) == {"bwd", "fwd"}   # the conv row exists on one side only: left out
    bwd = rows["bwd"]
    assert bwd["base_ms"] == [7.3, 7.5, 7.4, 7.0] and bwd["work_ms"] == [6.4, 6.1, 6.3, 6.0]
    assert bwd["base_median"] == pytest.approx(7.35) and bwd["work_median"] == pytest.approx(6.2)
    assert bwd["work_over_base"] == pytest.approx(6.2 / 7.35, abs=1e-4)
    assert rows["fwd"]["work_over_base"] == pytest.approx(1.4 / 1.3, abs=1e-4)
    assert "6.400, 6.100, 6.300, 6.000" in capsys.readouterr().out


def test_ab_summary_reads_bench_train_results(tmp_path):
    """bench_train.py's JSON (AB_PATHS=ops, a change of the fused mixer): a step's ms by width, lengths and mode;
    a mode that ran out of memory is left out."""
    import json
    ab = _ab_summary()
    for r, (b, w) in enumerate([(433.4, 427.3), (436.9, 428.1)], start=1):
        for side, ms in (("base", b), ("work", w)):
            (tmp_path / f"{side}_{r}.json").write_text(json.dumps({"results": [
                {"width": "1.4b", "lengths": "gsm8k", "mode": "packed", "ms_per_step": ms},
                {"width": "1.4b", "lengths": "gsm8k", "mode": "dense", "ms_per_step": 520.0 + r},
                {"width": "2.8b", "lengths": "gsm8k", "mode": "packed", "oom": True}]}))
    assert ab.main([str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "ab.json").read_text())["rows"]}
    assert set(rows) == {"packed", "dense"} and rows["packed"]["op"] == "1.4b gsm8k"
    assert rows["packed"]["base_ms"] == [433.4, 436.9] and rows["packed"]["work_ms"] == [427.3, 428.1]
    assert rows["packed"]["work_over_base"] == pytest.approx(427.7 / 435.15, abs=1e-4)
    assert rows["dense"]["work_over_base"] == pytest.approx(1.0)


def test_ab_summary_says_when_a_side_is_missing(tmp_path, capsys):
    ab = _ab_summary()
    _bench_json(tmp_path / "base_1.json", [("selective_scan", "ours", "bwd", 7.0)])
    assert ab.main([str(tmp_path)]) == 1
    assert "no rows found" in capsys.readouterr().out
    assert not (tmp_path / "ab.json").exists()
