"""Token shards in: Arrow IPC (memory-mapped), Parquet and WebDataset tar shards.

One module per concept: :mod:`~packloader.sources.patterns` (paths, braces, globs, directories),
:mod:`~packloader.sources.base` (:class:`SequenceBatch`, the :class:`Shard` interface, the id checks),
:mod:`~packloader.sources.arrow`, :mod:`~packloader.sources.parquet`, :mod:`~packloader.sources.tar` (reader
and writer; its Numba walk and index in ``_tarindex``; the ``.npy`` header in ``_npy``),
:mod:`~packloader.sources.uri` (shards named by URI, ``s3://`` / ``gs://`` / ..., read through pyarrow
filesystems). This module re-exports their public names and picks the reader (:func:`open_shard`).

A *shard* is one file of tokenized sequences. :func:`open_shard` picks a reader by the file's suffix and
returns a :class:`Shard`, which yields :class:`SequenceBatch` es: flat ``int32`` token arrays plus
``int64`` offsets, read through pyarrow record batches (``.values`` / ``.offsets``) or straight out of
a memory-mapped tar, without a Python loop per token.

========================================  ==========================================================
suffix                                    reader
========================================  ==========================================================
``.arrow`` / ``.ipc`` / ``.feather``      Arrow IPC file (or stream), memory-mapped, zero-copy;
``.arrows``                               a stream must end with its end-of-stream marker
``.parquet`` / ``.pq``                    Parquet, read in record batches of ``batch_rows`` rows
``.tar``                                  WebDataset tar; members ``KEY.input_ids.npy`` (or
                                          ``KEY.npy``) and optional ``KEY.labels.npy``
========================================  ==========================================================

Example::

    >>> from packloader.sources import resolve_sources, open_shard
    >>> paths = resolve_sources(["data/shard-{000..003}.arrow"])        # doctest: +SKIP
    >>> shard = open_shard(paths[0])                                     # doctest: +SKIP
    >>> len(shard), shard.lengths()[:3]                                  # doctest: +SKIP
    (5000, array([212, 87, 1033]))
    >>> for b in shard.iter_batches():                                   # doctest: +SKIP
    ...     first = b.tokens[b.offsets[0]:b.offsets[1]]                  # sequence b.row_start

Token columns are ``list<int32>`` or ``large_list<int32>`` (other integer value types are accepted and
converted when every id fits in int32); float values, nulls, negative ids, a missing column and a corrupt
file raise :class:`~packloader.errors.DataError` naming the file and the row.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from packloader.errors import DataError
from packloader.sources import uri
from packloader.sources.arrow import ArrowShard
from packloader.sources.base import DEFAULT_BATCH_ROWS, SequenceBatch, Shard, concat_batches
from packloader.sources.parquet import ParquetShard
from packloader.sources.patterns import (ARROW_SUFFIXES, PARQUET_SUFFIXES, SUPPORTED_SUFFIXES, TAR_SUFFIXES,
                                         expand_braces, resolve_sources, shard_format)
from packloader.sources.tar import TarShard

__all__ = [
    "SequenceBatch",
    "Shard",
    "ArrowShard",
    "ParquetShard",
    "TarShard",
    "open_shard",
    "resolve_sources",
    "expand_braces",
    "shard_format",
    "concat_batches",
    "ARROW_SUFFIXES",
    "PARQUET_SUFFIXES",
    "TAR_SUFFIXES",
    "SUPPORTED_SUFFIXES",
    "DEFAULT_BATCH_ROWS",
]


def open_shard(
    path,
    token_column: str = "input_ids",
    labels_column: str | None = "labels",
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    vocab_size: int | None = None,
) -> Shard:
    """Open one shard, choosing the reader by its suffix.

    Args:
        path: the shard file (``.arrow`` / ``.ipc`` / ``.feather``, ``.parquet`` / ``.pq``, ``.tar``), or its
            URI (``s3://bucket/tok/shard-000.arrow``; read through a pyarrow filesystem, see
            :mod:`packloader.sources.uri`).
        token_column: the column (or, in a tar, the member ``KEY.<token_column>.npy``; ``KEY.npy`` is
            accepted too) holding the token ids. Default ``"input_ids"``.
        labels_column: the optional labels column / member (``-100`` marks tokens without loss). When
            the shard lacks it, the labels are the inputs (``SequenceBatch.labels is None``). ``None``
            ignores labels altogether.
        batch_rows: sequences per batch for Parquet and tar shards.
        vocab_size: optional; reading a token id ``>= vocab_size`` raises a DataError naming the file and
            row.

    Returns:
        An :class:`ArrowShard`, :class:`ParquetShard` or :class:`TarShard`.

    Raises:
        DataError: unsupported suffix, missing, unreadable or corrupt file (or object), missing token
            column, wrong type; naming the path or URI.
    """
    path = os.fspath(path)
    remote = uri.is_uri(path) and uri.local_path(path) is None
    if not remote and uri.is_uri(path):
        path = uri.local_path(path)
    fmt = shard_format(path.split("?", 1)[0] if remote else path)
    if not remote and not os.path.isfile(path):
        raise DataError("no such file", path=path)
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer))
                                   or vocab_size < 1):
        raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
    # a URI: the object in memory (Arrow IPC, tar: their readers need every byte) or a random-access
    # file (Parquet: only the columns read are fetched); a path: memory-mapped (packloader.sources.uri)
    if fmt == "arrow":
        shard = ArrowShard(path, token_column, labels_column,
                           source=pa.BufferReader(uri.read_object(path)) if remote else None)
    elif fmt == "parquet":
        shard = ParquetShard(path, token_column, labels_column, batch_rows=batch_rows,
                             source=uri.open_random_access(path) if remote else None)
    else:
        shard = TarShard(path, token_column, labels_column, batch_rows=batch_rows,
                         data=uri.read_object(path) if remote else None)
    shard.vocab_size = None if vocab_size is None else int(vocab_size)
    return shard
