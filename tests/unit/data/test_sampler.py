"""The dataloader's state restores the exact data order, mid-epoch and across epochs."""

from __future__ import annotations

import pytest
from rlkit_data_rows import make_row, write_parquet

from rlkit.data.dataset import RLDataset
from rlkit.data.sampler import StatefulDataLoader, epoch_order
from rlkit.errors import DataError


class Items(list):
    """A dataset of ints; collate returns the ints so orders are easy to compare."""

    def collate(self, samples):
        return list(samples)


def _take(loader, k):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == k:
            break
    return out


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 5, 9])
def test_restore_gives_the_same_order(stop_after):
    data = Items(range(17))
    reference = StatefulDataLoader(data, 4, seed=7)  # 4 batches per epoch, 1 sample dropped
    full = [b for _ in range(3) for b in reference]
    assert len(full) == 12

    first = StatefulDataLoader(data, 4, seed=7)
    seen = []
    while len(seen) < stop_after:  # run across epoch boundaries, stop mid-epoch
        seen += _take(first, stop_after - len(seen))
    state = first.state_dict()

    resumed = StatefulDataLoader(data, 4, seed=7)
    resumed.load_state_dict(state)
    rest = []
    while len(seen) + len(rest) < 12:
        rest += list(resumed)
    assert seen + rest == full


def test_epochs_differ_and_cover_every_sample():
    loader = StatefulDataLoader(Items(range(12)), 3, seed=0)
    epoch0, epoch1 = [x for b in loader for x in b], [x for b in loader for x in b]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert epoch0 != epoch1
    assert loader.epoch == 2 and loader.position == 0
    assert [
        x for b in StatefulDataLoader(Items(range(6)), 4, shuffle=False, drop_last=False) for x in b
    ] == list(range(6))
    assert list(epoch_order(5, 0, 1)) == list(epoch_order(5, 0, 1))
    assert list(epoch_order(50, 0, 1)) != list(epoch_order(50, 0, 2))


def test_restore_refuses_other_settings():
    state = StatefulDataLoader(Items(range(10)), 2, seed=1).state_dict()
    other = StatefulDataLoader(Items(range(11)), 2, seed=2)
    with pytest.raises(DataError, match=r"seed: saved 1, now 2, num_samples: saved 10, now 11"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="fewer than one batch"):
        StatefulDataLoader(Items(range(3)), 4)


def test_with_rl_dataset(tmp_path, tokenizer):
    rows = [make_row(" ".join(["one"] * (i % 4 + 1)), str(i), index=i) for i in range(10)]
    ds = RLDataset(write_parquet(tmp_path / "t.parquet", rows), tokenizer)
    loader = StatefulDataLoader(ds, 4, seed=3)
    first = next(iter(loader))
    state = loader.state_dict()
    second = next(iter(loader))
    again = StatefulDataLoader(ds, 4, seed=3)
    again.load_state_dict(state)
    restored = next(iter(again))
    assert list(restored["row"]) == list(second["row"]) and list(first["row"]) != list(second["row"])
    assert restored["input_ids"].equal(second["input_ids"])
