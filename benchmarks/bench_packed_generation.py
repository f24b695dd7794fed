"""Packed prefill + batched decoding (``ops.generate_packed``) against padded batched generation and one-by-one
generation on GSM8K prompts, and the packed evaluation helper (``ops.evaluate_packed``) against batches padded to
their longest (issue 33).

    python benchmarks/bench_packed_generation.py --smoke                     # CPU, tiny, seconds (CI's smoke test)
    python benchmarks/bench_packed_generation.py --out benchmarks/results/generation/h100_hf.json   # GPU, defaults
    python benchmarks/bench_packed_generation.py --model mamba_ssm --dtype fp32 --num-prompts 256    # mamba-ssm

Prompts: GSM8K questions tokenized with the GPT-NeoX-20B tokenizer, from ``../shared/data`` (7,473 problems) when
it is there, else the sample embedded in packloader (4,000; the same tokenizer). The first ``--num-prompts`` are
used, in file order; for the evaluation, each question followed by its answer, the question labelled -100.

Model: random weights at ``--d-model`` / ``--layers`` (default: 768 / 24, the Mamba-130M shape, vocab 50280),
``--dtype``; ``--model hf`` (transformers' ``MambaForCausalLM``, any machine) or ``mamba_ssm`` (mamba-ssm's
``MambaLMHeadModel``, needs mamba-ssm; ``auto``: mamba-ssm where importable). The baselines run the unconverted model
(a copy made before ``ops.enable_packing``); every mode decodes greedily without stop tokens, ``--max-new-tokens``
per prompt (``--workloads fixed``) or each prompt's reference answer length, capped there (``answer``: what a
trained model stopping at its end-of-text token would produce; padded batches then run until their longest is done,
as transformers' generate() does, and count only the useful tokens).

Modes (generation):

- ``packed``: ``ops.generate_packed(model, prompts, batch_size=--batch-size)``: prompts in batches of that many,
  each batch packed into rows, prefilled in one packed forward, decoded together (``--cg``: ``cuda_graph=True``).
- ``padded``: the same batches, left-padded to their longest. transformers: ``generate()`` with an
  ``attention_mask`` (transformers zeroes the padded positions' inputs to the conv and the scan, so the prompts'
  states stay exact: its tokens are compared with one-by-one's). mamba-ssm: ``generate()``, which takes no mask: the
  pad tokens' state leaks into every shorter prompt, so its tokens are not compared (timed only).
- ``padded_converted``: the same on the converted model (its decode step is issue 33's fused one, where that
  applies): the difference to ``packed`` is the packing alone.
- ``one_by_one``: each of the first ``--alone`` prompts alone through the model's own ``generate()``; its tokens/s
  stands for all prompts.

Evaluation: ``ops.evaluate_packed`` (rows of ``--capacity``, or the longest sequence) against batches of
``--eval-batch`` sequences right-padded to their longest (unconverted model, per-sequence losses from the logits of
the real tokens); the largest relative difference of the per-sequence losses is reported.

Table on stdout, JSON to ``--out`` (default ``benchmarks/results/generation/<device>_<model>.json``; ``--smoke``
writes nothing unless ``--out`` is given). Timings: one run per mode after a short warm-up; CUDA synchronised.
"""
from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import ops  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared", "data")


def load_gsm8k(n: int):
    """([question ids], [answer ids], source) of the first ``n`` GSM8K problems."""
    from packloader.demo import CORPUS, TOKENIZER, data_path
    from packloader.prepare import load_tokenizer
    shared_data = os.path.join(SHARED, "gsm8k_train.jsonl")
    shared_tok = os.path.join(SHARED, "gpt-neox-20b-tokenizer.json")
    if os.path.exists(shared_data) and os.path.exists(shared_tok):
        source, tok, opener = "shared/data/gsm8k_train.jsonl", load_tokenizer(shared_tok), open(shared_data, "rt")
    else:
        source = "packloader/data/" + CORPUS
        tok, opener = load_tokenizer(data_path(TOKENIZER)), gzip.open(data_path(CORPUS), "rt", encoding="utf-8")
    qs, ans = [], []
    with opener as f:
        for line in f:
            row = json.loads(line)
            qs.append(tok.encode(row["question"] + "\n").ids)
            ans.append(tok.encode(row["answer"]).ids)
            if len(qs) == n:
                break
    if len(qs) < n:
        raise SystemExit(f"--num-prompts {n}: {source} has only {len(qs)} problems")
    return qs, ans, source


def build_model(kind: str, args, device, dtype):
    torch.manual_seed(args.seed)
    if kind == "mamba_ssm":
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        cfg = MambaConfig(d_model=args.d_model, n_layer=args.layers, vocab_size=args.vocab,
                          ssm_cfg={"layer": "Mamba1"}, rms_norm=True, residual_in_fp32=True, fused_add_norm=True)
        return MambaLMHeadModel(cfg, device=device, dtype=dtype).eval()
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.d_model, state_size=16,
                                   num_hidden_layers=args.layers, expand=2, conv_kernel=4, use_cache=True)
    model = transformers.MambaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def graphs_for_batch(model, batch: int, cg: bool) -> None:
    """mamba-ssm 2.3.2's generate(cg=True) reuses a larger batch's graph cache for a smaller batch and fails
    ("conv_state must have shape (batch_size, ...)"): a batch of another size captures its own graphs."""
    cache = getattr(model, "_decoding_cache", None)
    if cg and cache is not None and cache.max_batch_size != batch:
        model._decoding_cache = None


def generate_alone(kind, model, p, n_new, cg):
    graphs_for_batch(model, 1, cg)
    with torch.no_grad():
        if kind == "mamba_ssm":
            out = model.generate(p[None], max_length=len(p) + n_new, cg=cg, top_k=1)
            out = out.sequences if hasattr(out, "sequences") else out
            return out[0]
        return model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=n_new,
                              do_sample=False, pad_token_id=0)[0]


def generate_padded(kind, model, batch, n_new, cg, device):
    """Left-padded batch generation; each prompt's new tokens."""
    longest = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(batch):
        ids[r, longest - len(p):] = p
        mask[r, longest - len(p):] = 1
    graphs_for_batch(model, len(batch), cg)
    with torch.no_grad():
        if kind == "mamba_ssm":
            out = model.generate(ids, max_length=longest + n_new, cg=cg, top_k=1)
            out = out.sequences if hasattr(out, "sequences") else out
        else:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
    return [out[r, longest:] for r in range(len(batch))]


def padded_eval(model, seqs, labels, batch_size, device):
    """Per-sequence summed losses from batches right-padded to their longest (no mask needed: causal)."""
    sums = []
    with torch.no_grad():
        for b0 in range(0, len(seqs), batch_size):
            chunk, labs = seqs[b0:b0 + batch_size], labels[b0:b0 + batch_size]
            longest = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), longest, dtype=torch.long, device=device)
            tgt = torch.full_like(ids, -100)
            for r, (s, l) in enumerate(zip(chunk, labs)):
                ids[r, :len(s)] = s
                tgt[r, :len(s)] = l
            logits = model(ids).logits.float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1),
                                   reduction="none", ignore_index=-100).view(len(chunk), -1)
            sums.extend(loss.sum(1).double().cpu().tolist())
    return torch.tensor(sums, dtype=torch.float64)


def packed_graphs(kind, args) -> bool:
    """--cg: the packed mode decodes with ``cuda_graph=True`` too (on CUDA; transformers' Mamba: the decode graphed,
    the prefill eager)."""
    return bool(args.cg and args.device.startswith("cuda"))


def run_generation(kind, model, plain, prompts, budgets, workload, args, skip, device):
    """The generation modes on one workload (``budgets``: new tokens per prompt); rows of the table."""
    rows = []
    graphs = packed_graphs(kind, args)
    if graphs:   # the graphs this workload needs (decode, a prefill a row count) are captured once, kept on the model
        ops.generate_packed(model, prompts, budgets, capacity=args.capacity, batch_size=args.batch_size,
                            cuda_graph=True)
    packed, t_packed = timed(device, lambda: ops.generate_packed(model, prompts, budgets, capacity=args.capacity,
                                                                  batch_size=args.batch_size, cuda_graph=graphs))
    packed_new = [o[len(p):].tolist() for o, p in zip(packed, prompts)]
    useful = sum(budgets)
    assert sum(len(t) for t in packed_new) == useful
    rows.append({"workload": workload, "mode": "packed", "prompts": len(prompts), "new_tokens": useful,
                 "seconds": t_packed, "new_tokens_per_s": useful / t_packed, "cuda_graph": graphs})
    for mode, which in (("padded", plain), ("padded_converted", model)):
        if mode in skip:
            continue

        def run_padded():
            out = []
            for b0 in range(0, len(prompts), args.batch_size):
                batch, want = prompts[b0:b0 + args.batch_size], budgets[b0:b0 + args.batch_size]
                got = generate_padded(kind, which, batch, max(want), args.cg, device)
                out.extend(g[:w] for g, w in zip(got, want))     # a batch runs until its longest is done
            return out
        padded, t_pad = timed(device, run_padded)
        same = sum(int(o.tolist() == p) for o, p in zip(padded, packed_new))
        rows.append({"workload": workload, "mode": mode, "prompts": len(prompts), "new_tokens": useful,
                     "seconds": t_pad, "new_tokens_per_s": useful / t_pad,
                     "identical_to_packed": same if kind == "hf" else None})
    if "one_by_one" not in skip:
        k = min(args.alone, len(prompts))
        alone, t_alone = timed(device, lambda: [generate_alone(kind, plain, p, b, args.cg)
                                                for p, b in zip(prompts[:k], budgets[:k])])
        alone_new = [o[len(p):].tolist() for o, p in zip(alone, prompts)]
        same = sum(int(a == b) for a, b in zip(alone_new, packed_new))
        diff_tokens = sum(sum(int(x != y) for x, y in zip(a, b)) for a, b in zip(alone_new, packed_new))
        n_alone = sum(budgets[:k])
        rows.append({"workload": workload, "mode": "one_by_one", "prompts": k, "new_tokens": n_alone,
                     "seconds": t_alone, "new_tokens_per_s": n_alone / t_alone, "identical_to_packed": same,
                     "tokens_differing_from_packed": diff_tokens})
    pad_tps = next((r["new_tokens_per_s"] for r in rows if r["mode"] == "padded"), None)
    for r in rows:
        r["vs_padded"] = r["new_tokens_per_s"] / pad_tps if pad_tps else None
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny model, a dozen prompts")
    ap.add_argument("--model", default="auto", choices=["auto", "hf", "mamba_ssm"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="parameter dtype (default: bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=50280)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64, help="prompts decoded together (packed and padded)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="tokens per packed row (default: the library's, 256 for generation, 2048 for evaluation)")
    ap.add_argument("--alone", type=int, default=16, help="prompts generated one by one (their speed stands for all)")
    ap.add_argument("--eval-batch", type=int, default=16, help="sequences per padded evaluation batch")
    ap.add_argument("--workloads", default="fixed,answer",
                    help="fixed: --max-new-tokens for every prompt; answer: each prompt's reference answer length "
                         "(capped there), as if it stopped at an end-of-text token")
    ap.add_argument("--skip", default="",
                    help="comma-separated modes to skip: padded, padded_converted, one_by_one, eval")
    ap.add_argument("--cg", action="store_true",
                    help="CUDA graphs on CUDA: packed passes cuda_graph=True; mamba-ssm's baselines call "
                         "generate(cg=True) (transformers' generate() has no such switch: its baselines stay eager)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/generation/<device>_<model>)")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):   # smaller defaults; arguments given still count
        ap.set_defaults(d_model=32, layers=2, num_prompts=12, max_new_tokens=6, batch_size=4, alone=3, eval_batch=4,
                        capacity=512)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    kind = args.model
    if kind == "auto":
        try:
            import mamba_ssm  # noqa: F401
            kind = "mamba_ssm"
        except ImportError:
            kind = "hf"
    skip = {s for s in args.skip.split(",") if s}

    qs, ans, source = load_gsm8k(args.num_prompts)
    prompts = [torch.tensor(q, device=device) for q in qs]
    plain = build_model(kind, args, device, dtype)
    model = ops.enable_packing(copy.deepcopy(plain))
    n_new = args.max_new_tokens
    lengths = [len(q) for q in qs]
    print(f"{len(prompts)} GSM8K prompts ({source}), {min(lengths)}-{max(lengths)} tokens, mean "
          f"{sum(lengths) / len(lengths):.0f}; {n_new} new tokens each; model {kind} d_model {args.d_model} x "
          f"{args.layers} layers, {str(dtype).replace('torch.', '')}, {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))

    # warm-up: every path once at the timed batch size and length (Triton specialises its kernels by batch; mamba-ssm's
    # generate(cg=True) captures its graphs per batch size and keeps them while max_length does not grow)
    warm = prompts[:args.batch_size]
    ops.generate_packed(model, warm, 2, capacity=args.capacity, batch_size=args.batch_size,
                        cuda_graph=packed_graphs(kind, args))
    if "padded" not in skip:
        generate_padded(kind, plain, warm, n_new, args.cg, device)
    if "padded_converted" not in skip:
        generate_padded(kind, model, warm, n_new, args.cg, device)
    if "one_by_one" not in skip:
        generate_alone(kind, plain, warm[0], n_new, args.cg)

    rows = []
    for workload in [w for w in args.workloads.split(",") if w]:
        if workload == "fixed":
            budgets = [n_new] * len(prompts)
        elif workload == "answer":
            budgets = [max(1, min(len(a), n_new)) for a in ans]
        else:
            raise SystemExit(f"--workloads: unknown workload {workload!r} (fixed, answer)")
        rows.extend(run_generation(kind, model, plain, prompts, budgets, workload, args, skip, device))
    evals = []
    if "eval" not in skip:
        seqs = [torch.tensor(q + a, device=device) for q, a in zip(qs, ans)]
        labels = [torch.tensor([-100] * len(q) + a, device=device) for q, a in zip(qs, ans)]
        tokens = sum(len(s) for s in seqs)
        cap = None if args.capacity is None else max(args.capacity, max(len(s) for s in seqs))
        ops.evaluate_packed(model, seqs[:4], labels[:4], capacity=cap)
        padded_eval(plain, seqs[:4], labels[:4], args.eval_batch, device)
        res, t_pe = timed(device, lambda: ops.evaluate_packed(model, seqs, labels, capacity=cap))
        ref, t_pad_e = timed(device, lambda: padded_eval(plain, seqs, labels, args.eval_batch, device))
        rel = ((res.loss_sum - ref).abs() / ref.abs().clamp(min=1e-6)).max().item()
        evals = [{"mode": "evaluate_packed", "sequences": len(seqs), "tokens": tokens, "seconds": t_pe,
                  "tokens_per_s": tokens / t_pe, "vs_padded": t_pad_e / t_pe, "max_rel_loss_diff": rel},
                 {"mode": "eval padded to longest", "sequences": len(seqs), "tokens": tokens, "seconds": t_pad_e,
                  "tokens_per_s": tokens / t_pad_e, "vs_padded": 1.0, "max_rel_loss_diff": 0.0}]

    graphs = ", CUDA graphs" if args.cg else ""
    print(f"\n| workload | generation (batch {args.batch_size}{graphs}) | prompts | new tokens | s | new tokens/s | "
          "vs padded | identical to packed |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        same = r.get("identical_to_packed")
        same = "-" if r["mode"] == "packed" else ("not compared (pad state leaks)" if same is None
                                                   else f"{same}/{r['prompts']}")
        vs = f"{r['vs_padded']:.2f}x" if r["vs_padded"] else "-"
        print(f"| {r['workload']} | {r['mode']} | {r['prompts']} | {r['new_tokens']} | {r['seconds']:.2f} | "
              f"{r['new_tokens_per_s']:.0f} | {vs} | {same} |")
    if evals:
        print("\n| evaluation | sequences | tokens | s | tokens/s | vs padded | max rel. loss diff |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for e in evals:
            print(f"| {e['mode']} | {e['sequences']} | {e['tokens']} | {e['seconds']:.2f} | {e['tokens_per_s']:.0f} | "
                  f"{e['vs_padded']:.2f}x | {e['max_rel_loss_diff']:.1e} |")
    out = {"benchmark": "packed_generation", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "model": kind, "d_model": args.d_model, "layers": args.layers,
           "vocab": args.vocab, "dtype": str(dtype), "cuda_graphs": bool(args.cg), "prompts_source": source,
           "prompt_lengths": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
           "args": vars(args),
           "generation": rows, "evaluation": evals}
    path = args.out
    if path is None and not args.smoke:
        dev = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).split()[-1].lower()
        path = os.path.join(ROOT, "benchmarks", "results", "generation", f"{dev}_{kind}.json")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
