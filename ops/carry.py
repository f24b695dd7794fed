"""Carrying the Mamba state across the pieces of a long document, in a model: the state cache a training loop owns
(truncated backpropagation across steps) and the plan of one step.

With ``overflow="carry"`` (:mod:`packloader.carry`) a document longer than a row comes in pieces, in order, on one
rank; every batch says, per segment in ``cu_seqlens`` order, which document a piece belongs to
(``piece_doc_ids``), its index (``piece_index``), whether it continues the piece before (``has_initial_state``) and
whether another piece follows (``continues_after``)::

    step k    row 0 [ a a a | D0 D0 ]   row 1 [ D1 D1 D1 D1 D1 ]      D1 continues D0 in the same step: its initial
                                                                      state is D0's final state, with its gradient
    step k+1  row 0 [ D2 D2 D2 D2 D2 ]  row 1 [ b b | c c c ]         D2 continues D1 from the cache: D1's final
                                                                      state of step k, detached (truncated BPTT)

Usage (a mamba-ssm model converted by :func:`ops.enable_packing`, or :class:`ops.PackedMamba` layers with distinct
``layer_idx``)::

    cache = ops.StateCache()
    for batch in loader:                                     # PackedDataLoader(..., overflow="carry")
        carry = cache.step(batch)                            # this step's plan; keeps the last step's states
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], carry=carry).logits
        ...backward, optimizer step...
        torch.save({"model": ..., "loader": loader.state_dict(), "states": cache.state_dict()}, path)

A piece whose predecessor is in the same step starts from that predecessor's final state, computed in the same
forward and differentiated through: the scan is linear in its initial state (a piece's final state is
``P h0 + h_end(0)``, ``P`` the product of its decays). The composed mixer (:func:`carried_mamba_inner_ref`) scans once
with the states it already has, chains the final states of the step's pieces in order, and scans again with the true
initial states. The fused one (:class:`CarriedMambaInnerFn`) gets each predecessor's ``h_end(0)`` and ``P`` from a
reduction over its tokens (``ops.time_split.segment_sums``, no scan), so it scans once; its backward reduces each
continuation's start adjoint the same way, chains the gradients entering the predecessors' ends back, and runs the
scan's backward once. The conv's state is the ``width - 1`` inputs that end the predecessor. A piece whose
predecessor ended in an earlier step starts from the cached state (no gradient crosses the step). Only the mixers
of a batch that has continuations take this path; every other batch runs exactly as without carry.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from . import kernel_calls
from .states import host_to_device, sequence_spans

__all__ = ["StateCache", "CarryStep", "FixedLayoutStep", "CarryError", "CARRY_KEYS"]

#: the batch keys the plan reads (packloader.batch.CARRY_BATCH_KEYS), one entry per segment in cu_seqlens order
CARRY_KEYS = ("piece_doc_ids", "piece_index", "has_initial_state", "continues_after")


class CarryError(ValueError):
    """A continuation the model cannot honour: its predecessor's state was never computed, or states of the wrong
    shape."""


class StateCache:
    """The final states of pieces whose document continues in a later step, keyed by document id, per layer:
    ``{doc_id: {layer: (conv_state (d_inner, d_conv - 1), ssm_state (d_inner, d_state) float32)}}``, detached.

    Owned by the training loop, one per rank (the loader keeps a document's pieces on one rank); saved and restored
    with :meth:`state_dict` / :meth:`load_state_dict` beside the loader's state, so a resumed run continues every
    chain exactly. An entry is dropped when its continuation has been run (and replaced by the continuation's final
    state when the document goes on).
    """

    def __init__(self):
        self._states: Dict[int, Dict[int, tuple]] = {}
        self._pending: Optional["CarryStep"] = None

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, doc_id) -> bool:
        return int(doc_id) in self._states

    def get(self, doc_id: int, layer: int):
        """(conv_state, ssm_state) of ``doc_id`` at ``layer``, or None."""
        return self._states.get(int(doc_id), {}).get(layer)

    def step(self, batch) -> "CarryStep":
        """Plan the step of ``batch`` (a dict with the carry keys and ``position_ids``) against the cache; first
        keeps the states the previous step left (:meth:`commit`)."""
        self.commit()
        step = CarryStep(batch, self)
        self._pending = step
        return step

    @property
    def pending_step(self) -> Optional["CarryStep"]:
        """The step planned last, until :meth:`commit` keeps its states (its batched final states:
        :meth:`CarryStep.final_states`)."""
        return self._pending

    def commit(self) -> None:
        """Keep the final states of the last planned step's continuing pieces, drop the states it consumed. Called by
        :meth:`step` and :meth:`state_dict`; a step whose forward never ran (or failed) leaves the cache as it was."""
        step, self._pending = self._pending, None
        if step is None or not step._ran:
            return
        for doc in step.consumed_docs:
            self._states.pop(doc, None)
        for doc, layers in step.finals().items():
            self._states[doc] = layers

    def state_dict(self) -> dict:
        self.commit()
        return {"states": {doc: {layer: tuple(t.detach().cpu() for t in pair) for layer, pair in layers.items()}
                           for doc, layers in self._states.items()}}

    def load_state_dict(self, state: dict, device=None) -> None:
        if not isinstance(state, dict) or "states" not in state:
            raise ValueError("StateCache.load_state_dict: not a StateCache state (no 'states')")
        self._pending = None
        self._states = {int(doc): {int(layer): tuple(t.to(device) if device is not None else t for t in pair)
                                   for layer, pair in layers.items()} for doc, layers in state["states"].items()}


class CarryStep:
    """One step's carry plan, made once per batch (:meth:`StateCache.step`) and handed to every mixer (``carry=``).

    Args:
        batch: a dict with ``position_ids`` (batch, seqlen) and the carry keys (one entry per segment in
            ``cu_seqlens`` order: ``piece_doc_ids`` int64, ``piece_index``, ``has_initial_state`` bool,
            ``continues_after`` bool), as :class:`packloader.PackedDataLoader` makes them with ``overflow="carry"``.
        cache: the :class:`StateCache` the states of earlier steps come from and this step's go to.

    Raises:
        CarryError: a continued piece whose predecessor is neither earlier in this batch nor in the cache; keys of
            the wrong length.
    """

    def __init__(self, batch, cache: StateCache):
        pos = batch["position_ids"]
        keys = {k: np.asarray(torch.as_tensor(batch[k]).cpu()) for k in CARRY_KEYS}
        num = len(keys["piece_doc_ids"])
        starts = int((torch.as_tensor(pos) == 0).sum())
        for k, v in keys.items():
            if len(v) != starts:
                raise CarryError(f"batch[{k!r}] has {len(v)} entries but the rows hold {starts} segments "
                                 "(one entry per segment in cu_seqlens order)")
        doc, piece = keys["piece_doc_ids"].astype(np.int64), keys["piece_index"].astype(np.int64)
        has, cont = keys["has_initial_state"].astype(bool), keys["continues_after"].astype(bool)
        carried = np.flatnonzero(has | cont)               # the segments with a state in or out: slots 0..K-1
        slot_of = {int(i): k for k, i in enumerate(carried)}
        where = {(int(doc[i]), int(piece[i])): int(i) for i in carried}
        self.cache = cache
        self.num_slots = len(carried)
        self.doc_ids = doc[carried]
        self.source: List[str] = []          # per slot: "none", "cache" or "batch"
        self.pred = np.full(len(carried), -1, dtype=np.int64)   # the slot of an in-batch predecessor
        consumed = set()
        for k, i in enumerate(carried):
            if not has[i]:
                self.source.append("none")
                continue
            j = where.get((int(doc[i]), int(piece[i]) - 1))
            if j is not None and j < i:
                self.source.append("batch")
                self.pred[k] = slot_of[j]
            elif int(doc[i]) in cache:
                self.source.append("cache")
                consumed.add(int(doc[i]))
            else:
                raise CarryError(
                    f"segment {i} continues document {int(doc[i])} (piece {int(piece[i])}), but its predecessor is "
                    "neither earlier in this batch nor in the state cache: resumed without the cache saved with the "
                    "loader, or a batch from another rank")
        # depth in the step's chains: 0 for slots whose initial state is known before the forward
        self.depth = np.zeros(len(carried), dtype=np.int64)
        for k in range(len(carried)):
            if self.pred[k] >= 0:
                self.depth[k] = self.depth[self.pred[k]] + 1
        # a final state goes to the cache where the document continues after this step
        succ_in_batch = set(int(p) for p in self.pred if p >= 0)
        self.store = np.array([bool(cont[i]) and k not in succ_in_batch for k, i in enumerate(carried)], dtype=bool)
        self._stored = np.flatnonzero(self.store)
        self.num_states_in = sum(s != "none" for s in self.source)   # the slots with a state in
        self.consumed_docs = consumed
        # for the composed mixer (carried_mamba_inner_ref): where the in-batch predecessors are (its first scan runs
        # only on their rows), and the pieces both continued in this batch and continuing one here ("middle" pieces:
        # their decay P is summed over their tokens)
        flat_pos = torch.as_tensor(pos).reshape(-1).cpu().numpy()
        seg_start = np.flatnonzero(flat_pos == 0)
        seqlen = torch.as_tensor(pos).shape[1]
        seg_end = np.append(seg_start[1:], flat_pos.size)
        preds = sorted(set(int(p) for p in self.pred if p >= 0))
        self.pass_a_rows = sorted(set(int(seg_start[carried[k]] // seqlen) for k in preds))
        self.middle = [(k, int(seg_start[carried[k]] // seqlen), int(seg_start[carried[k]] % seqlen),
                        int(seg_end[carried[k]] - seg_start[carried[k]]))
                       for k in preds if self.source[k] == "batch"]
        # the fused mixer's chains: each from a slot whose state is known before the forward (cached, or zero) through
        # its in-batch continuations; the reductions run over the predecessors ("chain_pred", chain by chain, in
        # order) forward and over their continuations ("chain_succ", the same order) backward
        seg_len = seg_end - seg_start
        succ_of = {int(p): k for k, p in enumerate(self.pred) if p >= 0}
        self.chain_pred, self.chain_offsets = [], [0]
        for head in (k for k in range(len(carried)) if self.pred[k] < 0 and k in succ_of):
            cur = head
            while cur in succ_of:
                self.chain_pred.append(cur)
                cur = succ_of[cur]
            self.chain_offsets.append(len(self.chain_pred))
        self.chain_heads = [self.chain_pred[o] for o in self.chain_offsets[:-1]]
        self.chain_succ = [succ_of[p] for p in self.chain_pred]
        self._slot_start = seg_start[carried] if len(carried) else np.zeros(0, dtype=np.int64)
        self._slot_length = seg_len[carried] if len(carried) else np.zeros(0, dtype=np.int64)
        self.pred_max = int(max((seg_len[carried[k]] for k in self.chain_pred), default=0))
        self.succ_max = int(max((seg_len[carried[k]] for k in self.chain_succ), default=0))
        self.has_continuations = any(s != "none" for s in self.source) or bool(self.store.any())
        self._row_edges = self._row_edge_plan(seg_start[carried], seg_end[carried], len(flat_pos) // max(seqlen, 1),
                                              seqlen)
        self._pos = torch.as_tensor(pos)
        self._carried = torch.as_tensor(carried, dtype=torch.int64)
        self._num_sequences = num
        self._device_cache: Dict[torch.device, dict] = {}
        self._final_layers: Dict[int, tuple] = {}   # layer -> (conv (S, d, w-1), ssm (S, d, n)), the stored slots
        self._ran = False   # a mixer read its states: the step's forward ran

    def _row_edge_plan(self, start: np.ndarray, end: np.ndarray, batch: int, seqlen: int):
        """The fused mixer's scan slots at row edges (``ops.contract``: the scan's plain loops, without the per-token
        states variant's cost) where the step allows them: every slot with a state in starts a row (as a continuation
        piece does: it fills its row). Then ``(init (batch,), final (batch,), mid, backward)``: the slot starting /
        ending each row (-1: none); ``mid``, the stored slots that end inside a row, whose final state the forward
        completes from reductions over their tokens; ``backward``, whether the backward takes the row edges too (every
        slot a gradient enters the end of, an in-batch predecessor, ends a row). None where a state in starts inside a
        row: the per-token slots then."""
        has = np.array([src != "none" for src in self.source], dtype=bool)
        if seqlen == 0 or (start[has] % seqlen).any():
            return None
        init = np.full(batch, -1, dtype=np.int32)
        init[start[has] // seqlen] = np.flatnonzero(has)
        at_end = end % seqlen == 0
        final = np.full(batch, -1, dtype=np.int32)
        final[end[at_end] // seqlen - 1] = np.flatnonzero(at_end)
        mid = np.array([k for k in self._stored if not at_end[k]], dtype=np.int64)
        backward = bool(all(at_end[k] for k in self.chain_pred))
        return init, final, (mid, start[mid], end[mid] - start[mid]), backward

    def geometry(self, device: torch.device) -> dict:
        """Device tensors of the plan (made once per device): the slots' token spans, the kernels' state_slots (per
        token; ``fwd_slots`` / ``bwd_slots``: what the fused mixer's scan takes, row edges where the plan allows them,
        with ``mid``: the stored slots ending inside a row, or None), the slots with a state in (``has`` as a mask,
        ``has_idx`` as indices)."""
        got = self._device_cache.get(device)
        if got is None:
            pos = host_to_device(self._pos, device)
            start, length = sequence_spans(pos, self._num_sequences)
            idx = host_to_device(self._carried, device)
            start, length = start[idx], length[idx]
            batch, seqlen = pos.shape
            slots = torch.full((2, batch * seqlen), -1, dtype=torch.int32, device=device)
            k = torch.arange(self.num_slots, dtype=torch.int32, device=device)
            has = host_to_device([s != "none" for s in self.source], device, torch.bool)
            has_idx = host_to_device([i for i, s in enumerate(self.source) if s != "none"], device, torch.int64)
            slots[0, start[has_idx]] = k[has_idx]    # indices made on the host: a mask as an index waits for the GPU
            slots[1, start + length - 1] = k
            got = {"start": start, "length": length, "has": has, "has_idx": has_idx,
                   "slots": slots.view(2, batch, seqlen), "pos": pos,
                   "depth_at": [host_to_device(self.depth == d, device)
                                for d in range(1, int(self.depth.max(initial=0)) + 1)],
                   "pred": host_to_device(np.maximum(self.pred, 0), device)}
            chain = {name: host_to_device(getattr(self, name), device, torch.int64)
                     for name in ("chain_pred", "chain_succ", "chain_offsets", "chain_heads")}
            for name in ("chain_pred", "chain_succ"):
                chain[name + "_start"], chain[name + "_length"] = start[chain[name]], length[chain[name]]
            got.update(chain)
            got["fwd_slots"] = got["bwd_slots"] = got["slots"]
            got["mid"] = None
            if self._row_edges is not None:
                init, final, (mid, mid_start, mid_length), backward = self._row_edges
                rows = host_to_device(np.stack([init, final]), device, torch.int32)
                got["fwd_slots"] = rows
                if backward:
                    got["bwd_slots"] = rows
                if len(mid):
                    got["mid"] = {"slot": host_to_device(mid, device, torch.int64),
                                  "start": host_to_device(mid_start, device, torch.int64),
                                  "length": host_to_device(mid_length, device, torch.int64),
                                  "max_length": int(mid_length.max())}
            self._device_cache[device] = got
        return got

    def initial(self, layer: int, conv_shape, ssm_shape, dtype, device):
        """(conv_state (K, d, w-1) in ``dtype``, ssm_state (K, d, n) float32, float64 for a float64 model): the cached
        states of this layer, zeros for the slots without one (and for the in-batch continuations, filled in by the
        mixer)."""
        self._ran = True
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        conv_shape, ssm_shape = tuple(conv_shape), tuple(ssm_shape)
        if "cache" not in self.source:      # nothing cached (a prefill, a first piece): zeros, no per-slot work
            return (torch.zeros((self.num_slots,) + conv_shape, dtype=dtype, device=device),
                    torch.zeros((self.num_slots,) + ssm_shape, dtype=sdt, device=device))
        zc, zs = None, None
        convs, ssms = [], []
        for k, src in enumerate(self.source):   # one stack per state: the cached ones, zeros for the others
            if src == "cache":
                got = self.cache.get(int(self.doc_ids[k]), layer)
                if got is None:
                    raise CarryError(f"the state cache holds document {int(self.doc_ids[k])} but not layer {layer}: "
                                     "was it filled by another model?")
                c, s = got
                if tuple(c.shape) != conv_shape or tuple(s.shape) != ssm_shape:
                    raise CarryError(f"cached state of document {int(self.doc_ids[k])}, layer {layer}: shapes "
                                     f"{tuple(c.shape)} / {tuple(s.shape)}, the layer takes {conv_shape} / "
                                     f"{ssm_shape}")
                convs.append(c.to(device=device, dtype=dtype))
                ssms.append(s.to(device=device, dtype=sdt))
            else:
                if zc is None:
                    zc = torch.zeros(conv_shape, dtype=dtype, device=device)
                    zs = torch.zeros(ssm_shape, dtype=sdt, device=device)
                convs.append(zc)
                ssms.append(zs)
        return torch.stack(convs), torch.stack(ssms)

    def cached_states_in(self, layer: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype, device: torch.device):
        """[(conv (d, w-1), ssm (d, d_state))] of ``layer``, one pair per slot with a state in (slot order): the
        cache's own tensors (no copy), where every such slot continues from the cache with states of these dtypes on
        ``device``; else None. What the fused mixer keeps for its backward in their place: one piece of a document
        a step then holds each state once, the cache's, until its backward."""
        idx = [k for k, src in enumerate(self.source) if src != "none"]
        if not idx or any(self.source[k] != "cache" for k in idx):
            return None
        pairs = [self.cache.get(int(self.doc_ids[k]), layer) for k in idx]
        for p in pairs:
            if (p is None or p[0].dtype != conv_dtype or p[1].dtype != ssm_dtype or p[0].device != device
                    or p[1].device != device):
                return None
        return pairs

    def keep(self, layer: int, conv_final: torch.Tensor, ssm_final: torch.Tensor) -> None:
        """Keeps this layer's final states (K, ...) of the slots that store (:attr:`store`: their document continues
        after this step), detached and batched: one ``index_select`` (none where every slot stores, empty where none
        does); no other slot's is needed after the step. The cache takes them at the next :meth:`StateCache.step`; a
        generation's prefill, whose prompts all continue after, keeps every slot's."""
        if len(self._stored) < self.num_slots:
            dev = ssm_final.device
            idx = _cached(self.geometry(dev), "stored", lambda: host_to_device(self._stored, dev, torch.int64))
            conv_final, ssm_final = conv_final.index_select(0, idx), ssm_final.index_select(0, idx)
        self._final_layers[layer] = (conv_final.detach(), ssm_final.detach())

    def final_states(self, layer: int):
        """(conv (S, d_inner, w-1), ssm (S, d_inner, d_state)): ``layer``'s final states of the S slots that store
        (:meth:`keep`; in slot order, the segments ``slot_segments[store]``), as the forward left them. Every slot
        (S = K) where every piece continues after, as in a generation's prefill and a :class:`FixedLayoutStep`."""
        return self._final_layers[layer]

    @property
    def kept_layers(self):
        """The layers whose final states :meth:`keep` stored in this step."""
        return self._final_layers.keys()

    @property
    def slot_segments(self) -> np.ndarray:
        """The segment (index in ``cu_seqlens`` order) of each slot."""
        return self._carried.numpy()

    def finals(self) -> Dict[int, Dict[int, tuple]]:
        """{doc: {layer: (conv (d, w-1), ssm (d, n))}}: the final states of the pieces whose document continues
        after this step (views of the batched states :meth:`keep` stored: those slots only, no copy here)."""
        out: Dict[int, Dict[int, tuple]] = {}
        stored = self._stored.tolist()
        for layer, (convs, ssms) in self._final_layers.items():
            for j, k in enumerate(stored):
                out.setdefault(int(self.doc_ids[k]), {})[layer] = (convs[j], ssms[j])
        return out


class FixedLayoutStep(CarryStep):
    """A plan for a CUDA graph's replays (``ops.generate_packed(..., cuda_graph=True)``'s prefill): ``K`` pieces
    that start from zero and leave their final states (:meth:`CarryStep.final_states`), at token spans that are not
    known when the graph is captured. ``start`` and ``length`` ((K,) int64 device tensors, flat indices into the
    (rows, seqlen) batch) hold them when the forward runs; fill them before each run, every slot a distinct span.
    The geometry is device work on those buffers, made once per forward (:meth:`reset` before each eager run), so a
    captured forward recomputes it at every replay.

    Args:
        start, length: (K,) int64 device tensors, the slots' token spans.
        shape: (rows, seqlen) of the batches it plans.
    """

    def __init__(self, start: torch.Tensor, length: torch.Tensor, shape):
        rows, seqlen = int(shape[0]), int(shape[1])
        k, n = int(start.numel()), int(shape[0]) * int(shape[1])
        if k > n or tuple(length.shape) != (k,):
            raise ValueError(f"FixedLayoutStep: {k} slots (start {tuple(start.shape)}, length "
                             f"{tuple(length.shape)}) in a batch of {rows} x {seqlen} tokens")
        # the template: every token its own segment, the first K of them carried (slots 0..K-1, stored)
        template = {"position_ids": torch.zeros((rows, seqlen), dtype=torch.int64),
                    "piece_doc_ids": torch.arange(n), "piece_index": torch.zeros(n, dtype=torch.int64),
                    "has_initial_state": torch.zeros(n, dtype=torch.bool),
                    "continues_after": torch.arange(n) < k}
        super().__init__(template, StateCache())
        self._start, self._length, self._shape = start, length, (rows, seqlen)

    def reset(self) -> None:
        """Forget the geometry and the final states of the last forward (before an eager run or a capture)."""
        self._device_cache.clear()
        self._final_layers.clear()

    def geometry(self, device: torch.device) -> dict:
        got = self._device_cache.get(device)
        if got is None:
            k = self.num_slots
            rows, seqlen = self._shape
            slots = torch.full((2, rows * seqlen), -1, dtype=torch.int32, device=device)
            slots[1].index_copy_(0, self._start + self._length - 1, torch.arange(k, dtype=torch.int32, device=device))
            none = torch.zeros(k, dtype=torch.bool, device=device)
            got = {"start": self._start, "length": self._length, "has": none,
                   "has_idx": torch.zeros(0, dtype=torch.int64, device=device),
                   "slots": slots.view(2, rows, seqlen), "depth_at": [],
                   "pred": torch.zeros(k, dtype=torch.int64, device=device)}
            got["fwd_slots"] = got["bwd_slots"] = got["slots"]
            got["mid"] = None
            self._device_cache[device] = got
        return got


def _first_pass_geometry(step: CarryStep, g: dict) -> dict:
    """The composed mixer's first scan (:func:`carried_mamba_inner_ref`), made on its first use in a step: its rows
    (None: all of them), their position_ids and state slots (the in-batch continuations start from zero there), and
    the middle pieces' slots. The fused mixer does not scan twice and never makes it."""
    def make():
        pos, slots = g["pos"], g["slots"]
        cache_only = slots.clone()
        batch_idx = host_to_device([i for i, s in enumerate(step.source) if s == "batch"], pos.device, torch.int64)
        cache_only.view(2, -1)[0].index_fill_(0, g["start"][batch_idx], -1)   # ``x[idx] = -1`` copies and waits
        batch = pos.shape[0]
        rows = None if len(step.pass_a_rows) == batch else host_to_device(step.pass_a_rows, pos.device, torch.int64)
        return {"rows": rows,
                "slots": cache_only if rows is None else cache_only[:, rows].contiguous(),
                "pos": pos.to(torch.int32) if rows is None else pos[rows].to(torch.int32).contiguous(),
                "middle": host_to_device([m[0] for m in step.middle], pos.device, torch.int64)}
    return _cached(g, "first_pass", make)


def _middle_decays(step: CarryStep, g: dict, delta: torch.Tensor, dbias: torch.Tensor, A: torch.Tensor):
    """P (K, d, n): the product of the decays over each middle piece's tokens, ``exp(A sum_t softplus(delta_t +
    dbias))`` (zeros for the other slots: their P is never used), summed slice by slice (only those tokens)."""
    ct = torch.promote_types(delta.dtype, torch.float32)
    P = torch.zeros(step.num_slots, delta.shape[1], A.shape[1], dtype=ct, device=delta.device)
    if not step.middle:
        return P
    slices = [delta[row, :, c0:c0 + n] for _, row, c0, n in step.middle]
    return P.index_put((_first_pass_geometry(step, g)["middle"],), _decays(slices, dbias, A))


def _mixer_dims(mixer):
    """(d_inner, d_state, conv width, dt_rank, conv bias, the dtype rule of A / D / dt bias) of a Mamba-1 mixer:
    :class:`ops.PackedMamba` (mamba-ssm's names) or transformers' ``MambaMixer`` (as their packed paths take them)."""
    from .modules.mamba_simple import _ssm_float
    if hasattr(mixer, "d_inner"):
        return mixer.d_inner, mixer.d_state, mixer.d_conv, mixer.dt_rank, mixer.conv1d.bias, _ssm_float
    bias = mixer.conv1d.bias if getattr(mixer, "use_conv_bias", True) else None
    return (mixer.intermediate_size, mixer.ssm_state_size, mixer.conv_kernel_size, mixer.time_step_rank, bias,
            lambda t: t.float())


def carried_mamba_inner(mixer, hidden_states: torch.Tensor, pos: torch.Tensor, step: CarryStep,
                        fused: Optional[bool] = None) -> torch.Tensor:
    """The Mamba-1 mixer (``mixer``: :class:`ops.PackedMamba` or transformers' ``MambaMixer``) on a batch with
    continuations: :class:`CarriedMambaInnerFn` (``fused``, default: the mixer's ``use_fast_path``, True for
    transformers' mixer), else :func:`carried_mamba_inner_ref`."""
    layer = mixer.layer_idx
    if layer is None:
        raise CarryError("a mixer that carries states needs a layer_idx (the key of its states in the cache)")
    if fused is None:
        fused = getattr(mixer, "use_fast_path", True)
    if not fused:
        return carried_mamba_inner_ref(mixer, hidden_states, pos, step)
    _, _, _, _, conv_bias, ssm_float = _mixer_dims(mixer)
    A = -torch.exp(ssm_float(mixer.A_log))
    return CarriedMambaInnerFn.apply(
        hidden_states, mixer.in_proj.weight, mixer.in_proj.bias, mixer.conv1d.weight, conv_bias, mixer.x_proj.weight,
        mixer.dt_proj.weight, mixer.out_proj.weight, mixer.out_proj.bias, A, ssm_float(mixer.D),
        ssm_float(mixer.dt_proj.bias), pos.to(torch.int32).contiguous(), step, layer)


def carried_mamba_inner_ref(mixer, hidden_states: torch.Tensor, pos: torch.Tensor, step: CarryStep) -> torch.Tensor:
    """The same computation composed from the functional ops with torch autograd (see the module docstring): the
    oracle of :class:`CarriedMambaInnerFn`, and the mixer's path when ``use_fast_path`` is off."""
    from .conv1d_interface import _continue_from_states, _conv_final_states, packed_causal_conv1d
    from .selective_scan_interface import selective_scan_fwd
    layer = mixer.layer_idx
    if layer is None:
        raise CarryError("a mixer that carries states needs a layer_idx (the key of its states in the cache)")
    g = step.geometry(hidden_states.device)
    d_inner, d_state, width, dt_rank, conv_bias, _ssm_float = _mixer_dims(mixer)
    A = -torch.exp(_ssm_float(mixer.A_log))
    xz = F.linear(hidden_states, mixer.in_proj.weight, mixer.in_proj.bias).transpose(1, 2)
    x, z = xz[:, :d_inner], xz[:, d_inner:]
    conv_w = mixer.conv1d.weight[:, 0]
    conv0, ssm0 = step.initial(layer, (d_inner, width - 1), (d_inner, d_state), x.dtype, x.device)
    # conv: an in-batch continuation's state is its predecessor's last inputs, chained in depth order
    conv_init = conv0
    for at in g["depth_at"]:
        fin = _conv_final_states(x, width, g["start"], g["length"], conv_init, g["has"])
        conv_init = torch.where(at[:, None, None], fin[g["pred"]], conv_init)
    xc = packed_causal_conv1d(x, conv_w, conv_bias, "silu", position_ids=pos, validate=False)
    xc = _continue_from_states(xc, x, conv_w, conv_bias, True, g["start"], g["length"], conv_init, g["has"])
    conv_final = _conv_final_states(x, width, g["start"], g["length"], conv_init, g["has"])
    x_dbl = F.linear(xc.transpose(1, 2), mixer.x_proj.weight)
    dt_low, Bm, Cm = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=-1)
    delta = F.linear(dt_low, mixer.dt_proj.weight).transpose(1, 2)
    Bm, Cm = Bm.transpose(1, 2).contiguous(), Cm.transpose(1, 2).contiguous()
    D, dbias = _ssm_float(mixer.D), _ssm_float(mixer.dt_proj.bias)
    args = (xc, delta.contiguous(), A, Bm, Cm, D, z.contiguous(), dbias, pos, True)
    ssm_init = ssm0
    if g["depth_at"]:
        # first pass, over the rows of the in-batch predecessors only: the in-batch continuations from zero, their
        # final states h_end(0); with the decays P of the middle pieces they chain in order
        first = _first_pass_geometry(step, g)
        rows = first["rows"]
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))  # noqa: E731
        a_args = (pick(xc), pick(args[1]), A, pick(Bm), pick(Cm), D, pick(args[6]), dbias, first["pos"], True)
        _, _, fin0 = selective_scan_fwd(*a_args, first["slots"], ssm0, step.num_slots)
        ssm_init = _chain_forward_ref(fin0, _middle_decays(step, g, delta, dbias, A), ssm0, g)
    y, _, ssm_final = selective_scan_fwd(*args, g["slots"], ssm_init, step.num_slots)
    step.keep(layer, conv_final, ssm_final)
    return F.linear(y.transpose(1, 2), mixer.out_proj.weight, mixer.out_proj.bias)


# ----------------------------------------------------------------------------------------------------------------
# The fused mixer with carried states: the computation of carried_mamba_inner_ref in one autograd Function, with the
# kernel ops (the conv's states by packloader::conv_states_fwd / _bwd) and a hand-written backward through the chain.

def _cached(g: dict, key, make):
    """``g[key]``, made by ``make()`` on first use: the step's geometry is the same in every layer."""
    got = g.get(key)
    if got is None:
        got = g[key] = make()
    return got


def _splice_geometry(g: dict, k: int):
    """The tokens the conv's states touch: (flat index (K, k) of each continued slot's first k tokens, valid (K, k));
    the invalid entries (past a short sequence's end, or a slot without a state) point at the slot's first token."""
    def make():
        j = torch.arange(k, device=g["start"].device)
        valid = g["has"][:, None] & (j < g["length"][:, None])
        return torch.where(valid, g["start"][:, None] + j, g["start"][:, None]), valid
    return _cached(g, ("splice", k), make)


def _final_geometry(g: dict, k: int):
    """(flat index (K, k) of each slot's last k tokens, inside (K, k): the token belongs to the slot)."""
    def make():
        i = torch.arange(k, device=g["start"].device)
        flat = g["start"][:, None] + g["length"][:, None] - k + i
        inside = flat >= g["start"][:, None]
        return torch.where(inside, flat, g["start"][:, None]), inside
    return _cached(g, ("final", k), make)


def _conv_sources(step: "CarryStep", g: dict, k: int):
    """Where each slot's conv state (its ``k`` inputs before its first token, oldest first) comes from, made on the
    host once a step and width: ``(token, is_token, slot, col)``, (K, k) each. An in-batch continuation's input ``j``
    is the token ``k - j`` places before its start in the document, found by walking back through its predecessors
    (past those shorter than ``k``) to a token (``is_token``: flat index ``token``) or to the cached state of the
    chain's first piece (``conv0[slot, :, col]``); before a document's start it is the slot's own state (zeros: an
    in-batch continuation has no cached one). Any other slot keeps its own state (``conv0[s, :, j]``)."""
    def make():
        K = step.num_slots
        token = np.zeros((K, k), dtype=np.int64)
        is_token = np.zeros((K, k), dtype=bool)
        slot = np.repeat(np.arange(K, dtype=np.int64)[:, None], k, 1)
        col = np.repeat(np.arange(k, dtype=np.int64)[None, :], K, 0)
        start, length = step._slot_start, step._slot_length
        for s in range(K):
            if step.source[s] != "batch":
                continue
            for j in range(k):
                need, cur = k - j, int(step.pred[s])
                while True:
                    if length[cur] >= need:
                        token[s, j], is_token[s, j] = start[cur] + length[cur] - need, True
                        break
                    need -= int(length[cur])
                    if step.source[cur] == "batch":
                        cur = int(step.pred[cur])
                    else:   # the cached state of the chain's first piece, or the document's start (own zeros)
                        if step.source[cur] == "cache":
                            slot[s, j], col[s, j] = cur, k - need
                        break
        dev = g["start"].device
        return (host_to_device(token, dev), host_to_device(is_token, dev), host_to_device(slot, dev),
                host_to_device(col, dev))
    return _cached(g, ("conv_sources", k), make)


def _conv_initial(step, x, conv0, g, k):
    """The conv's initial states (K, d, k) from :func:`_conv_sources`: the cached ones, and for an in-batch
    continuation the inputs before it (no loop over the chains)."""
    token, is_token, slot, col = _conv_sources(step, g, k)
    got = torch.where(is_token[..., None], _tokens_of(x, token, g, ("conv_sources", k)), conv0[slot, :, col])
    return got.permute(0, 2, 1).contiguous()


def _put_tokens(t: torch.Tensor, flat: torch.Tensor, vals: torch.Tensor, accumulate: bool = False,
                g: Optional[dict] = None, key=None) -> None:
    """t (b, d, L)[tokens flat] = vals (flat.shape + (d,)), in place (``accumulate``: +=). With ``g`` and ``key``: one
    scatter into t's storage with the step's cached index (no copy of t; a token listed twice gets the same value,
    or zeros when accumulating)."""
    got = _storage_index(t, flat, g, key) if key is not None else None
    if got is not None:
        flat_t, idx = got
        if accumulate:
            flat_t.index_add_(0, idx.reshape(-1), vals.reshape(-1).to(t.dtype))
        else:
            flat_t.index_put_((idx.reshape(-1),), vals.reshape(-1).to(t.dtype))
        return
    L = t.shape[2]
    t.permute(0, 2, 1).index_put_((flat // L, flat % L), vals, accumulate=accumulate)


def _decays(slices, dbias, A):
    """P (m, d, n) of the middle pieces from their delta slices (each (d, n_k))."""
    ct = torch.promote_types(slices[0].dtype, torch.float32)
    sums = torch.stack([F.softplus(s.to(ct) + dbias.to(ct)[:, None]).sum(-1) for s in slices])
    return torch.exp(sums[..., None] * A.to(ct))


def _chain_forward_ref(fin0, P_all, ssm0, g):
    """The true initial states: h0(k) = P(k-1) h0(k-1) + h_end(k-1) down each chain, in depth order (``fin0``: the
    end states of the first pass, from the cached states at depth 0, from zero deeper)."""
    init, true_final = ssm0, fin0
    for at in g["depth_at"]:
        at3 = at[:, None, None]
        init = torch.where(at3, true_final[g["pred"]], init)
        true_final = torch.where(at3, fin0 + P_all * init, true_final)
    return init


def _chain_forward(step, g, ssm0, xc, delta, A, Bm, delta_bias):
    """The true initial state of every slot: the cached ones, and for an in-batch continuation its predecessor's end
    state ``P h0 + E``, ``E`` the predecessor's end state from zero and ``P`` its decay (reductions over its tokens,
    no scan), down each chain in order (one prefix from the chain's first state)."""
    from .time_split import chain_prefix, segment_sums
    E, dts = segment_sums(True, delta, delta_bias, A, xc, None, Bm, True, g["chain_pred_start"],
                          g["chain_pred_length"], step.pred_max)
    ends = chain_prefix(E, dts, A, g["chain_offsets"], ssm0.index_select(0, g["chain_heads"]))
    return ssm0.index_copy(0, g["chain_succ"], ends.to(ssm0.dtype))


def _mid_row_finals(mid, ssm_final, ssm_init, xc, delta, A, Bm, delta_bias):
    """``ssm_final`` with the final states of the stored slots that end inside a row (``mid``), which a scan with
    row-edge slots does not write: ``P h0 + E`` over each one's tokens (reductions, no scan)."""
    from .time_split import segment_sums
    E, dts = segment_sums(True, delta, delta_bias, A, xc, None, Bm, True, mid["start"], mid["length"],
                          mid["max_length"])
    P = torch.exp(dts[..., None] * A.to(dts.dtype))
    fin = P * ssm_init.index_select(0, mid["slot"]).to(P.dtype) + E
    return ssm_final.index_copy(0, mid["slot"], fin.to(ssm_final.dtype))


def _chain_backward(step, g, dout_y, z, delta, A, Cm, delta_bias):
    """The gradient entering the end of every slot (K, d, n): for an in-batch predecessor, the adjoint its
    continuation's start hands back, ``D + P G``, ``D`` the continuation's from its own outputs (a reduction over its
    tokens) and ``G`` the gradient entering the continuation's end, along each chain from its last piece (one
    prefix). Zero for the other slots (a state kept for a later step is detached)."""
    from .time_split import chain_prefix, segment_sums
    Dsum, dts = segment_sums(False, delta, delta_bias, A, dout_y, z, Cm, True, g["chain_succ_start"],
                             g["chain_succ_length"], step.succ_max)
    back = chain_prefix(Dsum, dts, A, g["chain_offsets"], reverse=True)
    dfinal = torch.zeros((step.num_slots,) + tuple(back.shape[1:]), dtype=back.dtype, device=back.device)
    return dfinal.index_copy_(0, g["chain_pred"], back)


def _fused_inputs(ctx, hidden_states, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias, x_proj_weight,
                  delta_proj_weight, out_proj_weight, out_proj_bias, A, D, delta_bias):
    """The first part of the fused mixers with states (:class:`CarriedMambaInnerFn`, context parallelism's): the
    weights in autocast's dtype, in_proj, the conv's weights; records on ``ctx`` what their backward needs to know.
    Returns (hidden_states, in_proj_weight, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, x, z,
    cw, cb, k)."""
    from .mamba_inner import _autocast_weights, _in_proj
    ctx.dtypes = (in_proj_weight.dtype, conv1d_weight.dtype, x_proj_weight.dtype, delta_proj_weight.dtype,
                  out_proj_weight.dtype, hidden_states.dtype)
    ctx.has_in_bias, ctx.has_out_bias, ctx.has_conv_bias = (
        in_proj_bias is not None, out_proj_bias is not None, conv1d_bias is not None)
    ctx.has_D, ctx.has_db = D is not None, delta_bias is not None
    ctx.conv_shape = conv1d_weight.shape
    (hidden_states, in_proj_weight, in_proj_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
     out_proj_bias) = _autocast_weights(hidden_states.device.type, hidden_states, in_proj_weight, in_proj_bias,
                                        x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias)
    d_inner = in_proj_weight.shape[0] // 2
    width = conv1d_weight.shape[-1]
    hidden_states = hidden_states.contiguous()
    x, z = _in_proj(hidden_states, in_proj_weight, in_proj_bias, d_inner)
    cw = conv1d_weight.reshape(d_inner, width).contiguous()
    cb = conv1d_bias.contiguous() if conv1d_bias is not None else None
    return (hidden_states, in_proj_weight, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, x, z, cw,
            cb, width - 1)


def _fused_projections(xc, x_proj_weight, delta_proj_weight, d_state):
    """(x_dbl (b, L, r + 2n), delta (b, d, L), B, C (b, n, L) contiguous) from the conv's output."""
    from .mamba_inner import _bmm_w
    batch, dt_rank = xc.shape[0], delta_proj_weight.shape[1]
    x_dbl = torch.bmm(xc.transpose(1, 2), x_proj_weight.t().unsqueeze(0).expand(batch, -1, -1))
    delta = _bmm_w(delta_proj_weight, x_dbl[..., :dt_rank].transpose(1, 2))
    Bm = x_dbl[..., dt_rank:dt_rank + d_state].transpose(1, 2).contiguous()
    Cm = x_dbl[..., dt_rank + d_state:].transpose(1, 2).contiguous()
    return x_dbl, delta, Bm, Cm


def _fused_out_proj(out_z, out_proj_weight, out_proj_bias):
    y = torch.bmm(out_z.transpose(1, 2), out_proj_weight.t().unsqueeze(0).expand(out_z.shape[0], -1, -1))
    return y + out_proj_bias.to(y.dtype) if out_proj_bias is not None else y


def _fused_grads(ctx, dx, dz, z, hidden_states, in_proj_weight, dcw, dcb, cb, dx_proj_weight, ddelta_proj_weight,
                 dout_proj_weight, dout_proj_bias, dA, dD, ddb):
    """The last part of the fused mixers' backward: in_proj's, then the gradients of the twelve inputs the mixers
    share (hidden_states .. delta_bias), in their dtypes."""
    from .mamba_inner import _in_proj_backward
    w_dtype_in, w_dtype_conv, _, _, _, h_dtype = ctx.dtypes
    dhidden, din_proj_weight, din_proj_bias = _in_proj_backward(dx, dz.contiguous().to(z.dtype), hidden_states,
                                                                in_proj_weight, w_dtype_in, ctx.has_in_bias)
    return (dhidden.to(h_dtype), din_proj_weight, din_proj_bias, dcw.reshape(ctx.conv_shape).to(w_dtype_conv),
            (dcb.to(cb.dtype) if ctx.has_conv_bias else None), dx_proj_weight, ddelta_proj_weight, dout_proj_weight,
            dout_proj_bias, dA, dD if ctx.has_D else None, ddb if ctx.has_db else None)


def _states_in(step: CarryStep, g: dict, init: torch.Tensor) -> Optional[torch.Tensor]:
    """The initial states (K, ...) of the slots with a state in (``g["has_idx"]``), what the backward keeps of
    ``init`` (the others are zeros): ``init`` itself where every slot has one, None where none does."""
    if step.num_states_in == step.num_slots:
        return init
    return init.index_select(0, g["has_idx"]) if step.num_states_in else None


def _every_slot(step: CarryStep, g: dict, states_in: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
    """The initial states (K, ...) of every slot back from :func:`_states_in`'s: zeros for the slots without one."""
    if step.num_states_in == step.num_slots:
        return states_in
    init = torch.zeros(shape, dtype=dtype, device=g["start"].device)
    return init.index_copy_(0, g["has_idx"], states_in) if step.num_states_in else init


class CarriedMambaInnerFn(torch.autograd.Function):
    """:class:`ops.mamba_inner.PackedMambaInnerFn` on a batch with continuations (``step``): the conv and the scan
    start the continued pieces from their states, chained through the batch (the predecessors' end states from
    reductions over their tokens: :func:`_chain_forward`), one scan; the backward gives each predecessor's end the
    gradient its continuation's start hands back (:func:`_chain_backward`, reductions again) and runs the scan's
    backward once with those final-state gradients. The backward keeps the initial states of the slots with one
    only (:func:`_states_in`), the cache's own tensors where they all come from it
    (:meth:`CarryStep.cached_states_in`: no copy). Equal to ``carried_mamba_inner_ref`` (two scans, autograd)."""

    @staticmethod
    def forward(ctx, hidden_states, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias, x_proj_weight,
                delta_proj_weight, out_proj_weight, out_proj_bias, A, D, delta_bias, position_ids, step, layer):
        from .conv1d_interface import runmask_for
        (hidden_states, in_proj_weight, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, x, z, cw, cb,
         k) = _fused_inputs(ctx, hidden_states, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias,
                            x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A, D, delta_bias)
        d_inner, d_state = x.shape[1], A.shape[1]
        g = step.geometry(x.device)
        conv0, ssm0 = step.initial(layer, (d_inner, k), (d_inner, d_state), x.dtype, x.device)
        runmask = runmask_for(x, cw, position_ids)
        xc, conv_final, conv_init = _conv_with_states(step, x, cw, cb, position_ids, runmask, conv0, g, k)
        x_dbl, delta, Bm, Cm = _fused_projections(xc, x_proj_weight, delta_proj_weight, d_state)
        ssm_init = ssm0
        if g["depth_at"]:
            ssm_init = _chain_forward(step, g, ssm0, xc, delta, A, Bm, delta_bias)
        out_z, saved, ssm_final = kernel_calls.selective_scan_fwd(
            xc, delta, A, Bm, Cm, D, z, delta_bias, position_ids, True, g["fwd_slots"], ssm_init, step.num_slots)
        if g["mid"] is not None:
            ssm_final = _mid_row_finals(g["mid"], ssm_final, ssm_init, xc, delta, A, Bm, delta_bias)
        y = _fused_out_proj(out_z, out_proj_weight, out_proj_bias)
        step.keep(layer, conv_final, ssm_final)
        ctx.step, ctx.g, ctx.k = step, g, k
        ctx.init_specs = [(t.shape, t.dtype) for t in (ssm_init, conv_init)]
        # the states in: references to the cache's own where they all come from it (no copy), else this step's
        cached = step.cached_states_in(layer, conv_init.dtype, ssm_init.dtype, x.device)
        refs = [t for pair in zip(*cached) for t in pair] if cached is not None else []
        ssm_in, conv_in = (None, None) if refs else (_states_in(step, g, ssm_init), _states_in(step, g, conv_init))
        ctx.save_for_backward(hidden_states, in_proj_weight, x, z, cw, cb, x_dbl, x_proj_weight, delta_proj_weight,
                              out_proj_weight, A, Bm, Cm, D, delta_bias, position_ids, saved, runmask, ssm_in, conv_in,
                              *refs)
        return y

    @staticmethod
    def backward(ctx, dy):
        from .mamba_inner import _bmm_w, _wgrad, _x_proj_backward
        (hidden_states, in_proj_weight, x, z, cw, cb, x_dbl, x_proj_weight, delta_proj_weight, out_proj_weight, A, Bm,
         Cm, D, delta_bias, position_ids, saved, runmask, ssm_in, conv_in, *refs) = ctx.saved_tensors
        step, g, k = ctx.step, ctx.g, ctx.k
        if refs:   # the cache's states (conv ones first), stacked for this layer's backward only
            conv_in, ssm_in = torch.stack(refs[:len(refs) // 2]), torch.stack(refs[len(refs) // 2:])
        ssm_init, conv_init = (_every_slot(step, g, t, *spec) for t, spec in zip((ssm_in, conv_in), ctx.init_specs))
        dt_rank = delta_proj_weight.shape[1]
        _, _, w_dtype_xp, w_dtype_dt, w_dtype_out, _ = ctx.dtypes
        dy = dy.contiguous().to(x.dtype)
        xc = _conv_respliced(x, cw, cb, position_ids, runmask, conv_init, g, k)   # recomputed
        delta = _bmm_w(delta_proj_weight, x_dbl[..., :dt_rank].transpose(1, 2))
        dout_y = _bmm_w(out_proj_weight.t(), dy.transpose(1, 2))
        dout_proj_bias = dy.sum(dim=(0, 1)) if ctx.has_out_bias else None
        # the gradient entering each in-batch predecessor's end (its continuation's start), known before the scan's
        # backward runs: one pass of it is then exact for the whole chain
        dfinal = _chain_backward(step, g, dout_y, z, delta, A, Cm, delta_bias) if g["depth_at"] else None
        dxc, ddelta, dA, dB, dC, dD, dz, ddb, out_z, _ = kernel_calls.selective_scan_bwd(
            xc, delta, A, Bm, Cm, D, z, delta_bias, position_ids, True, saved, dout_y, True, g["bwd_slots"], ssm_init,
            dfinal)
        dout_proj_weight = _wgrad(dy.transpose(1, 2), out_z.transpose(1, 2), w_dtype_out)
        del out_z
        dx_proj_weight, ddelta_proj_weight, dxc = _x_proj_backward(dB, dC, ddelta, dxc, x_dbl, xc, x_proj_weight,
                                                                   delta_proj_weight, w_dtype_xp, w_dtype_dt)
        # conv: the continued outputs' gradient goes through their recomputation from the states (and is zeroed in
        # dxc), the rest through the kernel's backward
        chained = bool(g["depth_at"])
        dx_head, ddw, ddb_conv, dconv_init = kernel_calls.conv_states_bwd(
            dxc, x, cw, cb, True, conv_init, g["start"], g["length"], g["has"], chained)
        dx, dcw, dcb = kernel_calls.causal_conv1d_bwd(x, cw, cb, position_ids, True, dxc, runmask)
        dx = dx.contiguous()
        _put_tokens(dx, _splice_geometry(g, k)[0], dx_head.to(dx.dtype), accumulate=True, g=g, key="splice")
        dcw = dcw + ddw.to(dcw.dtype)
        if cb is not None:
            dcb = dcb + ddb_conv.to(dcb.dtype)
        if chained:   # an in-batch chain: the states are this step's inputs (the predecessors' last ones)
            token, is_token = _conv_sources(step, g, k)[:2]
            _put_tokens(dx, token, torch.where(is_token[..., None], dconv_init.permute(0, 2, 1), 0.0),
                        accumulate=True, g=g, key=("conv_sources", k))
        return _fused_grads(ctx, dx, dz, z, hidden_states, in_proj_weight, dcw, dcb, cb, dx_proj_weight,
                            ddelta_proj_weight, dout_proj_weight, dout_proj_bias, dA, dD, ddb) + (None, None, None)


def _storage_index(t: torch.Tensor, flat: torch.Tensor, g: Optional[dict], key):
    """(t's elements as one 1-D view over its storage, the index (flat.shape + (d,)) of tokens ``flat`` of t (b, d,
    L) in it), or None where t's strides overlap. The index is kept in ``g`` per (key, shape, strides): made once a
    step, not once a layer. None under ``torch.compile`` (the plain indexing, which it traces)."""
    if torch.compiler.is_compiling():
        return None
    order = sorted(range(t.dim()), key=lambda i: t.stride(i))
    span = 1
    for i in order:
        if t.shape[i] > 1 and t.stride(i) < span:
            return None
        span = max(span, t.stride(i) * t.shape[i]) if t.shape[i] > 1 else span
    b, d, L = t.shape
    s0, s1, s2 = t.stride()

    def make():
        f = flat.to(torch.int64)
        return ((f // L) * s0 + (f % L) * s2)[..., None] + torch.arange(d, device=f.device) * s1
    idx = make() if g is None else _cached(g, ("index", key, tuple(flat.shape), tuple(t.shape), tuple(t.stride())),
                                           make)
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,)), idx


def _tokens_of(t: torch.Tensor, flat: torch.Tensor, g: Optional[dict] = None, key=None) -> torch.Tensor:
    """t (b, d, L) at the flattened tokens ``flat`` -> flat.shape + (d,) (one gather with the step's cached index
    where ``g`` and ``key`` are given)."""
    got = _storage_index(t, flat, g, key) if key is not None else None
    if got is not None:
        return got[0][got[1]]
    L = t.shape[2]
    return t[flat // L, :, flat % L]


def _conv_with_states(step, x, cw, cb, pos, runmask, conv0, g, k):
    """(xc, conv_final, conv_init): the conv kernel's output with each continued slot's first k outputs recomputed from
    its state (the states chained through the batch), every slot's last k inputs, and the states it started from."""
    conv_init = _conv_initial(step, x, conv0, g, k) if g["depth_at"] else conv0
    xc = kernel_calls.causal_conv1d_fwd(x, cw, cb, pos, True, runmask)
    conv_final = kernel_calls.conv_states_fwd(xc, x, cw, cb, True, conv_init, g["start"], g["length"],
                                                      g["has"])
    return xc, conv_final, conv_init


def _conv_respliced(x, cw, cb, pos, runmask, conv_init, g, k):
    """The backward's recomputation of :func:`_conv_with_states`' xc (the same kernels, the same bits)."""
    xc = kernel_calls.causal_conv1d_fwd(x, cw, cb, pos, True, runmask)
    if conv_init is not None:
        kernel_calls.conv_states_fwd(xc, x, cw, cb, True, conv_init, g["start"], g["length"], g["has"])
    return xc
