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
