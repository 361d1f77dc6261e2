"""Starts the real sandgate binary for the Python suites (tests/e2e-python,
tests/openapi): `sandgate serve` on 127.0.0.1:0, synchronised on the banner
it prints once it listens (URL and the local tenant's key, read with a
deadline, never a sleep); its stdout is drained for its whole life."""
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import List, Optional, Tuple


def required_env(name: str, suite: str) -> str:
    """The environment variable ctest sets for the suite; a clear error
    naming the CTest entry when it is missing."""
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"{name} is not set: run this suite through ctest ({suite}), "
            "which sets SANDGATE_BIN and SANDGATE_TESTS_TEMPLATES_DIR"
        )
    return value


def stop_sandgate(proc: subprocess.Popen, tmp: str) -> Optional[int]:
    """SIGTERM; returns the exit status (None if it had to be killed);
    removes tmp."""
    status = None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    else:
        status = proc.returncode
    shutil.rmtree(tmp, ignore_errors=True)
    return status


def spawn_sandgate(argv: List[str], tmp: str) -> Tuple[subprocess.Popen, str, str, List[str]]:
    """Runs argv (the binary and `serve ...`); returns (process, url, local
    key, stdout lines so far, kept growing). On failure kills it, removes
    tmp and raises RuntimeError with its output."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None, text=True)
    lines: List[str] = []
    banner = threading.Event()
    found = {}

    def pump():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"listening on (https?://[0-9.:]+)", line)
            if m:
                found["url"] = m.group(1)
            m = re.search(r'API key \(tenant "local"\): (e2b_[0-9a-f]{40})$', line.rstrip("\n"))
            if m:
                found["key"] = m.group(1)
            if "url" in found and "key" in found:
                banner.set()
        banner.set()

    threading.Thread(target=pump, daemon=True).start()
    if not banner.wait(60) or "url" not in found or "key" not in found:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"sandgate did not start (exit {proc.poll()}): {''.join(lines)}")
    return proc, found["url"], found["key"], lines


def fail_unless_all_ran(session) -> None:
    """pytest_sessionfinish for the suites: a skip, xfail, xpass or
    deselected test turns a pass into a failure (exit 1), and a run that
    collected nothing exits 5, so nothing that did not run counts as a pass."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    bad = {k: len(stats.get(k, [])) for k in ("skipped", "xfailed", "xpassed", "deselected") if stats.get(k)}
    if bad and session.exitstatus == 0:
        session.exitstatus = 1
        if reporter:
            reporter.write_line(f"FAILED: tests that did not run count as failures here: {bad}", red=True)
    if session.testscollected == 0 and session.exitstatus == 0:
        session.exitstatus = 5
