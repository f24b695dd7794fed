import os, sys, time, shutil
sys.path.insert(0, os.getcwd())
import numpy as np, pyarrow as pa
from packloader import prepack
from packloader._outdir import file_checksum, atomic_path
from packloader.prepacked import packed_schema
from packloader.sources import open_shard
from packer_algos import pack
sh = open_shard("/work/main/.bench_data/prepack/shard-000.arrow", "input_ids", "labels")
L = sh.lengths(); batch = sh.read_all()
plan = pack(L, 4096, "bfd", overflow="split")
sf = np.zeros(len(L), np.int32); sr = np.arange(len(L), dtype=np.int64)
os.makedirs("/tmp/corea/w", exist_ok=True)
def old(path):  # main's write path: fresh buffers, OSFile, checksum by reading back
    cap = plan.capacity; schema = packed_schema(cap); step = max(1, prepack.RECORD_BATCH_BYTES // (4 * cap))
    with atomic_path(path, fsync=False) as tmp:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for r0 in range(0, plan.n_bins, step):
                r1 = min(plan.n_bins, r0 + step)
                ids, lab = prepack.scatter_rows(batch, plan, r0, r1)
                p0, p1 = int(plan.bin_offsets[r0]), int(plan.bin_offsets[r1])
                offs = plan.bin_offsets[r0:r1 + 1] - p0; items = plan.item_ids[p0:p1]
                cols = [pa.FixedSizeListArray.from_arrays(pa.array(ids), cap), pa.FixedSizeListArray.from_arrays(pa.array(lab), cap),
                    prepack._list_array(offs, plan.lengths[p0:p1].astype(np.int32), pa.int32()), prepack._list_array(offs, sf[items], pa.int32()),
                    prepack._list_array(offs, sr[items], pa.int64()), prepack._list_array(offs, plan.starts[p0:p1].astype(np.int32), pa.int32())]
                writer.write_batch(pa.record_batch(cols, schema=schema))
        size = os.path.getsize(tmp)
    return size, file_checksum(path)
def nocrc(path):  # the new write path without any checksum (what the checksum costs)
    cap = plan.capacity; schema = packed_schema(cap); step = max(1, prepack.RECORD_BATCH_BYTES // (4 * cap))
    bufs = (np.empty(step * cap, np.int32), np.empty(step * cap, np.int32))
    with atomic_path(path, fsync=False) as tmp:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for r0 in range(0, plan.n_bins, step):
                r1 = min(plan.n_bins, r0 + step)
                ids, lab = prepack.scatter_rows(batch, plan, r0, r1, out=bufs)
                p0, p1 = int(plan.bin_offsets[r0]), int(plan.bin_offsets[r1])
                offs = plan.bin_offsets[r0:r1 + 1] - p0; items = plan.item_ids[p0:p1]
                cols = [pa.FixedSizeListArray.from_arrays(pa.array(ids), cap), pa.FixedSizeListArray.from_arrays(pa.array(lab), cap),
                    prepack._list_array(offs, plan.lengths[p0:p1].astype(np.int32), pa.int32()), prepack._list_array(offs, sf[items], pa.int32()),
                    prepack._list_array(offs, sr[items], pa.int64()), prepack._list_array(offs, plan.starts[p0:p1].astype(np.int32), pa.int32())]
                writer.write_batch(pa.record_batch(cols, schema=schema))
    return None
def new(path):
    return prepack.write_packed_file(path, batch, plan, 0, plan.n_bins, source_file=sf, source_row=sr)
res = {"old": [], "new": [], "nocrc": []}
import resource
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
for i in range(8):
    for name, f in (("old", old), ("new", new), ("nocrc", nocrc)) if i % 2 == 0 else (("nocrc", nocrc), ("new", new), ("old", old)):
        p = f"/tmp/corea/w/{name}.arrow"
        t = time.perf_counter(); c = cpu(); out = f(p); res[name].append((time.perf_counter() - t, cpu() - c))
        os.remove(p)
for k, v in res.items():
    w = sorted(x[0] for x in v); cpu = sorted(x[1] for x in v)
    print(k, "wall best %.3f median %.3f | cpu best %.3f median %.3f" % (w[0], w[len(w)//2], cpu[0], cpu[len(cpu)//2]), out if k=="new" else "")
print("tokens", int(L.sum()), os.getloadavg())
