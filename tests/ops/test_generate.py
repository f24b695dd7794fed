"""ops.generate_packed and ops.evaluate_packed (issue 33): packed prefill through the carry path and batched decoding
give each prompt's greedy tokens exactly as generating it alone (fp32); stop tokens, per-prompt lengths, seeded
sampling; per-sequence losses from packed rows equal to each sequence run alone; bad input is refused naming the
argument. mamba-ssm models through the stand-ins of tests/ops/_helpers.py (mamba-ssm's structure and signatures),
transformers' Mamba / FalconMamba through transformers itself. GPU tests at the end (marked gpu)."""
from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F

import ops
from ops.generate import _InferenceParams, _next_tokens, pack_prompts

from ._helpers import MambaLMHeadModel

VOCAB = 48


def mamba_ssm_model(seed, dtype=torch.float32, n_layer=2, d_conv=4):
    """A converted stand-in MambaLMHeadModel whose greedy continuations do not collapse at once (larger weights)."""
    torch.manual_seed(seed)
    model = MambaLMHeadModel(d_model=16, n_layer=n_layer, vocab_size=VOCAB, d_state=4, d_conv=d_conv)
    with torch.no_grad():
        model.backbone.embedding.weight.normal_(0, 1.0)
        for layer in model.backbone.layers:
            layer.mixer.out_proj.weight.mul_(3.0)
    return ops.enable_packing(model.to(dtype)).eval()


def prompts_of(lengths, seed, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def greedy_alone_plain(model, prompt, n):
    """Greedy continuation of one prompt by re-running the whole sequence, no boundaries, no cache (the plain path)."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids[None]).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt[None]])
    return ids


def greedy_alone_cached(model, prompt, n):
    """Greedy continuation of one prompt through mamba-ssm's cache (prefill with inference_params, then steps)."""
    params = _InferenceParams(len(prompt) + n, 1)
    with torch.no_grad():
        logits = model(prompt[None], inference_params=params, num_last_tokens=1).logits[:, -1]
        out = [prompt]
        for t in range(n):
            nxt = logits.argmax(-1)
            out.append(nxt)
            params.seqlen_offset = len(prompt) + t
            logits = model(nxt[:, None], inference_params=params, num_last_tokens=1).logits[:, -1]
    return torch.cat(out)


LENGTHS = [5, 1, 2, 9, 3, 12, 4, 7]          # 1 and 2: shorter than the conv's state (d_conv - 1 = 3)


@pytest.mark.parametrize("capacity,batch_size,prefill_tokens", [(12, None, None), (16, 3, 16), (None, None, None)])
def test_mamba_ssm_greedy_equals_one_by_one(seed, capacity, batch_size, prefill_tokens):
    """Several rows, several prefill forwards (prefill_tokens), decode batches of 3: every prompt's tokens are those of
    generating it alone, by the plain path (whole sequence re-run) and by mamba-ssm's cache path."""
    model = mamba_ssm_model(seed)
    prompts = prompts_of(LENGTHS, seed)
    n_new = 7
    out = ops.generate_packed(model, prompts, n_new, capacity=capacity, batch_size=batch_size,
                              prefill_tokens=prefill_tokens)
    assert len(out) == len(prompts)
    for i, (p, o) in enumerate(zip(prompts, out)):
        assert o.dtype == torch.int64 and o.dim() == 1
        assert torch.equal(o[:len(p)], p)
        assert o.tolist() == greedy_alone_plain(model, p, n_new).tolist(), f"prompt {i} (length {len(p)})"
        assert o.tolist() == greedy_alone_cached(model, p, n_new).tolist(), f"prompt {i} (length {len(p)})"
    # the outputs are not degenerate: the test could fail
    assert len({tuple(o[len(p):].tolist()) for p, o in zip(prompts, out)}) > 2


def test_mamba_ssm_float64_and_conv_width_2(seed):
    """float64 model, d_conv = 2 (a one-column conv state) and d_conv = 3."""
    for d_conv in (2, 3):
        model = mamba_ssm_model(seed, torch.float64, d_conv=d_conv)
        prompts = prompts_of([3, 1, 6, 2], seed + d_conv)
        out = ops.generate_packed(model, prompts, 5, capacity=8)
        for p, o in zip(prompts, out):
            assert o.tolist() == greedy_alone_plain(model, p, 5).tolist()


def test_states_for_every_layer_and_the_conv_convention(seed):
    """The packed prefill's states, as the decode cache holds them, equal mamba-ssm's own prefill of each prompt
    alone: conv (d_inner, d_conv) whose last d_conv - 1 columns are the prompt's last inputs, ssm (d_inner, d_state);
    every layer."""
    from ops.generate import _MambaSSMDecoder, _family, _prefill
    model = mamba_ssm_model(seed, torch.float64, n_layer=3)
    prompts = prompts_of([1, 2, 3, 5], seed)
    fam = _family(model)
    # rows of 9 lay the prompts out as [3, 2, 0] [1] (a permutation that is not its own inverse): the logits and
    # states come back in the prompts' order all the same
    assert pack_prompts([len(p) for p in prompts], 9) == [[3, 2, 0], [1]]
    with torch.no_grad():
        got_logits, states = _prefill(model, fam, prompts, [0, 1, 2, 3], 9, 64, "bfd", torch.device("cpu"))
    dec = _MambaSSMDecoder(model, fam, states, 32)
    for i, p in enumerate(prompts):
        params = _InferenceParams(16, 1)
        with torch.no_grad():
            logits = model(p[None], inference_params=params, num_last_tokens=1).logits[0, -1]
        torch.testing.assert_close(got_logits[i], logits, rtol=1e-10, atol=1e-12)
        assert sorted(params.key_value_memory_dict) == [m.layer_idx for m in fam.mixers]
        for layer, (conv, ssm) in params.key_value_memory_dict.items():
            mine_conv, mine_ssm = dec.params.key_value_memory_dict[layer]
            # mamba-ssm keeps the last d_conv inputs; a decode step drops the first column before it reads
            torch.testing.assert_close(mine_conv[i, :, 1:], conv[0, :, 1:], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(mine_ssm[i], ssm[0], rtol=1e-10, atol=1e-12)


def test_stop_tokens_and_per_prompt_lengths(seed):
    model = mamba_ssm_model(seed)
    prompts = prompts_of([6, 2, 9, 4], seed)
    budgets = [5, 0, 8, 1]
    free = ops.generate_packed(model, prompts, budgets, capacity=12)
    for p, o, b in zip(prompts, free, budgets):
        assert len(o) == len(p) + b
        assert o.tolist() == greedy_alone_plain(model, p, b).tolist()
    # two in flight: prompts that stop make room for the waiting ones (prefilled, then appended to the batch)
    for bs in (1, 2):
        assert all(torch.equal(x, y) for x, y in zip(ops.generate_packed(model, prompts, budgets, capacity=12,
                                                                           batch_size=bs), free))
    # a stop token: the first new token of prompt 2's free run at step 3; every prompt stops at its first occurrence
    stop = int(free[2][len(prompts[2]) + 3])
    out = ops.generate_packed(model, prompts, budgets, capacity=12, stop_token_ids=[stop])
    out_eos = ops.generate_packed(model, prompts, budgets, capacity=12, eos_token_id=stop)
    for p, o, f, oe in zip(prompts, out, free, out_eos):
        new = f[len(p):].tolist()
        want = new[:new.index(stop) + 1] if stop in new else new
        assert o[len(p):].tolist() == want
        assert torch.equal(o, oe)
    assert len(out[2]) <= len(prompts[2]) + 4


def slots_on_the_cpu(monkeypatch):
    """cuda_graph=True's fixed-row decoder without the capture: the CPU runs its bookkeeping eagerly."""
    import ops.generate as gen
    monkeypatch.setattr(gen, "_check_cuda_graph", lambda fam, device: None)


@pytest.mark.parametrize("batch_size", [None, 1, 2, 3])
def test_fixed_rows_decoder_gives_the_same_tokens(seed, monkeypatch, batch_size):
    """cuda_graph=True decodes in fixed rows (free rows refilled, every row stepped): the same tokens as the compacting
    decoder and as each prompt alone, with per-prompt lengths (0 and 1 included), stop tokens and refills."""
    slots_on_the_cpu(monkeypatch)
    model = mamba_ssm_model(seed)
    prompts = prompts_of([6, 2, 9, 4, 1, 5, 3], seed)
    budgets = [5, 0, 8, 1, 6, 2, 7]
    eager = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size)
    fixed = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size, cuda_graph=True)
    for p, e, f, b in zip(prompts, eager, fixed, budgets):
        assert len(f) == len(p) + b
        assert f.tolist() == e.tolist() == greedy_alone_plain(model, p, b).tolist()
    stop = int(eager[2][len(prompts[2]) + 3])
    e = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size, stop_token_ids=[stop])
    f = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size, stop_token_ids=[stop],
                            cuda_graph=True)
    assert [x.tolist() for x in f] == [x.tolist() for x in e]
    for p, o, full in zip(prompts, f, eager):
        new = full[len(p):].tolist()
        assert o[len(p):].tolist() == (new[:new.index(stop) + 1] if stop in new else new)


@pytest.mark.parametrize("prefill_tokens", [None, 3])
def test_graphed_prefill_layouts(seed, monkeypatch, prefill_tokens):
    """cuda_graph=True's prefill runs on fixed buffers: rows padded to a power-of-two count, the slots no prompt takes
    in scratch rows of one-token segments (here 7 slots over rows of 3 tokens: three scratch rows), and with
    prefill_tokens=3 one row a forward (a refill of several groups). Each prompt's tokens are its tokens alone."""
    slots_on_the_cpu(monkeypatch)
    model = mamba_ssm_model(seed)
    prompts = prompts_of([2, 1, 3, 2, 1, 3, 2, 3, 1], seed)
    budgets = [4, 3, 1, 5, 2, 6, 3, 2, 4]
    for batch_size in (None, 4):
        out = ops.generate_packed(model, prompts, budgets, capacity=3, batch_size=batch_size,
                                  prefill_tokens=prefill_tokens, cuda_graph=True)
        for p, o, b in zip(prompts, out, budgets):
            assert o.tolist() == greedy_alone_plain(model, p, b).tolist()


def test_graphed_prefill_equals_the_eager_prefill(seed):
    """The fixed-buffer prefill (run eagerly here) gives the eager packed prefill's logits and every layer's states,
    in the prompts' order: fewer prompts than slots, a one-token prompt first in a row, rows padded to the graph's
    row count, scratch rows, and more rows than one forward takes."""
    from ops.generate import _PrefillGraphs, _family, _prefill
    model = mamba_ssm_model(seed, torch.float64, n_layer=2)
    fam = _family(model)
    prompts = prompts_of([1, 3, 2, 1, 3, 2], seed)
    cpu = torch.device("cpu")
    for take, max_rows in (([0, 1, 2, 3, 4, 5], 8), ([3, 0, 5], 8), ([1, 3], 8), ([0, 1, 2, 3, 4, 5], 2)):
        graphs = _PrefillGraphs(model, fam, 3, 7, max_rows, cpu, capture=False)
        with torch.no_grad():
            want_logits, want = _prefill(model, fam, prompts, take, 3, 64, "bfd", cpu)
            got_logits, got = graphs(prompts, take, "bfd")
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-10, atol=1e-12)
        for li in range(len(fam.mixers)):
            for a, b in zip(got.layer(li), want.layer(li)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_graphs_are_kept_until_a_parameter_moves(seed, monkeypatch):
    """cuda_graph=True keeps its decoder and prefill graphs on the model: a second call of the same shapes reuses
    them (and sees weights changed in place); a model whose parameters were replaced (``.to()``) gets new ones, never
    graphs reading the old tensors."""
    slots_on_the_cpu(monkeypatch)
    model = mamba_ssm_model(seed)
    prompts = prompts_of([3, 5, 2, 4], seed)
    first = ops.generate_packed(model, prompts, 4, capacity=8, batch_size=2, cuda_graph=True)
    kept = model.__dict__["_packloader_generate_graphs"]
    parts = {k: v for k, v in kept.items() if k != "key"}
    assert {k[0] for k in parts} == {"decode", "prefill"}
    again = ops.generate_packed(model, prompts, 4, capacity=8, batch_size=2, cuda_graph=True)
    assert model.__dict__["_packloader_generate_graphs"] is kept
    assert all(kept[k] is v for k, v in parts.items())
    assert [x.tolist() for x in again] == [x.tolist() for x in first]
    with torch.no_grad():                           # in place: the kept graphs read the new values
        model.backbone.layers[0].mixer.out_proj.weight.mul_(-1.0)
    changed = ops.generate_packed(model, prompts, 4, capacity=8, batch_size=2, cuda_graph=True)
    assert model.__dict__["_packloader_generate_graphs"] is kept
    for p, o in zip(prompts, changed):
        assert o.tolist() == greedy_alone_plain(model, p, 4).tolist()
    model.to(torch.float64)                         # new parameter tensors: the graphs go
    moved = ops.generate_packed(model, prompts, 4, capacity=8, batch_size=2, cuda_graph=True)
    assert model.__dict__["_packloader_generate_graphs"] is not kept
    for p, o in zip(prompts, moved):
        assert o.tolist() == greedy_alone_plain(model, p, 4).tolist()


def test_cuda_graph_is_refused_where_it_cannot_run(seed):
    model = mamba_ssm_model(seed)
    with pytest.raises(ValueError, match="cuda_graph=True needs the model on a CUDA device, it is on cpu"):
        ops.generate_packed(model, [[1, 2]], 2, cuda_graph=True)
    with pytest.raises(TypeError, match="cuda_graph must be a bool"):
        ops.generate_packed(model, [[1, 2]], 2, cuda_graph=1)


def test_a_mixer_that_leaves_no_states_is_named(seed, monkeypatch):
    """A prefill whose mixer at some layer did not keep its final states (it did not take the carry path) is refused
    naming that layer, eagerly and on the fixed-row (cuda_graph) path's buffers, instead of decoding from nothing."""
    import ops.carry as carry
    import ops.generate as gen

    model = mamba_ssm_model(seed)
    prompts = prompts_of([5, 3, 7], seed)
    keep = carry.CarryStep.keep

    def keep_all_but_layer_1(self, layer, conv_final, ssm_final):
        if layer != 1:
            keep(self, layer, conv_final, ssm_final)
    monkeypatch.setattr(carry.CarryStep, "keep", keep_all_but_layer_1)
    with pytest.raises(RuntimeError, match="the packed prefill left no states at layer 1 "):
        ops.generate_packed(model, prompts, 3, capacity=12)
    monkeypatch.setattr(gen, "_check_cuda_graph", lambda fam, device: None)   # the fixed rows, run eagerly
    with pytest.raises(RuntimeError, match="the packed prefill left no states at layer 1 "):
        ops.generate_packed(model, prompts, 3, capacity=12, cuda_graph=True)


def test_seeded_sampling_is_reproducible(seed):
    model = mamba_ssm_model(seed)
    prompts = prompts_of([6, 2, 9, 4, 3], seed)
    kw = dict(capacity=12, temperature=4.0, seed=1234)
    a = ops.generate_packed(model, prompts, 8, **kw)
    b = ops.generate_packed(model, prompts, 8, **kw)
    c = ops.generate_packed(model, prompts, 8, **dict(kw, seed=99))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(not torch.equal(x, y) for x, y in zip(a, c))
    greedy = ops.generate_packed(model, prompts, 8, capacity=12)
    assert any(not torch.equal(x, y) for x, y in zip(a, greedy))
    for top in (dict(top_k=1), dict(top_p=1e-9)):   # a support of one token is greedy
        s = ops.generate_packed(model, prompts, 8, **kw, **top)
        assert all(torch.equal(x, y) for x, y in zip(s, greedy))


def test_next_tokens_restricts_the_support():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    g = torch.Generator().manual_seed(0)
    top5 = torch.topk(logits, 5, dim=-1).indices
    for _ in range(50):
        t = _next_tokens(logits, 1.0, 5, None, g)
        assert all(int(t[b]) in top5[b].tolist() for b in range(4))
    # top_p: the smallest prefix of the sorted probabilities reaching p
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    for _ in range(50):
        t = _next_tokens(logits, 1.0, None, 0.5, g)
        for b in range(4):
            k = int((sorted_p[b].cumsum(0) < 0.5).sum()) + 1
            assert int(t[b]) in order[b, :k].tolist()
    assert torch.equal(_next_tokens(logits, 0.0, None, None, None), logits.argmax(-1))


def test_bad_input(seed):
    model = mamba_ssm_model(seed)
    ok = [[1, 2, 3]]
    with pytest.raises(ValueError, match="prompts is empty"):
        ops.generate_packed(model, [], 4)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        ops.generate_packed(model, [[1], []], 4)
    with pytest.raises(ValueError, match=r"prompts\[0\] must be 1-D"):
        ops.generate_packed(model, [torch.ones(2, 3, dtype=torch.long)], 4)
    with pytest.raises(TypeError, match="prompts must be a list"):
        ops.generate_packed(model, torch.ones(2, 3, dtype=torch.long), 4)
    with pytest.raises(TypeError, match=r"prompts\[0\] must hold integer"):
        ops.generate_packed(model, [torch.ones(3)], 4)
    with pytest.raises(TypeError, match="tokenize"):
        ops.generate_packed(model, ["hello"], 4)
    with pytest.raises(ValueError, match="negative token id"):
        ops.generate_packed(model, [[1, -2]], 4)
    with pytest.raises(ValueError, match=f"outside the model's vocabulary of {VOCAB}"):
        ops.generate_packed(model, [[1, VOCAB]], 4)
    with pytest.raises(ValueError, match=r"capacity=2 is shorter than prompts\[0\]"):
        ops.generate_packed(model, ok, 4, capacity=2)
    with pytest.raises(ValueError, match="max_new_tokens has 2 entries for 1 prompts"):
        ops.generate_packed(model, ok, [1, 2])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        ops.generate_packed(model, ok, -1)
    with pytest.raises(ValueError, match="temperature"):
        ops.generate_packed(model, ok, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        ops.generate_packed(model, ok, 4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        ops.generate_packed(model, ok, 4, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="batch_size"):
        ops.generate_packed(model, ok, 4, batch_size=0)
    with pytest.raises(ValueError, match="not converted"):
        ops.generate_packed(MambaLMHeadModel(d_model=8, n_layer=1, vocab_size=VOCAB, d_state=4), ok, 4)
    with pytest.raises(ValueError, match="has no lm_head; pass the language model"):
        ops.generate_packed(model.backbone, ok, 4)
    m2 = ops.enable_packing(MambaLMHeadModel(d_model=8, n_layer=2, vocab_size=VOCAB, mixers=("Mamba1", "Mamba2"),
                                             d_state=4))
    with pytest.raises(NotImplementedError, match=r"layers \[1\] are mamba-ssm Mamba-2 mixers.*Mamba-1 mixers only"):
        ops.generate_packed(m2, ok, 4)
    # max_new_tokens=0: the prompts come back
    assert ops.generate_packed(model, [[3, 4], [5]], 0)[1].tolist() == [5]


# --------------------------------------------------------------------------------------------------
# evaluation


def loss_alone(model, seq, labels=None):
    labels = seq if labels is None else labels
    with torch.no_grad():
        logits = model(seq[None]).logits[0].double()
    tgt = labels[1:]
    keep = tgt != -100
    if len(seq) < 2 or not bool(keep.any()):
        return 0.0, 0
    return float(F.cross_entropy(logits[:-1][keep], tgt[keep], reduction="sum")), int(keep.sum())


def test_eval_equals_each_sequence_alone(seed):
    model = mamba_ssm_model(seed)
    seqs = prompts_of([5, 1, 2, 17, 3, 12, 8, 30, 4], seed)
    labels = [s.clone() for s in seqs]
    labels[3][:9] = -100          # a prompt excluded from the loss
    labels[5][:] = -100           # no loss token at all
    res = ops.evaluate_packed(model, seqs, labels, capacity=32, eval_tokens=64)
    for i, s in enumerate(seqs):
        want, n = loss_alone(model, s, labels[i])
        assert int(res.num_tokens[i]) == n
        assert abs(float(res.loss_sum[i]) - want) <= 1e-5 * max(1.0, abs(want)), (i, float(res.loss_sum[i]), want)
    assert torch.isnan(res.mean_loss[5]) and torch.isnan(res.mean_loss[1])
    want_total = sum(loss_alone(model, s, l)[0] for s, l in zip(seqs, labels)) / int(res.num_tokens.sum())
    assert res.total_mean_loss == pytest.approx(want_total, rel=1e-6)
    m = res.metrics("ev")
    assert m["ev_perplexity"] == pytest.approx(torch.exp(torch.tensor(want_total)).item(), rel=1e-6)
    assert m["ev_sequences"] == len(seqs)
    # float64: to rounding
    model64 = mamba_ssm_model(seed, torch.float64)
    res64 = ops.evaluate_packed(model64, seqs, capacity=40)
    for i, s in enumerate(seqs):
        assert float(res64.loss_sum[i]) == pytest.approx(loss_alone(model64, s)[0], rel=1e-10, abs=1e-10)


def test_eval_bad_input(seed):
    model = mamba_ssm_model(seed)
    with pytest.raises(ValueError, match=r"labels\[0\] must be 1-D with the length of sequences\[0\]"):
        ops.evaluate_packed(model, [[1, 2, 3]], [[1, 2]])
    with pytest.raises(ValueError, match="labels must be a list of 1"):
        ops.evaluate_packed(model, [[1, 2, 3]], [[1, 2, 3], [1]])
    with pytest.raises(ValueError, match=r"capacity=3 is shorter than sequences\[1\]"):
        ops.evaluate_packed(model, [[1, 2], [1, 2, 3, 4]], capacity=3)
    with pytest.raises(ValueError, match="not converted"):
        ops.evaluate_packed(MambaLMHeadModel(d_model=8, n_layer=1, vocab_size=VOCAB, d_state=4), [[1, 2]])


def test_eval_callback(seed):
    """PackedEvalCallback as a trainer calls it: on_evaluate adds the metrics, on_step_end evaluates every
    eval_steps into the log history; the model's training mode is restored."""
    model = mamba_ssm_model(seed).train()
    seqs = prompts_of([5, 9, 3], seed)
    cb = ops.PackedEvalCallback(seqs, capacity=16, eval_steps=2, prefix="ho")
    metrics = {"eval_loss": 1.0}
    state0 = types.SimpleNamespace(global_step=0, log_history=[])
    cb.on_evaluate(None, state0, "control", model=model, metrics=metrics)
    want = ops.evaluate_packed(model, seqs).metrics("ho")
    assert metrics["ho_loss"] == pytest.approx(want["ho_loss"]) and metrics["eval_loss"] == 1.0
    # Trainer logged its metrics before on_evaluate: ours are logged too
    assert state0.log_history[0]["ho_loss"] == pytest.approx(want["ho_loss"])
    assert model.training
    state = types.SimpleNamespace(global_step=1, log_history=[])
    cb.on_step_end(None, state, None, model=model)
    assert state.log_history == []
    state.global_step = 2
    cb.on_step_end(None, state, None, model=model)
    assert state.log_history[0]["ho_loss"] == pytest.approx(want["ho_loss"]) and state.log_history[0]["step"] == 2
    assert cb.on_train_begin(None, state, None) is None        # the other events do nothing
    with pytest.raises(ValueError, match="eval_steps"):
        ops.PackedEvalCallback(seqs, eval_steps=0)


# --------------------------------------------------------------------------------------------------
# transformers


def _hf():
    return pytest.importorskip("transformers", reason="transformers is not installed", exc_type=ImportError)


def hf_model(kind, seed, dtype=torch.float32):
    transformers = _hf()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cls, cfg_cls = {"mamba": (transformers.MambaForCausalLM, transformers.MambaConfig),
                    "falcon": (transformers.FalconMambaForCausalLM, transformers.FalconMambaConfig)}[kind]
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
                  time_step_rank=4, use_cache=True)
    model = cls(cfg).to(dtype).eval()
    with torch.no_grad():
        model.backbone.embeddings.weight.normal_(0, 1.0)
    return model


def assert_hf_reference(plain, prompts, out, budgets, conv_width=4):
    """Each output equals the unconverted model's greedy continuation by its whole-sequence forward, and by
    transformers' own generate() (its cache path) for prompts at least as long as the conv's state: transformers
    5.0's cached generate() of a shorter prompt differs from its own whole-sequence forward (5.24's does not)."""
    with torch.no_grad():
        for i, (p, o, b) in enumerate(zip(prompts, out, budgets)):
            assert o.tolist() == greedy_alone_plain(plain, p, b).tolist(), f"prompt {i}"
            if len(p) >= conv_width - 1:
                ref = plain.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=b,
                                     do_sample=False, pad_token_id=0)[0]
                assert o.tolist() == ref.tolist(), f"prompt {i}"


@pytest.mark.parametrize("kind", ["mamba", "falcon"])
def test_hf_greedy_equals_transformers_generate(seed, kind):
    """transformers' MambaForCausalLM / FalconMambaForCausalLM: the packed run's tokens are those of the unconverted
    model on each prompt alone (assert_hf_reference; generate() with an explicit all-ones attention_mask, else it
    would take prompt tokens equal to pad_token_id for padding); eval losses equal each alone."""
    model = hf_model(kind, seed)
    plain = copy.deepcopy(model)
    plain.generation_config.eos_token_id = None    # no stop (and no end-of-text suppression) in the reference
    ops.enable_packing(model)
    prompts = prompts_of([5, 1, 2, 9, 3, 7], seed)
    budgets = [6, 4, 6, 1, 6, 5]
    out = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=4)
    assert_hf_reference(plain, prompts, out, budgets)
    res = ops.evaluate_packed(model, prompts)
    for i, p in enumerate(prompts):
        want, n = loss_alone(plain, p)
        assert int(res.num_tokens[i]) == n
        assert abs(float(res.loss_sum[i]) - want) <= 1e-5 * max(1.0, abs(want))
    # the model's own state cache (a training run's, overflow="carry") is left as it was: none, or the same object
    assert "_packloader_state_cache" not in model.__dict__
    training_cache = model.__dict__["_packloader_state_cache"] = ops.StateCache()
    again = ops.generate_packed(model, prompts[:3], 2)
    assert model.__dict__["_packloader_state_cache"] is training_cache and len(training_cache) == 0
    assert all(torch.equal(a, o[:len(a)]) for a, o in zip(again, out))


def hf_mamba2(seed, n_layers=2, head_dim=8):
    """transformers' Mamba2ForCausalLM, 32 channels in heads of ``head_dim`` (4: in_proj's 104 features a multiple
    of 8, the strides causal-conv1d's kernel, which transformers runs where it is installed, needs)."""
    transformers = _hf()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=16, state_size=8, num_hidden_layers=n_layers,
                                    expand=2, conv_kernel=4, head_dim=head_dim, num_heads=32 // head_dim, n_groups=2,
                                    chunk_size=8, use_cache=True)
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.backbone.embeddings.weight.normal_(0, 1.0)
    return model


def test_hf_mamba2_greedy_equals_transformers_generate(seed):
    """transformers' Mamba2ForCausalLM: the packed prefill (the SSD recurrence as a packed scan, in place of each
    mixer for the call) leaves every prompt's states in transformers' cache layout; the tokens are transformers' own
    generate() of each prompt alone (its chunked scan, then its recurrent steps), continuous batching included;
    evaluate_packed equals each sequence alone."""
    model = hf_mamba2(seed)
    plain = copy.deepcopy(model)
    plain.generation_config.eos_token_id = None
    ops.enable_packing(model)
    prompts = prompts_of([5, 1, 2, 9, 3, 11], seed)
    budgets = [6, 3, 6, 1, 5, 6]
    out = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=3)
    assert_hf_reference(plain, prompts, out, budgets)
    seqs = prompts_of([4, 7, 2, 12], seed + 1)
    res = ops.evaluate_packed(model, seqs, capacity=13)
    for i, s in enumerate(seqs):
        assert float(res.loss_sum[i]) == pytest.approx(loss_alone(plain, s)[0], rel=1e-5, abs=1e-5)


def test_hf_unsupported_models(seed):
    transformers = _hf()
    with pytest.raises(ValueError, match="not converted"):
        ops.generate_packed(hf_model("mamba", seed), [[1, 2, 3]], 2)
    cfg = transformers.BambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32, attn_layer_indices=[1],
                                   mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                                   mamba_chunk_size=8, attn_implementation="sdpa")
    bamba = ops.enable_packing(transformers.BambaForCausalLM(cfg), allow_unprotected_attention=True)
    with pytest.raises(NotImplementedError, match="hybrid with attention layers"):
        ops.generate_packed(bamba, [[1, 2, 3]], 2)


# --------------------------------------------------------------------------------------------------
# GPU (the CUDA kernels: the carried prefill's fused mixer, the decode step)


def gpu_mamba_ssm_model(cuda, seed, dtype=torch.float32):
    """(converted model, an unconverted copy or None, vocabulary) on CUDA: a real mamba-ssm MambaLMHeadModel (4 Mamba-1
    layers, d_model 256) when mamba-ssm is installed, else the stand-in."""
    try:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel as Upstream
    except ImportError:
        return mamba_ssm_model(seed, dtype).to(cuda), None, VOCAB
    torch.manual_seed(seed)
    cfg = MambaConfig(d_model=256, n_layer=4, vocab_size=512, ssm_cfg={"layer": "Mamba1"}, rms_norm=True,
                      fused_add_norm=False, residual_in_fp32=True)
    model = Upstream(cfg, device=cuda, dtype=dtype).eval()
    plain = copy.deepcopy(model)
    return ops.enable_packing(model), plain, 512


@pytest.mark.gpu
def test_gpu_mamba_ssm_greedy_equals_one_by_one(cuda, seed):
    """A real mamba-ssm MambaLMHeadModel when installed (else the stand-in), fp32 on CUDA: packed prefill + batched
    decode give the tokens of mamba-ssm's own generation of each prompt alone on the unconverted model."""
    model, plain, vocab = gpu_mamba_ssm_model(cuda, seed)
    prompts = [p.to(cuda) for p in prompts_of([37, 1, 2, 150, 64, 9, 200, 3], seed, vocab)]
    out = ops.generate_packed(model, prompts, 24, capacity=256)
    for i, (p, o) in enumerate(zip(prompts, out)):
        if plain is not None:
            ref = plain.generate(p[None], max_length=len(p) + 24, cg=False, top_k=1)
            ref = ref.sequences[0] if hasattr(ref, "sequences") else ref[0]
        else:
            ref = greedy_alone_plain(model, p, 24)
        assert o.tolist() == ref.tolist(), f"prompt {i}"
    res = ops.evaluate_packed(model, prompts, capacity=256)
    for i, p in enumerate(prompts):
        want, _ = loss_alone(plain if plain is not None else model, p)
        assert abs(float(res.loss_sum[i]) - want) <= 1e-5 * max(1.0, abs(want))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_cuda_graph_decoding_gives_the_eager_tokens(cuda, seed, dtype):
    """cuda_graph=True (fixed rows, one graph replay a step, refills) against the eager decoder on CUDA, stop tokens
    included: the same tokens in fp32; in bf16 all but at most two prompts (the eager batch shrinks as prompts stop,
    the graph's does not, and a matmul of another batch size may round differently)."""
    model, _, vocab = gpu_mamba_ssm_model(cuda, seed, dtype)
    prompts = [p.to(cuda) for p in prompts_of([37, 1, 2, 150, 64, 9, 200, 3, 17, 88, 5], seed, vocab)]
    budgets = [24, 3, 0, 17, 24, 1, 9, 24, 12, 6, 20]
    for batch_size in (None, 4):
        eager = ops.generate_packed(model, prompts, budgets, capacity=256, batch_size=batch_size)
        graph = ops.generate_packed(model, prompts, budgets, capacity=256, batch_size=batch_size, cuda_graph=True)
        same = sum(e.tolist() == g.tolist() for e, g in zip(eager, graph))
        if dtype == torch.float32:
            assert same == len(prompts), f"batch_size={batch_size}: {same} of {len(prompts)} prompts equal"
        else:   # bf16: the matmuls of a 4-row and an 11-row batch may round differently; most prompts agree
            assert same >= len(prompts) - 2, f"batch_size={batch_size}: {same} of {len(prompts)} prompts equal"
        assert all(len(g) == len(p) + b for g, p, b in zip(graph, prompts, budgets))
    stop = int(eager[3][len(prompts[3]) + 2])
    e = ops.generate_packed(model, prompts, budgets, capacity=256, stop_token_ids=[stop])
    g = ops.generate_packed(model, prompts, budgets, capacity=256, stop_token_ids=[stop], cuda_graph=True)
    if dtype == torch.float32:
        assert [x.tolist() for x in g] == [x.tolist() for x in e]


@pytest.mark.gpu
def test_gpu_prefill_joins_a_running_decode_without_waiting(cuda, seed):
    """A packed prefill of waiting prompts and the write of their states into the decode rows queue behind the running
    decode without one host sync (``torch.cuda.set_sync_debug_mode("error")``): a sync there leaves the GPU idle for
    the prefill's host time, every refill."""
    from ops.generate import _family, _prefill, _SlotDecoder
    model = mamba_ssm_model(seed).to(cuda)
    fam = _family(model)
    prompts = prompts_of([5, 1, 9, 3, 12, 2, 7, 4], seed)
    dec = _SlotDecoder(model, fam, 8, 64, torch.device(cuda), capture=True)
    rows = torch.arange(4, 8, device=cuda)

    def refill():
        logits, states = _prefill(model, fam, prompts, [0, 2, 5, 6], 16, 4096, "bfd", torch.device(cuda))
        dec.write(rows, states)
        return logits

    with torch.no_grad():
        want = refill()         # warm: kernels loaded
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = refill()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mamba", "falcon"])
def test_gpu_hf_greedy_equals_transformers_generate(cuda, seed, kind):
    model = hf_model(kind, seed).to(cuda)
    plain = copy.deepcopy(model)
    plain.generation_config.eos_token_id = None
    ops.enable_packing(model)
    prompts = [p.to(cuda) for p in prompts_of([37, 1, 2, 90, 64, 9, 120, 3], seed)]
    out = ops.generate_packed(model, prompts, 16, capacity=128)
    assert_hf_reference(plain, prompts, out, [16] * len(prompts))


# --------------------------------------------------------------------------------------------------
# the example


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda-graph"])
def test_example_runs_and_matches_one_by_one(monkeypatch, cuda_graph):
    """examples/generate_packed.py at its smallest: GSM8K questions (embedded sample, GPT-NeoX tokens), packed
    generation identical to transformers' generate() of each question alone, the packed evaluation's loss finite;
    ``--cuda-graph`` (its fixed rows run eagerly on the CPU) the same."""
    _hf()
    if cuda_graph:
        slots_on_the_cpu(monkeypatch)
        if not hf_steps_fused(ops.enable_packing(hf_model("mamba", 0))):
            pytest.skip("this transformers version steps Mamba through its own code: cuda_graph=True is refused "
                        "(test_hf_fixed_rows_decoder_gives_the_same_tokens checks that)")
    pytest.importorskip("tokenizers", exc_type=ImportError)
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "generate_packed.py")
    spec = importlib.util.spec_from_file_location("generate_packed_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    got = example.main(["--num-prompts", "5", "--max-new-tokens", "4", "--check", "3", "--eval", "3", "--d-model",
                        "16", "--layers", "1", "--capacity", "256", "--device", "cpu"] + ["--cuda-graph"] * cuda_graph)
    assert got["prompts"] == 5 and got["new_tokens"] == 20
    assert got["checked"] == 3 and got["identical"] == 3
    assert 0 < got["eval_loss"] < 20 and got["eval_perplexity"] > 1


def test_benchmark_smoke(tmp_path):
    """benchmarks/bench_packed_generation.py --smoke, smaller still: every mode runs, the packed tokens equal the
    padded (masked) and one-by-one ones, the packed evaluation's losses equal the padded evaluation's, JSON written."""
    _hf()
    pytest.importorskip("tokenizers", exc_type=ImportError)
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import bench_packed_generation as bench
    out = tmp_path / "gen.json"
    got = bench.main(["--smoke", "--model", "hf", "--device", "cpu", "--num-prompts", "5", "--max-new-tokens", "3",
                      "--alone", "2", "--batch-size", "3", "--out", str(out)])
    assert json.loads(out.read_text())["generation"] == got["generation"]
    for workload in ("fixed", "answer"):
        modes = {r["mode"]: r for r in got["generation"] if r["workload"] == workload}
        assert modes["padded"]["identical_to_packed"] == 5 and modes["one_by_one"]["identical_to_packed"] == 2
        assert modes["padded_converted"]["identical_to_packed"] == 5
        assert modes["one_by_one"]["tokens_differing_from_packed"] == 0
    fixed = [r for r in got["generation"] if r["workload"] == "fixed"]
    assert fixed[0]["mode"] == "packed" and fixed[0]["new_tokens"] == 15
    assert got["evaluation"][0]["max_rel_loss_diff"] < 1e-5


def test_eval_callback_in_packed_trainer(tmp_path):
    """PackedEvalCallback attached to a real PackedTrainer: every eval_steps it logs the packed evaluation of the model
    as it is at that step (through trainer.log), and trainer.evaluate() gains the metrics."""
    transformers = _hf()
    pytest.importorskip("accelerate", exc_type=ImportError)
    from packloader import PackedDataLoader
    from packloader.hf import PackedTrainer
    from tests.packloader.conftest import random_sequences, sft_labels, write_arrow
    seqs = random_sequences(40, seed=3, min_len=2, max_len=30, vocab=VOCAB)
    path = write_arrow(tmp_path / "shard-000.arrow", seqs, sft_labels(seqs))
    model = ops.enable_packing(hf_model("mamba", 0).train())
    held_out = prompts_of([7, 12, 3, 20], 5)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, learning_rate=5e-3,
                                          logging_steps=100, save_steps=100, report_to=[], use_cpu=True, seed=0,
                                          disable_tqdm=True)
    loader = PackedDataLoader(path, capacity=64, batch_size=2, shuffle=True, seed=5, hf_compat=True)
    trainer = PackedTrainer(model=model, args=args, train_loader=loader)
    cb = ops.PackedEvalCallback(held_out, capacity=32, eval_steps=2).attach(trainer)
    before = ops.evaluate_packed(model, held_out).total_mean_loss
    trainer.train()
    assert [h["step"] for h in cb.history] == [2, 4]
    logged = [h for h in trainer.state.log_history if "eval_packed_loss" in h]
    assert [h["step"] for h in logged] == [2, 4]
    after = ops.evaluate_packed(model, held_out).total_mean_loss
    assert logged[-1]["eval_packed_loss"] == pytest.approx(after, rel=1e-6)
    assert after != before and model.training
    metrics = trainer.evaluate(eval_dataset=[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    assert metrics["eval_packed_loss"] == pytest.approx(after, rel=1e-6)


@pytest.mark.gpu
def test_gpu_hf_mamba2_greedy_equals_transformers(cuda, seed):
    """transformers' Mamba2ForCausalLM on CUDA, d_state 64 (above the CUDA scan's 16: the prefill's scan runs the
    reference there), fp32: the tokens of the unconverted model on each prompt alone."""
    transformers = _hf()
    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=64, state_size=64, num_hidden_layers=2, expand=2,
                                    conv_kernel=4, head_dim=16, num_heads=8, n_groups=2, chunk_size=16, use_cache=True)
    model = transformers.Mamba2ForCausalLM(cfg).to(cuda).eval()
    with torch.no_grad():
        model.backbone.embeddings.weight.normal_(0, 1.0)
    plain = copy.deepcopy(model)
    plain.generation_config.eos_token_id = None
    ops.enable_packing(model)
    prompts = [p.to(cuda) for p in prompts_of([37, 1, 2, 40, 9, 3], seed)]
    out = ops.generate_packed(model, prompts, 8, capacity=64)
    assert_hf_reference(plain, prompts, out, [8] * len(prompts))


# ---- cuda_graph=True on transformers' Mamba-1 / FalconMamba: fixed rows stepped by the fused steps ----

def hf_steps_fused(model) -> bool:
    """Whether this transformers version's cache lets every layer's one-token step run fused (ops.hf)."""
    from ops.hf import fused_step_states
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=dev), use_cache=True)
    cache = getattr(out, "cache", None)
    cache = getattr(out, "cache_params", None) if cache is None else cache
    return all(fused_step_states(b.mixer, cache) is not None for b in model.backbone.layers)


def hf_any(kind, seed, **mamba2):
    """transformers' Mamba ("mamba"), FalconMamba ("falcon") or Mamba-2 ("mamba2") test model."""
    return hf_mamba2(seed, **mamba2) if kind == "mamba2" else hf_model(kind, seed)


def count_fused_steps(monkeypatch, kind):
    """The batch sizes of the fused single-token steps (ops.decode.mamba_step, or ops.hf.mamba2_step) run from now."""
    import ops.decode as dec
    import ops.hf as hf
    module, name = (hf, "mamba2_step") if kind == "mamba2" else (dec, "mamba_step")
    steps = []
    real_step = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: steps.append(a[1].shape[0]) or real_step(*a, **k))
    return steps


@pytest.mark.parametrize("kind", ["mamba", "falcon", "mamba2"])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_hf_fixed_rows_decoder_gives_the_same_tokens(seed, monkeypatch, kind, batch_size):
    """cuda_graph=True on transformers' Mamba / FalconMamba / Mamba-2 (the CPU runs its fixed-row bookkeeping
    eagerly): every step goes through ops.decode's fused step on the cache's tensors (what the graph replays), and the
    tokens are the eager decoder's, with per-prompt lengths (0 and 1 included), refills of freed rows and a stop
    token."""
    slots_on_the_cpu(monkeypatch)
    model = ops.enable_packing(hf_any(kind, seed))
    prompts = prompts_of([5, 1, 2, 9, 3, 7], seed)
    budgets = [6, 0, 6, 1, 6, 5]
    if not hf_steps_fused(model):   # transformers 5.0's MambaCache: its own step code, which a graph cannot replay
        with pytest.raises(NotImplementedError, match=r"layers \[0, 1\] step through transformers' own code"):
            ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size, cuda_graph=True)
        return
    eager = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size)
    steps = count_fused_steps(monkeypatch, kind)
    fixed = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size, cuda_graph=True)
    slots = 5 if batch_size is None else batch_size   # the prompts with new tokens, or batch_size
    assert steps and set(steps) == {slots}             # every layer of every step, all rows, fused
    for p, e, f, b in zip(prompts, eager, fixed, budgets):
        assert len(f) == len(p) + b
        assert f.tolist() == e.tolist()
    stop = int(eager[0][len(prompts[0]) + 2])
    e = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size, stop_token_ids=[stop])
    f = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=batch_size, stop_token_ids=[stop],
                            cuda_graph=True)
    assert [x.tolist() for x in f] == [x.tolist() for x in e]


def test_hf_cuda_graph_is_refused_where_a_step_is_not_fused(seed, monkeypatch):
    """cuda_graph=True needs every layer's step fused (a graph replays kernels, not transformers' Python): a cache
    whose layers transformers steps itself, or a Mamba-2 variant the fused step does not compute, is refused naming
    the layers."""
    import ops.hf as hf
    slots_on_the_cpu(monkeypatch)
    model = ops.enable_packing(hf_mamba2(seed))
    with monkeypatch.context() as m:
        m.setattr(hf, "_mamba2_step_fusable", lambda mixer: False)
        with pytest.raises(NotImplementedError, match=r"layers \[0, 1\] step through transformers' own code"):
            ops.generate_packed(model, [[1, 2]], 2, cuda_graph=True)
    monkeypatch.setattr(hf, "fused_step_states", lambda mixer, cache: None)
    with pytest.raises(NotImplementedError, match=r"layers \[0, 1\] step through transformers' own code"):
        ops.generate_packed(ops.enable_packing(hf_model("mamba", seed)), [[1, 2]], 2, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mamba", "falcon", "mamba2"])
def test_gpu_hf_cuda_graph_tokens_equal_eager(cuda, seed, kind):
    """transformers' Mamba / FalconMamba / Mamba-2 on CUDA, fp32: generate_packed(cuda_graph=True) (the decode
    captured once, replayed every step, rows refilled) gives the eager decoder's tokens, which are the unconverted
    model's on each prompt alone; a second call replays the kept graph."""
    model = hf_any(kind, seed, head_dim=4).to(cuda)   # (causal-conv1d, under the unconverted model, needs it)
    plain = copy.deepcopy(model)
    plain.generation_config.eos_token_id = None
    ops.enable_packing(model)
    if not hf_steps_fused(model):
        pytest.skip("this transformers version steps Mamba through its own code: cuda_graph=True is refused")
    prompts = [p.to(cuda) for p in prompts_of([5, 1, 2, 9, 3, 7, 4, 8], seed)]
    budgets = [6, 3, 6, 1, 6, 5, 2, 7]
    eager = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=3)
    graphed = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=3, cuda_graph=True)
    assert [g.tolist() for g in graphed] == [e.tolist() for e in eager]
    assert_hf_reference(plain, prompts, graphed, budgets)
    again = ops.generate_packed(model, prompts[:4], budgets[:4], capacity=12, batch_size=3, cuda_graph=True)
    assert [a.tolist() for a in again] == [e.tolist() for e in eager[:4]]


@pytest.mark.gpu
def test_gpu_mamba_ssm_cuda_graph_tokens_equal_eager(cuda, seed):
    """A converted MambaLMHeadModel (the stand-in: mamba-ssm's module layout) on CUDA, fp32: cuda_graph=True (decode
    and prefill captured, rows refilled, prefill graphs of several row counts) gives the eager decoder's tokens, which
    are the whole-sequence forward's on each prompt alone."""
    model = mamba_ssm_model(seed).to(cuda)
    prompts = [p.to(cuda) for p in prompts_of([6, 2, 9, 4, 1, 5, 3, 8], seed)]
    budgets = [5, 3, 8, 1, 6, 2, 7, 4]
    eager = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=3)
    graphed = ops.generate_packed(model, prompts, budgets, capacity=12, batch_size=3, prefill_tokens=24,
                                  cuda_graph=True)
    assert [g.tolist() for g in graphed] == [e.tolist() for e in eager]
    for p, g, b in zip(prompts, graphed, budgets):
        assert g.tolist() == greedy_alone_plain(model, p, b).tolist()
