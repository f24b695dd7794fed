"""ops.boundaries: the three forms of packed-sequence boundaries (position_ids, seq_idx, cu_seqlens),
their conversions, validation errors and their resolution (once per step, no cache, no check under compile)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ops

from ops.boundaries import (
    BoundaryError,
    cu_seqlens_to_position_ids,
    cu_seqlens_to_seq_idx,
    position_ids_to_cu_seqlens,
    position_ids_to_seq_idx,
    resolve_boundaries,
    resolve_position_ids,
    seq_idx_to_position_ids,
    validate_position_ids,
)

from ._helpers import layouts


def forms_from_lengths(rows):
    """The three forms built by hand from lists of segment lengths (one list per row)."""
    pos, seq, cu = [], [], [0]
    for row in rows:
        pos.append([t for n in row for t in range(n)])
        seq.append([i for i, n in enumerate(row) for _ in range(n)])
        for n in row:
            cu.append(cu[-1] + n)
    return torch.tensor(pos), torch.tensor(seq), torch.tensor(cu)


def random_rows(rng, batch, seqlen):
    rows = layouts(seqlen, batch, rng.randrange(2**31))
    for row in rows:
        assert sum(row) == seqlen
    return rows


@pytest.mark.parametrize("seqlen", [1, 2, 7, 33])
def test_round_trips_on_random_layouts(seed, seqlen):
    rng = random.Random(seed)
    for _ in range(5):
        batch = rng.randint(1, 4)
        rows = random_rows(rng, batch, seqlen)
        pos, seq, cu = forms_from_lengths(rows)
        shape = (batch, seqlen)
        # every conversion gives the hand-built form, int32 and contiguous
        for got, want in [
            (seq_idx_to_position_ids(seq), pos),
            (position_ids_to_seq_idx(pos), seq),
            (cu_seqlens_to_position_ids(cu, shape), pos),
            (cu_seqlens_to_seq_idx(cu, shape), seq),
        ]:
            assert got.dtype == torch.int32 and got.is_contiguous()
            assert torch.equal(got.long(), want), (rows, got, want)
        cu2, max_len = position_ids_to_cu_seqlens(pos)
        assert cu2.dtype == torch.int32
        assert torch.equal(cu2.long(), cu), (rows, cu2, cu)
        assert max_len == max(max(r) for r in rows)
        # round trips
        assert torch.equal(seq_idx_to_position_ids(position_ids_to_seq_idx(pos)).long(), pos)
        assert torch.equal(position_ids_to_seq_idx(seq_idx_to_position_ids(seq)).long(), seq)
        assert torch.equal(cu_seqlens_to_position_ids(position_ids_to_cu_seqlens(pos)[0], shape).long(), pos)
        validate_position_ids(pos)


def test_dtype_argument_and_int32_inputs():
    pos = torch.tensor([[0, 1, 0, 1, 2]], dtype=torch.int32)
    assert seq_idx_to_position_ids(pos, dtype=torch.int64).dtype == torch.int64
    assert position_ids_to_seq_idx(pos, dtype=torch.int64).dtype == torch.int64
    assert position_ids_to_cu_seqlens(pos, dtype=torch.int64)[0].dtype == torch.int64
    assert position_ids_to_seq_idx(pos).tolist() == [[0, 0, 1, 1, 1]]


def test_seq_idx_any_change_starts_a_sequence():
    # ids need not be consecutive nor increasing; only changes matter; every row starts a sequence
    seq = torch.tensor([[5, 5, 2, 2, 2, 5, 7], [7, 7, 7, 7, 7, 7, 7]])
    assert seq_idx_to_position_ids(seq).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]]


def test_position_ids_to_seq_idx_treats_column_0_as_a_start_and_does_not_modify_input():
    pos = torch.tensor([[3, 4, 0, 1]])
    before = pos.clone()
    assert position_ids_to_seq_idx(pos).tolist() == [[0, 0, 1, 1]]
    assert torch.equal(pos, before)
    cu, _ = position_ids_to_cu_seqlens(pos)
    assert cu.tolist() == [0, 2, 4] and torch.equal(pos, before)


def test_padding_is_its_own_segment_and_matches_the_loader(seed):
    """The loader's collation (packloader.batch) and ops' conversions describe the same boundaries."""
    from packloader.batch import collate_packed

    rng = np.random.default_rng(seed)
    B, L = 4, 24
    lens, offsets = [], [0]
    for b in range(B):
        row, left = [], L - int(rng.integers(0, 4))  # 0-3 tokens of padding
        while left > 0 and rng.random() < 0.85:
            n = int(rng.integers(1, left + 1))
            row.append(n)
            left -= n
        lens.extend(row)
        offsets.append(len(lens))
    ids = rng.integers(1, 100, size=(B, L)).astype(np.int32)
    batch = collate_packed(ids, None, np.array(offsets), np.array(lens, dtype=np.int32))
    pos, seq, cu = batch["position_ids"], batch["seq_idx"], batch["cu_seqlens"]
    validate_position_ids(pos)
    assert torch.equal(seq_idx_to_position_ids(seq).long(), pos)
    assert torch.equal(position_ids_to_seq_idx(pos), seq)
    assert torch.equal(cu_seqlens_to_position_ids(cu, (B, L)).long(), pos)
    cu2, max_len = position_ids_to_cu_seqlens(pos)
    assert torch.equal(cu2, cu) and max_len == batch["max_seqlen"]
    # padding tails: a segment after the row's real sequences, counting up from 0
    for b in range(B):
        used = sum(lens[offsets[b]:offsets[b + 1]])
        if used < L:
            assert pos[b, used:].tolist() == list(range(L - used))
            assert seq[b, used] == offsets[b + 1] - offsets[b]


def test_empty_shapes():
    assert seq_idx_to_position_ids(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)
    assert position_ids_to_seq_idx(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)
    validate_position_ids(torch.zeros(3, 0, dtype=torch.long))
    cu, m = position_ids_to_cu_seqlens(torch.zeros(0, 5, dtype=torch.long))
    assert cu.tolist() == [0] and m == 0
    assert cu_seqlens_to_position_ids(torch.tensor([0]), (0, 0)).shape == (0, 0)


# ---------------------------------------------------------------------------------------------
# validation errors


@pytest.mark.parametrize(
    "ids, where, words",
    [
        ([[1, 2, 3]], "position_ids[0, 0] = 1", "begin at 0"),
        ([[0, 1, 2], [0, 2, 3]], "position_ids[1, 1] = 2 after 0", "expected 0 or 1"),
        ([[0, 1, 1]], "position_ids[0, 2] = 1 after 1", "count up by 1"),
        ([[0, 1, 2, 5, 6]], "position_ids[0, 3] = 5 after 2", "restart at 0"),
        ([[0, -1]], "position_ids[0, 1] = -1 after 0", "expected 0 or 1"),
        ([[0, 1, 0, 1], [0, 1, 2, 3], [0, 0, 0, 7]], "position_ids[2, 3] = 7 after 0", "expected 0 or 1"),
    ],
)
def test_validate_names_the_first_bad_id(ids, where, words):
    with pytest.raises(BoundaryError) as exc:
        validate_position_ids(torch.tensor(ids))
    assert where in str(exc.value) and words in str(exc.value)
    assert isinstance(exc.value, ValueError)  # BoundaryError is a ValueError


def test_validate_accepts_every_valid_layout(seed):
    rng = random.Random(seed)
    for _ in range(10):
        rows = random_rows(rng, rng.randint(1, 3), rng.randint(1, 40))
        validate_position_ids(forms_from_lengths(rows)[0])


@pytest.mark.parametrize("fn", [validate_position_ids, position_ids_to_seq_idx, position_ids_to_cu_seqlens,
                                seq_idx_to_position_ids])
def test_wrong_shape_and_dtype(fn):
    name = "seq_idx" if fn is seq_idx_to_position_ids else "position_ids"
    with pytest.raises(BoundaryError, match=rf"{name} must have shape \(batch, seqlen\), got \(4,\)"):
        fn(torch.arange(4))
    with pytest.raises(BoundaryError, match=rf"{name} must have shape .* got \(1, 2, 2\)"):
        fn(torch.zeros(1, 2, 2, dtype=torch.long))
    for dt in (torch.float32, torch.float64, torch.bool):
        with pytest.raises(BoundaryError, match=rf"{name} must be an integer tensor, got {dt}"):
            fn(torch.zeros(1, 3, dtype=dt))
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list"):
        fn([[0, 1, 2]])


def test_cu_seqlens_errors():
    with pytest.raises(BoundaryError, match="must start at 0, got 2"):
        cu_seqlens_to_position_ids(torch.tensor([2, 4]))
    with pytest.raises(BoundaryError, match="non-decreasing"):
        cu_seqlens_to_position_ids(torch.tensor([0, 4, 3, 8]), (2, 4))
    with pytest.raises(BoundaryError, match=r"covers 8 tokens but shape \(3, 4\) holds 12"):
        cu_seqlens_to_position_ids(torch.tensor([0, 4, 8]), (3, 4))
    with pytest.raises(BoundaryError, match=r"1-D with at least one entry"):
        cu_seqlens_to_position_ids(torch.tensor([[0, 4]]))
    with pytest.raises(BoundaryError, match=r"1-D with at least one entry"):
        cu_seqlens_to_position_ids(torch.zeros(0, dtype=torch.long))
    with pytest.raises(BoundaryError, match="integer tensor, got torch.float32"):
        cu_seqlens_to_position_ids(torch.tensor([0.0, 4.0]))
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        cu_seqlens_to_position_ids([0, 4])
    # a sequence crossing a row end; the index counts empty sequences too (sequence 2 here)
    with pytest.raises(BoundaryError, match=r"sequence 2 of cu_seqlens \(tokens \[2, 5\).*straddles two rows of length 4"):
        cu_seqlens_to_position_ids(torch.tensor([0, 2, 2, 5, 8]), (2, 4))


def test_cu_seqlens_default_shape_and_empty_sequences():
    assert cu_seqlens_to_position_ids(torch.tensor([0, 3, 5])).tolist() == [[0, 1, 2, 0, 1]]
    # zero-length sequences (repeated offsets) are allowed and occupy nothing
    assert cu_seqlens_to_position_ids(torch.tensor([0, 4, 4, 6, 8]), (2, 4)).tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]


# ---------------------------------------------------------------------------------------------
# resolution (what the ops call)


def test_resolve_returns_int32_position_ids_from_either_form():
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    seq = position_ids_to_seq_idx(pos)
    assert resolve_position_ids(None, None) is None
    for got in (resolve_position_ids(pos), resolve_position_ids(None, seq), resolve_position_ids(pos, seq, 2, 5)):
        assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got.long(), pos)
    # non-contiguous input
    pos_t = pos.t().contiguous().t()
    assert not pos_t.is_contiguous()
    assert torch.equal(resolve_position_ids(pos_t).long(), pos)


def test_resolve_errors():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    with pytest.raises(BoundaryError, match=r"boundaries have shape \(1, 5\) but the activations are \(batch=1, seqlen=6\)"):
        resolve_position_ids(pos, None, 1, 6)
    with pytest.raises(BoundaryError, match=r"position_ids\[0, 2\] = 3"):
        resolve_position_ids(torch.tensor([[0, 1, 3]]))
    with pytest.raises(BoundaryError, match=r"disagree at \[0, 3\]"):
        resolve_position_ids(pos, torch.tensor([[0, 0, 0, 0, 1]]))
    with pytest.raises(BoundaryError, match="different shapes"):
        resolve_position_ids(pos, torch.zeros(1, 4, dtype=torch.long))
    # validate=False skips the check (the caller vouches for the ids)
    bad = torch.tensor([[0, 1, 3]])
    assert resolve_position_ids(bad, validate=False).tolist() == [[0, 1, 3]]


def test_resolve_sees_in_place_changes():
    pos = torch.tensor([[0, 1, 2, 3]])
    assert resolve_position_ids(pos).tolist() == [[0, 1, 2, 3]]
    pos[0, 2:] = torch.tensor([0, 1])  # a new sequence starts: resolved again, nothing is cached
    assert resolve_position_ids(pos).tolist() == [[0, 1, 0, 1]]
    pos[0, 3] = 5  # and now invalid: validation runs again
    with pytest.raises(BoundaryError):
        resolve_position_ids(pos)
    # an unvalidated resolution is not reused by a validating call
    bad = torch.tensor([[0, 2]])
    resolve_position_ids(bad, validate=False)
    with pytest.raises(BoundaryError):
        resolve_position_ids(bad)


def test_resolve_checks_the_same_ids_once_for_a_stack_of_layers(monkeypatch):
    """A stack of ops.PackedMamba layers (each resolving with validate_boundaries on) handed one position_ids tensor
    checks it at the first layer only (each check is a host sync); changed in place it is checked again, and an
    invalid change is refused; ids resolved without a check are checked when a layer asks."""
    import importlib
    mod = importlib.import_module("ops.boundaries")
    checks = []
    real = mod.validate_position_ids
    monkeypatch.setattr(mod, "validate_position_ids", lambda *a, **k: checks.append(1) or real(*a, **k))
    torch.manual_seed(0)
    layers = [ops.PackedMamba(16, d_state=4, d_conv=4, expand=2, use_fast_path=False, layer_idx=i) for i in range(3)]
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    h = torch.randn(1, 8, 16)
    for layer in layers:
        h = h + layer(h, position_ids=pos)
    assert len(checks) == 1
    pos[0, 6] = 0                                   # a valid change: checked again, once
    for layer in layers:
        layer(h, position_ids=pos)
    assert len(checks) == 2
    pos[0, 2] = 7                                   # invalid: refused at the first layer
    with pytest.raises(BoundaryError):
        layers[0](h, position_ids=pos)
    fresh = torch.tensor([[0, 2]])
    resolve_position_ids(fresh, validate=False)     # resolved unchecked: a checking call still checks
    with pytest.raises(BoundaryError):
        resolve_position_ids(fresh)



def test_int64_ids_are_converted_once_and_every_layer_gets_the_same_int32_tensor():
    """int64 ids (what a loader yields) are converted to int32 once per tensor: each resolve hands back the same int32
    tensor, so what the layers keep per tensor (the conv's run mask) is made once a step; a change in place, another
    device or another tensor gets a new conversion, with the new values."""
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    first = resolve_position_ids(pos)
    assert first.dtype == torch.int32 and first is not pos
    assert resolve_position_ids(pos) is first and resolve_position_ids(pos, validate=False) is first
    pos[0, 6] = 0
    again = resolve_position_ids(pos)
    assert again is not first and again.tolist() == pos.tolist()
    other = pos.clone()
    assert resolve_position_ids(other) is not again
    with torch.inference_mode():   # no version counter: converted per call
        inf = torch.tensor([[0, 1, 0]])
        assert resolve_position_ids(inf) is not resolve_position_ids(inf)

def test_resolve_boundaries_all_three_forms():
    rows = [[3, 1, 2], [6]]
    pos, seq, cu = forms_from_lengths(rows)
    for kw in ({"position_ids": pos}, {"seq_idx": seq}, {"cu_seqlens": cu}):
        p, s = resolve_boundaries(**kw, shape=(2, 6), need_seq_idx=True)
        assert torch.equal(p.long(), pos) and torch.equal(s.long(), seq)
        assert p.dtype == torch.int32 and s.dtype == torch.int32
    p, s = resolve_boundaries(position_ids=pos, shape=(2, 6))
    assert s is None
    assert resolve_boundaries(shape=(2, 6)) == (None, None)
    with pytest.raises(BoundaryError, match="needs the"):
        resolve_boundaries(cu_seqlens=cu)


def test_resolve_hands_back_an_already_resolved_tensor_itself():
    pos = torch.tensor([[0, 1, 2, 0, 1]], dtype=torch.int32)
    assert resolve_position_ids(pos) is pos  # a layer below the model's entry costs nothing
    assert resolve_boundaries(pos, shape=(1, 5))[0] is pos
    seq = position_ids_to_seq_idx(pos)
    assert resolve_boundaries(pos, seq, shape=(1, 5))[1] is seq


def test_validation_is_skipped_under_compile(monkeypatch):
    """Under torch.compile validation (a host sync) is skipped: malformed ids pass through unchecked, and the
    cu_seqlens conversion runs without a sync (given the shape)."""
    bad = torch.tensor([[0, 1, 3]])
    with pytest.raises(BoundaryError):
        resolve_position_ids(bad)
    with pytest.raises(BoundaryError, match="straddles"):
        cu_seqlens_to_position_ids(torch.tensor([0, 2, 6]), (2, 3))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_position_ids(bad).tolist() == [[0, 1, 3]]
    assert resolve_boundaries(torch.tensor([[0, 2]]), torch.tensor([[0, 0]]), shape=(1, 2))[0].tolist() == [[0, 2]]
    cu_seqlens_to_position_ids(torch.tensor([0, 2, 6]), (2, 3))  # not checked
    # a valid layout converts the same either way
    rows = [[3, 1, 2], [6]]
    pos, _, cu = forms_from_lengths(rows)
    assert torch.equal(cu_seqlens_to_position_ids(cu, (2, 6)).long(), pos)


@pytest.mark.parametrize("seqlen", [1, 7, 40])
def test_cu_seqlens_conversion_on_random_layouts_with_empty_sequences(seed, seqlen):
    rng = random.Random(seed)
    rows = random_rows(rng, 3, seqlen)
    pos, _, cu = forms_from_lengths(rows)
    cu_list = cu.tolist()
    for _ in range(3):  # zero-length sequences (repeated offsets) anywhere, also at both ends
        i = rng.randrange(len(cu_list))
        cu_list.insert(i, cu_list[i])
    got = cu_seqlens_to_position_ids(torch.tensor(cu_list), (3, seqlen))
    assert torch.equal(got.long(), pos) and got.dtype == torch.int32


# --------------------------------------------------------------------------------------------------
# PackedBoundaries: resolved once, handed to the functional ops


def _packed_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4, 5, 6, 0, 1]])
    b, L, d, n = 2, 10, 6, 4
    f64 = torch.float64
    x = torch.randn(b, d, L, generator=g, dtype=f64)
    w = torch.randn(d, 4, generator=g, dtype=f64)
    bias = torch.randn(d, generator=g, dtype=f64)
    scan = dict(delta=torch.randn(b, d, L, generator=g, dtype=f64), A=-torch.rand(d, n, generator=g, dtype=f64),
                B=torch.randn(b, n, L, generator=g, dtype=f64), C=torch.randn(b, n, L, generator=g, dtype=f64),
                D=torch.randn(d, generator=g, dtype=f64), z=torch.randn(b, d, L, generator=g, dtype=f64))
    return pos, x, w, bias, scan


def test_packed_boundaries_give_the_position_ids_results():
    """Conv and scan with boundaries= equal the same calls with position_ids (outputs, final states, gradients)."""
    pos, x, w, bias, sc = _packed_inputs()
    bounds = ops.PackedBoundaries.resolve(position_ids=pos, count=True)
    assert bounds.num_sequences == int((pos == 0).sum()) and bounds.position_ids.dtype == torch.int32
    num = bounds.num_sequences
    init = torch.randn(num, x.shape[1], 3, dtype=x.dtype)
    h0 = torch.randn(num, x.shape[1], 4, dtype=x.dtype)
    has = torch.arange(num) % 2 == 0
    results = []
    for kw in ({"position_ids": pos}, {"boundaries": bounds}):
        xg = x.clone().requires_grad_(True)
        y, conv_final = ops.packed_causal_conv1d(xg, w, bias, "silu", initial_state=init, has_initial_state=has,
                                                 output_final_state=True, **kw)
        out, final = ops.packed_selective_scan(y, sc["delta"], sc["A"], sc["B"], sc["C"], sc["D"], sc["z"], None,
                                               True, initial_state=h0, has_initial_state=has,
                                               output_final_state=True, **kw)
        (out.sum() + final.sum() + conv_final.sum()).backward()
        results.append((out, final, conv_final, xg.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_packed_boundaries_skip_the_checks_and_keep_what_they_derive(monkeypatch):
    """A call with boundaries= converts and checks nothing (the check ran once, at resolve); derived values are made
    once; seq_idx padding is zeroed as with seq_idx."""
    pos, x, w, bias, sc = _packed_inputs()
    seq = ops.position_ids_to_seq_idx(pos)
    seq[1, -2:] = -1                                   # padding
    bounds = ops.PackedBoundaries.resolve(seq_idx=seq)
    want = ops.packed_causal_conv1d(x, w, bias, seq_idx=seq)
    import importlib

    def boom(*a, **k):
        raise AssertionError("checked again")
    monkeypatch.setattr(importlib.import_module("ops.boundaries"), "validate_position_ids", boom)   # the check
    with pytest.raises(AssertionError, match="checked again"):   # (the patch reaches the position_ids path)
        ops.packed_causal_conv1d(x, w, bias, position_ids=pos)
    got = ops.packed_causal_conv1d(x, w, bias, boundaries=bounds)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got[1, :, -2:] == 0).all()
    ops.packed_selective_scan(x, sc["delta"], sc["A"], sc["B"], sc["C"], boundaries=bounds)
    calls = []
    assert bounds.derived("k", lambda: calls.append(1) or 7) == 7 and bounds.derived("k", lambda: calls.append(1)) == 7
    assert calls == [1]


def test_position_ids_given_again_are_checked_once_and_again_after_a_change(monkeypatch):
    """The same position_ids tensor handed to the functional ops call after call (every layer of a step) is converted
    and checked at its first call only; changed in place, it is checked again (an invalid change is refused); the
    outputs equal those with boundaries=."""
    import importlib
    pos, x, w, bias, sc = _packed_inputs()
    want = ops.packed_causal_conv1d(x, w, bias, "silu",
                                    boundaries=ops.PackedBoundaries.resolve(position_ids=pos.clone()))
    mod = importlib.import_module("ops.boundaries")
    checks = []
    real = mod.validate_position_ids
    monkeypatch.setattr(mod, "validate_position_ids", lambda *a, **k: checks.append(1) or real(*a, **k))
    for _ in range(3):
        got = ops.packed_causal_conv1d(x, w, bias, "silu", position_ids=pos)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        ops.packed_selective_scan(x, sc["delta"], sc["A"], sc["B"], sc["C"], position_ids=pos)
    assert len(checks) == 1
    pos[0, 3] = 0                                       # a valid change: a new sequence starts there
    fresh = pos.clone()
    got = ops.packed_causal_conv1d(x, w, bias, "silu", position_ids=pos)
    assert len(checks) == 2
    torch.testing.assert_close(got, ops.packed_causal_conv1d(x, w, bias, "silu", position_ids=fresh), rtol=0, atol=0)
    pos[0, 1] = 5                                       # invalid (a jump inside a sequence): refused, not reused
    with pytest.raises(BoundaryError):
        ops.packed_causal_conv1d(x, w, bias, "silu", position_ids=pos)


def test_packed_boundaries_errors():
    pos, x, w, bias, sc = _packed_inputs()
    bounds = ops.PackedBoundaries.resolve(position_ids=pos)
    with pytest.raises(ValueError, match="not both"):
        ops.packed_causal_conv1d(x, w, position_ids=pos, boundaries=bounds)
    with pytest.raises(ops.BoundaryError, match="boundaries are for"):
        ops.packed_selective_scan(x[:, :, :5], sc["delta"][:, :, :5], sc["A"], sc["B"][:, :, :5],
                                  sc["C"][:, :, :5], boundaries=bounds)
    with pytest.raises(ops.BoundaryError, match="give position_ids"):
        ops.PackedBoundaries.resolve()
    with pytest.raises(ops.BoundaryError):
        ops.PackedBoundaries.resolve(position_ids=torch.tensor([[0, 2]]))
    counted = ops.PackedBoundaries.resolve(position_ids=pos, count=True)
    with pytest.raises(ValueError, match="boundaries hold"):
        ops.packed_selective_scan(x, sc["delta"], sc["A"], sc["B"], sc["C"], boundaries=counted,
                                  initial_state=torch.zeros(2, x.shape[1], 4, dtype=x.dtype))


def test_packed_boundaries_under_torch_compile():
    """torch.compile(fullgraph=True) traces the ops with boundaries= (final states too, from the counted sequences:
    no host sync), with the eager results."""
    pos, x, w, bias, sc = _packed_inputs()
    x, w, bias = x.float(), w.float(), bias.float()
    sc = {k: v.float() for k, v in sc.items()}
    bounds = ops.PackedBoundaries.resolve(position_ids=pos, count=True)

    def f(x, bounds):
        y = ops.packed_causal_conv1d(x, w, bias, "silu", boundaries=bounds)
        return ops.packed_selective_scan(y, sc["delta"], sc["A"], sc["B"], sc["C"], sc["D"], sc["z"], None, True,
                                         boundaries=bounds, output_final_state=True)

    got = torch.compile(f, fullgraph=True)(x, bounds)
    want = f(x, bounds)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------------------
# What the scan's plan may know without a sync: rows of one sequence

def test_validation_records_whether_every_row_is_one_sequence():
    from ops.boundaries import single_sequence_rows

    one = torch.arange(7, dtype=torch.int32).expand(3, 7).contiguous()
    packed = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3]], dtype=torch.int32)
    last_short = torch.tensor([[0, 1, 2, 3, 4, 5, 0]], dtype=torch.int32)   # ends in a new sequence of 1
    for ids in (one, packed, last_short):
        assert not single_sequence_rows(ids)          # nothing known before a check
    validate_position_ids(one)
    validate_position_ids(packed)
    validate_position_ids(last_short)
    assert single_sequence_rows(one)
    assert not single_sequence_rows(packed)
    assert not single_sequence_rows(last_short)
    one[1, 3] = 0                                   # changed in place: no longer known
    assert not single_sequence_rows(one)
    with pytest.raises(BoundaryError, match=r"position_ids\[0, 2\] = 5"):
        bad = torch.tensor([[0, 1, 5, 6]], dtype=torch.int32)
        validate_position_ids(bad)
    assert not single_sequence_rows(bad)
    # through the model-level resolution: the int32 tensor the kernels get is the one known
    pos = resolve_position_ids(torch.arange(5).expand(2, 5), batch=2, seqlen=5)
    assert pos.dtype == torch.int32 and single_sequence_rows(pos)
    assert not single_sequence_rows(resolve_position_ids(torch.arange(5).expand(2, 5), validate=False))


def test_shared_row_positions_are_made_once_and_usable_everywhere():
    from ops.boundaries import row_positions, shared_row_positions, single_sequence_rows

    a = shared_row_positions(2, 9, "cpu")
    assert a is shared_row_positions(2, 9, torch.device("cpu"))
    assert torch.equal(a, row_positions(2, 9)) and a.dtype == torch.int32 and a.is_contiguous()
    assert single_sequence_rows(a)
    assert shared_row_positions(3, 9, "cpu") is not a
    # first made under inference mode, the ids still serve a training step (saved for backward)
    with torch.inference_mode():
        b = shared_row_positions(1, 11, "cpu")
    assert not b.is_inference()
    x = torch.randn(1, 11, requires_grad=True)
    (x * b).sum().backward()
    assert torch.equal(x.grad, b.float())
    # under torch.compile they are made afresh (nothing kept from a traced call)
    from ops.boundaries import _shared_rows

    def f(t):
        return t + shared_row_positions(1, 5, "cpu")

    out = torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(1, 5, dtype=torch.int32))
    assert out.tolist() == [[0, 1, 2, 3, 4]] and (1, 5, "cpu") not in _shared_rows


def test_the_scan_runs_rows_of_one_sequence_whole():
    from ops.boundaries import shared_row_positions
    from ops.contract import scan_bwd_segments, scan_fwd_segments
    from ops.selective_scan_interface import _segments

    u = torch.empty(1, 1024, 2048)
    planned_fwd, planned_bwd = scan_fwd_segments(1, 1024, 2048, 132), scan_bwd_segments(1, 1024, 2048, 132)
    assert planned_fwd > 1 and planned_bwd > 1      # a small grid: cut into segments where it can be
    one = torch.arange(2048, dtype=torch.int32).expand(1, 2048).contiguous()
    assert _segments(scan_fwd_segments, u, one) == planned_fwd       # not known yet: the plan
    validate_position_ids(one)
    assert _segments(scan_fwd_segments, u, one) == 1
    assert _segments(scan_bwd_segments, u, one) == 1
    assert _segments(scan_fwd_segments, u, shared_row_positions(1, 2048, "cpu")) == 1
    packed = one.clone()
    packed[0, 1000] = 0
    packed[0, 1001:] = torch.arange(1, 1048, dtype=torch.int32)
    validate_position_ids(packed)
    assert _segments(scan_fwd_segments, u, packed) == planned_fwd
    assert _segments(scan_bwd_segments, u, packed) == planned_bwd
