"""Decode speed of a model converted by ``ops.enable_packing`` against the unconverted one (issue 33, part 1).

    python benchmarks/bench_generate.py                       # GPU: mamba-ssm if it imports, else transformers
    python benchmarks/bench_generate.py --impl both --widths 768,2560 --layers 8,24
    python benchmarks/bench_generate.py --smoke --out /tmp/decode_smoke.json      # CPU, tiny, any machine

Models (random init, ``--dtype`` parameters, bf16 by default; d_state 16, d_conv 4, expand 2, vocab 50280):

- ``mamba_ssm``: mamba-ssm's ``MambaLMHeadModel`` (Mamba-1 mixers, RMSNorm, fused add-norm, residual in fp32)
  and its ``generate`` (greedy, ``top_k=1``), without and with CUDA graphs (``cg=True``). The unconverted model
  decodes with upstream's ``causal_conv1d_update`` + Triton ``selective_state_update`` (when causal-conv1d is
  installed); the converted one with ``ops.decode``'s fused steps (``PackedMamba.step``).
- ``hf``: transformers' ``MambaForCausalLM`` and its ``generate`` (greedy, no CUDA graphs). The unconverted
  model's single-token steps run transformers' recurrent form (mamba-ssm's / causal-conv1d's kernels where they
  import, its PyTorch fallbacks otherwise), the converted model's ``ops.decode`` (``ops.hf._mamba1_decode_step``).
- ``hf_mamba2``: transformers' ``Mamba2ForCausalLM`` (head_dim 64, d_state 128, one group), the same way; the
  converted model steps through ``ops.hf.mamba2_step`` (``ops.decode.mamba2_state_step``).

For every (model, width, layers, batch, graphs) the same prompt (``--prompt`` random tokens) is generated to
``--new`` tokens by both models, alternating in ``--repeats`` rounds after one warm-up round (which also captures
the graphs): eager decoding is host-bound, and timing one model's runs after the other's let drifts of the host
decide the ratio. ``tok/s`` counts new tokens of the whole ``generate`` call (prefill included; median over the
rounds); ``decode tok/s`` takes the prefill out: (new - 1) tokens over the median, over the rounds, of the full
call's time minus the time of the call that follows it and generates one token (the prefill and the first
token). ``decode_ratio_rounds`` in the JSON gives every round's ratio. Where transformers' low-precision tokens differ,
:func:`logit_errors` says why (both models' logits against a float32 copy, stepping through the same tokens). ``identical`` compares the greedy tokens of the two
models. Table on stdout, JSON to ``--out`` (default ``benchmarks/results/generation/decode_<gpu>.json``).

Before that, one mixer's single-token step alone (``mixer_step_us`` in the JSON; ``--mixer-iters`` steps per
variant, eager and replayed from a CUDA graph): the previous torch step (``ops.decode``'s reference on the GPU, the
math ``PackedMamba.step`` ran before), ``ops.decode``'s kernels, and mamba-ssm's ``Mamba.step`` where it imports.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ops  # noqa: E402

TARGET = 1.0   # converted / unconverted decode tokens/s (issue 33)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# models


def mamba_ssm_models(d_model, n_layer, vocab, device, dtype, seed):
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(seed)
    fused = device.type == "cuda"
    cfg = MambaConfig(d_model=d_model, n_layer=n_layer, vocab_size=vocab, ssm_cfg={"layer": "Mamba1"},
                      rms_norm=True, fused_add_norm=fused, residual_in_fp32=True)
    model = MambaLMHeadModel(cfg, device=device, dtype=dtype).eval()
    return model, ops.enable_packing(copy.deepcopy(model))


def hf_models(d_model, n_layer, vocab, device, dtype, seed):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.MambaConfig(vocab_size=vocab, hidden_size=d_model, state_size=16, num_hidden_layers=n_layer,
                                   expand=2, conv_kernel=4, use_conv_bias=True, eos_token_id=None, pad_token_id=0)
    model = transformers.MambaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model, ops.enable_packing(copy.deepcopy(model))


def hf_mamba2_models(d_model, n_layer, vocab, device, dtype, seed):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(vocab_size=vocab, hidden_size=d_model, state_size=128, num_hidden_layers=n_layer,
                                    expand=2, conv_kernel=4, head_dim=64, num_heads=2 * d_model // 64, n_groups=1,
                                    eos_token_id=None, pad_token_id=0)
    model = transformers.Mamba2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model, ops.enable_packing(copy.deepcopy(model))


def mamba_ssm_generate(model, prompt, new, cg):
    def run(n):
        out = model.generate(prompt, max_length=prompt.shape[1] + n, cg=cg, top_k=1, return_dict_in_generate=True)
        return out.sequences
    return run


def hf_generate(model, prompt, new, cg):
    if cg:
        raise ValueError("the transformers path runs without CUDA graphs")

    def run(n):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return run


IMPLS = {"mamba_ssm": (mamba_ssm_models, mamba_ssm_generate), "hf": (hf_models, hf_generate),
         "hf_mamba2": (hf_mamba2_models, hf_generate)}


# --------------------------------------------------------------------------------------------------


def measure(impl, d_model, n_layer, batch, cg, args, device, dtype, models):
    """One table row. The two models alternate within every round (unconverted first in even rounds, converted
    first in odd ones), each running the full generation and then a one-token one, so slow drifts of a host-bound
    run (clocks, other processes) fall on both; a round's decode time is its full call minus its one-token call,
    and the row takes the median over ``--repeats`` rounds (after one warm-up round, which captures the graphs)."""
    _, make_gen = IMPLS[impl]
    g = torch.Generator().manual_seed(args.seed + batch)
    prompt = torch.randint(1, args.vocab, (batch, args.prompt), generator=g).to(device)
    row = {"impl": impl, "d_model": d_model, "n_layer": n_layer, "batch": batch, "cg": cg,
           "prompt": args.prompt, "new_tokens": args.new, "rounds": args.repeats}
    names = ("unconverted", "converted")
    runs = {name: make_gen(model, prompt, args.new, cg) for name, model in zip(names, models)}
    seqs = {name: runs[name](args.new) for name in names}   # warm-up: the first call captures the graphs
    for name in names:
        runs[name](1)                                         # (a shorter max_length reuses them)
    full = {name: [] for name in names}
    decode = {name: [] for name in names}
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = []
            for n in (args.new, 1):
                _sync(device)
                t0 = time.perf_counter()
                out = runs[name](n)
                _sync(device)
                t.append(time.perf_counter() - t0)
                if n == args.new:
                    seqs[name] = out
            full[name].append(t[0])
            decode[name].append(t[0] - t[1])
    for name in names:
        t_full, t_dec = statistics.median(full[name]), statistics.median(decode[name])
        row[f"{name}_tok_s"] = batch * args.new / t_full
        # None where timing noise hides the decode (tiny CPU runs)
        row[f"{name}_decode_tok_s"] = batch * (args.new - 1) / t_dec if t_dec > 0 else None
        row[f"{name}_s"] = t_full
        row[f"{name}_decode_s_rounds"] = decode[name]
    row["ratio"] = row["converted_tok_s"] / row["unconverted_tok_s"]
    dec = (row["converted_decode_tok_s"], row["unconverted_decode_tok_s"])
    row["decode_ratio"] = dec[0] / dec[1] if None not in dec else None
    # the spread: the decode ratio of every round (adjacent calls of the two models)
    row["decode_ratio_rounds"] = [u / c if c > 0 else None for u, c in zip(decode["unconverted"], decode["converted"])]
    a, b = seqs["unconverted"], seqs["converted"]
    row["identical"] = bool(a.shape == b.shape and torch.equal(a, b))
    row["tokens_differing"] = int((a != b).sum()) if a.shape == b.shape else -1
    if impl.startswith("hf") and not row["identical"] and dtype != torch.float32:
        row.update(logit_errors(models, a, args.prompt))
    return row


def _hf_steps(model, seq, prompt_len):
    """(batch, steps, vocab) float32 logits of transformers' ``model`` stepping through ``seq`` (batch, L) from its
    cache: a prefill of ``prompt_len`` tokens, then one token at a time (teacher-forced: the same tokens for every
    model)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "cache_params"
    with torch.no_grad():
        out = model(input_ids=seq[:, :prompt_len], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "cache_params", None)
        logits = [out.logits[:, -1].float()]
        for t in range(prompt_len, seq.shape[1] - 1):
            kw = {cache_kw: cache, "use_cache": True}
            if "cache_position" in params:
                kw["cache_position"] = torch.full((1,), t, dtype=torch.int64, device=seq.device)
            logits.append(model(input_ids=seq[:, t:t + 1], **kw).logits[:, -1].float())
    return torch.stack(logits, 1)


def logit_errors(models, seq, prompt_len):
    """Why greedy tokens differ in low precision: both models step through the same tokens (the unconverted model's
    output), next to a float32 copy of the unconverted model. Each model's mean |logit - float32 logit| (over steps,
    rows and the vocabulary), and how often its argmax is the float32 argmax; the step at which the two low-precision
    models' argmaxes first differ."""
    unconverted, converted = models
    reference = copy.deepcopy(unconverted).float()
    ref = _hf_steps(reference, seq, prompt_len)
    del reference
    out = {}
    argmax = {}
    for name, model in (("unconverted", unconverted), ("converted", converted)):
        got = _hf_steps(model, seq, prompt_len)
        out[f"{name}_logit_err_vs_fp32"] = (got - ref).abs().mean().item()
        out[f"{name}_argmax_agree_fp32"] = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        argmax[name] = got.argmax(-1)
    differ = (argmax["unconverted"] != argmax["converted"]).any(0).nonzero()
    out["first_step_argmax_differs"] = int(differ[0]) if differ.numel() else None
    out["fp32_logit_mean_abs"] = ref.abs().mean().item()
    return out


def _step_time(fn, device, iters, graph):
    """Mean microseconds of one ``fn()`` call over ``iters`` calls (after warm-up); with ``graph`` the
    call is captured once in a CUDA graph and replayed."""
    with torch.no_grad():
        if graph:
            s = torch.cuda.Stream(device)
            s.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream(device).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        else:
            run = fn
        for _ in range(3):
            run()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        _sync(device)
    return (time.perf_counter() - t0) / iters * 1e6


def mixer_rows(args, device, dtype, widths, batches):
    """One mixer's single-token step, microseconds: the previous torch step (ops.decode's reference: the math
    PackedMamba.step ran before), ops.decode's kernels, and mamba-ssm's Mamba.step where it imports."""
    from ops import PackedMamba

    try:
        from mamba_ssm.modules.mamba_simple import Mamba as UpstreamMamba
    except Exception:  # not installed (or broken): no upstream column
        UpstreamMamba = None
    rows = []
    graphs = [False] + ([True] if device.type == "cuda" and not args.no_cg else [])
    for d_model in widths:
        torch.manual_seed(args.seed)
        layer = PackedMamba(d_model, layer_idx=0, device=device, dtype=dtype).eval()
        upstream = None
        if UpstreamMamba is not None and device.type == "cuda":
            upstream = UpstreamMamba(d_model, layer_idx=0, device=device, dtype=dtype).eval()
            upstream.load_state_dict(layer.state_dict())
        for batch in batches:
            conv, ssm = layer.allocate_inference_cache(batch, 0)
            conv.normal_(), ssm.normal_()
            h = torch.randn(batch, 1, d_model, device=device, dtype=dtype)

            def previous():
                with ops.use_backend("reference"):
                    return layer.step(h, conv, ssm)

            variants = {"previous_torch_step": previous, "ops_decode": lambda: layer.step(h, conv, ssm)}
            if upstream is not None:
                variants["mamba_ssm"] = lambda: upstream.step(h, conv, ssm)
            for graph in graphs:
                row = {"d_model": d_model, "batch": batch, "cg": graph}
                for name, fn in variants.items():
                    row[f"{name}_us"] = _step_time(fn, device, args.mixer_iters, graph)
                rows.append(row)
                print("mixer step " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items()), flush=True)
    return rows


def _gpu_tag(device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for tag in ("h200", "h100", "a100", "l40s", "a10"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


def _versions():
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("mamba_ssm", "causal_conv1d", "transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__ if importlib.util.find_spec(mod) else None
        except Exception as e:  # a broken install: say so
            out[mod] = f"import failed: {type(e).__name__}"
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        out["commit"] = None
    return out


def _spread(ratios) -> str:
    """'lo-hi' of the rounds' decode ratios."""
    vals = [v for v in (ratios or []) if v is not None]
    return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"


def table(rows) -> str:
    head = (f"{'impl':<9} {'d_model':>7} {'layers':>6} {'batch':>5} {'cg':>3} | {'unconv tok/s':>12} "
            f"{'conv tok/s':>10} {'ratio':>6} | {'unconv dec/s':>12} {'conv dec/s':>10} {'ratio':>6} {'rounds':>11} | same")
    lines = [head, "-" * len(head)]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        lines.append(f"{r['impl']:<9} {r['d_model']:>7} {r['n_layer']:>6} {r['batch']:>5} {'y' if r['cg'] else 'n':>3} | "
                     f"{r['unconverted_tok_s']:>12.0f} {r['converted_tok_s']:>10.0f} {r['ratio']:>6.3f} | "
                     f"{f(r['unconverted_decode_tok_s'], '>12.0f'):>12} {f(r['converted_decode_tok_s'], '>10.0f'):>10} "
                     f"{f(r['decode_ratio'], '>6.3f'):>6} {_spread(r.get('decode_ratio_rounds')):>11} | "
                     f"{'yes' if r['identical'] else 'NO (%d)' % r['tokens_differing']}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--impl", choices=("auto", "mamba_ssm", "hf", "hf_mamba2", "both"), default="auto",
                    help="auto: mamba_ssm where it imports, else hf; both: mamba_ssm and hf")
    ap.add_argument("--widths", default="768,1024,1536,2048,2560", help="d_model values")
    ap.add_argument("--layers", default="8", help="layer counts")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (each runs both models)")
    ap.add_argument("--vocab", type=int, default=50280)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cg", action="store_true", help="skip the CUDA-graph runs")
    ap.add_argument("--mixer-iters", type=int, default=200,
                    help="steps timed per variant in the mixer-step table (0: skip it)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU (d_model 32, 2 layers, vocab 64, 6 new tokens, fp32)")
    ap.add_argument("--out", default=None, help="JSON output (default benchmarks/results/generation/decode_<gpu>.json)")
    args = ap.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
        args.widths, args.layers, args.batches = "32", "2", "1,3"
        args.prompt, args.new, args.repeats, args.vocab, args.dtype = 5, 6, 2, 64, "fp32"
        args.mixer_iters = min(args.mixer_iters, 5)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    has_mamba_ssm = importlib.util.find_spec("mamba_ssm") is not None
    if args.impl == "auto":
        impls = ["mamba_ssm"] if has_mamba_ssm else ["hf"]
    elif args.impl == "both":
        impls = ["mamba_ssm", "hf"]
    else:
        impls = [args.impl]
    if "mamba_ssm" in impls and not has_mamba_ssm:
        raise SystemExit("--impl mamba_ssm: mamba_ssm does not import here")
    if {"hf", "hf_mamba2"} & set(impls) and importlib.util.find_spec("transformers") is None:
        raise SystemExit("--impl hf: transformers is not installed")

    widths = [int(v) for v in args.widths.split(",")]
    layer_counts = [int(v) for v in args.layers.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    graphs = [False] + ([True] if device.type == "cuda" and not args.no_cg else [])
    mixer = mixer_rows(args, device, dtype, widths, batches) if args.mixer_iters > 0 else []
    rows = []
    for impl in impls:
        make_models, _ = IMPLS[impl]
        for n_layer in layer_counts:
            for d_model in widths:
                models = make_models(d_model, n_layer, args.vocab, device, dtype, args.seed)
                for batch in batches:
                    for cg in graphs:
                        if cg and impl.startswith("hf"):
                            continue
                        row = measure(impl, d_model, n_layer, batch, cg, args, device, dtype, models)
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
                del models
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print()
    for r in mixer:
        print("mixer step (us): " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in r.items()))
    print(table(rows))
    worst = min((r["decode_ratio"] for r in rows if r["decode_ratio"] is not None), default=float("nan"))
    print(f"\nworst decode ratio (converted / unconverted): {worst:.3f} (target >= {TARGET}); "
          f"greedy tokens identical in {sum(r['identical'] for r in rows)}/{len(rows)} cases")
    for r in rows:
        if "converted_logit_err_vs_fp32" in r:
            print(f"{r['impl']} d_model {r['d_model']} batch {r['batch']}: tokens differ; teacher-forced mean |logit - "
                  f"fp32| unconverted {r['unconverted_logit_err_vs_fp32']:.4g}, converted "
                  f"{r['converted_logit_err_vs_fp32']:.4g} (fp32 |logit| {r['fp32_logit_mean_abs']:.3g}); argmax = fp32 "
                  f"argmax {r['unconverted_argmax_agree_fp32']:.3f} / {r['converted_argmax_agree_fp32']:.3f}; the two "
                  f"first differ at step {r['first_step_argmax_differs']}")
    result = {
        "benchmark": "bench_generate", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "smoke": args.smoke, "versions": _versions(), "target_decode_ratio": TARGET,
        "settings": {k: getattr(args, k) for k in ("widths", "layers", "batches", "prompt", "new", "repeats", "vocab")},
        "rows": rows, "mixer_step_us": mixer,
    }
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generation",
                                   f"decode_{_gpu_tag(device)}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
