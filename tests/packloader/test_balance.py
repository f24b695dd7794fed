"""Compute-balanced placement of rows onto ranks (``balance="compute"``, issue 35): every row exactly once,
the cost spread across ranks below token balancing on a skewed mix, resume exact and elastic, and the
calibration of ``attention_factor`` (a fake clock: the arithmetic, not the machine)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from packloader import PackedDataLoader
from packloader.distributed import (assign_rows, assign_rows_by_cost, calibrate_attention_factor, num_batches,
                                    row_costs, step_cost_spread)
from tests.packloader.conftest import write_arrow
from tests.packloader.loader_fixtures import assert_exact_cover, batch_fingerprint

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

CAPACITY = 256


def skewed_lengths(rng, n_rows: int) -> list[list[int]]:
    """Rows of CAPACITY tokens: a third hold one long sequence, the rest many short ones (the hybrid's
    worst case for token balancing: equal tokens, very unequal attention cost)."""
    rows = []
    for _ in range(n_rows):
        if rng.random() < 0.33:
            rows.append([CAPACITY - int(rng.integers(0, 8))])
        else:
            lens, left = [], CAPACITY - int(rng.integers(0, 8))
            while left > 0:
                n = min(left, int(rng.integers(4, 24)))
                lens.append(n)
                left -= n
            rows.append(lens)
    return rows


def test_row_costs_float64_reference_and_errors():
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(1, 300, rng.integers(0, 6))) for _ in range(40)]
    off = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    lengths = np.array([n for r in rows for n in r], dtype=np.int64)
    af = 3.7e-3
    want = [sum(float(n) + af * float(n) * float(n) for n in r) for r in rows]
    np.testing.assert_allclose(row_costs(off, lengths, af), want, rtol=1e-12)
    np.testing.assert_array_equal(row_costs(off, lengths, 0.0), [sum(r) for r in rows])
    with pytest.raises(ValueError, match="attention_factor"):
        row_costs(off, lengths, -1.0)
    with pytest.raises(ValueError, match="row_offsets"):
        row_costs(off[:-1], lengths, 1.0)


@pytest.mark.parametrize("world, batch", [(1, 3), (2, 1), (2, 4), (3, 2), (8, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_assign_rows_by_cost_every_row_once_equal_counts(world, batch, drop_last):
    rng = np.random.default_rng(world * 10 + batch)
    for n in [0, 1, world * batch - 1, world * batch, 7 * world * batch + 3]:
        cost = rng.pareto(1.2, n) * 100
        for offset in sorted({0, min(n, 3), n}):
            a = assign_rows_by_cost(cost, world, batch, drop_last, offset)
            nb = num_batches(n - offset, world, batch, drop_last)
            assert a.shape == (world, nb, batch)
            used = np.sort(a[a >= 0])
            hi = offset + nb * world * batch if drop_last else n
            np.testing.assert_array_equal(used, np.arange(offset, min(hi, n)))
            S = world * batch
            for s in range(nb):  # step s holds exactly its window of plan rows, in plan order per batch
                rows = a[:, s][a[:, s] >= 0]
                assert set(rows.tolist()) == set(range(offset + s * S, min(offset + (s + 1) * S, n)))
                for w in range(world):
                    real = a[w, s][a[w, s] >= 0]
                    assert (np.diff(real) > 0).all() and (a[w, s][len(real):] == -1).all()
                loads = [cost[a[w, s][a[w, s] >= 0]].sum() for w in range(world)]
                # the greedy bound: the largest load is at most the mean plus the largest row
                if len(rows):
                    assert max(loads) <= sum(loads) / world + cost[rows].max() + 1e-9


def test_cost_balance_reduces_spread_against_token_balance():
    rng = np.random.default_rng(1)
    rows = skewed_lengths(rng, 400)
    off = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    lengths = np.array([n for r in rows for n in r], dtype=np.int64)
    tokens = np.array([sum(r) for r in rows], dtype=np.int64)
    cost = row_costs(off, lengths, attention_factor=0.05)
    for world, batch in [(2, 4), (4, 2), (8, 4)]:
        by_tokens = step_cost_spread(assign_rows(tokens, world, batch, True), cost)
        by_cost = step_cost_spread(assign_rows_by_cost(cost, world, batch, True), cost)
        greedy = step_cost_spread(assign_rows_by_cost(cost, world, batch, True, max_swaps=0), cost)
        print(world, batch, by_tokens.mean(), greedy.mean(), by_cost.mean())
        assert by_cost.mean() < by_tokens.mean() - 0.05, (by_cost.mean(), by_tokens.mean())
        assert by_cost.max() <= by_tokens.max() + 1e-12
        assert by_cost.mean() <= greedy.mean() + 1e-12  # the swaps never make a step worse
    # attention_factor 0: the cost is the token count, and the placement the token balancer's quality
    plain = row_costs(off, lengths, 0.0)
    np.testing.assert_array_equal(plain, tokens)


def skewed_corpus(tmp_path, seed: int):
    """Two shards of sequences whose best-fit rows are a skewed mix (see skewed_lengths)."""
    rng = np.random.default_rng(seed)
    seqs = [[], []]
    for k, row in enumerate(skewed_lengths(rng, 60)):
        for n in row:
            seqs[k % 2].append(rng.integers(0, 500, n, dtype=np.int32))
    paths = [write_arrow(tmp_path / f"skew-{k}.arrow", s, batch_rows=50) for k, s in enumerate(seqs)]
    return paths, seqs


def loader(paths, **kw):
    base = dict(capacity=CAPACITY, batch_size=2, algorithm="bfd", seed=5, return_ids=True)
    return PackedDataLoader(paths, **{**base, **kw})


def test_loader_compute_balance_cover_spread_and_exact_resume(tmp_path):
    paths, seqs = skewed_corpus(tmp_path, 3)
    af, world = 0.05, 2
    ranks = [loader(paths, rank=r, world_size=world, balance="compute", attention_factor=af) for r in range(world)]
    plain = [loader(paths, rank=r, world_size=world) for r in range(world)]
    assert len({len(x) for x in ranks + plain}) == 1
    batches = [list(x) for x in ranks]
    pieces = [tuple(p) for bs in batches for b in bs for p in b["sample_ids"][:, 1:].tolist()]
    assert_exact_cover(pieces, seqs)

    def cost_of(batch):  # the batch's cost from what it holds
        lens = batch["sample_ids"][:, 4].numpy().astype(np.float64)
        return float((lens + af * lens * lens).sum())

    def spread(per_rank):
        loads = np.array([[cost_of(b) for b in bs] for bs in per_rank])
        return (loads.max(0) / loads.mean(0)).mean()

    balanced, tokens = spread(batches), spread([list(x) for x in plain])
    print(f"cost spread: compute {balanced:.3f}, tokens {tokens:.3f}")
    assert balanced < tokens - 0.05
    # a mid-epoch state (JSON) continues exactly on every rank
    cut = len(batches[0]) // 2
    for r in range(world):
        it = iter(ranks[r])
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(ranks[r].state_dict()))
        assert state["rows_consumed"] == cut * world * 2 and state["settings"]["balance"] == f"compute:{af!r}"
        fresh = loader(paths, rank=r, world_size=world, balance="compute", attention_factor=af)
        fresh.load_state_dict(state)
        assert [batch_fingerprint(b) for b in fresh] == [batch_fingerprint(b) for b in batches[r][cut:]]
    # balance may change on resume (it does not make the plan): a token-balanced run continued with
    # compute balancing on 3 ranks covers the rest exactly once
    it = iter(plain[0])
    first = [next(it) for _ in range(cut)]
    its = [iter(plain[1])]
    second = [next(its[0]) for _ in range(cut)]
    state = plain[0].state_dict()
    rest = []
    for r in range(3):
        x = loader(paths, rank=r, world_size=3, balance="compute", attention_factor=af)
        x.load_state_dict(state)
        rest += list(x)
    pieces = [tuple(p) for b in first + second + rest for p in b["sample_ids"][:, 1:].tolist()]
    assert_exact_cover(pieces, seqs)


def test_loader_balance_arguments_are_checked(tmp_path):
    paths, _ = skewed_corpus(tmp_path, 4)
    with pytest.raises(ValueError, match="balance must be"):
        loader(paths, balance="flops")
    with pytest.raises(ValueError, match="needs attention_factor"):
        loader(paths, balance="compute")
    with pytest.raises(ValueError, match="needs attention_factor"):
        loader(paths, balance="compute", attention_factor=-0.1)
    with pytest.raises(ValueError, match="only used with balance='compute'"):
        loader(paths, attention_factor=0.1)
    with pytest.raises(ValueError, match="overflow='carry'"):
        loader(paths, balance="compute", attention_factor=0.1, overflow="carry")


def test_calibrate_attention_factor_recovers_a_known_cost_model():
    a, b, overhead = 2e-6, 3e-9, 1e-4  # seconds per token, per query-key pair, per call
    now = [0.0]
    seen = []

    def step(position_ids):
        pos = position_ids[0].numpy()
        starts = np.flatnonzero(pos == 0)
        lens = np.diff(np.append(starts, len(pos)))
        seen.append(len(lens))
        now[0] += overhead + a * lens.sum() + b * float((lens.astype(np.float64) ** 2).sum())

    cal = calibrate_attention_factor(step, capacity=1000, short_length=64, repeats=3, warmup=1,
                                     synchronize=lambda: None, clock=lambda: now[0])
    assert set(seen) == {1, 16}  # 15 sequences of 64 tokens and one of 40
    want = b / (a + overhead / 1000)  # the fixed overhead is spread over the row's tokens
    assert cal.attention_factor == pytest.approx(want, rel=1e-9)
    assert cal.seconds_long > cal.seconds_short and (cal.capacity, cal.short_length) == (1000, 64)
    # no attention: the two rows cost the same, the factor is 0
    flat = calibrate_attention_factor(lambda pos: now.__setitem__(0, now[0] + 1e-3), capacity=100, repeats=2,
                                      warmup=0, short_length=10, synchronize=lambda: None, clock=lambda: now[0])
    assert flat.attention_factor == 0.0
    # timings that leave no per-token cost (one 100-token sequence 11x the time of ten of 10 tokens, more than the
    # 10x that attention alone would give): refused, not a factor of 0 that would switch balancing off
    readings = iter([0.0, 1.0, 1.0, 12.0])    # short row: 1 s, long row: 11 s
    with pytest.raises(ValueError, match="no per-token cost"):
        calibrate_attention_factor(lambda pos: None, capacity=100, repeats=1, warmup=0, short_length=10,
                                   synchronize=lambda: None, clock=lambda: next(readings))
    with pytest.raises(ValueError, match="short_length"):
        calibrate_attention_factor(step, capacity=64, short_length=64)
    with pytest.raises(ValueError, match="repeats"):
        calibrate_attention_factor(step, capacity=64, repeats=0)


def test_bench_balance_varlen_attention_is_per_sequence_causal_attention():
    """The attention benchmarks/bench_balance.py gives the hybrid (CPU path: SDPA per sequence): equal, in
    float64, to causal attention over each packed sequence alone (grouped key/value heads repeated)."""
    import os
    import sys

    import torch
    import torch.nn.functional as F

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    sys.path.insert(0, here)
    try:
        import bench_balance
    finally:
        sys.path.remove(here)
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = 2, 4, 2, 24, 8
    q, k, v = (torch.randn(B, h, L, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    lens = [[5, 11, 8], [24]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    out, _ = bench_balance.varlen_attention(None, q, k, v, None, position_ids=pos)
    assert out.shape == (B, L, H, D)
    for b, row in enumerate(lens):
        s = 0
        for n in row:
            kk, vv = (t[b:b + 1, :, s:s + n].repeat_interleave(H // Hkv, 1) for t in (k, v))
            ref = F.scaled_dot_product_attention(q[b:b + 1, :, s:s + n], kk, vv, is_causal=True)[0].transpose(0, 1)
            torch.testing.assert_close(out[b, s:s + n], ref, rtol=1e-12, atol=1e-12)
            s += n
    with pytest.raises(ValueError, match="position_ids"):
        bench_balance.varlen_attention(None, q, k, v, None)


def test_cost_sorted_order_sorts_inside_windows_only():
    from packloader.balance import cost_sorted_order

    rng = np.random.default_rng(7)
    cost = rng.integers(0, 5, 103).astype(np.float64)  # many ties
    for window in (1, 8, 50, 500):
        order = cost_sorted_order(cost, window)
        np.testing.assert_array_equal(np.sort(order), np.arange(103))
        for lo in range(0, 103, window):
            part = order[lo:lo + window]
            assert part.min() >= lo and part.max() < lo + window  # rows never leave their window
            c = cost[part]
            assert (np.diff(c) <= 0).all()
            for value in np.unique(c):  # ties keep plan order
                assert (np.diff(part[c == value]) > 0).all()
    np.testing.assert_array_equal(cost_sorted_order(cost, 1), np.arange(103))
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        cost_sorted_order(cost, 0)


def test_loader_cost_sort_window_steps_cover_resume(tmp_path):
    """Rows into steps by cost: every sequence once, less waiting than per-step balancing alone (the
    summed slowest-rank cost of the steps), exact resume, elastic resume, a state of another plan refused."""
    paths, seqs = skewed_corpus(tmp_path, 3)
    af, world = 0.05, 2

    def make(**kw):
        return [loader(paths, rank=r, world_size=world, balance="compute", attention_factor=af, **kw)
                for r in range(world)]

    def cost_of(batch):
        lens = batch["sample_ids"][:, 4].numpy().astype(np.float64)
        return float((lens + af * lens * lens).sum())

    sorted_ranks, plain_ranks = make(cost_sort_window=16), make()
    runs = [list(x) for x in sorted_ranks]
    plain = [list(x) for x in plain_ranks]
    assert len(runs[0]) == len(runs[1]) == len(plain[0])
    assert_exact_cover([tuple(p) for bs in runs for b in bs for p in b["sample_ids"][:, 1:].tolist()], seqs)

    def slowest_sum(per_rank):
        return np.array([[cost_of(b) for b in bs] for bs in per_rank]).max(0).sum()

    print(f"summed slowest-rank cost: sorted {slowest_sum(runs):.0f}, per-step only {slowest_sum(plain):.0f}")
    assert slowest_sum(runs) < 0.95 * slowest_sum(plain)
    assert "cost-sorted:window=16" in sorted_ranks[0].state_dict()["settings"]["source"]
    cut = len(runs[0]) // 2
    states = []
    for r in range(world):
        it = iter(sorted_ranks[r])
        for _ in range(cut):
            next(it)
        states.append(json.loads(json.dumps(sorted_ranks[r].state_dict())))
        fresh = make(cost_sort_window=16)[r]
        fresh.load_state_dict(states[-1])
        assert [batch_fingerprint(b) for b in fresh] == [batch_fingerprint(b) for b in runs[r][cut:]]
    rest = []
    for r in range(3):  # elastic: 3 ranks
        x = loader(paths, rank=r, world_size=3, balance="compute", attention_factor=af, cost_sort_window=16)
        x.load_state_dict(states[0])
        rest += list(x)
    done = [b for bs in runs for b in bs[:cut]]
    assert_exact_cover([tuple(p) for b in done + rest for p in b["sample_ids"][:, 1:].tolist()], seqs)
    with pytest.raises(ValueError, match="'source'"):
        make()[0].load_state_dict(states[0])
    with pytest.raises(ValueError, match="needs balance='compute'"):
        loader(paths, cost_sort_window=16)
    with pytest.raises(ValueError, match="cost_sort_window must be an int >= 1"):
        loader(paths, balance="compute", attention_factor=af, cost_sort_window=0)
