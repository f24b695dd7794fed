"""packloader.prepare: JSONL -> token shards with the ``tokenizers`` library (the embedded GPT-NeoX-20B
tokenizer), shard sizes and formats, prompt masks, re-runs, bad input.

Records are a random subset of the embedded GSM8K sample plus random text (seed printed; replay with
``PACKLOADER_TEST_SEED=<seed>``).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import numpy as np
import pyarrow as pa
import pytest

from packloader.demo import CORPUS, TOKENIZER, data_path
from packloader.errors import DataError
from packloader.pack_writer import pack_dataset
from packloader.prepare import (
    find_eos_id,
    load_tokenizer,
    prepare_jsonl,
    tokenize_records,
    write_webdataset_shard,
)
from packloader.sources import open_shard
from tests.packloader.conftest import assert_packed_matches

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok_path():
    return data_path(TOKENIZER)


@pytest.fixture(scope="module")
def tok(tok_path):
    return load_tokenizer(tok_path)


@pytest.fixture(scope="module")
def gsm8k():
    with gzip.open(data_path(CORPUS), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


_ALPHABET = list("abcdefghijklmnopqrstuvwxyz     \n\t.,;!?0123456789") + ["é", "ß", "東京", "🙂", "  ", "\n\n"]


def random_text(rng, n_max=200):
    return "".join(rng.choice(_ALPHABET, int(rng.integers(0, n_max))).tolist())


def make_records(gsm8k, rng, n):
    """n records: GSM8K problems and random-text ones, in random order."""
    recs = []
    pick = rng.choice(len(gsm8k), n, replace=False)
    for k, i in enumerate(pick.tolist()):
        if k % 4 == 3:
            recs.append({"question": random_text(rng), "answer": random_text(rng), "id": k})
        else:
            recs.append({**gsm8k[i], "id": k})
    return recs


def write_jsonl(path, records, *, blank_every=0, gz=False):
    lines = []
    for i, r in enumerate(records):
        lines.append(json.dumps(r, ensure_ascii=False))
        if blank_every and i % blank_every == 0:
            lines.append("   ")
    text = "\n".join(lines) + "\n"
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return str(path)


def expected(tok, rec, fields=("question", "answer"), sep="\n", eos=True):
    """The documented rule: tokens(prompt) + tokens(last field) + [EOS], prompt = fields joined + sep."""
    vals = [rec[f] if isinstance(rec[f], str) else json.dumps(rec[f]) for f in fields]
    prompt = sep.join(vals[:-1]) + sep if len(vals) > 1 else ""
    p = tok.encode(prompt, add_special_tokens=False).ids
    a = tok.encode(vals[-1], add_special_tokens=False).ids
    return np.array(p + a + ([tok.token_to_id(EOS)] if eos else []), np.int32), len(p)


def read_shards(paths):
    seqs, labs = [], []
    for p in paths:
        with open_shard(p) as sh:
            b = sh.read_all()
            for i in range(len(b)):
                seqs.append(b.sequence(i).copy())
                labs.append(None if b.labels is None else b.labels[b.offsets[i]:b.offsets[i + 1]].copy())
    return seqs, labs


def test_embedded_tokenizer(tok):
    assert find_eos_id(tok) == tok.token_to_id(EOS) == 0
    assert tok.get_vocab_size() > 50_000
    assert tok.decode(tok.encode("Natalia sold clips", add_special_tokens=False).ids) == "Natalia sold clips"


@pytest.mark.parametrize("fmt", ["arrow", "webdataset", "parquet"])
def test_prepare_shards_sizes_and_tokens(tmp_path, tok, tok_path, gsm8k, seed, fmt):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(201, 260))
    recs = make_records(gsm8k, rng, n)
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "tok"
    res = prepare_jsonl(src, out, tokenizer=tok_path, fields=["question", "answer"], format=fmt, shard_size=100,
                        quiet=True)
    ext = {"arrow": "arrow", "webdataset": "tar", "parquet": "parquet"}[fmt]
    assert [os.path.basename(p) for p in res.paths] == [f"shard-{k:05d}.{ext}" for k in range(3)]
    sizes = [len(open_shard(p)) for p in res.paths]
    assert sizes == [100, 100, n - 200]
    seqs, labs = read_shards(res.paths)
    assert len(seqs) == n
    total = 0
    for i, (rec, got) in enumerate(zip(recs, seqs)):
        want, _ = expected(tok, rec)
        assert np.array_equal(got, want), (i, rec)
        assert got.dtype == np.int32 and got[-1] == 0
        if i % 4 != 3:  # a GSM8K problem: the same tokens as the whole text encoded at once
            whole = tok.encode(rec["question"] + "\n" + rec["answer"], add_special_tokens=False).ids
            assert got.tolist() == whole + [0]
        total += len(want)
    assert all(lab is None for lab in labs)  # no labels written without mask_prompt
    assert (res.sequences, res.tokens, res.loss_tokens) == (n, total, total)
    m = json.load(open(out / "prepare.json"))
    assert m["sequences"] == n and m["tokens"] == total and m["shards"] == [os.path.basename(p) for p in res.paths]
    assert m["fields"] == ["question", "answer"] and m["eos_id"] == 0
    if fmt in ("arrow", "parquet"):
        import pyarrow.parquet as pq

        t = pq.read_table(res.paths[1]) if fmt == "parquet" else pa.ipc.open_file(pa.memory_map(res.paths[1])).read_all()
        assert t.schema.field("input_ids").type == pa.list_(pa.int32())
        assert t.column("record").to_pylist() == list(range(100, 200))


def test_webdataset_members_are_standard(tmp_path, tok, tok_path, gsm8k, seed):
    rng = np.random.default_rng(seed)
    recs = make_records(gsm8k, rng, 30)
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    res = prepare_jsonl(src, tmp_path / "tok", tokenizer=tok_path, format="webdataset", shard_size=12,
                        mask_prompt=True, quiet=True)
    assert len(res.paths) == 3
    i = 0
    for p in res.paths:
        with tarfile.open(p) as tf:  # the standard library reads it
            names = tf.getnames()
            keys = sorted({n.split(".", 1)[0] for n in names})
            assert names == [f"{k}.{m}.npy" for k in keys for m in ("input_ids", "labels")]
            for k in keys:
                ids = np.load(io.BytesIO(tf.extractfile(f"{k}.input_ids.npy").read()))
                lab = np.load(io.BytesIO(tf.extractfile(f"{k}.labels.npy").read()))
                want, n_prompt = expected(tok, recs[i])
                assert k == f"{i:09d}"
                assert ids.dtype == np.int32 and np.array_equal(ids, want)
                assert (lab[:n_prompt] == -100).all() and np.array_equal(lab[n_prompt:], want[n_prompt:])
                i += 1
    assert i == 30
    import webdataset as wds

    got = [s["input_ids.npy"] for s in wds.WebDataset(res.paths[0], shardshuffle=False).decode()]
    assert [g.tolist() for g in got] == [expected(tok, r)[0].tolist() for r in recs[:12]]


def test_mask_prompt_labels(tmp_path, tok, tok_path, gsm8k, seed):
    rng = np.random.default_rng(seed)
    recs = make_records(gsm8k, rng, 64)
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    res = prepare_jsonl(src, tmp_path / "tok", tokenizer=tok_path, mask_prompt=True, shard_size=40, quiet=True)
    seqs, labs = read_shards(res.paths)
    loss = 0
    for rec, s, lab in zip(recs, seqs, labs):
        want, n_prompt = expected(tok, rec)
        assert np.array_equal(s, want)
        assert (lab[:n_prompt] == -100).all() and np.array_equal(lab[n_prompt:], s[n_prompt:])
        assert lab[-1] == 0  # the EOS is learnt
        loss += len(s) - n_prompt
    assert res.loss_tokens == loss < res.tokens


def test_tokenize_records_rule(tok, seed):
    rng = np.random.default_rng(seed)
    texts = [[random_text(rng, 50) for _ in range(int(rng.integers(1, 4)))] for _ in range(40)]
    offsets, tokens, labels = tokenize_records(tok, texts, separator=" | ", eos_id=7, mask_prompt=True)
    assert offsets[0] == 0 and offsets[-1] == len(tokens) == len(labels)
    for i, r in enumerate(texts):
        prompt = " | ".join(r[:-1]) + " | " if len(r) > 1 else ""
        p = tok.encode(prompt, add_special_tokens=False).ids
        a = tok.encode(r[-1], add_special_tokens=False).ids
        assert tokens[offsets[i]:offsets[i + 1]].tolist() == p + a + [7]
        assert labels[offsets[i]:offsets[i + 1]].tolist() == [-100] * len(p) + a + [7]
    o2, t2, l2 = tokenize_records(tok, texts, separator=" | ", eos_id=None)
    assert l2 is None and len(t2) == len(tokens) - len(texts)


def test_fields_separator_eos_and_limit(tmp_path, tok, tok_path, gsm8k):
    recs = [{**gsm8k[i], "n": i * 1.5} for i in range(25)]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    res = prepare_jsonl(src, tmp_path / "a", tokenizer=tok_path, fields=["answer", "n", "question"],
                        separator=" ### ", eos=False, limit=10, quiet=True)
    seqs, _ = read_shards(res.paths)
    assert len(seqs) == res.sequences == 10
    for rec, s in zip(recs, seqs):
        want, _ = expected(tok, rec, fields=("answer", "n", "question"), sep=" ### ", eos=False)
        assert np.array_equal(s, want)
    res = prepare_jsonl(src, tmp_path / "b", tokenizer=tok_path, fields=["question"], eos="<|padding|>",
                        limit=5, quiet=True)
    seqs, _ = read_shards(res.paths)
    pad = tok.token_to_id("<|padding|>")
    for rec, s in zip(recs, seqs):
        assert s.tolist() == tok.encode(rec["question"], add_special_tokens=False).ids + [pad]
    with pytest.raises(DataError, match="no token"):
        prepare_jsonl(src, tmp_path / "c", tokenizer=tok_path, eos="<|not-a-token|>", quiet=True)


def test_gzip_input_and_blank_lines(tmp_path, tok, tok_path, gsm8k):
    recs = gsm8k[:30]
    src = write_jsonl(tmp_path / "in.jsonl.gz", recs, blank_every=7, gz=True)
    res = prepare_jsonl(src, tmp_path / "tok", tokenizer=tok_path, quiet=True)
    seqs, _ = read_shards(res.paths)
    assert len(seqs) == 30
    assert all(np.array_equal(s, expected(tok, r)[0]) for r, s in zip(recs, seqs))


def test_rerun_skips_and_settings_change_rewrites(tmp_path, tok_path, gsm8k):
    src = write_jsonl(tmp_path / "in.jsonl", gsm8k[:120])
    out = tmp_path / "tok"
    r1 = prepare_jsonl(src, out, tokenizer=tok_path, shard_size=25, quiet=True)
    assert len(r1.paths) == 5
    mt = {p: os.stat(p).st_mtime_ns for p in r1.paths}
    r2 = prepare_jsonl(src, out, tokenizer=tok_path, shard_size=25, quiet=True)
    assert r2.paths == r1.paths and {p: os.stat(p).st_mtime_ns for p in r2.paths} == mt
    assert (r2.sequences, r2.tokens) == (r1.sequences, r1.tokens)
    r3 = prepare_jsonl(src, out, tokenizer=tok_path, shard_size=50, quiet=True)
    assert len(r3.paths) == 3
    # the two shards of the earlier, larger run are gone (a glob over the folder would pick them up)
    assert sorted(n for n in os.listdir(out) if n.startswith("shard-")) == [os.path.basename(p) for p in r3.paths]
    assert len(read_shards(r3.paths)[0]) == 120
    ino = os.stat(r3.paths[0]).st_ino
    r5 = prepare_jsonl(src, out, tokenizer=tok_path, shard_size=50, quiet=True)
    assert r5.seconds == 0.0 and os.stat(r5.paths[0]).st_ino == ino  # up to date: skipped
    r4 = prepare_jsonl(src, out, tokenizer=tok_path, shard_size=50, overwrite=True, quiet=True)
    assert r4.seconds > 0 and os.stat(r4.paths[0]).st_ino != ino  # written again (a new file renamed in)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


@pytest.mark.parametrize("case", ["bad_json", "not_object", "missing_field", "null_field"])
def test_bad_records_name_file_and_row(tmp_path, tok_path, gsm8k, case):
    lines = [json.dumps(r) for r in gsm8k[:20]]
    lines.insert(3, "")  # a blank line: skipped, not a record
    bad_line = 12  # 0-based line index of the bad record; its record (row) index is 11
    lines[bad_line] = {"bad_json": '{"question": "x", "answer": ', "not_object": "[1, 2, 3]",
                       "missing_field": '{"question": "only a question"}',
                       "null_field": '{"question": "q", "answer": null}'}[case]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok"
    with pytest.raises(DataError) as ei:
        prepare_jsonl(src, out, tokenizer=tok_path, shard_size=5, quiet=True)
    e = ei.value
    assert e.path == str(src) and e.row == bad_line - 1
    assert str(src) in str(e) and f"row {bad_line - 1}" in str(e)
    if case in ("bad_json", "not_object"):
        assert f"line {bad_line + 1}" in str(e)
    else:
        assert "'answer'" in str(e)
    assert not (out / "prepare.json").exists()  # an unfinished run is never taken as done
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_bad_arguments(tmp_path, tok_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"question": "a", "answer": "b"}\n')
    with pytest.raises(DataError, match="no such input file"):
        prepare_jsonl(tmp_path / "missing.jsonl", tmp_path / "o", tokenizer=tok_path)
    with pytest.raises(DataError, match="tokenizer file not found"):
        prepare_jsonl(src, tmp_path / "o", tokenizer=tmp_path / "nope.json")
    bad_tok = tmp_path / "broken.json"
    bad_tok.write_text("{not json")
    with pytest.raises(DataError, match="cannot load tokenizer") as ei:
        prepare_jsonl(src, tmp_path / "o", tokenizer=bad_tok)
    assert str(bad_tok) in str(ei.value)
    with pytest.raises(ValueError, match="format"):
        prepare_jsonl(src, tmp_path / "o", tokenizer=tok_path, format="csv")
    with pytest.raises(ValueError, match="shard_size"):
        prepare_jsonl(src, tmp_path / "o", tokenizer=tok_path, shard_size=0)
    with pytest.raises(ValueError, match="fields"):
        prepare_jsonl(src, tmp_path / "o", tokenizer=tok_path, fields=[])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="no records") as ei:
        prepare_jsonl(empty, tmp_path / "o2", tokenizer=tok_path, quiet=True)
    assert str(empty) in str(ei.value)


def test_write_webdataset_shard_reads_back(tmp_path, seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 300, 50)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    tokens = rng.integers(0, 2**31 - 1, int(offsets[-1]), dtype=np.int32)
    p = write_webdataset_shard(tmp_path / "w.tar", offsets, tokens, -tokens)
    with open_shard(p) as sh:
        b = sh.read_all()
        assert np.array_equal(b.offsets, offsets) and np.array_equal(b.tokens, tokens)
        assert np.array_equal(b.labels, -tokens)
    with tarfile.open(p) as tf:
        assert len(tf.getmembers()) == 100


def test_prepare_then_pack(tmp_path, tok_path, gsm8k, seed):
    rng = np.random.default_rng(seed)
    recs = make_records(gsm8k, rng, 150)
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    res = prepare_jsonl(src, tmp_path / "tok", tokenizer=tok_path, mask_prompt=True, format="webdataset",
                        shard_size=60, quiet=True)
    rep = pack_dataset(str(tmp_path / "tok" / "shard-{00000..00002}.tar"), tmp_path / "packed", capacity=1024,
                       quiet=True)
    seqs = {}
    labs = {}
    for p in res.paths:
        s, lab = read_shards([p])
        seqs[p], labs[p] = s, lab
    assert assert_packed_matches(tmp_path / "packed", seqs, labs) == rep.rows
    assert rep.tokens == res.tokens and rep.sequences == 150


def test_shared_gsm8k_and_plain_tokenizer_json(tmp_path, shared_data, tok):
    """The shared corpus with the shared (uncompressed) tokenizer.json gives the embedded tokenizer's ids."""
    src = shared_data / "gsm8k_train.jsonl"
    tjson = shared_data / "gpt-neox-20b-tokenizer.json"
    if not src.is_file() or not tjson.is_file():
        pytest.skip("shared GSM8K / tokenizer files absent")
    res = prepare_jsonl(src, tmp_path / "tok", tokenizer=tjson, limit=300, shard_size=128, quiet=True)
    assert res.sequences == 300 and len(res.paths) == 3
    seqs, _ = read_shards(res.paths)
    with open(src, encoding="utf-8") as f:
        recs = [json.loads(next(f)) for _ in range(300)]
    for r, s in zip(recs, seqs):
        assert np.array_equal(s, expected(tok, r)[0])


def test_text_the_tokenizer_cannot_take_names_file_and_line(tmp_path, tok_path):
    """Issue 36, defect 6: a lone surrogate (``"\\ud800"``, valid JSON but not a Unicode character) used to
    stop ``prepare`` with a raw ``TypeError`` from tokenizers, naming neither the file nor the line."""
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"question": "fine", "answer": "ok \U0001f642"}),  # a paired surrogate escape: fine
             "",
             json.dumps({"question": "also fine", "answer": "1"}),
             '{"question": "bad", "answer": "x \\ud800 y"}']
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "tok"
    with pytest.raises(DataError, match=r"in\.jsonl, row 2: line 4, field 'answer': text the tokenizer cannot take: "
                                        r"a lone UTF-16 surrogate \(\\ud800"):
        prepare_jsonl(src, out, tokenizer=tok_path, quiet=True)
    assert not [n for n in os.listdir(out) if n != ".packloader"]  # nothing written
    r = subprocess.run([sys.executable, "-m", "packloader.cli", "prepare", str(src), "--tokenizer", str(tok_path),
                        "--out", str(tmp_path / "tok2")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "line 4, field 'answer'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    src.write_text("\n".join(lines[:3]) + "\n", encoding="utf-8")
    assert prepare_jsonl(src, out, tokenizer=tok_path, quiet=True).sequences == 2
