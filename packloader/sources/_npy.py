"""The ``.npy`` format as packloader writes and reads it: 1-D integer arrays (WebDataset tar members).

One definition of the header numpy writes for a 1-D little-endian array (:data:`HEADER_TEMPLATE`, version
1.0, padded to 64 bytes): :func:`header` writes it (``packloader prepare``), the tar index's Numba scan
matches it byte for byte (:data:`STANDARD_PARTS`), and :func:`parse_header` reads any other valid
header (version 2/3, other key order or spacing, shape ``(n, 1)``) and names what is wrong with a bad one.
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["MAGIC", "HEADER_TEMPLATE", "STANDARD_PARTS", "header", "parse_header"]

MAGIC = b"\x93NUMPY"
#: the header dict numpy writes for a C-ordered 1-D array (``descr`` e.g. ``<i4``, ``n`` the length)
HEADER_TEMPLATE = "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({n},), }}"
#: the version-1.0 prefix and the template's fixed pieces around ``descr`` and ``n`` (as bytes)
STANDARD_PARTS = (MAGIC + b"\x01\x00",) + tuple(
    p.encode() for p in re.split(r"\{descr\}|\{n\}", HEADER_TEMPLATE.replace("{{", "{").replace("}}", "}")))

_DESCR = re.compile(rb"""['"]descr['"]\s*:\s*['"]([^'"]+)['"]""")
_SHAPE = re.compile(rb"""['"]shape['"]\s*:\s*\(([^)]*)\)""")


def header(n: int, descr: str = "<i4") -> bytes:
    """The .npy (version 1.0) header of a 1-D array of ``n`` items of ``descr``, padded to a multiple
    of 64 bytes (as ``numpy.save`` writes it)."""
    d = HEADER_TEMPLATE.format(descr=descr, n=int(n))
    pad = 64 - (10 + len(d) + 1) % 64
    d = d + " " * (pad % 64) + "\n"
    return STANDARD_PARTS[0] + len(d).to_bytes(2, "little") + d.encode("latin1")


def parse_header(buf, data: int, size: int) -> tuple[int, int, str]:
    """Read the header of a 1-D integer ``.npy`` array stored at ``buf[data:data + size]``.

    Args:
        buf: the bytes (a memory map, ``bytes``).
        data: where the ``.npy`` data starts.
        size: its size in bytes (the tar member's size).

    Returns:
        ``(offset, count, dtype str)``: where the array's values start in ``buf``, how many there are,
        and their numpy dtype string (e.g. ``"<i4"``).

    Raises:
        ValueError: not a ``.npy`` array, a corrupt header, a non-integer dtype, more than one
            dimension of length > 1, or a size that does not match the shape (the message says which).
    """
    if size < 10 or bytes(buf[data:data + 6]) != MAGIC:
        raise ValueError("member is not a .npy array (bad magic)")
    if buf[data + 6] == 1:
        hlen, hstart = int.from_bytes(buf[data + 8:data + 10], "little"), data + 10
    else:
        hlen, hstart = int.from_bytes(buf[data + 8:data + 12], "little"), data + 12
    head = bytes(buf[hstart:hstart + hlen])
    d, s = _DESCR.search(head), _SHAPE.search(head)
    if d is None or s is None or hstart + hlen > data + size:
        raise ValueError("member has a corrupt .npy header")
    descr = d.group(1).decode("latin-1")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise ValueError(f"member has an unknown dtype {descr!r}") from None
    if dtype.kind not in "iu":
        raise ValueError(f"member holds {dtype} values; token ids must be integers")
    try:
        dims = [int(x) for x in s.group(1).replace(b" ", b"").split(b",") if x]
    except ValueError:
        raise ValueError("member has a corrupt .npy shape") from None
    if len(dims) > 1 and sum(1 for x in dims if x != 1) > 1:
        raise ValueError(f"member has shape {tuple(dims)}; expected a 1-D array")
    n = int(np.prod(dims)) if dims else 1
    off = hstart + hlen
    if off + n * dtype.itemsize != data + size:  # a damaged shape must not drop or invent tokens
        raise ValueError(f"member {'is truncated' if off + n * dtype.itemsize > data + size else 'has extra bytes'}: "
                         f"shape {tuple(dims)} needs {n * dtype.itemsize} bytes, {data + size - off} present")
    return off, n, dtype.str
