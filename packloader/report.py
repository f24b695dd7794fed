"""Packing reports: how well a corpus packed, as a terminal table, JSON and a PNG.

:func:`packloader.pack_writer.pack_dataset` returns a :class:`PackingReport` and stores it in the output's
``index.json``; ``packloader report DIR`` rebuilds it from there.

Example::

    >>> from packloader.report import PackingReport
    >>> r = PackingReport.from_lengths([700, 300, 1000, 20], capacity=1024, algorithm="bfd",
    ...                                row_fills=[1000, 1020])
    >>> r.rows, round(r.efficiency, 4), r.padding_tokens, r.lower_bound
    (2, 0.9863, 28, 2)
    >>> print(r)                                                       # doctest: +SKIP
    >>> r.to_json(); r.plot("lengths.png")                              # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from packloader._outdir import atomic_path

__all__ = ["PackingReport", "side_by_side", "plot_reports", "baseline_pieces", "batch_padded_slots",
           "LENGTH_BINS", "FILL_BINS", "BASELINE_BATCH_SIZE"]

#: equal-width bins of the sequence-length histogram over ``[1, capacity]`` (plus one for longer ones)
LENGTH_BINS = 256
#: equal-width bins of the row-fill histogram over ``(0, 1]``
FILL_BINS = 20
#: batch size of the padded-batches baseline (sequences per batch, each batch padded to its longest)
BASELINE_BATCH_SIZE = 8


def baseline_pieces(lengths, capacity: int, overflow: str = "split") -> np.ndarray:
    """What an unpacked loader would feed, in data order: each non-empty sequence, a sequence longer than
    ``capacity`` as the overflow policy leaves it (``split``: pieces of ``capacity`` plus the rest;
    ``truncate``: ``capacity`` tokens; ``drop``: nothing)."""
    L = np.asarray(lengths, dtype=np.int64)
    L = L[L > 0]
    if overflow == "truncate":
        return np.minimum(L, capacity)
    if overflow == "drop":
        return L[L <= capacity]
    n = (L + capacity - 1) // capacity
    if not (n > 1).any():
        return L
    first = np.repeat(np.cumsum(n) - n, n)
    start = (np.arange(int(n.sum()), dtype=np.int64) - first) * capacity
    return np.minimum(np.repeat(L, n) - start, capacity)


def batch_padded_slots(pieces, batch_size: int) -> int:
    """Token slots of batches of ``batch_size`` consecutive ``pieces``, each padded to its longest."""
    p = np.asarray(pieces, dtype=np.int64)
    if p.size == 0:
        return 0
    b = int(batch_size)
    starts = np.arange(0, p.size, b)
    longest = np.maximum.reduceat(p, starts)
    sizes = np.diff(np.append(starts, p.size))
    return int((longest * sizes).sum())


def length_histogram(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """int64 ``[LENGTH_BINS + 1]`` counts of non-empty lengths: bin ``k < LENGTH_BINS`` holds lengths in
    ``(k * C / LENGTH_BINS, (k + 1) * C / LENGTH_BINS]``, the last bin lengths above ``capacity``."""
    L = np.asarray(lengths, dtype=np.int64)
    L = L[L > 0]
    idx = (L * LENGTH_BINS + capacity - 1) // capacity - 1
    np.minimum(idx, LENGTH_BINS, out=idx)
    return np.bincount(idx, minlength=LENGTH_BINS + 1).astype(np.int64)


def fill_histogram(row_fills: np.ndarray, capacity: int) -> np.ndarray:
    """int64 ``[FILL_BINS]`` counts of rows by fill ``used / capacity`` in ``((k)/F, (k+1)/F]``."""
    u = np.asarray(row_fills, dtype=np.int64)
    idx = (u * FILL_BINS + capacity - 1) // capacity - 1
    np.clip(idx, 0, FILL_BINS - 1, out=idx)
    return np.bincount(idx, minlength=FILL_BINS).astype(np.int64)


@dataclass
class PackingReport:
    """Figures of one packing run: what went in, how many rows came out, how full they are.

    Build one with :meth:`from_lengths` (or get it from :func:`~packloader.pack_writer.pack_dataset`); merge
    per-shard reports with :meth:`combine`.

    Args:
        capacity: tokens per row.
        algorithm: the packing algorithm (``"bfd"``, ``"next_fit"``, ...).
        overflow: the policy for sequences longer than ``capacity``.
        global_packing: whether all sources were packed together (else shard by shard).
        sources: number of source files.
        files: number of packed output files.
        sequences: input sequences (including empty ones).
        empty: zero-length sequences (dropped, never placed).
        tokens: input tokens.
        packed_tokens: tokens placed in rows (``tokens`` minus truncated / dropped ones).
        rows: packed rows.
        pieces: pieces placed (sequences, or parts of split sequences).
        min_seqs_per_row / max_seqs_per_row: fewest / most pieces in a row.
        split / truncated / dropped: sequences longer than ``capacity`` that were split, truncated or
            dropped.
        lost_tokens: tokens removed by truncation or dropping.
        carried_pieces / max_chain: with ``overflow="carry"``, the pieces that continue the piece before
            them (a chain of ``n`` pieces has ``n - 1``), and the most pieces in one chain; ``split``
            counts the chains. Mean chain length: :attr:`mean_chain`.
        min_length / max_length: shortest / longest non-empty input sequence.
        length_counts: sequence-length histogram (see :func:`length_histogram`).
        fill_counts: row-fill histogram (see :func:`fill_histogram`).
        read_seconds / plan_seconds / write_seconds: time reading lengths, planning, writing rows
            (summed over shards).
        total_seconds: wall time of the whole run.
        reused_files: output files found finished from an earlier identical run and kept.
        unpacked_rows: sequences (pieces of split ones) an unpacked loader feeds: the steps of the
            one-sequence-per-step baseline (no padding).
        baseline_batch_size: sequences per batch of the padded-batches baseline.
        batch_padded_slots: token slots of that baseline: the sequences in data order (per source file,
            or all together with global packing), ``baseline_batch_size`` at a time, each batch padded
            to its longest sequence, which is what an unpacked ``DataLoader`` with a padding collator does.

    Derived properties: :attr:`efficiency`, :attr:`padding_tokens`, :attr:`lower_bound`,
    :attr:`baseline_padding`, :attr:`padding_saved`,
    :attr:`rows_over_lower_bound`, :attr:`mean_seqs_per_row`, :attr:`mean_length`,
    :attr:`tokens_per_second`.
    """

    capacity: int
    algorithm: str
    overflow: str = "error"
    global_packing: bool = False
    sources: int = 0
    files: int = 0
    sequences: int = 0
    empty: int = 0
    tokens: int = 0
    packed_tokens: int = 0
    rows: int = 0
    pieces: int = 0
    min_seqs_per_row: int = 0
    max_seqs_per_row: int = 0
    split: int = 0
    truncated: int = 0
    dropped: int = 0
    lost_tokens: int = 0
    carried_pieces: int = 0
    max_chain: int = 0
    min_length: int = 0
    max_length: int = 0
    length_counts: list = field(default_factory=lambda: [0] * (LENGTH_BINS + 1))
    fill_counts: list = field(default_factory=lambda: [0] * FILL_BINS)
    read_seconds: float = 0.0
    plan_seconds: float = 0.0
    write_seconds: float = 0.0
    total_seconds: float = 0.0
    reused_files: int = 0
    unpacked_rows: int = 0
    baseline_batch_size: int = BASELINE_BATCH_SIZE
    batch_padded_slots: int = 0

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_lengths(cls, lengths, capacity: int, algorithm: str, *, row_fills=None, pieces_per_row=None,
                     split: int = 0, truncated: int = 0, dropped: int = 0, lost_tokens: int = 0,
                     baseline_batch_size: int = BASELINE_BATCH_SIZE, **kw) -> "PackingReport":
        """Build a report from sequence lengths and the rows' fills.

        Args:
            lengths: input sequence lengths (int array-like).
            capacity: tokens per row.
            algorithm: the algorithm name.
            row_fills: tokens used in each row (int array-like); its sum is ``packed_tokens``.
            pieces_per_row: pieces in each row (defaults to unknown: min/max 0, mean from counts).
            split / truncated / dropped / lost_tokens: overflow counts.
            baseline_batch_size: batch size of the padded-batches baseline (lengths taken in the given
                order).
            **kw: other fields (``overflow``, ``sources``, timings, ...).
        """
        L = np.asarray(lengths, dtype=np.int64)
        fills = np.zeros(0, np.int64) if row_fills is None else np.asarray(row_fills, dtype=np.int64)
        nz = L[L > 0]
        ppr = None if pieces_per_row is None else np.asarray(pieces_per_row, dtype=np.int64)
        base = baseline_pieces(L, int(capacity), kw.get("overflow", "split"))
        if kw.get("overflow") == "carry":  # chains of ceil(n / capacity) pieces (packer_algos.chains)
            chain = -(-L[L > int(capacity)] // int(capacity))
            kw.setdefault("carried_pieces", int((chain - 1).sum()))
            kw.setdefault("max_chain", int(chain.max()) if chain.size else 0)
        return cls(
            capacity=int(capacity), algorithm=algorithm,
            sequences=int(L.size), empty=int(L.size - nz.size), tokens=int(L.sum()),
            packed_tokens=int(fills.sum()), rows=int(fills.size),
            pieces=int(ppr.sum()) if ppr is not None else kw.pop("pieces", 0),
            min_seqs_per_row=int(ppr.min()) if ppr is not None and ppr.size else 0,
            max_seqs_per_row=int(ppr.max()) if ppr is not None and ppr.size else 0,
            split=int(split), truncated=int(truncated), dropped=int(dropped), lost_tokens=int(lost_tokens),
            min_length=int(nz.min()) if nz.size else 0, max_length=int(nz.max()) if nz.size else 0,
            length_counts=length_histogram(L, capacity).tolist(),
            fill_counts=fill_histogram(fills, capacity).tolist(),
            unpacked_rows=int(base.size),
            baseline_batch_size=int(baseline_batch_size),
            batch_padded_slots=batch_padded_slots(base, baseline_batch_size),
            **kw,
        )

    @classmethod
    def combine(cls, reports: Sequence["PackingReport"], **overrides) -> "PackingReport":
        """Merge reports of the same capacity (e.g. one per shard): counts and times add up,
        minima / maxima combine. ``overrides`` set fields of the result (e.g. ``total_seconds``)."""
        reports = list(reports)
        if not reports:
            raise ValueError("combine() needs at least one report")
        cap = reports[0].capacity
        if any(r.capacity != cap for r in reports):
            raise ValueError("cannot combine reports of different capacities")
        out = dataclasses.replace(reports[0])
        summed = ("sources", "files", "sequences", "empty", "tokens", "packed_tokens", "rows", "pieces", "split",
                  "truncated", "dropped", "lost_tokens", "carried_pieces", "read_seconds", "plan_seconds", "write_seconds",
                  "total_seconds", "reused_files", "unpacked_rows", "batch_padded_slots")
        if len({r.baseline_batch_size for r in reports}) > 1:
            raise ValueError("cannot combine reports of different baseline batch sizes")
        for name in summed:
            setattr(out, name, sum(getattr(r, name) for r in reports))
        with_rows = [r for r in reports if r.rows]
        out.min_seqs_per_row = min((r.min_seqs_per_row for r in with_rows), default=0)
        out.max_seqs_per_row = max((r.max_seqs_per_row for r in with_rows), default=0)
        with_seqs = [r for r in reports if r.sequences - r.empty]
        out.min_length = min((r.min_length for r in with_seqs), default=0)
        out.max_length = max((r.max_length for r in with_seqs), default=0)
        out.max_chain = max((r.max_chain for r in reports), default=0)
        if len({len(r.length_counts) for r in reports}) > 1:
            raise ValueError("cannot combine reports with different length histograms")
        out.length_counts = np.sum([r.length_counts for r in reports], axis=0).astype(int).tolist()
        out.fill_counts = np.sum([r.fill_counts for r in reports], axis=0).astype(int).tolist()
        for k, v in overrides.items():
            setattr(out, k, v)
        return out

    # ---------------------------------------------------------------- derived figures

    @property
    def mean_chain(self) -> float:
        """Mean pieces per chain (``overflow="carry"``); 0.0 without chains."""
        return (self.carried_pieces + self.split) / self.split if self.split and self.overflow == "carry" else 0.0

    @property
    def efficiency(self) -> float:
        """Share of row slots holding real tokens: ``packed_tokens / (rows * capacity)``."""
        return self.packed_tokens / (self.rows * self.capacity) if self.rows else 0.0

    @property
    def padding_tokens(self) -> int:
        return self.rows * self.capacity - self.packed_tokens

    @property
    def lower_bound(self) -> int:
        """``ceil(packed_tokens / capacity)``: no packing of these tokens has fewer rows."""
        return -(-self.packed_tokens // self.capacity)

    @property
    def rows_over_lower_bound(self) -> int:
        return self.rows - self.lower_bound

    @property
    def mean_seqs_per_row(self) -> float:
        return self.pieces / self.rows if self.rows else 0.0

    @property
    def mean_length(self) -> float:
        n = self.sequences - self.empty
        return self.tokens / n if n else 0.0

    @property
    def baseline_padding(self) -> int:
        """Padding tokens of the padded-batches baseline (see :attr:`batch_padded_slots`)."""
        return max(0, self.batch_padded_slots - self.packed_tokens)

    @property
    def padding_saved(self) -> float:
        """Share of the padded-batches baseline's padding that packing removed (1.0 = all of it; negative
        when packing pads more, e.g. short sequences of similar length in large rows). Not against
        padding every sequence to ``capacity``: nobody trains that way, and it flatters."""
        base = self.baseline_padding
        return 1.0 - self.padding_tokens / base if base > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.packed_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def length_edges(self) -> list[float]:
        """Edges of the length histogram's first ``LENGTH_BINS`` bins (the last bin is ``> capacity``)."""
        nb = len(self.length_counts) - 1  # reports stored by other versions may use other bin counts
        return [k * self.capacity / nb for k in range(nb + 1)]

    # ---------------------------------------------------------------- serialisation

    def to_dict(self) -> dict:
        """All fields plus the derived figures (JSON-serialisable)."""
        d = dataclasses.asdict(self)
        for name in ("efficiency", "padding_tokens", "lower_bound", "rows_over_lower_bound",
                     "mean_seqs_per_row", "mean_length", "baseline_padding", "padding_saved",
                     "tokens_per_second"):
            d[name] = getattr(self, name)
        d["length_edges"] = self.length_edges()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "PackingReport":
        """Inverse of :meth:`to_dict` (derived figures and unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> "PackingReport":
        return cls.from_dict(json.loads(text))

    # ---------------------------------------------------------------- rendering

    def rows_table(self) -> list[tuple[str, str]]:
        """(label, value) pairs of the terminal table."""
        return [
            ("algorithm", str(self.algorithm)),
            ("capacity", f"{self.capacity:,}"),
            ("packing", "global" if self.global_packing else "per shard"),
            ("sources / files", f"{self.sources:,} / {self.files:,}"),
            ("sequences", f"{self.sequences:,}"),
            ("tokens", f"{self.tokens:,}"),
            ("length min/mean/max", f"{self.min_length:,} / {self.mean_length:,.1f} / {self.max_length:,}"),
            ("rows", f"{self.rows:,}"),
            ("lower bound (rows)", f"{self.lower_bound:,}"),
            ("rows over lower bound", f"{self.rows_over_lower_bound:,}"),
            ("efficiency", f"{100 * self.efficiency:.2f} %"),
            ("padding tokens", f"{self.padding_tokens:,}"),
            (f"unpacked, batch {self.baseline_batch_size}: padding",
             f"{self.baseline_padding:,} ({100 * self.padding_saved:.1f} % saved)" if self.batch_padded_slots
             else "n/a"),
            ("unpacked, batch 1: steps", f"{self.unpacked_rows:,} (no padding)"),
            ("seqs per row min/mean/max",
             f"{self.min_seqs_per_row} / {self.mean_seqs_per_row:.2f} / {self.max_seqs_per_row}"),
            ("split / truncated / dropped", f"{self.split:,} / {self.truncated:,} / {self.dropped:,}"),
            ("tokens lost (trunc./drop)", f"{self.lost_tokens:,}"),
            ("carried pieces, chains (mean/max pieces)",
             f"{self.carried_pieces:,}, {self.split:,} ({self.mean_chain:.2f} / {self.max_chain})"
             if self.overflow == "carry" else "n/a"),
            ("empty sequences", f"{self.empty:,}"),
            ("time read/plan/write", f"{self.read_seconds:.2f} / {self.plan_seconds:.2f} / {self.write_seconds:.2f} s"),
            ("total time", f"{self.total_seconds:.2f} s"),
            ("throughput", f"{self.tokens_per_second / 1e6:,.1f} M tokens/s"),
        ]

    def __str__(self) -> str:
        return side_by_side([self], titles=[f"packing report ({self.algorithm})"])

    def plot(self, path, *, title: str | None = None) -> str:
        """Write a PNG: the sequence-length histogram and the row-fill histogram. Returns ``path``."""
        return plot_reports([self], path, titles=[title or str(self.algorithm)])


def side_by_side(reports: Sequence[PackingReport], titles: Sequence[str] | None = None) -> str:
    """Render reports as one table, a column per report.

    Args:
        reports: the reports.
        titles: column titles (default: each report's algorithm).

    Example::

        >>> print(side_by_side([next_fit_report, bfd_report]))            # doctest: +SKIP
    """
    reports = list(reports)
    titles = list(titles) if titles is not None else [str(r.algorithm) for r in reports]
    tables = [r.rows_table() for r in reports]
    labels = [lab for lab, _ in tables[0]]
    cols = [[v for _, v in t] for t in tables]
    w0 = max(len(s) for s in labels + [""])
    widths = [max(len(titles[i]), *(len(v) for v in cols[i])) for i in range(len(reports))]
    sep = "+-" + "-" * w0 + "-+" + "+".join("-" + "-" * w + "-" for w in widths) + "+"
    lines = [sep, "| " + " " * w0 + " |" + "|".join(f" {t:>{w}} " for t, w in zip(titles, widths)) + "|", sep]
    for i, lab in enumerate(labels):
        lines.append("| " + f"{lab:<{w0}}" + " |" + "|".join(f" {c[i]:>{w}} " for c, w in zip(cols, widths)) + "|")
    lines.append(sep)
    return "\n".join(lines)


def plot_reports(reports: Sequence[PackingReport], path, titles: Sequence[str] | None = None) -> str:
    """Write a PNG with the sequence-length histogram (of the first report; the same corpus) and the
    row-fill histogram of every report, overlaid. Returns ``path``.

    Draws on a bare :class:`matplotlib.figure.Figure` rendered by the Agg canvas: no display is needed and
    pyplot's backend and figure list (a notebook's, say) are left alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    reports = list(reports)
    titles = list(titles) if titles is not None else [str(r.algorithm) for r in reports]
    first = reports[0]
    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    edges = np.asarray(first.length_edges())
    counts = np.asarray(first.length_counts[:-1])
    ax1.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4C72B0", edgecolor="white",
            linewidth=0.3)
    over = first.length_counts[-1]
    note = f"; {over:,} longer than capacity" if over else ""
    if first.max_length and first.max_length < 0.6 * first.capacity:
        ax1.set_xlim(0, first.max_length * 1.1)  # short sequences: zoom in, name the capacity in the legend
        ax1.plot([], [], " ", label=f"capacity {first.capacity} (beyond the right edge)")
    else:
        ax1.axvline(first.capacity, color="#C44E52", linestyle="--", linewidth=1, label=f"capacity {first.capacity}")
    ax1.set_title(f"sequence lengths ({first.sequences - first.empty:,} sequences{note})")
    ax1.set_xlabel("tokens per sequence")
    ax1.set_ylabel("sequences")
    ax1.legend(loc="upper right")

    fedges = np.linspace(0, 100, FILL_BINS + 1)
    width = (fedges[1] - fedges[0]) / max(1, len(reports))
    colors = ["#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3"]
    for i, (r, t) in enumerate(zip(reports, titles)):
        ax2.bar(fedges[:-1] + i * width, r.fill_counts, width=width, align="edge",
                color=colors[i % len(colors)],
                label=f"{t}: {r.rows:,} rows, {100 * r.efficiency:.1f} % full")
    ax2.set_title(f"fill of packed rows (capacity {first.capacity})")
    ax2.set_xlabel("row fill (% of capacity)")
    ax2.set_ylabel("rows")
    if any(c > 0 for r in reports for c in r.fill_counts):  # a log axis needs a positive count
        ax2.set_yscale("log")
    ax2.legend(loc="upper left")
    fig.tight_layout()
    path = os.fspath(path)
    with atomic_path(path, fsync=False, beside=True) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path
