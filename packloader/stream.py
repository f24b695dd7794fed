"""Row sources of :class:`packloader.PackedDataLoader`: what the rows of an epoch are, and how to build them.

Two small stages with one interface (``fingerprint``, ``capacity``, ``epoch_rows(seed, epoch, shuffle)``
-> the real-token count of each row of the epoch's plan, ``build(epoch, rows)`` -> numpy row arrays):

* :class:`StreamingRows` packs token shards (Arrow / Parquet / WebDataset tar) *online*. The epoch's
  packing plan is computed from sequence lengths only (cheap: Arrow offsets, tar member sizes), in a
  deterministic stream order::

      shards in an order shuffled by (seed, epoch)       e.g.  s2  s0  s1
      sequences of each shard shuffled by (seed, epoch)        s2[7] s2[1] ... s0[4] s0[0] ... s1[..]
      the packer over that stream (default "online":           [s2[7] s2[1] s2[3] pad] [s2[0] s2[5]] ...
        packer_algos.OnlinePacker, buffer of `buffer_size`)

  Rows come out of the packer in stream order, so consecutive rows draw on the same one or two shards.
  Tokens are read only when a row is built, from a small per-process cache of decoded shards
  (:class:`ShardCache`). Because the plan is a pure function of (lengths, settings, seed, epoch), a
  resumed loader recomputes it and lands on exactly the rows of the uninterrupted run, including
  sequences that an online packer would have been holding in its buffer at the cut: no packer state,
  shard position or token data needs to be saved.

  Every rank computes the whole epoch's plan (packing is Numba and needs only the lengths: about a
  second per 10 million sequences; memory about 40 bytes per sequence), and then builds only its own
  rows. The alternative, each rank packing only its own shards, would save that time but cannot give
  every rank the same number of rows without communication, and makes the data order depend on the
  world size. No rank, world size or worker count goes into the plan, which is what lets a loader state
  resume on another number of ranks (see "Exact and elastic resume" in :mod:`packloader.loader`).
  With an offline algorithm (``"bfd"``, ``"ffd"``, ...) the epoch's rows are shuffled as a
  whole, so rows draw on all shards: fine for memory-mapped Arrow, slow for Parquet / tar.

* :class:`PrepackedRows` reads a directory written by ``packloader pack`` through
  :class:`packloader.prepacked.PrepackedDataset` (memory-mapped, zero-copy): the plan is its rows,
  in an order shuffled by (seed, epoch).
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

import numpy as np

from packloader.batch import raw_alloc
from packloader.errors import DataError

__all__ = ["EpochPlan", "overflow_counts", "StreamingRows", "PrepackedRows", "ShardCache", "epoch_rng", "is_prepacked_dir"]

_SALT_SHARDS = 0x5A4D
_SALT_SEQS = 0x5E95
_SALT_ROWS = 0x70E5


def epoch_rng(seed: int, epoch: int, salt: int, extra: int = 0) -> np.random.Generator:
    """The deterministic generator of one shuffling decision of one epoch."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFF, int(epoch), salt, int(extra)])


def is_prepacked_dir(source) -> bool:
    """Whether ``source`` is a directory holding a pre-packed ``index.json``."""
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        return os.path.isdir(p) and os.path.isfile(os.path.join(p, "index.json"))
    return False


def overflow_counts(policy: str | None, sequences: int, tokens: int, capacity: int) -> dict:
    """What an overflow policy did: ``sequences`` longer than ``capacity`` holding ``tokens`` tokens.

    Keys: ``policy``; ``split`` / ``truncated`` / ``dropped``: sequences split into pieces, cut to
    ``capacity`` tokens, or left out; ``split_tokens``: tokens of split sequences (all still trained on,
    in several pieces); ``lost_tokens``: tokens never trained on (cut off or dropped)."""
    n = int(sequences)
    return {
        "policy": policy,
        "split": n if policy == "split" else 0,
        "truncated": n if policy == "truncate" else 0,
        "dropped": n if policy == "drop" else 0,
        "split_tokens": int(tokens) if policy == "split" else 0,
        "lost_tokens": (int(tokens) - n * int(capacity) if policy == "truncate"
                        else int(tokens) if policy == "drop" else 0),
    }


class EpochPlan:
    """The packed rows of one epoch, as flat piece arrays (CSR over rows).

    Attributes:
        row_offsets: int64 [N + 1]: row ``r``'s pieces are ``row_offsets[r]:row_offsets[r+1]``.
        shard, row, start, length: int64 [n_pieces]: source shard index, sequence index in that
            shard, first token of the piece inside the sequence, and piece length.
        row_tokens: int64 [N]: real tokens per row.
    """

    __slots__ = ("row_offsets", "shard", "row", "start", "length", "row_tokens")

    def __init__(self, row_offsets, shard, row, start, length):
        self.row_offsets = row_offsets
        self.shard, self.row, self.start, self.length = shard, row, start, length
        self.row_tokens = np.add.reduceat(length, row_offsets[:-1]) if len(length) else np.zeros(0, np.int64)
        # reduceat gives wrong answers for empty rows; rows are never empty in a plan
        if len(row_offsets) > 1 and np.any(np.diff(row_offsets) == 0):
            raise AssertionError("empty row in a packing plan")

    def __len__(self) -> int:
        return len(self.row_offsets) - 1


class ShardCache:
    """Decoded shards, least recently used first out; one per process (never pickled).

    A cached shard is ``(offsets int64 [n+1], tokens int32, labels int32 or None)`` for the whole shard.
    Arrow IPC files with a single record batch are views of the memory map (no copy); others are
    concatenated once.
    """

    def __init__(self, paths, token_column, labels_column, max_shards: int):
        self.paths = list(paths)
        self.token_column, self.labels_column = token_column, labels_column
        self.max_shards = max(1, int(max_shards))
        self._cache: OrderedDict[int, tuple] = OrderedDict()
        self.loads = 0  # shards decoded so far (for tests / benchmarks)

    def get(self, shard: int):
        hit = self._cache.get(shard)
        if hit is not None:
            self._cache.move_to_end(shard)
            return hit
        from packloader.sources import open_shard

        sh = open_shard(self.paths[shard], token_column=self.token_column, labels_column=self.labels_column)
        whole = sh.read_all()  # a view of the memory map for one-record-batch Arrow files
        offsets, tokens, labels = whole.offsets, whole.tokens, whole.labels
        entry = (np.asarray(offsets, np.int64), tokens, labels)
        self._cache[shard] = entry
        self.loads += 1
        while len(self._cache) > self.max_shards:
            self._cache.popitem(last=False)
        return entry


class StreamingRows:
    """Rows packed online from token shards (see the module docstring).

    Args:
        paths: shard files (from :func:`packloader.sources.resolve_sources`), in a fixed order.
        capacity: tokens per row.
        algorithm: ``"online"`` (default of the loader) or an offline ``packer_algos`` algorithm.
        buffer_size: the online packer's buffer (``"online"`` only).
        overflow: what to do with a sequence longer than ``capacity`` (``packer_algos`` policies).
        max_items_per_bin: optional cap on sequences per row.
        token_column, labels_column: passed to :func:`packloader.sources.open_shard`.
        shard_cache: decoded shards kept per process.

    Raises:
        DataError: a shard cannot be read, or the source holds no tokens at all.
    """

    kind = "streaming"

    def __init__(self, paths, capacity: int, *, algorithm: str = "online", buffer_size: int = 1000,
                 overflow: str = "error", max_items_per_bin: int | None = None,
                 token_column: str = "input_ids", labels_column: str | None = "labels", shard_cache: int = 3):
        from packloader.sources import open_shard

        self.paths = [os.fspath(p) for p in paths]
        self.capacity = int(capacity)
        self.algorithm, self.buffer_size, self.overflow = algorithm, int(buffer_size), overflow
        self.max_items_per_bin = max_items_per_bin
        self.token_column, self.labels_column = token_column, labels_column
        self.shard_cache = int(shard_cache)
        self.lengths: list[np.ndarray] = []
        self.has_labels = False
        for p in self.paths:
            sh = open_shard(p, token_column=token_column, labels_column=labels_column)
            try:
                self.lengths.append(np.asarray(sh.lengths(), dtype=np.int64))
                self.has_labels |= bool(sh.has_labels)
            finally:
                sh.close()
        from packloader.prepacked import check_fits

        n_over = over_tokens = 0
        for p, ln in zip(self.paths, self.lengths):
            n, t = check_fits(ln, self.capacity, overflow, path=p)
            n_over += n
            over_tokens += t
        #: what the overflow policy does to the source, the same every epoch (see
        #: :attr:`packloader.PackedDataLoader.overflow_counts`)
        self.overflow_counts = overflow_counts(overflow, n_over, over_tokens, self.capacity)
        self.total_tokens = int(sum(int(x.sum()) for x in self.lengths))
        if self.total_tokens == 0:
            shown = self.paths if len(self.paths) <= 3 else self.paths[:3] + ["..."]
            raise DataError(f"source holds no tokens ({len(self.paths)} shard(s): {', '.join(shown)})",
                            path=self.paths[0] if len(self.paths) == 1 else None)
        h = hashlib.sha256()
        for p, ln in zip(self.paths, self.lengths):
            h.update(os.path.basename(p).encode() + b"\0")
            h.update(np.ascontiguousarray(ln, dtype="<i8").tobytes())
        self.fingerprint = "stream:" + h.hexdigest()[:24]
        self._plan_cache: tuple | None = None
        self._shards: ShardCache | None = None

    def __getstate__(self):  # workers get the lengths and the cached plan, never open files
        d = dict(self.__dict__)
        d["_shards"] = None
        return d

    # -- the plan ------------------------------------------------------------------------------------

    def stream_order(self, seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of every sequence in the epoch's stream order."""
        n_shards = len(self.paths)
        order = epoch_rng(seed, epoch, _SALT_SHARDS).permutation(n_shards) if shuffle else np.arange(n_shards)
        shard_parts, row_parts = [], []
        for s in order.tolist():
            n = len(self.lengths[s])
            rows = epoch_rng(seed, epoch, _SALT_SEQS, s).permutation(n) if shuffle else np.arange(n)
            shard_parts.append(np.full(n, s, dtype=np.int64))
            row_parts.append(rows.astype(np.int64))
        return np.concatenate(shard_parts), np.concatenate(row_parts)

    def plan(self, seed: int, epoch: int, shuffle: bool) -> EpochPlan:
        key = (int(seed), int(epoch), bool(shuffle))
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        from packer_algos import pack

        shard_of, row_of = self.stream_order(seed, epoch, shuffle)
        lens = np.concatenate(self.lengths)
        # lengths in stream order: gather through per-shard offsets
        shard_base = np.concatenate([[0], np.cumsum([len(x) for x in self.lengths])]).astype(np.int64)
        stream_lens = lens[shard_base[shard_of] + row_of]
        kw = {"overflow": self.overflow, "max_items_per_bin": self.max_items_per_bin}
        if self.algorithm == "online":
            kw["buffer_size"] = self.buffer_size
        else:
            kw["seed"] = int(epoch_rng(seed, epoch, _SALT_ROWS, 1).integers(2**31)) if shuffle else None
        p = pack(stream_lens, self.capacity, self.algorithm, **kw)
        offsets = np.asarray(p.bin_offsets, np.int64)
        items = np.asarray(p.item_ids, np.int64)
        starts = np.asarray(p.starts, np.int64)
        plen = np.asarray(p.lengths, np.int64)
        if self.algorithm != "online" and shuffle and p.n_bins > 1:
            perm = epoch_rng(seed, epoch, _SALT_ROWS).permutation(p.n_bins)
            counts = np.diff(offsets)[perm]
            new_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            idx = np.repeat(offsets[:-1][perm] - new_off[:-1], counts) + np.arange(new_off[-1])
            offsets, items, starts, plen = new_off, items[idx], starts[idx], plen[idx]
        ep = EpochPlan(offsets, shard_of[items], row_of[items], starts, plen)
        self._plan_cache = (key, ep)
        return ep

    def epoch_rows(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        return self.plan(seed, epoch, shuffle).row_tokens

    # -- building rows ---------------------------------------------------------------------------------

    def build(self, seed: int, epoch: int, shuffle: bool, rows: np.ndarray, want_ids: bool = False):
        """The raw batch of the given plan rows (``-1``: a padding row): ``(buf, ids)`` where ``buf`` is the
        int32 buffer of :func:`packloader.batch.raw_alloc` (input_ids, labels if the shards have any,
        sequence lengths) and ``ids`` the int64 [m, 5] (row in batch, shard, sequence, start, length)
        table of the pieces when ``want_ids`` (else None)."""
        ep = self.plan(seed, epoch, shuffle)
        if self._shards is None:
            self._shards = ShardCache(self.paths, self.token_column, self.labels_column, self.shard_cache)
        cache = self._shards
        ro = ep.row_offsets
        rows = np.asarray(rows, dtype=np.int64)
        real = rows >= 0
        counts = np.zeros(len(rows), np.int64)
        counts[real] = ro[rows[real] + 1] - ro[rows[real]]
        buf, ids, labels, seq_off, seq_lens = raw_alloc(len(rows), self.capacity, int(counts.sum()),
                                                        self.has_labels)
        np.cumsum(counts, out=seq_off[1:])
        id_parts = []
        for b, r in enumerate(rows.tolist()):
            if r < 0:
                continue
            lo, hi = int(ro[r]), int(ro[r + 1])
            seq_lens[seq_off[b]:seq_off[b + 1]] = ep.length[lo:hi]
            t = 0
            for s, q, st, n in zip(ep.shard[lo:hi].tolist(), ep.row[lo:hi].tolist(),
                                   ep.start[lo:hi].tolist(), ep.length[lo:hi].tolist()):
                offsets, tokens, lab = cache.get(s)
                a = int(offsets[q]) + st
                ids[b, t:t + n] = tokens[a:a + n]
                if labels is not None:
                    labels[b, t:t + n] = (tokens if lab is None else lab)[a:a + n]
                t += n
            if want_ids:
                id_parts.append(np.stack([np.full(hi - lo, b, np.int64), ep.shard[lo:hi], ep.row[lo:hi],
                                          ep.start[lo:hi], ep.length[lo:hi]], axis=1))
        table = None
        if want_ids:
            table = np.concatenate(id_parts) if id_parts else np.zeros((0, 5), np.int64)
        return buf, table


class PrepackedRows:
    """Rows of a pre-packed directory (see the module docstring).

    Args:
        directory: written by ``packloader pack``.

    Raises:
        DataError: not a pre-packed directory, or it holds no rows.
    """

    kind = "prepacked"

    def __init__(self, directory):
        from packloader.prepacked import PrepackedDataset

        self.directory = os.fspath(directory)
        ds = PrepackedDataset(self.directory)
        self.capacity = int(ds.capacity)
        index = ds.index
        self.n_rows = len(ds)
        if self.n_rows == 0:
            raise DataError("pre-packed directory holds no rows", path=self.directory)
        self.algorithm = index.get("algorithm")
        self.overflow = index.get("overflow")
        rep = index.get("report") if isinstance(index.get("report"), dict) else {}
        self.overflow_counts = {"policy": self.overflow,
                                **{k: int(rep.get(k) or 0) for k in ("split", "truncated", "dropped")},
                                "split_tokens": None,  # not recorded by ``pack``
                                "lost_tokens": int(rep.get("lost_tokens") or 0)}
        self.fingerprint = "prepacked:" + str(index.get("content_hash") or hashlib.sha256(
            repr((index.get("files"), index.get("total_tokens"))).encode()).hexdigest()[:24])
        self._ds = ds
        self._chunks = None
        self.row_tokens = self._load_chunks()[3]

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_ds"] = None
        d["_chunks"] = None
        d["_order"] = None
        return d

    def _load_chunks(self):
        """Views of every file: (chunk starts int64 [k+1], per-chunk arrays, ..., row_tokens)."""
        if self._chunks is None:
            from packloader.prepacked import PrepackedDataset

            if self._ds is None:
                self._ds = PrepackedDataset(self.directory)
            ds = self._ds
            starts, parts, tok = [], [], []
            pos = 0
            # one zero-copy block per record batch (iter_rows never crosses one)
            for ids, labels, soff, slen in ds.iter_rows(batch_rows=max(1, len(ds))):
                soff = np.asarray(soff, np.int64)
                csum = np.concatenate([[0], np.cumsum(slen, dtype=np.int64)])
                tok.append(csum[soff[1:]] - csum[soff[:-1]])
                starts.append(pos)
                parts.append((ids, labels, soff, slen))
                pos += len(ids)
            starts.append(pos)
            self._chunks = (np.asarray(starts, np.int64), parts, None, np.concatenate(tok))
        return self._chunks

    def epoch_rows(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        return self.row_tokens[self.order(seed, epoch, shuffle)]

    def order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """The epoch's row order (read-only; kept for the epoch: :meth:`build` asks for it every batch,
        and a permutation of all rows per batch took a third of the loader's time)."""
        key = (int(seed), int(epoch), bool(shuffle))
        cached = getattr(self, "_order", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if not shuffle:
            order = np.arange(self.n_rows, dtype=np.int64)
        else:
            order = epoch_rng(seed, epoch, _SALT_ROWS).permutation(self.n_rows).astype(np.int64)
        order.flags.writeable = False
        self._order = (key, order)
        return order

    def build(self, seed: int, epoch: int, shuffle: bool, rows: np.ndarray, want_ids: bool = False):
        """Like :meth:`StreamingRows.build`; ``ids`` is ``(row_ids, sample_ids)``: the int64 [B] dataset row of
        each row (-1: padding) and the [m, 5] (row in batch, source file, sequence, start, length) table
        from the directory's provenance columns (file indices into ``index.json["sources"]``)."""
        starts, parts, _, _ = self._load_chunks()
        order = self.order(seed, epoch, shuffle)
        rows = np.asarray(rows, dtype=np.int64)
        gids = np.full(len(rows), -1, dtype=np.int64)
        real = rows >= 0
        gids[real] = order[rows[real]]
        chunk = np.searchsorted(starts, gids, side="right") - 1
        local = gids - starts[chunk]
        counts = np.zeros(len(rows), np.int64)
        for b in np.flatnonzero(real).tolist():
            csoff = parts[chunk[b]][2]
            counts[b] = csoff[local[b] + 1] - csoff[local[b]]
        buf, ids, labels, seq_off, seq_lens = raw_alloc(len(rows), self.capacity, int(counts.sum()), True)
        np.cumsum(counts, out=seq_off[1:])
        for b in np.flatnonzero(real).tolist():
            cids, clab, csoff, cslen = parts[chunk[b]]
            i = int(local[b])
            ids[b] = cids[i]
            labels[b] = clab[i]
            seq_lens[seq_off[b]:seq_off[b + 1]] = cslen[int(csoff[i]):int(csoff[i + 1])]
        if not want_ids:
            return buf, None
        if self._ds is None:
            from packloader.prepacked import PrepackedDataset

            self._ds = PrepackedDataset(self.directory)
        tparts = []
        for b, g in enumerate(gids.tolist()):
            if g >= 0:
                _, sf, sr, ss = self._ds.read_sources(g, g + 1)
                n = seq_lens[seq_off[b]:seq_off[b + 1]]
                tparts.append(np.stack([np.full(len(sf), b), sf, sr, ss, n]).T.astype(np.int64))
        table = np.concatenate(tparts) if tparts else np.zeros((0, 5), np.int64)
        return buf, (gids, table)
