"""``pack --engine ray`` on a two-node Ray cluster on this machine (issue 17): ``ray.cluster_utils.Cluster``
starts a head and a second node (separate raylets, object stores and workers; 1 CPU each), the driver
connects with ``ray.init(address=cluster.address)``, and ``pack`` runs with 2 tasks in flight, so one
runs on each node. Checked: the bytes are the local engine's, tasks ran on both nodes (a probe around
the per-shard job records the node id of every task it starts), shards read from ``s3://`` (moto) on
both nodes, and a node lost while it runs a task (its worker SIGKILLed, then ``cluster.remove_node``:
its raylet and the rest killed) costs nothing: Ray runs the task again on the head and the bytes are still the local engine's.

One cluster for the module (~10 s to start on 2 cores); the whole module takes ~30-40 s. It runs before
``test_ray_engine.py`` (whose session-wide local Ray instance it would otherwise have to replace) and
is skipped when another Ray instance is already connected in this process.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest

from packloader import pack_dataset, pack_writer
from tests.packloader import fault_harness as fh
from tests.packloader.conftest import random_sequences, write_arrow

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError:
    ray = Cluster = None

PROBE_ENV = "PACKLOADER_TEST_PROBE_DIR"
RENDEZVOUS_S = 30.0  # how long a task waits for one on the other node (a test fails after it, not hangs)


def probe_run_job(job):
    """The per-shard job, run by a Ray task: first a marker ``<job>-<node id>-<pid>`` in the probe
    directory (named by $PACKLOADER_TEST_PROBE_DIR, inherited by the cluster's processes), then a wait until
    a task has started on the other node too (at most RENDEZVOUS_S), then a 0.3 s pause. The two tasks in
    flight thus overlap however slowly the second node starts its worker process (on a loaded machine that
    took longer than a short pause, and the driver ran every task on the head): the second task cannot have
    the head's one CPU and goes to the other node; and a node removed at a marker is removed while its task
    runs."""
    d = os.environ[PROBE_ENV]
    node = ray.get_runtime_context().get_node_id()
    with open(os.path.join(d, f"{job.index}-{node}-{os.getpid()}"), "w"):
        pass
    deadline = time.monotonic() + RENDEZVOUS_S
    while len({n for _, n in _markers(d)}) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    from packloader.pack_writer import _run_job  # (the worker's own module: never this probe)

    return _run_job(job)


def _markers(d, pids: bool = False) -> list[tuple]:
    """(job index, node id[, worker pid]) of every task the probe saw start."""
    out = []
    for n in os.listdir(d):
        if n[0].isdigit():
            job, node, pid = n.split("-")
            out.append((int(job), node, int(pid)) if pids else (int(job), node))
    return out


class TwoNodes:
    def __init__(self, cluster, worker_node, probe_dir, s3):
        self.cluster, self.worker_node, self.probe_dir, self.s3 = cluster, worker_node, probe_dir, s3
        self.head_id = cluster.head_node.node_id
        self.worker_id = worker_node.node_id

    def reset_probe(self):
        for n in os.listdir(self.probe_dir):
            os.remove(os.path.join(self.probe_dir, n))


@pytest.fixture(scope="module")
def two_nodes(request, tmp_path_factory):
    if ray is None:
        pytest.skip("ray is not installed (pip install 'packloader[ray]')")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already connected in this process (run this module on its own or first)")
    try:  # the raylets inherit this process's environment: the S3 server's variables, when there is one
        s3 = request.getfixturevalue("s3_store")
    except pytest.skip.Exception:
        s3 = None
    probe_dir = str(tmp_path_factory.mktemp("probe"))
    saved = os.environ.get(PROBE_ENV)
    os.environ[PROBE_ENV] = probe_dir
    # fast failure detection: a removed node is declared dead within ~1 s (default: ~15 s)
    system_config = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                     "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                           "_system_config": system_config})
    try:
        worker = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        cluster.wait_for_nodes()
        yield TwoNodes(cluster, worker, probe_dir, s3)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop(PROBE_ENV, None)
        else:
            os.environ[PROBE_ENV] = saved


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    return [write_arrow(str(d / f"shard-{k:03d}.arrow"), random_sequences(3000, seed=40 + k, max_len=900),
                        batch_rows=1000) for k in range(4)]


KW = dict(capacity=2048, rows_per_file=150, quiet=True)


def test_two_nodes_write_the_local_bytes(two_nodes, shards, tmp_path, monkeypatch):
    pack_dataset(shards, tmp_path / "local", **KW)
    two_nodes.reset_probe()
    monkeypatch.setattr(pack_writer, "_run_job", probe_run_job)
    pack_dataset(shards, tmp_path / "ray", engine="ray", workers=2, **KW)
    assert fh.diff(fh.snapshot(tmp_path / "ray"), fh.snapshot(tmp_path / "local")) == []
    seen = _markers(two_nodes.probe_dir)
    assert sorted(j for j, _ in seen) == [0, 1, 2, 3]
    assert {n for _, n in seen} == {two_nodes.head_id, two_nodes.worker_id}, seen


def test_two_nodes_read_s3(two_nodes, shards, tmp_path, monkeypatch):
    """Both nodes read their shards from s3:// (each task re-creates the filesystem from the URI and its
    own environment); the result is the local packing of the same shards (up to the job hashes, which
    name the sources)."""
    if two_nodes.s3 is None:
        pytest.skip("moto[server] / boto3 not installed")
    from tests.packloader.test_pack_uri import assert_same_packing

    prefix = f"cluster-{tmp_path.name}"
    uris = [two_nodes.s3.upload(p, f"{prefix}/{os.path.basename(p)}") for p in shards]
    pack_dataset(shards, tmp_path / "local", **KW)
    two_nodes.reset_probe()
    monkeypatch.setattr(pack_writer, "_run_job", probe_run_job)
    pack_dataset([f"s3://{two_nodes.s3.bucket}/{prefix}/shard-*.arrow"], tmp_path / "ray", engine="ray", workers=2,
                 **KW)
    assert_same_packing(tmp_path / "local", tmp_path / "ray", uris)
    assert {n for _, n in _markers(two_nodes.probe_dir)} == {two_nodes.head_id, two_nodes.worker_id}


def test_node_removed_mid_job(two_nodes, shards, tmp_path, monkeypatch):
    """The second node is lost as soon as a task starts on it (the task's worker SIGKILLed, the node's
    raylet and other processes killed by ``cluster.remove_node``): Ray runs that task again on the head, and the job ends with the local engine's bytes and no temp file.
    (Last in the module: the cluster has one node afterwards.)"""
    pack_dataset(shards, tmp_path / "local", **KW)
    two_nodes.reset_probe()
    monkeypatch.setattr(pack_writer, "_run_job", probe_run_job)
    removed = threading.Event()
    stop = threading.Event()

    def remover():
        while not stop.is_set():
            pids = [pid for _, n, pid in _markers(two_nodes.probe_dir, pids=True) if n == two_nodes.worker_id]
            if pids:
                # the node's loss: its task's worker (which could otherwise finish and hand its result to
                # the driver directly, without its raylet), then the raylet and the rest of the node
                os.kill(pids[0], signal.SIGKILL)
                two_nodes.cluster.remove_node(two_nodes.worker_node, allow_graceful=False)
                removed.set()
                return
            time.sleep(0.005)

    t = threading.Thread(target=remover, daemon=True)
    t.start()
    try:
        pack_dataset(shards, tmp_path / "ray", engine="ray", workers=2, **KW)
    finally:
        stop.set()
        t.join()
    assert removed.is_set(), "no task started on the second node"
    seen = _markers(two_nodes.probe_dir)
    on_worker = {j for j, n in seen if n == two_nodes.worker_id}
    on_head = {j for j, n in seen if n == two_nodes.head_id}
    assert on_worker & on_head, f"no task of the removed node ran again on the head: {seen}"
    assert fh.diff(fh.snapshot(tmp_path / "ray"), fh.snapshot(tmp_path / "local")) == []
    assert not os.path.exists(tmp_path / "ray" / ".packloader" / "tmp")
    assert json.load(open(tmp_path / "ray" / "index.json"))["total_rows"] > 0
