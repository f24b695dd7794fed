"""The Numba side of the tar reader (:class:`packloader.sources.tar.TarShard`): the walk over the
member headers, the vectorised index of the common case, and the gather of token runs.

:func:`walk_tar` is the one pass over a tar's 512-byte headers (checksums verified, sizes, type flags,
truncation and end-of-archive checks); every tar shard is walked by it exactly once.

The common case: every member is a plain file (type ``'0'``) with a name of at most 100 bytes (no ustar
prefix, no GNU / pax long-name records), and every token / labels member carries the standard .npy v1.0
header numpy writes for a 1-D little-endian integer array. One Numba pass over the member headers finds
each member's key, its role (tokens, labels, bare ``KEY.npy``, other) and its array (data offset, length,
dtype); samples are then assembled with numpy, without a Python loop per member.

:func:`index_common_case` returns None whenever a shard falls outside that case (another member type, an
unusual .npy header, a sample without a token member, labels of another length, a role given twice, a member
name given twice in a sample or a key given twice in the shard), and
``TarShard`` then runs its general per-member indexer over the same walk, which also produces the error
messages. Both give the same index (checked by ``tests/packloader/sources/test_tar.py``). The standard
.npy header both expect is defined once, in :mod:`packloader.sources._npy`.

:func:`gather_runs` copies runs of an int32 array into one contiguous array (the tokens of a batch).
"""
from __future__ import annotations

import numpy as np

from packloader._numba import njit_cached
from packloader.sources._npy import STANDARD_PARTS

__all__ = ["walk_tar", "index_common_case", "gather_runs"]

_MAGIC, _HEAD1, _HEAD2, _TAIL = (np.frombuffer(p, np.uint8) for p in STANDARD_PARTS)
#: dtype code -> numpy dtype string (code = 4 * unsigned + log2(itemsize))
_DTYPES = np.array(["|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8"])
_I4 = 2
_NPY_BYTES = np.frombuffer(b"npy", np.uint8)

# member roles
_SKIP, _TOK, _LAB, _BARE, _OTHER = 0, 1, 2, 3, 4


@njit_cached(nogil=True, inline="always")
def _octal(buf, a, b):
    """The tar number field ``buf[a:b]``: octal digits, ended by NUL or space (leading ones skipped);
    -1 when another byte is in the way."""
    v = np.int64(0)
    seen = False
    for j in range(a, b):
        c = buf[j]
        if c >= 48 and c <= 55:
            v = v * 8 + (c - 48)
            seen = True
        elif c == 0 or c == 32:
            if seen:
                break
        else:
            return np.int64(-1)
    return v


@njit_cached(nogil=True)
def walk_tar(buf):
    """Walk the 512-byte tar headers of ``buf`` (uint8): (header positions, sizes, type flags, error code,
    error byte offset). Error codes: 1 truncated header, 2 bad number field, 3 bad checksum, 4 member data
    past the end, 5 no end-of-archive (zero) block after the last member."""
    n = buf.size
    cap = 64
    pos = np.empty(cap, np.int64)
    size = np.empty(cap, np.int64)
    flag = np.empty(cap, np.uint8)
    m = 0
    p = 0
    err = 0
    ended = False
    while p < n:
        if p + 512 > n:
            err = 1
            break
        zero = True
        for j in range(512):
            if buf[p + j] != 0:
                zero = False
                break
        if zero:
            ended = True
            break
        stored = _octal(buf, p + 148, p + 156)
        if stored < 0:
            err = 2
            break
        total = 256  # the checksum field counts as 8 spaces
        for j in range(148):
            total += buf[p + j]
        for j in range(156, 512):
            total += buf[p + j]
        if total != stored:
            err = 3
            break
        sz = 0
        if buf[p + 124] & 0x80:  # GNU base-256
            sz = buf[p + 124] & 0x7F
            for j in range(125, 136):
                sz = sz * 256 + buf[p + j]
        else:
            sz = _octal(buf, p + 124, p + 136)
            if sz < 0:
                err = 2
                break
        if p + 512 + sz > n:
            err = 4
            break
        if m == cap:
            cap *= 2
            pos2 = np.empty(cap, np.int64)
            size2 = np.empty(cap, np.int64)
            flag2 = np.empty(cap, np.uint8)
            pos2[:m] = pos[:m]
            size2[:m] = size[:m]
            flag2[:m] = flag[:m]
            pos, size, flag = pos2, size2, flag2
        pos[m] = p
        size[m] = sz
        flag[m] = buf[p + 156]
        m += 1
        p += 512 + ((sz + 511) // 512) * 512
    if err == 0 and p > n:  # the last member's padding is cut off: the file was truncated
        err = 4
        p = pos[m - 1]
    elif err == 0 and not ended:  # no zero block after the last member: cut at a member boundary
        err = 5
    return pos[:m].copy(), size[:m].copy(), flag[:m].copy(), err, p


@njit_cached(nogil=True)
def _ext_is(buf, a, n, ext):
    """Whether buf[a:a+n], lower-cased, equals ``ext`` (lower-case bytes)."""
    if n != ext.size:
        return False
    for j in range(n):
        c = buf[a + j]
        if 65 <= c <= 90:
            c += 32
        if c != ext[j]:
            return False
    return True


@njit_cached(nogil=True)
def _npy_fast(buf, d, size, magic, head1, head2, tail):
    """(data offset, item count, dtype code) of a standard 1-D integer .npy member at ``buf[d:d+size]``,
    or (-1, 0, 0) when its header is not the standard one."""
    fixed = magic.size + 2 + head1.size + 3 + head2.size
    if size < fixed + 1 + tail.size:
        return -1, 0, 0
    for j in range(magic.size):
        if buf[d + j] != magic[j]:
            return -1, 0, 0
    hlen = np.int64(buf[d + 8]) + 256 * np.int64(buf[d + 9])
    q = d + 10
    for j in range(head1.size):
        if buf[q + j] != head1[j]:
            return -1, 0, 0
    q += head1.size
    e, k, s = buf[q], buf[q + 1], buf[q + 2]
    if not (e == 60 or e == 124) or not (k == 105 or k == 117):  # '<' '|', 'i' 'u'
        return -1, 0, 0
    if s == 49:
        lg = 0
    elif s == 50:
        lg = 1
    elif s == 52:
        lg = 2
    elif s == 56:
        lg = 3
    else:
        return -1, 0, 0
    if e == 124 and lg != 0:  # '|' only for single bytes
        return -1, 0, 0
    q += 3
    for j in range(head2.size):
        if buf[q + j] != head2[j]:
            return -1, 0, 0
    q += head2.size
    end = d + min(size, 128)  # the header numpy writes fits in its first 128 bytes
    n = np.int64(0)
    nd = 0
    while q < end and 48 <= buf[q] <= 57 and nd < 18:
        n = n * 10 + (buf[q] - 48)
        q += 1
        nd += 1
    if nd == 0 or q + tail.size > end:
        return -1, 0, 0
    for j in range(tail.size):
        if buf[q + j] != tail[j]:
            return -1, 0, 0
    off = d + 10 + hlen
    itemsize = np.int64(1) << lg
    if off > d + size or off + n * itemsize != d + size:
        return -1, 0, 0
    return off, n, 4 * (k == 117) + lg


@njit_cached(nogil=True)
def _scan(buf, pos, sizes, flags, tok_ext, lab_ext, has_lab_ext, magic, head1, head2, tail, npy):
    """Roles, keys and arrays of all members; status 1 when a member is outside the common case."""
    m = pos.size
    role = np.zeros(m, np.int8)
    key_len = np.zeros(m, np.int64)
    new = np.zeros(m, np.bool_)
    off = np.full(m, -1, np.int64)
    cnt = np.zeros(m, np.int64)
    code = np.zeros(m, np.int8)
    name_hash = np.zeros(m, np.uint64)  # FNV-1a of the member's name, and of its key
    key_hash = np.zeros(m, np.uint64)
    prev = -1
    for i in range(m):
        p = pos[i]
        f = flags[i]
        if f != 48 and f != 0:  # not a plain file ('0', or NUL in old tars)
            return 1, role, key_len, new, off, cnt, code, name_hash, key_hash
        if buf[p + 257] == 117 and buf[p + 345] != 0:  # a ustar prefix: a name longer than 100 bytes
            return 1, role, key_len, new, off, cnt, code, name_hash, key_hash
        n = 0
        while n < 100 and buf[p + n] != 0:
            n += 1
        slash = -1
        for j in range(n):
            if buf[p + j] == 47:
                slash = j
        dot = -1
        for j in range(slash + 1, n):
            if buf[p + j] == 46:
                dot = j
                break
        if dot <= slash + 1:
            continue  # no extension or a hidden file: not part of any sample
        key_len[i] = dot
        h = np.uint64(14695981039346656037)
        for j in range(n):
            if j == dot:
                key_hash[i] = h
            h = (h ^ np.uint64(buf[p + j])) * np.uint64(1099511628211)
        name_hash[i] = h
        same = prev >= 0 and key_len[prev] == dot
        if same:
            q = pos[prev]
            for j in range(dot):
                if buf[q + j] != buf[p + j]:
                    same = False
                    break
        new[i] = not same
        prev = i
        a, el = p + dot + 1, n - dot - 1
        if _ext_is(buf, a, el, tok_ext):
            r = _TOK
        elif has_lab_ext and _ext_is(buf, a, el, lab_ext):
            r = _LAB
        elif _ext_is(buf, a, el, npy):
            r = _BARE
        else:
            role[i] = _OTHER
            continue
        o, c, t = _npy_fast(buf, p + 512, sizes[i], magic, head1, head2, tail)
        if o < 0:
            return 1, role, key_len, new, off, cnt, code, name_hash, key_hash
        role[i] = r
        off[i] = o
        cnt[i] = c
        code[i] = t
    return 0, role, key_len, new, off, cnt, code, name_hash, key_hash


def _one_per_sample(mask, sample, n_samples):
    """int64 [n_samples]: the member with ``mask`` in each sample (-1 if none); None if one has two."""
    idx = np.flatnonzero(mask)
    out = np.full(n_samples, -1, np.int64)
    if idx.size:
        s = sample[idx]
        if np.bincount(s, minlength=n_samples).max() > 1:
            return None
        out[s] = idx
    return out


def _keys(buf, pos, key_len, first) -> list:
    """The sample keys (str), decoded in one call: key bytes joined by NULs (a tar name has none)."""
    L = key_len[first]
    S = first.size
    if S == 0:
        return []
    total = int(L.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(L) - L, L)
    out = np.zeros(total + S - 1, np.uint8)
    dst_start = np.cumsum(L + 1) - (L + 1)
    out[np.repeat(dst_start, L) + within] = buf[np.repeat(pos[first], L) + within]
    return out.tobytes().decode("utf-8", "replace").split("\0")


def index_common_case(buf, pos, sizes, flags, tok_ext: bytes, lab_ext: bytes | None) -> dict | None:
    """Index a tar shard in the common case (see the module docstring).

    Args:
        buf: uint8 view of the whole file.
        pos, sizes, flags: member header positions, sizes and type flags (the tar walk's output).
        tok_ext: lower-case member extension of the tokens (``b"input_ids.npy"``).
        lab_ext: lower-case member extension of the labels, or None.

    Returns:
        The ``TarShard`` index attributes (``keys``, ``_tok_off``, ``_tok_n``, ``_tok_dt``, ``_lab_off``,
        ``_lab_n``, ``_lab_dt``, ``has_labels``, ``_fast_tok``, ``_fast_lab``), or None when the general
        indexer must run.
    """
    has_lab = lab_ext is not None
    status, role, key_len, new, off, cnt, code, name_hash, key_hash = _scan(
        buf, pos, sizes, flags, np.frombuffer(tok_ext, np.uint8),
        np.frombuffer(lab_ext if has_lab else b"-", np.uint8), has_lab, _MAGIC, _HEAD1, _HEAD2, _TAIL, _NPY_BYTES,
    )
    if status:
        return None
    first = np.flatnonzero(new)
    S = first.size
    named = name_hash[key_len > 0]
    if np.unique(named).size != named.size or np.unique(key_hash[first]).size != S:
        return None  # a member name twice in a sample, or a key twice in the shard (or a hash collision):
                     # the general indexer names it (or, for a collision, indexes the shard)
    sample = np.cumsum(new) - 1
    tok = _one_per_sample(role == _TOK, sample, S)
    bare = _one_per_sample(role == _BARE, sample, S)
    lab = _one_per_sample(role == _LAB, sample, S)
    if tok is None or bare is None or lab is None:
        return None
    tok = np.where(tok >= 0, tok, bare)
    if (tok < 0).any():
        return None  # a sample without tokens: the general indexer names it
    tok_n = cnt[tok]
    present = lab >= 0
    if (cnt[lab[present]] != tok_n[present]).any():
        return None  # labels of another length: the general indexer names the sample
    tok_off = off[tok]
    lab_off = np.where(present, off[np.maximum(lab, 0)], -1)
    lab_n = np.where(present, cnt[np.maximum(lab, 0)], 0)
    tok_code = code[tok]
    lab_code = code[np.maximum(lab, 0)]
    lab_dt = np.where(present, _DTYPES[lab_code], "")
    has_labels = bool(S) and bool(present.any())
    return {
        "keys": _keys(buf, pos, key_len, first),
        "_tok_off": tok_off.astype(np.int64),
        "_tok_n": tok_n.astype(np.int64),
        "_tok_dt": _DTYPES[tok_code].tolist(),
        "_lab_off": lab_off.astype(np.int64),
        "_lab_n": lab_n.astype(np.int64),
        "_lab_dt": lab_dt.tolist(),
        "has_labels": has_labels,
        "_fast_tok": bool((tok_code == _I4).all()) and not (tok_off % 4).any(),
        "_fast_lab": has_labels and bool((lab_code[present] == _I4).all()) and not (lab_off[present] % 4).any(),
    }


@njit_cached(nogil=True)
def gather_runs(src, starts, counts, total):
    """Concatenate ``src[starts[i]:starts[i] + counts[i]]`` for all i into a new int32 array of ``total``."""
    out = np.empty(total, np.int32)
    o = 0
    for i in range(starts.size):
        s = starts[i]
        c = counts[i]
        out[o:o + c] = src[s:s + c]
        o += c
    return out
