"""envd process RPCs through the sync Python SDK: run, background, output
callbacks, stdin, kill, list, connect to a running process, exit codes as
CommandExitException, cwd, user, envs and timeouts."""

import time

import pytest
from e2b import CommandExitException, TimeoutException

from conftest import wait_until


def test_run_stdout_exit_code_envs_cwd_user(sbx):
    r = sbx.commands.run("echo hi")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "", 0)

    env = sbx.commands.run("echo $FOO $SANDBOX_WIDE; pwd; whoami", envs={"FOO": "bar"}, cwd="/tmp")
    assert env.stdout == "bar yes\n/tmp\nuser\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    # Request envs win over the sandbox-wide ones.
    assert sbx.commands.run("echo $SANDBOX_WIDE", envs={"SANDBOX_WIDE": "mine"}).stdout == "mine\n"


def test_nonzero_exit_is_command_exit_exception(sbx):
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo out; echo oops >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "out\n"
    assert e.value.stderr == "oops\n"


def test_on_stdout_on_stderr_callbacks(sbx):
    out, err = [], []
    r = sbx.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; done",
                         on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "o1\no2\no3\n" == r.stdout
    assert "".join(err) == "e1\ne2\ne3\n" == r.stderr


def test_large_output_arrives_whole(sbx):
    r = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' x")
    assert r.stdout == "x" * 3_000_000


def test_background_list_kill(sbx):
    h = sbx.commands.run("sleep 600", background=True)
    assert h.pid > 0
    procs = {p.pid: p for p in sbx.commands.list()}
    assert h.pid in procs
    assert procs[h.pid].cmd == "/bin/bash"
    assert "sleep 600" in " ".join(procs[h.pid].args)
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is False, "killing a gone process returns False (not_found)"


def test_background_handle_wait_and_handle_kill(sbx):
    h = sbx.commands.run("echo started; read x; echo got $x", background=True, stdin=True)
    h.send_stdin("line\n")
    r = h.wait()
    assert r.stdout == "started\ngot line\n"

    k = sbx.commands.run("sleep 600", background=True)
    assert k.kill() is True
    with pytest.raises(CommandExitException) as e:
        k.wait()
    assert e.value.exit_code != 0


def test_stdin_send_and_close(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "typed\n")
    sbx.commands.send_stdin(h.pid, b"bytes\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "typed\nbytes\n"


def test_connect_to_a_running_process(sbx):
    h = sbx.commands.run("read x; echo after $x", background=True, stdin=True)
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    assert again.pid == h.pid
    sbx.commands.send_stdin(h.pid, "reconnect\n")
    r = again.wait()
    assert r.stdout.endswith("after reconnect\n")


def test_command_timeout_is_timeout_exception(sbx):
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - start < 20
    # The timeout kills the process, not only the stream (Connect-Timeout-Ms);
    # the client gives up at its own deadline, the server's kill may land a
    # moment later.
    wait_until("the timed-out process to be killed",
               lambda: not [p for p in sbx.commands.list() if "sleep 30" in " ".join(p.args)], timeout=10)


def test_login_shell_and_exit_code_of_a_signal(sbx):
    h = sbx.commands.run("exec sleep 600", background=True)
    sbx.commands.run(f"kill -TERM {h.pid}", user="root")
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code != 0
