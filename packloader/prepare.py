"""The tokenizing front door: JSONL text in, token shards out (``packloader prepare``).

Each JSON record's ``fields`` are joined into one training sequence::

    field_1 + separator + field_2 + separator + ... + field_n + EOS

with the default ``separator="\\n"`` and the tokenizer's end-of-text token (``<|endoftext|>`` for
GPT-NeoX, id 0) appended, so packed sequences stay separated in the token stream too. The text before the
last field (its *prompt*, separators included) and the last field are tokenized separately and
concatenated, so ``mask_prompt=True`` can give the prompt tokens label ``-100`` (supervised fine-tuning:
loss on the answer and EOS only) without changing ``input_ids``.

Output: one set of shards per directory, listed in ``prepare.json`` (the manifest). A run writes its
shards in ``.packloader/tmp/``, commits the new manifest atomically, renames the shards into place and
only then removes the shards of the previous set, which the previous manifest lists; a run killed at any
point is completed (or cleaned up) by the next one. ``prepare`` writes only into an empty directory or one
it owns (``allow_nonempty=True`` / ``--allow-nonempty`` to write beside other files), and never
overwrites or removes a file it did not write. A directory given to ``pack`` or the loader as a source
stands for exactly the shards of its manifest.

Tokenization uses the Hugging Face ``tokenizers`` library on a local ``tokenizer.json``
(``Tokenizer.from_file``; nothing is downloaded) with ``encode_batch``, which runs on all cores.

Example::

    >>> from packloader.prepare import prepare_jsonl
    >>> res = prepare_jsonl("gsm8k_train.jsonl", "tok/", tokenizer="tokenizer.json",
    ...                     fields=["question", "answer"], mask_prompt=True)      # doctest: +SKIP
    >>> res.paths[:1], res.sequences, res.tokens                                  # doctest: +SKIP
    (['tok/shard-00000.arrow'], 7473, 1147955)
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from packloader._log import Progress, log
from packloader._dirlock import claimed_output_dir
from packloader._outdir import (atomic_write_text, fsync_dir, fsync_file, remove_file, remove_stale_temps,
                                temp_path)
from packloader.errors import DataError
from packloader.sources.tar import write_tar_members, write_webdataset_shard

__all__ = ["prepare_jsonl", "PrepareResult", "load_tokenizer", "find_eos_id", "tokenize_records", "write_webdataset_shard",
           "FORMATS"]

FORMATS = ("arrow", "webdataset", "parquet")
MANIFEST_NAME = "prepare.json"
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")


@dataclass
class PrepareResult:
    """What :func:`prepare_jsonl` wrote.

    Attributes:
        paths: the shard files, in order.
        sequences: records tokenized.
        tokens: tokens written (EOS included).
        loss_tokens: tokens whose label is not -100 (all of them without ``mask_prompt``).
        seconds: wall time.
        manifest: path of ``prepare.json`` (settings and counts).
    """

    paths: list = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    seconds: float = 0.0
    manifest: str = ""


def load_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` path (optionally gzipped, ``.json.gz``) or an
    existing ``Tokenizer`` (returned as is)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    path = os.fspath(tokenizer)
    if not os.path.isfile(path):
        raise DataError("tokenizer file not found", path=path)
    try:
        if path.endswith(".gz"):
            import gzip

            with gzip.open(path, "rt", encoding="utf-8") as f:
                return Tokenizer.from_str(f.read())
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise DataError(f"cannot load tokenizer: {e}", path=path) from None


def find_eos_id(tok) -> int | None:
    """The id of the tokenizer's end-of-text token (first of ``<|endoftext|>``, ``</s>``, ``<eos>``, ...)
    or None."""
    for t in _EOS_CANDIDATES:
        i = tok.token_to_id(t)
        if i is not None:
            return int(i)
    return None


def _open_text(path: str, mode: str = "r"):
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, mode + ("t" if mode == "r" else ""), encoding="utf-8") if mode == "r" else gzip.open(path, mode)
    return open(path, mode, encoding="utf-8") if mode == "r" else open(path, mode)


#: what reading a damaged, truncated or binary text file raises (gzip: EOFError, BadGzipFile, zlib.error)
def _read_errors():
    import zlib

    return (EOFError, OSError, UnicodeDecodeError, zlib.error)


def _count_lines(path: str) -> int:
    n = 0
    try:
        with _open_text(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                n += chunk.count(b"\n")
    except _read_errors() as e:
        raise DataError(f"cannot read input ({type(e).__name__}: {e or 'file ends early'}; truncated or "
                        "damaged?)", path=path) from None
    return n


def _records(path: str, fields: Sequence[str], limit: int | None) -> Iterator[tuple[int, list[str]]]:
    try:
        yield from _records_unchecked(path, fields, limit)
    except _read_errors() as e:
        raise DataError(f"cannot read input ({type(e).__name__}: {e or 'file ends early'}; truncated, damaged "
                        "or not UTF-8 text?)", path=path) from None


def _records_unchecked(path: str, fields: Sequence[str], limit: int | None) -> Iterator[tuple[int, list[str]]]:
    with _open_text(path, "r") as f:
        row = -1
        for line_no, line in enumerate(f):
            if not line.strip():
                continue
            row += 1
            if limit is not None and row >= limit:
                return
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"invalid JSON on line {line_no + 1}: {e}", path=path, row=row) from None
            if not isinstance(rec, dict):
                raise DataError(f"line {line_no + 1} is not a JSON object", path=path, row=row)
            vals = []
            for name in fields:
                if name not in rec or rec[name] is None:
                    raise DataError(f"record lacks field {name!r} (has {sorted(rec)})", path=path, row=row)
                v = rec[name]
                vals.append(v if isinstance(v, str) else json.dumps(v))
            if _SURROGATE_ESCAPE.search(line):  # (only a \uD800-\uDFFF escape can put one in the text)
                _check_encodable(vals, fields, path, row, line_no)
            yield row, vals


#: a JSON escape of a UTF-16 surrogate (paired ones decode to one character; a lone one stays a surrogate)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_encodable(vals: list, fields: Sequence[str], path: str, row: int, line_no: int) -> None:
    """Text the tokenizer cannot take (a lone surrogate, from an escape like ``"\\ud800"``: not a Unicode
    character, so not UTF-8) is a DataError naming the file, line and field."""
    for name, v in zip(fields, vals):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = v[e.start:e.end].encode("unicode_escape").decode("ascii")
            raise DataError(f"line {line_no + 1}, field {name!r}: text the tokenizer cannot take: a lone UTF-16 "
                            f"surrogate ({bad}, written as a JSON \\u escape) at character {e.start} is not a "
                            "Unicode character; fix or remove the record", path=path, row=row) from None


def tokenize_records(tok, texts: Sequence[Sequence[str]], *, separator: str = "\n", eos_id: int | None,
                     mask_prompt: bool = False):
    """Tokenize records (each a list of field strings) with ``encode_batch``.

    Returns:
        ``(offsets int64 [n+1], tokens int32 [T], labels int32 [T] or None)``; ``labels`` is None when
        ``mask_prompt`` is False (labels = inputs).
    """
    prompts = [separator.join(r[:-1]) + separator if len(r) > 1 else "" for r in texts]
    answers = [r[-1] for r in texts]
    enc_p = tok.encode_batch(prompts, add_special_tokens=False)
    enc_a = tok.encode_batch(answers, add_special_tokens=False)
    p_ids = [e.ids for e in enc_p]
    a_ids = [e.ids for e in enc_a]
    extra = 0 if eos_id is None else 1
    p_len = np.fromiter((len(x) for x in p_ids), np.int64, len(p_ids))
    a_len = np.fromiter((len(x) for x in a_ids), np.int64, len(a_ids))
    lens = p_len + a_len + extra
    offsets = np.zeros(len(texts) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = []
    for p, a in zip(p_ids, a_ids):
        flat.extend(p)
        flat.extend(a)
        if extra:
            flat.append(eos_id)
    tokens = np.asarray(flat, dtype=np.int32) if flat else np.zeros(0, np.int32)
    labels = None
    if mask_prompt:
        labels = tokens.copy()
        # mask [offsets[i], offsets[i] + p_len[i]) for every record, without a Python loop per token
        mark = np.zeros(len(tokens) + 1, np.int32)
        np.add.at(mark, offsets[:-1], 1)
        np.add.at(mark, offsets[:-1] + p_len, -1)
        labels[np.cumsum(mark[:-1]) > 0] = -100
    return offsets, tokens, labels


def _write_arrow(path: str, offsets, tokens, labels, ids, *, parquet: bool = False) -> None:
    cols = {"input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))}
    if labels is not None:
        cols["labels"] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(labels))
    cols["record"] = pa.array(ids, pa.int64())
    table = pa.table(cols)
    if parquet:
        import pyarrow.parquet as pq

        pq.write_table(table, path, write_page_checksum=True)
    else:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)


def _write_tar(path: str, offsets, tokens, labels, ids) -> None:
    write_tar_members(path, offsets, tokens, labels, keys=[f"{i:09d}" for i in ids.tolist()])


def _read_manifest(manifest_path: str) -> dict | None:
    try:
        with open(manifest_path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("shards", []), list) else None


def _manifest_names(m: dict | None, out_dir: str) -> set:
    """Shard names the manifest says prepare wrote (the current set and an unfinished replacement's)."""
    if m is None:
        return set()
    names = list(m.get("shards", [])) + list(m.get("replacing", []) or [])
    return {n for n in names if isinstance(n, str) and n and os.path.basename(n) == n}


def _finished(manifest_path: str, key: str, out_dir: str) -> PrepareResult | None:
    m = _read_manifest(manifest_path)
    if m is None or m.get("settings_key") != key or m.get("replacing"):
        return None
    paths = [os.path.join(out_dir, n) for n in m.get("shards", [])]
    sizes = m.get("shard_bytes", [])
    if len(sizes) != len(paths) or not all(os.path.isfile(p) and os.path.getsize(p) == b for p, b in zip(paths, sizes)):
        return None
    return PrepareResult(paths=paths, sequences=m["sequences"], tokens=m["tokens"], loss_tokens=m["loss_tokens"],
                         seconds=0.0, manifest=manifest_path)


def _finish_replacement(out_dir: str, manifest_path: str, m: dict | None) -> None:
    """Remove the shards a committed manifest marks as replaced (prepare wrote them), then drop the mark."""
    if not m or not m.get("replacing"):
        return
    keep = set(m.get("shards", []))
    for name in _manifest_names({"replacing": m["replacing"]}, out_dir) - keep:
        remove_file(os.path.join(out_dir, name))
    m = dict(m)
    del m["replacing"]
    atomic_write_text(manifest_path, json.dumps(m, indent=1))


def prepare_jsonl(
    input,
    out_dir,
    *,
    tokenizer,
    fields: Sequence[str] = ("question", "answer"),
    separator: str = "\n",
    eos: bool | str = True,
    mask_prompt: bool = False,
    format: str = "arrow",
    shard_size: int = 10_000,
    batch_size: int = 1000,
    limit: int | None = None,
    prefix: str = "shard",
    quiet: bool = False,
    progress: bool | None = None,
    overwrite: bool = False,
    allow_nonempty: bool = False,
) -> PrepareResult:
    """Tokenize a JSONL file into token shards (Arrow IPC, WebDataset tar or Parquet).

    Args:
        input: the ``.jsonl`` file (one JSON object per line; ``.jsonl.gz`` is read through gzip).
        out_dir: the output directory (created if needed).
        tokenizer: a ``tokenizer.json`` path (``.json.gz`` accepted) or a ``tokenizers.Tokenizer``.
        fields: the record fields, joined in this order. Default ``("question", "answer")``.
        separator: text between fields. Default ``"\\n"``.
        eos: True appends the tokenizer's end-of-text token (``<|endoftext|>``, ``</s>``, ...); a string
            names the token; False appends nothing.
        mask_prompt: label the prompt (all fields but the last, separators included) ``-100`` and write
            a ``labels`` column / member; otherwise no labels are written (labels = inputs).
        format: ``"arrow"`` (uncompressed IPC, memory-mappable; default), ``"webdataset"`` (tar, members
            ``KEY.input_ids.npy`` / ``KEY.labels.npy``) or ``"parquet"``.
        shard_size: records per shard.
        batch_size: records per ``encode_batch`` call.
        limit: tokenize only the first ``limit`` records.
        prefix: shard name prefix: ``{prefix}-00000.arrow`` ...
        quiet: print nothing. progress: True / False / None (a bar on a terminal) as in ``pack``.
        overwrite: tokenize again even when ``out_dir/prepare.json`` shows the same input, tokenizer and
            settings with all shards present (by default such a re-run returns at once).
        allow_nonempty: write into a non-empty directory that ``prepare`` did not create (its files are
            never overwritten or removed). Default False: such a directory is refused.

    Returns:
        A :class:`PrepareResult`.

    Raises:
        DataError: unreadable, truncated or binary input, invalid JSON, a missing field or text the
            tokenizer cannot take (a lone surrogate such as ``"\\ud800"``) (naming the file and record), tokenizer not found, no EOS token when ``eos=True``; an output directory that is
            not empty and not written by ``prepare`` (see ``allow_nonempty``) or owned by ``packloader
            pack``, a shard name taken by a file ``prepare`` did not write, or another run writing
            ``out_dir`` at the same time (named by its host and pid; see :mod:`packloader._dirlock`).
    """
    t0 = time.perf_counter()
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose one of {FORMATS}")
    for name, value in (("shard_size", shard_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0):
        raise ValueError(f"limit must be an int >= 0 or None, got {limit!r}")
    fields = list(fields)
    if not fields:
        raise ValueError("fields must name at least one field")
    input = os.fspath(input)
    if not os.path.isfile(input):
        raise DataError("no such input file", path=input)
    tok = load_tokenizer(tokenizer)
    if eos is True:
        eos_id = find_eos_id(tok)
        if eos_id is None:
            raise DataError(f"tokenizer has none of the end-of-text tokens {_EOS_CANDIDATES}; pass eos=False "
                            "or name the token", path=None if not isinstance(tokenizer, (str, os.PathLike)) else tokenizer)
    elif isinstance(eos, str):
        eos_id = tok.token_to_id(eos)
        if eos_id is None:
            raise DataError(f"tokenizer has no token {eos!r}")
    else:
        eos_id = None
    with claimed_output_dir(out_dir, "prepare", allow_nonempty=allow_nonempty, reserved=(MANIFEST_NAME,),
                            quiet=quiet) as out_dir:  # one writer at a time (packloader._dirlock)
        from packloader.pack_writer import _hash, source_digest

        tok_digest = (source_digest(tokenizer) if isinstance(tokenizer, (str, os.PathLike))
                      else _hash(tok.to_str()))
        settings_key = _hash({"input": source_digest(input), "tokenizer": tok_digest, "fields": fields,
                              "separator": separator, "eos_id": eos_id, "mask_prompt": mask_prompt, "format": format,
                              "shard_size": shard_size, "limit": limit, "prefix": prefix})
        manifest_path = os.path.join(out_dir, MANIFEST_NAME)
        old = _read_manifest(manifest_path)
        _finish_replacement(out_dir, manifest_path, old)
        remove_stale_temps(out_dir)
        if not overwrite:
            done = _finished(manifest_path, settings_key, out_dir)
            if done is not None:
                log(f"{out_dir}: up to date ({done.sequences:,} records in {len(done.paths)} shard(s)); "
                    "nothing to do", quiet=quiet)
                return done
        ext = {"arrow": "arrow", "webdataset": "tar", "parquet": "parquet"}[format]
        writer = {"webdataset": _write_tar, "arrow": _write_arrow,
                  "parquet": lambda *a: _write_arrow(*a, parquet=True)}[format]
        res = PrepareResult()
        total = _count_lines(input)
        bar = Progress(total if limit is None else min(total, limit), f"tokenizing {os.path.basename(input)}",
                       "records", quiet=quiet, bar=progress)

        staged: list = []        # (temp path, final path) of the new set, renamed at the commit
        pending_texts, pending_ids = [], []
        shard_parts: list = []   # (offsets, tokens, labels, ids) accumulated for the current shard
        shard_rows = 0

        def flush_shard():
            nonlocal shard_parts, shard_rows
            if not shard_parts:
                return
            offs = [np.zeros(1, np.int64)]
            base = 0
            for o, _, _, _ in shard_parts:
                offs.append(o[1:] + base)
                base += int(o[-1])
            offsets = np.concatenate(offs)
            tokens = np.concatenate([p[1] for p in shard_parts])
            labels = None if not mask_prompt else np.concatenate([p[2] for p in shard_parts])
            ids = np.concatenate([p[3] for p in shard_parts])
            path = os.path.join(out_dir, f"{prefix}-{len(res.paths):05d}.{ext}")
            tmp = temp_path(path)
            staged.append((tmp, path))
            writer(tmp, offsets, tokens, labels, ids)
            res.paths.append(path)
            res.tokens += len(tokens)
            res.loss_tokens += int((labels != -100).sum()) if labels is not None else len(tokens)
            shard_parts, shard_rows = [], 0

        def run_batch():
            nonlocal shard_rows
            if not pending_texts:
                return
            try:
                offsets, tokens, labels = tokenize_records(tok, pending_texts, separator=separator, eos_id=eos_id,
                                                           mask_prompt=mask_prompt)
            except Exception as e:  # tokenizers raises plain Exception subclasses (TypeError, ...)
                raise DataError(f"the tokenizer cannot take the text of records {pending_ids[0]}-{pending_ids[-1]} "
                                f"({type(e).__name__}: {e})", path=input) from None
            ids = np.asarray(pending_ids, np.int64)
            res.sequences += len(pending_texts)
            bar.update(len(pending_texts))
            # split this batch across shard boundaries
            i = 0
            while i < len(ids):
                take = min(len(ids) - i, shard_size - shard_rows)
                a, b = offsets[i], offsets[i + take]
                shard_parts.append((offsets[i:i + take + 1] - a, tokens[a:b], None if labels is None else labels[a:b],
                                    ids[i:i + take]))
                shard_rows += take
                i += take
                if shard_rows >= shard_size:
                    flush_shard()
            pending_texts.clear()
            pending_ids.clear()

        try:
            try:
                for rid, vals in _records(input, fields, limit):
                    pending_texts.append(vals)
                    pending_ids.append(rid)
                    if len(pending_texts) >= batch_size:
                        run_batch()
                run_batch()
                flush_shard()
            finally:
                bar.close()
            if res.sequences == 0:
                raise DataError("no records in the input", path=input)
            ours = _manifest_names(old, out_dir)
            for _, path in staged:  # never replace a file prepare did not write
                name = os.path.basename(path)
                if os.path.lexists(path) and name not in ours:
                    raise DataError(f"shard name {name!r} is taken by a file 'packloader prepare' did not write; "
                                    "choose another --out directory or prefix", path=path)
            for tmp, _ in staged:
                fsync_file(tmp)
        except BaseException:
            for tmp, _ in staged:
                remove_file(tmp)
            raise
        res.seconds = time.perf_counter() - t0
        manifest = {
            "manifest": "packloader-prepare",
            "settings_key": settings_key,
            "shard_bytes": [os.path.getsize(tmp) for tmp, _ in staged],
            "input": os.path.abspath(input),
            "tokenizer": tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "__class__").__name__,
            "fields": fields, "separator": separator, "eos_id": eos_id, "mask_prompt": mask_prompt,
            "format": format, "shard_size": shard_size, "shards": [os.path.basename(p) for p in res.paths],
            "sequences": res.sequences, "tokens": res.tokens, "loss_tokens": res.loss_tokens,
        }
        res.manifest = manifest_path
        # the commit: the new manifest (naming the old set as "replacing"), then the renames, then the old
        # set's removal, then the manifest without "replacing". A kill anywhere is finished by the next run.
        manifest["replacing"] = sorted(_manifest_names(old, out_dir) - set(manifest["shards"]))
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1))
        for tmp, path in staged:
            os.replace(tmp, path)
        fsync_dir(out_dir)
        _finish_replacement(out_dir, manifest_path, manifest)
        log(f"{input}: {res.sequences:,} records -> {res.tokens:,} tokens in {len(res.paths)} {format} shard(s) "
            f"under {out_dir} ({res.seconds:.2f} s)", quiet=quiet)
        return res
