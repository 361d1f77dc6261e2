"""Starts the real sandgate binary for the Python suites (tests/e2e-python,
tests/openapi): `sandgate serve` on 127.0.0.1:0, synchronised on the banner
it prints once it listens (URL and the local tenant's key, read with a
deadline, never a sleep); its stdout is drained for its whole life."""
import re
import shutil
import subprocess
import threading
from typing import List, Tuple


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
