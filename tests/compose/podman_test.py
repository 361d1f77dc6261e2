#!/usr/bin/env python3
"""compose/ on a real container engine: Debian's podman and podman-compose.

What a new user does, from the repository root (docs/compose.md, "What is
verified"): build the images from compose/Dockerfile as compose does, bring
the stack up from compose/compose.yaml, wait for the healthcheck, use it,
restart it with the volume kept, and run the mock-model variant. Each step
that fails ends the run with what the engine and sandgate printed.

1. The engine: podman with runc and cgroupfs (crun refuses this host's
   mixed cgroup layout) and no default ulimits (podman's exceed this host's
   hard limits), its images and layer cache in --state-dir (kept between
   runs, like the test templates), the Debian base images made locally from
   the test template's root file system (no registry is reachable).
2. podman-compose 1.0.3 does not translate `device_cgroup_rules` and
   `userns_mode`: the equivalent `podman run` options are made from the
   rendered file (so a change there reaches this run), and the build gets
   the host's network (apt inside the build stage).
3. The stack, as a project of its own (random name, its own volume, a
   free port): the first start builds the base template into the volume
   (debootstrap, the step that failed on podman's nodev volumes), the
   healthcheck passes, the banner and key file agree, the E2B JS SDK runs
   its subset (tests/e2e/compose_sdk.mjs) with size-limited sandbox disks
   (loop devices in the container), curl creates and kills a sandbox.
4. `down` and `up` again with the volume kept: the same key, the base
   template not built again, a sandbox runs.
5. The mock-model variant (compose/mock-model.yaml): a model-proxy key made
   with `sandgate llm key create` inside the container, one OpenAI and one
   Anthropic request through sandgate to the mock.
Everything is torn down at the end, volume included, whatever happened.

Usage: podman_test.py --templates-dir DIR --state-dir DIR [--keep-going]
Exit status 0 when every step passed.
"""

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.dont_write_bytecode = True

try:
    import yaml
except ImportError:
    sys.exit("podman_test: python3-yaml is missing (scripts/install-deps.sh installs it)")

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
E2E = REPO / "tests" / "e2e"
BASE_IMAGES = ("docker.io/library/debian:bookworm", "docker.io/library/debian:bookworm-slim")
HEALTHY_WITHIN = 900  # seconds: the first start runs debootstrap before it listens


class Failed(Exception):
    pass


def log(msg):
    print(f"podman_test: {msg}", flush=True)


def run(cmd, env, check=True, timeout=1800, quiet=False, nice=False):
    if not quiet:
        log("$ " + " ".join(shlex.quote(str(c)) for c in cmd))
    try:
        r = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=(lambda: os.nice(19)) if nice else None)
    except subprocess.TimeoutExpired as e:
        raise Failed(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''}: no end after {timeout} s\n{e.stdout or ''}{e.stderr or ''}")
    if check and r.returncode != 0:
        raise Failed(f"exit {r.returncode}: {' '.join(map(str, cmd))}\n{(r.stdout + r.stderr)[-4000:]}")
    return r


def http(method, url, body=None, headers=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, state_dir: Path, work: Path):
        self.state = state_dir
        self.work = work
        (state_dir / "storage").mkdir(parents=True, exist_ok=True)
        conf = work / "containers.conf"
        conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n')
        storage = work / "storage.conf"
        storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{state_dir / "storage"}"\n'
                           f'runroot = "{work / "run"}"\n')
        self.env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        self.env |= {"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}

    def podman(self, *args, **kw):
        return run(["podman", *args], self.env, **kw)

    def base_images(self, rootfs: Path):
        if all(self.podman("image", "exists", i, check=False, quiet=True).returncode == 0 for i in BASE_IMAGES):
            return
        if not (rootfs / "etc" / "debian_version").exists():
            raise Failed(f"{rootfs} is no Debian root file system (scripts/test.sh builds it first)")
        log(f"making the Debian base images from {rootfs}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-cf", "-", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(["podman", "import", "-", "localhost/sandgate-test-debian:12"], stdin=tar.stdout,
                             env=self.env, capture_output=True, text=True)
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise Failed(f"podman import: {imp.stderr[-2000:]}")
        for i in BASE_IMAGES:
            self.podman("tag", "localhost/sandgate-test-debian:12", i)


class Stack:
    """One compose project: its own name, volume and port."""

    def __init__(self, engine: Engine, work: Path):
        self.e = engine
        self.project = "sgtest" + secrets.token_hex(4)
        self.volume = self.project + "-data"
        self.port = free_port()
        override = work / "test-override.yaml"
        # Only what makes the run hermetic: its own volume name.
        override.write_text(yaml.safe_dump({"volumes": {"sandgate-data": {"name": self.volume}}}))
        self.override = override
        self.env = engine.env | {"SANDGATE_PORT": str(self.port), "SANDGATE_BIND": "127.0.0.1"}
        self.variant = []
        self.url = f"http://127.0.0.1:{self.port}"

    def files(self):
        fs = ["-f", COMPOSE / "compose.yaml"]
        for v in self.variant:
            fs += ["-f", COMPOSE / v]
        return fs + ["-f", self.override]

    def rendered(self):
        """The sandgate service as compose renders it (docker-compose 1.29: the spec's merge)."""
        r = run(["docker-compose", "-p", self.project, *self.files(), "config"], self.env, quiet=True)
        return yaml.safe_load(r.stdout)["services"]["sandgate"]

    def run_args(self):
        """podman run options for what podman-compose 1.0.3 leaves out of the rendered file."""
        svc = self.rendered()
        args = [f"--device-cgroup-rule={r}" for r in svc.get("device_cgroup_rules", [])]
        if svc.get("userns_mode") == "host":
            args.append("--userns=host")
        return args

    def compose(self, *args, timeout=1800):
        cmd = ["podman-compose", "-p", self.project, *self.files()]
        if args[0] == "build" or args[0] == "up":
            cmd += ["--podman-build-args=--network=host"]
        if args[0] == "up":
            cmd += ["--podman-run-args=" + " ".join(shlex.quote(a) for a in self.run_args())]
            # podman-compose 1.0.3 builds again at every up (from its cache,
            # still hashing the whole context): the build step made them.
            args = ("up", "--no-build", *args[1:])
        # scripts/test.sh runs this test beside the others (CTest -j2): the
        # image build (its steps inherit the niceness) takes only the CPU
        # they leave idle; the stack itself runs at normal priority.
        if args[0] == "build":
            cmd = ["ionice", "-c", "3"] + cmd  # its disk writes wait for everyone else's too
        r = run(cmd + list(args), self.env, timeout=timeout, nice=args[0] == "build")
        if args[0] == "up":
            self.last_up = r  # podman-compose 1.0.3 exits 0 when podman fails: its words are the evidence
        return r

    def container(self):
        r = self.e.podman("ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
                          "--filter", "label=com.docker.compose.service=sandgate", "--format", "{{.Names}}", quiet=True)
        names = r.stdout.split()
        if len(names) != 1:
            up = getattr(self, "last_up", None)
            said = f"; podman-compose up said:\n{(up.stdout + up.stderr)[-4000:]}" if up else ""
            raise Failed(f"expected one sandgate container of project {self.project}, found {names}{said}")
        return names[0]

    def logs(self):
        r = self.e.podman("logs", self.container(), check=False, quiet=True)
        return r.stdout + r.stderr

    def wait_healthy(self):
        name = self.container()
        deadline = time.monotonic() + HEALTHY_WITHIN
        while time.monotonic() < deadline:
            state = self.e.podman("inspect", "--format", "{{.State.Status}}", name, check=False, quiet=True).stdout.strip()
            if state not in ("running", "created", "configured"):
                raise Failed(f"the sandgate container is {state!r} before it was healthy:\n{self.logs()[-4000:]}")
            # The compose file's healthcheck, run by the engine.
            if self.e.podman("healthcheck", "run", name, check=False, quiet=True).returncode == 0:
                return
            time.sleep(2)
        raise Failed(f"not healthy within {HEALTHY_WITHIN} s:\n{self.logs()[-4000:]}")

    def exec(self, *cmd):
        return self.e.podman("exec", self.container(), *cmd)

    def down(self, volumes=False):
        args = ["down"] + (["-v"] if volumes else [])
        self.compose(*args, timeout=300)

    def teardown(self):
        run(["podman-compose", "-p", self.project, *self.files(), "down", "-v"], self.env, check=False, timeout=300)
        self.e.podman("volume", "rm", "-f", self.volume, check=False, quiet=True)
        # The images stay in --state-dir: the next run's layer cache.


def check(cond, what, detail=""):
    if not cond:
        raise Failed(f"{what}\n{detail}"[-4000:])
    log(f"ok: {what}")


def key_of(stack):
    key = stack.exec("cat", "/var/lib/sandgate/local-api-key").stdout.strip()
    check(len(key) >= 20 and key.isprintable() and " " not in key, "the local key is in the data volume", key)
    return key


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--templates-dir", required=True, help="holds the test base template (the base images are made of it)")
    ap.add_argument("--state-dir", required=True, help="podman's images and layer cache, kept between runs")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("podman_test: needs root (the container holds CAP_SYS_ADMIN and makes device nodes)")
    for tool in ("podman", "podman-compose", "runc", "docker-compose", "node"):
        if not shutil.which(tool):
            sys.exit(f"podman_test: {tool} is missing (scripts/install-deps.sh installs it)")

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sgpodman") as tmp:
        work = Path(tmp)
        engine = Engine(Path(a.state_dir).resolve(), work)
        stack = Stack(engine, work)
        try:
            engine.base_images(Path(a.templates_dir).resolve() / "base")
            t = time.monotonic()
            stack.compose("build")
            log(f"images built in {time.monotonic() - t:.0f} s")

            # First start: the base template is built into the fresh volume.
            t = time.monotonic()
            stack.compose("up", "-d")
            stack.wait_healthy()
            first = stack.logs()
            log(f"healthy in {time.monotonic() - t:.0f} s")
            check("sandgate: base template ready in" in first,
                  "the first start built the base template into the volume (debootstrap)", first[-3000:])
            check("sandbox disks are not size-limited" not in first,
                  "size-limited sandbox disks are available in the container", first[-3000:])
            key = key_of(stack)
            check(f"export E2B_API_KEY={key}" in first, "the banner prints the key saved in the volume", first[-2000:])

            r = run(["node", E2E / "compose_sdk.mjs", stack.url, key, "disk-limited"], engine.env, check=False, timeout=600)
            check(r.returncode == 0, "the E2B JS SDK subset passes against the container",
                  r.stdout + r.stderr + "\n--- sandgate's log, its end ---\n" + stack.logs()[-6000:])
            # Sandboxes reach the internet by default (--network auto): each
            # process sandbox has a network of its own inside the container.
            status, body = http("GET", f"{stack.url}/metrics")
            check(status == 200 and 'sandgate_network_path{path="veth"} 1' in body,
                  "sandboxes have networks of their own in the container (--network auto)",
                  "\n".join(l for l in body.splitlines() if "network" in l)[:2000] + stack.logs()[-2000:])

            status, body = http("POST", f"{stack.url}/sandboxes", {"templateID": "base", "timeout": 60},
                                {"X-API-Key": key})
            check(status == 201, "curl-style create: 201", f"{status} {body}")
            sid = json.loads(body)["sandboxID"]
            status, body = http("DELETE", f"{stack.url}/sandboxes/{sid}", headers={"X-API-Key": key})
            check(status == 204, "curl-style kill: 204", f"{status} {body}")
            status, body = http("GET", f"{stack.url}/sandboxes/{sid}", headers={"X-API-Key": key})
            check(status == 404, "the killed sandbox is gone: 404", f"{status} {body}")

            # Restart with the volume kept.
            stack.down()
            t = time.monotonic()
            stack.compose("up", "-d")
            stack.wait_healthy()
            log(f"healthy again in {time.monotonic() - t:.0f} s")
            again = stack.logs()
            check(key_of(stack) == key, "the key survives the restart")
            status, body = http("GET", f"{stack.url}/templates", headers={"X-API-Key": key})
            check(status == 200 and any(t.get("aliases") == ["base"] or "base" in (t.get("aliases") or []) or
                                        t.get("templateID") == "base" for t in json.loads(body)),
                  "the base template is listed after the restart", body[:1000])
            check("building the base template" not in again, "the base template was not built again", again[-2000:])
            status, body = http("POST", f"{stack.url}/sandboxes", {"templateID": "base", "timeout": 60},
                                {"X-API-Key": key})
            check(status == 201, "a sandbox starts after the restart", f"{status} {body}")
            http("DELETE", f"{stack.url}/sandboxes/{json.loads(body)['sandboxID']}", headers={"X-API-Key": key})

            # The mock-model variant.
            stack.down()
            stack.variant = ["mock-model.yaml"]
            stack.compose("build")  # the mock's image (sandgate's comes from the cache)
            stack.compose("up", "-d")
            stack.wait_healthy()
            out = stack.exec("sandgate", "llm", "key", "create", "local").stdout
            vkey = (re.search(r"sk-sg-[0-9a-f]+", out) or [None])[0]
            check(vkey, "`sandgate llm key create local` inside the container", out)
            ok = False
            for _ in range(30):  # the mock container may still be starting
                status, body = http("POST", f"{stack.url}/v1/chat/completions",
                                    {"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}]},
                                    {"authorization": f"Bearer {vkey}"})
                if status == 200:
                    ok = True
                    break
                time.sleep(1)
            check(ok and "mock reply 1 2 3" in body, "OpenAI chat completion through sandgate to the mock",
                  f"{status} {body[:500]}")
            status, body = http("POST", f"{stack.url}/v1/messages",
                                {"model": "mock-claude", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
                                {"x-api-key": vkey, "anthropic-version": "2023-06-01"})
            check(status == 200 and "mock reply 1 2 3" in body, "Anthropic message through sandgate to the mock",
                  f"{status} {body[:500]}")
        except Failed as e:
            log(f"FAILED after {time.monotonic() - t0:.0f} s: {e}")
            return 1
        finally:
            stack.teardown()
    log(f"passed in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
