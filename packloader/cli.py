"""The ``packloader`` command line: ``prepare``, ``pack``, ``report``, ``demo``.

::

    packloader prepare gsm8k.jsonl --tokenizer tokenizer.json --fields question,answer --out tok/ \\
        --format arrow --shard-size 2000 --mask-prompt
    packloader pack "tok/shard-*.arrow" --capacity 4096 --algorithm bfd --out packed/
    packloader report packed/ [--json] [--plot lengths.png] [--verify]
    packloader demo [--out demo_out]

Bad input stops with ``error: FILE, row R: ...`` and exit status 1; usage errors exit with 2. ``-q``
prints nothing but errors (and the JSON that ``--json`` asks for). Output files (``--plot``) are written
before anything is printed, and a closed pipe (``packloader report DIR | head -3``) ends the command
quietly with status 0.
"""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main", "build_parser"]


class _DefaultsFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help unless it names its default already or has none (flags)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if ("default" in h or action.default in (None, False, argparse.SUPPRESS)
                or action.option_strings == [] and action.nargs in ("+", "*", None)):
            return h
        return h + " (default: %(default)s)"


def _add_common(p):
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print nothing but errors (and the JSON that --json asks for)")


def build_parser() -> argparse.ArgumentParser:
    import packloader._numba  # noqa: F401  (first: Numba's cache fallback, before packer_algos compiles)
    from packer_algos import ALGORITHMS, OVERFLOW_POLICIES
    from packloader import __version__

    parser = argparse.ArgumentParser(
        prog="packloader",
        description="Pack variable-length token sequences into fixed-capacity rows for Mamba training.",
    )
    parser.add_argument("--version", action="version", version=f"packloader {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    fmt = {"formatter_class": _DefaultsFormatter}

    p = sub.add_parser("prepare", help="tokenize a JSONL file into token shards", **fmt,
                       description="Tokenize the --fields of every JSON record (joined by --separator, EOS "
                                   "appended) with a local tokenizer.json into Arrow / WebDataset / Parquet "
                                   "shards.")
    p.add_argument("input", help="the .jsonl (or .jsonl.gz) file")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json file (tokenizers library)")
    p.add_argument("--fields", default="question,answer", help="comma-separated fields (default: %(default)s)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["arrow", "webdataset", "parquet"], default="arrow",
                   help="shard format (default: %(default)s)")
    p.add_argument("--shard-size", type=int, default=10_000, help="records per shard (default: %(default)s)")
    p.add_argument("--separator", default="\n", help="text between fields (default: a newline)")
    p.add_argument("--no-eos", action="store_true", help="do not append the end-of-text token")
    p.add_argument("--mask-prompt", action="store_true",
                   help="labels -100 over all fields but the last (SFT); writes a labels column")
    p.add_argument("--limit", type=int, default=None, help="tokenize only the first N records")
    p.add_argument("--overwrite", action="store_true", help="tokenize again even if up to date")
    p.add_argument("--allow-nonempty", action="store_true",
                   help="write into a non-empty directory prepare did not create (its files are left alone)")
    _add_common(p)

    p = sub.add_parser("pack", help="pre-pack token shards into fixed-capacity Arrow rows", **fmt,
                       description="Pack token shards (.arrow/.ipc/.feather, .parquet, .tar; globs and "
                                   "{000..127} braces) into uncompressed Arrow IPC files plus index.json.")
    p.add_argument("sources", nargs="+", help="shard files, patterns or directories, or URIs read through pyarrow "
                                              "filesystems (s3://bucket/tok/shard-{000..127}.arrow, gs://...)")
    p.add_argument("--out", required=True, help="output directory (a filesystem path)")
    p.add_argument("--capacity", type=int, default=4096, help="tokens per row (default: %(default)s)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="bfd",
                   help="packing algorithm (default: %(default)s)")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="error",
                   help="sequences longer than --capacity (default: %(default)s)")
    p.add_argument("--global", dest="global_packing", action="store_true",
                   help="pack across shard boundaries (default: each shard alone)")
    p.add_argument("--token-column", default="input_ids", help="token column / tar member (default: %(default)s)")
    p.add_argument("--labels-column", default="labels", help="labels column / tar member (default: %(default)s)")
    p.add_argument("--no-labels", action="store_true", help="ignore a labels column (labels = inputs)")
    p.add_argument("--max-items-per-bin", type=int, default=None, help="cap on sequences per row (default: no cap)")
    p.add_argument("--buffer-size", type=int, default=None,
                   help="pending sequences of --algorithm online (default: 1000)")
    p.add_argument("--seed", type=int, default=None,
                   help="tie-breaking seed of bfd / ffd (default: none, equal lengths in input order)")
    p.add_argument("--rows-per-file", type=int, default=None,
                   help="split output files at this many rows (default: one file per shard, or one with --global)")
    p.add_argument("--allow-empty", action="store_true", help="skip empty shards instead of failing")
    p.add_argument("--workers", type=int, default=1,
                   help="jobs run in parallel: local processes, or Ray tasks in flight (>= 1; default: %(default)s)")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="where the jobs run: this machine's processes, or Ray (pip install 'packloader[ray]'); "
                        "same output bytes (default: %(default)s)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster for --engine ray ('auto', 'ray://head:10001'; default: $RAY_ADDRESS, else a "
                        "local Ray instance with --workers CPUs)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="fail (naming file and row) on a token id >= this vocabulary size (default: no check)")
    p.add_argument("--allow-nonempty", action="store_true",
                   help="write into a non-empty directory pack did not create (its files are left alone)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="PNG", default=None, help="write the length / row-fill plot")
    _add_common(p)

    p = sub.add_parser("report", help="show the packing report of a pre-packed directory", **fmt,
                       description="Print the packing report stored in DIR/index.json (rows, efficiency, "
                                   "padding against padding each batch to its longest sequence and against "
                                   "one sequence per row, the lower bound ceil(tokens / capacity), overflow "
                                   "counts, timings) as a table or JSON; optionally plot it and verify the "
                                   "packed files' checksums.")
    p.add_argument("dir", help="a directory written by 'packloader pack'")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="PNG", default=None, help="write the length / row-fill plot")
    p.add_argument("--verify", action="store_true",
                   help="also hash every packed file and compare with the checksums in index.json")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch size of the unpacked baseline (sequences per batch, each batch padded to its "
                        "longest; recomputed from the packed rows' provenance; default: the one stored by "
                        "pack, 8)")
    _add_common(p)

    p = sub.add_parser("demo", help="tokenize, pack (next_fit and bfd) and report the embedded GSM8K sample",
                       **fmt, description="Offline, on data embedded in the package: tokenize 4,000 GSM8K "
                                          "problems with the GPT-NeoX-20B tokenizer into Arrow shards, pre-pack "
                                          "them with next_fit and bfd, check a packed row against its source, "
                                          "print both reports side by side and write lengths.png. Re-running "
                                          "reuses finished outputs.")
    p.add_argument("--out", default="demo_out", help="output directory (default: %(default)s)")
    p.add_argument("--capacity", type=int, default=2048, help="tokens per row (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N problems")
    p.add_argument("--no-plot", action="store_true", help="do not write lengths.png")
    _add_common(p)
    return parser


def _cmd_prepare(a) -> int:
    from packloader.prepare import prepare_jsonl

    fields = [f.strip() for f in a.fields.split(",") if f.strip()]
    res = prepare_jsonl(a.input, a.out, tokenizer=a.tokenizer, fields=fields, separator=a.separator,
                        eos=not a.no_eos, mask_prompt=a.mask_prompt, format=a.format, shard_size=a.shard_size,
                        limit=a.limit, quiet=a.quiet, overwrite=a.overwrite, allow_nonempty=a.allow_nonempty)
    if not a.quiet:
        for p in res.paths:
            print(p)
    return 0


def _cmd_pack(a) -> int:
    from packloader.pack_writer import pack_dataset

    report = pack_dataset(
        a.sources, a.out, capacity=a.capacity, algorithm=a.algorithm, overflow=a.overflow,
        token_column=a.token_column, labels_column=None if a.no_labels else a.labels_column,
        global_packing=a.global_packing, max_items_per_bin=a.max_items_per_bin, buffer_size=a.buffer_size,
        seed=a.seed, rows_per_file=a.rows_per_file, allow_empty=a.allow_empty, workers=a.workers,
        quiet=a.quiet, allow_nonempty=a.allow_nonempty, vocab_size=a.vocab_size, engine=a.engine,
        ray_address=a.ray_address,
    )
    _print_report(a, report)
    return 0


def _print_report(a, report, lines=()) -> None:
    """Write ``--plot`` first (a closed stdout must not cost the file), then print."""
    if a.plot:
        report.plot(a.plot)
    if a.json:
        print(report.to_json())
    elif not a.quiet:
        print(report)
        for line in lines:
            print(line)
        if a.plot:
            print(f"plot: {a.plot}")


def _cmd_report(a) -> int:
    from packloader.prepacked import PrepackedDataset

    from packloader.errors import DataError

    with PrepackedDataset(a.dir, verify=a.verify) as ds:  # validates the directory, not only index.json
        if not isinstance(ds.index.get("report"), dict):
            raise DataError("index.json holds no packing report", path=a.dir)
        report = ds.report
        if a.batch_size is not None:
            report = _rebase(ds, report, a.batch_size)
    lines = [f"verified: {len(ds.file_names)} file(s) match the checksums in index.json"] if a.verify else []
    _print_report(a, report, lines)
    return 0


def _rebase(ds, report, batch_size: int):
    """``report`` with its padded-batches baseline recomputed at ``batch_size`` from the directory's pieces,
    taken in data order (source file, sequence, offset)."""
    import dataclasses

    import numpy as np

    from packloader.report import batch_padded_slots

    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    _, _, _, lens = ds.read_rows(0, len(ds))
    _, sf, sr, ss = ds.read_sources(0, len(ds))
    order = np.lexsort((ss, sr, sf))
    return dataclasses.replace(report, baseline_batch_size=int(batch_size),
                               batch_padded_slots=batch_padded_slots(np.asarray(lens, np.int64)[order], batch_size))


def _cmd_demo(a) -> int:
    from packloader.demo import run_demo

    run_demo(a.out, capacity=a.capacity, limit=a.limit, plot=not a.no_plot, quiet=a.quiet)
    return 0


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 bad input, 2 usage)."""
    from packloader.errors import DataError

    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as e:  # usage error (2), --help / --version (0): a status, not an exception
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if a.command is None:
        parser.print_help()
        return 2
    cmd = {"prepare": _cmd_prepare, "pack": _cmd_pack, "report": _cmd_report, "demo": _cmd_demo}[a.command]
    try:
        return cmd(a)
    except BrokenPipeError:
        # the reader of stdout went away (``| head``): stop quietly, as cat or grep do; point stdout at
        # /dev/null so that the interpreter's final flush does not fail again
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ImportError) as e:  # bad settings, unreadable / unwritable paths, no ray
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
