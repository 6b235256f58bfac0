"""Atomic checkpoints: complete or absent, last K kept, a failed write leaves the previous whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlkit.runtime.checkpoint import COMPLETE, CheckpointError, CheckpointManager


def writer(payload: bytes):
    def write(tmp):
        (tmp / "actor").mkdir()
        (tmp / "actor" / "model.bin").write_bytes(payload)

    return write


def test_save_publishes_complete_folders_and_keeps_last_k(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        manager.save(step, writer(bytes([step])))
    assert [s for s, _ in manager.steps()] == [2, 3]
    latest = manager.latest()
    assert latest.name == "global_step_3" and (latest / COMPLETE).read_text() == "3\n"
    assert (latest / "actor" / "model.bin").read_bytes() == b"\x03"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_failed_write_leaves_previous_intact_and_no_partial(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, writer(b"one"))

    def crash(tmp):
        writer(b"two")(tmp)
        raise RuntimeError("killed while writing")

    with pytest.raises(
        CheckpointError, match="killed while writing; the previous checkpoint .*global_step_1 is intact"
    ):
        manager.save(2, crash)
    assert [s for s, _ in manager.steps()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]


def test_a_stop_signal_during_the_write_publishes_nothing_and_passes_through(tmp_path):
    """Ctrl-C / SIGTERM while the workers write (rlkit.runtime.stop raises RunInterrupted there): no
    global_step_2, no temporary folder, and the interrupt is not turned into a CheckpointError."""
    import signal

    from rlkit.runtime.stop import RunInterrupted

    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, writer(b"one"))

    def interrupted(tmp):
        writer(b"two")(tmp)
        raise RunInterrupted(signal.SIGTERM)

    with pytest.raises(RunInterrupted) as info:
        manager.save(2, interrupted)
    assert info.value.exit_code == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]


def test_partial_folders_are_never_resumed_and_are_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, writer(b"a"))
    (tmp_path / "global_step_5").mkdir()  # a folder without COMPLETE (e.g. copied by hand, cut short)
    (tmp_path / ".tmp-global_step_6-123").mkdir()  # what a SIGKILL during save leaves
    assert manager.resolve_resume("auto").name == "global_step_1"
    removed = sorted(p.name for p in manager.clean_partial())
    assert removed == [".tmp-global_step_6-123", "global_step_5"]


def test_resume_modes(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.resolve_resume("auto") is None
    path = manager.save(4, writer(b"x"))
    assert manager.resolve_resume("never") is None
    assert manager.resolve_resume(str(path)) == path
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.resolve_resume(str(tmp_path / "nope"))


def test_disk_full_during_write_keeps_previous_and_says_so(tmp_path):
    """A real write failure: the process's file-size limit (RLIMIT_FSIZE) makes the OS refuse the write."""
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        from rlkit.runtime.checkpoint import CheckpointManager, CheckpointError
        m = CheckpointManager({str(tmp_path)!r})
        def write(payload):
            def w(tmp):
                (tmp / "model.bin").write_bytes(payload)
            return w
        m.save(1, write(b"small"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            m.save(2, write(b"x" * (1 << 20)))
        except CheckpointError as e:
            print("ERR", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ})
    assert "ERR could not write the checkpoint of step 2" in out.stdout, out.stderr
    assert "global_step_1 is intact" in out.stdout
    manager = CheckpointManager(tmp_path)
    assert [s for s, _ in manager.steps()] == [1]
    assert (manager.latest() / "model.bin").read_bytes() == b"small"


def test_a_kill_after_complete_publishes_the_whole_folder_at_the_next_start(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(3, writer(b"old"))
    # killed while replacing step 3: the old one moved aside, the new (complete) one not yet renamed
    (tmp_path / "global_step_3").rename(tmp_path / ".tmp-old-3-99")
    new = tmp_path / ".tmp-global_step_3-99"
    new.mkdir()
    writer(b"new")(new)
    (new / "COMPLETE").write_text("3\n")
    manager.clean_partial()
    assert [s for s, _ in manager.steps()] == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3"]
    assert (tmp_path / "global_step_3" / "actor" / "model.bin").read_bytes() == b"new"
