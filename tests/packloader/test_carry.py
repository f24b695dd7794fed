"""overflow="carry" in the loader: the rule (packloader.carry), the guarantees on every rank, the batch keys,
exact and elastic resume, workers, and the pre-packed path."""
import os
import warnings

import numpy as np
import pytest

from packloader import PackedDataLoader
from packloader.carry import DOC_KEY_SHIFT, CarrySchedule

from .conftest import write_arrow

CAP = 32


@pytest.fixture(scope="module")
def carry_shards(tmp_path_factory):
    """3 shards of short sequences with ~10% documents 3-9x the capacity."""
    d = tmp_path_factory.mktemp("carry")
    rng = np.random.default_rng(0)
    paths, docs = [], {}
    for f in range(3):
        lens = rng.integers(1, 30, 70)
        long = rng.random(70) < 0.1
        lens[long] = rng.integers(3 * CAP, 9 * CAP, int(long.sum()))
        seqs = [rng.integers(1, 30000, n).astype(np.int32) for n in lens]
        for r, s in enumerate(seqs):
            docs[(f, r)] = s
        paths.append(write_arrow(os.path.join(d, f"s{f}.arrow"), seqs))
    return paths, docs


def loaders(paths, world_size, **kw):
    kw = {"capacity": CAP, "batch_size": 2, "overflow": "carry", "seed": 3, "return_ids": True, **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [PackedDataLoader(paths, rank=r, world_size=world_size, **kw) for r in range(world_size)]


def segments(batch):
    """Per segment: (doc key, piece index, has_initial_state, continues_after, row, tokens)."""
    ids = batch["input_ids"].reshape(-1).numpy()
    cu = batch["cu_seqlens"].tolist()
    L = batch["input_ids"].shape[1]
    keys = [batch[k].tolist() for k in ("piece_doc_ids", "piece_index", "has_initial_state", "continues_after")]
    assert all(len(k) == len(cu) - 1 for k in keys)
    return [(keys[0][i], keys[1][i], keys[2][i], keys[3][i], cu[i] // L, ids[cu[i]:cu[i + 1]])
            for i in range(len(cu) - 1)]


def check_guarantees(per_rank, docs, restarted=(), before=None):
    """(a) in order on one rank, (b) has_initial_state only after the predecessor on that rank,
    (c) the same number of batches; every cut document's pieces put together are its tokens.
    ``before``: per rank, the pieces delivered before a resume ({doc: last piece index}).
    Returns {doc: [(rank, piece index, has_initial_state)]}."""
    assert len({len(b) for b in per_rank}) == 1
    seen = {}
    got_tokens = {}
    for rank, batches in enumerate(per_rank):
        last = dict(before[rank]) if before else {}
        for batch in batches:
            for doc, k, initial, after, row, toks in segments(batch):
                if doc < 0:
                    assert k == 0 and not initial and not after
                    continue
                seen.setdefault(doc, []).append((rank, k, initial, after))
                if k > 0 and initial:
                    assert last.get(doc) == k - 1, f"piece {k} of {doc} on rank {rank} without its predecessor"
                if k > 0 and not initial:
                    assert doc in restarted, f"piece {k} of {doc} restarts unannounced"
                if k == 0:
                    assert not initial and doc not in last
                last[doc] = k
                got_tokens.setdefault(doc, {})[k] = toks
    for doc, pieces in seen.items():
        ranks = {r for r, *_ in pieces}
        assert len(ranks) == 1, f"document {doc} on ranks {ranks}"
        for i, (_, k, _, after) in enumerate(pieces):
            assert after == (i + 1 < len(pieces)), f"continues_after of piece {k} of {doc}"
        if before is None:
            f, r = doc >> DOC_KEY_SHIFT, doc & ((1 << DOC_KEY_SHIFT) - 1)
            ks = sorted(got_tokens[doc])
            assert ks == list(range(len(ks)))
            np.testing.assert_array_equal(np.concatenate([got_tokens[doc][k] for k in ks]), docs[(f, r)])
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("algorithm", ["online", "bfd"])
def test_every_rank_gets_chains_in_order(carry_shards, world_size, algorithm):
    paths, docs = carry_shards
    per_rank = [list(ld) for ld in loaders(paths, world_size, algorithm=algorithm)]
    seen = check_guarantees(per_rank, docs)
    cut = {(f << DOC_KEY_SHIFT) | r for (f, r), s in docs.items() if len(s) > CAP}
    assert set(seen) == cut
    # every token once across ranks (no row lost, none repeated)
    n_tok = sum(len(s) for s in docs.values())
    placed = sum(int(b["sample_ids"][:, 4].sum()) for bs in per_rank for b in bs)
    assert placed == n_tok


@pytest.mark.parametrize("world_size", [1, 3])
def test_one_piece_per_step(carry_shards, world_size):
    """carry_one_piece_per_step: the guarantees hold, every token comes once, and no step (all ranks' batches of
    it) holds two pieces of one document: every continuation's predecessor is in an earlier step (which the
    default schedule does not give)."""
    paths, docs = carry_shards
    per_rank = [list(ld) for ld in loaders(paths, world_size, carry_one_piece_per_step=True)]
    check_guarantees(per_rank, docs)
    n_tok = sum(len(s) for s in docs.values())
    assert sum(int(b["sample_ids"][:, 4].sum()) for bs in per_rank for b in bs) == n_tok

    def steps_with_two_pieces(per_rank):
        count = 0
        for step in range(len(per_rank[0])):
            docs_in_step = [d for bs in per_rank for d in bs[step]["piece_doc_ids"].tolist() if d >= 0]
            count += len(docs_in_step) != len(set(docs_in_step))
        return count

    assert steps_with_two_pieces(per_rank) == 0
    assert steps_with_two_pieces([list(ld) for ld in loaders(paths, world_size)]) > 0
    with pytest.raises(ValueError, match="needs overflow='carry'"):
        loaders(paths, 1, overflow="split", carry_one_piece_per_step=True)


def test_one_piece_per_step_resumes_exactly(carry_shards):
    paths, _ = carry_shards
    full = list(loaders(paths, 2, carry_one_piece_per_step=True)[0])
    lds = loaders(paths, 2, carry_one_piece_per_step=True)
    it = iter(lds[0])
    head = [next(it) for _ in range(5)]
    state = lds[0].state_dict()
    ld = loaders(paths, 2, carry_one_piece_per_step=True)[0]
    ld.load_state_dict(state)
    rest = list(ld)
    assert len(head) + len(rest) == len(full)
    for x, y in zip(head + rest, full):
        for k in ("input_ids", "piece_doc_ids", "piece_index", "has_initial_state", "continues_after"):
            assert (x[k] == y[k]).all()


def test_position_ids_restart_at_every_piece(carry_shards):
    paths, docs = carry_shards
    batch = next(b for b in loaders(paths, 1)[0] if (b["piece_index"] > 0).any())
    starts = batch["cu_seqlens"][:-1]
    assert (batch["position_ids"].reshape(-1)[starts] == 0).all()
    assert batch["has_initial_state"].dtype.is_floating_point is False
    assert str(batch["piece_doc_ids"].dtype) == "torch.int64" and str(batch["piece_index"].dtype) == "torch.int32"


def test_workers_give_the_same_batches(carry_shards):
    paths, _ = carry_shards
    a = list(loaders(paths, 2)[1])
    b = list(loaders(paths, 2, num_workers=2)[1])
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in ("input_ids", "piece_doc_ids", "piece_index", "has_initial_state", "continues_after"):
            assert (x[k] == y[k]).all()


def _open_chain_step(per_rank):
    """A batch index after which some chain is open (its next piece comes later)."""
    for k in range(len(per_rank[0]) - 1):
        if any(bool(b[k]["continues_after"].any()) for b in per_rank):
            later = any(bool(b[k + 1]["has_initial_state"].any()) for b in per_rank)
            if later:
                return k + 1
    raise AssertionError("no chain crosses a step")


def _consume(lds, k):
    its = [iter(ld) for ld in lds]
    out = [[next(it) for _ in range(k)] for it in its]
    return out, lds[0].state_dict()


def _last_pieces(batches):
    last = {}
    for b in batches:
        for doc, k, *_ in segments(b):
            if doc >= 0:
                last[doc] = k
    return last


def test_exact_resume_mid_chain(carry_shards):
    paths, docs = carry_shards
    full = [list(ld) for ld in loaders(paths, 2)]
    k = _open_chain_step(full)
    head, state = _consume(loaders(paths, 2), k)
    assert state["carry"]["pins"], "the checkpoint is inside a chain"
    fresh = loaders(paths, 2)
    for ld in fresh:
        ld.load_state_dict(state)
    rest = [list(ld) for ld in fresh]
    for r in range(2):
        assert len(head[r]) + len(rest[r]) == len(full[r])
        for x, y in zip(head[r] + rest[r], full[r]):
            for key in ("input_ids", "piece_doc_ids", "piece_index", "has_initial_state", "continues_after"):
                assert (x[key] == y[key]).all()
    # the resumed piece of an open chain has its state (has_initial_state) and its predecessor was before
    pinned_rows = {r for r, _ in state["carry"]["pins"]}
    assert pinned_rows
    check_guarantees(rest, docs, before=[_last_pieces(h) for h in head])


def test_elastic_resume_same_world_size_keeps_chains(carry_shards):
    paths, docs = carry_shards
    full = [list(ld) for ld in loaders(paths, 2)]
    k = _open_chain_step(full)
    head, state = _consume(loaders(paths, 2), k)
    fresh = loaders(paths, 2, batch_size=3, num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no restart warning
        for ld in fresh:
            ld.load_state_dict(state)
    rest = [list(ld) for ld in fresh]
    before = [_last_pieces(h) for h in head]
    check_guarantees(rest, docs, before=before)
    # every piece exactly once over the two runs, each document on one rank
    pieces = {}
    for r, part in enumerate(head + rest):
        for b in part:
            for doc, kk, *_ in segments(b):
                if doc >= 0:
                    pieces.setdefault(doc, []).append((r % 2, kk))
    for doc, ps in pieces.items():
        assert sorted(kk for _, kk in ps) == list(range(len(ps)))
        assert len({r for r, _ in ps}) == 1


@pytest.mark.parametrize("new_world", [1, 3])
def test_elastic_resume_other_world_size_restarts_exactly_the_open_chains(carry_shards, new_world):
    paths, docs = carry_shards
    full = [list(ld) for ld in loaders(paths, 2)]
    k = _open_chain_step(full)
    head, state = _consume(loaders(paths, 2), k)
    fresh = loaders(paths, new_world)
    with pytest.warns(UserWarning, match=r"chain\(s\) interrupted by the checkpoint restart"):
        fresh[0].load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ld in fresh[1:]:
            ld.load_state_dict(state)
    rest = [list(ld) for ld in fresh]
    # the documents whose last piece before the checkpoint said continues_after
    head_last, open_docs = {}, set()
    for h in head:
        for b in h:
            for doc, kk, _, after, *_ in segments(b):
                if doc >= 0:
                    head_last[doc] = kk
                    (open_docs.add if after else open_docs.discard)(doc)
    restarted = set()
    for bs in rest:
        for b in bs:
            for doc, kk, initial, *_ in segments(b):
                if doc >= 0 and kk > 0 and not initial:
                    restarted.add(doc)
    continued = {d for d in open_docs if any(d == doc for bs in rest for b in bs for doc, *_ in segments(b))}
    assert restarted == continued and restarted
    assert fresh[0].dataset.carry(fresh[0].epoch, 1).restarted_docs == len(restarted)
    check_guarantees(rest, docs, restarted=restarted,
                     before=[{d: kk for d, kk in head_last.items() if d not in restarted}] * new_world)


def test_the_rule_defers_a_row_whose_rank_is_full():
    # rows 0..4: row 0 anchor, rows 1-3 its chain, row 4 whole; world 2, batch 2
    pred = np.array([-1, 0, 1, 2, -1])
    s = CarrySchedule(np.full(5, 8), pred, 2, 2, False)
    assert s.rows[0].tolist() == [[0, 1], [2, 3]]
    assert s.rows[1].tolist() == [[4, -1], [-1, -1]]
    st = s.state_at(1)
    assert st == {"next_row": 5, "deferred": [2, 3], "pins": [[2, 0]], "world_size": 2, "rows_consumed": 3}
    again = CarrySchedule(np.full(5, 8), pred, 2, 2, False, {**st, "pins": [(2, 0)]})
    assert again.rows[0].tolist() == [[2, 3]] and again.rows[1].tolist() == [[-1, -1]]
    moved = CarrySchedule(np.full(5, 8), pred, 3, 1, False, {**st, "pins": [(2, 0)]})
    assert moved.restarted.tolist() == [False, False, True, False, False] and moved.restarted_docs == 1
    dropped = CarrySchedule(np.full(5, 8), pred, 2, 2, True)
    assert dropped.n_batches == 0 and not dropped.delivered().any()


def test_state_without_carry_entry_is_refused(carry_shards):
    paths, _ = carry_shards
    lds = loaders(paths, 1)
    state = lds[0].state_dict()
    del state["carry"]
    with pytest.raises(ValueError, match="no 'carry' entry"):
        loaders(paths, 1)[0].load_state_dict(state)


@pytest.mark.parametrize("global_packing", [False, True])
def test_packed_directory_serves_chains_and_report_counts_them(carry_shards, tmp_path, capsys, global_packing):
    from packloader.cli import main

    paths, docs = carry_shards
    out = tmp_path / "packed"
    args = ["pack", *paths, "--out", str(out), "--capacity", str(CAP), "--overflow", "carry", "-q"]
    assert main(args + (["--global"] if global_packing else [])) == 0
    per_rank = [list(ld) for ld in loaders(str(out), 3, capacity=None, overflow=None)]
    seen = check_guarantees(per_rank, docs)
    chains = [-(-len(s) // CAP) for s in docs.values() if len(s) > CAP]
    assert len(seen) == len(chains)
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    want = f"{sum(chains) - len(chains):,}, {len(chains):,} ({sum(chains) / len(chains):.2f} / {max(chains)})"
    assert want in text, text


def test_split_directory_cannot_be_served_as_carry(carry_shards, tmp_path):
    from packloader.cli import main

    paths, _ = carry_shards
    out = tmp_path / "split"
    assert main(["pack", *paths, "--out", str(out), "--capacity", str(CAP), "--overflow", "split", "-q"]) == 0
    with pytest.raises(ValueError, match="overflow='carry' does not match the pre-packed directory"):
        loaders(str(out), 1, capacity=None)


def test_batches_have_the_documented_carry_keys(carry_shards):
    from packloader.batch import BATCH_KEYS, CARRY_BATCH_KEYS

    paths, _ = carry_shards
    for b in loaders(paths, 2, return_ids=False)[0]:
        assert set(b) == set(BATCH_KEYS) | set(CARRY_BATCH_KEYS)
        S = b["cu_seqlens"].numel() - 1
        for key, (shape, dtype) in CARRY_BATCH_KEYS.items():
            assert shape == "[S]" and tuple(b[key].shape) == (S,) and str(b[key].dtype) == f"torch.{dtype}"
        assert ((b["piece_index"] > 0) == b["has_initial_state"]).all()
        assert ((b["piece_doc_ids"] == -1) <= (b["piece_index"] == 0)).all()


def test_resume_after_a_dropped_successor_restarts_its_chain():
    """drop_last drops a continuation, so its predecessor says continues_after=False and the model keeps no state;
    a checkpoint taken then and resumed with drop_last=False delivers that continuation as a restart
    (has_initial_state=False), never as a continuation of a state nobody kept (review reproducer)."""
    import numpy as np
    from packloader.carry import CarrySchedule
    pred = np.array([-1, 0, 0, -1, -1])    # row 0 holds piece 0 of two chains, rows 1 and 2 continue them
    saving = CarrySchedule(np.full(5, 8), pred, world_size=2, batch_size=1, drop_last=True)
    assert not saving.delivered()[2]       # dropped: row 0's second piece says continues_after=False
    state = saving.state_at(1)
    assert [2, -1] in state["pins"] and [1, 0] in state["pins"]
    resumed = CarrySchedule(np.full(5, 8), pred, 2, 1, False, {**state, "pins": [tuple(p) for p in state["pins"]]})
    assert resumed.delivered()[2] and resumed.restarted[2] and not resumed.restarted[1]
