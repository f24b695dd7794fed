"""pack_dataset over the 8 Arrow (or tar) shards of bench_prepack into /dev/shm (no disk), one code tree per
process; prints wall and CPU seconds (all threads: getrusage)."""
import os, sys, time, shutil, resource, json
root, fmt = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
from packloader import pack_dataset
src = f"/tmp/corea/benchdata/shard-*.{fmt}"
out = f"/dev/shm/corea_ab_{os.getpid()}"
pack_dataset(f"/tmp/corea/benchdata/shard-000.{fmt}", out + "w", capacity=4096, overflow="split", quiet=True); shutil.rmtree(out + "w")
res = []
for i in range(3):
    shutil.rmtree(out, ignore_errors=True)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    rep = pack_dataset(src, out, capacity=4096, overflow="split", quiet=True)
    wall = time.perf_counter() - t; r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    res.append((wall, cpu, rep.write_seconds))
shutil.rmtree(out, ignore_errors=True)
print(json.dumps({"root": root, "fmt": fmt, "wall": [round(x[0], 3) for x in res], "cpu": [round(x[1], 3) for x in res],
                  "write": [round(x[2], 3) for x in res], "load": os.getloadavg()}))
