#!/usr/bin/env bash
# Upstream's own test suites against ops, on the GPU: causal-conv1d 1.7.0's tests/test_causal_conv1d.py (the
# causal_conv1d_fn tests: plain, varlen, varlen_padding, deterministic, race) and mamba-ssm's
# tests/ops/test_selective_scan.py (test_selective_scan, widened to fp16/bf16, odd lengths and both
# return_last_state values), through tests/ops/upstream_adapter.py. Counts go to OUTDIR/upstream_suites.json.
#
#   bash benchmarks/gpu/upstream_suites.sh OUTDIR
#   BASELINE=1 bash benchmarks/gpu/upstream_suites.sh OUTDIR    # upstream's own kernels on the same (widened) tests
#   SUITES=scan bash benchmarks/gpu/upstream_suites.sh OUTDIR   # one of the two suites (conv or scan)
#
# The scan suite runs twice: as it is, and with its reference given z in float32 (tests/ops/upstream_gate32.py:
# mamba-ssm's float32 reference rounds the gate silu(z) to fp16 / bf16, which alone fails the widened cases).
#
# Needs causal-conv1d and mamba-ssm importable (benchmarks/gpu/run.sh installs them), causal-conv1d's source archive
# in .gpu/ and mamba-ssm's test file at .gpu/upstream_tests/test_selective_scan.py (from its public repository,
# fetched beforehand; neither is part of this repository).
set -u
out=${1:?usage: upstream_suites.sh OUTDIR}; mkdir -p "$out"; out=$(cd "$out" && pwd)
work=$(mktemp -d)
tar xzf .gpu/causal_conv1d-*.tar.gz -C "$work" --wildcards '*/tests/test_causal_conv1d.py' || exit 1
conv_tests=$(ls "$work"/causal_conv1d-*/tests/test_causal_conv1d.py)
cp .gpu/upstream_tests/test_selective_scan.py "$work/test_selective_scan.py" || exit 1
python3 - "$work/test_selective_scan.py" <<'PY' || exit 1
import re, sys
p = sys.argv[1]
s = open(p).read()
head, sep, rest = s.partition("def test_selective_scan(")
head = head.replace("@pytest.mark.parametrize('itype', [torch.float32])",
                    "@pytest.mark.parametrize('itype', [torch.float32, torch.float16, torch.bfloat16])")
head = head.replace("@pytest.mark.parametrize('seqlen', [128, 256, 512, 1024, 2048, 4096])",
                    "@pytest.mark.parametrize('seqlen', [1, 7, 128, 333, 1024, 2047, 4096])")
head = head.replace('@pytest.mark.parametrize("return_last_state", [True])',
                    '@pytest.mark.parametrize("return_last_state", [False, True])')
assert head.count("torch.float16, torch.bfloat16]") >= 1 and "2047" in head and "[False, True])\n# @pytest.mark.parametrize('has_delta_bias'" in head
open(p, "w").write(head + sep + rest)
PY
common="-p no:cacheprovider -q -rs --rootdir=$work -c /dev/null"
tag=""
if [ "${BASELINE:-0}" = 1 ]; then tag="_baseline"; else common="-p tests.ops.upstream_adapter $common"; fi
suites=" ${SUITES:-conv scan} "   # SUITES=scan runs only mamba-ssm's scan suite
if [[ $suites == *" conv "* ]]; then
  timeout ${SUITE_TIMEOUT:-300} python3 -m pytest $common "$conv_tests" \
    -k "not update and not get_states and not varlen_states and not varlen_initial_states" > "$out/conv_suite$tag.log" 2>&1
  echo "causal-conv1d suite rc=$?: $(tail -1 "$out/conv_suite$tag.log")"
fi
if [[ $suites == *" scan "* ]]; then
  # twice: against mamba-ssm's own selective_scan_ref as it is (float32, the gate silu(z) rounded to z's dtype), and
  # against it with the gate in float32 (tests/ops/upstream_gate32.py)
  timeout ${SUITE_TIMEOUT:-300} python3 -m pytest $common "$work/test_selective_scan.py" \
    -k "test_selective_scan and not mamba_inner" > "$out/scan_suite$tag.log" 2>&1
  echo "selective-scan suite rc=$?: $(tail -1 "$out/scan_suite$tag.log")"
  timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -p tests.ops.upstream_gate32 $common "$work/test_selective_scan.py" \
    -k "test_selective_scan and not mamba_inner" > "$out/scan_suite_gate32$tag.log" 2>&1
  echo "selective-scan suite, reference gated in float32 rc=$?: $(tail -1 "$out/scan_suite_gate32$tag.log")"
fi
python3 - "$out" "$tag" <<'PY'
import json, re, sys
out, tag = sys.argv[1], sys.argv[2]
res = {}
import os
for name in ("conv_suite" + tag, "scan_suite" + tag, "scan_suite_gate32" + tag):
    if not os.path.exists(f"{out}/{name}.log"):
        continue
    last = open(f"{out}/{name}.log").read().strip().splitlines()[-1]
    res[name] = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|xfailed|error|errors|deselected)", last)}
    res[name]["summary"] = last
json.dump(res, open(f"{out}/upstream_suites{tag}.json", "w"), indent=1)
print(json.dumps(res, indent=1))
PY
