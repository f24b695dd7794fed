"""Step-time spread across ranks for a hybrid (Mamba-2 + attention) model: rows placed by tokens or by compute.

Rows of equal tokens cost the same in a pure Mamba model, not in a hybrid with attention layers: a row holding
one long sequence costs ``n^2`` attention, a row of many short ones far less. ``PackedDataLoader(...,
balance="compute", attention_factor=af)`` places each global step's rows onto ranks by the estimated cost
``sum(n) + af * sum(n^2)`` (see ``packloader.distributed``); this measures what that buys on 2 ranks:

1. a small transformers ``BambaForCausalLM`` (random weights from a config; attention every ``--attn-every``
   layers), converted by ``ops.enable_packing``; its attention layers run variable-length attention over
   the packed sequences (``flash_attention_2`` when flash-attn imports, else ``torch.nn.attention.varlen``,
   else one SDPA call per sequence), so their cost really grows with ``n^2`` per sequence;
2. ``attention_factor`` measured by ``packloader.distributed.calibrate_attention_factor`` (forward + backward
   of one row of one long sequence against one of short ones);
3. synthetic token shards with a skewed mix: ``--long-share`` of the tokens in long documents (0.5 to 1.0 x
   capacity), the rest in short ones (lognormal, median ``--short-median``), packed best-fit;
4. three placements: ``tokens`` (the default: equal tokens per rank in each step), ``compute`` (equal
   estimated cost per rank in each step) and ``compute+sorted`` (also ``cost_sort_window`` of
   ``--window-steps`` global steps' rows: rows of similar cost in the same steps). Every rank times forward +
   backward of each of its batches (no gradient sync, so the time is the rank's own work); per step the
   slowest rank sets the pace of synchronous data-parallel training. Every mode times the same plan rows
   (the first ``--steps`` global steps, after warm-up steps).

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_balance.py
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_balance.py --device cpu --smoke   # CPU, gloo

Table: per balance mode, the mean step time of the slowest rank, the mean over ranks, the spread (slowest /
mean, per step, averaged), the spread the cost model predicted, and the time a synchronous step loses to
waiting. JSON: ``benchmarks/results/balance/balance.json``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

ATTN_NAME = "packloader_varlen"


# ------------------------------------------------------------------------------------------------------------
# variable-length attention for transformers (registered under ATTN_NAME)

def _segments(position_ids, total):
    """int32 cumulative sequence starts over the flattened batch and the longest sequence."""
    import torch

    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    cu = torch.cat([starts, torch.tensor([total], device=pos.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None,
                     **kwargs):
    """Causal attention inside each packed sequence (sequences start where ``position_ids`` is 0): one
    varlen kernel (``torch.nn.attention.varlen.varlen_attn``) on CUDA when available, else SDPA per sequence.
    ``query`` [B, H, L, D], ``key`` / ``value`` [B, Hkv, L, D]; returns ``([B, L, H, D], None)``."""
    import torch
    import torch.nn.functional as F

    if position_ids is None:
        raise ValueError("packloader_varlen attention needs position_ids (the packed sequences' boundaries)")
    B, H, L, D = query.shape
    rep = H // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    cu, longest = _segments(position_ids.expand(B, L), B * L)
    if query.is_cuda and _VARLEN is not None:
        q, k, v = (t.transpose(1, 2).reshape(B * L, H, D) for t in (query, key, value))
        if "is_causal" in _VARLEN_PARAMS:
            extra = {"is_causal": True}
        elif "window_size" in _VARLEN_PARAMS:
            extra = {"window_size": (-1, 0)}
        else:
            raise TypeError("varlen_attn takes neither is_causal nor window_size")
        if "scale" in _VARLEN_PARAMS and scaling is not None:
            extra["scale"] = scaling
        out = _VARLEN(q, k, v, cu, cu, longest, longest, **extra)
        return out.reshape(B, L, H, D), None
    flat_q, flat_k, flat_v = (t.transpose(1, 2).reshape(B * L, H, D) for t in (query, key, value))
    bounds = cu.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        outs.append(F.scaled_dot_product_attention(flat_q[s:e].transpose(0, 1)[None], flat_k[s:e].transpose(0, 1)[None],
                                                   flat_v[s:e].transpose(0, 1)[None], is_causal=True,
                                                   scale=scaling)[0].transpose(0, 1))
    return torch.cat(outs).reshape(B, L, H, D), None


def _load_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None, ()
    return varlen_attn, tuple(inspect.signature(varlen_attn).parameters)


_VARLEN, _VARLEN_PARAMS = _load_varlen()


def _probe_varlen(device) -> None:
    """Forward and backward of ``varlen_attn`` once on ``device``; on any failure use SDPA per sequence."""
    global _VARLEN
    if device.type != "cuda" or _VARLEN is None:
        return
    import torch

    try:
        q = torch.randn(1, 2, 16, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        pos = torch.cat([torch.arange(10), torch.arange(6)])[None].to(device)
        out, _ = varlen_attention(None, q, q, q, None, position_ids=pos)
        out.float().sum().backward()
        torch.cuda.synchronize(device)
    except Exception as e:  # an older torch without (or with another) varlen_attn
        print(f"torch.nn.attention.varlen unusable here ({type(e).__name__}: {e}); SDPA per sequence", flush=True)
        _VARLEN = None


def attention_implementation(device) -> str:
    """flash_attention_2 when flash-attn imports on a GPU, else our varlen function (registered)."""
    _probe_varlen(device)
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except Exception:
            pass
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)  # no mask: the boundaries suffice
    return ATTN_NAME


def build_model(args, device):
    import torch
    import transformers

    import ops

    impl = attention_implementation(device)
    attn = [i for i in range(args.layers) if i % args.attn_every == args.attn_every - 1]
    # mamba_d_state 16: the largest the CUDA scan of ops takes (ops.contract.MAX_DSTATE; without mamba-ssm)
    cfg = transformers.BambaConfig(vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
                                   intermediate_size=2 * args.d_model, attn_layer_indices=attn,
                                   mamba_n_heads=2 * args.d_model // 64, mamba_d_head=64, mamba_d_state=16,
                                   mamba_n_groups=1, mamba_chunk_size=256, use_cache=False)
    cfg._attn_implementation = impl
    torch.manual_seed(args.seed)
    model = transformers.BambaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16 if device.type == "cuda"
                                                  else torch.float32)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # our registered attention isolates sequences itself (position_ids)
        ops.enable_packing(model, allow_unprotected_attention=impl == ATTN_NAME)
    return model.train(), impl, attn


def fwd_bwd(model, ids, pos):
    out = model(ids, position_ids=pos, labels=ids)
    out.loss.backward()


# ------------------------------------------------------------------------------------------------------------
# data

def write_data(directory, args):
    from _synthetic import write_arrow_shard

    os.makedirs(directory, exist_ok=True)
    tag = os.path.join(directory, f"done-{args.capacity}-{args.tokens}-{args.long_share}-{args.short_median}-"
                                  f"{args.seed}")
    pattern = os.path.join(directory, "shard-*.arrow")
    if os.path.exists(tag):
        return pattern
    rng = np.random.default_rng(args.seed)
    long_tokens = int(args.tokens * args.long_share)
    longs = []
    while sum(longs) < long_tokens:
        longs.append(int(rng.uniform(0.5, 1.0) * args.capacity))
    shorts = []
    while sum(shorts) < args.tokens - long_tokens:
        shorts.append(int(np.clip(np.exp(rng.normal(np.log(args.short_median), 0.7)), 8, args.capacity // 4)))
    lens = np.array(longs + shorts, dtype=np.int64)
    rng.shuffle(lens)
    off = np.concatenate([[0], np.cumsum(lens)])
    write_arrow_shard(os.path.join(directory, "shard-000.arrow"), off,
                      rng.integers(2, args.vocab, int(off[-1]), dtype=np.int32))
    open(tag, "w").close()
    return pattern


# ------------------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024, help="hidden size")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers")
    ap.add_argument("--attn-every", type=int, default=2, help="an attention layer every this many layers")
    ap.add_argument("--heads", type=int, default=16, help="attention heads")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary")
    ap.add_argument("--capacity", type=int, default=8192, help="tokens per packed row")
    ap.add_argument("--rows", type=int, default=2, help="rows per rank and step")
    ap.add_argument("--tokens", type=int, default=3_000_000, help="synthetic tokens")
    ap.add_argument("--long-share", type=float, default=0.4, help="share of tokens in long documents")
    ap.add_argument("--short-median", type=int, default=200, help="median length of the short documents")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per mode (a multiple of --window-steps)")
    ap.add_argument("--window-steps", type=int, default=8,
                    help="compute+sorted: cost_sort_window = this many global steps' rows")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per balance mode")
    ap.add_argument("--attention-factor", type=float, default=None, help="skip the calibration, use this")
    ap.add_argument("--seed", type=int, default=0, help="data, init and order seed")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: NCCL, cpu: gloo")
    ap.add_argument("--data-dir", default="/tmp/packloader_bench_balance", help="synthetic shards")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "balance", "balance.json"), help="JSON")
    ap.add_argument("--smoke", action="store_true", help="a tiny configuration (seconds on a CPU)")
    args = ap.parse_args(argv)
    if args.steps % args.window_steps:
        ap.error("--steps must be a multiple of --window-steps (so every mode times the same rows)")
    if args.smoke:
        args.d_model, args.layers, args.heads, args.vocab, args.capacity = 64, 2, 4, 256, 256
        args.tokens, args.steps, args.warmup, args.short_median, args.window_steps = 20000, 4, 1, 16, 2
        args.data_dir = args.data_dir + "_smoke"
        if args.out == ap.get_default("out"):
            args.out = os.path.join(args.data_dir, "balance.json")

    import torch
    import torch.distributed as dist

    from packloader import PackedDataLoader
    from packloader.distributed import calibrate_attention_factor, row_costs, step_cost_spread

    from _synthetic import init_distributed
    device, rank, world = init_distributed(args.device)
    if rank == 0:
        write_data(args.data_dir, args)
    dist.barrier()
    pattern = write_data(args.data_dir, args)
    model, impl, attn_layers = build_model(args, device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = torch.Generator().manual_seed(args.seed)

    def calib_step(pos):
        ids = torch.randint(2, args.vocab, pos.shape, generator=gen).to(device)
        fwd_bwd(model, ids, pos.to(device))
        model.zero_grad(set_to_none=True)

    if args.attention_factor is None:
        cal = calibrate_attention_factor(calib_step, args.capacity, short_length=max(8, args.short_median),
                                         repeats=5, warmup=2, synchronize=sync)
        factor = torch.tensor(cal.attention_factor, dtype=torch.float64, device=device)
        dist.broadcast(factor, 0)  # every rank must place rows with the same factor
        af, calibration = float(factor), cal._asdict()
    else:
        af, calibration = args.attention_factor, None
    if rank == 0:
        print(f"{impl} attention in layers {attn_layers} of {args.layers}; attention_factor {af:.3e}"
              + (f" (one long row {calibration['seconds_long'] * 1e3:.1f} ms, short rows "
                 f"{calibration['seconds_short'] * 1e3:.1f} ms)" if calibration else ""), flush=True)

    from packloader.distributed import assign_rows, assign_rows_by_cost

    window = args.window_steps * world * args.rows
    modes = {"tokens": {}, "compute": {"balance": "compute", "attention_factor": af},
             "compute+sorted": {"balance": "compute", "attention_factor": af, "cost_sort_window": window}}
    results = []
    for name, kw in modes.items():
        loader = PackedDataLoader(pattern, capacity=args.capacity, batch_size=args.rows, seed=args.seed,
                                  algorithm="bfd", overflow="split", **kw)
        if len(loader) < args.steps:
            raise SystemExit(f"error: {len(loader)} steps in the epoch, fewer than --steps {args.steps}: "
                             "raise --tokens")

        def timed(batch):
            ids, pos = batch["input_ids"].to(device), batch["position_ids"].to(device)
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            fwd_bwd(model, ids, pos)
            sync()
            model.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        for _, batch in zip(range(args.warmup), loader):  # warm-up, then the epoch afresh: every mode times
            timed(batch)                                  # the same rows (plan rows [0, steps * world * rows))
        times = [timed(batch) for _, batch in zip(range(args.steps), loader)]
        t = torch.tensor(times, dtype=torch.float64, device=device)
        every = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(every, t)
        per = torch.stack(every).cpu().numpy()  # [world, steps]
        # the cost model's prediction for the same steps (through the loader's own row source: sorted or not)
        off, _, _, length = loader.dataset.rows.epoch_pieces(args.seed, 0, True)
        cost = row_costs(off, length, af)
        tokens = loader.dataset.rows.epoch_rows(args.seed, 0, True)
        sched = (assign_rows_by_cost(cost, world, args.rows, False) if name != "tokens"
                 else assign_rows(tokens, world, args.rows, False))[:, :args.steps]
        predicted = float(step_cost_spread(sched, cost).mean())
        slowest, mean = per.max(0), per.mean(0)
        res = {"balance": name, "steps": int(per.shape[1]), "slowest_ms": float(slowest.mean() * 1e3),
               "mean_rank_ms": float(mean.mean() * 1e3), "spread": float((slowest / mean).mean()),
               "max_spread": float((slowest / mean).max()), "predicted_spread": predicted,
               "waiting_ms": float((slowest - per.min(0)).mean() * 1e3), "per_rank_ms": (per * 1e3).tolist(),
               "cost_sort_window": kw.get("cost_sort_window")}
        results.append(res)
        if rank == 0:
            print(f"{name}: slowest rank {res['slowest_ms']:.1f} ms/step, mean {res['mean_rank_ms']:.1f}, "
                  f"spread {res['spread']:.3f} (predicted {predicted:.3f})", flush=True)
    if rank == 0:
        base = results[0]["slowest_ms"]
        lines = ["| balance | steps | slowest rank ms/step | mean rank ms/step | spread (slowest / mean) | "
                 "predicted spread | waiting ms/step | step time vs tokens |", "|" + " --- |" * 8]
        for r in results:
            lines.append(f"| {r['balance']} | {r['steps']} | {r['slowest_ms']:.1f} | {r['mean_rank_ms']:.1f} | "
                         f"{r['spread']:.3f} (max {r['max_spread']:.3f}) | {r['predicted_spread']:.3f} | "
                         f"{r['waiting_ms']:.1f} | {r['slowest_ms'] / base:.3f}x |")
        table = "\n".join(lines)
        print(table)
        doc = {"results": results, "table": table, "attention_factor": af, "calibration": calibration,
               "attention": impl, "attention_layers": attn_layers, "world_size": world,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "args": vars(args),
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
