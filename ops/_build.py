"""Building the CUDA kernels of ``ops``: one list of sources and flags for the two ways to build them.

- **Just in time** (the default): the first kernel call on a CUDA tensor compiles ``ops/csrc`` with
  ``torch.utils.cpp_extension.load`` into a cache folder keyed by a hash of the sources, the flags, torch, CUDA and
  the GPU architecture (``~/.cache/packloader/ops-<hash>``, or ``$PACKLOADER_CACHE/ops-<hash>``). It needs ``nvcc``
  on the node (``CUDA_HOME`` or ``PATH``) and takes about a minute, once; later processes import the module found
  there directly (:func:`load_built`).
- **Ahead of time**, for clusters whose nodes have no compiler:
  ``PACKLOADER_BUILD_CUDA=1 pip install --no-build-isolation .`` compiles the same sources with the same flags into
  the module ``ops._C`` (``setup.py`` calls :func:`cuda_extension`). ``TORCH_CUDA_ARCH_LIST`` picks the
  architectures, as for any torch extension.

:func:`load_extension` takes ``ops._C`` when it is installed, loads and was built from these sources (the binding
exports :func:`source_digest`), else builds just in time.

The constants that the kernels share with Python live in :mod:`ops.contract` and reach the CUDA sources as ``-D``
flags from :func:`defines`; the headers refuse to compile without them.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pathlib
import shutil
import sys
import threading
import time
import warnings

from . import contract

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "selective_scan.cu", "causal_conv1d.cu", "conv_cf_regs.cu", "conv_cf_vec.cu", "conv_cl.cu",
           "conv_states.cu", "segment_sums.cu")
JIT_NAME = "packloader_ops_cuda"
AOT_MODULE = "ops._C"

_ext = None
_lock = threading.Lock()
# torch's just-in-time build holds a lock file in the build folder while it compiles; one this old was left behind by
# a process killed mid-build (a build takes 1-3 minutes), and every later build would wait for it forever
STALE_LOCK_SECONDS = 30 * 60


def defines() -> list:
    """``-D`` flags carrying :mod:`ops.contract` into the CUDA sources."""
    return [f"-DPACKLOADER_SCAN_CHUNK={contract.SCAN_CHUNK}", f"-DPACKLOADER_SCAN_LANES={contract.SCAN_LANES}",
            f"-DPACKLOADER_CONV_SLOT_STEPS={contract.CONV_SLOT_STEPS}",
            f"-DPACKLOADER_CONV_MASK_RUN={contract.CONV_MASK_RUN}",
            f"-DPACKLOADER_SCAN_BLOCK_CHANNELS={contract.SCAN_BLOCK_CHANNELS}",
            f"-DPACKLOADER_SCAN_FWD_WARPS_PER_SM={contract.SCAN_FWD_WARPS_PER_SM}"]


def source_digest() -> str:
    """A hash of the CUDA sources, headers and contract defines. The binding is compiled with it
    (``PACKLOADER_SOURCE_DIGEST``) and exports it as ``source_digest``, so an installed ``ops._C`` built from other
    sources (an editable install updated since) is refused instead of called with the wrong signatures."""
    h = hashlib.sha256()
    for name in SOURCES + tuple(headers()):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(defines()).encode())
    return "d" + h.hexdigest()[:16]


def cxx_flags() -> list:
    """Flags of the C++ binding (``binding.cpp``): the contract defines and the source digest."""
    return ["-O3", "-std=c++17"] + defines() + [f"-DPACKLOADER_SOURCE_DIGEST={source_digest()}"]


def nvcc_flags() -> list:
    return ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"] + defines()


def headers() -> list:
    return sorted(p.name for p in CSRC.iterdir() if p.suffix in (".h", ".cuh"))


def cuda_extension(root: "str | os.PathLike | None" = None):
    """The ``CUDAExtension`` that ``setup.py`` builds as ``ops._C`` (paths relative to the project ``root``)."""
    from torch.utils.cpp_extension import CUDAExtension

    base = pathlib.Path(root) if root is not None else CSRC.parent.parent
    srcs = [os.path.relpath(CSRC / s, base) for s in SOURCES]
    return CUDAExtension(AOT_MODULE, sources=srcs, extra_compile_args={"cxx": cxx_flags(), "nvcc": nvcc_flags()})


def nvcc() -> "str | None":
    """Path of the nvcc that a just-in-time build would use, or None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (pathlib.Path(home) / "bin" / "nvcc").exists():
        return str(pathlib.Path(home) / "bin" / "nvcc")
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover
        CUDA_HOME = None
    if CUDA_HOME and (pathlib.Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(pathlib.Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_dir() -> pathlib.Path:
    """The just-in-time build folder: a hash of sources, headers, flags, torch, CUDA and the GPU architecture."""
    import torch

    h = hashlib.sha256()
    for name in SOURCES + tuple(headers()):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    major, minor = torch.cuda.get_device_capability()
    h.update(" ".join(cxx_flags() + nvcc_flags()).encode())
    h.update(f"torch={torch.__version__};cuda={torch.version.cuda};arch={major}{minor};py={sys.version_info[:2]}".encode())
    root = pathlib.Path(os.environ.get("PACKLOADER_CACHE", pathlib.Path.home() / ".cache" / "packloader"))
    return root / f"ops-{h.hexdigest()[:16]}"


def _load_aot():
    """``ops._C`` if it is installed and loads; a warning (once) if it is installed but broken."""
    if importlib.util.find_spec(AOT_MODULE) is None:
        return None
    import torch  # noqa: F401  (the extension links against torch's libraries: load them first)

    try:
        mod = importlib.import_module(AOT_MODULE)
    except Exception as e:  # built for another torch / CUDA: say so, then build just in time
        warnings.warn(f"packloader ops: the installed {AOT_MODULE} does not load ({e}); building the kernels just in "
                      "time instead (reinstall with PACKLOADER_BUILD_CUDA=1 to rebuild it)", stacklevel=3)
        return None
    built_from = getattr(mod, "source_digest", None)
    if built_from != source_digest():   # built from other sources: its functions may take other arguments
        warnings.warn(f"packloader ops: the installed {AOT_MODULE} was built from other sources (digest {built_from}, "
                      f"these sources {source_digest()}); building the kernels just in time instead (reinstall with "
                      "PACKLOADER_BUILD_CUDA=1 to rebuild it)", stacklevel=3)
        return None
    return mod


def _load_jit():
    import torch
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        raise RuntimeError("packloader ops: the CUDA kernels need a CUDA GPU; none is visible to torch")
    if nvcc() is None:
        raise RuntimeError(
            "packloader ops: cannot build the CUDA kernels: nvcc not found (set CUDA_HOME to a CUDA toolkit matching "
            f"torch's CUDA {torch.version.cuda}, or put nvcc on PATH), and no prebuilt {AOT_MODULE} is installed "
            "(PACKLOADER_BUILD_CUDA=1 pip install --no-build-isolation . builds one)")
    build = build_dir()
    build.mkdir(parents=True, exist_ok=True)
    check_build_lock(build)
    built = load_built(build)
    if built is not None:
        return built
    major, minor = torch.cuda.get_device_capability()
    fresh = not any(build.glob("*.so"))
    if fresh:
        print(f"packloader ops: building CUDA kernels for sm_{major}{minor} in {build} (once; about a minute)...",
              file=sys.stderr, flush=True)
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    try:
        ext = cpp_extension.load(
            name=JIT_NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=cxx_flags(),
            extra_cuda_cflags=nvcc_flags(), extra_include_paths=[str(CSRC)], build_directory=str(build),
            verbose=False)
    except Exception as e:
        raise RuntimeError(f"packloader ops: building the CUDA kernels in {build} failed: {e}") from e
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    if fresh:
        print("packloader ops: CUDA kernels built.", file=sys.stderr, flush=True)
    return ext


def jit_module_path(build: "pathlib.Path | None" = None) -> pathlib.Path:
    """Where a just-in-time build leaves its module (torch names it after the extension): in ``build``, by default
    :func:`build_dir`."""
    return pathlib.Path(build if build is not None else build_dir()) / f"{JIT_NAME}.so"


def load_built(build: pathlib.Path):
    """The module a finished just-in-time build left in ``build``, imported as it is, without torch's build step (which
    runs ninja over the sources in every process); None where there is none, a build holds the folder's lock, or it
    does not import (torch's build step then rebuilds it or says why). The folder's name is the hash of everything the
    module was built from (:func:`build_dir`), so a module found there is these sources' own, also when it was copied
    from another machine with the same torch, CUDA and GPU (``benchmarks/gpu/run.sh`` carries it between machines)."""
    so = jit_module_path(build)
    if not so.is_file() or (pathlib.Path(build) / "lock").exists():
        return None
    import torch  # noqa: F401  (the module links against torch's libraries: load them first)
    try:
        spec = importlib.util.spec_from_file_location(JIT_NAME, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module


def check_build_lock(build: pathlib.Path, now: float = None) -> None:
    """Before a just-in-time build in ``build``: a lock file (torch's ``lock``) older than ``STALE_LOCK_SECONDS`` is
    removed with a warning (its process died mid-build); a younger one is reported on stderr (torch waits for it)."""
    lock = pathlib.Path(build) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"packloader ops: removing the build lock {lock}, {age / 60:.0f} minutes old: the process that "
                      "made it died mid-build", stacklevel=3)
        lock.unlink(missing_ok=True)
    else:
        print(f"packloader ops: waiting for the build lock {lock} ({age:.0f} s old): another process is building the "
              f"kernels; if none is, delete the file (it is removed by itself after {STALE_LOCK_SECONDS // 60} "
              "minutes)", file=sys.stderr, flush=True)


def load_extension():
    """The compiled kernels: ``ops._C`` if installed, else built just in time (once per process, cached on disk)."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is None:
            _ext = _load_aot() or _load_jit()
    return _ext


def can_load() -> bool:
    """A CUDA device is visible and the kernels are loaded, installed, or buildable (nvcc found). Never raises."""
    try:
        import torch

        if not torch.cuda.is_available() or torch.version.cuda is None:
            return False
        return _ext is not None or importlib.util.find_spec(AOT_MODULE) is not None or nvcc() is not None
    except Exception:
        return False
