"""One epoch of PackedDataLoader over bench_loader's pre-packed directory, num_workers=0; CPU s of all threads."""
import os, sys, time, resource, json, warnings
root = sys.argv[1]; sys.path.insert(0, root); warnings.simplefilter("ignore")
from packloader import PackedDataLoader
L = PackedDataLoader("/tmp/corea/loaderdata/packed", batch_size=8, num_workers=0)
for _ in L: pass
walls, cpus = [], []
for e in range(1, 5):
    L.set_epoch(e)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
    for _ in L: pass
    walls.append(round(time.perf_counter() - t, 3)); r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpus.append(round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 3))
print(json.dumps({"root": root, "wall": walls, "cpu": cpus, "load": os.getloadavg()}))
