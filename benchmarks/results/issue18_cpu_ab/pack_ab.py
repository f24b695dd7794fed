import sys, os, time, json
root = sys.argv[1]; sys.path.insert(0, root)
import numpy as np
from packer_algos import pack
rng = np.random.default_rng(0)
L = np.clip(np.round(rng.lognormal(np.log(600), 1.1, 1_000_000)), 1, 4096).astype(np.int64)
out = {}
for alg in ("bfd", "ffd"):
    for mx in (None, 8):
        pack(L[:1000], 4096, alg, max_items_per_bin=mx)
        ts = []
        for _ in range(7):
            t = time.perf_counter(); p = pack(L, 4096, alg, max_items_per_bin=mx); ts.append(time.perf_counter() - t)
        out[f"{alg} mx={mx}"] = (round(min(ts), 4), round(sorted(ts)[3], 4), p.n_bins)
print(root, json.dumps(out), os.getloadavg())
