"""WorkerGroup on a real Ray cluster with real gloo process groups (2 ranks, 1 CPU bundle each)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray
import torch
import torch.distributed as dist

from rlkit.batch import Batch
from rlkit.errors import WorkerError
from rlkit.recipe.schema import PoolConfig, ResourcesConfig
from rlkit.workers import ResourcePoolManager, Worker, WorkerGroup

# Ray workers cannot import this test module by name; ship its classes by value instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EchoWorker(Worker):
    """A trivial role: proves the process group is real and lets tests see what each rank received."""

    def __init__(self, rank, world_size, master_addr, master_port, device, threads=1, *, scale=1.0):
        super().__init__(rank, world_size, master_addr, master_port, device, threads)
        self.scale = scale

    def all_reduce_rank(self) -> dict:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)  # 1 + 2 = 3 on both ranks only if both joined one gloo group
        return {"sum": t.item(), "backend": dist.get_backend(), "threads": torch.get_num_threads()}

    def tag(self, batch: Batch) -> Batch:
        """One row per sample: the sample's id, the rank that saw it, its token count (scaled)."""
        n = len(batch)
        return Batch(
            {
                "sample_id": batch["sample_id"].clone(),
                "seen_by": torch.full((n,), self.rank),
                "tokens": batch["attention_mask"].sum(-1) * self.scale,
            },
            {"text": batch["text"]},
        )

    def socket_addresses(self) -> list[str]:
        """Local addresses of every inet socket of this process (Ray's and gloo's)."""
        import psutil

        return sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet")})

    def count(self, batch: Batch) -> int:
        return len(batch)

    def hold(self, path: str) -> int:
        """Rank 0 answers at once; the others wait until ``path`` exists (a slow rank)."""
        # os.access and time.sleep are C: the probe's innermost Python frame is always this one
        # (os.path.exists is Python; a probe landing inside it named genericpath, once in a full run)
        while self.rank and not os.access(path, os.F_OK):
            time.sleep(0.02)
        return self.rank

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank


@pytest.fixture(scope="module")
def group(ray_cluster):
    resources = ResourcesConfig(
        device="cpu", pools={"global": PoolConfig(bundles_per_node=2, cpus_per_bundle=1)}
    )
    manager = ResourcePoolManager(resources)
    t0 = time.perf_counter()
    g = WorkerGroup(EchoWorker, manager.pool_for("actor"), role="actor", role_kwargs={"scale": 2.0})
    print(f"\n2-rank group start: {time.perf_counter() - t0:.2f} s")
    yield g
    g.shutdown()
    manager.remove_all()


def _batch(lens: list[int], width: int = 8) -> Batch:
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    return Batch(
        {"sample_id": torch.arange(len(lens)), "attention_mask": mask},  # [N], [N, L]
        {"text": [f"s{i}" for i in range(len(lens))]},
        {"step": 3},
    )


def test_process_group_is_real(group):
    out = group.call("all_reduce_rank", dispatch="all")
    assert [o["sum"] for o in out] == [3.0, 3.0]
    assert {o["backend"] for o in out} == {"gloo"}
    assert {o["threads"] for o in out} == {1}
    assert group.master_addr == "127.0.0.1"
    loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
    for addresses in group.call("socket_addresses", dispatch="all"):
        assert addresses and set(addresses) <= loopback  # gloo's sockets stay on loopback too
    assert group.call("all_reduce_rank", dispatch="rank0")["sum"] == 3.0


def test_split_round_trip_keeps_original_order(group):
    lens = [8, 1, 1, 8, 2, 7]
    batch = _batch(lens)
    t0 = time.perf_counter()
    out = group.call("tag", batch)
    print(f"\nsplit dispatch round-trip: {(time.perf_counter() - t0) * 1000:.1f} ms")
    assert out["sample_id"].tolist() == list(range(6))
    assert out["seen_by"].tolist() == [0, 0, 0, 1, 1, 1]  # contiguous halves
    assert out["tokens"].tolist() == [2.0 * n for n in lens]
    assert list(out["text"]) == [f"s{i}" for i in range(6)]


def test_balanced_split(group):
    lens = [8, 7, 8, 7, 1, 1, 2, 2]  # contiguous halves: 30 | 6; balanced: 18 | 18
    batch = _batch(lens)
    out = group.call("tag", batch, balance=True)
    assert out["sample_id"].tolist() == list(range(8))  # original order restored
    seen = out["seen_by"].tolist()
    assert seen.count(0) == seen.count(1) == 4  # equal sample counts per rank
    per_rank = [sum(n for n, r in zip(lens, seen) if r == rank) for rank in (0, 1)]
    assert per_rank == [18, 18]
    m = group.last_metrics
    assert (m["global_seqlen/min"], m["global_seqlen/max"], m["global_seqlen/minmax_diff"]) == (6, 30, 24)
    assert (m["global_seqlen/balanced_min"], m["global_seqlen/balanced_max"], m["global_seqlen/mean"]) == (
        18,
        18,
        18,
    )


def test_non_batch_results_come_back_by_rank(group):
    assert group.call("count", _batch([1, 2, 3])) == [2, 1]  # 3 samples: 2 + 1


def test_an_object_ref_goes_to_every_rank_as_its_value(group):
    """dispatch='all' with an ObjectRef (another group's result): each rank gets the value, the driver never
    fetches it."""
    import ray

    ref = ray.put(_batch([3, 5]))
    assert group.call("count", ref, dispatch="all") == [2] * group.world_size


def test_exception_reaches_driver_with_role_rank_and_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.call("fail_on", dispatch="all", rank=1)
    err = info.value
    assert (err.role, err.rank, err.method) == ("actor", 1, "fail_on")
    assert "boom from rank 1" in str(err) and "role 'actor', rank 1" in str(err)
    assert "test_group.py" in err.remote_traceback and "in fail_on" in err.remote_traceback
    assert 'raise ValueError(f"boom from rank {self.rank}")' in str(err)  # the remote source line
    print(f"\n{err}")
    assert group.call("fail_on", dispatch="all", rank=5) == [0, 1]  # a raise does not kill the actor


def test_bad_calls_are_refused_with_a_fix(group):
    with pytest.raises(WorkerError, match="has no method 'nope'"):
        group.call("nope", dispatch="all")
    with pytest.raises(WorkerError, match="cannot split 1 sample"):
        group.call("tag", _batch([3]))
    with pytest.raises(WorkerError, match="balance_key"):
        group.call("tag", Batch({"sample_id": torch.arange(2)}), balance=True)


def test_a_slow_rank_is_named_probed_and_reported_by_the_watchdog(group, tmp_path, caplog):
    """Rank 1 holds a call: in_flight() names it, probe() finds it busy in 'hold' (the liveness group runs
    beside the method), a SIGSTOPped rank does not answer, and the watchdog's report says all of it."""
    import logging
    import threading
    from types import SimpleNamespace

    from rlkit.runtime.watchdog import PhaseWatch

    release = tmp_path / "release"
    results: list = []
    waiter = threading.Thread(
        target=lambda: results.append(group.call("hold", dispatch="all", path=str(release)))
    )
    waiter.start()
    try:
        deadline = time.monotonic() + 60
        while not (calls := group.in_flight()) or calls[0].answered != {0}:
            assert time.monotonic() < deadline, calls
            time.sleep(0.02)
        assert (calls[0].method, calls[0].waiting) == ("hold", [1])
        busy = group.probe([1], timeout_s=30)[1]
        assert busy["state"] == "alive" and busy["method"] == "hold" and "test_group.py" in busy["at"]

        config = SimpleNamespace(
            slow_factor=5.0, slow_min_s=60.0, first_slow_s=0.05, ping_after_s=3600.0, ping_timeout_s=2.0
        )
        watch = PhaseWatch(lambda: [group], config)
        watch.enter("gen")
        time.sleep(0.1)
        with caplog.at_level(logging.WARNING, logger="rlkit.runtime.watchdog"):
            watch.check()
        assert "phase 'gen' of step 0 has run" in caplog.text and "first-run limit of 0.05 s" in caplog.text
        assert (
            "role 'actor', method 'hold'" in caplog.text
            and "rank(s) [1] still working, rank(s) [0] answered" in caplog.text
        )
        assert "rank 1: answers a liveness ping (pid" in caplog.text and "running 'hold' at" in caplog.text

        worker_pid = busy["pid"]
        os.kill(worker_pid, signal.SIGSTOP)
        try:
            assert group.probe([1], timeout_s=1.0)[1]["state"] == "no answer"
        finally:
            os.kill(worker_pid, signal.SIGCONT)
    finally:
        release.touch()
        waiter.join(60)
    assert results == [[0, 1]]
    assert group.in_flight() == []


def test_slow_limit_worked_examples():
    from rlkit.runtime.watchdog import slow_limit

    # fewer than 3 finished runs: the first-run limit
    assert slow_limit([4.0, 4.0], factor=5, min_s=60, first_s=600)[0] == 600
    # median 4 s: 5 × 4 = 20 s is under the 60 s floor
    assert slow_limit([4.0, 4.0, 5.0], factor=5, min_s=60, first_s=600)[0] == 60
    # median 30 s (of 20, 30, 100): 5 × 30 = 150 s
    limit, why = slow_limit([20.0, 100.0, 30.0], factor=5, min_s=60, first_s=600)
    assert limit == 150 and "its median 30 s of the last 3 runs" in why


def test_killed_actor_is_reported(ray_cluster, group):
    # Last test of the module on purpose: it breaks its own 2-rank group.
    resources = ResourcesConfig(
        device="cpu", pools={"victim": PoolConfig(bundles_per_node=2, cpus_per_bundle=0.5)}
    )
    manager = ResourcePoolManager(resources)
    victim = WorkerGroup(EchoWorker, manager.pool_for("critic"), role="critic")
    try:
        pids = victim.pids()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="worker process died") as info:
            for _ in range(50):  # the death may take a moment to be noticed
                victim.call("count", _batch([1, 1]))
                time.sleep(0.1)
        assert (info.value.role, info.value.rank) == ("critic", 1)
    finally:
        victim.shutdown()
        manager.remove_all()
