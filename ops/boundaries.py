"""Sequence boundaries of a packed batch, in the three forms a training step meets them.

A packed row holds several sequences back to back. Their boundaries reach the ops in one of three
equivalent forms::

    row (capacity 12)   seq A (5)        seq B (3)   seq C (3)  pad
    position_ids      [  0  1  2  3  4 |  0  1  2 |  0  1  2 | 0 ]   restarts at 0 at every start
    seq_idx           [  0  0  0  0  0 |  1  1  1 |  2  2  2 | 3 ]   segment number inside the row
    cu_seqlens        [0, 5, 8, 11, 12]                              offsets over the flattened B*L tokens

The kernels consume ``position_ids`` (int32, contiguous, (batch, seqlen)): a scan resets its state
where ``position_ids == 0`` and conv tap ``k`` at time ``t`` is used only where
``position_ids[t] >= k``. Everything else is converted with the helpers here.

Valid ``position_ids`` start every row at 0 and, from one token to the next, either restart at 0 or
count up by exactly 1. :func:`validate_position_ids` checks that with one reduction (one host sync on
GPU) and names the first offending row and column otherwise. Pass ``validate=False`` to skip it.

Resolve once per step, where the boundaries enter a model (:class:`ops.PackedMamba`, a model converted by
:func:`ops.enable_packing`): :func:`resolve_boundaries` / :func:`resolve_position_ids` turn whichever form
was given into int32 ``position_ids`` (and ``seq_idx`` where a Mamba-2 mixer needs it), validate them, and
the layers below receive the resolved tensors and do not check again.

Under ``torch.compile`` validation is skipped (``torch.compiler.is_compiling()``): it needs a host sync, which
would break the graph. Validate the batch outside the compiled region (``ops.validate_position_ids``) if the
ids are not trusted; the loader's are valid by construction. The conversions themselves are sync-free
(``cu_seqlens`` too, when the batch shape is given).
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

__all__ = [
    "validate_position_ids",
    "seq_idx_to_position_ids",
    "position_ids_to_seq_idx",
    "cu_seqlens_to_position_ids",
    "position_ids_to_cu_seqlens",
    "cu_seqlens_to_seq_idx",
    "resolve_position_ids",
    "resolve_boundaries",
    "row_positions",
    "BoundaryError",
]


class BoundaryError(ValueError):
    """Sequence boundaries (position_ids / seq_idx / cu_seqlens) that are malformed or disagree."""


def _check_2d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise BoundaryError(f"{name} must have shape (batch, seqlen), got {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise BoundaryError(f"{name} must be an integer tensor, got {t.dtype}")


def _bad_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (batch, seqlen): True where an id neither restarts at 0 nor counts up by 1."""
    p = position_ids
    # the id each token may take besides 0: the previous one plus 1; 0 for the first column (it must be 0)
    allowed = torch.nn.functional.pad(p[:, :-1] + 1, (1, 0))
    return (p != 0) & (p != allowed)


def validate_position_ids(position_ids: torch.Tensor) -> None:
    """Raise :class:`BoundaryError` unless ``position_ids`` is a valid packed layout.

    Every row must start at 0, and every next id must be 0 (a new sequence starts) or the previous
    id plus 1. Costs one reduction (a single host sync on GPU); the error is only built on failure.

    Args:
        position_ids: integer tensor (batch, seqlen).

    Raises:
        BoundaryError: naming the first offending row and column, the id found and the ids allowed.
    """
    _check_2d("position_ids", position_ids)
    if position_ids.numel() == 0:
        return
    bad = _bad_positions(position_ids)
    # the one sync, which also tells whether every row is one sequence (valid ids ending at seqlen - 1): then the
    # scan's forward runs rows whole instead of planning to cut them (single_sequence_rows)
    single = position_ids[:, -1] == position_ids.shape[1] - 1
    any_bad, all_single = torch.stack([bad.any(), single.all()]).tolist()
    if not any_bad:
        _single_rows.put(position_ids, bool(all_single))
        return
    row, col = (int(v) for v in bad.nonzero()[0].tolist())
    got = int(position_ids[row, col])
    if col == 0:
        raise BoundaryError(
            f"position_ids[{row}, 0] = {got}: every row must start a sequence, i.e. begin at 0"
        )
    prev = int(position_ids[row, col - 1])
    raise BoundaryError(
        f"position_ids[{row}, {col}] = {got} after {prev}: position ids must restart at 0 "
        f"(a new sequence) or count up by 1 (expected 0 or {prev + 1})"
    )


def seq_idx_to_position_ids(seq_idx: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Convert ``seq_idx`` (batch, seqlen) into ``position_ids`` (batch, seqlen).

    A new sequence starts at column 0 of every row and wherever ``seq_idx`` changes from one token to
    the next (any change counts, so ids need not be consecutive). Example::

        seq_idx      [0 0 0 1 1 2]  ->  position_ids [0 1 2 0 1 0]

    Args:
        seq_idx: integer tensor (batch, seqlen).
        dtype: dtype of the result (int32 is what the kernels take).
    """
    _check_2d("seq_idx", seq_idx)
    batch, seqlen = seq_idx.shape
    if seqlen == 0:
        return torch.zeros(batch, 0, dtype=dtype, device=seq_idx.device)
    ar = torch.arange(seqlen, device=seq_idx.device, dtype=torch.int64).expand(batch, seqlen)
    start = torch.ones(batch, seqlen, dtype=torch.bool, device=seq_idx.device)
    start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    start_col = torch.where(start, ar, torch.zeros_like(ar)).cummax(dim=1).values
    return (ar - start_col).to(dtype).contiguous()


def position_ids_to_seq_idx(position_ids: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Convert ``position_ids`` (batch, seqlen) into ``seq_idx`` (batch, seqlen), numbering the
    sequences of each row 0, 1, 2, ... (the form causal-conv1d and mamba-ssm's Mamba-2 take)::

        position_ids [0 1 2 0 1 0]  ->  seq_idx [0 0 0 1 1 2]

    Column 0 always starts a sequence. No validation (see :func:`validate_position_ids`).
    """
    _check_2d("position_ids", position_ids)
    start = position_ids == 0
    if start.shape[1] > 0:
        start[:, 0] = True
    return (start.to(torch.int32).cumsum(dim=1, dtype=torch.int32) - 1).to(dtype).contiguous()


def cu_seqlens_to_position_ids(
    cu_seqlens: torch.Tensor,
    shape: Optional[Tuple[int, int]] = None,
    dtype: torch.dtype = torch.int32,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Convert ``cu_seqlens`` (n_seqs + 1,) over the flattened tokens into ``position_ids``.

    ``cu_seqlens`` holds cumulative sequence offsets over the B*L tokens of the batch flattened row
    by row, starting at 0 and ending at B*L (what the loader emits, and what flash-attn's varlen
    kernels take). A sequence may not straddle two rows.

    Args:
        cu_seqlens: int tensor (n_seqs + 1,), non-decreasing, ``cu_seqlens[0] == 0``.
        shape: ``(batch, seqlen)`` of the result; default ``(1, cu_seqlens[-1])`` (a host sync).
        dtype: dtype of the result.
        validate: check the offsets (host syncs; skipped under ``torch.compile``). Given ``shape`` and
            ``validate=False`` (or under compile) the conversion needs no sync.

    Returns:
        position_ids (batch, seqlen).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise BoundaryError(f"cu_seqlens must be 1-D with at least one entry, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise BoundaryError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(torch.int64)
    if shape is None:
        shape = (1, int(cu[-1]))
    batch, seqlen = int(shape[0]), int(shape[1])
    total = batch * seqlen
    if validate and not torch.compiler.is_compiling():
        _validate_cu_seqlens(cu, batch, seqlen)
    ar = torch.arange(total, device=cu.device, dtype=torch.int64)
    # the sequence holding token i is the last one starting at or before i (empty sequences skipped)
    start = cu[torch.searchsorted(cu, ar, right=True) - 1]
    return (ar - start).view(batch, seqlen).to(dtype).contiguous()


def _validate_cu_seqlens(cu: torch.Tensor, batch: int, seqlen: int) -> None:
    total = int(cu[-1])
    if int(cu[0]) != 0:
        raise BoundaryError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    lens = cu[1:] - cu[:-1]
    if bool((lens < 0).any()):
        raise BoundaryError("cu_seqlens must be non-decreasing")
    if batch * seqlen != total:
        raise BoundaryError(
            f"cu_seqlens covers {total} tokens but shape {(batch, seqlen)} holds {batch * seqlen}"
        )
    if seqlen > 0:
        starts, ends = cu[:-1], cu[1:]
        crosses = (lens > 0) & ((starts // seqlen) != ((ends - 1) // seqlen))
        if bool(crosses.any()):
            i = int(crosses.nonzero()[0])
            raise BoundaryError(
                f"sequence {i} of cu_seqlens (tokens [{int(starts[i])}, {int(ends[i])}) of the flattened "
                f"batch) straddles two rows of length {seqlen}"
            )


def position_ids_to_cu_seqlens(position_ids: torch.Tensor, dtype: torch.dtype = torch.int32) -> Tuple[torch.Tensor, int]:
    """Convert ``position_ids`` (batch, seqlen) into ``(cu_seqlens, max_seqlen)`` over the flattened
    B*L tokens. Every row start counts as a sequence start.

    Returns:
        cu_seqlens: (n_seqs + 1,) of ``dtype``, from 0 to B*L; max_seqlen: int (one host sync).
    """
    _check_2d("position_ids", position_ids)
    batch, seqlen = position_ids.shape
    start = position_ids == 0
    if seqlen > 0:
        start[:, 0] = True
    starts = start.reshape(-1).nonzero().squeeze(1)
    total = torch.tensor([batch * seqlen], device=position_ids.device, dtype=starts.dtype)
    cu = torch.cat([starts, total]).to(dtype)
    max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu, max_seqlen


def cu_seqlens_to_seq_idx(cu_seqlens: torch.Tensor, shape: Optional[Tuple[int, int]] = None,
                          dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``cu_seqlens`` -> ``seq_idx`` (batch, seqlen), numbering sequences from 0 within each row."""
    return position_ids_to_seq_idx(cu_seqlens_to_position_ids(cu_seqlens, shape), dtype)


# ---------------------------------------------------------------------------------------------
# Resolution: once per step, where the boundaries enter a model
# ---------------------------------------------------------------------------------------------

def row_positions(batch: int, seqlen: int, device=None) -> torch.Tensor:
    """``position_ids`` of rows that are each one sequence: ``0, 1, ..., seqlen - 1`` (int32, contiguous)."""
    return torch.arange(seqlen, dtype=torch.int32, device=device).expand(batch, seqlen).contiguous()


# The ids the mixers use for rows without boundaries, made once per (shape, device) and shared by every layer and
# step (no kernels to make them, the conv's run mask kept with them): never handed out to be changed.
_shared_rows: dict = {}
_SHARED_ROWS_KEPT = 8


def shared_row_positions(batch: int, seqlen: int, device) -> torch.Tensor:
    """:func:`row_positions`, the same tensor on every call for a shape and device (internal: not to be changed).
    Made afresh under ``torch.compile`` and while a CUDA graph is being captured (a tensor made there is not
    filled until the graph is replayed)."""
    device = torch.device(device)
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return row_positions(batch, seqlen, device)
    key = (batch, seqlen, str(device))
    got = _shared_rows.get(key)
    if got is None:
        with torch.inference_mode(False):   # usable (savable for backward) outside inference mode too
            got = row_positions(batch, seqlen, device)
        if len(_shared_rows) >= _SHARED_ROWS_KEPT:
            _shared_rows.pop(next(iter(_shared_rows)))
        _shared_rows[key] = got
    return got


def note_single_sequence_rows(position_ids: torch.Tensor, single: bool) -> None:
    """Record that ``position_ids`` (the int32 tensor the kernels get) holds one sequence in every row (``single``)
    or not, for :func:`single_sequence_rows`, while it is alive and unchanged: for ids whose layout a caller learnt
    without :func:`validate_position_ids` (a context-parallel chunk, whose first id restarts the row)."""
    _single_rows.put(position_ids, bool(single))


def single_sequence_rows(position_ids: torch.Tensor) -> bool:
    """Whether ``position_ids`` (the int32 tensor the kernels get) is known to hold one sequence in every row: the
    ids of :func:`shared_row_positions`, or ids :func:`validate_position_ids` checked and found so (while they are
    alive and unchanged). False when not known: nothing is synced here."""
    key = (position_ids.shape[0], position_ids.shape[1], str(position_ids.device)) if position_ids.dim() == 2 else None
    if key is not None and _shared_rows.get(key) is position_ids:
        return True
    return bool(_single_rows.get(position_ids))


def _check_agree(pos: torch.Tensor, seq_idx: torch.Tensor) -> None:
    other = seq_idx_to_position_ids(seq_idx.to(pos.device))
    diff = (other == 0) != (pos == 0)
    if bool(diff.any()):
        row, col = (int(v) for v in diff.nonzero()[0].tolist())
        raise BoundaryError(
            f"position_ids and seq_idx disagree at [{row}, {col}]: position_ids says "
            f"{'a sequence starts' if int(pos[row, col]) == 0 else 'no sequence starts'} "
            f"there, seq_idx says the opposite"
        )


class TensorMemo:
    """Values derived from a tensor, kept while that tensor is alive and unchanged: keyed by its identity (and an
    ``extra`` key: a device, say), a value is returned while the tensor's ``_version`` and shape are those it was made
    with. The last ``size`` keys are kept. Nothing is kept under ``torch.compile`` or for inference tensors (they keep
    no version counter); a change that does not bump the version (written through ``.data`` or a numpy array sharing
    the memory) is not seen. One home for the per-step memos of the boundaries (the resolved ids, the resolved
    :class:`PackedBoundaries` of the functional ops, the conv's run mask)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: dict = {}   # (id, extra) -> (weakref to the tensor, its _version, shape, value)

    @staticmethod
    def usable(t) -> bool:
        return isinstance(t, torch.Tensor) and not torch.compiler.is_compiling() and not t.is_inference()

    def get(self, t: torch.Tensor, extra=None):
        """The value kept for ``t`` (and ``extra``), or None."""
        if not self.usable(t):
            return None
        got = self._entries.get((id(t), extra))
        if got is not None and got[0]() is t and got[1] == t._version and got[2] == tuple(t.shape):
            return got[3]
        return None

    def put(self, t: torch.Tensor, value, extra=None):
        """Keep ``value`` for ``t`` (and ``extra``); returns ``value``."""
        if self.usable(t):
            key = (id(t), extra)
            if key not in self._entries and len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)), None)
            self._entries[key] = (weakref.ref(t), t._version, tuple(t.shape), value)
        return value


def resolve_position_ids(
    position_ids: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    batch: Optional[int] = None,
    seqlen: Optional[int] = None,
    *,
    device: Optional[torch.device] = None,
    validate: bool = True,
) -> Optional[torch.Tensor]:
    """Turn whichever boundaries were given into int32 contiguous ``position_ids`` (batch, seqlen).

    Args:
        position_ids: (batch, seqlen) integer, restarting at 0 at every sequence start, or None.
        seq_idx: (batch, seqlen) integer segment numbers, or None.
        batch, seqlen: the expected shape (checked when given).
        device: move the result there (e.g. the activations' device).
        validate: check ``position_ids`` (one reduction, a host sync) and, when both forms are given, that
            they describe the same boundaries. Skipped under ``torch.compile``, and for a ``position_ids`` tensor
            already checked here while it is alive and unchanged (a stack of layers handed the same ids checks
            them once). Call this once per step, where the boundaries enter the model, and hand the result down
            with ``validate=False``.

    Returns:
        int32 contiguous (batch, seqlen) tensor (the input itself when it already is one), or None when
        neither form is given (no boundaries: each row is one sequence).

    Raises:
        BoundaryError: wrong shape, malformed ids, or position_ids and seq_idx that disagree.
    """
    if position_ids is None and seq_idx is None:
        return None
    check = validate and not torch.compiler.is_compiling()
    memo_key = None
    if position_ids is not None:
        _check_2d("position_ids", position_ids)
        if seq_idx is None:   # resolved before (a stack of layers): the same int32 tensor, checked once
            memo_key = str(torch.device(device)) if device is not None else str(position_ids.device)
            got = _resolved.get(position_ids, memo_key)
            if got is not None and (got[1] or not check):
                return _check_shape(got[0], batch, seqlen)
        pos = position_ids.to(torch.int32).contiguous()
        if seq_idx is not None:
            _check_2d("seq_idx", seq_idx)
            if seq_idx.shape != position_ids.shape:
                raise BoundaryError(
                    f"position_ids {tuple(position_ids.shape)} and seq_idx {tuple(seq_idx.shape)} have different shapes"
                )
        if check:
            validate_position_ids(pos)
            if seq_idx is not None:
                _check_agree(pos, seq_idx)
    else:
        pos = seq_idx_to_position_ids(seq_idx)
    _check_shape(pos, batch, seqlen)
    if device is not None and pos.device != torch.device(device):
        pos = pos.to(device)
    if memo_key is not None:
        _resolved.put(position_ids, (pos, check), memo_key)
    return pos


def _check_shape(pos: torch.Tensor, batch: Optional[int], seqlen: Optional[int]) -> torch.Tensor:
    if batch is not None and seqlen is not None and tuple(pos.shape) != (batch, seqlen):
        raise BoundaryError(
            f"boundaries have shape {tuple(pos.shape)} but the activations are (batch={batch}, seqlen={seqlen})"
        )
    return pos


# A stack of layers, each resolving the same position_ids (ops.PackedMamba with validate_boundaries on, the
# functional ops' position_ids=): the ids are converted to int32 and checked once, at the first layer, not once a layer
# (each check is a host sync that stops the host from running ahead of the GPU), and every layer gets the same int32
# tensor (so the conv's run mask, kept per tensor, is made once too). Value: (the int32 ids, whether checked).
_resolved = TensorMemo()
# position_ids checked by validate_position_ids and found to hold one sequence a row (True) or not (False)
_single_rows = TensorMemo()


def resolve_boundaries(
    position_ids: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    shape: Optional[Tuple[int, int]] = None,
    *,
    device: Optional[torch.device] = None,
    validate: bool = True,
    need_seq_idx: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Model-level resolution, once per step: any of the three forms -> ``(position_ids, seq_idx)`` int32
    contiguous, validated (unless ``validate=False`` or under ``torch.compile``).

    ``seq_idx`` is computed only when ``need_seq_idx`` (or passed through when given). ``(None, None)``
    when no boundaries were given.
    """
    if position_ids is None and seq_idx is None and cu_seqlens is not None:
        if shape is None:
            raise BoundaryError("cu_seqlens needs the (batch, seqlen) shape of the batch")
        position_ids = cu_seqlens_to_position_ids(cu_seqlens.to(device) if device is not None else cu_seqlens, shape,
                                                  validate=validate)
        validate = False  # checked as cu_seqlens: the position_ids made from them are valid by construction
    pos = resolve_position_ids(position_ids, seq_idx, *(shape or (None, None)), device=device, validate=validate)
    if pos is None:
        return None, None
    seq = None
    if seq_idx is not None:
        seq = seq_idx.to(device=pos.device, dtype=torch.int32).contiguous()
    elif need_seq_idx:
        seq = position_ids_to_seq_idx(pos)
    return pos, seq


class PackedBoundaries:
    """The boundaries of one packed batch, resolved once and handed to every functional op of the step.

    :func:`ops.packed_causal_conv1d` and :func:`ops.packed_selective_scan` given ``position_ids`` convert and
    check them (a host sync) and build the conv's boundary mask; they do it once per tensor and reuse it while the
    tensor is alive and unchanged (:func:`boundaries_for_ids`). Made once per batch, this object carries the int32
    ids and keeps what the ops derive from them (the conv kernels' run mask, the number of sequences): a call with
    ``boundaries=`` does neither again::

        position_ids  [ 0 1 2 3 0 1 2 0 ]        (a, b, c)
        bounds = ops.PackedBoundaries.resolve(position_ids=pos, device="cuda")   # checked here, once
        x = ops.packed_causal_conv1d(x, w, b, "silu", boundaries=bounds)
        y = ops.packed_selective_scan(x, delta, A, B, C, D, z, dt_bias, True, boundaries=bounds)

    Build it with :meth:`resolve`. Its tensors are not to be changed afterwards.

    Attributes:
        position_ids: (batch, seqlen) int32 contiguous.
        seq_idx: (batch, seqlen) int32, when given to :meth:`resolve` (a negative one marks padding, which the conv
            zeroes as causal-conv1d does), else None.
        num_sequences: the number of sequences (starts), when counted (``count=True``), else None.
    """

    def __init__(self, position_ids: torch.Tensor, seq_idx: Optional[torch.Tensor] = None,
                 num_sequences: Optional[int] = None):
        self.position_ids = position_ids
        self.seq_idx = seq_idx
        self.num_sequences = num_sequences
        self._derived: dict = {}

    @classmethod
    def resolve(cls, position_ids: Optional[torch.Tensor] = None, seq_idx: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, shape: Optional[Tuple[int, int]] = None, *,
                device=None, validate: bool = True, count: bool = False) -> "PackedBoundaries":
        """Resolve a batch's boundaries, given in any of the three forms.

        Args:
            position_ids, seq_idx, cu_seqlens: as the ops and :func:`resolve_boundaries` take them (one is enough).
            shape: (batch, seqlen), needed with ``cu_seqlens`` alone.
            device: where the ops will run (the activations' device).
            validate: check them (one host sync), as the ops would.
            count: also count the sequences (one host sync): what ``output_final_state`` needs.

        Raises:
            BoundaryError: none given, or malformed (naming the row and column).
        """
        pos, seq = resolve_boundaries(position_ids, seq_idx, cu_seqlens, shape, device=device, validate=validate)
        if pos is None:
            raise BoundaryError("PackedBoundaries.resolve: give position_ids, seq_idx or cu_seqlens")
        num = int((pos == 0).sum()) if count else None
        return cls(pos, seq, num)

    @property
    def shape(self) -> Tuple[int, int]:
        return tuple(self.position_ids.shape)

    def derived(self, key, make):
        """``make()`` once per ``key`` (kept on the object; recomputed under ``torch.compile``)."""
        if torch.compiler.is_compiling():
            return make()
        got = self._derived.get(key)
        if got is None:
            got = self._derived[key] = make()
        return got

    def check(self, what: str, batch: int, seqlen: int, device, position_ids, seq_idx) -> torch.Tensor:
        """The ids for an op over (batch, seqlen) on ``device``; a clear error where they do not fit."""
        if position_ids is not None or seq_idx is not None:
            raise ValueError(f"{what}: give boundaries= or position_ids / seq_idx, not both")
        if self.shape != (batch, seqlen):
            raise BoundaryError(f"{what}: boundaries are for {self.shape}, the inputs are (batch={batch}, "
                                f"seqlen={seqlen})")
        if self.position_ids.device != torch.device(device):
            raise BoundaryError(f"{what}: boundaries are on {self.position_ids.device}, the inputs on {device}: "
                                "resolve them with device=")
        return self.position_ids


def resolve_for_op(what: str, position_ids: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor],
                   boundaries: Optional["PackedBoundaries"], batch: int, seqlen: int, device, validate: bool):
    """The functional ops' one rule for their boundaries: ``(position_ids int32, seq_idx, validate, boundaries)``.
    ``boundaries=`` as given (checked against the inputs; no validation again); a ``position_ids`` tensor alone
    through :func:`boundaries_for_ids` (resolved once per tensor); else converted per call (``validate`` as given);
    neither: each row one sequence. ``validate`` stays on for the ids given as ``position_ids`` (the states' count
    is checked against them)."""
    given = boundaries is not None
    if (not given and position_ids is not None and seq_idx is None
            and tuple(position_ids.shape) == (batch, seqlen)):   # the same ids again: resolved once
        boundaries = boundaries_for_ids(position_ids, device, validate)
        position_ids = None if boundaries is not None else position_ids
    if boundaries is not None:
        pos = boundaries.check(what, batch, seqlen, device, position_ids, seq_idx)
        return pos, boundaries.seq_idx, validate and not given, boundaries
    pos = resolve_position_ids(position_ids, seq_idx, batch, seqlen, device=device, validate=validate)
    if pos is None:
        pos = shared_row_positions(batch, seqlen, device)
    return pos, seq_idx, validate, None


# ----------------------------------------------------------------------------------------------------------------
# position_ids given to the functional ops call after call: resolved once per tensor

_recent = TensorMemo()   # (the ids, the device) -> (PackedBoundaries, whether checked)


def boundaries_for_ids(position_ids: torch.Tensor, device, validate: bool) -> Optional[PackedBoundaries]:
    """The :class:`PackedBoundaries` of ``position_ids`` on ``device``, made (and checked, where ``validate``) at the
    first call with this tensor and reused while it is alive and unchanged (its ``_version``): a model that hands the
    same ``position_ids`` to the functional ops of every layer pays for one conversion, one check and one conv mask a
    step, as with ``boundaries=``. None under ``torch.compile`` and for inference tensors (the ops resolve per call
    there). A change that does not bump the tensor's version (written through ``.data`` or a numpy array sharing its
    memory) is not seen: hand such ids over as a new tensor, or as ``boundaries=``."""
    if not TensorMemo.usable(position_ids):
        return None   # (an inference tensor keeps no version counter: resolved per call, as before)
    dev = torch.device(device) if device is not None else position_ids.device
    got = _recent.get(position_ids, str(dev))
    if got is not None and (got[1] or not validate):
        return got[0]
    bounds = PackedBoundaries.resolve(position_ids=position_ids, device=dev, validate=validate)
    return _recent.put(position_ids, (bounds, validate), str(dev))[0]
