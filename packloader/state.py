"""The loader's resume state: what :meth:`packloader.PackedDataLoader.state_dict` saves, and the checks of
:meth:`~packloader.PackedDataLoader.load_state_dict`.

Exact and elastic resume
------------------------
The epoch's plan is a pure function of (sequence lengths, settings, seed, epoch), and no rank, world
size or worker count goes into it (every rank computes the whole plan, the online packer included; see
:mod:`packloader.rows`), so the state is only the position in it: ``{epoch, rows_consumed}`` plus the
settings, the epoch's row count and a digest of its plan to check against (JSON, a few hundred bytes, no
token data). ``rows_consumed`` is MosaicML streaming's ``sample_in_epoch``: the plan rows ``[0, R)``
handed out, over all ranks together. Batches are counted when the training loop receives them
(``__next__`` in the main process, :class:`packloader.workers.LoaderIterator`): batches prefetched by
workers but not yet handed out are not consumed. All ranks consume the same number of batches, so
**every rank's state is the same**: save rank 0's (``if rank == 0: torch.save(...)``) and load it on
every rank of the next run.

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
  ``R // (world_size * batch_size)`` (:func:`packloader.distributed.resume_point`);
* **not** another ``source`` (other shards, another order of them, another pre-packed directory),
  ``capacity``, ``seed``, ``shuffle``, ``algorithm``, ``buffer_size``, ``overflow`` or
  ``max_items_per_bin`` (:data:`PLAN_SETTINGS`): these make the plan, so the saved position means nothing
  under other ones. :func:`read_state` names the setting, both values and what may change; it also
  refuses a plan that differs although the settings match (a packer changed between versions). Finish the
  epoch with the old settings, or start a new epoch (``set_epoch``) without loading the state.

Both sources are elastic: a pre-packed directory's plan is its rows in a ``(seed, epoch)`` order, a
streaming source's the packer's rows over the ``(seed, epoch)`` stream order. Once every batch of an
epoch is out the state says ``rows_consumed == epoch_rows`` (a tail that ``drop_last`` dropped counts as
done), and any layout resumes it with an empty rest. States of the first format (``version`` 1,
``batches_consumed`` of the saving layout) still load, elastically too.

Epochs follow ``DistributedSampler``: call ``set_epoch`` before each epoch to reshuffle; iterating again
without it repeats the epoch. After ``load_state_dict`` the *next* iterator yields the rest of the saved
epoch (``set_epoch`` with the saved epoch keeps that; another epoch discards it), so the usual loop
``for e in range(state["epoch"], n_epochs): loader.set_epoch(e); for batch in loader: ...`` continues
exactly. A state saved at the very end of an epoch yields an empty rest of that epoch, then the loop
moves on to the next epoch, as the uninterrupted run would.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from packloader.distributed import num_batches, rows_consumed

__all__ = ["STATE_FORMAT", "STATE_VERSION", "PLAN_SETTINGS", "LAYOUT_SETTINGS", "make_state", "read_state"]

STATE_FORMAT = "packloader.PackedDataLoader"
STATE_VERSION = 2
#: settings that decide the epoch's plan of rows: a state resumes only with the same ones
PLAN_SETTINGS = ("source", "capacity", "seed", "shuffle", "algorithm", "buffer_size", "overflow",
                 "max_items_per_bin")
#: settings that only cut the plan into batches (saved for information; they may change between save and
#: load, as may num_workers and the output options, which are not saved)
LAYOUT_SETTINGS = ("world_size", "batch_size", "drop_last")


def make_state(*, epoch: int, offset: int, batches: int, n_batches: int, epoch_info: tuple[int, str],
               settings: dict, overflow_counts: dict) -> dict[str, Any]:
    """The state of a loader at batch ``batches`` of its schedule of ``epoch`` (``n_batches`` batches, global
    steps from plan row ``offset``); ``epoch_info`` is the plan's ``(rows, digest)``. Keys: see
    :meth:`packloader.PackedDataLoader.state_dict`."""
    n_rows, digest = epoch_info
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "epoch": epoch,
        "rows_consumed": rows_consumed(offset, batches, n_batches, n_rows, settings["world_size"],
                                       settings["batch_size"]),
        "epoch_rows": n_rows,
        "epoch_digest": digest,
        "batches_consumed": int(batches),
        "settings": settings,
        "overflow_counts": overflow_counts,
    }


def _is_count(value, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def read_state(state, settings: dict, epoch_info: Callable[[int], tuple[int, str]],
               overflow_counts: dict) -> tuple[int, int, dict]:
    """Check a saved state against this loader's ``settings`` and plans (``epoch_info(epoch)`` ->
    ``(rows, digest)``) and its ``overflow_counts``.

    Returns:
        ``(epoch, rows_consumed, overflow_counts)``: the saved position as plan rows of the epoch, and the
        overflow counts to keep (the saved ones; this loader's for a state that has none).

    Raises:
        ValueError: not a loader state; saved with other plan settings (names the key, both values, and
            what may change); the epoch's plan differs from the saved one although the settings match
            (another packer version); a position outside the epoch.
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
    allowed = (f"the plan settings ({', '.join(PLAN_SETTINGS)}) must be as when saved; "
               f"{', '.join(LAYOUT_SETTINGS)} and num_workers may change")
    for key in PLAN_SETTINGS:
        if key not in saved:
            raise ValueError(f"state_dict mismatch: {key!r} missing from the saved state")
        if saved[key] != settings[key]:
            raise ValueError(f"state_dict mismatch: {key!r} was {saved[key]!r} when saved, this loader "
                             f"has {settings[key]!r}; the epoch's plan of rows depends on it, so the saved "
                             f"position means nothing here ({allowed})")
    epoch = state.get("epoch")
    if not _is_count(epoch):
        raise ValueError(f"bad state_dict position: epoch={epoch!r}")
    n_rows, digest = epoch_info(epoch)
    if version == 1:  # position in batches of the saving layout
        consumed = state.get("batches_consumed")
        if not _is_count(consumed):
            raise ValueError(f"bad state_dict position: epoch={epoch!r}, batches_consumed={consumed!r}")
        layout = [saved.get(k) for k in LAYOUT_SETTINGS]
        if not all(_is_count(v, 1) for v in layout[:2]):
            raise ValueError(f"bad state_dict settings: world_size={layout[0]!r}, batch_size={layout[1]!r}")
        world, batch, drop_last = layout[0], layout[1], bool(layout[2])
        n = num_batches(n_rows, world, batch, drop_last)
        if consumed > n:
            raise ValueError(f"state_dict position batches_consumed={consumed} is past the end of epoch "
                             f"{epoch} ({n} batches of world_size={world}, batch_size={batch})")
        done = rows_consumed(0, consumed, n, n_rows, world, batch)
    else:
        done = state.get("rows_consumed")
        if not _is_count(done):
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
        if counts != overflow_counts:
            raise ValueError(f"state_dict mismatch: overflow_counts were {counts!r} when saved, this loader "
                             f"has {overflow_counts!r} with the same settings (another packloader version?)")
        overflow_counts = counts
    return epoch, done, dict(overflow_counts)
