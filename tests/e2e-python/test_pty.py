"""PTY through the sync Python SDK: create with a size, input, output as
terminal bytes, resize, kill, and a PTY's exit code."""

import pytest
from e2b import CommandExitException, PtySize


def _read_until(events, out: bytearray, marker: str):
    """Consumes the handle's event iterator until `marker` is in the output."""
    for _, _, pty in events:
        if pty is not None:
            out.extend(pty)
        if marker in out.decode(errors="replace"):
            return
    pytest.fail(f"the PTY ended before {marker!r}: {out.decode(errors='replace')!r}")


def test_pty_size_input_resize_exit(sbx):
    h = sbx.pty.create(PtySize(rows=30, cols=100), cwd="/tmp", envs={"PTY_VAR": "pv"})
    events = iter(h)
    out = bytearray()
    sbx.pty.send_stdin(h.pid, b"echo size=$(stty size | tr ' ' x) tty=$(test -t 0 && echo yes) $PTY_VAR $PWD $TERM\n")
    _read_until(events, out, "size=30x100 tty=yes pv /tmp xterm-256color")
    sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(h.pid, b"echo resized=$(stty size | tr ' ' x)\n")
    _read_until(events, out, "resized=40x120")
    sbx.pty.send_stdin(h.pid, b"exit 0\n")
    for _, _, pty in events:
        out.extend(pty or b"")
    r = h.wait()
    assert r.exit_code == 0
    assert r.stdout == "" and r.stderr == "", "PTY output arrives as pty data, not stdout"
    assert "logout" in out.decode(errors="replace")


def test_pty_exit_code_and_kill(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(h.pid, b"exit 7\n")
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code == 7

    k = sbx.pty.create(PtySize(rows=24, cols=80))
    assert k.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.pty.kill(k.pid) is True
    with pytest.raises(CommandExitException):
        k.wait()
    assert sbx.pty.kill(k.pid) is False
