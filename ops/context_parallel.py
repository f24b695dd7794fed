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

The ranks form a pipeline over the layers: rank ``k`` runs layer ``l`` once rank ``k - 1`` has finished it, so a step
of ``n_layers`` layers over ``N`` ranks takes about ``n_layers + N - 1`` layer times instead of ``n_layers`` (the
backward likewise, from the last rank): 48 layers over 4 GPUs would allow 94% of linear scaling; measured on H100s,
0.77 (2 GPUs) and 0.67 (4) of one GPU's tokens/s per GPU (benchmarks/results/RESULTS.md). On GPUs the exchange is
NCCL send / receive. Outputs and gradients equal the unsplit row's on one
process (float64: to rounding).

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
        dist.send(g, dst=ctx.src, group=ctx.group if ctx.group is not dist.group.WORLD else None)
        return None, None, None, None, None


class _SendToNext(torch.autograd.Function):
    """Sends ``t`` to the next rank; returns a zero scalar to add to this rank's output (the graph edge through which
    the backward receives the gradient of ``t`` from the next rank)."""

    @staticmethod
    def forward(ctx, t, group, dst):
        ctx.group, ctx.dst = group, dst
        ctx.shape, ctx.dtype = t.shape, t.dtype
        dist.send(t.contiguous(), dst=dst, group=group if group is not dist.group.WORLD else None)
        return t.new_zeros(())

    @staticmethod
    def backward(ctx, grad_of_zero):
        g = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_of_zero.device)
        dist.recv(g, src=ctx.dst, group=ctx.group if ctx.group is not dist.group.WORLD else None)
        return g, None, None


# ----------------------------------------------------------------------------------------------------------------
# Geometry of a rank's chunk

def _chunk_geometry(pos: torch.Tensor, rank: int, world: int) -> dict:
    """Per row of this rank's chunk (no host sync): whether its first token continues the previous rank's sequence,
    the length of its first sequence, the start of its last one, the scan's state slots (row ``r``'s initial state
    read at its first token where it continues, its final state written at its last token where a next rank exists)
    and the position ids the kernels take (the chunk's first token a sequence start: the state it continues from is
    handed in)."""
    b, L = pos.shape
    cont = pos[:, 0] != 0
    if rank == 0:
        cont = torch.zeros_like(cont)
    local = pos.to(torch.int32).clone()
    local[:, 0] = 0
    starts = local == 0
    idx = torch.arange(L, device=pos.device)
    if L > 1:
        first_len = torch.where(starts[:, 1:], idx[1:], torch.full_like(idx[1:], L)).amin(1)
    else:
        first_len = torch.ones(b, dtype=torch.long, device=pos.device)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).amax(1)
    rows = torch.arange(b, device=pos.device)
    slots = torch.full((2, b, L), -1, dtype=torch.int32, device=pos.device)
    slots[0, :, 0] = torch.where(cont, rows, torch.full_like(rows, -1)).to(torch.int32)
    if rank < world - 1:
        slots[1, :, L - 1] = rows.to(torch.int32)
    return {"pos": local.contiguous(), "cont": cont, "row_start": rows * L, "first_len": first_len,
            "last_start": rows * L + last_start, "last_len": L - last_start, "slots": slots.contiguous()}


def context_parallel_mamba_inner(mixer, hidden_states: torch.Tensor, position_ids: Optional[torch.Tensor],
                                 group, recompute: bool = False) -> torch.Tensor:
    """A Mamba-1 mixer (:class:`ops.PackedMamba` or transformers' ``MambaMixer``) over this rank's chunk of every row.

    Receives, from the rank before, the scan state and the conv's last ``width - 1`` inputs at the end of its chunk
    (one ``batch x d_inner x (d_state + width - 1)`` float32 tensor), runs the layer once from them, and sends its
    own to the rank after; the backward returns the gradients the same way in reverse.

    Args:
        mixer: the layer whose weights run.
        hidden_states: (batch, chunk, d_model): this rank's tokens ``rank * chunk .. (rank + 1) * chunk - 1`` of
            every row.
        position_ids: (batch, chunk) the rows' position ids over those tokens (not restarted at the chunk: a chunk
            whose first id is not 0 continues the sequence of the rank before); None: each row one sequence.
        group: the process group whose ranks hold the chunks, in rank order.
        recompute: keep only the layer's inputs (hidden states, x, z and the received states) for the backward
            and recompute the conv, the projections, the scan and out_proj there (the exchange is not repeated):
            about half the layer's activation memory for one more forward of them.

    Returns:
        (batch, chunk, d_model).
    """
    from .carry import _mixer_dims
    from .mamba_inner import _bmm_w, _in_proj
    from .conv1d_interface import _continue_from_states, _conv_final_states, packed_causal_conv1d
    from .selective_scan_interface import selective_scan_fwd

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
        position_ids = (torch.arange(L, device=hidden_states.device) + rank * L).expand(b, L)
    g = _chunk_geometry(position_ids.to(hidden_states.device), rank, world)
    A = -torch.exp(ssm_float(mixer.A_log))
    # the projections as the fused mixer lays them out: (b, channels, tokens) contiguous straight from the GEMMs
    x, z = _in_proj(hidden_states, mixer.in_proj.weight, mixer.in_proj.bias, d_inner)
    st = torch.float64 if x.dtype == torch.float64 else torch.float32
    # Whether the exchange runs a backward: the same rule on every rank (the sender and the receiver must agree),
    # from what every rank shares: the input's requires_grad and the mixer's trainable parameters
    trainable = [p for p in mixer.parameters() if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or bool(trainable))
    anchor = hidden_states if hidden_states.requires_grad or not needs_grad else trainable[0]
    ssm0 = conv0 = None
    if rank > 0:   # what the previous rank's chunk ended with: its scan state and its last width-1 conv inputs
        got = _RecvFromPrevious.apply(anchor, (b, d_inner, d_state + width - 1), st, group,
                                      _peer(group, rank - 1))
        ssm0, conv0 = got[..., :d_state], got[..., d_state:].to(x.dtype)
    last = rank == world - 1

    def core(x, z, conv0, ssm0):
        """conv (from the received inputs), projections, scan (from the received state), out_proj: no exchange
        inside, so that it may be recomputed in the backward (``recompute``)."""
        conv_w = mixer.conv1d.weight[:, 0]
        xc = packed_causal_conv1d(x, conv_w, conv_bias, "silu", position_ids=g["pos"], validate=False)
        if conv0 is not None:
            xc = _continue_from_states(xc, x, conv_w, conv_bias, True, g["row_start"], g["first_len"], conv0,
                                       g["cont"])
        x_dbl = _bmm_w(mixer.x_proj.weight, xc)                                            # (b, r + 2n, L)
        dt_low, Bm, Cm = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=1)
        delta = _bmm_w(mixer.dt_proj.weight, dt_low)                                       # (b, d_inner, L)
        y, _, ssm_final = selective_scan_fwd(
            xc, delta, A, Bm.contiguous(), Cm.contiguous(), ssm_float(mixer.D), z, ssm_float(mixer.dt_proj.bias),
            g["pos"], True, g["slots"], None if ssm0 is None else ssm0.contiguous(), 0 if last else b)
        out = F.linear(y.transpose(1, 2), mixer.out_proj.weight, mixer.out_proj.bias)
        return (out,) if last else (out, ssm_final)

    if recompute and torch.is_grad_enabled():
        res = torch.utils.checkpoint.checkpoint(core, x, z, conv0, ssm0, use_reentrant=False)
    else:
        res = core(x, z, conv0, ssm0)
    out = res[0]
    if not last:   # (a chunk holds >= width - 1 tokens: its tail never reaches back into the previous chunk)
        tail = _conv_final_states(x, width, g["last_start"], g["last_len"], None, None)   # (b, d_inner, width-1)
        payload = torch.cat([res[1].to(st), tail.to(st)], -1)
        if needs_grad and not payload.requires_grad:   # (the receiver sends a gradient back: take it)
            payload = payload.detach().requires_grad_(True)
        sent = _SendToNext.apply(payload, group, _peer(group, rank + 1))
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
