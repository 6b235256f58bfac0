"""World size 1 and world size 2 give the same actor update for the same global batch (real gloo, FSDP2).

Each run: old log-probs, then one update call (2 PPO epochs over one mini-batch, micro-batches of 2,
KL loss and entropy bonus on) with a high LR so weights move visibly. Rank splits and micro-batch
splits differ between the runs; the global-token-count aggregation and the SUM gradient reduction
make the results equal up to float reassociation. Mode ``clip_cov``: Clip-Cov's random token
selection is made once over the global mini-batch (all-gathered), so the ranks cut the same tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("_fsdp_ranks.py")


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> dict:
    """Both modes with 2 gloo ranks in a subprocess (rank 0's results)."""
    out = tmp_path_factory.mktemp("ws2") / "ws2.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_model_dir), "2", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "clip_cov"])
def test_world_size_1_and_2_agree(tiny_model_dir, gloo_world1, two_ranks, mode):
    # FSDP ranks run one prompt pass per row; so does world size 1 here (update_once's ForwardPlan; the shared
    # prompt pass is tested against it in test_fast_paths.py; its float reassociation, through Adam, exceeds
    # this test's 1e-4).
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from _fsdp_ranks import assert_same_update, update_once
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert_same_update(update_once(str(tiny_model_dir), mode), two_ranks[mode], tiny_model_dir)
