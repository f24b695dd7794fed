"""Streaming rows: token shards packed while the loader streams them (a row source, see :mod:`packloader.rows`).

:class:`StreamingRows` packs token shards (Arrow / Parquet / WebDataset tar) *online*. The epoch's
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
resume on another number of ranks (see :mod:`packloader.state`).
With an offline algorithm (``"bfd"``, ``"ffd"``, ...) the epoch's rows are shuffled as a
whole, so rows draw on all shards: fine for memory-mapped Arrow, slow for Parquet / tar.

A pre-packed directory is the other row source: :class:`packloader.prepacked.PrepackedRows`.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

import numpy as np

from packloader.batch import raw_alloc
from packloader.errors import DataError
from packloader.place import place_pieces, row_layout
from packloader.rows import SALT_ROWS, SALT_SEQS, SALT_SHARDS, Built, epoch_rng

__all__ = ["EpochPlan", "overflow_counts", "StreamingRows", "ShardCache"]


def overflow_counts(policy: str | None, sequences: int, tokens: int, capacity: int) -> dict:
    """What an overflow policy did: ``sequences`` longer than ``capacity`` holding ``tokens`` tokens.

    Keys: ``policy``; ``split`` / ``truncated`` / ``dropped``: sequences split into pieces, cut to
    ``capacity`` tokens, or left out; ``split_tokens``: tokens of split sequences (all still trained on,
    in several pieces); ``lost_tokens``: tokens never trained on (cut off or dropped)."""
    n = int(sequences)
    return {
        "policy": policy,
        "split": n if policy in ("split", "carry") else 0,
        "truncated": n if policy == "truncate" else 0,
        "dropped": n if policy == "drop" else 0,
        "split_tokens": int(tokens) if policy in ("split", "carry") else 0,
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
        order = epoch_rng(seed, epoch, SALT_SHARDS).permutation(n_shards) if shuffle else np.arange(n_shards)
        shard_parts, row_parts = [], []
        for s in order.tolist():
            n = len(self.lengths[s])
            rows = epoch_rng(seed, epoch, SALT_SEQS, s).permutation(n) if shuffle else np.arange(n)
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
            kw["seed"] = int(epoch_rng(seed, epoch, SALT_ROWS, 1).integers(2**31)) if shuffle else None
        p = pack(stream_lens, self.capacity, self.algorithm, **kw)
        offsets = np.asarray(p.bin_offsets, np.int64)
        items = np.asarray(p.item_ids, np.int64)
        starts = np.asarray(p.starts, np.int64)
        plen = np.asarray(p.lengths, np.int64)
        if self.algorithm != "online" and shuffle and p.n_bins > 1:
            perm = epoch_rng(seed, epoch, SALT_ROWS).permutation(p.n_bins)
            counts = np.diff(offsets)[perm]
            new_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            idx = np.repeat(offsets[:-1][perm] - new_off[:-1], counts) + np.arange(new_off[-1])
            offsets, items, starts, plen = new_off, items[idx], starts[idx], plen[idx]
            if self.overflow == "carry":  # the shuffle moved chains' rows: every one after its predecessor again
                from packer_algos.chains import carry_row_order, permute_rows

                offsets, items, starts, plen = permute_rows(offsets, carry_row_order(offsets, items, starts),
                                                            items, starts, plen)
        ep = EpochPlan(offsets, shard_of[items], row_of[items], starts, plen)
        self._plan_cache = (key, ep)
        return ep

    def epoch_rows(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        return self.plan(seed, epoch, shuffle).row_tokens

    def epoch_pieces(self, seed: int, epoch: int, shuffle: bool):
        """``(row_offsets, doc_key, start, length)`` of the epoch's plan pieces, in plan order (doc keys:
        :func:`packloader.carry.doc_keys` of shard index and sequence)."""
        from packloader.carry import doc_keys

        ep = self.plan(seed, epoch, shuffle)
        return ep.row_offsets, doc_keys(ep.shard, ep.row), ep.start, ep.length

    # -- building rows ---------------------------------------------------------------------------------

    def build(self, seed: int, epoch: int, shuffle: bool, rows: np.ndarray, want_ids: bool = False):
        """The plan rows ``rows`` (``-1``: a padding row) as a :class:`~packloader.rows.Built`: the raw
        buffer (labels in it if any shard has labels), and with ``want_ids`` the ``sample_ids`` table
        (row in batch, shard index into :attr:`paths`, sequence, start, length of each piece).

        Each shard the batch draws on is placed in one call of :func:`packloader.place.place_pieces`."""
        ep = self.plan(seed, epoch, shuffle)
        if self._shards is None:
            self._shards = ShardCache(self.paths, self.token_column, self.labels_column, self.shard_cache)
        ro = ep.row_offsets
        rows = np.asarray(rows, dtype=np.int64)
        real = rows >= 0
        counts = np.zeros(len(rows), np.int64)
        counts[real] = ro[rows[real] + 1] - ro[rows[real]]
        buf, ids, labels, seq_off, seq_lens = raw_alloc(len(rows), self.capacity, int(counts.sum()),
                                                        self.has_labels)
        np.cumsum(counts, out=seq_off[1:])
        # the batch's pieces, in order: plan piece numbers, then where each goes
        piece = np.repeat(ro[rows[real]] - seq_off[:-1][real], counts[real]) + np.arange(int(counts.sum()))
        length = ep.length[piece]
        seq_lens[:] = length
        dst_row, dst_col, _ = row_layout(seq_off, length)
        shard, seq, start = ep.shard[piece], ep.row[piece], ep.start[piece]
        for s in _in_order_of_appearance(shard):  # one placement per shard the batch draws on
            offsets, tokens, lab = self._shards.get(s)
            sel = np.flatnonzero(shard == s)
            place_pieces(tokens, lab, offsets[seq[sel]] + start[sel], length[sel], dst_row[sel], dst_col[sel],
                         ids, labels)
        ids_out = {"sample_ids": np.stack([dst_row, shard, seq, start, length], axis=1)} if want_ids else {}
        return Built(buf, ids_out)


def _in_order_of_appearance(values: np.ndarray) -> list:
    uniq, first = np.unique(values, return_index=True)
    return uniq[np.argsort(first)].tolist()
