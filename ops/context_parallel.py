"""Context parallelism: one packed row split along its tokens over the ranks of a process group.

A Mamba layer's activations grow with the row; a row longer than one GPU holds trains across several. Rank ``k`` of a
group of ``N`` holds tokens ``k * L/N .. (k+1) * L/N - 1`` of every row (:func:`shard_batch`). Everything outside the
mixers is token-wise; a mixer needs, for the one sequence of each row that crosses into its chunk from the rank before:

- the conv: the ``width - 1`` inputs that end the previous rank's chunk (its *halo*);
- the scan: the state ``h`` that sequence had at the end of the previous rank's chunk.

The scan is linear in its initial state: over a chunk's last segment from a zero state it ends at ``h_end``, and from
``h0`` at ``P * h0 + h_end``, ``P`` the product of the segment's decays (zero where the segment starts inside the
chunk). So every rank scans its chunk once from zero (pass A), the ranks all-gather their ``(P, h_end)`` pairs (two
``batch x d_inner x d_state`` float32 tensors a layer: megabytes, not activations), every rank composes its true
initial state from the ranks before it, and scans again from it (pass B)::

    row (one sequence crossing both cuts)  [ a0 ... a7 | a8 ... a15 | a16 ... a23 | b0 ... b7 ]
    rank                                      0            1              2            3
    pass A (from zero)                    h_end(0)     P(1), h_end(1)  P(2), h_end(2)  (b starts inside: P(3) = 0)
    initial state of rank 2's first token = P(1) * h_end(0) + h_end(1)

The backward is torch autograd through the same graph: the all-gathers' backward sums every rank's gradient of the
gathered pairs and halos (an all-reduce), so the state gradients run back across the ranks exactly as across the
pieces of :mod:`ops.carry`. Outputs and gradients equal the unsplit row's on one process (float64: to rounding).

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

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["context_parallel", "shard_batch", "all_reduce_gradients", "context_parallel_mamba_inner",
           "ContextParallelError"]


class ContextParallelError(ValueError):
    """A model, batch or group that context parallelism cannot take; the message says what and why."""


def _group_rank_world(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError("context parallelism needs torch.distributed initialised (init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


# ----------------------------------------------------------------------------------------------------------------
# The exchange: an all-gather whose backward sums every rank's gradient of the gathered tensor.

class _AllGather(torch.autograd.Function):
    """(world, *t.shape): every rank's ``t``; backward: this rank's slice of the sum over ranks of the gradients."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        ctx.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ctx.rank = rank
        t = t.contiguous()
        if dist.get_backend(group) == "nccl":
            out = t.new_empty((world,) + tuple(t.shape))
            dist.all_gather_into_tensor(out, t, group=group)
            return out
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
            return mine, None
        dist.all_reduce(grad, group=ctx.group)   # gloo has no reduce-scatter
        return grad[ctx.rank].clone(), None


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(t, group)


# ----------------------------------------------------------------------------------------------------------------
# Geometry of a rank's chunk

def _chunk_geometry(pos: torch.Tensor, rank: int) -> dict:
    """Per row of this rank's chunk (no host sync): whether its first token continues the previous rank's sequence,
    the length of its first sequence, the start of its last one, and the position ids the kernels take (the chunk's
    first token a sequence start: the state it continues from is handed in)."""
    b, L = pos.shape
    cont = pos[:, 0] != 0
    if rank == 0:
        cont = torch.zeros_like(cont)
    local = pos.to(torch.int32).clone()
    local[:, 0] = 0
    starts = local == 0
    idx = torch.arange(L, device=pos.device)
    first_len = torch.where(starts[:, 1:], idx[1:], torch.full_like(idx[1:], L)).amin(1) if L > 1 else \
        torch.ones(b, dtype=torch.long, device=pos.device)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).amax(1)
    rows = torch.arange(b, device=pos.device)
    none = torch.full((b, L), -1, dtype=torch.int32, device=pos.device)
    slots_final = none.clone()
    slots_final[:, L - 1] = rows.to(torch.int32)
    slots_init = none.clone()
    slots_init[:, 0] = torch.where(cont, rows, torch.full_like(rows, -1)).to(torch.int32)
    return {
        "pos": local.contiguous(), "cont": cont, "row_start": rows * L, "first_len": first_len,
        "last_start": rows * L + last_start, "last_len": L - last_start,
        # P matters only where the chunk's last segment is its first and continues from the rank before
        "whole_row": cont & (last_start == 0),
        "pass_a": torch.stack([none, slots_final]).contiguous(),
        "pass_b": torch.stack([slots_init, none]).contiguous(),
    }


class _ChunkDecay(torch.autograd.Function):
    """P (b, d, n) = exp(A * sum_t softplus(delta + delta_bias)) over each row, zero where ``keep`` is False; saves
    nothing of the row's size beyond ``delta`` (which the scan keeps anyway)."""

    @staticmethod
    def forward(ctx, delta, delta_bias, A, keep, dtype):
        dt_sum = F.softplus(delta.to(dtype) + delta_bias.to(dtype)[:, None]).sum(-1)            # (b, d)
        P = torch.exp(dt_sum[..., None] * A.to(dtype)) * keep.to(dtype)[:, None, None]
        ctx.save_for_backward(delta, delta_bias, A, P, dt_sum)
        return P

    @staticmethod
    def backward(ctx, dP):
        delta, delta_bias, A, P, dt_sum = ctx.saved_tensors
        At = A.to(P.dtype)
        g = dP * P                                                                           # d/d(exponent)
        d_sum = (g * At).sum(-1)                                                             # (b, d)
        dA = (g * dt_sum[..., None]).sum(0)
        sig = torch.sigmoid(delta.to(P.dtype) + delta_bias.to(P.dtype)[:, None])             # softplus'
        d_pre = d_sum[..., None] * sig                                                       # (b, d, L)
        return (d_pre.to(delta.dtype), d_pre.sum((0, 2)).to(delta_bias.dtype), dA.to(A.dtype), None, None)


def context_parallel_mamba_inner(mixer, hidden_states: torch.Tensor, position_ids: Optional[torch.Tensor],
                                 group) -> torch.Tensor:
    """A Mamba-1 mixer (:class:`ops.PackedMamba` or transformers' ``MambaMixer``) over this rank's chunk of every row.

    Args:
        mixer: the layer whose weights run.
        hidden_states: (batch, chunk, d_model): this rank's tokens ``rank * chunk .. (rank + 1) * chunk - 1`` of
            every row.
        position_ids: (batch, chunk) the rows' position ids over those tokens (not restarted at the chunk: a chunk
            whose first id is not 0 continues the sequence of the rank before); None: each row one sequence.
        group: the process group whose ranks hold the chunks, in rank order.

    Returns:
        (batch, chunk, d_model).
    """
    from .carry import _mixer_dims
    from .conv1d_interface import _continue_from_states, _conv_final_states, packed_causal_conv1d
    from .selective_scan_interface import selective_scan_fwd

    rank, world = _group_rank_world(group)
    b, L, _ = hidden_states.shape
    d_inner, d_state, width, dt_rank, conv_bias, ssm_float = _mixer_dims(mixer)
    if L < width - 1:
        raise ContextParallelError(f"each rank's chunk ({L} tokens) must hold at least the conv width - 1 = "
                                   f"{width - 1} tokens; use fewer ranks or longer rows")
    if position_ids is None:
        position_ids = (torch.arange(L, device=hidden_states.device) + rank * L).expand(b, L)
    g = _chunk_geometry(position_ids.to(hidden_states.device), rank)
    A = -torch.exp(ssm_float(mixer.A_log))
    xz = F.linear(hidden_states, mixer.in_proj.weight, mixer.in_proj.bias).transpose(1, 2)
    x, z = xz[:, :d_inner], xz[:, d_inner:]
    conv_w = mixer.conv1d.weight[:, 0]
    # conv: the last width-1 inputs of every row's last sequence go to the next rank
    tail = _conv_final_states(x, width, g["last_start"], g["last_len"], None, None)       # (b, d, width-1)
    halos = _all_gather(tail, group)                                                     # (world, b, d, width-1)
    halo = halos[rank - 1] if rank > 0 else halos[0] * 0
    xc = packed_causal_conv1d(x, conv_w, conv_bias, "silu", position_ids=g["pos"], validate=False)
    xc = _continue_from_states(xc, x, conv_w, conv_bias, True, g["row_start"], g["first_len"], halo, g["cont"])
    x_dbl = F.linear(xc.transpose(1, 2), mixer.x_proj.weight)
    dt_low, Bm, Cm = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=-1)
    delta = F.linear(dt_low, mixer.dt_proj.weight).transpose(1, 2).contiguous()
    Bm, Cm = Bm.transpose(1, 2).contiguous(), Cm.transpose(1, 2).contiguous()
    D, dbias = ssm_float(mixer.D), ssm_float(mixer.dt_proj.bias)
    args = (xc, delta, A, Bm, Cm, D, z.contiguous(), dbias, g["pos"], True)
    st = torch.float64 if xc.dtype == torch.float64 else torch.float32
    # pass A: every row's last segment from zero -> h_end; its decays -> P (zero unless it spans the whole chunk
    # and continues from the rank before)
    _, _, h_end = selective_scan_fwd(*args, g["pass_a"], None, b)                          # (b, d, n)
    P = _ChunkDecay.apply(delta, dbias, A, g["whole_row"], st)
    pairs = _all_gather(torch.stack([P, h_end.to(st)]), group)                             # (world, 2, b, d, n)
    # the true initial state of this rank's first sequence: h(k) = P(k-1) h(k-1) + h_end(k-1), h(0) = 0; every
    # rank's graph reads the gathered pairs (rank 0 with weight 0) so that every rank joins their backward
    h0 = torch.zeros_like(h_end, dtype=st)
    for j in range(world):
        w = 1.0 if j < rank else 0.0
        h0 = w * (pairs[j, 0] * h0 + pairs[j, 1]) + (1.0 - w) * h0
    y, _, _ = selective_scan_fwd(*args, g["pass_b"], h0.contiguous(), 0)
    return F.linear(y.transpose(1, 2), mixer.out_proj.weight, mixer.out_proj.bias)


# ----------------------------------------------------------------------------------------------------------------
# The model and the batch

def context_parallel(model: torch.nn.Module, group) -> torch.nn.Module:
    """Make ``model``'s Mamba-1 mixers run context-parallel over ``group`` (in place; returns ``model``).

    Every :class:`ops.PackedMamba` in ``model`` (what :func:`ops.enable_packing` puts in a mamba-ssm model) and every
    Hugging Face ``MambaMixer`` of a converted Mamba model then takes this rank's chunk of every row and exchanges
    its states with the other ranks of ``group``. The model's own check of the position ids at its entry is switched
    off (a chunk may begin inside a sequence): :func:`shard_batch` checks the whole rows before cutting them.

    Args:
        model: a module holding Mamba-1 mixers, converted by :func:`ops.enable_packing` where it is a mamba-ssm or
            Hugging Face model.
        group: a ``torch.distributed`` process group (NCCL on GPUs, gloo on the CPU); None: the default group.

    Raises:
        ContextParallelError: no Mamba-1 mixer found, a Mamba-2 mixer or a FalconMamba mixer with norms (not
            supported yet: their layers would run each chunk from zero).
    """
    from .modules.mamba_simple import PackedMamba
    from .convert import is_mamba2_mixer
    group = group if group is not None else dist.group.WORLD
    _group_rank_world(group)
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
            found += 1
    if not found:
        raise ContextParallelError(f"{type(model).__name__} holds no Mamba-1 mixer to run context-parallel")
    for m in model.modules():   # the model's entry check (mamba-ssm and Hugging Face conversions): off
        if hasattr(m, "_packloader_validate"):
            m._packloader_validate = False
    model._packloader_validate = False
    model._packloader_cp_group = group
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
