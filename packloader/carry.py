"""``overflow="carry"`` in the loader: the one rule for which rank and step each row of a chain goes to, the
continuation keys of a batch, and the resume state.

A document longer than ``capacity`` is a *chain* of pieces (:mod:`packer_algos.chains`): piece 0 (the
remainder) shares a row with short sequences, pieces 1, 2, ... fill a row each, and the epoch's plan lists
every continuation row after the row of the piece before it. A model carries its state from a piece to
the next, so the loader guarantees, on every rank:

(a) the pieces of a document arrive in order: piece ``k + 1`` is in a later row of the same batch or in a
    later batch of the **same rank**;
(b) a piece with ``has_initial_state`` has had its predecessor delivered earlier (or earlier in the same
    batch) on that rank: never skipped, never on another rank;
(c) every rank yields the same number of batches.

The rule (:func:`carry_schedule`)
---------------------------------
Global steps of ``S = world_size * batch_size`` rows are filled from the plan in order, as without carry,
except that a continuation row is *pinned* to the rank of its predecessor's row::

    plan rows    0:[x x y0]  1:[y1]  2:[y2]  3:[z z]  4:[w w]  5:[v v]      (world 2, batch 2: S = 4)
    step 0       rank 0: 0 [x x y0], 1 [y1]          rank 1: 3 [z z], 4 [w w]     (2 [y2]: rank 0 full,
    step 1       rank 0: 2 [y2], ...                 rank 1: 5 [v v], ...          deferred to step 1)

Each step takes first the *deferred* rows (in plan order), then new rows in plan order. A row whose
predecessor is not scheduled yet, or whose pinned rank has no room left in the step, is deferred to the
next step (with ``one_piece_per_step``, also a row whose predecessor is in the current step: then no step holds
two pieces of one document, and every continuation takes its state from the model's cache); any other row goes to the rank with the fewest tokens in the step that still has room (ties to
the lower rank). Inside a batch rows keep plan order, so a predecessor in the same batch is in an earlier
row. A step is short only when the plan's rows run out while deferred rows wait for their rank: it is
completed with padding rows (with ``drop_last=True`` the short steps at the end of the epoch are dropped,
and a piece whose successor is dropped says ``continues_after=False``). Every rank computes the same
schedule from the plan alone.

Resume
------
The state at a step boundary is the position in the plan (``next_row``), the deferred rows, and for every
unconsumed row whose predecessor was consumed, the rank holding that chain's state (``pins``); JSON,
saved under ``"carry"`` in the loader's ``state_dict`` (the same on every rank).

* **Same world size** (any ``batch_size``, ``drop_last``, ``num_workers``): every chain stays intact. An
  interrupted chain continues on the rank that had it, with ``has_initial_state=True``; the model's state
  cache, saved by that rank in the same checkpoint, supplies its state. With the same ``batch_size`` too
  the batches are exactly those of the uninterrupted run.
* **A successor the saving run dropped** (``drop_last``; its predecessor said ``continues_after=False``, so the
  model kept no state): a resumed schedule that delivers it (another ``batch_size`` or ``drop_last``) restarts that
  chain from zero, as below, and warns.
* **Another world size**: the chains that were interrupted by the checkpoint (some pieces consumed, some
  not) *restart*: their next piece comes with ``has_initial_state=False`` (state from zero, as with
  ``overflow="split"``) although its ``piece_index > 0``; the pieces after it carry the state as usual.
  The loader warns with their number, lists them in :attr:`CarrySchedule.restarted_docs`, and the state
  records them (``pins`` with rank -1) until they are resumed. No other chain is affected.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from packloader._numba import njit_cached
from packloader.batch import CARRY_BATCH_KEYS

__all__ = ["DOC_KEY_SHIFT", "doc_keys", "CarrySchedule", "carry_schedule", "carry_state", "read_carry_state",
           "segment_keys"]

#: ``piece_doc_ids = source_file_index << DOC_KEY_SHIFT | sequence_index``: unique in a dataset of fewer than
#: 2**23 files of fewer than 2**40 sequences each
DOC_KEY_SHIFT = 40



def doc_keys(source_file, sequence) -> np.ndarray:
    """int64 document keys of (source file index, sequence index in that file) pairs."""
    return (np.asarray(source_file, np.int64) << DOC_KEY_SHIFT) | np.asarray(sequence, np.int64)


@njit_cached(nogil=True)
def _schedule_kernel(row_tokens, pred_row, world_size, batch_size, next_row, pending, pin_rank,
                     row_step, row_rank, row_slot, restarted, step_next_row, step_rows, one_piece_per_step):
    """Run the rule from the state (next_row, pending, pins) to the end of the epoch. ``row_step`` is -1 for
    rows not yet scheduled, -2 for rows consumed before; filled in: step, rank and slot of every row this
    schedule places, ``restarted`` for rows whose chain restarts, ``step_next_row[s]`` (plan position at the
    start of step s) and ``step_rows[s]``. Returns the number of steps."""
    n = row_tokens.shape[0]
    S = world_size * batch_size
    pend = pending.copy()
    npend = pend.shape[0]
    buf = np.empty(n, np.int64)
    fill = np.zeros(world_size, np.int64)
    load = np.zeros(world_size, np.int64)
    nxt = next_row
    step = 0
    while npend > 0 or nxt < n:
        fill[:] = 0
        load[:] = 0
        total = 0
        nb = 0
        step_next_row[step] = nxt
        i = 0
        while True:
            if i < npend:
                r = pend[i]
                i += 1
            elif total < S and nxt < n:
                r = nxt
                nxt += 1
            else:
                break
            w = -1
            defer = total >= S
            if not defer:
                p = pred_row[r]
                if p >= 0:
                    if row_step[p] == -1:
                        defer = True          # predecessor not placed yet
                    elif row_step[p] == -2:
                        w = pin_rank[r]       # consumed before this schedule: the saved pin
                        if w < 0:
                            restarted[r] = True
                    else:
                        w = row_rank[p]
                        if one_piece_per_step and row_step[p] == step:
                            defer = True      # its predecessor is in this step: the next one
                if w >= 0 and fill[w] >= batch_size:
                    defer = True
            if defer:
                buf[nb] = r
                nb += 1
                continue
            if w < 0:
                for v in range(world_size):
                    if fill[v] < batch_size and (w < 0 or load[v] < load[w]):
                        w = v
            row_step[r] = step
            row_rank[r] = w
            row_slot[r] = fill[w]
            fill[w] += 1
            load[w] += row_tokens[r]
            total += 1
        step_rows[step] = total
        pend, buf = buf, pend
        npend = nb
        if buf.shape[0] < n:
            buf = np.empty(n, np.int64)
        step += 1
    step_next_row[step] = nxt
    return step


class CarrySchedule:
    """The schedule of one epoch under the carry rule, for all ranks (see the module docstring).

    Attributes:
        rows: int64 ``[world_size, n_batches, batch_size]``: plan rows, -1 for padding rows.
        row_step, row_rank: int64 [N]: step and rank of each plan row; -1 never delivered by this schedule
            (dropped with ``drop_last``), -2 consumed before it (resume).
        restarted: bool [N]: the row's continuation piece starts from a zero state (its chain was
            interrupted by a resume on another world size).
        restarted_docs: number of chains restarted.
    """

    def __init__(self, row_tokens, pred_row, world_size: int, batch_size: int, drop_last: bool,
                 start: dict | None = None, one_piece_per_step: bool = False):
        row_tokens = np.ascontiguousarray(row_tokens, np.int64)
        self.pred_row = pred_row = np.ascontiguousarray(pred_row, np.int64)
        n = row_tokens.size
        self.n_rows, self.world_size, self.batch_size = n, int(world_size), int(batch_size)
        row_step = np.full(n, -1, np.int64)
        pin_rank = np.full(n, -1, np.int64)
        if start is None:
            next_row, pending = 0, np.zeros(0, np.int64)
        else:
            next_row, pending = int(start["next_row"]), np.asarray(start["deferred"], np.int64)
            row_step[:next_row] = -2
            row_step[pending] = -1
            for r, w in start["pins"]:
                pin_rank[r] = w if w < world_size and start["world_size"] == world_size else -1
        self.start = start
        row_rank = np.full(n, -1, np.int64)
        row_slot = np.full(n, -1, np.int64)
        restarted = np.zeros(n, bool)
        step_next_row = np.zeros(n + 2, np.int64)
        step_rows = np.zeros(n + 1, np.int64)
        self.one_piece_per_step = bool(one_piece_per_step)
        n_steps = _schedule_kernel(row_tokens, pred_row, self.world_size, self.batch_size, next_row, pending,
                                   pin_rank, row_step, row_rank, row_slot, restarted, step_next_row, step_rows,
                                   self.one_piece_per_step)
        S = self.world_size * self.batch_size
        if drop_last:
            full = np.flatnonzero(step_rows[:n_steps] == S)
            keep = int(full[-1]) + 1 if full.size else 0
            drop = row_step >= keep
            row_step[drop] = row_rank[drop] = row_slot[drop] = -1
            n_steps = keep
        self.n_batches = int(n_steps)
        self.step_next_row = step_next_row[: n_steps + 1]
        self.row_step, self.row_rank, self.restarted = row_step, row_rank, restarted
        self.restarted_docs = int(restarted.sum())
        self.rows = np.full((self.world_size, self.n_batches, self.batch_size), -1, np.int64)
        placed = np.flatnonzero(row_step >= 0)
        self.rows[row_rank[placed], row_step[placed], row_slot[placed]] = placed

    def delivered(self) -> np.ndarray:
        """bool [N]: rows this schedule hands out."""
        return self.row_step >= 0

    def state_at(self, batches: int) -> dict[str, Any]:
        """The resume state after ``batches`` batches of this schedule (every rank's is the same)."""
        k = min(int(batches), self.n_batches)
        consumed = (self.row_step == -2) | ((self.row_step >= 0) & (self.row_step < k))
        if k >= self.n_batches:  # the end of the epoch: rows the schedule dropped count as done
            consumed[:] = True
        next_row = self.n_rows if k >= self.n_batches else int(self.step_next_row[k])
        deferred = np.flatnonzero(~consumed[:next_row])
        p = self.pred_row
        open_rows = np.flatnonzero(~consumed & (p >= 0))
        open_rows = open_rows[consumed[p[open_rows]]]
        pins = []
        start_pins = {} if self.start is None else {int(r): int(w) for r, w in self.start["pins"]}
        same_world = self.start is None or self.start["world_size"] == self.world_size
        for r in open_rows.tolist():
            pred = int(p[r])
            if self.row_step[pred] >= 0:
                # a successor this schedule drops (drop_last) was announced as not following (continues_after=False):
                # the model kept no state for it, so a resumed schedule that delivers it restarts its chain
                pins.append([r, int(self.row_rank[pred]) if self.row_step[r] >= 0 else -1])
            else:  # consumed before this schedule began: keep the saved pin (or its restart)
                w = start_pins.get(r, -1)
                pins.append([r, w if same_world and w < self.world_size else -1])
        return {"next_row": int(next_row), "deferred": deferred.tolist(), "pins": pins,
                "world_size": self.world_size, "rows_consumed": int(consumed.sum())}


def carry_schedule(row_tokens, pred_row, world_size: int, batch_size: int, drop_last: bool,
                   start: dict | None = None, one_piece_per_step: bool = False) -> CarrySchedule:
    """The epoch's schedule under the carry rule, from the beginning or from a saved state ``start``."""
    return CarrySchedule(row_tokens, pred_row, world_size, batch_size, drop_last, start, one_piece_per_step)


def carry_state(schedule: CarrySchedule, batches: int) -> dict[str, Any]:
    """The ``"carry"`` entry of the loader state after ``batches`` batches of ``schedule``."""
    return schedule.state_at(batches)


def read_carry_state(state, n_rows: int) -> dict[str, Any]:
    """Check a saved ``"carry"`` entry against an epoch of ``n_rows`` plan rows.

    Raises:
        ValueError: missing or malformed, naming what is wrong.
    """
    if not isinstance(state, dict):
        raise ValueError("state_dict mismatch: overflow='carry' but the saved state has no 'carry' entry "
                         "(saved by a loader without overflow='carry'?)")
    try:
        next_row = int(state["next_row"])
        deferred = [int(r) for r in state["deferred"]]
        pins = [(int(r), int(w)) for r, w in state["pins"]]
        world = int(state["world_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad state_dict 'carry' entry: {e!r}") from None
    if not 0 <= next_row <= n_rows or any(not 0 <= r < next_row for r in deferred) or \
            any(not 0 <= r < n_rows for r, _ in pins) or world < 1:
        raise ValueError(f"bad state_dict 'carry' entry: rows outside the epoch's {n_rows} rows")
    return {"next_row": next_row, "deferred": deferred, "pins": pins, "world_size": world}


class _PieceKeys(NamedTuple):
    doc: np.ndarray
    index: np.ndarray
    initial: np.ndarray
    after: np.ndarray


def segment_keys(seq_offsets, seq_lens, capacity: int, keys: _PieceKeys | tuple) -> dict[str, np.ndarray]:
    """The carry keys per segment of a batch (pieces of each row, then the row's padding tail if any; a
    padding row is one segment), from the per-piece ``(doc, index, initial, after)`` arrays."""
    seq_offsets = np.asarray(seq_offsets, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    counts = np.diff(seq_offsets)
    csum = np.zeros(seq_lens.size + 1, np.int64)
    np.cumsum(seq_lens, out=csum[1:])
    fill = csum[seq_offsets[1:]] - csum[seq_offsets[:-1]]
    tail = fill < capacity
    per_row = counts + tail
    first_seg = np.zeros(counts.size + 1, np.int64)
    np.cumsum(per_row, out=first_seg[1:])
    row_of = np.repeat(np.arange(counts.size), counts)
    seg = first_seg[row_of] + np.arange(seq_lens.size) - seq_offsets[row_of]
    n_seg = int(first_seg[-1])
    doc, index, initial, after = keys
    out = {key: np.zeros(n_seg, dtype) for key, (_, dtype) in CARRY_BATCH_KEYS.items()}
    out["piece_doc_ids"][:] = -1    # whole sequences and padding tails
    for key, values in zip(CARRY_BATCH_KEYS, (doc, index, initial, after)):
        out[key][seg] = values
    return out
