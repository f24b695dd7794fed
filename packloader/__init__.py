"""packloader: token shards in, packed batches out.

Sources (Arrow / Parquet / WebDataset), offline pre-packing to Arrow, packing reports, the
``packloader`` command line, and :class:`PackedDataLoader`, a drop-in loader of packed batches.

Public names are imported lazily so that ``import packloader`` stays cheap (no Numba compile, no torch
import) until a name is used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "PackedDataLoader": "packloader.loader",
    "PackingReport": "packloader.report",
    "pack_dataset": "packloader.pack_writer",
    "prepare_jsonl": "packloader.prepare",
    "PrepackedDataset": "packloader.prepacked",
    "resolve_sources": "packloader.sources",
    "open_shard": "packloader.sources",
    "DataError": "packloader.errors",
    "collate_packed": "packloader.batch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'packloader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
