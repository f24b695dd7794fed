"""Where mamba-ssm's Mamba-2 chunk scan lets one packed sequence touch another's outputs (rounding only).

    python benchmarks/gpu/mamba2_rounding.py

mamba_chunk_scan_combined(seq_idx=...) masks every cross-sequence term, but inside a chunk it forms
exp(dA_cumsum[m] - dA_cumsum[k]) from cumulative sums that run over the whole chunk, earlier sequences included.
In exact arithmetic the earlier sequence cancels; in fp32 its dt values change the rounding. The script perturbs the
first sequence of a packed row two ways (its x only; its dt only) and prints the largest change in the second
sequence's outputs and input gradients: x alone must give exactly 0 in the forward, dt a rounding-sized change.
"""
import json
import sys

import torch


def main():
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    torch.manual_seed(0)
    b, L, h, p, g, n, chunk = 1, 512, 4, 32, 1, 32, 256
    cut = 100   # sequence 0 = [0, 100), sequence 1 = [100, 512): both share the first chunk
    x = torch.randn(b, L, h, p, device="cuda")
    dt = torch.nn.functional.softplus(torch.randn(b, L, h, device="cuda") - 1.0)
    A = -torch.exp(torch.randn(h, device="cuda"))
    B = torch.randn(b, L, g, n, device="cuda")
    C = torch.randn(b, L, g, n, device="cuda")
    seq_idx = torch.zeros(b, L, dtype=torch.int32, device="cuda")
    seq_idx[:, cut:] = 1

    def run(x_, dt_):
        return mamba_chunk_scan_combined(x_, dt_, A, B, C, chunk, seq_idx=seq_idx)

    dout = torch.randn(b, L, h, p, device="cuda")

    def run_grad(x_, dt_):
        x_ = x_.detach().requires_grad_(True)
        out = run(x_, dt_)
        out.backward(dout)
        return out.detach(), x_.grad

    ref, ref_dx = run_grad(x, dt)
    res = {}
    x_p, dt_p = x.clone(), dt.clone()
    x_p[:, :cut] = torch.randn(b, cut, h, p, device="cuda")
    dt_p[:, :cut] = torch.rand(b, cut, h, device="cuda")
    for name, (xp, dtp) in {"x of sequence 0": (x_p, dt), "dt of sequence 0": (x, dt_p)}.items():
        out, dx = run_grad(xp, dtp)
        d1 = (out[:, cut:] - ref[:, cut:]).abs().max().item()
        g1 = (dx[:, cut:] - ref_dx[:, cut:]).abs().max().item()
        res[name] = {"max |change| of sequence 1 outputs": d1, "sequence 1 max |out|": ref[:, cut:].abs().max().item(),
                     "max |change| of sequence 1 dx": g1, "sequence 1 max |dx|": ref_dx[:, cut:].abs().max().item()}
        print(f"perturb {name:<18}: sequence 1 max |d out| = {d1:.3e} (of {res[name]['sequence 1 max |out|']:.2f}), "
              f"max |d dx| = {g1:.3e} (of {res[name]['sequence 1 max |dx|']:.2f})")
    # the same call twice: run-to-run noise of the backward (atomics) for scale
    _, dx2 = run_grad(x, dt)
    res["same inputs twice"] = {"max |change| of dx": (dx2 - ref_dx).abs().max().item()}
    print(f"same inputs twice: max |d dx| = {res['same inputs twice']['max |change| of dx']:.3e}")
    json.dump(res, sys.stdout if len(sys.argv) < 2 else open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
