"""check_isolation: exactly zero on packing-safe models (PackedMamba, a converted LM), and a clear,
correctly located leak on deliberately leaky layers (a plain causal nn.Conv1d over the row, a cumulative
sum, a layer leaking only in its backward pass, one mixing rows, PackedMamba called without boundaries)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ops
from ops import PackedMamba, check_isolation, enable_packing

from ._helpers import MambaLMHeadModel, mixed_rows, positions, spans

F64 = torch.float64


def float_batch(rows, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = sum(rows[0])
    return {"hidden_states": torch.randn(len(rows), L, d, generator=g, dtype=F64), "position_ids": positions(rows)}


def leaking_sequences(rows, target, reach_fwd, reach_bwd):
    """Indices of the sequences of target's row with a token in [end, end + reach_fwd) (their outputs
    see the target) or in [start - reach_bwd, start) (the target's outputs see them)."""
    seqs = spans(rows)
    r, s, n = seqs[target]
    out = set()
    for j, (rj, sj, nj) in enumerate(seqs):
        if j == target or rj != r:
            continue
        tokens = set(range(sj, sj + nj))
        if tokens & set(range(s + n, s + n + reach_fwd)) or tokens & set(range(s - reach_bwd, s)):
            out.add(j)
    return out


def flagged(report):
    return {k for k, v in report.per_sequence().items() if v > 0}


def test_packed_mamba_is_exactly_isolated(seed):
    rng = random.Random(seed)
    rows = mixed_rows(rng, 4, 13)
    print("rows", rows)
    layer = PackedMamba(6, d_state=4).double()
    for fast in (True, False):
        layer.use_fast_path = fast
        rep = check_isolation(lambda b: layer(b["hidden_states"], position_ids=b["position_ids"]),
                              float_batch(rows, seed=seed), max_targets=8)
        assert rep.ok, str(rep)
        assert rep.max_output_change == 0.0 and rep.max_grad_change == 0.0 and rep.grads_checked
        assert len(rep.targets) >= 2 and len(rep.results) == len(rep.targets) * (len(rep.sequences) - 1)
        assert "isolation OK" in str(rep) and "<- leak" not in str(rep)


@pytest.mark.parametrize("form", ["position_ids", "seq_idx", "cu_seqlens"])
def test_converted_model_is_exactly_isolated(seed, form):
    torch.manual_seed(seed)
    model = MambaLMHeadModel(d_model=8, n_layer=2, vocab_size=30, mixers=("Mamba1", "Mamba2"), d_state=4).double()
    enable_packing(model)
    rows = [[5, 1, 4], [3, 3, 4], [10]]
    pos = positions(rows)
    batch = {"input_ids": torch.randint(0, 30, (3, 10)), "position_ids": pos,
             "seq_idx": ops.position_ids_to_seq_idx(pos), "cu_seqlens": ops.position_ids_to_cu_seqlens(pos)[0]}
    batch = {k: v for k, v in batch.items() if k in ("input_ids", form)}
    rep = check_isolation(lambda b: model(b["input_ids"], **{form: b[form]}), batch)
    assert rep.ok and rep.grads_checked, str(rep)  # the embedding was found through the closure
    assert rep.max_output_change == 0.0 and rep.max_grad_change == 0.0
    assert rep.targets == [0, 3, 2]  # first sequence of each multi-sequence row, last one of the first


def test_unconverted_model_leaks(seed):
    torch.manual_seed(seed)
    model = MambaLMHeadModel(d_model=8, n_layer=2, vocab_size=30, d_state=4).double()
    rows = [[5, 5], [10]]
    batch = {"input_ids": torch.randint(0, 30, (2, 10)), "position_ids": positions(rows)}
    rep = check_isolation(lambda b: model(b["input_ids"]), batch, embedding=model.backbone.embedding)
    assert not rep.ok and rep.max_output_change > 1e-6
    assert rep.targets == [0, 1]
    assert {(r.target, r.other) for r in rep.results if r.worst > 0} == {(0, 1), (1, 0)}  # row 1 (seq 2) never


@pytest.mark.parametrize("width", [2, 4])
def test_plain_conv1d_over_the_row_leaks_exactly_where_expected(seed, width):
    rng = random.Random(seed)
    rows = mixed_rows(rng, 4, 12, width=width)
    print("rows", rows)
    torch.manual_seed(seed)
    conv = nn.Conv1d(6, 6, width, groups=6, padding=width - 1, dtype=F64)  # linear, causal, no boundaries

    def fn(b):
        x = b["hidden_states"]
        return conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    batch = float_batch(rows, seed=seed)
    n_seq = len(spans(rows))
    for target in range(n_seq):
        rep = check_isolation(fn, batch, targets=[target])
        want = leaking_sequences(rows, target, width - 1, width - 1)
        assert flagged(rep) == want, (target, str(rep))
        assert rep.ok == (not want)
        fwd = {r.other for r in rep.results if r.output_change > 0}
        assert fwd == leaking_sequences(rows, target, width - 1, 0)  # outputs after the target
        for r in rep.results:
            line = [ln for ln in str(rep).splitlines()[2:] if ln.split()[:2] == [str(target), str(r.other)]]
            assert len(line) == 1 and line[0].endswith("<- leak") == (r.other in want)


def test_cumulative_sum_leaks_to_the_whole_row_not_other_rows(seed):
    rows = [[3, 1, 4, 2], [10], [6, 4]]
    batch = float_batch(rows, seed=seed)
    rep = check_isolation(lambda b: b["hidden_states"].cumsum(1), batch, targets=[1, 6])
    by_target = {}
    for r in rep.results:
        if r.worst > 0:
            by_target.setdefault(r.target, set()).add(r.other)
    assert by_target == {1: {0, 2, 3}, 6: {5}}
    # forward: only later sequences change; backward: the target's outputs depend on earlier inputs
    assert {r.other for r in rep.results if r.target == 1 and r.output_change > 0} == {2, 3}
    assert {r.other for r in rep.results if r.target == 1 and r.grad_leak > 0} == {0}
    assert rep.grad_into_target[1] > 0  # later sequences' outputs send gradient into the target
    assert "isolation LEAK" in str(rep)


class BackwardLeak(torch.autograd.Function):
    """Identity forward; the backward mixes gradients along the row (a leak no output can show)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g + 0.5 * g.roll(1, dims=1)


def test_backward_only_leak_is_caught(seed):
    rows = [[4, 4], [8]]
    batch = float_batch(rows, seed=seed)
    lin = nn.Linear(6, 6, dtype=F64)
    rep = check_isolation(lambda b: lin(BackwardLeak.apply(b["hidden_states"])), batch)
    assert rep.max_output_change == 0.0
    assert not rep.ok and rep.max_grad_change > 0
    # g[t] also reaches input t+1 (and, rolling around, the row's last token reaches its first one)
    assert {(r.target, r.other) for r in rep.results if r.worst > 0} == {(0, 1), (1, 0)}
    assert all(r.grad_change == 0 for r in rep.results)  # the leak is a constant (linear) one


def test_row_mixing_layer_leaks_into_other_rows(seed):
    rows = [[5, 3], [8], [2, 6]]
    batch = float_batch(rows, seed=seed)
    rep = check_isolation(lambda b: b["hidden_states"] - b["hidden_states"].mean(0, keepdim=True), batch,
                          targets=[0])
    # every sequence sharing a column range with sequence 0 (row 0, tokens 0-4), in every row
    assert flagged(rep) == {2, 3, 4}


def test_packed_mamba_without_boundaries_leaks(seed):
    rows = [[6, 1, 5], [12]]
    layer = PackedMamba(6, d_state=4).double()
    batch = float_batch(rows, seed=seed)
    rep = check_isolation(lambda b: layer(b["hidden_states"]), batch, targets=[0, 1])
    assert not rep.ok
    assert {r.other for r in rep.results if r.target == 0 and r.output_change > 0} == {1, 2}
    assert {r.other for r in rep.results if r.target == 1 and r.output_change > 0} == {2}
    assert all(r.output_change == 0 for r in rep.results if r.row == 1)


def test_dropout_masks_repeat_between_runs(seed):
    """The RNG is reseeded before every call, so dropout does not show up as a leak."""
    layer = PackedMamba(6, d_state=4).double()
    rows = [[3, 5, 4], [12]]
    rep = check_isolation(
        lambda b: F.dropout(layer(b["hidden_states"], position_ids=b["position_ids"]), 0.3, training=True),
        float_batch(rows, seed=seed))
    assert rep.ok, str(rep)


def test_tolerance(seed):
    rows = [[4, 4]]
    batch = float_batch(rows, seed=seed)
    fn = lambda b: b["hidden_states"] + 1e-9 * b["hidden_states"].cumsum(1)  # noqa: E731
    assert not check_isolation(fn, batch).ok
    assert check_isolation(fn, batch, atol=1e-6).ok


def test_no_gradient_check_without_an_embedding(seed):
    ids = torch.randint(0, 10, (1, 6))
    table = torch.randn(10, 4)
    rep = check_isolation(lambda b: table[b["input_ids"]], {"input_ids": ids, "position_ids": positions([[3, 3]])})
    assert rep.ok and not rep.grads_checked and rep.max_grad_change is None
    assert any("gradients not checked" in n for n in rep.notes)
    one_row = check_isolation(lambda b: table[b["input_ids"]], {"input_ids": ids, "position_ids": positions([[6]])})
    assert one_row.ok and one_row.targets == [] and any("nothing can leak" in n for n in one_row.notes)


def test_errors():
    batch = float_batch([[3, 3]])
    with pytest.raises(ValueError, match="needs 'position_ids', 'seq_idx' or 'cu_seqlens'"):
        check_isolation(lambda b: b["hidden_states"], {"hidden_states": batch["hidden_states"]})
    with pytest.raises(ValueError, match="target 5 out of range: the batch holds 2 sequences"):
        check_isolation(lambda b: b["hidden_states"], batch, targets=[5])
    with pytest.raises(ValueError, match=r"does not start with \(batch, seqlen\) = \(1, 6\)"):
        check_isolation(lambda b: b["hidden_states"][:, :3], batch)
    with pytest.raises(TypeError, match="model_fn must return a tensor"):
        check_isolation(lambda b: "nope", batch)
    with pytest.raises(ValueError, match="no input to perturb"):
        check_isolation(lambda b: b, {"position_ids": batch["position_ids"]})
