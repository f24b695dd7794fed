"""overflow="carry": chains in order, continuation pieces alone in their rows, the same efficiency as
"split", and clear errors for plans that break the rule."""
import json
import pathlib

import numpy as np
import pytest

from packer_algos import OnlinePacker, pack
from packer_algos.chains import carry_row_order, chain_links, permute_rows

WIKI = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "graphcore_wikipedia_lengths.json"


def long_doc_mix(n, capacity, seed, long_share=0.05):
    """Lognormal lengths with ``long_share`` of the documents 4-16x ``capacity``."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(5.5, 0.9, n)), 1, capacity).astype(np.int64)
    long = rng.random(n) < long_share
    lengths[long] = rng.integers(4 * capacity, 16 * capacity + 1, int(long.sum()))
    return lengths


def chains_of(plan):
    """{item: [(row, start, length), ...]} in token order, for the cut items."""
    out = {}
    for b in range(plan.n_bins):
        for i, s, n in zip(*(a.tolist() for a in plan.bin(b))):
            out.setdefault(i, []).append((b, s, n))
    return {i: sorted(p, key=lambda x: x[1]) for i, p in out.items() if len(p) > 1}


@pytest.mark.parametrize("algorithm", ["bfd", "ffd", "first_fit", "next_fit", "online"])
def test_carry_keeps_each_chain_in_row_order(algorithm):
    lengths = long_doc_mix(3000, 256, seed=1)
    plan = pack(lengths, 256, algorithm, overflow="carry").validate(lengths)
    chains = chains_of(plan)
    assert set(chains) == set(np.flatnonzero(lengths > 256).tolist())
    for item, pieces in chains.items():
        rows = [r for r, _, _ in pieces]
        assert rows == sorted(rows) and len(set(rows)) == len(rows)
        # piece 0 the remainder, then whole rows, each alone in its row and right after the previous
        assert pieces[0][2] == lengths[item] - (len(pieces) - 1) * 256
        for r, _, n in pieces[1:]:
            assert n == 256 and plan.bin(r)[0].size == 1
        assert rows[1:] == list(range(rows[1], rows[1] + len(rows) - 1))


def test_chain_links_of_a_carry_plan():
    plan = pack([25, 3, 7, 20, 4], 10, "bfd", overflow="carry")
    ch = chain_links(plan.bin_offsets, plan.item_ids, plan.starts, plan.lengths)
    rows_of_25 = [b for b in range(plan.n_bins) if 0 in plan.bin(b)[0].tolist()]
    assert ch.pred_row[rows_of_25[1]] == rows_of_25[0] and ch.pred_row[rows_of_25[2]] == rows_of_25[1]
    p0 = int(np.flatnonzero((plan.item_ids == 0) & (plan.starts == 0))[0])
    assert ch.piece_index[p0] == 0 and ch.in_chain[p0] and ch.next_row[p0] == rows_of_25[1]
    whole = int(np.flatnonzero(plan.item_ids == 1)[0])
    assert not ch.in_chain[whole] and ch.next_row[whole] == -1
    assert sorted(ch.chain_pieces.tolist()) == [2, 3]


@pytest.mark.parametrize("capacity, seed", [(4096, 0), (1024, 1)])
def test_carry_packs_within_one_percent_of_split_on_long_documents(capacity, seed):
    lengths = long_doc_mix(20_000, capacity, seed)
    for algorithm, kw in (("bfd", {}), ("online", {"buffer_size": 1000})):
        split = pack(lengths, capacity, algorithm, overflow="split", **kw)
        carry = pack(lengths, capacity, algorithm, overflow="carry", **kw).validate(lengths)
        assert carry.total_tokens == split.total_tokens == int(lengths.sum())
        assert carry.efficiency >= split.efficiency - 0.01, (algorithm, carry.efficiency, split.efficiency)


@pytest.mark.skipif(not WIKI.exists(), reason="shared data folder absent")
def test_carry_packs_within_one_percent_of_split_on_wikipedia_histogram():
    counts = np.asarray(json.loads(WIKI.read_text())["wikipedia"]["counts"], dtype=np.int64)
    lengths = np.repeat(np.arange(1, counts.size + 1), counts // 200)  # 1/200 of the histogram
    for capacity in (512, 128):  # 128: a quarter of the histogram is cut into chains
        split = pack(lengths, capacity, "bfd", overflow="split")
        carry = pack(lengths, capacity, "bfd", overflow="carry").validate(lengths)
        assert carry.efficiency >= split.efficiency - 0.01


def _plan_arrays(rows):
    """CSR arrays of rows given as lists of (doc, start, length)."""
    off = np.cumsum([0] + [len(r) for r in rows])
    flat = [p for r in rows for p in r]
    return off, *(np.array([p[k] for p in flat]) for k in range(3))


def test_chain_links_refuses_a_continuation_sharing_its_row():
    off, doc, start, length = _plan_arrays([[(0, 0, 4)], [(0, 4, 4), (1, 0, 2)]])
    with pytest.raises(ValueError, match="row 1 holds piece 1 of sequence 0 together with other pieces"):
        chain_links(off, doc, start, length)


def test_chain_links_refuses_a_missing_predecessor():
    off, doc, start, length = _plan_arrays([[(0, 0, 4)], [(0, 8, 4)]])
    with pytest.raises(ValueError, match="predecessor never comes"):
        chain_links(off, doc, start, length)


def test_chain_links_refuses_rows_out_of_chain_order():
    off, doc, start, length = _plan_arrays([[(0, 4, 4)], [(0, 0, 4), (1, 0, 2)]])
    with pytest.raises(ValueError, match="not after its predecessor's row 1"):
        chain_links(off, doc, start, length)


def test_carry_row_order_restores_the_rule_after_a_shuffle():
    lengths = long_doc_mix(500, 64, seed=3)
    plan = pack(lengths, 64, "bfd", overflow="carry")
    perm = np.random.default_rng(0).permutation(plan.n_bins)
    off, ids, starts, lens = permute_rows(plan.bin_offsets, perm, plan.item_ids, plan.starts, plan.lengths)
    with pytest.raises(ValueError, match="carry"):
        chain_links(off, ids, starts, lens)
    off2, ids2, starts2, lens2 = permute_rows(off, carry_row_order(off, ids, starts), ids, starts, lens)
    chain_links(off2, ids2, starts2, lens2)
    # anchor rows keep the shuffled order
    anchors = [ids[off[r]] * 10**6 + starts[off[r]] for r in range(len(off) - 1) if starts[off[r]] == 0]
    anchors2 = [ids2[off2[r]] * 10**6 + starts2[off2[r]] for r in range(len(off2) - 1) if starts2[off2[r]] == 0]
    assert anchors == anchors2


def test_online_packer_refuses_carry_and_pack_names_it():
    with pytest.raises(ValueError, match="packer_algos.pack"):
        OnlinePacker(10, 4, overflow="carry")
    with pytest.raises(ValueError, match="'carry'"):
        pack([5, 30], 10, "bfd")
    with pytest.raises(ValueError, match="overflow must be one of"):
        pack([5, 30], 10, "bfd", overflow="carried")
