"""ops.context_parallel: packed rows split along their tokens over 2-4 processes (gloo, the reference kernels,
float64) give the unsplit rows' outputs, input gradients and weight gradients of one process; sequences cross one
and several cuts, start inside a chunk's last width-1 tokens, are shorter than the conv width, and one fills a row.
GPU: 2 and 4 GPUs over NCCL (``-m gpu``; needs that many GPUs)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ops

F64 = torch.float64
L = 24   # divisible by 2, 3 and 4 ranks; chunks of 6..12 tokens >= width - 1 = 3
ROWS = [
    [24],                    # one sequence, crossing every cut (the decays P chain over all ranks)
    [1, 2, 7, 1, 13],        # short ones; a length-1 sequence inside a chunk's last 3 tokens; a long one crossing
    [5, 1, 6, 6, 6],         # sequences starting exactly at the cuts (nothing continues there)
]


class Stack(torch.nn.Module):
    def __init__(self, d_model=8, n=2, dtype=F64, device=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            ops.PackedMamba(d_model, d_state=4, d_conv=4, expand=2, layer_idx=i, dtype=dtype, device=device)
            for i in range(n))

    def forward(self, h, position_ids):
        for layer in self.layers:
            h = h + layer(h, position_ids=position_ids)
        return h


def _inputs(device="cpu", dtype=F64):
    torch.manual_seed(1234)   # the same model and data in every process
    model = Stack(dtype=dtype, device=device)
    with torch.no_grad():
        for m in model.layers:   # a slower decay so that states carry over whole chunks
            m.A_log.mul_(0.3)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS]).to(device)
    h = torch.randn(len(ROWS), L, 8, dtype=dtype, device=device)
    dy = torch.randn(len(ROWS), L, 8, dtype=dtype, device=device)
    return model, pos, h, dy


def _reference(model, pos, h, dy):
    h = h.clone().requires_grad_(True)
    out = model(h, position_ids=pos)
    (out * dy).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), h.grad, grads


def _check_rank(rank, world, device, dtype, tol, recompute=False):
    model, pos, h, dy = _inputs(device, dtype)
    want_out, want_dh, want_grads = _reference(model, pos, h, dy)
    group = dist.group.WORLD
    ops.context_parallel(model, group, recompute=recompute)
    n = L // world
    cut = slice(rank * n, (rank + 1) * n)
    _, pos_k, _ = ops.shard_batch(group, torch.zeros_like(pos), pos)
    with torch.no_grad():   # inference: the exchange runs forward only
        _close(model(h[:, cut], position_ids=pos_k), want_out[:, cut], tol, "outputs without grad")
    h_k = h[:, cut].clone().requires_grad_(True)
    out = model(h_k, position_ids=pos_k)
    (out * dy[:, cut]).sum().backward()
    ops.all_reduce_gradients(model, group)
    _close(out.detach(), want_out[:, cut], tol, "outputs")
    _close(h_k.grad, want_dh[:, cut], tol, "input gradients")
    for name, p in model.named_parameters():
        # A_log and D are float32 parameters: their gradients sum per-rank float32 contributions (float32's rounding)
        _close(p.grad, want_grads[name], max(tol, 2e-6) if p.dtype == torch.float32 else tol, f"gradient of {name}")


def _close(got, want, tol, what):
    """max |got - want| <= tol * max |want| (a tolerance relative to the tensor's scale: near-zero entries of a
    float32 gradient carry the rounding of its large ones)."""
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    assert err <= tol, f"{what}: max |diff| / max |ref| = {err:.2e} > {tol:.0e}"


def _check_labels(rank, world):
    """The shifted labels of the chunks, summed over ranks, make the unsplit rows' next-token loss."""
    torch.manual_seed(7)
    ids = torch.randint(0, 50, (len(ROWS), L))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS])
    logits = torch.randn(len(ROWS), L, 50, dtype=F64)
    labels = ids.clone()
    labels[1, 3] = -100
    ce = torch.nn.functional.cross_entropy
    want = 0.0
    for r, row in enumerate(ROWS):   # each sequence alone: predict token t+1 from t, inside the sequence
        s = 0
        for n in row:
            tgt = labels[r, s + 1:s + n]
            if tgt.numel():
                want += float(ce(logits[r, s:s + n - 1], tgt, ignore_index=-100, reduction="sum"))
            s += n
    with pytest.raises(ops.ContextParallelError, match="not divisible"):
        ops.shard_batch(dist.group.WORLD, torch.zeros(2, world * 3 + 1, dtype=torch.long))
    _, _, lab_k = ops.shard_batch(dist.group.WORLD, ids, pos, labels)
    n = L // world
    mine = ce(logits[:, rank * n:(rank + 1) * n].flatten(0, 1), lab_k.flatten(), ignore_index=-100, reduction="sum")
    total = mine.clone()
    dist.all_reduce(total)
    assert abs(float(total) - want) < 1e-9 * max(1.0, abs(want)), (float(total), want)


def _hf_model():
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(99)
    cfg = MambaConfig(vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=4, expand=2,
                      use_cache=False)
    return ops.enable_packing(MambaForCausalLM(cfg).to(F64))


def _check_hf(rank, world):
    """A converted Hugging Face MambaForCausalLM: the chunks' logits and the summed loss's gradients equal the
    unsplit rows' (one process, packed)."""
    model = _hf_model()
    torch.manual_seed(5)
    ids = torch.randint(0, 40, (len(ROWS), L))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS])
    ce = torch.nn.functional.cross_entropy
    group = dist.group.WORLD
    _, _, lab = ops.shard_batch(group, ids, pos) if world == 1 else (None, None, None)
    logits = model(ids, position_ids=pos).logits
    full_labels = torch.full_like(ids, -100)
    full_labels[:, :-1] = ids[:, 1:]
    full_labels[:, :-1].masked_fill_(pos[:, 1:] == 0, -100)
    ce(logits.flatten(0, 1), full_labels.flatten(), ignore_index=-100, reduction="sum").backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ops.context_parallel(model, group)
    ids_k, pos_k, lab_k = ops.shard_batch(group, ids, pos)
    n = L // world
    torch.testing.assert_close(lab_k, full_labels[:, rank * n:(rank + 1) * n])
    logits_k = model(ids_k, position_ids=pos_k).logits
    torch.testing.assert_close(logits_k.detach(), logits.detach()[:, rank * n:(rank + 1) * n], rtol=1e-9, atol=1e-9)
    ce(logits_k.flatten(0, 1), lab_k.flatten(), ignore_index=-100, reduction="sum").backward()
    ops.all_reduce_gradients(model, group)
    for name, p in model.named_parameters():
        _close(p.grad, want[name], 2e-6 if name.endswith((".D", ".A_log")) else 1e-7,   # (A, D, dt bias float32)
               f"gradient of {name}")


def _check_frozen_input(rank, world):
    """A mixer input that does not require grad (frozen features, LoRA-like training of in_proj alone) with trainable
    weights: the backward still exchanges the state gradients (no rank waits forever) and the gradients are exact."""
    model, pos, h, dy = _inputs()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("in_proj.weight"))
    out = model(h, position_ids=pos)
    (out * dy).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    group = dist.group.WORLD
    ops.context_parallel(model, group)
    n = L // world
    cut = slice(rank * n, (rank + 1) * n)
    _, pos_k, _ = ops.shard_batch(group, torch.zeros_like(pos), pos)
    (model(h[:, cut], position_ids=pos_k) * dy[:, cut]).sum().backward()
    ops.all_reduce_gradients(model, group)
    assert set(want) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, g in want.items():
        _close(dict(model.named_parameters())[name].grad, g, 1e-9, f"gradient of {name}")


def _check_guards(rank, world):
    """Refused: a group this rank is not in; a Hugging Face model without position_ids or with labels=; gradient
    checkpointing switched on."""
    solo = dist.new_group([0])
    if rank != 0:
        with pytest.raises(ops.ContextParallelError, match="not a member"):
            ops.context_parallel(_inputs()[0], solo)
    model = _hf_model()
    model.gradient_checkpointing_enable()
    with pytest.raises(ops.ContextParallelError, match="gradient checkpointing"):
        ops.context_parallel(model, dist.group.WORLD)
    model = ops.context_parallel(_hf_model(), dist.group.WORLD)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ops.ContextParallelError, match="takes position_ids"):
        model(ids)
    with pytest.raises(ops.ContextParallelError, match="labels"):
        model(ids, position_ids=torch.arange(8)[None], labels=ids)


def _worker(rank, world, init_file, backend, device_kind):
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if device_kind == "cuda":
            torch.cuda.set_device(rank)
            _check_rank(rank, world, f"cuda:{rank}", torch.float32, 2e-5)
            _check_rank(rank, world, f"cuda:{rank}", torch.float32, 2e-5, recompute=True)
        else:
            _check_rank(rank, world, "cpu", F64, 1e-9)
            _check_rank(rank, world, "cpu", F64, 1e-9, recompute=True)
            _check_labels(rank, world)
            if world == 2:
                _check_hf(rank, world)
                _check_frozen_input(rank, world)
                _check_guards(rank, world)
        # every rank done before any tears gloo down (rank 0 aborted at exit under load, "terminate called without an
        # active exception", as the DDP example did before its barrier)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world, backend, device_kind):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), backend, device_kind), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(world):
    _spawn(world, "gloo", "cpu")


def test_bad_arguments():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            with pytest.raises(ops.ContextParallelError, match="no Mamba-1 mixer"):
                ops.context_parallel(torch.nn.Linear(2, 2), group)
            with pytest.raises(ops.ContextParallelError, match="position_ids must be"):
                ops.shard_batch(group, torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
            with pytest.raises(ops.BoundaryError):
                ops.shard_batch(group, torch.zeros(1, 4, dtype=torch.long), torch.tensor([[0, 1, 3, 4]]))
            # a converted mamba-ssm model's entry: seq_idx / cu_seqlens alone cannot say that a chunk continues
            from ops.convert import _resolve_for_model
            marked = torch.nn.Module()
            marked._packloader_cp_group, marked._packloader_validate = group, False
            with pytest.raises(ops.ContextParallelError, match="takes position_ids"):
                _resolve_for_model(marked, torch.zeros(1, 4, dtype=torch.long), None,
                                   torch.zeros(1, 4, dtype=torch.int32), None)
            model, pos, h, _ = _inputs()
            ops.context_parallel(model, group)
            with pytest.raises(ops.ContextParallelError, match="position_ids"):
                model.layers[0](h, seq_idx=torch.zeros_like(pos))
            # one rank: the context-parallel mixer is the plain one
            model2, pos2, h2, dy2 = _inputs()
            want = model2(h2, position_ids=pos2)
            torch.testing.assert_close(model(h, position_ids=pos), want, rtol=1e-12, atol=1e-12)
        finally:
            dist.destroy_process_group()


def test_chunk_geometry_tells_the_scan_which_rows_are_one_sequence():
    """A chunk's ids restart at its first token, so the model's validation (which tells the scan that rows are one
    sequence) never sees them: the geometry records it, and the scan then runs such rows whole instead of planning
    to cut them at sequence starts (the layout of a larger grid, +25-30 % scan time on an H100)."""
    from ops.boundaries import single_sequence_rows
    from ops.context_parallel import _chunk_geometry
    from ops.contract import scan_bwd_segments, scan_fwd_segments
    from ops.selective_scan_interface import _segments
    n = 4096
    whole = torch.arange(4 * n)[None].expand(2, -1)              # two rows, each one sequence over 4 ranks
    inside = whole.clone()
    inside[1, n + 7:] -= n + 7                                   # row 1: a sequence starts inside rank 1's chunk
    u = torch.empty(2, 64, n)
    for rank in range(4):
        chunk = whole[:, rank * n:(rank + 1) * n]
        geo = _chunk_geometry(chunk, rank, 4)
        assert single_sequence_rows(geo["pos"])
        assert _segments(scan_fwd_segments, u, geo["pos"]) == 1 and _segments(scan_bwd_segments, u, geo["pos"]) == 1
    geo = _chunk_geometry(inside[:, n:2 * n], 1, 4)
    assert not single_sequence_rows(geo["pos"])
    assert _segments(scan_fwd_segments, u, geo["pos"]) > 1       # (the planned cut a small grid gets)
    assert single_sequence_rows(_chunk_geometry(inside[:, 2 * n:3 * n], 2, 4)["pos"])   # no start inside this one


def test_geometry_is_made_once_for_rows_without_position_ids(monkeypatch):
    """Without position_ids every layer and step gets the same default ids, so the chunk's geometry (and its one host
    sync) is made once, not at every layer."""
    import importlib
    cp = importlib.import_module("ops.context_parallel")   # (ops.context_parallel is also the function)
    made = []
    real = cp._chunk_geometry
    monkeypatch.setattr(cp, "_chunk_geometry", lambda *a: made.append(1) or real(*a))
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            model, _, h, _ = _inputs()
            want = model(h, None)
            ops.context_parallel(model, dist.group.WORLD)
            for _ in range(2):
                out = model(h, None)
                out.sum().backward()
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        finally:
            dist.destroy_process_group()
    assert len(made) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_gpus(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _spawn(world, "nccl", "cuda")


def _losses(cmd, cwd):
    import re
    import subprocess
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [float(v) for v in re.findall(r"loss (\d+\.\d+)", out.stdout)]


def test_example_context_parallel_matches_one_process(tmp_path):
    """examples/train_context_parallel.py: 2 ranks of one context-parallel group train with the losses of one
    process on the same rows (float32; the runs' sums differ only in order)."""
    import socket
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "examples", "train_context_parallel.py")
    common = ["--steps", "3", "--threads", "1", "--capacity", "512", "--workdir", str(tmp_path / "w")]
    one = _losses([sys.executable, script] + common, root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = _losses([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(port), script, "--cp", "2"] + common, root)
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a - b) < 2e-5, (one, two)
    assert one[0] != one[-1]   # it trains
