"""Fixtures of the OpenAPI fuzzer (test_openapi.py): the real sandgate
binary, started as tests/e2e-python/conftest.py starts it (port 0, its own
temp data dir, a random cgroup parent sgtest-<hex>, the URL and the local
key read from its banner), with a tenant `fuzz` capped at 3 sandboxes whose
E2B key and model key (sk-sg-...) the fuzzer uses. The server is stopped
with SIGTERM at the end of the session and must exit 0; its sandboxes die
with it.

CTest runs this directory as openapi_fuzz from BUILD_DIR/py-schemathesis
(scripts/python-venv.sh). A skipped, xfailed or deselected test, or a run
that collected nothing, fails the session: a skip must not count as a
pass."""

import os
import glob
import re
import secrets
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from sandgate_server import fail_unless_all_ran, required_env, spawn_sandgate, stop_sandgate  # noqa: E402

FUZZ_MAX_SANDBOXES = 3


@dataclass
class Server:
    url: str
    local_key: str
    fuzz_key: str
    model_key: str
    dir: str
    cgroup_parent: str
    proc: subprocess.Popen
    output: List[str] = field(default_factory=list)

    def stop(self) -> Optional[int]:
        """SIGTERM; returns the exit status (None if it had to be killed)."""
        return stop_sandgate(self.proc, self.dir)


def _required_env(name: str) -> str:
    return required_env(name, "openapi_fuzz")


def sandgate_cli(data: str, *args: str) -> str:
    """Runs a sandgate admin command on data dir `data`; returns its stdout."""
    return subprocess.run([_required_env("SANDGATE_BIN"), *args, "--data-dir", data], check=True,
                          capture_output=True, text=True, timeout=60).stdout


def _only_line(out: str, pattern: str) -> str:
    keys = re.findall(pattern, out, re.M)
    if len(keys) != 1:
        raise RuntimeError(f"expected one key matching {pattern} in {out!r}")
    return keys[0]


def start_sandgate() -> Server:
    bin_path = _required_env("SANDGATE_BIN")
    templates = _required_env("SANDGATE_TESTS_TEMPLATES_DIR")
    tmp = tempfile.mkdtemp(prefix="sandgate-openapi-")
    data = os.path.join(tmp, "data")
    fuzz_key = _only_line(sandgate_cli(data, "tenant", "create", "fuzz", "--max-sandboxes", str(FUZZ_MAX_SANDBOXES)),
                          r"^(e2b_[0-9a-f]{40})$")
    model_key = _only_line(sandgate_cli(data, "llm", "key", "create", "fuzz"), r"^(sk-sg-[0-9a-f]{48})$")
    cgroup_parent = "sgtest-" + secrets.token_hex(4)
    proc, url, key, lines = spawn_sandgate(
        [bin_path, "serve", "--listen", "127.0.0.1:0", "--data-dir", data,
         "--templates-dir", templates, "--cgroup-parent", cgroup_parent,
         # Rates high enough that the fuzzer meets the quota, not the
         # limiter (a 429 is documented either way).
         "--rate", "100000", "--create-rate", "100000", "--llm-rate", "100000",
         "--log-level", "warn", "--keep-sandboxes", "off"],
        tmp)
    return Server(url=url, local_key=key, fuzz_key=fuzz_key, model_key=model_key, dir=tmp,
                  cgroup_parent=cgroup_parent, proc=proc, output=lines)


@pytest.fixture(scope="session")
def server():
    srv = start_sandgate()
    yield srv
    status = srv.stop()
    assert status == 0, f"sandgate exited with {status} on SIGTERM"
    # Its sandboxes were killed and their cgroups removed (v2, or each v1
    # controller's hierarchy).
    left = glob.glob(f"/sys/fs/cgroup/{srv.cgroup_parent}") + glob.glob(f"/sys/fs/cgroup/*/{srv.cgroup_parent}")
    assert not left, f"sandgate left its cgroups behind after SIGTERM: {left}"


def pytest_sessionfinish(session, exitstatus):
    fail_unless_all_ran(session)
