"""The async Python SDK (AsyncSandbox): control plane, commands with
streaming callbacks, stdin and connect, files, watch_dir (the streaming
WatchDir RPC, unlike the sync SDK's polling watcher), PTY, pause/resume,
and the error classes for 401, 404, 429 and timeouts."""

import asyncio
import datetime

import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    NotFoundException,
    PtySize,
    RateLimitException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

from conftest import start_sandgate
from test_control_plane import NO_RETRIES


async def wait_for(what: str, event: asyncio.Event, timeout: float = 30):
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pytest.fail(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
async def asbx(server):
    s = await AsyncSandbox.create("base", timeout=300, envs={"SANDBOX_WIDE": "yes"}, metadata={"api": "async"})
    yield s
    await s.kill()


async def test_async_control_plane_lifecycle(server):
    tag = "async-" + datetime.datetime.now().strftime("%H%M%S%f")
    a = await AsyncSandbox.create("base", timeout=90, metadata={"suite": tag, "k": "v&w"}, envs={"E": "1"})
    b = await AsyncSandbox.create("base", metadata={"suite": tag})
    info = await a.get_info()
    assert info.sandbox_id == a.sandbox_id and info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": tag, "k": "v&w"}
    assert 80 <= (info.end_at - info.started_at).total_seconds() <= 100
    assert (await a.commands.run("echo $E")).stdout == "1\n"

    got = await AsyncSandbox.list(query=SandboxQuery(metadata={"k": "v&w"})).next_items()
    assert [s.sandbox_id for s in got] == [a.sandbox_id]
    pager = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
    seen = []
    while pager.has_next:
        seen += [s.sandbox_id for s in await pager.next_items()]
        assert len(seen) <= 4, "pagination never ended"
    assert sorted(seen) == sorted([a.sandbox_id, b.sandbox_id])

    await a.set_timeout(200)
    left = ((await a.get_info()).end_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    assert 160 < left <= 205

    await a.files.write("/tmp/kept.txt", "kept")
    assert await a.pause() is True
    assert await a.pause() is False
    assert (await AsyncSandbox.get_info(a.sandbox_id)).state == SandboxState.PAUSED
    again = await AsyncSandbox.connect(a.sandbox_id)
    assert (await again.get_info()).state == SandboxState.RUNNING
    assert await again.files.read("/tmp/kept.txt") == "kept"

    metrics = await a.get_metrics()
    assert metrics and metrics[-1].mem_used > 0

    assert await a.kill() is True
    assert await AsyncSandbox.kill(a.sandbox_id) is False
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(a.sandbox_id)
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(a.sandbox_id)
    assert await b.kill() is True


async def test_async_errors_401_429(server):
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create("base", api_key="e2b_" + "0" * 40)
    srv = start_sandgate(["--rate", "1"])
    try:
        with pytest.raises(RateLimitException):
            for _ in range(200):
                await AsyncSandbox.list(**srv.opts, **NO_RETRIES).next_items()
    finally:
        srv.stop()


async def test_async_commands(asbx):
    r = await asbx.commands.run("echo $FOO $SANDBOX_WIDE; pwd; whoami", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar yes\n/tmp\nuser\n"
    assert (await asbx.commands.run("whoami", user="root")).stdout == "root\n"

    with pytest.raises(CommandExitException) as e:
        await asbx.commands.run("echo oops >&2; exit 4")
    assert (e.value.exit_code, e.value.stderr) == (4, "oops\n")

    out, err = [], []
    await asbx.commands.run("echo a; echo b >&2; echo c", on_stdout=out.append, on_stderr=err.append)
    assert ("".join(out), "".join(err)) == ("a\nc\n", "b\n")

    with pytest.raises(TimeoutException):
        await asbx.commands.run("sleep 30", timeout=1)


async def test_async_background_stdin_connect_kill(asbx):
    lines = []
    got_ready = asyncio.Event()

    def on_stdout(s):
        lines.append(s)
        if "ready" in "".join(lines):
            got_ready.set()

    h = await asbx.commands.run("echo ready; read x; echo got $x", background=True, stdin=True, on_stdout=on_stdout)
    await wait_for("the background command's first line", got_ready)
    assert h.pid in [p.pid for p in await asbx.commands.list()]

    # A second client attaches to the running process and sees its output.
    tail = []
    other = await asbx.commands.connect(h.pid, on_stdout=tail.append)
    await asbx.commands.send_stdin(h.pid, "via-stdin\n")
    r = await h.wait()
    assert r.stdout == "ready\ngot via-stdin\n"
    r2 = await other.wait()
    assert "got via-stdin\n" in "".join(tail) and r2.exit_code == 0

    k = await asbx.commands.run("sleep 600", background=True)
    assert await asbx.commands.kill(k.pid) is True
    with pytest.raises(CommandExitException):
        await k.wait()
    assert await asbx.commands.kill(k.pid) is False


async def test_async_files(asbx):
    await asbx.files.write("/tmp/a/t.txt", "text")
    assert await asbx.files.read("/tmp/a/t.txt") == "text"
    await asbx.files.write("/tmp/a/b.bin", b"\x00\xff\x01")
    assert bytes(await asbx.files.read("/tmp/a/b.bin", format="bytes")) == b"\x00\xff\x01"
    infos = await asbx.files.write_files([{"path": "/tmp/a/m1", "data": "1"}, {"path": "/tmp/a/d/m2", "data": b"2"}])
    assert sorted(i.path for i in infos) == ["/tmp/a/d/m2", "/tmp/a/m1"]
    assert sorted(e.name for e in await asbx.files.list("/tmp/a")) == ["b.bin", "d", "m1", "t.txt"]
    assert "/tmp/a/d/m2" in [e.path for e in await asbx.files.list("/tmp/a", depth=2)]
    assert await asbx.files.exists("/tmp/a/m1") is True
    assert await asbx.files.make_dir("/tmp/a/new") is True
    await asbx.files.rename("/tmp/a/m1", "/tmp/a/new/m1")
    assert (await asbx.files.get_info("/tmp/a/new/m1")).size == 1
    await asbx.files.remove("/tmp/a/new")
    assert await asbx.files.exists("/tmp/a/new/m1") is False
    with pytest.raises(NotFoundException):
        await asbx.files.read("/tmp/a/gone")


async def test_async_watch_dir_streams_events(asbx):
    await asbx.files.make_dir("/tmp/w")
    events = []
    created = asyncio.Event()

    def on_event(ev):
        events.append(ev)
        if ev.name == "made.txt" and ev.type == FilesystemEventType.CREATE:
            created.set()

    handle = await asbx.files.watch_dir("/tmp/w", on_event=on_event)
    await asbx.commands.run("echo x > /tmp/w/made.txt")
    await wait_for("a create event on the WatchDir stream", created)
    await handle.stop()


async def test_async_pty(asbx):
    out = bytearray()
    seen = asyncio.Event()

    def on_data(data: bytes):
        out.extend(data)
        if b"size=25x90" in out:
            seen.set()

    h = await asbx.pty.create(PtySize(rows=25, cols=90), on_data=on_data)
    await asbx.pty.send_stdin(h.pid, b"echo size=$(stty size | tr ' ' x)\n")
    await wait_for("the PTY's answer", seen)
    await asbx.pty.resize(h.pid, PtySize(rows=26, cols=91))
    assert await asbx.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        await h.wait()
