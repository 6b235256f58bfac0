"""Beyond one machine: one resource pool spans two Ray nodes and a 2-rank FSDP2 actor trains across them.

``_two_nodes.py`` (a subprocess: its own cluster, the session cluster is not disturbed) starts a Ray
cluster of three nodes on distinct loopback addresses: the driver's head node 127.0.0.1 without CPUs and
two worker nodes 127.0.0.2 and 127.0.0.3 with one CPU each. The pool ``{nodes: 2, bundles_per_node: 1}``
puts one placement group on each worker node; the update must equal world size 1's, and the ranks must
rendezvous at rank 0's node, not at the driver's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("two_nodes") / "two_nodes.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # not the session cluster's
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "_two_nodes.py"), str(tiny_model_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    print(f"\ntwo-node run (s since start): {result['seconds']}")
    return result


def test_pool_spans_two_nodes_and_ranks_meet_at_rank0_node(two_nodes):
    where, driver, nodes = two_nodes["where"], two_nodes["driver"], two_nodes["nodes"]
    ids = [w["node_id"] for w in where]  # rank order
    assert len(set(ids)) == 2 and driver["node_id"] not in ids  # each rank on its own, non-driver node
    assert two_nodes["pool_nodes"] == ids  # rank i runs in the placement group of node i
    assert sorted(w["node_ip"] for w in where) == ["127.0.0.2", "127.0.0.3"]
    assert [nodes[i] for i in ids] == [w["node_ip"] for w in where]
    addr, port = two_nodes["group_rendezvous"]
    assert driver["node_ip"] == "127.0.0.1" and addr == where[0]["node_ip"] != driver["node_ip"]
    assert all(w["rendezvous"] == [addr, port] for w in where)  # every rank was handed that address
    assert f"{addr}:{port}" in where[0]["listen"]  # rank 0 serves the rendezvous store there


def test_node_groups_of_a_pool_use_distinct_nodes_even_when_ray_would_pack_them(two_nodes):
    # 0.75 of 127.0.0.3's CPU was taken: Ray's own choice puts both 0.125-CPU groups on 127.0.0.2.
    spread = two_nodes["spread"]
    assert len(set(spread["pool_nodes"])) == 2 and spread["busy_node"] in spread["pool_nodes"]


def test_two_node_update_equals_world_size_1(two_nodes, tiny_model_dir, gloo_world1):
    sys.path.insert(0, str(HERE))
    try:
        from _fsdp_ranks import assert_same_update, update_once
    finally:
        sys.path.remove(str(HERE))
    assert_same_update(update_once(str(tiny_model_dir), False), two_nodes["result"], tiny_model_dir)
