"""Snapshots, fork and the filesystem-only pause through the sync Python SDK
(issue 21; the process backend keeps files, not memory): create_snapshot
-> Sandbox.create from it, list_snapshots, delete_snapshot, fork, and
pause(keep_memory=False) -> connect."""

import inspect

import pytest
from e2b import Sandbox, SandboxException, SandboxState


def test_snapshot_create_from_it_list_delete(server):
    sbx = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/kept.txt", "kept by the snapshot\n")
        snap = sbx.create_snapshot()
        assert snap.snapshot_id.endswith(":default")
        assert sbx.get_info().state == SandboxState.RUNNING
        child = Sandbox.create(snap.snapshot_id)
        try:
            assert child.files.read("/home/user/kept.txt") == "kept by the snapshot\n"
        finally:
            child.kill()
        listed = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
        if "mode" in inspect.signature(Sandbox.create_snapshot).parameters:
            with pytest.raises(SandboxException):
                sbx.create_snapshot(mode="full")  # memory snapshots: refused, not silently files
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        sbx.kill()


def test_fork_has_the_parents_files(server):
    parent = Sandbox.create("base", envs={"FROM_PARENT": "1"})
    try:
        parent.files.write("/home/user/state", "seven")
        forks = parent.fork(count=2, timeout=60)
        assert len(forks) == 2
        for f in forks:
            assert isinstance(f, Sandbox), f
            assert f.sandbox_id != parent.sandbox_id
            assert f.files.read("/home/user/state") == "seven"
            assert f.commands.run("echo $FROM_PARENT").stdout == "1\n"
            f.kill()
    finally:
        parent.kill()


def test_pause_without_memory_then_connect(server):
    sbx = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/disk.txt", "on disk\n")
        sbx.pause(keep_memory=False)
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.files.read("/home/user/disk.txt") == "on disk\n"
        assert back.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()
