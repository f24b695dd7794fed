"""Shard paths: suffixes, brace and glob patterns, directories (:func:`resolve_sources`).

Brace patterns (``shard-{000..127}.tar``, ``{train,valid}/*.arrow``) are expanded by ``braceexpand``,
the package webdataset uses for the same patterns, so a pattern means here what it means there.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Iterable

from packloader.errors import DataError

__all__ = ["resolve_sources", "expand_braces", "shard_format", "ARROW_SUFFIXES", "PARQUET_SUFFIXES",
           "TAR_SUFFIXES", "SUPPORTED_SUFFIXES"]

ARROW_SUFFIXES = (".arrow", ".arrows", ".ipc", ".feather")
PARQUET_SUFFIXES = (".parquet", ".pq")
TAR_SUFFIXES = (".tar",)
#: ``scheme://``: a URI (see :mod:`packloader.sources.uri`)
_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
SUPPORTED_SUFFIXES = ARROW_SUFFIXES + PARQUET_SUFFIXES + TAR_SUFFIXES


def expand_braces(pattern: str) -> list[str]:
    """Expand shell-style brace patterns, as webdataset does (with ``braceexpand``).

    ``{a,b}`` alternates, ``{000..127}`` counts (zero-padded to the wider bound when a bound is), ``{0..10..2}``
    counts by a step and ``{a..e}`` runs over letters; braces nest and several may appear. A brace with
    neither ``,`` nor ``..`` is left as text; a backslash is an ordinary character (paths).

    Args:
        pattern: the pattern.

    Returns:
        The expanded strings, in order.

    Raises:
        DataError: unbalanced braces, naming the pattern.

    Example::

        >>> expand_braces("shard-{00..02}.{arrow,tar}")
        ['shard-00.arrow', 'shard-00.tar', 'shard-01.arrow', 'shard-01.tar', 'shard-02.arrow', 'shard-02.tar']
    """
    from braceexpand import UnbalancedBracesError, braceexpand

    try:
        return list(braceexpand(pattern, escape=False))
    except UnbalancedBracesError:
        raise DataError(f"pattern {pattern!r} has unbalanced braces (a file of that literal name does not "
                        "exist either)") from None


def shard_format(path) -> str:
    """Return ``"arrow"``, ``"parquet"`` or ``"tar"`` for a shard path, from its suffix.

    Raises:
        DataError: the suffix is not one of the supported ones.
    """
    name = os.fspath(path).lower()
    if name.endswith(ARROW_SUFFIXES):
        return "arrow"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TAR_SUFFIXES):
        return "tar"
    raise DataError(
        f"unsupported shard suffix; expected one of {', '.join(SUPPORTED_SUFFIXES)}", path=path
    )


def resolve_sources(patterns: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Expand shard patterns into a list of existing shard files.

    A pattern naming an existing file or directory literally is taken as is (so ``br[ack]et.arrow`` or
    ``a{1,2}.arrow`` can be addressed; :func:`glob.escape` works too). Otherwise it is brace-expanded
    (:func:`expand_braces`), then glob-expanded (``*``, ``?``, ``[...]``, ``**``); the matches of each glob
    are sorted. A directory stands for every supported shard (``.arrow``, ``.arrows``, ``.ipc``,
    ``.feather``, ``.parquet``, ``.pq``, ``.tar``) directly inside it, sorted; a directory written by
    ``packloader prepare`` stands for exactly the shards its ``prepare.json`` lists (so shards of another
    output set can never be counted twice). Duplicates are dropped, keeping the first occurrence: a file
    is identified by its device and inode, so one file under two names (relative and absolute, a symlink,
    a hard link, overlapping patterns) is read once, with a warning naming the merged names.

    A URI (``s3://bucket/tok/shard-{000..127}.arrow``, ``gs://bucket/tok/*.parquet``) is resolved on its
    filesystem's listing, the same way (:func:`packloader.sources.uri.resolve_uri`); a ``file://`` URI is the
    local path it names.

    Args:
        patterns: one pattern or an iterable of patterns (str or path-like).

    Returns:
        Paths (str), in pattern order.

    Warns:
        UserWarning: one file was given under several names (they are named; it is read once).

    Raises:
        DataError: a pattern matches no file (object), or names a file with an unsupported suffix; a directory
            written by ``packloader pack`` (a pre-packed directory, finished or not, is not a set of
            token shards); a ``prepare`` directory whose manifest lists a missing shard.

    Example::

        >>> resolve_sources(["data/shard-{000..127}.tar", "more/*.parquet"])   # doctest: +SKIP
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    out: list[str] = []
    seen: set[str] = set()
    by_identity: dict[tuple, str] = {}   # (st_dev, st_ino) -> the first name of a local file
    merged: dict[str, list[str]] = {}    # first name -> the other names of the same file
    for pattern in patterns:
        pattern = os.fspath(pattern)
        matched: list[str] = []
        if isinstance(pattern, str) and _URI_RE.match(pattern):
            from packloader.sources import uri

            local = uri.local_path(pattern)
            if local is None:
                for p in uri.resolve_uri(pattern):
                    if p not in seen:
                        seen.add(p)
                        out.append(p)
                continue
            pattern = local
        literal = os.path.exists(pattern)
        for expanded in ([pattern] if literal else expand_braces(pattern)):
            if os.path.isdir(expanded):
                hits = _directory_shards(expanded)
            elif not literal and glob.has_magic(expanded):
                hits = sorted(glob.glob(expanded, recursive=True))
                hits = [h for h in hits if os.path.isfile(h) and h.lower().endswith(SUPPORTED_SUFFIXES)]
            elif os.path.isfile(expanded):
                shard_format(expanded)  # raises on an unsupported suffix
                hits = [expanded]
            else:
                raise DataError(f"no such shard file (from pattern {pattern!r})", path=expanded)
            matched.extend(hits)
        if not matched:
            raise DataError(f"pattern {pattern!r} matches no shard file")
        for p in matched:
            if p in seen:
                continue
            seen.add(p)
            first = by_identity.setdefault(_identity(p), p)
            if first != p:  # another name (relative / absolute, symlink, hard link) of a file already listed
                merged.setdefault(first, []).append(p)
                continue
            out.append(p)
    if merged:
        import warnings

        shown = "; ".join(" = ".join(repr(n) for n in [first, *others]) for first, others in merged.items())
        warnings.warn(f"the same file was given under several names and is read once, under its first name: "
                      f"{shown}", UserWarning, stacklevel=2)
    return out


def _identity(path: str) -> tuple:
    """What makes a local file itself: its device and inode (one file under two names, a symlink or a hard
    link, is one file)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _directory_shards(d: str) -> list[str]:
    """The shards a directory stands for (see :func:`resolve_sources`)."""
    import json

    from packloader._outdir import owner_of

    owner = owner_of(d)
    if owner == "pack" or os.path.isfile(os.path.join(d, "index.json")):
        if os.path.isfile(os.path.join(d, "index.json")):
            raise DataError("a pre-packed directory (written by 'packloader pack'), not token shards: read it "
                            "with PackedDataLoader / PrepackedDataset, or give the original shards", path=d)
        raise DataError("not a finished pre-packed directory (written by 'packloader pack', but no index.json: "
                        "packing incomplete, failed, or still running)", path=d)
    manifest = os.path.join(d, "prepare.json")
    if owner == "prepare" and os.path.isfile(manifest):
        try:
            with open(manifest, encoding="utf-8") as f:
                m = json.load(f)
            names = m["shards"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"unreadable prepare manifest: {e}", path=manifest) from None
        if m.get("replacing"):
            raise DataError("'packloader prepare' did not finish replacing this directory's shards; run it "
                            "again", path=d)
        out = []
        for n in names:
            p = os.path.join(d, n)
            if not os.path.isfile(p):
                raise DataError(f"shard {n!r} listed in prepare.json is missing", path=d)
            out.append(p)
        return out
    return sorted(
        os.path.join(d, n) for n in os.listdir(d)
        if n.lower().endswith(SUPPORTED_SUFFIXES) and os.path.isfile(os.path.join(d, n))
    )
