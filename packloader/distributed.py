"""Rank and worker partitioning, in one place.

Everything that decides *which rank and which DataLoader worker produces which packed row* lives here,
so that the rest of the loader only has to build the rows it is told to build.

How an epoch is split
---------------------
1. The epoch's packing plan is an ordered list of ``N`` packed rows (the same on every rank: it is
   computed from sequence lengths, seed and epoch only; see :mod:`packloader.rows`).
2. The rows are cut into *global steps* of ``world_size * batch_size`` consecutive rows. Step ``s`` gives
   every rank exactly ``batch_size`` rows, chosen greedily so that ranks get balanced token counts
   (:func:`assign_rows`: rows by decreasing token count, each to the rank with the fewest tokens so far
   that still has room; ties to the lower rank). Inside a rank's batch the rows keep plan order.
3. Remainder: if ``N`` is not a multiple of ``world_size * batch_size``, the last step is filled up with
   *padding rows* (row id ``-1``: all padding, labels all -100, no loss tokens), so every rank gets the
   same number of full batches, ``ceil(N / (world_size * batch_size))``, and no sequence is dropped. With
   ``drop_last=True`` the incomplete last step is dropped instead (at most ``world_size*batch_size - 1``
   rows; they are not carried over) and there are ``N // (world_size * batch_size)`` batches.
   Either way every rank yields the same number of batches, so DDP / FSDP collectives never hang, and
   every batch has the static shape ``[batch_size, capacity]``.
4. Workers: a rank's batch ``k`` (counted from the start of the epoch) is built by worker
   ``(k - start) % num_workers`` where ``start`` is the first batch of the current iterator (non-zero
   after a resume). ``torch.utils.data.DataLoader`` collects batches from its workers round-robin,
   so the rank sees batches in the canonical order ``start, start+1, ...`` whatever ``num_workers`` is.
5. Elastic resume: the position in an epoch is one number, ``rows_consumed`` (``R``): the plan rows
   ``[0, R)`` have been handed out, over all ranks (MosaicML streaming's ``sample_in_epoch``). Ranks
   move in lock-step, so after ``k`` batches ``R = k * world_size * batch_size`` (or ``N`` once the
   epoch's batches are all out: with ``drop_last`` the dropped tail counts as done). Any layout
   ``(world_size', batch_size')`` continues from ``R``: its global steps of ``S' = world_size' *
   batch_size'`` rows start at ``offset = R % S'`` (:func:`resume_point`), so the step boundary falls on
   ``R``, batch ``R // S'`` of the schedule is the first one after the resume, and rows ``[R, N)`` are
   each in exactly one batch of one rank. With the saving layout, ``offset == 0`` and the schedule is
   the uninterrupted one, batch for batch.
"""
from __future__ import annotations

import os

import numpy as np
from numba import njit

__all__ = ["resolve_rank_world", "assign_rows", "num_batches", "resume_point", "rows_consumed",
           "worker_batch_indices", "current_worker"]


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Rank and world size: the arguments, else ``torch.distributed`` (if initialised), else the
    ``RANK`` / ``WORLD_SIZE`` environment variables, else ``(0, 1)``.

    Raises:
        ValueError: world_size < 1, or rank outside ``[0, world_size)`` (naming both values).
    """
    if rank is None or world_size is None:
        dist_rank = dist_world = None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist_rank, dist_world = dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        if dist_world is None and "WORLD_SIZE" in os.environ:
            dist_world = int(os.environ["WORLD_SIZE"])
            dist_rank = int(os.environ.get("RANK", "0"))
        if world_size is None:
            world_size = dist_world if dist_world is not None else 1
        if rank is None:
            rank = dist_rank if dist_rank is not None else 0
    rank, world_size = int(rank), int(world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
    return rank, world_size


def num_batches(n_rows: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches per rank for an epoch of ``n_rows`` packed rows (identical on every rank)."""
    step = world_size * batch_size
    return n_rows // step if drop_last else -(-n_rows // step)


@njit(cache=True)
def _assign_kernel(row_tokens, world_size, batch_size, n_steps, out):
    n_rows = row_tokens.shape[0]
    step_rows = world_size * batch_size
    load = np.zeros(world_size, dtype=np.int64)
    fill = np.zeros(world_size, dtype=np.int64)
    for s in range(n_steps):
        lo = s * step_rows
        hi = min(lo + step_rows, n_rows)
        load[:] = 0
        fill[:] = 0
        if hi > lo:
            # stable sort by decreasing tokens: argsort of (-tokens) with index tie-break
            keys = -row_tokens[lo:hi]
            order = np.argsort(keys, kind="mergesort")
            for i in range(hi - lo):
                r = lo + order[i]
                best = -1
                for w in range(world_size):
                    if fill[w] < batch_size and (best < 0 or load[w] < load[best]):
                        best = w
                out[best, s, fill[best]] = r
                fill[best] += 1
                load[best] += row_tokens[r]
        # padding rows (-1) fill the rest; sort each rank's rows into plan order
        for w in range(world_size):
            for j in range(fill[w], batch_size):
                out[w, s, j] = -1
            out[w, s, : fill[w]] = np.sort(out[w, s, : fill[w]])


def assign_rows(row_tokens: np.ndarray, world_size: int, batch_size: int, drop_last: bool,
                offset: int = 0) -> np.ndarray:
    """Assign an epoch's packed rows to ranks and batches.

    Args:
        row_tokens: int64 [N], real (non-padding) tokens of each plan row, in plan order.
        world_size: number of ranks.
        batch_size: rows per batch.
        drop_last: drop the incomplete last global step instead of padding it.
        offset: the first plan row of the first global step (0 for a fresh epoch; ``R % (world_size *
            batch_size)`` after an elastic resume at ``R``, see :func:`resume_point`). Rows before it are
            in no batch.

    Returns:
        int64 ``[world_size, n_batches, batch_size]``: plan row ids, ``-1`` for a padding row. Every row
        of ``[offset, offset + n_batches * world_size * batch_size)`` (capped at ``N``) appears exactly
        once. Step ``s`` depends only on rows ``offset + s * S ... offset + (s+1) * S - 1``.
    """
    row_tokens = np.ascontiguousarray(row_tokens, dtype=np.int64)
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    offset = int(offset)
    if not 0 <= offset <= len(row_tokens):
        raise ValueError(f"offset must be in [0, {len(row_tokens)}], got {offset}")
    n_steps = num_batches(len(row_tokens) - offset, world_size, batch_size, drop_last)
    out = np.empty((world_size, n_steps, batch_size), dtype=np.int64)
    if n_steps:
        _assign_kernel(row_tokens[offset: offset + n_steps * world_size * batch_size], world_size, batch_size,
                       n_steps, out)
        if offset:
            out[out >= 0] += offset
    return out


def resume_point(rows_consumed: int, n_rows: int, world_size: int, batch_size: int,
                 drop_last: bool) -> tuple[int, int]:
    """Where a layout of ``S = world_size * batch_size`` rows per global step continues an epoch of
    ``n_rows`` plan rows of which ``[0, rows_consumed)`` are consumed: ``(offset, start)``, the
    :func:`assign_rows` offset and the first batch of that schedule to hand out, with
    ``offset + start * S == rows_consumed``, ``offset < S``. At the end of the epoch
    (``rows_consumed == n_rows``) it is the end of the fresh schedule, ``(0, num_batches(...))``."""
    if not 0 <= rows_consumed <= n_rows:
        raise ValueError(f"rows_consumed must be in [0, {n_rows}], got {rows_consumed}")
    if rows_consumed == n_rows:
        return 0, num_batches(n_rows, world_size, batch_size, drop_last)
    step = world_size * batch_size
    return rows_consumed % step, rows_consumed // step


def rows_consumed(offset: int, batches: int, n_batches: int, n_rows: int, world_size: int,
                  batch_size: int) -> int:
    """Plan rows consumed (all ranks together) after ``batches`` batches of a schedule of ``n_batches``
    batches that starts at ``offset``: ``offset + batches * world_size * batch_size``, and ``n_rows``
    once every batch is out (the padding of the last step, or the tail that ``drop_last`` drops, counts
    as done)."""
    if batches >= n_batches:
        return int(n_rows)
    return int(offset) + int(batches) * world_size * batch_size


def worker_batch_indices(n_batches: int, start: int, worker_id: int, num_workers: int) -> range:
    """The batches (of one rank's epoch) that worker ``worker_id`` of ``num_workers`` builds, in order,
    for an iterator that begins at batch ``start``. Together the workers cover ``range(start, n_batches)``
    exactly once, and round-robin collection restores the canonical order."""
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id {worker_id} not in [0, num_workers={num_workers})")
    return range(start + worker_id, n_batches, num_workers)


def current_worker() -> tuple[int, int]:
    """``(worker_id, num_workers)`` of the calling DataLoader worker, ``(0, 1)`` in the main process."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
