"""``PackedDataLoader``: a drop-in ``DataLoader`` of packed batches, exact to resume, equal across ranks.

Example::

    from packloader import PackedDataLoader

    loader = PackedDataLoader("data/shard-{000..127}.arrow", capacity=4096, batch_size=8,
                              algorithm="online", buffer_size=1000, shuffle=True, seed=0, num_workers=2)
    for epoch in range(start_epoch, n_epochs):
        loader.set_epoch(epoch)
        for batch in loader:                       # dict of tensors, see packloader.batch
            loss_sum = model(batch["input_ids"], position_ids=batch["position_ids"],
                             labels=batch["labels"])  # summed over tokens
            (loss_sum / max(batch["num_loss_tokens"], 1)).backward()  # DDP: all-reduce the count first
            ...
            if step % 1000 == 0:
                torch.save({"model": ..., "loader": loader.state_dict()}, "ckpt.pt")

    # later: a fresh loader continues exactly where the checkpoint was taken, also on another number
    # of GPUs or with another batch_size (see "Exact and elastic resume")
    loader.load_state_dict(torch.load("ckpt.pt")["loader"])

A complete, runnable loop (DDP under torchrun, global loss normalisation, checkpoint and exact resume):
``examples/train_packed_mamba.py``.

What one epoch is
-----------------
1. **Rows.** A streaming source (Arrow / Parquet / WebDataset shards) is packed from its sequence lengths
   into the epoch's plan of rows: shards and the sequences inside each shard in an order shuffled by
   ``(seed, epoch)``, then the packer (``algorithm``, default the online packer with ``buffer_size``);
   see :mod:`packloader.stream`. A pre-packed directory's rows are its rows, shuffled by ``(seed, epoch)``.
2. **Ranks.** Global steps of ``world_size * batch_size`` consecutive rows; each rank gets ``batch_size``
   rows of each step, balanced by token count; the last step is completed with padding rows (no loss
   tokens) or, with ``drop_last=True``, dropped (at most ``world_size * batch_size - 1`` rows, counted in
   no later epoch: every epoch is self-contained, which keeps the resume state a pure function of the
   epoch). So **every rank yields the same number of batches**,
   every batch is ``[batch_size, capacity]``, and across ranks and workers every sequence is in exactly
   one row of the epoch (``drop_last=False``); see :mod:`packloader.distributed`.
3. **Workers.** Batch ``k`` of a rank is built by worker ``k % num_workers`` (counted from the first batch
   of the iterator); torch's round-robin collection gives the same batches in the same order for any
   ``num_workers``. A worker reads and places the tokens (the expensive part: shard decoding, gathers)
   and sends the batch as ONE int32 buffer (:func:`packloader.batch.raw_alloc`); the main process turns
   it into the tensors of the batch in one Numba pass (tens of microseconds), written straight into
   page-locked memory with ``pin_memory=True``. Moving one small buffer instead of five tensors is what
   makes workers pay: torch moves each tensor through its own shared-memory segment and file descriptor.

Exact and elastic resume
------------------------
The epoch's plan is a pure function of (sequence lengths, settings, seed, epoch), and no rank, world
size or worker count goes into it (every rank computes the whole plan, the online packer included), so
the state is only the position in it: ``{epoch, rows_consumed}`` plus the settings, the epoch's row
count and a digest of its plan to check against (JSON, a few hundred bytes, no token data).
``rows_consumed`` is MosaicML streaming's ``sample_in_epoch``: the plan rows ``[0, R)`` handed out, over
all ranks together. Batches are counted when the training loop receives them (``__next__`` in the main
process): batches prefetched by workers but not yet handed out are not consumed. All ranks consume the
same number of batches, so **every rank's state is the same**: save rank 0's (``if rank == 0:
torch.save(...)``) and load it on every rank of the next run.

A fresh loader given the state continues the epoch at plan row ``R``; sequences that an online packer
would have held in its buffer, or a partially read shard, are exactly where the plan puts them:

* **the same** ``world_size`` and ``batch_size``: the batches are exactly those of the uninterrupted run
  (``len(loader)`` and ``batches_consumed`` too), with any ``num_workers``;
* **another** ``world_size``, ``batch_size``, ``drop_last`` or ``num_workers`` (a job restarted on more or
  fewer GPUs): the rows ``[R, N)`` are cut into global steps of the new ``world_size * batch_size``, so
  every remaining sequence comes exactly once, none consumed before comes again, and every rank still
  yields the same number of batches (the last step padded, or dropped with ``drop_last=True``). The
  epoch's schedule then begins at row ``R % (world_size * batch_size)``: ``len(loader)`` counts its
  batches (the same as a fresh epoch's, or one less), and the resumed iterator starts at batch
  ``R // (world_size * batch_size)``;
* **not** another ``source`` (other shards, another order of them, another pre-packed directory),
  ``capacity``, ``seed``, ``shuffle``, ``algorithm``, ``buffer_size``, ``overflow`` or
  ``max_items_per_bin``: these make the plan, so the saved position means nothing under other ones.
  :meth:`load_state_dict` names the setting, both values and what may change; it also refuses a plan
  that differs although the settings match (a packer changed between versions). Finish the epoch with
  the old settings, or start a new epoch (``set_epoch``) without loading the state.

Both sources are elastic: a pre-packed directory's plan is its rows in a ``(seed, epoch)`` order, a
streaming source's the packer's rows over the ``(seed, epoch)`` stream order. Once every batch of an
epoch is out the state says ``rows_consumed == epoch_rows`` (a tail that ``drop_last`` dropped counts as
done), and any layout resumes it with an empty rest. States of the first format (``version`` 1,
``batches_consumed`` of the saving layout) still load, elastically too.

Epochs follow ``DistributedSampler``: call :meth:`set_epoch` before each epoch to reshuffle; iterating
again without it repeats the epoch. After :meth:`load_state_dict` the *next* iterator yields the rest of
the saved epoch (``set_epoch`` with the saved epoch keeps that; another epoch discards it), so the usual
loop ``for e in range(state["epoch"], n_epochs): loader.set_epoch(e); for batch in loader: ...``
continues exactly. A state saved at the very end of an epoch yields an empty rest of that epoch, then
the loop moves on to the next epoch, as the uninterrupted run would.

Padding batches and the loss
----------------------------
Padding rows carry no loss tokens, and a tiny dataset split over many ranks can give a rank a batch of
only padding rows (``num_loss_tokens == 0``). Sum the loss over tokens and divide by the global count
(``all_reduce`` of ``num_loss_tokens``) rather than by the local one, so such a batch contributes
nothing instead of NaN; it still runs forward/backward, so collectives stay in step. A rank that gets
no real row in an epoch (the data packs into fewer rows than one global step) is not an error; the
loader warns once per epoch.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
import warnings
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from packloader.batch import collate_raw  # (imports packloader._numba: Numba's cache fallback) first
from packloader.distributed import (assign_rows, current_worker, resolve_rank_world, resume_point, rows_consumed,
                                    worker_batch_indices)
from packloader.distributed import num_batches as plan_batches
from packloader.errors import DataError, WorkerError
from packloader.prepacked import PrepackedRows, check_capacity, is_prepacked_dir, unfinished_pack_dir
from packloader.stream import StreamingRows

__all__ = ["PackedDataLoader", "STATE_FORMAT"]

STATE_FORMAT = "packloader.PackedDataLoader"
STATE_VERSION = 2
# settings that decide the epoch's plan of rows: a state resumes only with the same ones. The others
# (world_size, batch_size, drop_last; num_workers and the output options are not saved) only split the
# plan into batches and may change between save and load.
_PLAN_SETTINGS = ("source", "capacity", "seed", "shuffle", "algorithm", "buffer_size", "overflow",
                  "max_items_per_bin")
_LAYOUT_SETTINGS = ("world_size", "batch_size", "drop_last")


class _PackedIterable(IterableDataset):
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
        self._sched: tuple[tuple[int, int], np.ndarray] | None = None
        self._info: tuple[int, tuple[int, str]] | None = None

    def share_control(self):
        self.control.share_memory_()

    def schedule(self, epoch: int, offset: int = 0) -> np.ndarray:
        """int64 [n_batches, batch_size]: plan rows of this rank's batches (-1 = padding row), global steps
        starting at plan row ``offset`` (see :func:`packloader.distributed.assign_rows`)."""
        key = (int(epoch), int(offset))
        if self._sched is None or self._sched[0] != key:
            tokens = self.rows.epoch_rows(self.seed, epoch, self.shuffle)
            sched = assign_rows(tokens, self.world_size, self.batch_size, self.drop_last, offset)[self.rank]
            self._sched = (key, np.ascontiguousarray(sched))
        return self._sched[1]

    def epoch_info(self, epoch: int) -> tuple[int, str]:
        """``(rows, digest)`` of the epoch's plan: its row count and a hash of its rows' token counts, in
        plan order. The same on every rank and for every world size, batch size and worker count."""
        if self._info is None or self._info[0] != epoch:
            tokens = np.ascontiguousarray(self.rows.epoch_rows(self.seed, epoch, self.shuffle), dtype="<i8")
            self._info = (epoch, (len(tokens), hashlib.sha256(tokens.tobytes()).hexdigest()[:16]))
        return self._info[1]

    def make_raw(self, epoch: int, rows: np.ndarray) -> dict[str, Any]:
        """The batch before collation, as it travels from a worker: ``{"raw": int32 tensor}`` (one buffer,
        see :func:`packloader.batch.raw_alloc`), plus the id tables with ``return_ids``."""
        built = self.rows.build(self.seed, epoch, self.shuffle, rows, want_ids=self.return_ids)
        out = {"raw": torch.from_numpy(built.raw)}
        for key, table in built.ids.items():
            out[key] = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64))
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
            yield self.make_raw(epoch, sched[k])


class PackedDataLoader:
    """Packed batches of ``capacity``-token rows from token shards or a pre-packed directory.

    Swap a ``torch.utils.data.DataLoader`` for it: iterate, get a dict of tensors per step (keys, shapes
    and dtypes in :mod:`packloader.batch`)::

        capacity = 12          seq A (5)        seq B (3)   seq C (3)  pad
        input_ids     [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 c1 c2 | 0 ]
        labels        [  - a1 a2 a3 a4 |  - b1 b2 |  - c1 c2 | - ]    (- = -100)
        position_ids  [  0  1  2  3  4 |  0  1  2 |  0  1  2 | 0 ]
        seq_idx       [  0  0  0  0  0 |  1  1  1 |  2  2  2 | 3 ]

    Resume: :meth:`state_dict` is the position in the epoch's plan of rows (``rows_consumed``, counted over
    all ranks), the same on every rank: save rank 0's. :meth:`load_state_dict` continues it exactly with the
    same ``world_size`` and ``batch_size``, and elastically with another ``world_size``, ``batch_size``,
    ``drop_last`` or ``num_workers``: every remaining sequence once, none repeated, the same number of
    batches on every rank. ``source``, ``capacity``, ``seed``, ``shuffle``, ``algorithm``, ``buffer_size``,
    ``overflow`` and ``max_items_per_bin`` must be the saved ones (they make the plan); another value is
    refused with an error naming it. Details: "Exact and elastic resume" in :mod:`packloader.loader`.

    Args:
        source: token shards (a path, directory, glob / brace pattern, or a list of them: see
            :func:`packloader.sources.resolve_sources`), packed online while streaming; or a directory
            written by ``packloader pack`` (it has an ``index.json``), read zero-copy.
        capacity: tokens per packed row (``L``). Default: the pre-packed directory's capacity, or 4096
            for shards. Given with a pre-packed directory it must match it.
        batch_size: packed rows per batch (``B``).
        algorithm: packing algorithm for shards: ``"online"`` (the default for shards; streaming packer
            with a buffer of ``buffer_size`` sequences, rows follow the data order) or ``"bfd"``,
            ``"ffd"``, ``"first_fit"``, ``"next_fit"`` over the whole epoch (rows then shuffled). A
            pre-packed directory was packed by ``packloader pack``: leave it ``None``, or give the
            directory's algorithm (``index.json["algorithm"]``); another one is a ValueError naming both.
        buffer_size: pending sequences of the online packer.
        shuffle: shuffle shards, sequences (shards) or rows (pre-packed) by ``(seed, epoch)``.
        seed: the shuffling seed; same seed and epoch give the same batches on any run and machine.
        num_workers: DataLoader worker processes (0: build batches in the main process).
        rank, world_size: this process's rank and the number of ranks. Default: ``torch.distributed`` if
            initialised, else the ``RANK`` / ``WORLD_SIZE`` environment variables, else 0 and 1.
        drop_last: drop the incomplete last global step (``world_size * batch_size`` rows) instead of
            completing it with padding rows. Either way every rank yields the same number of batches.
        overflow: sequences longer than ``capacity``: ``"error"`` (the default for shards, as for
            ``packloader pack`` and ``packer_algos.pack``: a DataError naming the file, row and length),
            ``"split"`` (consecutive pieces, each its own segment), ``"truncate"`` (the first ``capacity``
            tokens) or ``"drop"``. Whatever it changed is counted in :attr:`overflow_counts` (also in
            :meth:`state_dict`) and said once in a warning when the loader is built. A pre-packed directory
            was packed with its own policy: leave it ``None`` or give that one (another is a ValueError).
        max_items_per_bin: optional cap on sequences per row.
        token_column, labels_column: columns (tar members) of the shards; without a labels column the
            labels are the inputs.
        hf_compat: also emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` (Hugging Face padding-free names).
        return_ids: also emit ``sample_ids``: (row in batch, source file index, sequence index, start,
            length) of each sequence piece; file indices point into :attr:`sources` (shards) or the
            pre-packed ``index.json["sources"]``; and for a pre-packed directory ``row_ids``, its row
            of each batch row (-1: padding row).
        shard_cache: decoded shards kept per process (streaming).
        pin_memory: return page-locked tensors (the batch is collated straight into them, no extra copy),
            ready for ``.to("cuda", non_blocking=True)``; ignored with a warning without an accelerator.
        persistent_workers, prefetch_factor, worker_init_fn, multiprocessing_context: as in
            ``torch.utils.data.DataLoader``.
        timeout: seconds to wait for a worker's batch (0: forever, as in ``DataLoader``). With a
            timeout, a worker that was killed, or stopped (``SIGSTOP``) so that it sends nothing for
            ``timeout`` seconds, ends the iteration with one :class:`~packloader.errors.WorkerError`
            naming the worker and the signal (a stopped worker is killed then); resume from
            :meth:`state_dict` with a fresh loader. A killed worker is reported so even without a timeout.
        pin_memory_device: accepted for compatibility and ignored (pinning is for the current accelerator).

    Raises:
        packloader.errors.DataError: the source is missing, unreadable or empty (names it), or a
            directory that ``packloader pack`` has not finished ("not a finished pre-packed directory").
        ValueError: a bad argument (names it); ``capacity`` is an int in ``[1, MAX_CAPACITY]``
            (:data:`packloader.prepacked.MAX_CAPACITY`).
        packloader.errors.WorkerError: (while iterating) a worker died or stopped answering.

    Warns:
        UserWarning: when an epoch is started on a rank that gets no data: the source packs into fewer rows
        than ``world_size * batch_size``, so the rank yields only padding batches (or, with
        ``drop_last=True``, no batch at all on any rank). A rank never has "no shards": shards are not
        split between ranks, rows of the whole epoch's plan are. Once, when the loader is built, when the
        overflow policy split, truncated or dropped any sequence (counts in :attr:`overflow_counts`).
    """

    def __init__(self, source, capacity: int | None = None, batch_size: int = 8, algorithm: str | None = None,
                 buffer_size: int = 1000, shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = False, *,
                 overflow: str | None = None, max_items_per_bin: int | None = None,
                 token_column: str = "input_ids", labels_column: str | None = "labels",
                 hf_compat: bool = False, return_ids: bool = False, shard_cache: int = 3,
                 pin_memory: bool = False, persistent_workers: bool = False, prefetch_factor: int | None = None,
                 timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 pin_memory_device: str = ""):
        for name, value in (("batch_size", batch_size), ("buffer_size", buffer_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(num_workers, (int, np.integer)) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if capacity is not None:
            check_capacity(capacity)
        for name, value in (("rank", rank), ("world_size", world_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a number >= 0, got {timeout!r}")
        self.timeout = float(timeout)
        if isinstance(source, (str, os.PathLike)) and unfinished_pack_dir(source):
            raise DataError("not a finished pre-packed directory (written by 'packloader pack', but no "
                            "index.json: packing incomplete, failed, or still running)", path=source)
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.drop_last, self.num_workers = bool(drop_last), int(num_workers)

        if overflow is not None:
            from packer_algos.pieces import check_overflow

            check_overflow(overflow)
        if is_prepacked_dir(source):
            rows = PrepackedRows(source)
            if capacity is not None and int(capacity) != rows.capacity:
                raise ValueError(f"capacity={capacity} does not match the pre-packed directory {rows.directory!r}"
                                 f" (capacity {rows.capacity}); pass capacity=None or {rows.capacity}")
            for name, given, packed in (("algorithm", algorithm, rows.algorithm), ("overflow", overflow, rows.overflow)):
                if given is not None and packed is not None and given != packed:  # (None: not recorded)
                    raise ValueError(f"{name}={given!r} does not match the pre-packed directory {rows.directory!r}"
                                     f" (packed with {name} {packed!r}): its rows are already packed; pass "
                                     f"{name}=None, or pack the shards again with --{name} {given}")
            self.capacity = rows.capacity
            self.algorithm = None
            self.buffer_size = self.overflow = self.max_items_per_bin = None
            self.sources = [rows.directory]
        else:
            from packer_algos import ALGORITHMS
            from packloader.sources import resolve_sources

            algorithm = "online" if algorithm is None else algorithm
            overflow = "error" if overflow is None else overflow
            if algorithm not in ALGORITHMS:
                raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
            if isinstance(source, (list, tuple)) and not source:
                raise ValueError("source is an empty list: give shard paths, patterns or a pre-packed directory")
            self.sources = resolve_sources(source)
            self.capacity = 4096 if capacity is None else int(capacity)
            self.algorithm, self.buffer_size, self.overflow = algorithm, int(buffer_size), overflow
            self.max_items_per_bin = max_items_per_bin
            rows = StreamingRows(self.sources, self.capacity, algorithm=algorithm, buffer_size=buffer_size,
                                 overflow=overflow, max_items_per_bin=max_items_per_bin,
                                 token_column=token_column, labels_column=labels_column, shard_cache=shard_cache)
        self._overflow_counts = dict(rows.overflow_counts)
        self._warn_overflow()
        self.hf_compat, self.return_ids = bool(hf_compat), bool(return_ids)
        self.dataset = _PackedIterable(rows, rank=self.rank, world_size=self.world_size,
                                       batch_size=self.batch_size, drop_last=self.drop_last, seed=self.seed,
                                       shuffle=self.shuffle, hf_compat=self.hf_compat, return_ids=self.return_ids)
        if self.num_workers > 0:
            self.dataset.share_control()
        dl_kw: dict[str, Any] = {}
        if self.num_workers > 0:
            dl_kw.update(persistent_workers=persistent_workers, timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context)
            if prefetch_factor is not None:
                dl_kw["prefetch_factor"] = prefetch_factor
        # pinning is done by the collation in the main process, straight into page-locked tensors
        self.pin_memory = bool(pin_memory) and _can_pin()
        if pin_memory and not self.pin_memory:
            warnings.warn("PackedDataLoader: pin_memory=True but no accelerator is available; batches are "
                          "not pinned", stacklevel=2)
        self._dl = DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers, **dl_kw)
        self._epoch = 0
        self._offset = 0            # first plan row of the global steps of self._epoch (non-zero after an
                                    # elastic resume, see packloader.distributed.resume_point)
        self._consumed = 0          # batches of self._epoch's schedule handed out (by the latest iterator)
        self._resume: int | None = None
        # number of the latest iterator: only that one counts consumed batches. The loader holds no
        # reference to its iterators: a loader <-> iterator cycle would leave a worker iterator to the
        # cyclic garbage collector, and torch's worker shutdown run from there waits 5 s per worker.
        self._iter_gen = 0
        self._warned: set[int] = set()  # epochs warned about (see _warn_if_no_data)

    @property
    def overflow_counts(self) -> dict[str, Any]:
        """What the overflow policy did to the source (the same every epoch): ``{"policy", "split",
        "truncated", "dropped", "split_tokens", "lost_tokens"}``; sequences split / truncated / dropped,
        tokens of the split sequences (all kept) and tokens lost (cut off or dropped). For a pre-packed
        directory, the figures of ``packloader pack`` (``split_tokens`` is None there: not recorded)."""
        return dict(self._overflow_counts)

    def _warn_overflow(self) -> None:
        """One warning per loader when the overflow policy changed any sequence."""
        c = self._overflow_counts
        n = c["split"] + c["truncated"] + c["dropped"]
        if not n:
            return
        what = {"split": f"split into pieces of at most {self.capacity} tokens ({c['split_tokens']} tokens, "
                         "all kept; no piece attends to the one before it)" if c["split_tokens"] is not None
                         else f"split into pieces of at most {self.capacity} tokens",
                "truncate": f"truncated to {self.capacity} tokens ({c['lost_tokens']} tokens lost)",
                "drop": f"dropped ({c['lost_tokens']} tokens lost)"}[c["policy"]]
        where = "when the directory was packed" if self.algorithm is None else f"by overflow={c['policy']!r}"
        warnings.warn(f"PackedDataLoader: {n} sequence(s) longer than capacity {self.capacity} were {what} "
                      f"{where}; see loader.overflow_counts", stacklevel=3)

    # -- epochs and length ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reshuffles). Setting the epoch it already is keeps a loaded resume point."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._offset, self._consumed, self._resume = epoch, 0, 0, None

    def num_batches(self, epoch: int | None = None) -> int:
        """Batches per rank in ``epoch`` (default: the current one); the same on every rank. After an
        elastic resume (another ``world_size * batch_size``) the current epoch's schedule starts at the
        resume point's offset and can have one batch less than a fresh epoch."""
        if epoch is None or int(epoch) == self._epoch:
            return len(self.dataset.schedule(self._epoch, self._offset))
        return len(self.dataset.schedule(int(epoch)))

    def __len__(self) -> int:
        return self.num_batches()

    def __iter__(self) -> "_LoaderIterator":
        epoch = self._epoch
        if self._resume is None:  # a fresh pass over the epoch (iterating again repeats all of it)
            self._offset = 0
        n = self.num_batches(epoch)  # plan computed here, inherited by forked workers
        self._warn_if_no_data(epoch, n)
        start = min(self._resume, n) if self._resume is not None else 0
        self._resume = None
        self.dataset.control[0] = epoch
        self.dataset.control[1] = self._offset
        self.dataset.control[2] = start
        self._consumed = start
        self._iter_gen += 1
        return _LoaderIterator(self, iter(self._dl), epoch, start, n, self._iter_gen)

    def _warn_if_no_data(self, epoch: int, n: int) -> None:
        """Warn (once per epoch) when this rank gets no real row: the data packs into fewer rows than
        one global step. Not an error: the rank still yields its padding batches, in step with the rest.
        Only for a whole epoch's schedule (not for the rest of an epoch after an elastic resume)."""
        if epoch in self._warned or self._offset:
            return
        sched = self.dataset.schedule(epoch, self._offset)
        if n and (sched >= 0).any():
            return
        self._warned.add(epoch)
        n_rows = len(self.dataset.rows.epoch_rows(self.seed, epoch, self.shuffle))
        step = self.world_size * self.batch_size
        if n == 0:
            warnings.warn(f"PackedDataLoader: epoch {epoch} has no batches: the source packs into {n_rows} "
                          f"row(s), fewer than world_size * batch_size = {step}, and drop_last=True drops "
                          "them; use drop_last=False or a smaller batch_size / world_size", stacklevel=3)
        else:
            warnings.warn(f"PackedDataLoader: rank {self.rank} of {self.world_size} gets no data in epoch "
                          f"{epoch}: the source packs into {n_rows} row(s), fewer than world_size * "
                          f"batch_size = {step}; this rank yields {n} batch(es) of padding rows only "
                          "(num_loss_tokens == 0)", stacklevel=3)

    # -- state ---------------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        return {
            "source": self.dataset.rows.fingerprint,
            "capacity": self.capacity,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "algorithm": self.algorithm,
            "buffer_size": self.buffer_size if self.algorithm == "online" else None,
            "overflow": self.overflow,
            "max_items_per_bin": self.max_items_per_bin,
        }

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: JSON-serializable, no token data, the same on every rank (see
        "Exact and elastic resume" in the module docstring).

        Keys: ``epoch``; ``rows_consumed``, the plan rows of the epoch handed out over all ranks (what a
        resume continues from, whatever its world size and batch size); ``epoch_rows`` and
        ``epoch_digest``, the epoch's plan (row count, hash of the rows' token counts) to check on load;
        ``batches_consumed``, this loader's batch index in its schedule of the epoch (informational);
        ``settings``, the loader's settings (``world_size``, ``batch_size``, ``drop_last``
        informational, the others must match on load); ``overflow_counts``, see :attr:`overflow_counts`
        (checked and restored on load).
        """
        epoch = self._epoch
        n_rows, digest = self.dataset.epoch_info(epoch)
        batches = self._resume if self._resume is not None else self._consumed
        n = self.num_batches(epoch)
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": epoch,
            "rows_consumed": rows_consumed(self._offset, batches, n, n_rows, self.world_size, self.batch_size),
            "epoch_rows": n_rows,
            "epoch_digest": digest,
            "batches_consumed": int(batches),
            "settings": self._settings(),
            "overflow_counts": self.overflow_counts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of any rank of a loader over the same data).

        The settings that make the epoch's plan (``source``, ``capacity``, ``seed``, ``shuffle``,
        ``algorithm``, ``buffer_size``, ``overflow``, ``max_items_per_bin``) must be the saved ones;
        ``world_size``, ``batch_size``, ``drop_last`` and ``num_workers`` may differ: the next iterator
        then yields this rank's share of the rest of the saved epoch (plan rows ``rows_consumed`` to the
        end), every remaining row on exactly one rank, the same number of batches on every rank. With
        the saved ``world_size`` and ``batch_size`` the batches are exactly the uninterrupted run's.
        States of version 1 (``batches_consumed`` only) load too.

        Raises:
            ValueError: not a loader state; saved with other plan settings (names the key, both values,
                and what may change); the epoch's plan differs from the saved one although the
                settings match (another packer version); a position outside the epoch.
        """
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a PackedDataLoader state_dict (format={state.get('format') if isinstance(state, dict) else type(state).__name__!r})")
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"unsupported PackedDataLoader state version {version!r} "
                             f"(this loader reads 1 and {STATE_VERSION})")
        saved = state.get("settings") or {}
        mine = self._settings()
        allowed = (f"the plan settings ({', '.join(_PLAN_SETTINGS)}) must be as when saved; "
                   f"{', '.join(_LAYOUT_SETTINGS)} and num_workers may change")
        for key in _PLAN_SETTINGS:
            if key not in saved:
                raise ValueError(f"state_dict mismatch: {key!r} missing from the saved state")
            if saved[key] != mine[key]:
                raise ValueError(f"state_dict mismatch: {key!r} was {saved[key]!r} when saved, this loader "
                                 f"has {mine[key]!r}; the epoch's plan of rows depends on it, so the saved "
                                 f"position means nothing here ({allowed})")
        epoch = state.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"bad state_dict position: epoch={epoch!r}")
        n_rows, digest = self.dataset.epoch_info(epoch)
        if version == 1:  # position in batches of the saving layout
            consumed = state.get("batches_consumed")
            if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
                raise ValueError(f"bad state_dict position: epoch={epoch!r}, batches_consumed={consumed!r}")
            layout = [saved.get(k) for k in _LAYOUT_SETTINGS]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in layout[:2]):
                raise ValueError(f"bad state_dict settings: world_size={layout[0]!r}, batch_size={layout[1]!r}")
            world, batch, drop_last = layout[0], layout[1], bool(layout[2])
            n = plan_batches(n_rows, world, batch, drop_last)
            if consumed > n:
                raise ValueError(f"state_dict position batches_consumed={consumed} is past the end of epoch "
                                 f"{epoch} ({n} batches of world_size={world}, batch_size={batch})")
            done = rows_consumed(0, consumed, n, n_rows, world, batch)
        else:
            done = state.get("rows_consumed")
            if not isinstance(done, int) or isinstance(done, bool) or done < 0:
                raise ValueError(f"bad state_dict position: epoch={epoch!r}, rows_consumed={done!r}")
            if (state.get("epoch_rows"), state.get("epoch_digest")) != (n_rows, digest):
                raise ValueError(
                    f"state_dict mismatch: epoch {epoch}'s plan was {state.get('epoch_rows')!r} rows (digest "
                    f"{state.get('epoch_digest')!r}) when saved, this loader's plan is {n_rows} rows (digest "
                    f"{digest!r}) with the same settings: the packer or the shuffling changed (another "
                    "packloader version?), so the saved position cannot be continued; finish the epoch "
                    "with the version that saved it, or start the next epoch (set_epoch)")
            if done > n_rows:
                raise ValueError(f"state_dict position rows_consumed={done} is past the end of epoch {epoch} "
                                 f"({n_rows} rows)")
        counts = state.get("overflow_counts")
        if isinstance(counts, dict):  # (states saved before it was kept have none: the source's are kept)
            if counts != self._overflow_counts:
                raise ValueError(f"state_dict mismatch: overflow_counts were {counts!r} when saved, this loader "
                                 f"has {self._overflow_counts!r} with the same settings (another packloader "
                                 "version?)")
            self._overflow_counts = dict(counts)
        offset, start = resume_point(done, n_rows, self.world_size, self.batch_size, self.drop_last)
        self._epoch, self._offset, self._consumed, self._resume = epoch, offset, start, start
        self._iter_gen += 1  # an iterator still open from before no longer counts


def _can_pin() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


class _LoaderIterator:
    """Counts batches as they are handed to the training loop (prefetched ones are not consumed)."""

    def __init__(self, loader: PackedDataLoader, it, epoch: int, start: int, n: int, gen: int):
        self._loader, self._it = loader, it
        self._epoch, self._pos, self._n, self._gen = epoch, start, n, gen
        workers = list(getattr(it, "_workers", None) or [])
        self._watch = _WorkerWatch(workers, loader.timeout) if workers else None

    def __del__(self):
        if getattr(self, "_watch", None) is not None:
            self._watch.stop.set()

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._n - self._pos

    def __next__(self) -> dict[str, Any]:
        watch = self._watch
        try:
            if watch is not None:
                watch.waiting_since = time.monotonic()
            batch = next(self._it)
        except StopIteration:
            if watch is not None:
                watch.stop.set()
            raise
        except Exception as e:
            for _ in range(20):
                try:
                    self._fail(e, watch)  # always raises
                except RuntimeError as again:
                    # torch's SIGCHLD handler raises asynchronously wherever the main thread is when a
                    # worker dies; here it only repeats what _fail is reporting: do it again
                    if type(again) is RuntimeError and again is not e and "DataLoader worker" in str(again):
                        continue
                    raise
            raise
        finally:
            if watch is not None:
                watch.waiting_since = None
        loader = self._loader
        batch = loader.dataset.collate(batch, loader.pin_memory)
        self._pos += 1
        if loader._iter_gen == self._gen and loader._epoch == self._epoch:
            loader._consumed = self._pos
        return batch

    def _fail(self, e: Exception, watch) -> None:
        """After ``next()`` of torch's iterator raised ``e``: stop the workers now (the epoch cannot go on;
        otherwise the traceback keeps torch's iterator alive until the cyclic garbage collector runs, and
        torch's worker shutdown run from there waits 5 s per worker), then raise one WorkerError naming
        a dead or stopped worker, or ``e`` itself."""
        transport = isinstance(e, (EOFError, ConnectionError)) or (
            type(e) is RuntimeError and ("DataLoader worker" in str(e) or "timed out" in str(e)))
        if not hasattr(self, "_fault"):  # (once: a retry must not see the workers the shutdown ended)
            # an exception raised by the worker's own code (torch re-raises it here: "Caught ... in DataLoader
            # worker process N") is the story; the other workers may be exiting by then (status 0) and must not
            # be reported instead of it. Only a lost worker (transport errors, timeouts) is looked for.
            self._fault = watch.fault_safely(wait=True) if (watch is not None and transport) else None
        fault = self._fault
        if watch is not None:
            watch.stop.set()
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
            dl = self._loader._dl
            if getattr(dl, "_iterator", None) is self._it:  # persistent workers: start afresh next time
                dl._iterator = None
        if fault is not None:
            worker, pid, sig, what = fault
            raise WorkerError(
                f"PackedDataLoader worker {worker} (pid {pid}) {what}; this iteration cannot go on "
                f"({type(e).__name__} in the main process). {self._pos} batch(es) of epoch {self._epoch} "
                "were handed out: build a fresh loader with the same settings and load_state_dict("
                "state_dict()) to continue exactly.", worker=worker, pid=pid, signal=sig) from None
        raise e


def _proc_state(pid: int) -> str | None:
    """The state letter of a process in /proc (``"T"``: stopped), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3].decode()
    except (OSError, ValueError):
        return None


class _WorkerWatch:
    """Watches the DataLoader workers of one iterator (holds no reference to the iterator or loader).

    While the main process waits for a batch longer than ``timeout``, a stopped worker (``SIGSTOP``;
    torch would otherwise block the main process forever, receiving a tensor's file descriptor from it)
    is killed, which makes the main process's wait fail at once; :meth:`fault` then names the worker."""

    def __init__(self, workers: list, timeout: float):
        self.workers, self.timeout = workers, timeout
        self.waiting_since: float | None = None
        self.stopped: dict[int, int] = {}    # worker number -> pid, of workers found stopped and killed
        self.stop = threading.Event()
        if timeout > 0:
            threading.Thread(target=self._run, name="packloader-worker-watch", daemon=True).start()

    def _kill_stopped(self) -> None:
        for i, w in enumerate(self.workers):
            pid = w.pid
            if pid is not None and i not in self.stopped and _proc_state(pid) in ("T", "t"):
                self.stopped[i] = pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _run(self) -> None:
        while not self.stop.wait(min(0.25, self.timeout / 4)):
            since = self.waiting_since
            if since is not None and time.monotonic() - since > self.timeout:
                self._kill_stopped()

    def fault_safely(self, wait: bool = True):
        """:meth:`fault`, retried when torch's SIGCHLD handler raises (it reports the same death)."""
        for _ in range(10):
            try:
                return self.fault(wait)
            except RuntimeError:
                continue
        return None

    def fault(self, wait: bool = True):
        """``(worker, pid, signal name or None, description)`` of the first failed worker, or None.
        ``wait``: give a worker whose connection just broke up to 2 s to be seen dead."""
        self._kill_stopped()
        deadline = time.monotonic() + (2.0 if wait else 0.0)
        while True:
            for i in sorted(self.stopped):
                return (i, self.stopped[i], "SIGSTOP",
                        f"was stopped (SIGSTOP) and sent nothing for {self.timeout:g} s (timeout); it was killed")
            codes = [(i, w.pid, w.exitcode) for i, w in enumerate(self.workers)]
            # any exit before the iterator ends is unexpected; a signal first, then an error status
            for i, pid, code in sorted((c for c in codes if c[2] is not None), key=lambda c: (c[2] >= 0, c[2] == 0)):
                if code < 0:
                    try:
                        name = signal.Signals(-code).name
                    except ValueError:
                        name = f"signal {-code}"
                    return i, pid, name, f"was killed by {name}"
                if code == 0:  # observed: a torch worker sent SIGTERM exits with status 0
                    return i, pid, None, "exited unexpectedly with status 0 (as a worker does on SIGTERM)"
                return i, pid, None, f"exited unexpectedly with status {code}"
            if time.monotonic() > deadline:  # not a worker fault (e.g. an error raised in the worker)
                return None
            time.sleep(0.05)
