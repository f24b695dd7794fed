"""Numba helpers: a hierarchical bitset over small integer keys, for "nearest set key" queries.

Level 0 has one bit per key (``n_keys`` bits in ``ceil(n_keys / 64)`` uint64 words); level ``l + 1``
has one bit per word of level ``l``, set when that word is non-zero; the top level is one word. With
capacities up to 4096 that is two levels (65 + 2 words, all in L1 cache), and a query is a couple of
word reads and one count-trailing/leading-zeros instruction per level, against ~2 * log2(capacity)
dependent branches in a binary segment tree.

The structure is three arrays made by :func:`bs_new`: ``bits`` (uint64 words of all levels), ``off``
(int64, first word of each level) and ``nbits`` (int64, bits per level); ``nlev = off.size``. It
only records *whether* a key is present: callers keep their own per-key counts or lists and call
:func:`bs_set` when a key becomes non-empty and :func:`bs_clear` when it becomes empty.

These functions are inlined into the cached kernels of ``offline.py``; Numba's on-disk cache only
watches the kernel's own file, so after editing this file clear ``packer_algos/__pycache__/*.nb*``.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


@intrinsic
def _cttz(typingctx, x):
    """Count trailing zeros of a non-zero uint64 (LLVM ``cttz``, one instruction on x86-64)."""
    if x != types.uint64:
        return None
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


@intrinsic
def _ctlz(typingctx, x):
    """Count leading zeros of a non-zero uint64 (LLVM ``ctlz``)."""
    if x != types.uint64:
        return None
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


@njit(cache=True)
def bs_new(n_keys):
    """An empty bitset over keys ``0 .. n_keys - 1``: ``(bits, off, nbits)``."""
    nlev = 1
    n = n_keys
    while n > 64:
        n = (n + 63) >> 6
        nlev += 1
    off = np.empty(nlev, dtype=np.int64)
    nbits = np.empty(nlev, dtype=np.int64)
    n = n_keys
    total = 0
    for lvl in range(nlev):
        nbits[lvl] = n
        off[lvl] = total
        w = (n + 63) >> 6
        total += w
        n = w
    return np.zeros(total, dtype=np.uint64), off, nbits


@njit(cache=True, inline="always")
def bs_set(bits, off, key):
    """Mark ``key`` present."""
    k = key
    for lvl in range(off.size):
        w = k >> 6
        j = off[lvl] + w
        old = bits[j]
        bits[j] = old | (_ONE << np.uint64(k & 63))
        if old != 0:
            return
        k = w


@njit(cache=True, inline="always")
def bs_clear(bits, off, key):
    """Mark ``key`` absent."""
    k = key
    for lvl in range(off.size):
        w = k >> 6
        j = off[lvl] + w
        v = bits[j] & ~(_ONE << np.uint64(k & 63))
        bits[j] = v
        if v != 0:
            return
        k = w


@njit(cache=True, inline="always")
def bs_next(bits, off, nbits, key):
    """Smallest present key ``>= key``, or -1."""
    nlev = off.size
    k = key if key > 0 else 0
    lvl = 0
    while True:
        if k >= nbits[lvl]:
            return -1
        w = k >> 6
        word = bits[off[lvl] + w] & (_ALL << np.uint64(k & 63))
        if word != 0:
            k = (w << 6) + _cttz(word)
            break
        lvl += 1
        if lvl == nlev:
            return -1
        k = w + 1
    while lvl > 0:
        lvl -= 1
        k = (k << 6) + _cttz(bits[off[lvl] + k])
    return k


@njit(cache=True, inline="always")
def bs_prev(bits, off, nbits, key):
    """Largest present key ``<= key``, or -1."""
    nlev = off.size
    k = key
    if k >= nbits[0]:
        k = nbits[0] - 1
    lvl = 0
    while True:
        if k < 0:
            return -1
        w = k >> 6
        word = bits[off[lvl] + w] & (_ALL >> np.uint64(63 - (k & 63)))
        if word != 0:
            k = (w << 6) + 63 - _ctlz(word)
            break
        lvl += 1
        if lvl == nlev:
            return -1
        k = w - 1
    while lvl > 0:
        lvl -= 1
        k = (k << 6) + 63 - _ctlz(bits[off[lvl] + k])
    return k
