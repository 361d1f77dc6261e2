"""The unmodified official E2B Python SDK (PyPI `e2b`) against the real
sandgate binary, the Python twin of tests/e2e/server.mjs: a session-scoped
fixture starts `sandgate serve` on port 0 with its own temp data dir and
cgroup parent, reads the listening URL and the API key from its banner, and
points the SDK at it through E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY.
CTest runs this directory once per SDK version (e2e_py_new, e2e_py_old),
each from its own venv (scripts/python-venv.sh).

A skipped, xfailed or deselected test, or a run that collected nothing,
fails the session: a skip must not count as a pass."""

import os
import re
import secrets
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import version as _dist_version
from typing import List, Optional

import pytest

import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from sandgate_server import fail_unless_all_ran, required_env, spawn_sandgate, stop_sandgate  # noqa: E402

SDK_VERSION = tuple(int(p) for p in _dist_version("e2b").split(".")[:3])
# 2.51.0 moved create and connect to /v2; before it the SDK used the v1 routes.
SDK_USES_V1_ROUTES = SDK_VERSION < (2, 51, 0)
# The client-side API key format check (e2b_ + hex) exists up to 2.45.x.
SDK_VALIDATES_KEY_FORMAT = SDK_VERSION < (2, 46, 0)

# The code interpreter SDK (e2b-code-interpreter 2.11) needs e2b >= 2.55.1:
# only the new flavour's venv has it. Not collected in the old one (not a
# skip); in the new one a missing package fails at import.
collect_ignore = ["test_code_interpreter.py"] if SDK_VERSION < (2, 55, 1) else []


@dataclass
class Server:
    url: str
    key: str
    dir: str
    proc: subprocess.Popen
    output: List[str] = field(default_factory=list)

    @property
    def opts(self) -> dict:
        """The SDK's own connection parameters for this server."""
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": self.key}

    def stop(self) -> Optional[int]:
        """SIGTERM; returns the exit status (None if it had to be killed)."""
        return stop_sandgate(self.proc, self.dir)


def _required_env(name: str) -> str:
    return required_env(name, "e2e_py_new / e2e_py_old")


def sandgate_cli(*args: str) -> str:
    """Runs a sandgate admin command (tenant create, ...) and returns stdout."""
    bin_path = _required_env("SANDGATE_BIN")
    return subprocess.run([bin_path, *args], check=True, capture_output=True, text=True, timeout=60).stdout


def start_sandgate(extra_args=(), data_dir: Optional[str] = None) -> Server:
    bin_path = _required_env("SANDGATE_BIN")
    templates = _required_env("SANDGATE_TESTS_TEMPLATES_DIR")
    tmp = tempfile.mkdtemp(prefix="sandgate-e2e-py-")
    data = data_dir or os.path.join(tmp, "data")
    proc, url, key, lines = spawn_sandgate(
        [bin_path, "serve", "--listen", "127.0.0.1:0", "--data-dir", data,
         "--templates-dir", templates, "--cgroup-parent", "sgtest-" + secrets.token_hex(4),
         "--log-level", "warn", "--keep-sandboxes", "off", *extra_args],
        tmp)
    return Server(url=url, key=key, dir=tmp, proc=proc, output=lines)


@pytest.fixture(scope="session")
def server():
    srv = start_sandgate()
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG")}
    os.environ["E2B_API_URL"] = srv.url
    os.environ["E2B_SANDBOX_URL"] = srv.url
    os.environ["E2B_API_KEY"] = srv.key
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.pop("E2B_DEBUG", None)
    yield srv
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    status = srv.stop()
    assert status == 0, f"sandgate exited with {status} on SIGTERM"


@pytest.fixture(scope="module")
def sbx(server):
    """One sandbox shared by a module's envd tests."""
    from e2b import Sandbox

    s = Sandbox.create("base", timeout=600, envs={"SANDBOX_WIDE": "yes"})
    yield s
    try:
        s.kill()
    except Exception:
        pass


def wait_until(what: str, probe, timeout: float = 30.0, interval: float = 0.05):
    """Polls probe() until it returns a truthy value (returned) or fails the
    test naming `what`. For state that changes asynchronously on the server
    side (watch events); never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}; last value {value!r}")
        time.sleep(interval)


def pytest_report_header(config):
    return f"e2b SDK {'.'.join(map(str, SDK_VERSION))} (v1 routes: {SDK_USES_V1_ROUTES}, key format check: {SDK_VALIDATES_KEY_FORMAT})"


def pytest_sessionfinish(session, exitstatus):
    fail_unless_all_ran(session)
