"""ops.enable_packing on Hugging Face transformers' MambaForCausalLM, FalconMambaForCausalLM and
Mamba2ForCausalLM (tiny random configs, float64): a packed row gives every sequence the logits and
every parameter the gradient that running each sequence alone through the unconverted model gives;
check_isolation passes on the converted model and catches the unconverted one; no boundaries, state_dict,
generation and gradient checkpointing behave; unsupported hybrids (Jamba) are refused."""
from __future__ import annotations

import copy
import random

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')", exc_type=ImportError
)

import ops  # noqa: E402
from ops.boundaries import BoundaryError, position_ids_to_cu_seqlens  # noqa: E402

transformers.logging.set_verbosity_error()  # the "falling back to PyTorch" notices of the CPU path

VOCAB = 48
FAMILIES = ["mamba", "falcon_mamba", "mamba2"]


def make_model(family: str, seed: int = 0, n_layers: int = 2, gpu_sizes: bool = False):
    torch.manual_seed(seed)
    if family == "mamba":
        cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=n_layers,
                                       expand=2, conv_kernel=4, time_step_rank=4, use_conv_bias=True)
        model = transformers.MambaForCausalLM(cfg)
    elif family == "falcon_mamba":
        cfg = transformers.FalconMambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4,
                                             num_hidden_layers=n_layers, expand=2, conv_kernel=4, time_step_rank=4)
        model = transformers.FalconMambaForCausalLM(cfg)
    else:
        if gpu_sizes:  # sizes mamba-ssm's Triton SSD kernels take (dot products of at least 16)
            cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=64, state_size=16, num_hidden_layers=n_layers,
                                            expand=2, conv_kernel=4, head_dim=16, num_heads=8, n_groups=2,
                                            chunk_size=64)
        else:
            cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=16, state_size=8,
                                            num_hidden_layers=n_layers, expand=2, conv_kernel=4, head_dim=8,
                                            num_heads=4, n_groups=2, chunk_size=8)
        model = transformers.Mamba2ForCausalLM(cfg)
    model = model.double()
    with torch.no_grad():  # move every parameter off its init so each one matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def random_rows(rng: random.Random, n_rows: int, capacity: int, width: int = 4):
    """Lengths per row covering 1, shorter than the conv width, one sequence per row, a padding tail."""
    rows = []
    for r in range(n_rows):
        if r == 0:
            lens = [1, width - 2, width, capacity - (1 + width - 2 + width) - 3, 3]  # 3: a padding segment
        elif r == 1:
            lens = [capacity]
        else:
            lens, left = [], capacity
            while left > 0:
                n = min(left, rng.randint(1, capacity // 2))
                lens.append(n)
                left -= n
        rows.append(lens)
    return rows


def packed_batch(rows, capacity, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(rows), capacity), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])
    return ids, pos


def boundary_kwargs(pos, form):
    if form == "position_ids":
        return {"position_ids": pos}
    if form == "seq_idx":
        return {"seq_idx": ops.position_ids_to_seq_idx(pos)}
    cu, max_len = position_ids_to_cu_seqlens(pos)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def per_sequence_reference(model, ids, rows, weights, dtype=torch.float32, **fwd_kw):
    """Logits of each sequence run alone (as ``dtype``: transformers returns float32 logits from these models), and
    the parameter gradients of sum(logits * weights); ``fwd_kw`` go to the model's forward."""
    model.zero_grad(set_to_none=True)
    out = torch.zeros(ids.shape + weights.shape[-1:], dtype=dtype)
    for r, lens in enumerate(rows):
        s = 0
        for n in lens:
            logits = model(ids[r:r + 1, s:s + n], **fwd_kw).logits
            (logits * weights[r:r + 1, s:s + n]).sum().backward()
            out[r, s:s + n] = logits[0].detach().to(dtype)
            s += n
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def packed_run(model, ids, weights, dtype=torch.float32, **kw):
    model.zero_grad(set_to_none=True)
    logits = model(ids, **kw).logits
    (logits * weights).sum().backward()
    return logits.detach().to(dtype), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_close_all(out, ref, grads, ref_grads, grad_rtol=1e-5):
    # transformers returns float32 logits (and computes parts of the FalconMamba norms and the
    # Mamba-2 chunk scan in float32) even in a float64 model: the tolerance is float32's
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        atol = grad_rtol * ref_grads[k].abs().max().item() + 1e-9
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=grad_rtol, atol=atol,
                                   msg=lambda m: f"grad of {k}: {m}")


# the Mamba-2 reference (transformers' chunked scan, float32 inside) sums gradients over chunks in
# float32: its parameter gradients carry ~1e-5 relative rounding
# transformers 5.0's FalconMamba normalizes B / C / dt in float32 even in a float64 model: packed rows and single
# sequences round those norms in different batches. Over 401 seeds (2026-11-28, transformers 5.0.0) the largest
# gradient difference was 1.7e-6 of the largest gradient (one seed over 1e-6, the next 6.3e-7; transformers 5.24:
# 6.5e-8 at that seed); a leak across a boundary is of the order of the gradient itself
GRAD_RTOL = {"mamba": 1e-6, "falcon_mamba": 1e-5, "mamba2": 2e-4}


@pytest.mark.parametrize("form", ["position_ids", "seq_idx", "cu_seq_lens_q"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_per_sequence_runs(seed, family, form):
    rng = random.Random(seed)
    model = make_model(family, seed=seed).train()
    original = copy.deepcopy(model)
    capacity = 24
    rows = random_rows(rng, 3, capacity)
    ids, pos = packed_batch(rows, capacity, seed)
    weights = torch.randn(ids.shape + (VOCAB,), generator=torch.Generator().manual_seed(seed))
    ref, ref_grads = per_sequence_reference(original, ids, rows, weights)
    assert ops.enable_packing(model) is model
    out, grads = packed_run(model, ids, weights, **boundary_kwargs(pos, form))
    assert_close_all(out, ref, grads, ref_grads, GRAD_RTOL[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_mode_and_gradient_checkpointing(seed, family):
    """Eval (transformers would build a cache) and checkpointed training (blocks recomputed in the
    backward pass) keep the boundaries."""
    rng = random.Random(seed)
    model = make_model(family, seed=seed)
    original = copy.deepcopy(model)
    rows = random_rows(rng, 2, 16)
    ids, pos = packed_batch(rows, 16, seed)
    weights = torch.randn(ids.shape + (VOCAB,), generator=torch.Generator().manual_seed(seed))
    ref, ref_grads = per_sequence_reference(original.train(), ids, rows, weights)
    ops.enable_packing(model)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids, position_ids=pos).logits, ref, rtol=1e-5, atol=1e-6)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in model.backbone.layers)
    out, grads = packed_run(model, ids, weights, position_ids=pos)
    assert_close_all(out, ref, grads, ref_grads, GRAD_RTOL[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_check_isolation_passes_converted_and_catches_unconverted(family):
    model = make_model(family)
    rows = random_rows(random.Random(1), 2, 20)
    ids, pos = packed_batch(rows, 20, 1)
    batch = {"input_ids": ids, "position_ids": pos}
    leaky = ops.check_isolation(lambda b: model(b["input_ids"], position_ids=b["position_ids"]).logits, batch,
                                embedding=model.get_input_embeddings())
    assert not leaky.ok and leaky.max_output_change > 1e-3, leaky
    ops.enable_packing(model)
    safe = ops.check_isolation(lambda b: model(b["input_ids"], position_ids=b["position_ids"]).logits, batch,
                               embedding=model.get_input_embeddings())
    assert safe.ok, safe
    assert safe.max_output_change == 0.0 and safe.max_grad_change == 0.0
    # converting again changes nothing; a deep copy of a converted model is converted and isolates too
    assert ops.enable_packing(model) is model
    twin = copy.deepcopy(model)
    assert twin.backbone.layers[0]._packloader_slot is twin._packloader_slot is not model._packloader_slot
    again = ops.check_isolation(lambda b: twin(b["input_ids"], position_ids=b["position_ids"]).logits, batch,
                                embedding=twin.get_input_embeddings())
    assert again.ok, again


@pytest.mark.parametrize("family", FAMILIES)
def test_without_boundaries_nothing_changes_and_state_dict_is_kept(family, tmp_path):
    model = make_model(family)
    original = copy.deepcopy(model)
    params_before = {k: p for k, p in model.named_parameters()}
    keys_before = list(model.state_dict().keys())
    ops.enable_packing(model)
    assert {k: p for k, p in model.named_parameters()} == params_before  # same objects, same names
    assert list(model.state_dict().keys()) == keys_before
    ids = torch.randint(1, VOCAB, (2, 11))
    for mode in ("train", "eval"):
        getattr(model, mode)(), getattr(original, mode)()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, original(ids).logits)
    # a converted model saves a checkpoint the plain class loads
    model.save_pretrained(tmp_path)
    reloaded = type(original).from_pretrained(tmp_path, dtype=torch.float64)
    assert type(reloaded) is type(original)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids).logits, original.eval()(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_unchanged(family):
    model = make_model(family).eval()
    original = copy.deepcopy(model)
    prompt = torch.randint(1, VOCAB, (2, 5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = original.generate(prompt, **kw)
    ops.enable_packing(model)
    assert torch.equal(model.generate(prompt, **kw), expected)
    assert torch.equal(model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw), expected)


def test_backbone_alone_and_loss_with_labels(seed):
    model = make_model("mamba", seed=seed)
    original = copy.deepcopy(model)
    rows = [[5, 2, 9], [16]]
    ids, pos = packed_batch(rows, 16, seed)
    ops.enable_packing(model.backbone)  # a MambaModel on its own
    h = model.backbone(ids, position_ids=pos).last_hidden_state
    s = 0
    for n in rows[0]:
        # transformers' own slow path runs parts of the scan in float32 (5.0 casts the scan inputs), so the float64
        # model is compared at float32 tolerance, as everywhere in this file
        torch.testing.assert_close(h[0, s:s + n], original.backbone(ids[:1, s:s + n]).last_hidden_state[0],
                                   rtol=1e-5, atol=1e-6)
        s += n
    # the whole model: labels work and no label crosses a boundary (the loader's -100 at every start)
    ops.enable_packing(model)
    labels = ids.clone()
    labels[pos == 0] = -100
    loss = model(ids, position_ids=pos, labels=labels).loss
    logits = model(ids, position_ids=pos).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_mask_of_ones_changes_nothing(family, seed):
    """A collator's all-ones attention_mask sends Mamba-1 through the composed (masking) path."""
    model = ops.enable_packing(make_model(family, seed=seed))
    rows = [[3, 1, 12], [9, 7]]
    ids, pos = packed_batch(rows, 16, seed)
    with torch.no_grad():
        plain = model(ids, position_ids=pos).logits
        masked = model(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(masked, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_autocast_bf16(family):
    """Trainer's bf16=True on a CPU (TRL's default) runs under CPU autocast: the converted model trains
    there, still isolating the packed sequences."""
    model = ops.enable_packing(make_model(family).float())
    rows = random_rows(random.Random(2), 2, 16)
    ids, pos = packed_batch(rows, 16, 2)

    def fn(b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(b["input_ids"], position_ids=b["position_ids"]).logits.float()

    report = ops.check_isolation(fn, {"input_ids": ids, "position_ids": pos}, embedding=model.get_input_embeddings())
    assert report.ok, report


def test_errors_are_clear():
    model = make_model("mamba")
    ops.enable_packing(model)
    ids = torch.randint(1, VOCAB, (1, 8))
    bad = torch.tensor([[0, 1, 2, 4, 0, 1, 2, 3]])
    with pytest.raises(BoundaryError):
        model(ids, position_ids=bad)
    good = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="use_cache"):
        model(ids, position_ids=good, use_cache=True)


def test_unsupported_hybrid_refused_unchanged():
    """Jamba's SSM layers are Mamba-1 mixers of its own class: refused, naming them (the Mamba-2 hybrids are
    converted: tests/ops/test_hf_hybrids.py)."""
    cfg = transformers.JambaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, attn_layer_period=2,
                                   attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=1,
                                   mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
    model = transformers.JambaForCausalLM(cfg)
    cls_before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(NotImplementedError, match=r"JambaForCausalLM is not supported.*JambaMambaMixer.*attention"):
        ops.enable_packing(model)
    assert {n: type(m) for n, m in model.named_modules()} == cls_before


def test_import_ops_does_not_import_transformers():
    import subprocess
    import sys

    code = "import ops, packloader, sys; ops.enable_packing; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------------
# GPU: the converted model on CUDA against per-sequence runs


def _cuda_model(family, dtype):
    model = make_model(family, gpu_sizes=True).to(device="cuda", dtype=dtype)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("family,dtype", [("mamba", torch.float32), ("mamba", torch.bfloat16),
                                          ("falcon_mamba", torch.float32), ("mamba2", torch.float32)])
def test_gpu_packed_equals_per_sequence(family, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = _cuda_model(family, dtype).train()
    original = copy.deepcopy(model)
    rows = [[1, 3, 4, 40, 16], [64], [30, 2, 17, 15]]
    ids, pos = packed_batch(rows, 64, 0)
    ids, pos = ids.cuda(), pos.cuda()
    weights = torch.randn(ids.shape + (VOCAB,), device="cuda", dtype=torch.float32)
    original.zero_grad(set_to_none=True)
    ref = torch.zeros(ids.shape + (VOCAB,), device="cuda")
    for r, lens in enumerate(rows):
        s = 0
        for n in lens:
            logits = original(ids[r:r + 1, s:s + n]).logits.float()
            (logits * weights[r:r + 1, s:s + n]).sum().backward()
            ref[r, s:s + n] = logits[0].detach()
            s += n
    ref_grads = {k: p.grad.float() for k, p in original.named_parameters() if p.grad is not None}
    if family == "falcon_mamba":
        # transformers trains FalconMamba on CUDA through mamba-ssm's mamba_inner_fn, whose backward treats the RMS
        # norms of dt, B and C as the identity (their Jacobians are missing: its gradients are not those of its own
        # forward). The forward must match it; the gradients are checked against exact autograd of the same function:
        # the converted model run on each sequence alone.
        alone = copy.deepcopy(model)
        ops.enable_packing(alone)
        alone.zero_grad(set_to_none=True)
        for r, lens in enumerate(rows):
            s = 0
            for n in lens:
                seq_pos = torch.arange(n, device="cuda")[None]
                out = alone(ids[r:r + 1, s:s + n], position_ids=seq_pos).logits.float()
                (out * weights[r:r + 1, s:s + n]).sum().backward()
                s += n
        ref_grads = {k: p.grad.float() for k, p in alone.named_parameters() if p.grad is not None}
    ops.enable_packing(model)
    model.zero_grad(set_to_none=True)
    logits = model(ids, position_ids=pos).logits.float()
    (logits * weights).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(logits.detach(), ref, **tol)
    for k, p in model.named_parameters():
        g, rg = p.grad.float(), ref_grads[k]
        scale = rg.abs().max().clamp_min(1e-6)
        assert ((g - rg).abs().max() / scale).item() < (5e-2 if dtype == torch.bfloat16 else 5e-3), k
    report = ops.check_isolation(lambda b: model(b["input_ids"], position_ids=b["position_ids"]).logits,
                                 {"input_ids": ids, "position_ids": pos}, embedding=model.get_input_embeddings(),
                                 # backward kernels that add with atomics vary in their last bits; mamba-ssm's
                                 # Mamba-2 chunk scan rounds across boundaries (~3e-5 relative); a leak is O(1)
                                 atol=1e-3 if family == "mamba2" else 1e-5)
    assert report.ok, report


def test_bench_hf_quick_smoke(tmp_path):
    """benchmarks/bench_hf.py --quick runs on the CPU and writes its JSON (the numbers are a GPU matter)."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_hf.py")
    spec = importlib.util.spec_from_file_location("bench_hf", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--quick", "--out", str(tmp_path / "hf.json")])
    assert [r["variant"] for r in out["results"]] == ["hf rows, no boundaries", "hf padded", "packed"]
    saved = json.loads((tmp_path / "hf.json").read_text())
    assert saved["real_tokens"] == sum(map(sum, saved["rows"])) > 0
    assert all(r["real_tokens_per_s"] > 0 for r in saved["results"])


def test_mamba_carries_the_state_between_rows_and_steps():
    """MambaForCausalLM converted: with the carry keys of overflow='carry' in its kwargs, a document cut across two
    rows of one step and a third piece in the next step gives the whole document's logits, and its weight gradients
    in the first step (the state cache lives on the model); FalconMamba's norms and Mamba-2 refuse continuations."""
    model = make_model("mamba").double()
    ops.enable_packing(model)
    ids = torch.randint(0, VOCAB, (3, 12))
    doc = torch.cat([ids[0, 4:], ids[1], ids[2, :5]])
    whole = model(doc[None], position_ids=torch.arange(25)[None]).logits[0]
    params = list(model.parameters())
    want = torch.autograd.grad(whole[:20].square().sum(), params)
    keys1 = dict(piece_doc_ids=torch.tensor([-1, 7, 7]), piece_index=torch.tensor([0, 0, 1]),
                 has_initial_state=torch.tensor([False, False, True]),
                 continues_after=torch.tensor([False, True, True]))
    pos1 = torch.stack([torch.cat([torch.arange(4), torch.arange(8)]), torch.arange(12)])
    out = model(ids[:2], position_ids=pos1, **keys1).logits
    got_doc = torch.cat([out[0, 4:], out[1]])
    torch.testing.assert_close(got_doc, whole[:20], rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(got_doc.square().sum(), params)
    for (name, _), x, y in zip(model.named_parameters(), got, want):
        # A, D and the dt bias enter the packed ops in float32 in both paths (as transformers' mixer takes them)
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-8, msg=name)
    keys2 = dict(piece_doc_ids=torch.tensor([7, -1]), piece_index=torch.tensor([2, 0]),
                 has_initial_state=torch.tensor([True, False]), continues_after=torch.tensor([False, False]))
    pos2 = torch.cat([torch.arange(5), torch.arange(7)])[None]
    out2 = model(ids[2:], position_ids=pos2, **keys2).logits
    torch.testing.assert_close(out2[0, :5], whole[20:], rtol=1e-10, atol=1e-10)
    for family in ("falcon_mamba", "mamba2"):
        other = make_model(family)
        ops.enable_packing(other)
        with pytest.raises(ops.CarryError):
            other(ids[:2], position_ids=pos1, **keys1)
