"""Packed batch layout and the collation that builds it.

This module is the one place that defines what a training step receives from
:class:`packloader.PackedDataLoader`. A *packed row* holds several whole sequences (or pieces of
split ones) back to back, followed by padding up to ``capacity`` (= ``L``) tokens::

    capacity L = 12       seq A (5)        seq B (3)   seq C (3)  pad
    input_ids     [ a0 a1 a2 a3 a4 | b0 b1 b2 | c0 c1 c2 | 0 ]
    labels        [  - a1 a2 a3 a4 |  - b1 b2 |  - c1 c2 | - ]     (- = -100: no loss)
    position_ids  [  0  1  2  3  4 |  0  1  2 |  0  1  2 | 0 ]
    seq_idx       [  0  0  0  0  0 |  1  1  1 |  2  2  2 | 3 ]
    cu_seqlens    [0, 5, 8, 11, 12,  <row 2 continues at 12 + ...>]

Batch keys (``B`` = batch size in rows, ``L`` = capacity, ``S`` = number of segments in the batch,
counting the padding tail of each row that has one as its own segment):

=====================  ===============  =======  =============================================================
key                    shape            dtype    meaning
=====================  ===============  =======  =============================================================
``input_ids``          [B, L]           int64    token ids; padding is 0 (or what the pre-packed file holds)
``labels``             [B, L]           int64    ``labels[t] = input_ids[t]`` (the model shifts), except -100 at
                                                 the first token of every segment and on padding; any -100 in
                                                 the source's own ``labels`` column is kept
``position_ids``       [B, L]           int64    0, 1, 2, ... restarting at every segment start; the padding
                                                 tail counts up from 0 as its own segment
``seq_idx``            [B, L]           int32    segment number inside the row, from 0; the padding tail is
                                                 its own (last) segment
``cu_seqlens``         [S + 1]          int32    cumulative segment lengths over the flattened ``B*L`` tokens
                                                 (row-major); starts at 0 and ends at ``B*L``
``max_seqlen``         python int       --       longest segment in ``cu_seqlens`` (padding tails included)
``num_loss_tokens``    python int       --       ``(labels != -100).sum()``: normalise the summed loss by it
``cu_seq_lens_q/k``    [S + 1]          int32    only with ``hf_compat=True``: same tensor as ``cu_seqlens``
                                                 (names of Hugging Face's padding-free attention path)
``max_length_q/k``     python int       --       only with ``hf_compat=True``: same as ``max_seqlen``
``row_ids``            [B]              int64    only with ``return_ids=True`` and a pre-packed source: row of
                                                 the pre-packed dataset, -1 for a padding row
``sample_ids``         [S_real, 5]      int64    only with ``return_ids=True``: for each
                                                 non-padding segment in order, (row in the batch, source file
                                                 index, sequence index in that file, first token within that
                                                 sequence, length)
``piece_doc_ids``      [S]              int64    only with ``overflow="carry"``, one entry per segment of
                                                 ``cu_seqlens`` (padding tails included): the document key of
                                                 a segment that is a piece of a cut document (``source_file
                                                 << 40 | sequence index``, unique in the dataset), -1 for
                                                 whole sequences and padding tails
``piece_index``        [S]              int32    only with ``overflow="carry"``: 0-based index of the piece
                                                 in its document (0 for whole sequences and padding)
``has_initial_state``  [S]              bool     only with ``overflow="carry"``: the segment continues the
                                                 previous piece of its document, whose final state it starts
                                                 from (``piece_index > 0``; False only where a chain restarts
                                                 after a resume on another world size)
``continues_after``    [S]              bool     only with ``overflow="carry"``: another piece of this
                                                 document follows, in a later row of this batch or a later
                                                 batch of this rank
=====================  ===============  =======  =============================================================

A continued piece (``overflow="carry"``, capacity 8, document D of 19 tokens cut into D0 = 3 tokens, then
D1, D2 = 8 tokens each; the rows are on the same rank, D2 in a later row or batch than D1)::

                       seq A (5)        D0 (3)      row 1: D1 (8)                    row 2: D2 (8)
    input_ids     [ a0 a1 a2 a3 a4 | d0 d1 d2 ] [ d3 d4 d5 d6 d7 d8 d9 d10 ] ... [ d11 ... d18 ]
    position_ids  [  0  1  2  3  4 |  0  1  2 ] [  0  1  2  3  4  5  6  7  ] ... [  0  ...  7  ]
    labels        [  - a1 a2 a3 a4 |  - d1 d2 ] [  - d4 d5 d6 d7 d8 d9 d10 ] ... [  -  ... d18 ]
    segment             0                1                    2                          k
    piece_doc_ids      -1                D                    D                          D
    piece_index         0                0                    1                          2
    has_initial_state   F                F                    T                          T
    continues_after     F                T                    T                          F

``position_ids`` restart at 0 at every piece (and the first label of a piece is -100, as for any
segment): the state, not the positions, carries the document across pieces. The guarantees behind these
keys (pieces in order on one rank, a predecessor never skipped, the same number of batches on every rank)
and what a resume does to them: :mod:`packloader.carry`.

A *padding row* (used to give every rank the same number of batches, see
:mod:`packloader.distributed`) is all padding: ``input_ids`` 0, ``labels`` -100, one segment of length
``L``; it carries no loss tokens.

Boundaries reach Mamba kernels through ``position_ids`` (a scan resets its state where
``position_ids == 0``; see ``docs/architecture.md``), so a padding tail never leaks state into the next
row's first sequence and vice versa.

:func:`collate_numpy` does all per-token work in one Numba pass (no per-token Python), and
:func:`collate_packed` wraps its arrays as torch tensors without copying.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from packloader._numba import njit_cached

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "BATCH_KEYS", "CARRY_BATCH_KEYS", "collate_numpy", "collate_packed", "collate_raw", "raw_alloc",
           "raw_views", "padding_row_layout"]

#: key -> (shape, dtype) as documented above (``None`` dtype: a python int)
BATCH_KEYS: dict[str, tuple[str, str | None]] = {
    "input_ids": ("[B, L]", "int64"),
    "labels": ("[B, L]", "int64"),
    "position_ids": ("[B, L]", "int64"),
    "seq_idx": ("[B, L]", "int32"),
    "cu_seqlens": ("[S + 1]", "int32"),
    "max_seqlen": ("int", None),
    "num_loss_tokens": ("int", None),
}

#: the keys ``overflow="carry"`` adds to every batch (documented above; one entry per ``cu_seqlens`` segment)
CARRY_BATCH_KEYS: dict[str, tuple[str, str]] = {
    "piece_doc_ids": ("[S]", "int64"),
    "piece_index": ("[S]", "int32"),
    "has_initial_state": ("[S]", "bool"),
    "continues_after": ("[S]", "bool"),
}


@njit_cached(nogil=True)
def _collate_kernel(input_ids, labels, has_labels, offsets, seq_lens,
                    out_ids, out_labels, out_pos, out_seq, out_cu):
    """One pass over the batch. Returns (n_segments, max_seqlen, num_loss_tokens, bad_row) where
    bad_row >= 0 names a row whose sequence lengths do not fit (or are not positive)."""
    B, L = input_ids.shape
    n_seg = 0
    max_len = 0
    n_loss = 0
    base = 0
    out_cu[0] = 0
    for b in range(B):
        t = 0
        s = 0
        for k in range(offsets[b], offsets[b + 1]):
            n = seq_lens[k]
            if n <= 0 or t + n > L:
                return n_seg, max_len, n_loss, b
            for j in range(n):
                x = input_ids[b, t + j]
                out_ids[b, t + j] = x
                out_pos[b, t + j] = j
                out_seq[b, t + j] = s
                if j == 0:
                    lab = IGNORE_INDEX
                elif has_labels:
                    lab = labels[b, t + j]
                else:
                    lab = x
                out_labels[b, t + j] = lab
                if lab != IGNORE_INDEX:
                    n_loss += 1
            t += n
            s += 1
            n_seg += 1
            out_cu[n_seg] = base + t
            if n > max_len:
                max_len = n
        if t < L:
            for j in range(L - t):
                out_ids[b, t + j] = input_ids[b, t + j]
                out_pos[b, t + j] = j
                out_seq[b, t + j] = s
                out_labels[b, t + j] = IGNORE_INDEX
            n_seg += 1
            out_cu[n_seg] = base + L
            if L - t > max_len:
                max_len = L - t
        base += L
    return n_seg, max_len, n_loss, -1


def _check_inputs(input_ids, labels, seq_lens_offsets, seq_lens):
    input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be 2-D [B, L], got shape {input_ids.shape}")
    B, L = input_ids.shape
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {labels.shape} != input_ids shape {input_ids.shape}")
    offsets = np.asarray(seq_lens_offsets, dtype=np.int64)
    if offsets.shape != (B + 1,):
        raise ValueError(f"seq_lens_offsets must have B+1 = {B + 1} entries, got {offsets.shape}")
    seq_lens = np.asarray(seq_lens)
    if offsets[0] < 0 or offsets[-1] > len(seq_lens) or np.any(np.diff(offsets) < 0):
        raise ValueError("seq_lens_offsets must be non-decreasing and within seq_lens")
    return input_ids, labels, offsets, seq_lens


def _collate_into(input_ids, labels, offsets, seq_lens, out: dict) -> dict:
    """Run the kernel into the preallocated arrays of ``out`` (numpy views); fills in the python ints
    and trims ``cu_seqlens``. Returns ``out``'s numpy results as a new dict."""
    has_labels = labels is not None
    n_seg, max_len, n_loss, bad = _collate_kernel(input_ids, labels if has_labels else input_ids, has_labels,
                                                  offsets, seq_lens, out["input_ids"], out["labels"],
                                                  out["position_ids"], out["seq_idx"], out["cu_seqlens"])
    if bad >= 0:
        lens = seq_lens[offsets[bad]:offsets[bad + 1]]
        raise ValueError(f"row {bad}: sequence lengths {lens.tolist()} are not all positive or sum to "
                         f"{int(lens.sum())} > capacity {input_ids.shape[1]}")
    return {"n_seg": int(n_seg), "max_seqlen": int(max_len), "num_loss_tokens": int(n_loss)}


_OUT_DTYPES = (("input_ids", np.int64), ("labels", np.int64), ("position_ids", np.int64), ("seq_idx", np.int32))


def collate_numpy(input_ids: np.ndarray, labels: np.ndarray | None, seq_lens_offsets: np.ndarray,
                  seq_lens: np.ndarray) -> dict[str, Any]:
    """Build the packed batch (numpy arrays) from packed rows.

    Args:
        input_ids: [B, L] integer token ids of the packed rows (int32 or int64; any values in the
            padding tail are copied as they are).
        labels: [B, L] integer labels or ``None`` (then labels are the input ids). Positions holding
            -100 stay -100; the first token of every segment and the padding tail become -100.
        seq_lens_offsets: int64 [B + 1]: row ``b``'s sequences are ``seq_lens[offsets[b]:offsets[b+1]]``.
        seq_lens: [m] positive lengths of the sequences of each row, in order from position 0; each
            row's lengths sum to at most L (the rest is padding).

    Returns:
        a dict with the keys documented in this module's docstring (numpy arrays, python ints).

    Raises:
        ValueError: shapes disagree, or a row's lengths are not positive or overflow ``L`` (names the row).
    """
    input_ids, labels, offsets, seq_lens = _check_inputs(input_ids, labels, seq_lens_offsets, seq_lens)
    B, L = input_ids.shape
    out = {k: np.empty((B, L), dtype=dt) for k, dt in _OUT_DTYPES}
    out["cu_seqlens"] = np.empty(int(offsets[-1] - offsets[0]) + B + 1, dtype=np.int32)
    info = _collate_into(input_ids, labels, offsets, seq_lens, out)
    out["cu_seqlens"] = out["cu_seqlens"][: info["n_seg"] + 1]
    out["max_seqlen"], out["num_loss_tokens"] = info["max_seqlen"], info["num_loss_tokens"]
    return out


_TORCH_DTYPES = {np.int64: "int64", np.int32: "int32"}


def collate_packed(input_ids, labels, seq_lens_offsets, seq_lens, *, hf_compat: bool = False,
                   return_tensors: str = "pt", pin_memory: bool = False) -> dict[str, Any]:
    """Build the packed training batch (see the key table in this module's docstring).

    Example::

        >>> import numpy as np
        >>> from packloader import collate_packed
        >>> ids = np.array([[5, 6, 7, 8, 9, 0]], dtype=np.int32)      # sequences of 3 and 2, 1 pad
        >>> b = collate_packed(ids, None, np.array([0, 2]), np.array([3, 2]))
        >>> b["position_ids"].tolist(), b["labels"].tolist(), b["cu_seqlens"].tolist()
        ([[0, 1, 2, 0, 1, 0]], [[-100, 6, 7, -100, 9, -100]], [0, 3, 5, 6])

    Args:
        input_ids, labels, seq_lens_offsets, seq_lens: as in :func:`collate_numpy`.
        hf_compat: also add ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k``
            (the names of Hugging Face's padding-free path; same values as ``cu_seqlens``/``max_seqlen``).
        return_tensors: ``"pt"`` (torch tensors sharing memory with the numpy arrays) or ``"np"``.
        pin_memory: (``"pt"`` only) write the batch straight into page-locked tensors (needs an
            accelerator), ready for ``.to(device, non_blocking=True)``; no extra copy.
    """
    if return_tensors not in ("pt", "np"):
        raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
    if return_tensors == "np" or not pin_memory:
        out = collate_numpy(input_ids, labels, seq_lens_offsets, seq_lens)
        if return_tensors == "pt":
            import torch

            for k, v in list(out.items()):
                if isinstance(v, np.ndarray):
                    out[k] = torch.from_numpy(v)
    else:
        import torch

        input_ids, labels, offsets, seq_lens = _check_inputs(input_ids, labels, seq_lens_offsets, seq_lens)
        B, L = input_ids.shape
        tens = {k: torch.empty((B, L), dtype=getattr(torch, _TORCH_DTYPES[dt]), pin_memory=True)
                for k, dt in _OUT_DTYPES}
        tens["cu_seqlens"] = torch.empty(int(offsets[-1] - offsets[0]) + B + 1, dtype=torch.int32,
                                         pin_memory=True)
        info = _collate_into(input_ids, labels, offsets, seq_lens, {k: v.numpy() for k, v in tens.items()})
        out = dict(tens)
        out["cu_seqlens"] = tens["cu_seqlens"][: info["n_seg"] + 1]
        out["max_seqlen"], out["num_loss_tokens"] = info["max_seqlen"], info["num_loss_tokens"]
    if hf_compat:
        out["cu_seq_lens_q"] = out["cu_seqlens"]
        out["cu_seq_lens_k"] = out["cu_seqlens"]
        out["max_length_q"] = out["max_seqlen"]
        out["max_length_k"] = out["max_seqlen"]
    return out


# ---- the raw form of a batch: one int32 buffer -------------------------------------------------------
#
# What a DataLoader worker sends to the main process: the packed rows before collation, in ONE int32
# array (``[B, L, m, has_labels] | seq_lens_offsets [B+1] | seq_lens [m] | input_ids [B*L] |
# labels [B*L] if has_labels``). torch moves each tensor between processes through its own shared-memory
# segment and file descriptor, and that per-tensor cost, not the bytes, dominates: the collated batch
# (4 [B, L] tensors + cu_seqlens, 28 bytes a token) costs about 4x as much to move as this buffer (4-8
# bytes a token). The main process collates it (one Numba pass, tens of microseconds per batch).

RAW_HEADER = 4


def raw_alloc(batch_rows: int, capacity: int, n_pieces: int, has_labels: bool):
    """A zeroed raw buffer and its views ``(buf, input_ids [B, L], labels [B, L] or None,
    seq_lens_offsets int32 [B + 1], seq_lens int32 [m])`` to fill in."""
    B, L, m = int(batch_rows), int(capacity), int(n_pieces)
    n = RAW_HEADER + B + 1 + m + B * L * (2 if has_labels else 1)
    buf = np.zeros(n, dtype=np.int32)
    buf[:RAW_HEADER] = (B, L, m, int(bool(has_labels)))
    return (buf,) + raw_views(buf)


def raw_views(buf: np.ndarray):
    """``(input_ids [B, L], labels [B, L] or None, seq_lens_offsets int32 [B + 1], seq_lens int32 [m])``
    views of a raw buffer made by :func:`raw_alloc`."""
    B, L, m, has_labels = (int(x) for x in buf[:RAW_HEADER])
    p = RAW_HEADER
    offsets = buf[p:p + B + 1]
    p += B + 1
    lens = buf[p:p + m]
    p += m
    ids = buf[p:p + B * L].reshape(B, L)
    p += B * L
    labels = buf[p:p + B * L].reshape(B, L) if has_labels else None
    return ids, labels, offsets, lens


def collate_raw(buf, *, hf_compat: bool = False, pin_memory: bool = False) -> dict[str, Any]:
    """:func:`collate_packed` of a raw buffer (numpy array or torch tensor)."""
    buf = buf.numpy() if hasattr(buf, "numpy") else np.asarray(buf)
    ids, labels, offsets, lens = raw_views(buf)
    return collate_packed(ids, labels, offsets, lens, hf_compat=hf_compat, pin_memory=pin_memory)


def padding_row_layout(n_rows: int, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids, labels, seq_lens_offsets, seq_lens)`` of ``n_rows`` all-padding rows."""
    ids = np.zeros((n_rows, capacity), dtype=np.int32)
    labels = np.full((n_rows, capacity), IGNORE_INDEX, dtype=np.int32)
    return ids, labels, np.zeros(n_rows + 1, dtype=np.int64), np.zeros(0, dtype=np.int32)
