"""Shards named by URI (``s3://``, ``gs://``, ``hdfs://``, ...), read through pyarrow filesystems.

A URI is opened with :meth:`pyarrow.fs.FileSystem.from_uri` wherever it is read (the driver, a process-pool
worker, a Ray task): the filesystem is re-created from the URI and the process's own environment, so no
credentials travel with the tasks or land in ``index.json``. Credentials and endpoints come from the
filesystem's standard configuration: for S3 ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` (S3-compatible stores), ``~/.aws``,
an instance role; for GCS ``GOOGLE_APPLICATION_CREDENTIALS`` or the VM's service account. pyarrow's own
URI options work too (``s3://bucket/key?region=eu-west-1&endpoint_override=host:9000&scheme=http``); a
URI carrying a secret (``s3://key:secret@bucket/...``) is refused.

``file://`` URIs are local paths: :func:`local_path` turns them into one, and they take the local
(memory-mapped) readers.

Patterns, as for paths (:func:`packloader.sources.resolve_sources`)::

    s3://bucket/tok/shard-{000..127}.arrow     braces, expanded first (``braceexpand``)
    s3://bucket/tok/*.parquet                  ``*`` within one path segment, ``**`` across segments,
    gs://bucket/tok/**/part-[0-9]*.tar         ``[...]`` character classes: matched against the
                                               filesystem's listing (``FileSelector``), sorted
    s3://bucket/tok/                           every supported shard directly inside the prefix
                                               (a ``prepare`` output: the shards its ``prepare.json`` lists)

``?`` begins pyarrow's query options in a URI, so it is not a wildcard here (use ``[0-9]``). The URI is
percent-encoded as pyarrow expects (a space is ``%20``); the URIs this module returns are too. Each
pattern must match at least one object, and a literal URI must name an existing object: otherwise a
:class:`~packloader.errors.DataError` names the URI.

How objects are read (:func:`read_object`, :func:`open_random_access`): Arrow IPC and tar shards, whose
readers need every byte, are read whole into memory in one sequential read (checked against the object's
size), then parsed exactly as a memory map of a local file is; Parquet shards are read through a
random-access file (only the token and labels columns are fetched). A shard's identity
(:func:`object_digest`) is its size, modification time and a hash of its first and last 64 KiB.
"""
from __future__ import annotations

import hashlib
import re
from urllib.parse import quote, unquote, urlsplit

from packloader.errors import DataError
from packloader.sources.patterns import _URI_RE, SUPPORTED_SUFFIXES, expand_braces, shard_format

__all__ = ["is_uri", "local_path", "filesystem", "object_info", "read_object", "open_random_access",
           "resolve_uri", "object_digest"]

#: glob characters in a URI (``?`` is the query)
_MAGIC = re.compile(r"[*\[]")
#: bytes hashed at each end of an object by :func:`object_digest`
DIGEST_BLOCK = 1 << 16


def is_uri(x) -> bool:
    """Whether ``x`` is a string of the form ``scheme://...``."""
    return isinstance(x, str) and _URI_RE.match(x) is not None


def local_path(uri: str) -> str | None:
    """The local path a ``file://`` URI names (percent-decoded), else None."""
    if not uri[:7].lower() == "file://":
        return None
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise DataError("a file:// URI must name a local path (file:///abs/path)", path=uri)
    if parts.query:
        raise DataError("a file:// URI takes no query options", path=uri)
    return unquote(parts.path)


def _check(uri: str) -> None:
    parts = urlsplit(uri)
    if parts.password is not None:
        shown = uri.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[-1], 1)
        raise DataError("the URI carries a secret (user:secret@...): it would be recorded in index.json and sent "
                        "to every worker; give credentials through the filesystem's environment instead "
                        "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, ...)",
                        path=shown)


def filesystem(uri: str):
    """``(pyarrow filesystem, path in it)`` for ``uri`` (:meth:`pyarrow.fs.FileSystem.from_uri`).

    Raises:
        DataError: a URI pyarrow cannot parse or whose filesystem it cannot create (unknown scheme,
            unreachable region lookup, ...), naming the URI.
    """
    import pyarrow as pa
    from pyarrow import fs as pafs

    _check(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"cannot open the filesystem of this URI: {type(e).__name__}: {e}", path=uri) from None


def object_info(uri: str):
    """``(filesystem, path, FileInfo)`` of the object ``uri`` names.

    Raises:
        DataError: no such object (or it is a directory), or the store cannot be reached; naming the URI.
    """
    from pyarrow import fs as pafs

    fs, path = filesystem(uri)
    try:
        info = fs.get_file_info(path)
    except OSError as e:
        raise DataError(f"cannot read the object's metadata: {e}", path=uri) from None
    if info.type == pafs.FileType.NotFound:
        raise DataError("no such object", path=uri)
    if info.type != pafs.FileType.File:
        raise DataError("not a file (a directory or prefix?)", path=uri)
    return fs, path, info


def read_object(uri: str):
    """The whole object as a :class:`pyarrow.Buffer`, read in one sequential pass.

    Raises:
        DataError: missing object, a read error, or fewer / more bytes than the object's size (it
            changed while being read): naming the URI.
    """
    fs, path, info = object_info(uri)
    try:
        with fs.open_input_file(path) as f:
            buf = f.read_buffer()
    except OSError as e:
        raise DataError(f"cannot read object: {e}", path=uri) from None
    if buf.size != info.size:
        raise DataError(f"read {buf.size} bytes of an object of {info.size} bytes (it changed while being read?)",
                        path=uri)
    return buf


def open_random_access(uri: str):
    """A random-access pyarrow file of the object (for Parquet: only the columns read are fetched)."""
    fs, path, info = object_info(uri)
    try:
        return fs.open_input_file(path)
    except OSError as e:
        raise DataError(f"cannot open object: {e}", path=uri) from None


def object_digest(uri: str) -> str:
    """A cheap identity of an object: its size, modification time and a blake2b of its first and last
    64 KiB (two ranged reads: the digests of many shards are taken by the driver, one round trip each)."""
    fs, path, info = object_info(uri)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{info.size}:{info.mtime_ns}".encode())
    try:
        with fs.open_input_file(path) as f:
            if info.size <= 2 * DIGEST_BLOCK:
                h.update(f.read_buffer())
            else:
                h.update(f.read_at(DIGEST_BLOCK, 0))
                h.update(f.read_at(DIGEST_BLOCK, info.size - DIGEST_BLOCK))
    except OSError as e:
        raise DataError(f"cannot read object: {e}", path=uri) from None
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# patterns


def _split(uri: str) -> tuple[str, str, str]:
    """``(scheme, rest without the query, "?query" or "")``."""
    scheme, rest = uri.split("://", 1)
    query = ""
    if "?" in rest:
        rest, q = rest.split("?", 1)
        query = "?" + q
    return scheme, rest, query


def _glob_regex(raw: str) -> re.Pattern:
    """A regex of the glob ``raw`` (percent-encoded literal parts are decoded): ``*`` within a segment,
    ``**`` across segments (``**/``: zero or more segments), ``[...]`` / ``[!...]`` classes."""
    out, lit, i, n = [], [], 0, len(raw)

    def flush():
        if lit:
            out.append(re.escape(unquote("".join(lit))))
            lit.clear()

    while i < n:
        if raw.startswith("**/", i):
            flush(); out.append("(?:[^/]*/)*"); i += 3
        elif raw.startswith("**", i):
            flush(); out.append(".*"); i += 2
        elif raw[i] == "*":
            flush(); out.append("[^/]*"); i += 1
        elif raw[i] == "[" and raw.find("]", i + 2) > 0:
            j = raw.find("]", i + 2)
            body = unquote(raw[i + 1:j])
            neg = body.startswith("!")
            body = body[1:] if neg else body
            flush(); out.append(("[^/" if neg else "[") + body.replace("\\", "\\\\") + "]"); i = j + 1
        else:
            lit.append(raw[i]); i += 1
    flush()
    return re.compile("".join(out) + r"\Z", re.S)


def resolve_uri(pattern: str) -> list[str]:
    """The object URIs a URI pattern stands for (see the module docstring), in pattern order.

    Raises:
        DataError: the pattern matches no shard, names a missing object or an unsupported suffix, a
            pre-packed directory; naming the pattern or URI.
    """
    out: list[str] = []
    for expanded in expand_braces(pattern):
        hits = _resolve_one(pattern, expanded)
        out.extend(hits)
    if not out:
        raise DataError(f"pattern {pattern!r} matches no shard object")
    return out


def _resolve_one(pattern: str, uri: str) -> list[str]:
    from pyarrow import fs as pafs

    scheme, rest, query = _split(uri)
    m = _MAGIC.search(rest)
    if m is None:
        fs, path = filesystem(uri)
        try:
            info = fs.get_file_info(path)
        except OSError as e:
            raise DataError(f"cannot read the object's metadata: {e}", path=uri) from None
        if info.type == pafs.FileType.File:
            shard_format(rest)  # raises on an unsupported suffix
            return [uri]
        if info.type == pafs.FileType.Directory:
            return _directory_objects(fs, path, f"{scheme}://{rest.rstrip('/')}", query)
        raise DataError(f"no such object (from pattern {pattern!r})", path=uri)
    slash = rest.rfind("/", 0, m.start())
    if slash <= 0:
        raise DataError("the bucket (or host) of a URI cannot be a pattern", path=uri)
    base = f"{scheme}://{rest[:slash]}"
    regex = _glob_regex(rest[slash:])
    fs, base_path = filesystem(base + query)
    base_path = base_path.rstrip("/")
    recursive = "/" in rest[slash + 1:] or "**" in rest[slash:]
    try:
        infos = fs.get_file_info(pafs.FileSelector(base_path, recursive=recursive, allow_not_found=True))
    except OSError as e:
        raise DataError(f"cannot list {base!r}: {e}", path=uri) from None
    hits = []
    for info in infos:
        if info.type != pafs.FileType.File or not info.path.startswith(base_path + "/"):
            continue
        rel = info.path[len(base_path):]
        if regex.match(rel) and rel.lower().endswith(SUPPORTED_SUFFIXES):
            hits.append((rel, base + quote(rel, safe="/") + query))
    return [u for _, u in sorted(hits)]


def _directory_objects(fs, path: str, dir_uri: str, query: str) -> list[str]:
    """The shards a directory (prefix) stands for: as :func:`packloader.sources.patterns._directory_shards`
    (a ``prepare`` output: its manifest's shards; a ``pack`` output: refused)."""
    import json

    from pyarrow import fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=False))
    except OSError as e:
        raise DataError(f"cannot list: {e}", path=dir_uri + query) from None
    files = {i.base_name: i for i in infos if i.type == pafs.FileType.File}

    def uri_of(name):
        return f"{dir_uri}/{quote(name, safe='')}{query}"

    if "index.json" in files:
        raise DataError("a pre-packed directory (written by 'packloader pack'), not token shards: give the "
                        "original shards", path=dir_uri + query)
    if "prepare.json" in files:
        try:
            with fs.open_input_file(files["prepare.json"].path) as f:
                m = json.loads(f.read_buffer().to_pybytes())
            names = m["shards"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"unreadable prepare manifest: {e}", path=uri_of("prepare.json")) from None
        if m.get("replacing"):
            raise DataError("'packloader prepare' did not finish replacing this directory's shards; run it "
                            "again", path=dir_uri + query)
        for n in names:
            if n not in files:
                raise DataError(f"shard {n!r} listed in prepare.json is missing", path=dir_uri + query)
        return [uri_of(n) for n in names]
    return [uri_of(n) for n in sorted(files) if n.lower().endswith(SUPPORTED_SUFFIXES)]
