"""Numba's on-disk cache, with a fallback when no cache location is writable.

``@njit(cache=True)`` raises ``RuntimeError: cannot cache function ...: no locator available`` at import
when neither the package directory nor the user's cache directory (under ``$HOME``) is writable (a
read-only install with a read-only or missing home directory). Importing this module first checks that
a cache location exists; if none does, it points Numba at a temporary directory
(``$TMPDIR/packloader-numba-cache-<uid>``) with a one-line warning, or, if that fails too, turns caching
off (functions then compile on first use in every process). ``NUMBA_CACHE_DIR`` set by the user is left
alone. Every packloader module that compiles with Numba imports this module before decorating, and the
setting is process-wide, so ``packer_algos`` (imported by packloader) benefits too.

Use :func:`njit_cached` instead of ``njit(cache=True)``.
"""
from __future__ import annotations

import os
import sys
import tempfile

import numba
from numba import njit

__all__ = ["njit_cached", "CACHE"]


def _probe(x):  # a function whose cache location is checked
    return x


def _cache_usable() -> bool:
    from numba.core.caching import FunctionCache

    try:
        FunctionCache(_probe)
    except RuntimeError:
        return False
    return True


def _configure() -> bool:
    if _cache_usable():
        return True
    tmp = os.path.join(tempfile.gettempdir(), f"packloader-numba-cache-{os.getuid() if hasattr(os, 'getuid') else 0}")
    try:
        os.makedirs(tmp, exist_ok=True)
        numba.config.CACHE_DIR = tmp
        if _cache_usable():
            print(f"packloader: warning: no writable Numba cache directory (home or package directory); "
                  f"caching compiled code in {tmp}", file=sys.stderr)
            return True
    except OSError:
        pass
    print("packloader: warning: no writable Numba cache directory; compiled code is not cached "
          "(set NUMBA_CACHE_DIR to a writable directory)", file=sys.stderr)
    return False


#: whether compiled functions are cached on disk in this process
CACHE = _configure()


def njit_cached(**kw):
    """``numba.njit(cache=True, **kw)`` when a cache location is usable, else ``njit(**kw)``."""
    return njit(cache=CACHE, **kw)
