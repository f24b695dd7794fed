"""benchmarks/bench_train.py: the batches each mode trains on (CPU), its merge of result files, and its GSM8K lengths.
The training itself needs mamba-ssm on a GPU: its figures are in benchmarks/results/RESULTS.md."""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"
SHARED = SCRIPT.parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_packed_steps_hold_each_sequence_once(bench, seed):
    lengths = bench.lognormal_lengths(3000, seed)
    assert lengths.min() >= 8 and lengths.max() <= 2048
    steps = bench.packed_steps(lengths, 4096, 4, seed)
    assert steps and all(len(s) == 4 for s in steps)
    placed = collections.Counter(n for s in steps for row in s for n in row)
    assert all(sum(row) <= 4096 for s in steps for row in s)
    # whole rows are left over only when they do not fill a step: fewer than 4 rows' worth of sequences
    left = collections.Counter(lengths.tolist()) - placed
    assert not (placed - collections.Counter(lengths.tolist()))
    assert sum(left.values()) == 0 or sum(n * c for n, c in left.items()) <= 3 * 4096
    assert bench.real_tokens(steps[0]) == sum(map(sum, steps[0]))


def test_padded_and_single_steps_are_permutations(bench, seed):
    lengths = bench.lognormal_lengths(161, seed)
    padded = bench.padded_steps(lengths, 16, seed)
    assert len(padded) == 10 and all(len(s) == 16 for s in padded)
    assert collections.Counter(n for s in padded for n in s) <= collections.Counter(lengths.tolist())
    single = bench.single_steps(lengths, seed)
    assert sorted(n for s in single for n in s) == sorted(lengths.tolist())
    assert bench.real_tokens(single[3]) == single[3][0]


def test_packed_batch_positions_and_labels(bench):
    gen = torch.Generator().manual_seed(0)
    ids, pos, labels = bench.packed_batch([[3, 1, 4], [8]], 10, 100, gen, "cpu")
    assert pos.dtype == torch.int32
    assert pos[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1]   # the padding tail is a segment of its own
    assert pos[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    ig = bench.IGNORE_INDEX
    # next-token labels inside each sequence; the last token of a sequence and the padding predict nothing
    assert labels[0].tolist() == [ids[0, 1].item(), ids[0, 2].item(), ig, ig, ids[0, 5].item(), ids[0, 6].item(),
                                  ids[0, 7].item(), ig, ig, ig]
    assert ids[0, 8:].tolist() == [0, 0] and ids[1, 8:].tolist() == [0, 0]
    assert (ids[:, :8] >= 2).all()


def test_padded_batch_labels(bench):
    gen = torch.Generator().manual_seed(0)
    ids, labels = bench.padded_batch([2, 5, 1], 100, gen, "cpu")
    assert ids.shape == (3, 5)
    ig = bench.IGNORE_INDEX
    assert labels[0].tolist() == [ids[0, 1].item(), ig, ig, ig, ig]
    assert labels[2].tolist() == [ig] * 5
    assert labels[1, :4].tolist() == ids[1, 1:].tolist() and labels[1, 4].item() == ig
    assert ids[0, 2:].tolist() == [0, 0, 0]


def _result_file(path, device, width):
    rows = [{"width": width, "lengths": "gsm8k", "mode": m, "tokens_per_s": tps, "peak_gib": 10.0,
             "ms_per_step": 1.0, "rows_per_step": 4 if m in ("packed", "dense") else None,
             "micro_batches": 1 if m == "padded" else None, "packed_is": 1.0}
            for m, tps in (("single", 10.0), ("padded", 100.0), ("packed", 1000.0), ("dense", 990.0))]
    path.write_text(json.dumps({"device_name": device, "torch": "x", "date": "2026-11-23", "results": rows,
                                "saved_tensors": []}))
    return str(path)


def test_merge_joins_one_device_and_draws(bench, tmp_path):
    a = _result_file(tmp_path / "a.json", "GPU A", "1.4b")
    b = _result_file(tmp_path / "b.json", "GPU A", "2.8b")
    out = bench.main(["--merge", a, b, "--out", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.png")])
    assert [(r["width"], r["mode"]) for r in out["results"]][::4] == [("1.4b", "single"), ("2.8b", "single")]
    assert json.loads((tmp_path / "m.json").read_text())["merged_from"] == [a, b]
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    c = _result_file(tmp_path / "c.json", "GPU B", "2.8b")
    with pytest.raises(SystemExit, match="different devices"):
        bench.main(["--merge", a, c])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_without_a_gpu_it_says_so(bench):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--lengths", "lognormal"])


def test_gsm8k_lengths_from_the_shared_corpus(bench, tmp_path):
    if not (SHARED / "gsm8k_train.jsonl").exists():
        pytest.skip(f"needs ../shared/data/gsm8k_train.jsonl (not found at {SHARED})")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    lengths = bench.gsm8k_lengths(str(SHARED / "gsm8k_train.jsonl"), str(SHARED / "gpt-neox-20b-tokenizer.json"))
    assert len(lengths) == 7473 and lengths.dtype == np.int64
    tok = Tokenizer.from_file(str(SHARED / "gpt-neox-20b-tokenizer.json"))
    with open(SHARED / "gsm8k_train.jsonl") as f:
        ex = json.loads(next(f))
    assert lengths[0] == len(tok.encode(ex["question"] + "\n" + ex["answer"]).ids) + 1
    out = tmp_path / "lens.npy"
    bench.main(["--write-gsm8k-lengths", os.fspath(out)])
    assert np.array_equal(np.load(out), lengths)


def test_profile_kinds_and_table(bench, capsys):
    """--profile-steps: kernel names from the real profiles (H200, 2026-11-23) land in their kind, and the table sums
    them per mode."""
    names = {
        "void packloader_ops::(anonymous namespace)::scan_bwd_kernel<__nv_bfloat16, __nv_bfloat16, true, true>": "scan bwd",
        "void selective_scan_fwd_kernel<Selective_Scan_fwd_kernel_traits<128, 16, 1, true>>": "scan fwd",
        "void packloader_ops::conv::(anonymous namespace)::conv_bwd_cf_vec<__nv_bfloat16, 4, 2>": "conv",
        "packloader_ops::(anonymous namespace)::conv_dw_sum_kernel(float const*, int, int, int, float*, float*)": "conv",
        "void causal_conv1d_fwd_kernel<Causal_conv1d_fwd_kernel_traits<128, 4, true>>": "conv",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TTT": "gemm",
        "_layer_norm_bwd_kernel": "norm",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16>>": "reduce",
        "Memcpy DtoD (Device -> Device)": "copy / cast",
        "void at::native::vectorized_elementwise_kernel<4, at::native::neg_kernel_cuda>": "elementwise / other",
    }
    for name, kind in names.items():
        assert bench.kernel_kind(name) == kind, name
    rows = [{"width": "2.8b", "lengths": "gsm8k", "mode": m,
             "profile": {"kernel_ms_per_step": t, "kinds_ms": {"gemm": t - 1.0, "conv": 1.0},
                         "kernels": [{"name": "nvjet_x", "ms": t - 1.0, "calls": 3}]}}
            for m, t in (("packed", 10.0), ("dense", 12.5))]
    bench.print_profiles(rows)
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert total.split()[1:] == ["10.00", "12.50"]
    assert "largest kernels, 2.8b gsm8k dense" in out


def test_ratios_over_packed_and_dense(bench):
    rows = [{"width": "1.4b", "lengths": "gsm8k", "mode": m, "tokens_per_s": tps}
            for m, tps in (("packed", 1100.0), ("dense", 1000.0), ("compiled", 1320.0), ("padded", 200.0))]
    rows.append({"width": "2.8b", "lengths": "gsm8k", "mode": "compiled", "tokens_per_s": 5.0})
    rows.append({"width": "2.8b", "lengths": "gsm8k", "mode": "dense", "oom": True})
    bench.add_ratios(rows)
    by = {(r["width"], r["mode"]): r for r in rows}
    assert by["1.4b", "compiled"]["over_dense"] == pytest.approx(1.32)
    assert by["1.4b", "compiled"]["packed_is"] == pytest.approx(1100 / 1320)
    assert by["1.4b", "padded"]["over_dense"] == pytest.approx(0.2)
    assert by["1.4b", "dense"]["over_dense"] == pytest.approx(1.0)
    assert "over_dense" not in by["2.8b", "compiled"] and "packed_is" not in by["2.8b", "compiled"]  # dense ran out


class _TinyLM(torch.nn.Module):
    """Stands in for the converted model: ``model(ids, position_ids=...).logits``; the positions enter the output."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, position_ids=None):
        h = self.emb(ids)
        if position_ids is not None:
            h = h * (1.0 + position_ids.unsqueeze(-1).float()).rsqrt()
        return collections.namedtuple("Out", "logits")(self.head(h))


def test_compiled_loss_is_the_eager_loss(bench, seed):
    """The compiled mode's loss (``loss_of`` with the loss compiled whole, ``fullgraph=True``) gives the eager loss and
    gradients (CPU, aot_eager: the graph itself; inductor runs on the GPU)."""
    torch.manual_seed(seed)
    model = _TinyLM()
    gen = torch.Generator().manual_seed(seed)
    ids, pos, labels = bench.packed_batch([[5, 9, 1], [14]], 16, 50, gen, "cpu")
    compiled = torch.compile(bench.loss_sum, backend="aot_eager", fullgraph=True)
    got = []
    for fn in (bench.loss_sum, compiled):
        model.zero_grad()
        loss = bench.loss_of(model, ids, labels, pos, fn)
        loss.backward()
        got.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    n = int((labels != bench.IGNORE_INDEX).sum())
    assert n == 4 + 8 + 0 + 13
    torch.testing.assert_close(got[1][0], got[0][0])
    for a, b in zip(got[1][1], got[0][1]):
        torch.testing.assert_close(a, b)
    assert got[0][1][0].abs().sum() > 0
