#!/usr/bin/env bash
# Waits (at most LIMIT seconds) for a background GPU run to write "done" into OUTDIR/progress, then packs what exists
# into DEST as the lent machine hands files back: at most 8 files of 16 MiB. The logs and JSON go into one archive
# (results.tgz); the profiler traces into archives of at most 15 MiB each (traces.tgz.part-*).
#
#   bash benchmarks/gpu/collect.sh OUTDIR DEST [LIMIT]
set -u
src=${1:?usage: collect.sh OUTDIR DEST [LIMIT]}; dest=${2:?usage: collect.sh OUTDIR DEST [LIMIT]}; lim=${3:-540}
t=0
while [ "$t" -lt "$lim" ] && ! grep -q "done" "$src/progress" 2>/dev/null; do sleep 10; t=$((t + 10)); done
cat "$src/progress" 2>/dev/null
mkdir -p "$dest"
tar czf "$dest/results.tgz" -C "$(dirname "$src")" --exclude="$(basename "$src")/traces" "$(basename "$src")"
if [ -d "$src/traces" ]; then
  tar czf - -C "$src" traces | split -b 15M -d -a 1 - "$dest/traces.tgz.part-"
  ls "$dest"/traces.tgz.part-* | tail -n +7 | xargs -r rm -f   # 1 + at most 6 parts + room for one more file
fi
ls -la "$dest"
