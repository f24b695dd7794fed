"""ops._build: one list of sources and flags for the just-in-time and ahead-of-time builds; the constants shared
with the CUDA sources come from ops.contract only."""
import pathlib
import re
import shutil
import subprocess

import pytest

from ops import _build, contract

CSRC = pathlib.Path(_build.__file__).parent / "csrc"


def test_every_csrc_file_is_built_or_included():
    files = {p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cpp", ".h", ".cuh")}
    assert files == set(_build.SOURCES) | set(_build.headers())
    assert all((CSRC / s).exists() for s in _build.SOURCES)


def test_defines_carry_the_contract():
    flags = " ".join(_build.defines())
    assert f"-DPACKLOADER_SCAN_CHUNK={contract.SCAN_CHUNK}" in flags
    assert f"-DPACKLOADER_SCAN_LANES={contract.SCAN_LANES}" in flags
    assert f"-DPACKLOADER_CONV_SLOT_STEPS={contract.CONV_SLOT_STEPS}" in flags
    for flags in (_build.cxx_flags(), _build.nvcc_flags()):
        assert set(_build.defines()) <= set(flags)


def test_no_constant_copied_into_the_cuda_sources():
    # the shared constants are never written as literals in the headers, and no kernel reads the environment
    common = (CSRC / "ops_common.h").read_text()
    assert re.search(r"kScanChunk\s*=\s*PACKLOADER_SCAN_CHUNK", common)
    assert re.search(r"kScanLanes\s*=\s*PACKLOADER_SCAN_LANES", common)
    for p in CSRC.iterdir():
        assert "getenv" not in p.read_text(), f"{p.name} reads the environment"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_sources_preprocess_with_the_defines_and_refuse_without(tmp_path):
    # nvcc -E runs the preprocessor only (seconds): the includes resolve and the #error guard fires without -D
    for src in _build.SOURCES:
        if not src.endswith(".cu"):
            continue
        ok = subprocess.run(["nvcc", "-E", "-std=c++17", *_build.defines(), str(CSRC / src), "-o", str(tmp_path / "o")],
                            capture_output=True, text=True)
        assert ok.returncode == 0, ok.stderr[-2000:]
    bad = subprocess.run(["nvcc", "-E", str(CSRC / "selective_scan.cu"), "-o", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "PACKLOADER_SCAN_CHUNK" in bad.stderr


def test_the_binding_carries_the_source_digest():
    digest = _build.source_digest()
    assert re.fullmatch(r"d[0-9a-f]{16}", digest)
    assert f"-DPACKLOADER_SOURCE_DIGEST={digest}" in _build.cxx_flags()
    assert 'm.attr("source_digest")' in (CSRC / "binding.cpp").read_text()


class _FakeModule:
    def __init__(self, digest):
        if digest is not None:
            self.source_digest = digest


@pytest.mark.parametrize("digest", [None, "d0000000000000000"])
def test_an_installed_extension_built_from_other_sources_is_refused(monkeypatch, digest):
    """An ops._C built before the sources changed (no digest, or another one) must not be called: its functions may
    take other arguments. The loader warns and builds just in time instead; the current one is taken."""
    import importlib
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == _build.AOT_MODULE else None)
    monkeypatch.setattr(importlib, "import_module", lambda name: _FakeModule(digest))
    with pytest.warns(UserWarning, match="built from other sources"):
        assert _build._load_aot() is None
    current = _FakeModule(_build.source_digest())
    monkeypatch.setattr(importlib, "import_module", lambda name: current)
    assert _build._load_aot() is current


def test_a_stale_build_lock_is_removed_and_a_fresh_one_reported(tmp_path, capsys):
    """A lock file left by a process killed mid-build would make every later just-in-time build wait forever: one older
    than STALE_LOCK_SECONDS is removed with a warning; a younger one is kept (torch waits for it) and reported."""
    import os
    import time

    lock = tmp_path / "lock"
    _build.check_build_lock(tmp_path)   # no lock: nothing to do
    assert not lock.exists() and capsys.readouterr().err == ""
    lock.write_text("")
    _build.check_build_lock(tmp_path)
    assert lock.exists() and "waiting for the build lock" in capsys.readouterr().err
    old = time.time() - _build.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="removing the build lock"):
        _build.check_build_lock(tmp_path)
    assert not lock.exists()


def _an_extension_module():
    """(name, path) of a compiled extension module of this Python (a stand-in for the kernels' module), or a skip."""
    import importlib.util

    for name in ("_json", "math", "_bisect", "_struct"):
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None) or ""
        if origin.endswith(".so"):
            return name, pathlib.Path(origin)
    pytest.skip("this Python has its extension modules built in: no .so to stand in for the kernels' module")


def test_a_finished_build_is_imported_without_the_build_step(tmp_path, monkeypatch):
    """A process whose build folder already holds the module imports it as it is (the folder's name is the hash of its
    sources, flags, torch, CUDA and GPU): no ninja run, and a module carried from another machine is used. A build
    holding the lock, no module, or one that does not import fall through to torch's build step."""
    name, so = _an_extension_module()
    monkeypatch.setattr(_build, "JIT_NAME", name)
    assert _build.load_built(tmp_path) is None                     # nothing built yet
    shutil.copy(so, tmp_path / f"{name}.so")
    module = _build.load_built(tmp_path)
    assert module is not None and module.__name__ == name and pathlib.Path(module.__file__) == tmp_path / f"{name}.so"
    (tmp_path / "lock").write_text("")                            # a build is writing the folder: wait for it
    assert _build.load_built(tmp_path) is None
    cut = tmp_path / "cut"                                        # a link cut short (a new folder: the module
    cut.mkdir()                                                   # above stays mapped into this process)
    (cut / f"{name}.so").write_bytes(b"not a shared library")
    assert _build.load_built(cut) is None


def test_the_just_in_time_loader_takes_a_finished_build(tmp_path, monkeypatch):
    """_load_jit returns the module in the build folder without calling torch's cpp_extension.load; without one it
    builds (here: the call is recorded instead)."""
    import torch
    from torch.utils import cpp_extension

    name, so = _an_extension_module()
    monkeypatch.setattr(_build, "JIT_NAME", name)
    monkeypatch.setattr(_build, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(_build, "nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "built")
    assert _build._load_jit() == "built" and len(calls) == 1 and calls[0]["build_directory"] == str(tmp_path)
    shutil.copy(so, tmp_path / f"{name}.so")
    module = _build._load_jit()
    assert module.__name__ == name and len(calls) == 1
