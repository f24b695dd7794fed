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
   see :mod:`packloader.stream`. A pre-packed directory's rows are its rows, shuffled by ``(seed, epoch)``
   (:class:`packloader.prepacked.PrepackedRows`). Both are row sources (:mod:`packloader.rows`): the
   loader asks neither which one it holds.
2. **Ranks.** Global steps of ``world_size * batch_size`` consecutive rows; each rank gets ``batch_size``
   rows of each step, balanced by token count; the last step is completed with padding rows (no loss
   tokens) or, with ``drop_last=True``, dropped (at most ``world_size * batch_size - 1`` rows, counted in
   no later epoch: every epoch is self-contained, which keeps the resume state a pure function of the
   epoch). So **every rank yields the same number of batches**,
   every batch is ``[batch_size, capacity]``, and across ranks and workers every sequence is in exactly
   one row of the epoch (``drop_last=False``); see :mod:`packloader.distributed`.
3. **Workers.** Batch ``k`` of a rank is built by worker ``k % num_workers`` (counted from the first batch
   of the iterator); torch's round-robin collection gives the same batches in the same order for any
   ``num_workers`` (:mod:`packloader.iterable`). A worker reads and places the tokens
   (:mod:`packloader.place`; the expensive part: shard decoding, copies)
   and sends the batch as ONE int32 buffer (:func:`packloader.batch.raw_alloc`); the main process turns
   it into the tensors of the batch in one Numba pass (tens of microseconds), written straight into
   page-locked memory with ``pin_memory=True``. Moving one small buffer instead of five tensors is what
   makes workers pay: torch moves each tensor through its own shared-memory segment and file descriptor.

Exact and elastic resume
------------------------
The epoch's plan of rows is a pure function of (the data, the plan settings, seed, epoch): no rank, world
size or worker count goes into it. :meth:`~PackedDataLoader.state_dict` is the position in it,
``rows_consumed`` (plan rows handed out over all ranks, counted when the training loop receives a batch),
the same on every rank: save rank 0's. A fresh loader with the same plan settings continues exactly with
the same ``world_size`` and ``batch_size``, and elastically with others (every remaining sequence once,
none repeated, every rank the same number of batches). Epochs follow ``DistributedSampler``: call
:meth:`~PackedDataLoader.set_epoch` before each epoch; after ``load_state_dict`` the next iterator yields
the rest of the saved epoch. The rules, and what the state holds: :mod:`packloader.state`.

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

import os
import warnings
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

import packloader._numba  # noqa: F401  (first: Numba's cache fallback, before packer_algos compiles)
from packloader.distributed import data_parallel_rank_world, resolve_rank_world, resume_point  # isort: skip
from packloader.errors import DataError
from packloader.iterable import PackedIterable
from packloader.place import warm_up
from packloader.prepacked import PrepackedRows, check_capacity, is_prepacked_dir, unfinished_pack_dir
from packloader.state import STATE_FORMAT, make_state, read_state
from packloader.stream import StreamingRows
from packloader.workers import LoaderIterator

__all__ = ["PackedDataLoader", "STATE_FORMAT"]


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
    refused with an error naming it. Details: :mod:`packloader.state`.

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
            ``"split"`` (consecutive pieces, each its own segment), ``"carry"`` (pieces in order on one
            rank, for a model that carries its state across them: batches gain ``piece_doc_ids``,
            ``piece_index``, ``has_initial_state``, ``continues_after``; the rule and what a resume does:
            :mod:`packloader.carry`), ``"truncate"`` (the first ``capacity`` tokens) or ``"drop"``. Whatever it changed is counted in :attr:`overflow_counts` (also in
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
        verify: a pre-packed directory: also hash every packed file once, when the loader is built, and
            compare with the checksums in ``index.json`` (reads all the data; default False). Without it the
            loader still checks, reading no data, each file's size, row count, schema and the job hash it
            carries against ``index.json``.
        balance: how each global step's rows are split over ranks: ``"tokens"`` (default: equal real
            tokens per rank, right for pure Mamba models, whose cost is linear in tokens) or ``"compute"``
            (equal estimated cost, ``sum(n) + attention_factor * sum(n^2)`` over each row's sequences: for
            hybrids with attention layers, where one long sequence costs more than many short ones of the
            same tokens; see :func:`packloader.distributed.assign_rows_by_cost`). Steps are the same rows
            either way, so resume stays exact and elastic, and ``balance`` may change between save and load.
        attention_factor: with ``balance="compute"`` (required there, else None): the cost of one
            query-key pair in units of one token, measured by
            :func:`packloader.distributed.calibrate_attention_factor`.
        cost_sort_window: with ``balance="compute"``: also place rows *into steps* by cost: sort the plan by
            estimated cost inside consecutive windows of this many rows (:class:`packloader.balance.CostSortedRows`),
            so a step holds rows of similar cost and splits evenly over the ranks (a few global steps' rows,
            e.g. ``16 * world_size * batch_size``). It changes the plan (the data order inside a window follows
            cost), so it is part of the source's fingerprint: a state resumes only with the same window and
            factor. Default None: plan order.
        carry_one_piece_per_step: with ``overflow="carry"``: never two pieces of one document in one step, each
            piece in a later step than the one before (on the same rank). Every continuation then starts from the
            state the model's cache kept (truncated backpropagation at each cut; one scan a layer, about the cost
            of ``"split"``), instead of from its predecessor in the same step (the gradient flows through the
            chain, but the predecessor's rows are scanned twice). Default False.
        context_parallel_size: ranks per context-parallel group (``C``, a divisor of the world size).
            The ``C`` consecutive ranks ``k * C ... k * C + C - 1`` (the ``"cp"`` dimension of
            ``init_device_mesh(device, (world // C, C), mesh_dim_names=("dp", "cp"))``) get the same batches
            in the same order, each of them whole (split the sequence dimension over the group yourself, or
            with the model's context-parallel mode); rows are partitioned over the ``world // C``
            data-parallel groups (:attr:`dp_rank` of :attr:`dp_size`) as over ranks without CP. The state
            counts rows over the data-parallel groups (its ``world_size`` is :attr:`dp_size`), so it resumes
            exactly with the same ``dp_size`` and ``batch_size`` whatever ``C``, and elastically with another
            ``dp_size``. For another rank layout pass ``rank=dp_rank, world_size=dp_size`` and leave this at 1.

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
                 pin_memory_device: str = "", verify: bool = False, balance: str = "tokens",
                 attention_factor: float | None = None, cost_sort_window: int | None = None,
                 context_parallel_size: int = 1, carry_one_piece_per_step: bool = False):
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
        self.context_parallel_size = context_parallel_size
        self.dp_rank, self.dp_size = data_parallel_rank_world(self.rank, self.world_size, context_parallel_size)
        if balance not in ("tokens", "compute"):
            raise ValueError(f"balance must be 'tokens' or 'compute', got {balance!r}")
        if balance == "compute":
            if isinstance(attention_factor, bool) or not isinstance(attention_factor, (int, float, np.number)) \
                    or not np.isfinite(attention_factor) or attention_factor < 0:
                raise ValueError("balance='compute' needs attention_factor, a finite number >= 0 (measure it "
                                 "with packloader.distributed.calibrate_attention_factor), got "
                                 f"{attention_factor!r}")
        elif attention_factor is not None:
            raise ValueError(f"attention_factor={attention_factor!r} is only used with balance='compute'")
        self.balance = balance
        self.attention_factor = float(attention_factor) if balance == "compute" else None
        if cost_sort_window is not None:
            if balance != "compute":
                raise ValueError(f"cost_sort_window={cost_sort_window!r} needs balance='compute' (and its "
                                 "attention_factor)")
            if isinstance(cost_sort_window, bool) or not isinstance(cost_sort_window, (int, np.integer)) \
                    or cost_sort_window < 1:
                raise ValueError(f"cost_sort_window must be an int >= 1, got {cost_sort_window!r}")
        self.cost_sort_window = None if cost_sort_window is None else int(cost_sort_window)
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.drop_last, self.num_workers = bool(drop_last), int(num_workers)

        if overflow is not None:
            from packer_algos.pieces import check_overflow

            check_overflow(overflow)
        if is_prepacked_dir(source):
            rows = PrepackedRows(source, verify=verify)
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
        if self.balance == "compute" and getattr(rows, "overflow", None) == "carry":
            raise ValueError("balance='compute' does not combine with overflow='carry' (the carry rule places "
                             "a document's pieces itself); use balance='tokens'")
        if self.cost_sort_window is not None:
            from packloader.balance import CostSortedRows

            rows = CostSortedRows(rows, self.cost_sort_window, self.attention_factor)
        if context_parallel_size > 1 and self.capacity % context_parallel_size:
            raise ValueError(f"capacity {self.capacity} is not divisible by context_parallel_size="
                             f"{context_parallel_size}: every rank of a context-parallel group takes an equal chunk "
                             "of each row (ops.shard_batch)")
        self.dataset = PackedIterable(rows, rank=self.dp_rank, world_size=self.dp_size,
                                       batch_size=self.batch_size, drop_last=self.drop_last, seed=self.seed,
                                       shuffle=self.shuffle, hf_compat=self.hf_compat, return_ids=self.return_ids)
        self.dataset.attention_factor = self.attention_factor
        if carry_one_piece_per_step and not self.dataset.carries:
            raise ValueError("carry_one_piece_per_step=True needs overflow='carry'")
        self.dataset.carry_one_piece_per_step = bool(carry_one_piece_per_step)
        if self.num_workers > 0:
            self.dataset.share_control()
            warm_up()  # the placer, loaded once here instead of in every worker of every epoch
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
                "drop": f"dropped ({c['lost_tokens']} tokens lost)",
                "carry": f"cut into chains of pieces of at most {self.capacity} tokens (all kept, in order on "
                         "one rank; each batch says which piece continues which: packloader.carry)"}[c["policy"]]
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

    def __iter__(self) -> LoaderIterator:
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
        return LoaderIterator(self, iter(self._dl), epoch, start, n, self._iter_gen)

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
        step = self.dp_size * self.batch_size
        if n == 0:
            warnings.warn(f"PackedDataLoader: epoch {epoch} has no batches: the source packs into {n_rows} "
                          f"row(s), fewer than world_size * batch_size = {step}, and drop_last=True drops "
                          "them; use drop_last=False or a smaller batch_size / world_size", stacklevel=3)
        else:
            who = (f"rank {self.rank} of {self.world_size}" if self.context_parallel_size == 1 else
                   f"data-parallel group {self.dp_rank} of {self.dp_size} (rank {self.rank})")
            warnings.warn(f"PackedDataLoader: {who} gets no data in epoch "
                          f"{epoch}: the source packs into {n_rows} row(s), fewer than world_size * "
                          f"batch_size = {step}; this rank yields {n} batch(es) of padding rows only "
                          "(num_loss_tokens == 0)", stacklevel=3)

    # -- state ---------------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        return {
            "source": self.dataset.rows.fingerprint,
            "capacity": self.capacity,
            "batch_size": self.batch_size,
            "world_size": self.dp_size,   # data-parallel groups: the rows are partitioned over them
            "context_parallel_size": self.context_parallel_size,
            "balance": self.balance if self.attention_factor is None else f"compute:{self.attention_factor!r}",
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
        :mod:`packloader.state`).

        Keys: ``epoch``; ``rows_consumed``, the plan rows of the epoch handed out over all ranks (what a
        resume continues from, whatever its world size and batch size); ``epoch_rows`` and
        ``epoch_digest``, the epoch's plan (row count, hash of the rows' token counts) to check on load;
        ``batches_consumed``, this loader's batch index in its schedule of the epoch (informational);
        ``settings``, the loader's settings (``world_size``, ``batch_size``, ``drop_last``
        informational, the others must match on load); ``overflow_counts``, see :attr:`overflow_counts`
        (checked and restored on load).
        """
        batches = self._resume if self._resume is not None else self._consumed
        state = make_state(epoch=self._epoch, offset=self._offset, batches=batches,
                           n_batches=self.num_batches(self._epoch), epoch_info=self.dataset.epoch_info(self._epoch),
                           settings=self._settings(), overflow_counts=self.overflow_counts)
        if self.dataset.carries:  # the carry rule's position: see packloader.carry
            state["carry"] = self.dataset.carry(self._epoch, self._offset).state_at(batches)
            state["rows_consumed"] = state["carry"].pop("rows_consumed")
        return state

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
        epoch, done, counts = read_state(state, self._settings(), self.dataset.epoch_info, self._overflow_counts)
        self._overflow_counts = counts
        n_rows = self.dataset.epoch_info(epoch)[0]
        if self.dataset.carries:
            offset, start = self._carry_resume(state, epoch, n_rows)
        else:
            offset, start = resume_point(done, n_rows, self.dp_size, self.batch_size, self.drop_last)
        self._epoch, self._offset, self._consumed, self._resume = epoch, offset, start, start
        self._iter_gen += 1  # an iterator still open from before no longer counts


    def _carry_resume(self, state: dict, epoch: int, n_rows: int) -> tuple[int, int]:
        """``(control offset, first batch)`` of an ``overflow="carry"`` resume (see :mod:`packloader.carry`):
        the fresh schedule at the saved batch when it is the saved position (same layout), else the schedule
        from the saved carry state (``offset`` 1), warning when chains restart (another world size)."""
        from packloader.carry import read_carry_state

        saved = read_carry_state(state.get("carry"), n_rows)
        batches = state.get("batches_consumed")
        fresh = self.dataset.carry(epoch, 0)
        if isinstance(batches, int) and 0 <= batches <= fresh.n_batches:
            mine = fresh.state_at(batches)
            mine.pop("rows_consumed")
            if mine == {**saved, "pins": [list(p) for p in saved["pins"]]}:
                return 0, batches
        self.dataset.carry_start = saved
        it = getattr(self._dl, "_iterator", None)
        if it is not None:  # persistent workers hold the old carry_start: start them afresh
            getattr(it, "_shutdown_workers", lambda: None)()
            self._dl._iterator = None
        resumed = self.dataset.carry(epoch, 1)
        if resumed.restarted_docs:
            why = (f"on world_size={self.dp_size} (saved with {saved['world_size']})"
                   if saved["world_size"] != self.dp_size else
                   "where the saving run had dropped their next piece (drop_last) and said no piece follows")
            warnings.warn(f"PackedDataLoader: resuming {why}: {resumed.restarted_docs} chain(s) interrupted by the "
                          "checkpoint restart from a zero state: their next piece has has_initial_state=False "
                          "although piece_index > 0 (see packloader.carry)", stacklevel=3)
        return 1, 0


def _can_pin() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()
