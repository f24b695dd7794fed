"""The per-process half of the loader: this rank's schedule of an epoch, and the batches of one worker.

:class:`PackedIterable` is the ``IterableDataset`` that torch's ``DataLoader`` runs in each worker (or in
the main process with ``num_workers=0``)::

    row source --epoch_rows--> assign_rows (packloader.distributed) --> schedule: int64 [n_batches, B]
                                                     (plan rows of this rank's batches, -1: padding row)
    batch k of the schedule, (k - start) % num_workers == this worker
        --> row source .build(rows) --> {"raw": int32 buffer, id tables}        (make_raw, in the worker)
    main process: collate (packloader.batch.collate_raw) --> the training batch   (collate)

The epoch, the first plan row of its global steps (non-zero after an elastic resume) and the iterator's
first batch travel to the workers in the shared ``control`` tensor, so persistent workers follow
:meth:`packloader.PackedDataLoader.set_epoch` and :meth:`~packloader.PackedDataLoader.load_state_dict`.

With ``overflow="carry"`` the schedule follows the carry rule (:mod:`packloader.carry`) instead of
:func:`~packloader.distributed.assign_rows`; ``control[1]`` then says whether it starts from the saved
state in :attr:`PackedIterable.carry_start` (1) or from the epoch's beginning (0), and every batch gets the
continuation keys.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from packloader.batch import collate_raw  # (imports packloader._numba: Numba's cache fallback) first
from packloader.distributed import (assign_rows, assign_rows_by_cost, current_worker, row_costs,
                                    worker_batch_indices)
from packloader.carry import CarrySchedule, segment_keys

__all__ = ["PackedIterable"]


class PackedIterable(IterableDataset):
    """The per-process half of the loader: builds this rank's batches of the epoch named in the shared
    ``control`` tensor ``[epoch, offset, start]`` (the schedule begins at plan row ``offset``, the
    iterator at its batch ``start``), the share of the calling worker only."""

    def __init__(self, rows, *, rank, world_size, batch_size, drop_last, seed, shuffle, hf_compat, return_ids):
        super().__init__()
        self.rows = rows
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.drop_last, self.seed, self.shuffle = drop_last, seed, shuffle
        self.hf_compat, self.return_ids = hf_compat, return_ids
        self.control = torch.zeros(3, dtype=torch.int64)
        #: None: ranks balanced by tokens; a float: by row_costs(..., attention_factor) (balance="compute")
        self.attention_factor: float | None = None
        self._sched: tuple[tuple[int, int], np.ndarray] | None = None
        self._info: tuple[int, tuple[int, str]] | None = None
        #: overflow="carry": the source's rows form chains (see packloader.carry)
        self.carries = getattr(rows, "overflow", None) == "carry"
        self.carry_start: dict | None = None   # the saved carry state an elastic resume starts from
        self.carry_one_piece_per_step = False   # the loader's option (packloader.carry)
        self._carry: tuple | None = None
        self._chains: tuple | None = None

    def carry(self, epoch: int, from_start: int = 0) -> CarrySchedule:
        """The epoch's schedule under the carry rule (all ranks), from its beginning or (``from_start``) from
        :attr:`carry_start`."""
        key = (int(epoch), int(from_start), repr(self.carry_start) if from_start else None)
        if self._carry is None or self._carry[0] != key:
            tokens = self.rows.epoch_rows(self.seed, epoch, self.shuffle)
            sched = CarrySchedule(tokens, self.chains(epoch)[1].pred_row, self.world_size, self.batch_size,
                                  self.drop_last, self.carry_start if from_start else None,
                                  self.carry_one_piece_per_step)
            self._carry = (key, sched)
        return self._carry[1]

    def chains(self, epoch: int):
        """``(row_offsets, Chains, doc_key)`` of the epoch's plan (see :func:`packer_algos.chains.chain_links`).

        Raises:
            packloader.errors.DataError: the source's chains break the carry rule (names what).
        """
        if self._chains is None or self._chains[0] != epoch:
            from packer_algos.chains import chain_links
            from packloader.errors import DataError

            off, doc, start, length = self.rows.epoch_pieces(self.seed, epoch, self.shuffle)
            try:
                ch = chain_links(off, doc, start, length)
            except ValueError as e:
                raise DataError(f"{e} (source {self.rows.fingerprint})") from None
            self._chains = (epoch, (off, ch, doc))
        return self._chains[1]

    def carry_keys(self, epoch: int, from_start: int, rows: np.ndarray, raw: np.ndarray) -> dict:
        """The continuation keys of the batch of plan ``rows`` (built into ``raw``), one per segment."""
        from packloader.batch import raw_views

        off, ch, doc = self.chains(epoch)
        sched = self.carry(epoch, from_start)
        rows = np.asarray(rows, np.int64)
        real = rows[rows >= 0]
        counts = off[real + 1] - off[real]
        piece = np.repeat(off[real] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
        row_of = np.repeat(real, counts)
        index = ch.piece_index[piece]
        nxt = ch.next_row[piece]
        keys = (np.where(ch.in_chain[piece], doc[piece], -1), index,
                (index > 0) & ~sched.restarted[row_of],
                (nxt >= 0) & sched.delivered()[np.maximum(nxt, 0)])
        _, _, seq_off, seq_lens = raw_views(raw)
        return segment_keys(seq_off, seq_lens, raw_views(raw)[0].shape[1], keys)

    def share_control(self):
        self.control.share_memory_()

    def schedule(self, epoch: int, offset: int = 0) -> np.ndarray:
        """int64 [n_batches, batch_size]: plan rows of this rank's batches (-1 = padding row), global steps
        starting at plan row ``offset`` (see :func:`packloader.distributed.assign_rows`)."""
        if self.carries:
            return self.carry(epoch, offset).rows[self.rank]
        key = (int(epoch), int(offset))
        if self._sched is None or self._sched[0] != key:
            if self.attention_factor is None:
                tokens = self.rows.epoch_rows(self.seed, epoch, self.shuffle)
                sched = assign_rows(tokens, self.world_size, self.batch_size, self.drop_last, offset)[self.rank]
            else:
                sched = assign_rows_by_cost(self.row_costs(epoch), self.world_size, self.batch_size, self.drop_last,
                                            offset)[self.rank]
            self._sched = (key, np.ascontiguousarray(sched))
        return self._sched[1]

    def row_costs(self, epoch: int) -> np.ndarray:
        """float64 [N]: the estimated cost of each plan row of the epoch (:func:`packloader.distributed.row_costs`
        with :attr:`attention_factor`, 0 when None)."""
        off, _, _, length = self.rows.epoch_pieces(self.seed, epoch, self.shuffle)
        return row_costs(off, length, self.attention_factor or 0.0)

    def epoch_info(self, epoch: int) -> tuple[int, str]:
        """``(rows, digest)`` of the epoch's plan: its row count and a hash of its rows' token counts, in
        plan order. The same on every rank and for every world size, batch size and worker count."""
        if self._info is None or self._info[0] != epoch:
            tokens = np.ascontiguousarray(self.rows.epoch_rows(self.seed, epoch, self.shuffle), dtype="<i8")
            self._info = (epoch, (len(tokens), hashlib.sha256(tokens.tobytes()).hexdigest()[:16]))
        return self._info[1]

    def make_raw(self, epoch: int, rows: np.ndarray, offset: int = 0) -> dict[str, Any]:
        """The batch before collation, as it travels from a worker: ``{"raw": int32 tensor}`` (one buffer,
        see :func:`packloader.batch.raw_alloc`), plus the id tables with ``return_ids``, plus the
        continuation keys with ``overflow="carry"`` (``offset``: the schedule's ``control[1]``)."""
        built = self.rows.build(self.seed, epoch, self.shuffle, rows, want_ids=self.return_ids)
        out = {"raw": torch.from_numpy(built.raw)}
        for key, table in built.ids.items():
            out[key] = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64))
        if self.carries:
            for key, table in self.carry_keys(epoch, offset, rows, built.raw).items():
                out[key] = torch.from_numpy(table)
        return out

    def collate(self, item: dict[str, Any], pin_memory: bool = False) -> dict[str, Any]:
        """The training batch of a :meth:`make_raw` item (in the main process)."""
        out = collate_raw(item["raw"], hf_compat=self.hf_compat, pin_memory=pin_memory)
        for key, table in item.items():
            if key != "raw":
                out[key] = table.pin_memory() if pin_memory else table
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, offset, start = (int(x) for x in self.control.tolist())
        sched = self.schedule(epoch, offset)
        wid, nw = current_worker()
        for k in worker_batch_indices(len(sched), start, wid, nw):
            yield self.make_raw(epoch, sched[k], offset)
