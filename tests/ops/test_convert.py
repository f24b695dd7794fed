"""enable_packing on the tiny MambaLMHeadModel mirror (tests/ops/_helpers.py: same structure and
forward signatures as mamba_ssm.models.mixer_seq_simple): packed logits and gradients equal
per-sequence runs (Mamba-1, the Mamba-2 stand-in, mixed with a token-wise MHA stand-in), seq_idx reaches
Mamba-2 mixers, nothing changes without boundaries, generation still works, clear errors otherwise."""
from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn as nn

import ops
from ops import PackedMamba, enable_packing

from ._helpers import Block, MambaLMHeadModel, Mamba, Mamba2, assert_packing_invariant, boundary_kwargs, mixed_rows, positions

F64 = torch.float64
VOCAB = 40


def make_model(mixers=("Mamba1",), n_layer=2, seed=0):
    torch.manual_seed(seed)
    model = MambaLMHeadModel(d_model=8, n_layer=n_layer, vocab_size=VOCAB, mixers=mixers, d_state=4).double()
    with torch.no_grad():  # perturb the init so every parameter matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def logits_fn(model):
    return lambda ids, **b: model(ids, **b).logits


@pytest.mark.parametrize("mixers", [("Mamba1",), ("Mamba1", "Mamba2"), ("Mamba2",)], ids=lambda m: "+".join(m))
@pytest.mark.parametrize("form", ["position_ids", "seq_idx", "cu_seqlens"])
def test_packed_batch_equals_per_sequence_runs(seed, mixers, form):
    rng = random.Random(seed)
    model = make_model(mixers, n_layer=3, seed=seed)
    enable_packing(model)
    rows = mixed_rows(rng, 4, rng.choice([9, 14]))
    print("rows", rows)
    ids = torch.randint(0, VOCAB, (4, sum(rows[0])))
    names = [n for n, _ in model.named_parameters()]
    assert_packing_invariant(logits_fn(model), ids, list(model.parameters()), rows, form, names=names)


def test_boundaries_matter(seed):
    """Sanity check of the invariance test: the same packed rows without boundaries are not invariant,
    and with boundaries the logits of a row's second sequence change."""
    model = make_model(("Mamba1", "Mamba2"), seed=seed)
    enable_packing(model)
    rows = [[4, 6], [2, 8]]
    ids = torch.randint(0, VOCAB, (2, 10))
    no_bounds = lambda x, **b: model(x).logits  # noqa: E731
    with pytest.raises(AssertionError, match="output of sequence"):
        assert_packing_invariant(no_bounds, ids, list(model.parameters()), rows)
    packed = model(ids, position_ids=positions(rows)).logits
    plain = model(ids).logits
    assert torch.equal(packed[0, :4], plain[0, :4])
    assert (packed[0, 4:] - plain[0, 4:]).abs().max() > 1e-6


def test_seq_idx_reaches_the_mamba2_mixers_once_per_batch(seed):
    model = make_model(("Mamba2", "Mamba1"), n_layer=4, seed=seed)
    enable_packing(model)
    rows = [[3, 5, 2], [10]]
    pos = positions(rows)
    want = ops.position_ids_to_seq_idx(pos)
    m2 = [layer.mixer for layer in model.backbone.layers if type(layer.mixer).__name__ == "PackedMamba2"]
    assert len(m2) == 2
    for kw in (boundary_kwargs("position_ids", rows), boundary_kwargs("seq_idx", rows),
               boundary_kwargs("cu_seqlens", rows)):
        for m in m2:
            m.seen_seq_idx.clear()
        model(torch.randint(0, VOCAB, (2, 10)), **kw)
        seen = [m.seen_seq_idx[-1] for m in m2]
        assert seen[0] is seen[1], "seq_idx is computed once per batch and shared by every layer"
        assert seen[0].dtype == torch.int32 and seen[0].is_contiguous()
        assert torch.equal(seen[0], want)
    # without boundaries the Mamba-2 mixers get seq_idx=None, as before conversion
    model(torch.randint(0, VOCAB, (2, 10)))
    assert all(m.seen_seq_idx[-1] is None for m in m2)


def test_conversion_is_in_place_and_changes_nothing_without_boundaries(seed):
    model = make_model(("Mamba1", "Mamba2"), n_layer=3, seed=seed)
    ids = torch.randint(0, VOCAB, (2, 11))
    before = model(ids).logits
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    out = enable_packing(model)
    assert out is model
    assert type(model).__name__ == "PackedMambaLMHeadModel" and isinstance(model, MambaLMHeadModel)
    assert isinstance(model.backbone.layers[0].mixer, PackedMamba)
    assert isinstance(model.backbone.layers[1].mixer, Mamba2)
    assert isinstance(model.backbone.layers[2].mixer, PackedMamba)
    assert model._packloader_conversion == {
        "mamba1": ["backbone.layers.0.mixer", "backbone.layers.2.mixer"],
        "mamba2": ["backbone.layers.1.mixer"], "left_unsafe": []}
    assert list(model.state_dict()) == keys_before
    for name, p in model.named_parameters():
        assert p is params_before[name], name  # shared, not copied (optimizer state stays valid)
    assert model.lm_head.weight is model.backbone.embedding.weight  # tied weights still tied
    assert torch.equal(model(ids).logits, before)
    # idempotent
    enable_packing(model)
    assert torch.equal(model(ids).logits, before)
    assert model._packloader_conversion["mamba1"] == ["backbone.layers.0.mixer", "backbone.layers.2.mixer"]


def test_backbone_alone(seed):
    model = make_model(("Mamba1",), seed=seed)
    enable_packing(model.backbone)
    assert type(model.backbone).__name__ == "PackedMixerModel"
    rows = [[3, 7], [1, 9]]
    ids = torch.randint(0, VOCAB, (2, 10))
    assert_packing_invariant(lambda x, **b: model.backbone(x, **b), ids, list(model.backbone.parameters()), rows)


def test_unsafe_mixers(seed):
    model = make_model(("Mamba1", "MHA"), n_layer=2, seed=seed)
    with pytest.raises(NotImplementedError, match=r"not packing-safe .*backbone\.layers\.1\.mixer \(MHA\).*strict=False"):
        enable_packing(model)
    # a refused conversion leaves the model as it was
    assert type(model.backbone.layers[0].mixer) is Mamba and type(model) is MambaLMHeadModel
    enable_packing(model, strict=False)
    assert model._packloader_conversion["left_unsafe"] == ["backbone.layers.1.mixer (MHA)"]
    assert isinstance(model.backbone.layers[0].mixer, PackedMamba)
    # the MHA stand-in takes no boundaries: it is handed none, and the model runs (it is token-wise, so
    # this model happens to be invariant; a real attention layer would leak: see test_isolation.py)
    rows = [[4, 6], [10]]
    assert_packing_invariant(logits_fn(model), torch.randint(0, VOCAB, (2, 10)), list(model.parameters()), rows)


def test_generation_after_conversion(seed):
    """mamba-ssm's generate() calls model(ids, position_ids=<offset>, inference_params=..., num_last_tokens=1)
    while decoding: the converted model must ignore those position_ids, as upstream does."""
    model = make_model(("Mamba1",), seed=seed)
    enable_packing(model)
    ids = torch.randint(0, VOCAB, (2, 8))
    full = model(ids).logits
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    got = [model(ids[:, :5], inference_params=params, num_last_tokens=1).logits]
    for t in range(5, 8):
        params.seqlen_offset = t
        pos = torch.full((2, 1), t, dtype=torch.long)
        got.append(model(ids[:, t:t + 1], position_ids=pos, inference_params=params, num_last_tokens=1).logits)
    torch.testing.assert_close(torch.cat(got, 1), full[:, 4:], rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="inference_params .* cannot be combined with packed boundaries"):
        model(ids, seq_idx=torch.zeros(2, 8, dtype=torch.int32), inference_params=params)


def test_bad_boundaries_and_validate_flag(seed):
    model = make_model(("Mamba1", "Mamba2"), seed=seed)
    enable_packing(model)
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(ops.BoundaryError, match=r"position_ids\[1, 3\] = 2 after 0"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 0, 2, 3, 4]]))
    with pytest.raises(ops.BoundaryError, match=r"boundaries have shape \(2, 5\)"):
        model(ids, position_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ops.BoundaryError, match="straddles two rows"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 8, 12]))
    enable_packing(model, validate=False)  # re-running only updates the flag
    assert model._packloader_validate is False


class OldBlock(Block):
    """A block whose forward does not pass **mixer_kwargs on (mamba-ssm < 2.0)."""

    def forward(self, hidden_states, residual=None, inference_params=None):
        return super().forward(hidden_states, residual, inference_params=inference_params)


def test_unsupported_models():
    with pytest.raises(ValueError, match="found no Mamba-1 or Mamba-2 mixer in Linear"):
        enable_packing(nn.Linear(3, 3))
    model = make_model(("Mamba1",))
    model.backbone.layers[0].__class__ = OldBlock
    with pytest.raises(NotImplementedError, match=r"OldBlock.forward \(layer 0\) does not pass \*\*mixer_kwargs"):
        enable_packing(model)
    assert type(model.backbone.layers[0].mixer) is Mamba  # nothing converted
    with pytest.raises(TypeError, match="PackedMamba.from_mamba"):
        enable_packing(Mamba(8, d_state=4))
    layer = PackedMamba(8, d_state=4)
    assert enable_packing(layer) is layer


def test_bare_mamba2_mixer_and_a_container(seed):
    m2 = Mamba2(8).double()
    enable_packing(m2)
    h = torch.randn(2, 9, 8, dtype=F64)
    rows = [[2, 7], [9]]
    assert_packing_invariant(lambda x, **b: m2(x, **b), h, list(m2.parameters()), rows, "position_ids")
    # any module holding mixers: only the mixers are converted
    holder = nn.Sequential(Mamba(8, d_state=4)).double()
    enable_packing(holder)
    assert isinstance(holder[0], PackedMamba)
    assert_packing_invariant(lambda x, **b: holder[0](x, **b), h, list(holder.parameters()), rows)


def test_checkpoint_of_the_unconverted_model_loads_into_a_converted_one(seed):
    """A state_dict saved (torch.save) from the mirror before conversion loads unchanged (strict) into a
    converted model, which then computes the same logits; and the other way round."""
    import io

    src = make_model(("Mamba1", "Mamba2"), n_layer=3, seed=seed)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = enable_packing(make_model(("Mamba1", "Mamba2"), n_layer=3, seed=seed + 1))
    dst.load_state_dict(torch.load(buf), strict=True)
    ids = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(dst(ids).logits, src(ids).logits, rtol=0, atol=0)
    back = make_model(("Mamba1", "Mamba2"), n_layer=3, seed=seed + 2)
    back.load_state_dict(dst.state_dict(), strict=True)
    torch.testing.assert_close(back(ids).logits, src(ids).logits, rtol=0, atol=0)


def test_boundaries_are_resolved_and_validated_once_per_forward(seed, monkeypatch):
    """The converted model validates the boundaries once (at most one check) at its entry and hands the resolved int32
    position_ids / seq_idx down: no mixer converts or checks them again, whatever form was given."""
    import ops.boundaries as boundaries

    model = make_model(("Mamba1", "Mamba2", "Mamba1"), n_layer=3, seed=seed)
    enable_packing(model)
    rows = [[3, 5, 2], [10]]
    calls = {"validate": 0, "seq_to_pos": 0}
    real_validate, real_seq_to_pos = boundaries.validate_position_ids, boundaries.seq_idx_to_position_ids

    def counting_validate(p):
        calls["validate"] += 1
        return real_validate(p)

    def counting_seq_to_pos(s, *a, **k):
        calls["seq_to_pos"] += 1
        return real_seq_to_pos(s, *a, **k)

    monkeypatch.setattr(boundaries, "validate_position_ids", counting_validate)
    monkeypatch.setattr(boundaries, "seq_idx_to_position_ids", counting_seq_to_pos)
    seen = []
    for layer in model.backbone.layers:
        if isinstance(layer.mixer, PackedMamba):
            layer.mixer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["position_ids"]), with_kwargs=True)
    for form in ("position_ids", "seq_idx", "cu_seqlens"):
        calls.update(validate=0, seq_to_pos=0)
        seen.clear()
        model(torch.randint(0, VOCAB, (2, 10)), **boundary_kwargs(form, rows))
        # one check where one is needed: seq_idx makes valid position_ids by construction, cu_seqlens are checked
        # as such
        assert calls["validate"] == (1 if form == "position_ids" else 0), (form, calls)
        # once at the entry for seq_idx; plus once inside the Mamba-2 stand-in (its conv takes seq_idx)
        assert calls["seq_to_pos"] == (1 if form == "seq_idx" else 0) + 1, (form, calls)
        assert len(seen) == 2 and seen[0] is seen[1] and seen[0].dtype == torch.int32
    calls.update(validate=0)
    enable_packing(model, validate=False)
    model(torch.randint(0, VOCAB, (2, 10)), position_ids=positions(rows))
    assert calls["validate"] == 0
