"""Carried states: where a packed sequence starts from a state and where it hands its state on.

A piece of a long document continues the piece before it: its scan starts from the state the previous piece ended
with, and its conv reads the ``width - 1`` inputs that ended the previous piece. The functional ops take those states
the way flash-linear-attention's kernels do: one state per sequence, indexed by the sequence's number in
``cu_seqlens`` order (row-major over the batch, every segment of every row, padding tails included), plus a flag per
sequence saying whether it starts from its state (vLLM's ``has_initial_state``)::

    row 0          [ a0 a1 a2 a3 | b0 b1 b2 b3 ]        sequence 0: a (continues a piece of an earlier row or step)
    row 1          [ c0 c1 | d0 d1 d2 d3 d4 d5 ]        sequence 1: b;  2: c;  3: d
    position_ids   [ 0 1 2 3 | 0 1 2 3 ] [ 0 1 | 0 1 2 3 4 5 ]
    has_initial_state = [True, False, False, False]
    initial_state[0]  = the state a's previous piece ended with; rows 1..3 are not read
    final_state[i]    = the state after sequence i's last token (output_final_state=True), for every i

The kernels see this as :func:`state_slots`: two int32 planes over the tokens, the slot of the initial state read at
a sequence's first token and the slot of the final state written at its last token (-1 elsewhere; contract:
:mod:`ops.contract`). A model that carries only a few sequences' states numbers just those (its slots), so a step
with one continued document holds one state per layer, not one per sequence. Where states sit only at row edges
(a row's first token continues, its last hands on: context parallelism's chunks), the slots can be given per row
instead, ``(2, batch)``, and the kernels read them once a row (:func:`token_slots` spreads them over the tokens).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["sequence_numbers", "sequence_spans", "state_slots", "row_edge_slots", "token_slots", "check_state"]


_PAGEABLE_COPY_BYTES = 64 * 1024   # host_to_device: larger copies go through pinned memory


def host_to_device(data, device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``data`` (a list, numpy array or CPU tensor) as a tensor on ``device`` without waiting for the GPU:
    ``.to(device)`` or ``torch.tensor(..., device=)`` copy and then wait for every kernel queued before the copy. To a
    CUDA device the copy is asynchronous: up to 64 KiB straight from pageable memory (the driver stages it at once),
    larger through pinned memory. ``data`` may change afterwards."""
    t = torch.as_tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if t.numel() * t.element_size() > _PAGEABLE_COPY_BYTES:
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def sequence_numbers(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen) int64: the number of each token's sequence in ``cu_seqlens`` order (0, 1, ...). No host
    sync."""
    starts = (position_ids == 0).reshape(-1)
    return (starts.cumsum(0) - 1).view(position_ids.shape)


def sequence_spans(position_ids: torch.Tensor, num_sequences: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(start, length), each (num_sequences,) int64: sequence ``i`` is the tokens ``start[i] .. start[i] + length[i]
    - 1`` of the flattened (batch * seqlen) row-major tokens. ``num_sequences`` must be the number of sequence
    starts (``(position_ids == 0).sum()``); no host sync."""
    count = (position_ids == 0).reshape(-1).cumsum(0)   # starts up to and including each token
    wanted = torch.arange(1, num_sequences + 1, device=position_ids.device, dtype=count.dtype)
    start = torch.searchsorted(count, wanted)           # the token where the count reaches i + 1: the start of i
    end = torch.cat([start[1:], start.new_full((1,), count.numel())])
    return start, end - start


def state_slots(position_ids: torch.Tensor, has_initial_state: Optional[torch.Tensor],
                final_state: bool) -> torch.Tensor:
    """The kernels' ``state_slots`` (2, batch, seqlen) int32 for states indexed by sequence number: plane 0 holds,
    at the first token of every sequence ``i`` with ``has_initial_state[i]``, the slot ``i`` (else -1); plane 1,
    with ``final_state``, the slot ``i`` at the last token of every sequence ``i`` (else -1). No host sync."""
    batch, seqlen = position_ids.shape
    seq = sequence_numbers(position_ids)
    starts = position_ids == 0
    none = torch.full_like(seq, -1)
    if has_initial_state is None:
        init = none
    else:
        flag = has_initial_state.to(device=seq.device, dtype=torch.bool)
        init = torch.where(starts & flag[seq.clamp(0, max(flag.numel() - 1, 0))], seq, none)
    if final_state:
        ends = torch.ones_like(starts)
        ends[:, :-1] = starts[:, 1:]
        fin = torch.where(ends, seq, none)
    else:
        fin = none
    return torch.stack([init, fin]).to(torch.int32).contiguous()


def row_edge_slots(batch: int, has_initial_state: Optional[torch.Tensor], final_state: bool,
                   device) -> torch.Tensor:
    """:func:`state_slots` for rows that are one sequence each (sequence ``i`` is row ``i``), as row-edge slots
    ``(2, batch)`` int32: row ``i``'s initial-state slot ``i`` where ``has_initial_state[i]``, its final-state slot
    ``i`` with ``final_state`` (-1 elsewhere). The scan then runs its plain loops with the states outside them."""
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    none = torch.full_like(rows, -1)
    init = none if has_initial_state is None else torch.where(
        has_initial_state.to(device=device, dtype=torch.bool), rows, none)
    return torch.stack([init, rows if final_state else none]).contiguous()


def token_slots(slots: torch.Tensor, seqlen: int) -> torch.Tensor:
    """``state_slots`` (2, batch, seqlen) as given, or row-edge slots (2, batch) (states at row edges only:
    context parallelism's chunks) spread over the tokens: plane 0's slot of row ``b`` at its first token, plane 1's
    at its last, -1 elsewhere (the layout the reference scan reads)."""
    if slots.dim() == 3:
        return slots
    tok = torch.full((2, slots.shape[1], seqlen), -1, dtype=slots.dtype, device=slots.device)
    if seqlen:
        tok[0, :, 0] = slots[0]
        tok[1, :, seqlen - 1] = slots[1]
    return tok


def check_state(name: str, state: torch.Tensor, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """A clear error for a state of the wrong type, shape, dtype or device (naming the argument)."""
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(state).__name__}")
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"{name} must be {tuple(shape)} (sequences, ...), got {tuple(state.shape)}")
    if state.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {state.dtype}")
    if state.device != device:
        raise ValueError(f"{name} is on {state.device}, the inputs on {device}")
