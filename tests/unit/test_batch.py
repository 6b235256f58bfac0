"""Batch: construction checks, selection, combination, reshaping, and their errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlkit.batch import Batch
from rlkit.errors import BatchError


def make(n: int = 4) -> Batch:
    return Batch(
        {"ids": torch.arange(n * 3).view(n, 3), "mask": torch.ones(n, 3)},
        {"uid": [f"u{i}" for i in range(n)], "gt": [{"v": i} for i in range(n)]},
        {"temperature": 1.0},
    )


def test_consistency_is_checked_when_built():
    with pytest.raises(BatchError, match="disagree"):
        Batch({"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)})
    with pytest.raises(BatchError, match="do not match"):
        Batch({"a": torch.zeros(3, 2)}, {"uid": ["x", "y"]})
    with pytest.raises(BatchError, match="scalar"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(BatchError, match="non_tensors"):
        Batch({"a": [1, 2, 3]})


def test_index_by_int_slice_list_mask():
    b = make()
    assert b[1]["uid"].tolist() == ["u1"]
    assert b[-1]["ids"][0, 0].item() == 9
    assert b[1:3]["uid"].tolist() == ["u1", "u2"]
    assert b[[3, 0]]["ids"][:, 0].tolist() == [9, 0]
    assert b[torch.tensor([True, False, False, True])]["uid"].tolist() == ["u0", "u3"]
    assert b[np.array([2])]["gt"][0] == {"v": 2}
    with pytest.raises(BatchError, match="out of range"):
        b[4]
    with pytest.raises(BatchError, match="boolean mask"):
        b[torch.tensor([True, False])]


def test_select_and_pop():
    b = make()
    s = b.select(["ids", "uid"])
    assert sorted(s.keys()) == ["ids", "uid"] and s.meta == {"temperature": 1.0}
    popped = b.pop(["mask", "gt"])
    assert sorted(popped.keys()) == ["gt", "mask"]
    assert sorted(b.keys()) == ["ids", "uid"]
    with pytest.raises(BatchError, match="missing"):
        b.select(["nope"])


def test_union_merges_and_refuses_conflicts():
    b = make()
    extra = Batch({"adv": torch.ones(4, 3)}, {"uid": b["uid"]}, {"step": 3})
    u = b.union(extra)
    assert "adv" in u and u.meta == {"temperature": 1.0, "step": 3}
    with pytest.raises(BatchError, match="'ids' differs"):
        b.union(Batch({"ids": torch.zeros(4, 3, dtype=torch.long)}))
    with pytest.raises(BatchError, match="'uid' differs"):
        b.union(Batch(non_tensors={"uid": ["a", "b", "c", "d"]}))
    with pytest.raises(BatchError, match="meta 'temperature'"):
        b.union(Batch({"x": torch.zeros(4)}, meta={"temperature": 0.5}))
    with pytest.raises(BatchError, match="4 and 2"):
        b.union(make(2))


def test_concat_split_chunk_round_trip():
    b = make(5)
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    back = Batch.concat(parts)
    assert torch.equal(back["ids"], b["ids"]) and back["uid"].tolist() == b["uid"].tolist()
    assert [len(p) for p in b.split([1, 4])] == [1, 4]
    with pytest.raises(BatchError, match="sum to"):
        b.split([1, 1])
    with pytest.raises(BatchError, match="equal parts"):
        b.chunk(2)
    assert [len(c) for c in make(4).chunk(2)] == [2, 2]
    with pytest.raises(BatchError, match="fields"):
        Batch.concat([make(2), make(2).select(["ids"])])


def test_repeat_interleave_and_tile():
    b = make(2)
    assert b.repeat(3)["uid"].tolist() == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert b.repeat(2, interleave=False)["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert b.repeat(2)["ids"][:, 0].tolist() == [0, 0, 3, 3]
    with pytest.raises(BatchError):
        b.repeat(0)


def test_reorder_needs_a_permutation():
    b = make(3)
    assert b.reorder([2, 0, 1])["uid"].tolist() == ["u2", "u0", "u1"]
    with pytest.raises(BatchError, match="permutation"):
        b.reorder([0, 0, 1])


def test_setitem_checks_size():
    b = make(3)
    b["adv"] = torch.zeros(3, 2)
    b["tag"] = ["a", "b", "c"]
    assert "adv" in b and b["tag"].tolist() == ["a", "b", "c"]
    with pytest.raises(BatchError):
        b["bad"] = torch.zeros(2)
    with pytest.raises(BatchError):
        b["bad"] = ["x"]


def test_non_tensor_only_batch():
    b = Batch(non_tensors={"a": [1, 2, 3]})
    assert len(b) == 3 and b[[0, 2]]["a"].tolist() == [1, 3]
    assert len(b.repeat(2)) == 6


def test_pickling_hands_host_tensors_over_as_arrays_and_rebuilds_the_same_batch():
    """``Batch.__reduce__``: numpy-representable host tensors travel as arrays (protocol 5 buffers, what Ray
    sends out of band), the rest (bf16, grad-requiring) as tensors; the copy is equal in every field and
    dtype, writable, and independent of the original, also when the buffers arrive read-only."""
    import pickle
    import warnings

    n = 4
    batch = make(n)
    batch["bf"] = torch.randn(n, 3).to(torch.bfloat16)
    batch["wide"] = torch.randn(n, 6)[:, ::2]  # not contiguous
    batch["leaf"] = torch.randn(n, 2, requires_grad=True)
    batch["conj"] = torch.randn(n, 2, dtype=torch.complex64).conj()  # numpy() refuses a conjugate-bit view
    fields = batch.__reduce__()[1][0]
    assert isinstance(fields["ids"], np.ndarray) and isinstance(fields["mask"], np.ndarray)
    assert all(isinstance(fields[k], torch.Tensor) for k in ("bf", "leaf", "conj"))
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert buffers  # the arrays went out of band
    readonly = [memoryview(bytes(b.raw())) for b in buffers]  # as Ray hands them back: read-only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only array
        copy = pickle.loads(data, buffers=readonly)
    assert copy.keys() == batch.keys() and copy.meta == batch.meta and len(copy) == n
    for key in batch.tensors.keys():
        assert copy[key].dtype == batch[key].dtype and torch.equal(copy[key].detach(), batch[key].detach())
    assert list(copy["uid"]) == list(batch["uid"]) and copy["gt"][2] == {"v": 2}
    copy["ids"][0, 0] = 99  # writable, and not the original's memory
    assert batch["ids"][0, 0] == 0
    assert len(pickle.loads(pickle.dumps(Batch({}, {"uid": ["a", "b"]})))) == 2  # no tensors
