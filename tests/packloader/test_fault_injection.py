"""SIGKILL of ``packloader pack`` (local engine, 1 and 2 workers) at random moments (issue 16).

Each trial kills a run after a random delay in ``[0, T]`` (``T``: an uninterrupted run's wall time), on a
fresh directory or on a finished one being re-packed with other settings, and checks: no process of the
killed run is left; a finished directory is still readable and whole (old or new output, never a mix);
a re-run then equals an uninterrupted run byte for byte with nothing left behind (see
``tests/packloader/fault_harness.py``). ``PACKLOADER_FAULT_TRIALS`` sets the trials per case (default 2:
8 kills, about a minute on 2 cores); ``benchmarks/fault_injection.py`` runs the large campaign of
``docs/reliability.md``.
"""
from __future__ import annotations

import os
import random
import sys

import pytest

from tests.packloader import fault_harness as fh


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_pack_at_random_moments(tmp_path, seed):
    trials = int(os.environ.get("PACKLOADER_FAULT_TRIALS", "2"))
    sources = fh.make_sources(tmp_path / "src", n_shards=4, n_seqs=1000, seed=seed)
    refs, wall = fh.prepare_refs(str(tmp_path), sources)
    rng = random.Random(seed)
    results = []
    for workers in (1, 2):
        for mode in ("fresh", "repack"):
            for _ in range(trials):
                results.append(fh.trial(sources, str(tmp_path), workers=workers, mode=mode, refs=refs,
                                        wall=wall, rng=rng))
    for r in results:
        print(r)
    bad = [r for r in results if r["problems"] or r["orphans"]]
    assert not bad, bad
    assert sum(r["killed"] for r in results) >= len(results) // 4  # trials really killed runs
