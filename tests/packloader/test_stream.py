"""packloader.stream: building streaming rows."""
from __future__ import annotations

import numpy as np

from packloader.batch import raw_views
from packloader.stream import StreamingRows
from tests.packloader.conftest import random_sequences, write_arrow


def test_a_batch_decodes_each_of_its_shards_once(tmp_path):
    """Rows of an offline plan mix shards; with a cache of one shard, a batch still decodes each shard it
    draws on once (it was once per change of shard from piece to piece before), and its tokens are right."""
    seqs = [random_sequences(30, seed=s, max_len=40) for s in range(4)]
    paths = [write_arrow(tmp_path / f"s{i}.arrow", seqs[i]) for i in range(4)]
    rows = StreamingRows(paths, 128, algorithm="bfd", shard_cache=1)
    n = len(rows.epoch_rows(0, 0, True))
    batch = np.arange(min(n, 6), dtype=np.int64)
    built = rows.build(0, 0, True, batch, want_ids=True)
    table = built.ids["sample_ids"]
    assert len(np.unique(table[:, 1])) >= 3  # the batch draws on several shards, in mixed order
    assert rows._shards.loads == len(np.unique(table[:, 1]))
    ids = raw_views(built.raw)[0]
    col = {b: 0 for b in range(len(batch))}
    for b, f, q, st, ln in table.tolist():
        assert (ids[b, col[b]:col[b] + ln] == seqs[f][q][st:st + ln]).all()
        col[b] += ln
