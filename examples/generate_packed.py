"""Generate from many GSM8K prompts at once with packed prefill and batched decoding, and evaluate a held-out set
through packed rows (issue 33). Runs on a CPU as is (the PyTorch reference kernels), in seconds::

    python examples/generate_packed.py                          # 16 prompts, 16 new tokens, a tiny random model
    python examples/generate_packed.py --num-prompts 64 --check 64 --device cuda
    python examples/generate_packed.py --num-prompts 256 --check 8 --device cuda --cuda-graph   # decode from graphs

What it does, on the GSM8K sample embedded in packloader (tokenized with the embedded GPT-NeoX tokenizer):

1. builds a tiny transformers ``MambaForCausalLM`` (random weights: the text it writes is noise; ``--from-pretrained``
   loads a trained transformers Mamba checkpoint instead, e.g. ``state-spaces/mamba-130m-hf``, where it can be
   downloaded) and
   converts it with ``ops.enable_packing``;
2. ``ops.generate_packed``: packs the questions into rows, prefills them in one packed forward that leaves every
   question's final states, and decodes all of them together, greedily;
3. checks the first ``--check`` questions against transformers' own ``generate()`` of each question alone (the same
   tokens) and prints the two timings;
4. ``ops.evaluate_packed``: the loss of each answer given its question (the question's tokens labelled -100), from
   packed rows, and the set's perplexity.

Needs ``transformers`` (``pip install -e ".[hf]"``).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

import ops  # noqa: E402
from packloader.demo import CORPUS, TOKENIZER, data_path  # noqa: E402
from packloader.prepare import load_tokenizer  # noqa: E402


def gsm8k_pairs(n: int, offset: int = 0):
    """The first ``n`` (question, answer) pairs of the embedded GSM8K sample, after ``offset``."""
    out = []
    with gzip.open(data_path(CORPUS), "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            row = json.loads(line)
            out.append((row["question"], row["answer"]))
            if len(out) == n:
                break
    return out


def build_model(args, vocab_size: int):
    import transformers
    transformers.logging.set_verbosity_error()
    if args.from_pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.from_pretrained, dtype=torch.float32)
    else:
        torch.manual_seed(args.seed)
        cfg = transformers.MambaConfig(vocab_size=vocab_size, hidden_size=args.d_model, state_size=16,
                                       num_hidden_layers=args.layers, expand=2, conv_kernel=4, use_cache=True)
        model = transformers.MambaForCausalLM(cfg)
    return model.to(args.device).eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16, help="GSM8K questions to continue (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per question (default 16)")
    p.add_argument("--capacity", type=int, default=512, help="tokens per packed row (default 512)")
    p.add_argument("--check", type=int, default=4,
                   help="compare this many questions with transformers' generate() of each alone (default 4)")
    p.add_argument("--eval", type=int, default=8, help="question-answer pairs to evaluate (default 8; 0: skip)")
    p.add_argument("--d-model", type=int, default=64, help="width of the tiny random model (default 64)")
    p.add_argument("--layers", type=int, default=2, help="layers of the tiny random model (default 2)")
    p.add_argument("--from-pretrained", default=None, help="a transformers Mamba / FalconMamba checkpoint instead")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cuda-graph", action="store_true",
                   help="decode in fixed rows, each step one CUDA graph replay (generate_packed(cuda_graph=True); "
                        "CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tok = load_tokenizer(data_path(TOKENIZER))
    pairs = gsm8k_pairs(max(args.num_prompts, args.eval))
    prompts = [torch.tensor(tok.encode(q + "\n").ids) for q, _ in pairs[:args.num_prompts]]
    model = build_model(args, tok.get_vocab_size())
    reference = None
    if args.check:
        import copy
        reference = copy.deepcopy(model)
        reference.generation_config.eos_token_id = None
    ops.enable_packing(model)
    lengths = [len(t) for t in prompts]
    print(f"{len(prompts)} GSM8K questions, {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all); "
          f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{args.device}")

    # warm-up (first calls; with --cuda-graph the graphs of this batch, kept on the model), not timed
    warm = prompts if args.cuda_graph else prompts[:1]
    ops.generate_packed(model, [t.to(args.device) for t in warm], 2, capacity=args.capacity,
                        cuda_graph=args.cuda_graph)
    if reference is not None:
        with torch.no_grad():
            reference.generate(prompts[0][None].to(args.device), max_new_tokens=2, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    outs = ops.generate_packed(model, [t.to(args.device) for t in prompts], args.max_new_tokens,
                               capacity=args.capacity, cuda_graph=args.cuda_graph)
    packed_s = time.perf_counter() - t0
    new = sum(len(o) - len(t) for o, t in zip(outs, prompts))
    print(f"packed prefill + batched decode: {packed_s:.2f} s, {new} new tokens ({new / packed_s:.0f} tokens/s)")
    for o, t in list(zip(outs, prompts))[:2]:
        print(f"  {tok.decode(t.tolist())[:60]!r} ... -> {tok.decode(o[len(t):].tolist())!r}")

    result = {"prompts": len(prompts), "new_tokens": new, "packed_s": packed_s, "checked": 0, "identical": 0}
    if args.check:
        n = min(args.check, len(prompts))
        t0 = time.perf_counter()
        with torch.no_grad():
            for o, t in zip(outs[:n], prompts[:n]):
                ids = t[None].to(args.device)
                ref = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                         do_sample=False, pad_token_id=0)[0]
                result["identical"] += int(ref.tolist() == o.tolist())
        alone_s = time.perf_counter() - t0
        result.update(checked=n, alone_s_per_prompt=alone_s / n)
        print(f"one by one (transformers' generate): {alone_s / n:.3f} s per question "
              f"(packed: {packed_s / len(prompts):.3f}); identical tokens: {result['identical']}/{n}")

    if args.eval:
        seqs, labels = [], []
        for q, a in pairs[:args.eval]:
            qi, ai = tok.encode(q + "\n").ids, tok.encode(a).ids
            seqs.append(torch.tensor(qi + ai))
            labels.append(torch.tensor([-100] * len(qi) + ai))
        t0 = time.perf_counter()
        res = ops.evaluate_packed(model, seqs, labels, capacity=args.capacity)
        eval_s = time.perf_counter() - t0
        result.update(eval_s=eval_s, eval_loss=res.total_mean_loss, eval_perplexity=res.total_perplexity)
        print(f"evaluate_packed: {len(seqs)} question-answer pairs in {eval_s:.2f} s; answer loss "
              f"{res.total_mean_loss:.3f} nats/token, perplexity {res.total_perplexity:.0f} "
              f"(first three: {', '.join(f'{v:.3f}' for v in res.mean_loss[:3].tolist())})")
    return result


if __name__ == "__main__":
    main()
