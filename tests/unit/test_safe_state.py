"""Checkpoint state files are read with ``weights_only=True``: plain values round-trip, pickled objects are
refused."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlkit.batch import Batch
from rlkit.model.fsdp import rng_state, set_rng_state
from rlkit.model.state_file import CheckpointError, load_state_file, to_plain


class _Payload:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_a_pickled_object_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "marker"
    bad = tmp_path / "extra_rank0.pt"
    torch.save({"rng": {"torch": torch.get_rng_state()}, "evil": _Payload(marker)}, bad)
    assert not marker.exists()
    with pytest.raises(CheckpointError) as err:
        load_state_file(bad)
    assert str(bad) in str(err.value) and "pickled" in str(err.value)
    assert not marker.exists()


def test_a_truncated_state_file_is_a_checkpoint_error_naming_it(tmp_path):
    path = tmp_path / "trainer_state.pt"
    torch.save({"global_step": 3, "w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        load_state_file(path)


def test_rng_states_numpy_and_batches_round_trip(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    saved = rng_state()
    batch = Batch(
        {"input_ids": torch.arange(6).view(2, 3)},
        {"uid": ["a", "b"], "reward_model": [{"ground_truth": "1"}, {"ground_truth": "2"}]},
        {"temperature": 1.0, "count": np.int64(4)},
    )
    state = {"rng": saved, "queue": {"items": [(batch, batch, 3, 7)]}, "arr": np.arange(4, dtype=np.float32)}
    path = tmp_path / "state.pt"
    torch.save(to_plain(state), path)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    loaded = load_state_file(path)
    set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]
    request, result, version, serial = loaded["queue"]["items"][0]
    assert isinstance(result, Batch) and (version, serial) == (3, 7)
    assert torch.equal(result["input_ids"], batch["input_ids"])
    assert list(result["uid"]) == ["a", "b"] and result["reward_model"][1] == {"ground_truth": "2"}
    assert result.meta["count"] == 4 and isinstance(result.meta["count"], np.int64)
    assert loaded["arr"].dtype == np.float32 and loaded["arr"].tolist() == [0, 1, 2, 3]


def test_an_object_that_would_not_load_back_is_refused_at_save():
    with pytest.raises(CheckpointError, match=r"trainer_state\.odd"):
        to_plain({"odd": object()}, "trainer_state")
