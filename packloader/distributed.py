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
6. Compute balancing (``balance="compute"``, :func:`assign_rows_by_cost`): for hybrids with attention
   layers, rows of equal tokens do not cost equal time (attention grows with ``n^2`` per sequence). Each
   global step is then split over ranks by an estimated cost per row, :func:`row_costs`
   (``sum(n) + attention_factor * sum(n^2)`` over the row's sequences; ``attention_factor`` measured by
   :func:`calibrate_attention_factor`): longest-processing-time greedy, then swaps between the most and
   the least loaded rank while they shrink the largest load. Steps stay the same windows of consecutive
   plan rows (the resume position is a prefix of the plan, so that exact and elastic resume hold
   unchanged); only which rank of the step takes which row changes. To place rows *into steps* by cost
   as well, the loader's ``cost_sort_window`` sorts the plan by cost inside windows of plan rows
   (:class:`packloader.balance.CostSortedRows`: a plan of its own, independent of the layout), so that a
   step holds rows of similar cost.
7. Context-parallel groups (``context_parallel_size=C``, :func:`data_parallel_rank_world`): the ``C``
   consecutive ranks ``dp * C ... dp * C + C - 1`` form one CP group (the layout of
   ``init_device_mesh(device, (world // C, C), mesh_dim_names=("dp", "cp"))``) and get the same rows;
   rows are partitioned over the ``world // C`` data-parallel groups exactly as over ranks above.
"""
from __future__ import annotations

import os
import time
from typing import Callable, NamedTuple

import numpy as np
from numba import njit

__all__ = ["resolve_rank_world", "data_parallel_rank_world", "assign_rows", "assign_rows_by_cost", "row_costs",
           "step_cost_spread", "calibrate_attention_factor", "AttentionCalibration", "num_batches", "resume_point",
           "rows_consumed", "worker_batch_indices", "current_worker"]


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


def data_parallel_rank_world(rank: int, world_size: int, context_parallel_size: int = 1) -> tuple[int, int]:
    """The data-parallel group of ``rank`` when context-parallel groups of ``context_parallel_size`` ranks
    share rows: ``(dp_rank, dp_size) = (rank // C, world_size // C)``.

    The ``C`` consecutive ranks ``dp_rank * C ... dp_rank * C + C - 1`` form one context-parallel group:
    the layout of ``torch.distributed.device_mesh.init_device_mesh(device, (world_size // C, C),
    mesh_dim_names=("dp", "cp"))``, where the ``"cp"`` dimension is the innermost one. For another layout,
    give the loader ``rank=dp_rank, world_size=dp_size`` yourself and leave ``context_parallel_size`` at 1.

    Example::

        data_parallel_rank_world(rank=5, world_size=8, context_parallel_size=2)   # (2, 4): ranks 4 and 5 share rows

    Args:
        rank: this process's rank in ``[0, world_size)``.
        world_size: all ranks (data-parallel times context-parallel).
        context_parallel_size: ranks per context-parallel group (``C >= 1``, a divisor of ``world_size``).

    Raises:
        ValueError: ``context_parallel_size`` not an int >= 1 or not a divisor of ``world_size`` (names both).
    """
    c = context_parallel_size
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
        raise ValueError(f"context_parallel_size must be an int >= 1, got {c!r}")
    if world_size % c:
        raise ValueError(f"context_parallel_size={c} does not divide world_size={world_size}: every "
                         "context-parallel group needs the same number of ranks")
    return int(rank) // int(c), int(world_size) // int(c)


def num_batches(n_rows: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches per rank for an epoch of ``n_rows`` packed rows (identical on every rank)."""
    step = world_size * batch_size
    return n_rows // step if drop_last else -(-n_rows // step)


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
        # the cost rule with cost = tokens (exact in float64) and no swaps: decreasing tokens, each row to the
        # least loaded rank with room
        _assign_cost_kernel(row_tokens[offset: offset + n_steps * world_size * batch_size].astype(np.float64),
                            world_size, batch_size, n_steps, out, 0)
        if offset:
            out[out >= 0] += offset
    return out


def row_costs(row_offsets: np.ndarray, lengths: np.ndarray, attention_factor: float) -> np.ndarray:
    """Estimated training cost of each packed row: ``sum(n) + attention_factor * sum(n * n)`` over the
    sequences (pieces) of the row, in units of one token through the SSM layers.

    Rows of equal tokens cost the same in a pure Mamba model (``attention_factor = 0``: the cost is the
    token count), but not in a hybrid with attention layers, whose cost grows with the square of each
    sequence's length. ``attention_factor`` is the extra cost of one query-key pair relative to one token;
    :func:`calibrate_attention_factor` measures it for a model.

    Example::

        row_costs(np.array([0, 1, 5]), np.array([400, 100, 100, 100, 100]), 1e-3)   # [560., 440.]

    Args:
        row_offsets: int [N + 1], the pieces of row ``r`` are ``lengths[row_offsets[r]:row_offsets[r + 1]]``.
        lengths: int [P], the tokens of each piece, rows after each other.
        attention_factor: float >= 0.

    Returns:
        float64 [N].

    Raises:
        ValueError: ``attention_factor`` negative or not finite; offsets that do not fit ``lengths``.
    """
    af = float(attention_factor)
    if not np.isfinite(af) or af < 0:
        raise ValueError(f"attention_factor must be a finite number >= 0, got {attention_factor!r}")
    off = np.asarray(row_offsets, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.float64)
    if off.ndim != 1 or len(off) < 1 or off[0] != 0 or off[-1] != len(n) or (np.diff(off) < 0).any():
        raise ValueError(f"row_offsets must rise from 0 to len(lengths)={len(n)}, got {off[:3]}...{off[-3:]}")
    per_piece = n + af * n * n
    csum = np.concatenate([[0.0], np.cumsum(per_piece)])
    return csum[off[1:]] - csum[off[:-1]]


@njit(cache=True)
def _assign_cost_kernel(cost, world_size, batch_size, n_steps, out, max_swaps):
    n_rows = cost.shape[0]
    step_rows = world_size * batch_size
    load = np.zeros(world_size, dtype=np.float64)
    fill = np.zeros(world_size, dtype=np.int64)
    for s in range(n_steps):
        lo = s * step_rows
        hi = min(lo + step_rows, n_rows)
        load[:] = 0.0
        fill[:] = 0
        if hi > lo:
            order = np.argsort(-cost[lo:hi], kind="mergesort")  # decreasing cost, ties in plan order
            for i in range(hi - lo):
                r = lo + order[i]
                best = -1
                for w in range(world_size):
                    if fill[w] < batch_size and (best < 0 or load[w] < load[best]):
                        best = w
                out[best, s, fill[best]] = r
                fill[best] += 1
                load[best] += cost[r]
            # swaps (or moves into a free slot) between the most and a less loaded rank, while they
            # lower the most loaded rank's cost
            for _ in range(max_swaps):
                top = 0
                for w in range(1, world_size):
                    if load[w] > load[top]:
                        top = w
                improved = False
                # partners from the least loaded up
                partners = np.argsort(load, kind="mergesort")
                for pi in range(world_size):
                    w2 = partners[pi]
                    if w2 == top:
                        continue
                    gap = load[top] - load[w2]
                    if gap <= 0:
                        break
                    best_i, best_j, best_err = -1, -2, gap  # j == -1: move into a free slot of w2
                    for i in range(fill[top]):
                        ci = cost[out[top, s, i]]
                        for j in range(-1, fill[w2]):
                            if j < 0 and fill[w2] >= batch_size:
                                continue
                            d = ci - (cost[out[w2, s, j]] if j >= 0 else 0.0)
                            if d > 0 and d < gap:
                                err = abs(gap - 2 * d)
                                if err < best_err:
                                    best_i, best_j, best_err = i, j, err
                    if best_i >= 0:
                        ri = out[top, s, best_i]
                        if best_j >= 0:
                            rj = out[w2, s, best_j]
                            out[top, s, best_i] = rj
                            out[w2, s, best_j] = ri
                            d = cost[ri] - cost[rj]
                        else:
                            out[top, s, best_i] = out[top, s, fill[top] - 1]
                            fill[top] -= 1
                            out[w2, s, fill[w2]] = ri
                            fill[w2] += 1
                            d = cost[ri]
                        load[top] -= d
                        load[w2] += d
                        improved = True
                        break
                if not improved:
                    break
        for w in range(world_size):
            for j in range(fill[w], batch_size):
                out[w, s, j] = -1
            out[w, s, : fill[w]] = np.sort(out[w, s, : fill[w]])


def assign_rows_by_cost(row_cost: np.ndarray, world_size: int, batch_size: int, drop_last: bool,
                        offset: int = 0, max_swaps: int = 64) -> np.ndarray:
    """Like :func:`assign_rows`, balancing an estimated cost per row (:func:`row_costs`) instead of tokens.

    The global steps are the same windows of ``world_size * batch_size`` consecutive plan rows as with
    :func:`assign_rows` (so :func:`resume_point` and :func:`rows_consumed` hold unchanged: exact resume
    with the same layout, elastic with another). Inside a step, rows go to ranks by decreasing cost, each
    to the least loaded rank with room, then rows are swapped (or moved into a free slot of the last,
    padded step) between the most loaded rank and a less loaded one while that lowers the largest load,
    at most ``max_swaps`` times per step. A step's time is its slowest rank's, so the largest load is what
    is minimised. Rows keep plan order inside a batch; every rank gets ``batch_size`` rows per step.

    Example::

        cost = row_costs(row_offsets, lengths, attention_factor=2e-3)
        sched = assign_rows_by_cost(cost, world_size=2, batch_size=4, drop_last=False)   # [2, n_batches, 4]

    Args:
        row_cost: float [N], the cost of each plan row, in plan order (non-negative).
        world_size: number of ranks (data-parallel groups).
        batch_size: rows per batch.
        drop_last: drop the incomplete last global step instead of padding it.
        offset: the first plan row of the first global step (see :func:`assign_rows`).
        max_swaps: improvement swaps per step (0: the greedy placement alone).

    Returns:
        int64 ``[world_size, n_batches, batch_size]``, as :func:`assign_rows`.

    Raises:
        ValueError: a negative or non-finite cost, bad sizes or offset (names the argument).
    """
    cost = np.ascontiguousarray(row_cost, dtype=np.float64)
    if cost.ndim != 1 or not np.isfinite(cost).all() or (cost < 0).any():
        raise ValueError("row_cost must be a 1-d array of finite costs >= 0")
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    if isinstance(max_swaps, bool) or not isinstance(max_swaps, (int, np.integer)) or max_swaps < 0:
        raise ValueError(f"max_swaps must be an int >= 0, got {max_swaps!r}")
    offset = int(offset)
    if not 0 <= offset <= len(cost):
        raise ValueError(f"offset must be in [0, {len(cost)}], got {offset}")
    n_steps = num_batches(len(cost) - offset, world_size, batch_size, drop_last)
    out = np.empty((world_size, n_steps, batch_size), dtype=np.int64)
    if n_steps:
        _assign_cost_kernel(cost[offset: offset + n_steps * world_size * batch_size], world_size, batch_size,
                            n_steps, out, int(max_swaps))
        if offset:
            out[out >= 0] += offset
    return out


def step_cost_spread(schedule: np.ndarray, row_cost: np.ndarray) -> np.ndarray:
    """Per global step of ``schedule`` (``[world_size, n_batches, batch_size]``, from :func:`assign_rows` or
    :func:`assign_rows_by_cost`): ``max / mean`` of the ranks' summed row costs (1.0: perfectly balanced;
    a step of only padding rows counts as 1.0). The expected slowdown of a step against perfect balance."""
    cost = np.asarray(row_cost, dtype=np.float64)
    sched = np.asarray(schedule)
    per = np.where(sched >= 0, cost[np.maximum(sched, 0)], 0.0).sum(axis=2)  # [world, n_batches]
    mean = per.mean(axis=0)
    return np.where(mean > 0, per.max(axis=0) / np.where(mean > 0, mean, 1.0), 1.0)


class AttentionCalibration(NamedTuple):
    """What :func:`calibrate_attention_factor` measured.

    Attributes:
        attention_factor: the cost of one query-key pair in units of one token's cost (for :func:`row_costs`).
        seconds_long: median seconds of the row holding one sequence of ``capacity`` tokens.
        seconds_short: median seconds of the row of ``capacity // short_length`` sequences.
        capacity, short_length: the two shapes.
    """

    attention_factor: float
    seconds_long: float
    seconds_short: float
    capacity: int
    short_length: int


def calibrate_attention_factor(step: Callable, capacity: int, short_length: int = 128, repeats: int = 5,
                               warmup: int = 2, synchronize: Callable | None = None,
                               clock: Callable[[], float] = time.perf_counter) -> AttentionCalibration:
    """Measure ``attention_factor`` of :func:`row_costs` for a model by timing two rows of the same tokens.

    Row A holds one sequence of ``capacity`` tokens (``sum n = L``, ``sum n^2 = L^2``), row B
    ``L / short_length`` sequences of ``short_length`` tokens (``sum n = L``, ``sum n^2 = L * short_length``).
    With the model ``t = a * sum(n) + b * sum(n^2)`` (a fixed overhead goes into ``a``: both rows have ``L``
    tokens), ``b = (t_A - t_B) / (L^2 - L * short_length)``, ``a = (t_B - b * L * short_length) / L`` and the
    factor is ``b / a`` (0 when A is not slower than B: no attention cost measurable).

    Example::

        def step(position_ids):                    # one training step (or forward) of one packed row
            ids = torch.randint(0, vocab, position_ids.shape, device="cuda")
            model(ids, position_ids=position_ids, labels=ids).loss.backward()
        af = calibrate_attention_factor(step, capacity=4096).attention_factor
        loader = PackedDataLoader(..., balance="compute", attention_factor=af)

    Args:
        step: called with ``position_ids`` (int64 ``[1, capacity]`` CPU tensor, restarting at 0 at each
            sequence start) for one timed run of the row; move it to the model's device yourself.
        capacity: tokens of the rows (the loader's ``capacity``).
        short_length: tokens of each sequence of row B; ``1 <= short_length < capacity``; the last sequence
            takes the remainder.
        repeats: timed runs of each row (the median is used).
        warmup: untimed runs of each row first.
        synchronize: called before reading the clock (default: ``torch.cuda.synchronize`` when CUDA is
            initialised, else nothing).
        clock: seconds, monotonic (default ``time.perf_counter``).

    Returns:
        :class:`AttentionCalibration`.

    Raises:
        ValueError: ``capacity``, ``short_length``, ``repeats`` or ``warmup`` out of range (names it).
    """
    import torch

    for name, value, lo in (("capacity", capacity, 2), ("short_length", short_length, 1), ("repeats", repeats, 1),
                            ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    if short_length >= capacity:
        raise ValueError(f"short_length must be below capacity={capacity}, got {short_length}")
    if synchronize is None:
        synchronize = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else (lambda: None)
    L, k = int(capacity), int(short_length)
    long_pos = torch.arange(L, dtype=torch.int64)[None]
    short_pos = (torch.arange(L, dtype=torch.int64) % k)[None]
    short_lens = [k] * (L // k) + ([L % k] if L % k else [])
    sum_sq_short = float(sum(n * n for n in short_lens))

    def timed(pos) -> float:
        for _ in range(warmup):
            step(pos)
        times = []
        for _ in range(repeats):
            synchronize()
            t0 = clock()
            step(pos)
            synchronize()
            times.append(clock() - t0)
        return float(np.median(times))

    t_short = timed(short_pos)
    t_long = timed(long_pos)
    b = max(0.0, (t_long - t_short) / (float(L) * L - sum_sq_short))
    a = (t_short - b * sum_sq_short) / L
    if a <= 0:   # the short row's time is all attention by this fit: noise, or attention dominates everything
        raise ValueError(f"calibrate_attention_factor: the timings ({t_short:.3g} s for rows of {k}-token sequences, "
                         f"{t_long:.3g} s for one {L}-token sequence) leave no per-token cost; time more repeats, or "
                         "use a shorter short_length")
    factor = b / a
    return AttentionCalibration(float(factor), t_long, t_short, L, k)


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
