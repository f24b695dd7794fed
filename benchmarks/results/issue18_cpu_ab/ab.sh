#!/bin/bash
# A/B: main (74d3804) vs core-a, same machine, back to back
R=/tmp/corea/res
run() { # name dir script args...
  local name=$1 dir=$2; shift 2
  echo "== $name $(cat /proc/loadavg) $(date -u +%H:%M:%S)" >> $R/log.txt
  (cd $dir && python "$@" >> $R/log.txt 2>&1)
  echo "== end $name $(cat /proc/loadavg)" >> $R/log.txt
}
for i in 1 2; do
  run prepack_main_$i /tmp/corea/main benchmarks/bench_prepack.py --data-dir /tmp/corea/benchdata --out $R/prepack_main_$i.json
  run prepack_new_$i /work/wt-core-a benchmarks/bench_prepack.py --data-dir /tmp/corea/benchdata --out $R/prepack_new_$i.json
done
for i in 1 2; do
  run loader_main_$i /tmp/corea/main benchmarks/bench_loader.py --data-dir /tmp/corea/loaderdata --out $R/loader_main_$i.json
  run loader_new_$i /work/wt-core-a benchmarks/bench_loader.py --data-dir /tmp/corea/loaderdata --out $R/loader_new_$i.json
done
run packing_main /tmp/corea/main benchmarks/bench_packing.py --out $R/packing_main.json
run packing_new /work/wt-core-a benchmarks/bench_packing.py --out $R/packing_new.json
echo ALLDONE >> $R/log.txt
