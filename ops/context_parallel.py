"""Context parallelism: one packed row split along its tokens over the ranks of a process group.

A Mamba layer's activations grow with the row; a row longer than one GPU holds trains across several. Rank ``k`` of a
group of ``N`` holds tokens ``k * L/N .. (k+1) * L/N - 1`` of every row (:func:`shard_batch`). Everything outside the
mixers is token-wise; a mixer needs, for the one sequence of each row that crosses into its chunk from the rank before:

- the conv: the ``width - 1`` inputs that end the previous rank's chunk (its *halo*);
- the scan: the state ``h`` that sequence had at the end of the previous rank's chunk.

Each layer of rank ``k`` receives both from rank ``k - 1`` (one ``batch x d_inner x (d_state + width - 1)`` float32
(float64 for a float64 model) tensor: a few megabytes, not activations), runs once from them, and sends its own to rank ``k + 1``; the backward
sends the gradients back the same way::

    row (one sequence crossing every cut)  [ a0 ... a7 | a8 ... a15 | a16 ... a23 | b0 ... b7 ]
    rank                                      0            1              2            3
    layer l: rank 1 starts from rank 0's state after a7 and its inputs a5 a6 a7; rank 3's b starts from zero

The exchange runs inside the layer's autograd Function: a rank receives after its in_proj and sends right after its
scan (backward: receives before the scan's backward, sends once the conv's backward is done), so the ranks form a
pipeline over the layers in which only the conv, projections and scan of a layer wait for the rank before (backward:
after); in_proj and out_proj overlap. The scan takes the chunk's states as row-edge slots (its plain loops). Measured
on 4 H200s at the 1.4B width: 0.972 (2 GPUs) and 0.928 (4) of one GPU's tokens/s per GPU
(benchmarks/results/RESULTS.md). On GPUs the exchange is NCCL send / receive. Outputs and
gradients equal the unsplit row's on one process (float64: to rounding).

Usage (every rank of ``group`` runs the same code on the same rows)::

    model = ops.enable_packing(MambaLMHeadModel(cfg))
    ops.context_parallel(model, group)                 # its Mamba-1 mixers exchange states over ``group``
    ids, pos, labels = ops.shard_batch(group, batch["input_ids"], batch["position_ids"])
    logits = model(ids, position_ids=pos).logits       # this rank's chunk of every row
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    (loss / total_label_tokens).backward()             # the loss summed over the ranks of the group
    ops.all_reduce_gradients(model, group)             # every rank's weight gradients: the sum over the group

Data parallelism composes: the ranks of one context-parallel group receive the same rows
(``PackedDataLoader(context_parallel_size=...)``), different groups different rows.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from . import kernel_calls
from .boundaries import note_single_sequence_rows

__all__ = ["context_parallel", "shard_batch", "all_reduce_gradients", "context_parallel_mamba_inner",
           "ContextParallelError"]


class ContextParallelError(ValueError):
    """A model, batch or group that context parallelism cannot take; the message says what and why."""


def _group_rank_world(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError("context parallelism needs torch.distributed initialised (init_process_group)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ContextParallelError(f"this process (global rank {dist.get_rank()}) is not a member of the given "
                                   "context-parallel group: give each rank the group it belongs to")
    return rank, dist.get_world_size(group)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward (where activation checkpointing recomputes a forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


# ----------------------------------------------------------------------------------------------------------------
# The exchange: point-to-point along the ranks, differentiable. A rank receives from the rank before it and sends to
# the rank after it; the backward sends the gradient of what it received back, and receives the gradient of what it
# sent.

def _peer(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank


_PENDING_SENDS = []   # (work, tensor) of the sends not yet known to be complete, oldest first


def _send_async(t: torch.Tensor, dst: int, group) -> None:
    """Send ``t`` to global rank ``dst`` without making this rank's compute wait for the receiver.

    A blocking ``dist.send`` on NCCL makes the current stream wait until the peer has posted its receive, so every
    rank's compute would follow the slowest rank after it, layer by layer (and the backward the rank before it). The
    send is queued on the communicator's own stream instead (which still waits for ``t`` to be computed); ``t`` and
    the work stay referenced here until the send has completed (checked without blocking as later sends are queued),
    so the allocator never hands its memory out while NCCL reads it. Sends to one peer complete in order. (On 4
    H100s the step time did not measurably change against blocking sends: benchmarks/results/RESULTS.md.)"""
    work = dist.isend(t, dst=dst, group=group if group is not dist.group.WORLD else None)
    _PENDING_SENDS.append((work, t))
    while _PENDING_SENDS and _PENDING_SENDS[0][0].is_completed():
        _PENDING_SENDS.pop(0)


class _RecvFromPrevious(torch.autograd.Function):
    """The tensor the previous rank sends (shape, dtype given); backward: its gradient goes back to that rank.
    ``anchor`` (any tensor of this rank's graph that requires grad) ties the receive into the graph, so that its
    backward runs wherever this rank's backward runs."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, group, src):
        ctx.group, ctx.src = group, src
        buf = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(buf, src=src, group=group if group is not dist.group.WORLD else None)
        return buf

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous() if grad is not None else None
        if g is None:
            raise RuntimeError("context parallelism: no gradient for a received state")
        _send_async(g, ctx.src, ctx.group)
        return None, None, None, None, None


class _SendToNext(torch.autograd.Function):
    """Sends ``t`` to the next rank; returns a zero scalar to add to this rank's output (the graph edge through which
    the backward receives the gradient of ``t`` from the next rank)."""

    @staticmethod
    def forward(ctx, t, group, dst):
        ctx.group, ctx.dst = group, dst
        ctx.shape, ctx.dtype = t.shape, t.dtype
        _send_async(t.contiguous(), dst, group)
        return t.new_zeros(())

    @staticmethod
    def backward(ctx, grad_of_zero):
        g = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_of_zero.device)
        dist.recv(g, src=ctx.dst, group=ctx.group if ctx.group is not dist.group.WORLD else None)
        return g, None, None


class _Link:
    """The exchange inside :class:`_ContextParallelMambaInnerFn`: a layer receives its states from the previous rank
    (``prev``, global rank; None: rank 0) just before its conv and sends its own to the next (``next``; None: the last
    rank) right after its scan; the backward receives their gradient just before the scan's backward and returns the
    received states' once the conv's backward has them. So a rank waits for the rank before it only over the
    conv, projections and scan of a layer, not over its in_proj and out_proj (and, backward, their gradients), which
    run while the ranks before (backward: after) it still work on the layer."""

    def __init__(self, group, prev: Optional[int], next: Optional[int], shape, dtype):
        self.group = group if group is not dist.group.WORLD else None
        self.prev, self.next, self.shape, self.dtype = prev, next, tuple(shape), dtype

    def recv(self, src: int, device) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=device)
        dist.recv(buf, src=src, group=self.group)
        return buf

    def send(self, t: torch.Tensor, dst: int) -> None:
        _send_async(t.to(self.dtype).contiguous(), dst, self.group if self.group is not None else dist.group.WORLD)


# ----------------------------------------------------------------------------------------------------------------
# Geometry of a rank's chunk

def _chunk_geometry(pos: torch.Tensor, rank: int, world: int) -> dict:
    """Per row of this rank's chunk: whether its first token continues the previous rank's sequence, the length of
    its first sequence, the start of its last one, the scan's state slots (row ``r``'s initial state read at its first
    token where it continues, its final state written at its last token where a next rank exists) and the position
    ids the kernels take (the chunk's first token a sequence start: the state it continues from is handed in),
    recorded as one sequence a row where they are (one host sync; none under ``torch.compile``)."""
    b, L = pos.shape
    cont = pos[:, 0] != 0
    if rank == 0:
        cont = torch.zeros_like(cont)
    local = pos.to(torch.int32).clone()
    local[:, 0] = 0
    starts = local == 0
    if not (torch.compiler.is_compiling() or local.is_inference()):
        # one host sync a step (the geometry is made once a step): whether each row of the chunk is one sequence.
        # The scan then runs rows whole (the plain model learns it from its validation, which a chunk skips);
        # otherwise it plans to cut rows at sequence starts, and a row with none runs the layout of a larger grid
        # (+25-30 % scan time at one row of 8,192 tokens, 4,096 channels, H100)
        note_single_sequence_rows(local, not bool(starts[:, 1:].any()))
    idx = torch.arange(L, device=pos.device)
    if L > 1:
        first_len = torch.where(starts[:, 1:], idx[1:], torch.full_like(idx[1:], L)).amin(1)
    else:
        first_len = torch.ones(b, dtype=torch.long, device=pos.device)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).amax(1)
    rows = torch.arange(b, device=pos.device)
    # row-edge slots (ops.contract): the plain scan kernels read them once a row (the per-token states variant cost
    # 11 % of the forward scan and 4 % of its backward where only row edges hold states, H200)
    slots = torch.full((2, b), -1, dtype=torch.int32, device=pos.device)
    slots[0] = torch.where(cont, rows, torch.full_like(rows, -1)).to(torch.int32)
    if rank < world - 1:
        slots[1] = rows.to(torch.int32)
    return {"pos": local.contiguous(), "slots": slots.contiguous(),
            # the fused mixer's token geometry (ops.carry's helpers; their gather/scatter indices are kept in these
            # dicts, so made once a step): each row's first sequence, spliced from the received conv inputs ...
            "first": {"start": rows * L, "length": first_len, "has": cont},
            # ... and its last sequence, whose last width - 1 inputs go to the next rank
            "last": {"start": rows * L + last_start, "length": L - last_start}}


_GEOMETRY = [None]   # (key, weakref to the position_ids, geometry) of the last step
_DEFAULT_POSITIONS = {}   # (batch, chunk, rank, device) -> the chunk's ids where a call gives none (one tensor each)


def _default_positions(b: int, L: int, rank: int, device) -> torch.Tensor:
    """The ids of rows that are one sequence each, over this rank's chunk: the same tensor at every layer and step,
    so that its geometry is made once (and its one host sync paid once)."""
    key = (b, L, rank, str(device))
    got = _DEFAULT_POSITIONS.get(key)
    if got is None:
        with torch.inference_mode(False):   # (kept across calls: usable outside inference mode too)
            got = (torch.arange(L, device=device) + rank * L).expand(b, L)
        if len(_DEFAULT_POSITIONS) >= 8:
            _DEFAULT_POSITIONS.pop(next(iter(_DEFAULT_POSITIONS)))
        _DEFAULT_POSITIONS[key] = got
    return got


def _step_geometry(pos: torch.Tensor, rank: int, world: int, device) -> dict:
    """:func:`_chunk_geometry` on ``device``, made once per batch: every layer of a step gets the same
    ``position_ids`` tensor, and its geometry (with the indices the layers' gathers and scatters cache in it) is
    reused while that tensor is alive and unchanged (its version), wherever it lives. Made per call under
    ``torch.compile`` and for inference tensors."""
    if torch.compiler.is_compiling() or pos.is_inference():
        return _chunk_geometry(pos.to(device), rank, world)
    key = (rank, world, pos._version, tuple(pos.shape), pos.device, torch.device(device))
    last = _GEOMETRY[0]   # (one read: another thread may replace it)
    if last is not None and last[0] == key and last[1]() is pos:
        return last[2]
    value = _chunk_geometry(pos.to(device), rank, world)
    _GEOMETRY[0] = (key, weakref.ref(pos), value)
    return value


def _cp_conv(x, cw, cb, runmask, conv0, geo):
    """The conv over the chunk, each continuing row's first width - 1 outputs recomputed from the received inputs
    ``conv0`` (None: none received)."""
    xc = kernel_calls.causal_conv1d_fwd(x, cw, cb, geo["pos"], True, runmask)
    if conv0 is not None:
        first = geo["first"]
        kernel_calls.conv_states_fwd(xc, x, cw, cb, True, conv0, first["start"], first["length"],
                                             first["has"])
    return xc


class _ContextParallelMambaInnerFn(torch.autograd.Function):
    """The Mamba-1 mixer over one rank's chunk in one autograd Function (``PackedMambaInnerFn``'s layout: the conv
    recomputed in the backward): each row's first sequence continues from the received conv inputs ``conv0`` (b, d,
    width - 1) and scan state ``ssm0`` (b, d, n) where the geometry says it continues; returns ``(out, ssm_final,
    tail)``: each row's scan state at its last token and the last width - 1 inputs of its last sequence (zeros before
    a short one's start), what the next rank continues from (``send``; empty otherwise). The backward takes their
    gradients and returns those of ``conv0`` and ``ssm0``. With ``link`` (a :class:`_Link`) the Function exchanges
    them itself: ``conv0`` / ``ssm0`` are received inside (pass None), ``ssm_final`` / ``tail`` are sent inside (empty
    outputs), and the backward does the same with their gradients."""

    @staticmethod
    def forward(ctx, hidden_states, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias, x_proj_weight,
                delta_proj_weight, out_proj_weight, out_proj_bias, A, D, delta_bias, conv0, ssm0, geo, send,
                link=None):
        from .carry import _final_geometry, _fused_inputs, _fused_out_proj, _fused_projections, _tokens_of
        from .conv1d_interface import runmask_for
        (hidden_states, in_proj_weight, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, x, z, cw, cb,
         k) = _fused_inputs(ctx, hidden_states, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias,
                            x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A, D, delta_bias)
        batch, n = x.shape[0], A.shape[1]
        if link is not None and link.prev is not None:   # the previous rank's states, after this layer's in_proj
            got = link.recv(link.prev, x.device)
            ssm0, conv0 = got[..., :n], got[..., n:]
        ctx.conv0_dtype = conv0.dtype if conv0 is not None else None
        conv0 = conv0.to(x.dtype).contiguous() if conv0 is not None else None
        ssm0 = ssm0.contiguous() if ssm0 is not None else None
        runmask = runmask_for(x, cw, geo["pos"])
        xc = _cp_conv(x, cw, cb, runmask, conv0, geo)
        x_dbl, delta, Bm, Cm = _fused_projections(xc, x_proj_weight, delta_proj_weight, A.shape[1])
        out_z, saved, ssm_final = kernel_calls.selective_scan_fwd(
            xc, delta, A, Bm, Cm, D, z, delta_bias, geo["pos"], True, geo["slots"], ssm0, batch if send else 0)
        if send:
            fflat, inside = _final_geometry(geo["last"], k)
            tail = torch.where(inside[:, :, None], _tokens_of(x, fflat, geo["last"], "tail"), 0.0).permute(0, 2, 1)
            if link is not None:   # to the next rank before this layer's out_proj
                link.send(torch.cat([ssm_final.to(link.dtype), tail.to(link.dtype)], -1), link.next)
                ssm_final = tail = x.new_zeros((0,))
        else:
            ssm_final = tail = x.new_zeros((0,))
        y = _fused_out_proj(out_z, out_proj_weight, out_proj_bias)
        ctx.geo, ctx.k, ctx.send, ctx.link = geo, k, send, link
        ctx.save_for_backward(hidden_states, in_proj_weight, x, z, cw, cb, x_dbl, x_proj_weight, delta_proj_weight,
                              out_proj_weight, A, Bm, Cm, D, delta_bias, saved, runmask, conv0, ssm0)
        return y, ssm_final, tail.contiguous()

    @staticmethod
    def backward(ctx, dy, d_final, d_tail):
        from .carry import _final_geometry, _fused_grads, _put_tokens, _splice_geometry
        from .mamba_inner import _bmm_w, _wgrad, _x_proj_backward
        (hidden_states, in_proj_weight, x, z, cw, cb, x_dbl, x_proj_weight, delta_proj_weight, out_proj_weight, A, Bm,
         Cm, D, delta_bias, saved, runmask, conv0, ssm0) = ctx.saved_tensors
        geo, k = ctx.geo, ctx.k
        dt_rank = delta_proj_weight.shape[1]
        _, _, w_dtype_xp, w_dtype_dt, w_dtype_out, _ = ctx.dtypes
        dy = dy.contiguous().to(x.dtype)
        xc = _cp_conv(x, cw, cb, runmask, conv0, geo)   # recomputed
        delta = _bmm_w(delta_proj_weight, x_dbl[..., :dt_rank].transpose(1, 2))
        dout_y = _bmm_w(out_proj_weight.t(), dy.transpose(1, 2))
        dout_proj_bias = dy.sum(dim=(0, 1)) if ctx.has_out_bias else None
        link = ctx.link
        if link is not None and ctx.send:   # the gradient of what went to the next rank, before the scan's backward
            got = link.recv(link.next, x.device)
            d_final, d_tail = got[..., :A.shape[1]], got[..., A.shape[1]:]
        dfinal = d_final.contiguous() if ctx.send and d_final is not None else None
        dxc, ddelta, dA, dB, dC, dD, dz, ddb, out_z, dinit = kernel_calls.selective_scan_bwd(
            xc, delta, A, Bm, Cm, D, z, delta_bias, geo["pos"], True, saved, dout_y, True, geo["slots"], ssm0,
            dfinal)
        dx_proj_weight, ddelta_proj_weight, dxc = _x_proj_backward(dB, dC, ddelta, dxc, x_dbl, xc, x_proj_weight,
                                                                   delta_proj_weight, w_dtype_xp, w_dtype_dt)
        first = geo["first"]
        dconv0 = None
        if conv0 is not None:   # the continued outputs' gradient goes through their recomputation (zeroed in dxc)
            dx_head, ddw, ddb_conv, dconv0 = kernel_calls.conv_states_bwd(
                dxc, x, cw, cb, True, conv0, first["start"], first["length"], first["has"], True)
            if link is not None:   # back to the previous rank before the rest of this layer's backward
                link.send(torch.cat([dinit.to(link.dtype), dconv0.to(link.dtype)], -1), link.prev)
        dout_proj_weight = _wgrad(dy.transpose(1, 2), out_z.transpose(1, 2), w_dtype_out)
        del out_z
        dx, dcw, dcb = kernel_calls.causal_conv1d_bwd(x, cw, cb, geo["pos"], True, dxc, runmask)
        dx = dx.contiguous()
        if conv0 is not None:
            _put_tokens(dx, _splice_geometry(first, k)[0], dx_head.to(dx.dtype), accumulate=True, g=first,
                        key="splice")
            dcw = dcw + ddw.to(dcw.dtype)
            if cb is not None:
                dcb = dcb + ddb_conv.to(dcb.dtype)
            dconv0 = dconv0.to(ctx.conv0_dtype)
        if ctx.send and d_tail is not None:   # the sent inputs' gradient, back at their tokens
            fflat, inside = _final_geometry(geo["last"], k)
            _put_tokens(dx, fflat, torch.where(inside[..., None], d_tail.permute(0, 2, 1), 0.0).to(dx.dtype),
                        accumulate=True, g=geo["last"], key="tail")
        if link is not None:
            dconv0 = dinit = None
        return _fused_grads(ctx, dx, dz, z, hidden_states, in_proj_weight, dcw, dcb, cb, dx_proj_weight,
                            ddelta_proj_weight, dout_proj_weight, dout_proj_bias, dA, dD, ddb) + (
            dconv0, dinit if ssm0 is not None else None, None, None, None)


def context_parallel_mamba_inner(mixer, hidden_states: torch.Tensor, position_ids: Optional[torch.Tensor],
                                 group, recompute: bool = False) -> torch.Tensor:
    """A Mamba-1 mixer (:class:`ops.PackedMamba` or transformers' ``MambaMixer``) over this rank's chunk of every row.

    Receives, from the rank before, the scan state and the conv's last ``width - 1`` inputs at the end of its chunk
    (one ``batch x d_inner x (d_state + width - 1)`` float32 tensor), runs the layer once from them (one fused
    autograd Function, :class:`_ContextParallelMambaInnerFn`), and sends its own to the rank after; the backward
    returns the gradients the same way in reverse.

    Args:
        mixer: the layer whose weights run.
        hidden_states: (batch, chunk, d_model): this rank's tokens ``rank * chunk .. (rank + 1) * chunk - 1`` of
            every row.
        position_ids: (batch, chunk) the rows' position ids over those tokens (not restarted at the chunk: a chunk
            whose first id is not 0 continues the sequence of the rank before); None: each row one sequence.
        group: the process group whose ranks hold the chunks, in rank order.
        recompute: keep only the layer's inputs (hidden states and the received states) for the backward and
            recompute the layer there (the exchange is not repeated): less activation memory for one more forward.

    Returns:
        (batch, chunk, d_model).
    """
    from .carry import _mixer_dims

    group = group if group is not None else dist.group.WORLD
    rank, world = _group_rank_world(group)
    if _in_backward():
        raise ContextParallelError("a context-parallel mixer ran inside a backward (activation checkpointing of its "
                                   "block recomputes it, and the exchange cannot be repeated): switch checkpointing "
                                   "off and use ops.context_parallel(model, group, recompute=True)")
    b, L, _ = hidden_states.shape
    if position_ids is not None and tuple(position_ids.shape) != (b, L):
        raise ContextParallelError(f"position_ids must be (batch, chunk) = {(b, L)}, got {tuple(position_ids.shape)}")
    d_inner, d_state, width, dt_rank, conv_bias, ssm_float = _mixer_dims(mixer)
    if L < width - 1:
        raise ContextParallelError(f"each rank's chunk ({L} tokens) must hold at least the conv width - 1 = "
                                   f"{width - 1} tokens; use fewer ranks or longer rows")
    if position_ids is None:
        position_ids = _default_positions(b, L, rank, hidden_states.device)
    g = _step_geometry(position_ids, rank, world, hidden_states.device)
    A = -torch.exp(ssm_float(mixer.A_log))
    st = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    last = rank == world - 1
    prev = _peer(group, rank - 1) if rank > 0 else None
    nxt = _peer(group, rank + 1) if not last else None
    weights = (mixer.in_proj.weight, mixer.in_proj.bias, mixer.conv1d.weight, conv_bias, mixer.x_proj.weight,
               mixer.dt_proj.weight, mixer.out_proj.weight, mixer.out_proj.bias, A, ssm_float(mixer.D),
               ssm_float(mixer.dt_proj.bias))
    shape = (b, d_inner, d_state + width - 1)
    if not (recompute and torch.is_grad_enabled()):
        # the exchange inside the layer's Function: its backward runs on a rank exactly when some input of the mixer
        # requires grad (the input or a trainable weight: the same on every rank)
        return _ContextParallelMambaInnerFn.apply(hidden_states, *weights, None, None, g, not last,
                                                  _Link(group, prev, nxt, shape, st))[0]
    # recompute (grad enabled): the exchange around the Function, which checkpointing recomputes in the backward.
    # Whether the exchange runs a backward: the same rule on every rank (the sender and the receiver must agree),
    # from what every rank shares: the input's requires_grad and the mixer's trainable parameters
    trainable = [p for p in mixer.parameters() if p.requires_grad]
    needs_grad = hidden_states.requires_grad or bool(trainable)
    anchor = hidden_states if hidden_states.requires_grad or not needs_grad else trainable[0]
    ssm0 = conv0 = None
    if rank > 0:   # what the previous rank's chunk ended with: its scan state and its last width-1 conv inputs
        got = _RecvFromPrevious.apply(anchor, shape, st, group, prev)
        ssm0, conv0 = got[..., :d_state], got[..., d_state:]

    def core(hidden_states, conv0, ssm0):
        """The fused mixer from the received states: no exchange inside, so that it may be recomputed in the
        backward (``recompute``)."""
        return _ContextParallelMambaInnerFn.apply(hidden_states, *weights, conv0, ssm0, g, not last)

    out, ssm_final, tail = torch.utils.checkpoint.checkpoint(core, hidden_states, conv0, ssm0, use_reentrant=False)
    if not last:   # (a chunk holds >= width - 1 tokens: its tail never reaches back into the previous chunk)
        payload = torch.cat([ssm_final.to(st), tail.to(st)], -1)
        if needs_grad and not payload.requires_grad:   # (the receiver sends a gradient back: take it)
            payload = payload.detach().requires_grad_(True)
        sent = _SendToNext.apply(payload, group, nxt)
        out = out + sent.to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The model and the batch

def context_parallel(model: torch.nn.Module, group, *, recompute: bool = False) -> torch.nn.Module:
    """Make ``model``'s Mamba-1 mixers run context-parallel over ``group`` (in place; returns ``model``).

    Every :class:`ops.PackedMamba` in ``model`` (what :func:`ops.enable_packing` puts in a mamba-ssm model) and every
    Hugging Face ``MambaMixer`` of a converted Mamba model then takes this rank's chunk of every row and exchanges
    its states with the other ranks of ``group``. The model's own check of the position ids at its entry is switched
    off (a chunk may begin inside a sequence): :func:`shard_batch` checks the whole rows before cutting them.

    Args:
        model: a module holding Mamba-1 mixers, converted by :func:`ops.enable_packing` where it is a mamba-ssm or
            Hugging Face model.
        group: a ``torch.distributed`` process group (NCCL on GPUs, gloo on the CPU); None: the default group.
        recompute: each mixer keeps only its inputs and recomputes its conv, projections, scan and out_proj in the
            backward (about half its activation memory, one more forward of those): the longest rows. (Activation
            checkpointing of whole blocks with ``torch.utils.checkpoint`` would repeat the exchange in the backward,
            which the other ranks do not answer: use this instead.)

    Raises:
        ContextParallelError: no Mamba-1 mixer found, a Mamba-2 or FalconMamba mixer (not supported yet: their
            layers would run each chunk from zero), gradient checkpointing switched on.
    """
    from .modules.mamba_simple import PackedMamba
    from .convert import is_mamba2_mixer
    group = group if group is not None else dist.group.WORLD
    _group_rank_world(group)
    checkpointed = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if getattr(model, "is_gradient_checkpointing", False) or checkpointed:
        raise ContextParallelError(
            f"{type(model).__name__} has gradient checkpointing on ({', '.join(checkpointed[:3]) or 'the model'}): its "
            "recomputation would repeat the exchange between ranks in the backward; switch it off "
            "(gradient_checkpointing_disable()) and pass recompute=True instead")
    found = 0
    for name, m in model.named_modules():
        classes = {c.__name__ for c in type(m).__mro__}
        if is_mamba2_mixer(m) or classes & {"Mamba2Mixer", "FalconMambaMixer", "BambaMixer", "Zamba2MambaMixer"}:
            raise ContextParallelError(f"{name} ({type(m).__name__}): context parallelism covers Mamba-1 mixers "
                                       "(mamba-ssm's Mamba, transformers' MambaMixer) only")
        if isinstance(m, PackedMamba) or "MambaMixer" in classes:
            if not isinstance(m, PackedMamba) and not getattr(type(m), "_packloader_packed", False):
                raise ContextParallelError(f"{name}: a Hugging Face MambaMixer not converted: call "
                                           "ops.enable_packing(model) first")
            m._packloader_cp_group = group
            m._packloader_cp_recompute = bool(recompute)
            found += 1
    if not found:
        raise ContextParallelError(f"{type(model).__name__} holds no Mamba-1 mixer to run context-parallel")
    for m in model.modules():   # the model's entry check (mamba-ssm and Hugging Face conversions): off
        if hasattr(m, "_packloader_validate"):
            m._packloader_validate = False
    model._packloader_validate = False
    model._packloader_cp_group = group   # the model's entry refuses a batch without position_ids (see shard_batch)
    return model


def shard_batch(group, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, *, validate: bool = True):
    """This rank's chunk of every row: ``(input_ids, position_ids, labels)``, each (batch, seqlen / world).

    The labels come back already shifted (the next token of the same sequence, -100 at every sequence's last token
    and where ``labels`` had -100): a chunk's last token's target lies on the next rank, so the loss on each rank
    is a plain cross entropy over its chunk, with no further shift. Summed over the ranks it is the unsplit row's.

    Args:
        group: the context-parallel process group (None: the default group).
        input_ids: (batch, seqlen) the whole rows, the same on every rank of the group; ``seqlen`` divisible by the
            group's size.
        position_ids: (batch, seqlen) restarting at 0 at every sequence start, or None (each row one sequence).
        labels: (batch, seqlen) the unshifted targets (usually ``input_ids`` with -100 where no loss is taken), or
            None: ``input_ids``.
        validate: check the whole rows' position ids first (one host sync).

    Raises:
        ContextParallelError: ``seqlen`` not divisible by the group's size, or shapes that differ.
    """
    from .boundaries import row_positions, validate_position_ids
    group = group if group is not None else dist.group.WORLD
    rank, world = _group_rank_world(group)
    if input_ids.dim() != 2:
        raise ContextParallelError(f"input_ids must be (batch, seqlen), got {tuple(input_ids.shape)}")
    b, L = input_ids.shape
    if L % world:
        raise ContextParallelError(f"input_ids: seqlen {L} is not divisible by the context-parallel group's "
                                   f"{world} ranks; pack rows of a capacity divisible by it")
    if position_ids is None:
        position_ids = row_positions(b, L, input_ids.device)
    for name, t in (("position_ids", position_ids), ("labels", labels)):
        if t is not None and tuple(t.shape) != (b, L):
            raise ContextParallelError(f"{name} must be (batch, seqlen) = {(b, L)}, got {tuple(t.shape)}")
    if validate:
        validate_position_ids(position_ids)
    labels = input_ids if labels is None else labels
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    ends = torch.ones_like(position_ids, dtype=torch.bool)
    ends[:, :-1] = position_ids[:, 1:] == 0          # a sequence's last token has no target in its sequence
    shifted = shifted.masked_fill(ends, -100)
    n = L // world
    cut = slice(rank * n, (rank + 1) * n)
    return input_ids[:, cut].contiguous(), position_ids[:, cut].contiguous(), shifted[:, cut].contiguous()


def all_reduce_gradients(model: torch.nn.Module, group) -> None:
    """Sum every parameter's gradient over ``group`` (each rank's gradient covers its chunk's tokens only): call
    after ``backward`` and before the optimizer step. (Under DDP or FSDP over the whole world, their averaging
    replaces this: scale the loss by the group's size.)"""
    group = group if group is not None else dist.group.WORLD
    by_dtype = {}
    for p in model.parameters():
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():     # one all-reduce per dtype
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
