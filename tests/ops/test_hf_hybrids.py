"""ops.enable_packing on transformers' hybrid SSM / attention models (Bamba, NemotronH, GraniteMoeHybrid,
FalconH1, Zamba2), tiny random configs in float64 with at least one attention layer each: the Mamba-2
mixers are converted, the attention layers are left to transformers' packed attention.

- a packed row gives every sequence the logits and every parameter the gradient that running each
  sequence alone through the unconverted model gives (position_ids, seq_idx or cu_seq_lens_q);
- ops.check_isolation passes on the converted model and catches the unconverted one;
- the verdict on the attention implementation (``ops.hf._attention_gap``) is checked against what the
  attention really does, in whichever transformers version runs: where packloader says it isolates, the
  converted model passes check_isolation; where it says it does not, enable_packing refuses (changing
  nothing) and, under allow_unprotected_attention=True, converts, warns and check_isolation sees the leak;
- parameter names, state_dict, outputs without boundaries and greedy generation are unchanged;
- gradient checkpointing (nested in Zamba2's hybrid layers) replays the boundaries.
"""
from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')", exc_type=ImportError
)

import ops  # noqa: E402
from ops import hf as ops_hf  # noqa: E402
from ops.boundaries import position_ids_to_cu_seqlens  # noqa: E402

from .test_hf import packed_run, per_sequence_reference  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 48
FAMILIES = ["bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2"]
_CONFIGS = {"bamba": "BambaConfig", "nemotron_h": "NemotronHConfig", "granitemoehybrid": "GraniteMoeHybridConfig",
            "falcon_h1": "FalconH1Config", "zamba2": "Zamba2Config"}


def make_hybrid(family: str, attn: str = "sdpa", *, seed: int = 0, attention: bool = True, gpu_sizes: bool = False):
    """A tiny random hybrid with SSM layers and (``attention=True``) at least one attention layer.

    ``gpu_sizes``: widths mamba-ssm's Triton kernels take (state 16, head dim 16, chunk 64)."""
    if not hasattr(transformers, _CONFIGS[family]):
        pytest.skip(f"transformers {transformers.__version__} has no {_CONFIGS[family]}")
    torch.manual_seed(seed)
    h, heads, hd, st, chunk = (64, 8, 16, 16, 64) if gpu_sizes else (16, 4, 8, 8, 8)
    common = dict(vocab_size=VOCAB, hidden_size=h, num_attention_heads=2, num_key_value_heads=1,
                  attn_implementation=attn)
    mamba = dict(mamba_n_heads=heads, mamba_d_head=hd, mamba_d_state=st, mamba_n_groups=2, mamba_chunk_size=chunk,
                 mamba_expand=2)
    if family == "bamba":
        cfg = transformers.BambaConfig(**common, **mamba, intermediate_size=2 * h, num_hidden_layers=3,
                                       attn_layer_indices=[1] if attention else [])
        model = transformers.BambaForCausalLM(cfg)
    elif family == "nemotron_h":
        blocks = ["mamba", "attention", "mlp", "mamba"] if attention else ["mamba", "mlp", "mamba"]
        cfg = transformers.NemotronHConfig(**common, layers_block_type=blocks, intermediate_size=2 * h,
                                           ssm_state_size=st, mamba_num_heads=heads, mamba_head_dim=hd, n_groups=2,
                                           chunk_size=chunk, head_dim=h // 2)
        model = transformers.NemotronHForCausalLM(cfg)
    elif family == "granitemoehybrid":
        types = ["mamba", "attention", "mamba"] if attention else ["mamba", "mamba"]
        cfg = transformers.GraniteMoeHybridConfig(**common, **mamba, intermediate_size=2 * h,
                                                  num_hidden_layers=len(types), layer_types=types,
                                                  num_local_experts=0, shared_intermediate_size=2 * h,
                                                  position_embedding_type="rope")
        model = transformers.GraniteMoeHybridForCausalLM(cfg)
    elif family == "falcon_h1":  # every layer holds attention and a mixer side by side
        if not attention:
            pytest.skip("every FalconH1 layer has attention")
        cfg = transformers.FalconH1Config(**common, **mamba, mamba_d_ssm=heads * hd, intermediate_size=2 * h,
                                          num_hidden_layers=2, mamba_rms_norm=True)
        model = transformers.FalconH1ForCausalLM(cfg)
    else:
        types = ["mamba", "hybrid", "mamba"] if attention else ["mamba", "mamba"]
        # one chunk per test sequence: transformers 5.0's Zamba2 PyTorch scan is wrong across chunks (its result
        # with 8-token chunks differs from its own one-chunk result by 1.5e-4 here; the converted mixer is exact)
        cfg = transformers.Zamba2Config(**common, num_hidden_layers=len(types), layers_block_type=types,
                                        mamba_d_state=st, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=heads,
                                        chunk_size=max(chunk, 32), intermediate_size=2 * h, num_mem_blocks=1,
                                        use_mem_rope=True)
        model = transformers.Zamba2ForCausalLM(cfg)
    model = model.double()
    with torch.no_grad():  # move every parameter off its init so each one matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def protected(model) -> bool:
    """packloader's verdict: does transformers' attention in ``model`` isolate packed rows?"""
    return ops_hf._attention_gap(ops_hf._hybrid_backbone(model), ops_hf._attn_implementation(model)) is None


def packed_batch(rows, capacity, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(rows), capacity), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])
    return ids, pos


# lengths 1, shorter than the conv width, one sequence per row, more than one chunk (8), a 3-token tail
ROWS = [[1, 2, 4, 10, 3], [20], [7, 9, 4]]


def assert_matches(out, ref, grads, ref_grads):
    # transformers' chunked Mamba-2 scan computes in float32 even in a float64 model: float32 tolerances
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        atol = 2e-4 * ref_grads[k].abs().max().item() + 1e-9
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=2e-4, atol=atol, msg=lambda m: f"grad of {k}: {m}")


def boundary_kwargs(pos, form):
    if form == "position_ids":
        return {"position_ids": pos}
    if form == "seq_idx":
        return {"seq_idx": ops.position_ids_to_seq_idx(pos)}
    cu, max_len = position_ids_to_cu_seqlens(pos)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def isolation(model, ids, pos):
    return ops.check_isolation(lambda b: model(b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits,
                               {"input_ids": ids, "position_ids": pos}, embedding=model.get_input_embeddings())


def _convertible(family, attention=True):
    """A model whose attention (if any) transformers isolates in this version; where it does not (see
    test_attention_verdict), the same model without attention layers, so the SSM conversion is still checked."""
    model = make_hybrid(family, attention=attention)
    if attention and not protected(model):
        return make_hybrid(family, attention=False)
    return model


@pytest.mark.parametrize("family,form", [(f, "position_ids") for f in FAMILIES]
                         + [("bamba", "seq_idx"), ("zamba2", "cu_seq_lens_q")])
def test_packed_rows_equal_per_sequence_runs(family, form, seed):
    model = _convertible(family).train()
    original = copy.deepcopy(model)
    ids, pos = packed_batch(ROWS, 20, seed)
    weights = torch.randn(ids.shape + (VOCAB,), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref, ref_grads = per_sequence_reference(original, ids, ROWS, weights, torch.float64, use_cache=False)
    assert ops.enable_packing(model) is model
    assert model._packloader_conversion["mamba2"] and not model._packloader_conversion["left_unsafe"]
    out, grads = packed_run(model, ids, weights, torch.float64, **boundary_kwargs(pos, form))
    assert_matches(out, ref, grads, ref_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_check_isolation_passes_converted_and_catches_unconverted(family):
    model = _convertible(family)
    ids, pos = packed_batch(ROWS, 20, 1)
    leaky = isolation(model, ids, pos)  # the unconverted mixers ignore position_ids
    assert not leaky.ok and leaky.max_output_change > 1e-3, leaky
    ops.enable_packing(model)
    safe = isolation(model, ids, pos)
    assert safe.ok, safe
    assert safe.max_output_change == 0.0 and safe.max_grad_change == 0.0
    assert ops.enable_packing(model) is model  # converting again changes nothing
    twin = copy.deepcopy(model)  # a deep copy is converted, with its own boundary slot
    assert twin._packloader_slot is not model._packloader_slot
    assert isolation(twin, ids, pos).ok


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_attention_verdict(family, attn):
    """packloader's verdict on transformers' attention is what the attention does: protected -> the
    converted model isolates; unprotected -> refused unchanged, and with the flag converted, warned about
    and leaking (through attention only: the SSM layers are converted)."""
    model = make_hybrid(family, attn)
    ids, pos = packed_batch(ROWS, 20, 2)
    if protected(model):
        ops.enable_packing(model)
        assert isolation(model, ids, pos).ok
        return
    classes = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(NotImplementedError, match=rf"attention layers .*attn_implementation='{attn}'"):
        ops.enable_packing(model)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    with pytest.warns(UserWarning, match="remain unprotected"):
        ops.enable_packing(model, allow_unprotected_attention=True)
    assert model._packloader_conversion["left_unsafe"]
    report = isolation(model, ids, pos)
    assert not report.ok and report.max_output_change > 1e-3, report


@pytest.mark.parametrize("family", FAMILIES)
def test_names_state_dict_no_boundaries_and_generation_unchanged(family, tmp_path):
    model = make_hybrid(family).eval()
    original = copy.deepcopy(model)
    params = dict(model.named_parameters())
    keys = list(model.state_dict().keys())
    prompt = torch.randint(1, VOCAB, (2, 5))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = original.generate(prompt, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ops.enable_packing(model, allow_unprotected_attention=True)
    assert dict(model.named_parameters()) == params and list(model.state_dict().keys()) == keys
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
    assert torch.equal(model.generate(prompt, **kw), expected)
    assert torch.equal(model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw), expected)
    # a converted model saves a checkpoint the plain class loads: the same tensors as the original's checkpoint, and
    # the same logits as the original reloaded the same way (a reloaded config carries dtype float64, with which
    # transformers may round differently, by one float64 ulp, from the model built in memory)
    model.save_pretrained(tmp_path / "converted")
    original.save_pretrained(tmp_path / "original")
    reloaded = type(original).from_pretrained(tmp_path / "converted", dtype=torch.float64).eval()
    baseline = type(original).from_pretrained(tmp_path / "original", dtype=torch.float64).eval()
    assert type(reloaded) is type(original)
    got, want = reloaded.state_dict(), original.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, baseline(ids).logits)
        torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["bamba", "zamba2"])
def test_gradient_checkpointing_and_eval(family, seed):
    """Checkpointed layers (Zamba2's nested in its hybrid layers) replay the boundaries in the backward
    pass; an eval forward (where transformers would build a cache) keeps them."""
    model = _convertible(family)
    original = copy.deepcopy(model)
    ids, pos = packed_batch(ROWS[:2], 20, seed)
    weights = torch.randn(ids.shape + (VOCAB,), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref, ref_grads = per_sequence_reference(original.train(), ids, ROWS[:2], weights, torch.float64,
                                             use_cache=False)
    ops.enable_packing(model)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids, position_ids=pos).logits.double(), ref, rtol=1e-5, atol=1e-5)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    out, grads = packed_run(model, ids, weights, torch.float64, position_ids=pos)
    assert_matches(out, ref, grads, ref_grads)


def test_cpu_autocast_bf16_and_loss():
    """Trainer's bf16=True on a CPU runs under CPU autocast: the converted hybrid still isolates; labels give
    transformers' loss over the packed row."""
    model = ops.enable_packing(_convertible("bamba").float())
    ids, pos = packed_batch(ROWS, 20, 5)

    def fn(b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(b["input_ids"], position_ids=b["position_ids"]).logits.float()

    report = ops.check_isolation(fn, {"input_ids": ids, "position_ids": pos}, embedding=model.get_input_embeddings())
    assert report.ok, report
    labels = ids.clone()
    labels[pos == 0] = -100
    out = model(ids, position_ids=pos, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(),
                                                 labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


def test_attention_mask_and_cache_errors():
    model = ops.enable_packing(_convertible("bamba"))
    ids, pos = packed_batch(ROWS, 20, 3)
    with torch.no_grad():
        plain = model(ids, position_ids=pos).logits
        ones = model(ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
        torch.testing.assert_close(ones, plain, rtol=0, atol=0)  # an all-ones mask is dropped, packing kept
        padded = torch.ones_like(ids)
        padded[0, -3:] = 0
        with pytest.raises(ValueError, match="padding attention_mask"):
            model(ids, position_ids=pos, attention_mask=padded)
        with pytest.raises(ValueError, match="use_cache"):
            model(ids, seq_idx=ops.position_ids_to_seq_idx(pos), use_cache=True)
        with pytest.raises(ValueError, match="restarting within a row"):
            model(ids, position_ids=pos, use_cache=True)
        # one sequence per row with a cache (a prefill): transformers' own path, as unconverted
        row = torch.arange(20)[None].expand(3, -1)
        torch.testing.assert_close(model(ids, position_ids=row, use_cache=True).logits,
                                   model(ids, position_ids=row).logits, rtol=1e-5, atol=1e-5)


def _varlen_attention_double(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """A CPU stand-in for transformers' flash_attention_2 on an unpadded batch, doing what the kernel does
    with the keyword arguments it is handed: causal attention within each cu_seq_lens_q segment of the
    flattened rows when they are given (flash_attn_varlen_func), over each whole row when not (flash_attn_func
    with batch > 1 ignores position_ids). query (b, heads, l, d); key / value (b, kv_heads, l, d)."""
    assert attention_mask is None  # no padding: transformers' flash mask is None
    b, heads, length, _ = query.shape
    key = key.repeat_interleave(heads // key.shape[1], dim=1)
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
    if cu_seq_lens_q is not None:
        assert max_length_q is not None
        token = torch.arange(b * length, device=query.device)
        seg = (torch.searchsorted(cu_seq_lens_q[1:].to(token.dtype), token, right=True)).view(b, length)
    else:
        seg = torch.zeros(b, length, dtype=torch.long, device=query.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    allowed = causal[None] & (seg[:, :, None] == seg[:, None, :])  # (b, l, l)
    scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("family", FAMILIES)
def test_flash_attention_gets_varlen_kwargs(family, monkeypatch):
    """flash_attention_2 (here a CPU double of the kernel; the real one runs in the GPU test): the converted
    model hands every attention layer cu_seq_lens_q/k + max_length_q/k, so packed rows are isolated with
    batch > 1 and in GraniteMoeHybrid (whose attention never sees position_ids); without them they leak."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", _varlen_attention_double)
    model = make_hybrid(family)
    model.config._attn_implementation = "flash_attention_2"  # set after init: flash-attn is not installed here
    assert protected(model)
    ids, pos = packed_batch(ROWS, 20, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ops.enable_packing(model)
    assert not model._packloader_conversion["left_unsafe"]
    assert isolation(model, ids, pos).ok
    # checkpointed layers (attention-only ones included) replay the varlen kwargs in the backward pass
    model.train().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert isolation(model, ids, pos).ok
    # the kernel without those kwargs (as transformers would call it given position_ids on several rows):
    # the same converted model leaks through its attention
    varlen = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

    def without_varlen(*args, **kwargs):
        return _varlen_attention_double(*args, **{k: v for k, v in kwargs.items() if k not in varlen})

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", without_varlen)
    leaky = isolation(model, ids, pos)
    assert not leaky.ok and leaky.max_output_change > 1e-3, leaky


# --------------------------------------------------------------------------------------------------
# GPU: the same on CUDA (mamba-ssm's kernels serve the mixers where installed, packloader's ops otherwise)


def _flash_attn_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


@pytest.mark.gpu
@pytest.mark.parametrize("family,attn", [("bamba", "sdpa"), ("zamba2", "sdpa"), ("nemotron_h", "sdpa"),
                                         ("falcon_h1", "sdpa"), ("bamba", "flash_attention_2"),
                                         ("granitemoehybrid", "flash_attention_2")])
def test_gpu_packed_equals_per_sequence(family, attn, cuda):
    if attn == "flash_attention_2" and not _flash_attn_available():
        pytest.skip("flash-attn is not installed")
    dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32  # flash-attn takes 16-bit inputs
    model = make_hybrid(family, "sdpa", gpu_sizes=True).to(device=cuda, dtype=dtype).train()
    if attn != "sdpa":  # set on the GPU model in its 16-bit dtype, where transformers' checks accept it
        model.set_attn_implementation(attn)
    assert ops_hf._attn_implementation(model) == attn
    if not protected(model):
        pytest.skip(f"transformers {transformers.__version__}: {family} with {attn} does not isolate packed rows")
    original = copy.deepcopy(model)
    rows = [[1, 3, 4, 40, 16], [64], [30, 2, 17, 15]]
    ids, pos = packed_batch(rows, 64, 0)
    ids, pos = ids.to(cuda), pos.to(cuda)
    weights = torch.randn(ids.shape + (VOCAB,), device=cuda, dtype=torch.float32)
    original.zero_grad(set_to_none=True)
    ref = torch.zeros(ids.shape + (VOCAB,), device=cuda)
    for r, lens in enumerate(rows):
        s = 0
        for n in lens:
            logits = original(ids[r:r + 1, s:s + n], use_cache=False).logits.float()
            (logits * weights[r:r + 1, s:s + n]).sum().backward()
            ref[r, s:s + n] = logits[0].detach()
            s += n
    ref_grads = {k: p.grad.float() for k, p in original.named_parameters() if p.grad is not None}
    low = dtype == torch.bfloat16

    def isolation_report():
        # mamba-ssm's chunk scan rounds across boundaries (~3e-5 relative, a bfloat16 ulp at worst) and
        # backward kernels add with atomics; a leak here is O(0.1-1)
        return ops.check_isolation(lambda b: model(b["input_ids"], position_ids=b["position_ids"]).logits,
                                   {"input_ids": ids, "position_ids": pos}, embedding=model.get_input_embeddings(),
                                   atol=2e-2 if low else 1e-3)

    leaky = isolation_report()  # unconverted: the mixers (and flash attention on several rows) mix sequences
    assert not leaky.ok, leaky
    ops.enable_packing(model)
    model.zero_grad(set_to_none=True)
    logits = model(ids, position_ids=pos).logits.float()
    (logits * weights).sum().backward()
    tol = dict(rtol=3e-2, atol=3e-2) if low else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(logits.detach(), ref, **tol)
    for k, p in model.named_parameters():
        g, rg = p.grad.float(), ref_grads[k]
        scale = rg.abs().max().clamp_min(1e-6)
        assert ((g - rg).abs().max() / scale).item() < (6e-2 if low else 1e-2), k
    report = isolation_report()
    assert report.ok, report
    # generation (the cache path, mamba-ssm's state-update kernels where installed) is transformers' own
    prompt = ids[:2, :6]
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.eval().generate(prompt, **kw), original.eval().generate(prompt, **kw))


def test_hybrid_mixers_step_through_transformers_code():
    """ops.hf's fused single-token step is for transformers' Mamba / FalconMamba / Mamba2 mixers only: a hybrid's
    Mamba-2 mixer on a filled cache gets no fused states (its step is transformers' own), nor does a Mamba-2 mixer
    whose conv runs under accelerate's hooks."""
    model = ops.enable_packing(make_hybrid("bamba").eval(), allow_unprotected_attention=True)   # the mixers only
    with torch.no_grad():
        out = model(input_ids=torch.randint(1, VOCAB, (2, 5)), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or getattr(out, "cache_params", None)
    if not (hasattr(cache, "has_previous_state") and hasattr(cache, "layers")):
        pytest.skip("this transformers version's hybrid cache has no has_previous_state / layers API")
    mixers = [m for m in model.modules() if ops_hf._mixer_kind(m) == "hybrid"]
    assert mixers and all(ops_hf.fused_step_states(m, cache) is None for m in mixers)
    from .test_generate import hf_mamba2
    m2 = ops.enable_packing(hf_mamba2(0))
    with torch.no_grad():
        out = m2(input_ids=torch.randint(1, 16, (2, 5)), use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.cache_params
    mixer = m2.backbone.layers[0].mixer
    assert ops_hf.fused_step_states(mixer, cache) is not None
    hooked = m2.backbone.layers[1].mixer
    hooked.conv1d._hf_hook = object()   # what accelerate's add_hook_to_module sets
    assert ops_hf.fused_step_states(hooked, cache) is None
