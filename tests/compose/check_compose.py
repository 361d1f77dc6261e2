#!/usr/bin/env python3
"""Checks compose/ without a container engine (docs/compose.md, "What is verified").

1. Compose files: `docker-compose config` (Debian's docker-compose 1.29)
   validates compose.yaml alone and with each combination of the overrides;
   a deliberately broken copy must be rejected, so the validation is known
   to bite. The rendered configurations are checked where a merge could go
   wrong: the data volume is a named volume, port 3000 is published, the
   healthcheck is the image's, KVM and mock-model wiring, nothing is
   privileged, and every privilege granted is named in docs/compose.md.
2. Dockerfiles (each one a variant builds): the build context is assembled
   the way the builder would see it (the Dockerfile's ignore file applied,
   each COPY with Docker's semantics), so a COPY source that is missing or
   ignored fails; scripts RUN steps call exist and are executable there;
   the cmake configure step runs verbatim in that clean tree and the build
   step's targets are resolved with `ninja -t commands` (a real build takes
   minutes on two cores: SANDGATE_COMPOSE_FULL_BUILD=1 runs it); every
   COPY --from source is a build output, a copied file, or the output of a
   RUN step whose result CI produces anyway (--sample-output); runtime
   packages exist in Debian 12's archive and provide every shared library
   of the binaries the image ships and the healthcheck's program.
3. A run without an engine: the mock model wrapper from the assembled
   mock-model image tree and the image's entrypoint with the environment
   of the mock-model variant (container paths mapped to local ones, the
   container setup off), then the compose healthcheck command, the banner
   and key file, and one OpenAI and one Anthropic request through sandgate
   to the mock.

Usage: check_compose.py --bin-dir DIR [--templates-dir DIR]
       [--sample-output CONTAINER_DIR=LOCAL_DIR ...]
Exit status 0 when every check passed.
"""

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dockerfile as df  # noqa: E402

try:
    import yaml
except ImportError:
    sys.exit("check_compose: python3-yaml is missing (scripts/install-deps.sh installs docker-compose, which needs it)")

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
BASE = "compose.yaml"
OVERRIDES = ["kvm.yaml", "mock-model.yaml"]
DOCS = REPO / "docs" / "compose.md"
PRIVILEGE_KEYS = ("cap_add", "security_opt", "device_cgroup_rules", "devices", "userns_mode")


class Report:
    def __init__(self):
        self.failures = 0
        self.t0 = time.monotonic()

    def ok(self, msg):
        print(f"ok    {msg}", flush=True)

    def fail(self, msg):
        print(f"FAIL  {msg}", flush=True)
        self.failures += 1

    def skip(self, msg):
        print(f"skip  {msg}", flush=True)

    def expect(self, cond, msg, why=""):
        if cond:
            self.ok(msg)
        else:
            self.fail(msg + (f": {why}" if why else ""))
        return cond


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def clean_env():
    """The caller's environment without what would change the rendering or route loopback through a proxy."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SANDGATE_", "COMPOSE_", "MOCK_MODEL_")) and not k.lower().endswith("_proxy")}


# ---- 1. compose files -------------------------------------------------------


def variants():
    out = [[]]
    for o in OVERRIDES:
        out += [v + [o] for v in out]
    return out


def compose_config(files, compose_dir=COMPOSE_DIR):
    cmd = ["docker-compose"]
    for f in [BASE] + files:
        cmd += ["-f", str(compose_dir / f)]
    r = run(cmd + ["config"], cwd=REPO, env=clean_env())
    return r, (yaml.safe_load(r.stdout) if r.returncode == 0 else None)


def volume_entries(svc):
    """(source, target, read_only) of each volume, short or long syntax."""
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, dict):
            out.append((v.get("source"), v["target"], bool(v.get("read_only"))))
        else:
            parts = v.split(":")
            src, dst = (parts[0], parts[1]) if len(parts) > 1 else (None, parts[0])
            out.append((src, dst, len(parts) > 2 and "ro" in parts[2].split(",")))
    return out


def check_compose(rep, workspace):
    configs = {}
    if shutil.which("docker-compose") is None:
        rep.fail("docker-compose not found: scripts/install-deps.sh installs Debian's docker-compose package")
        return configs
    for files in variants():
        label = " + ".join([BASE] + files)
        r, cfg = compose_config(files)
        if rep.expect(r.returncode == 0, f"docker-compose config: {label}", r.stderr.strip()):
            configs[tuple(files)] = cfg
    # Negative control: an unknown service key must be refused.
    broken_dir = Path(workspace) / "broken"
    broken_dir.mkdir()
    text = (COMPOSE_DIR / BASE).read_text()
    (broken_dir / BASE).write_text(text.replace("    init: true\n", "    init: true\n    no_such_option: 1\n", 1))
    r, _ = compose_config([], broken_dir)
    rep.expect(r.returncode != 0 and "no_such_option" in r.stderr,
               "docker-compose config rejects a compose.yaml with an unknown option (the validation bites)",
               f"exit {r.returncode}: {r.stderr.strip()}")
    return configs


def check_rendered(rep, configs, images):
    base = configs.get(())
    if not base:
        return
    svc = base["services"]["sandgate"]
    named = set((base.get("volumes") or {}).keys())
    vols = {dst: src for src, dst, _ in volume_entries(svc)}
    data = images["sandgate"].final.env.get("SANDGATE_DATA_DIR") if "sandgate" in images else None
    rep.expect(data in vols and vols[data] in named,
               f"the data directory {data} (the image's SANDGATE_DATA_DIR) is a named volume", f"volumes {vols}")
    ports = [str(p).split("/")[0].split(":")[-1] for p in svc.get("ports", [])]
    rep.expect("3000" in ports, "container port 3000 is published", f"ports {svc.get('ports')}")
    if "sandgate" in images and images["sandgate"].healthcheck:
        opts, test = images["sandgate"].healthcheck
        image_hc = {"test": test, **{k.replace("-", "_"): (int(v) if k == "retries" else v) for k, v in opts.items()}}
        rep.expect(svc.get("healthcheck") == image_hc, "compose.yaml's healthcheck is the image's HEALTHCHECK",
                   f"{svc.get('healthcheck')} vs {image_hc}")
    docs = DOCS.read_text() if DOCS.exists() else ""
    for files, cfg in configs.items():
        label = " + ".join([BASE] + list(files))
        for name, s in cfg["services"].items():
            rep.expect(not s.get("privileged"), f"{label}: {name} is not privileged")
            granted = []
            for key in PRIVILEGE_KEYS:
                v = s.get(key)
                granted += [str(x) for x in v] if isinstance(v, list) else ([f"{key}: {v}"] if v else [])
            undocumented = [g for g in granted if g not in docs]
            rep.expect(not undocumented, f"{label}: {name}'s privileges are named in docs/compose.md",
                       f"missing {undocumented}")
    kvm = configs.get(("kvm.yaml",))
    if kvm:
        k = kvm["services"]["sandgate"]
        rep.expect("/dev/kvm:/dev/kvm" in k.get("devices", []) and k["environment"].get("SANDGATE_RUNTIME") == "kvm",
                   "kvm.yaml passes /dev/kvm and requires the kvm runtime", f"{k.get('devices')} {k.get('environment')}")
    mock = configs.get(("mock-model.yaml",))
    if mock:
        check_mock_wiring(rep, mock)


def check_mock_wiring(rep, cfg):
    """sandgate's upstream URLs name the mock service and its port; both sides read one key file."""
    sg, services = cfg["services"]["sandgate"], cfg["services"]
    env = sg.get("environment", {})
    mounts = {dst: src for src, dst, _ in volume_entries(sg)}
    for provider in ("OPENAI", "ANTHROPIC"):
        url = env.get(f"SANDGATE_{provider}_BASE_URL", "")
        m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
        target = services.get(m.group(1)) if m else None
        port = target.get("environment", {}).get("MOCK_MODEL_PORT") if target else None
        rep.expect(m and target and str(port) == m.group(2) and str(port) in [str(p) for p in target.get("expose", [])],
                   f"mock-model.yaml: SANDGATE_{provider}_BASE_URL {url} is a service's MOCK_MODEL_PORT, exposed",
                   f"services {list(services)}, port {port}")
        key = env.get(f"SANDGATE_{provider}_KEY_FILE")
        src = mounts.get(key)
        mock_mounts = {dst: s for s, dst, _ in volume_entries(target or {})}
        mock_key = mock_mounts.get((target or {}).get("environment", {}).get("MOCK_MODEL_KEY_FILE"))
        rep.expect(src and Path(src).is_file() and src == mock_key,
                   f"mock-model.yaml: sandgate's {provider.lower()} key file and the mock's MOCK_MODEL_KEY_FILE are one file",
                   f"{key} -> {src}, mock's -> {mock_key}")


# ---- 2. Dockerfiles ---------------------------------------------------------


class Image:
    """What check_dockerfile learnt about one image, for the later checks."""

    def __init__(self, stages):
        self.stages = stages
        self.final = stages[-1]
        self.healthcheck = None
        self.entrypoint = None
        self.cmd = None
        self.packages = []
        self.copied_from = []  # (destination, source, "build" | "copy" | "sample")


def preset_binary_dir(source_dir, preset):
    """The binaryDir of a configure preset, following "inherits"."""
    presets = {p["name"]: p for p in json.loads((source_dir / "CMakePresets.json").read_text())["configurePresets"]}
    p = presets[preset]
    while "binaryDir" not in p:
        parent = p["inherits"]
        p = presets[parent if isinstance(parent, str) else parent[0]]
    return Path(p["binaryDir"].replace("${sourceDir}", str(source_dir)).replace("${presetName}", preset))


def ninja_output(bindir, local):
    """Whether local (a path inside bindir) is an output of its build graph."""
    rel = os.path.relpath(local, bindir)
    return run(["ninja", "-C", str(bindir), "-t", "query", rel]).returncode == 0


def run_step(rep, stage, ins, where, bindirs, full_build):
    form = ins.exec_form()
    commands = [form] if form is not None else df.shell_commands(ins.args)
    for cmd in commands:
        words = df.strip_assignments(cmd)
        if not words:
            continue
        prog = words[0]
        if "/" in prog:
            p = stage.local(prog)
            rep.expect(p.is_file() and os.access(p, os.X_OK), f"{where}: {prog} is copied in and executable")
        for w in words[1:]:
            if w.startswith("-") or "/" not in w:
                continue
            p = stage.local(w)
            for b in bindirs.values():
                if p.is_relative_to(b):
                    rep.expect(ninja_output(b, p), f"{where}: {w} is an output of the build")
    if len(commands) != 1:
        return
    words = df.strip_assignments(commands[0])
    if words[:1] != ["cmake"] or "--preset" not in words:
        return
    preset = words[words.index("--preset") + 1]
    cwd = stage.local(".")
    if "--build" not in words:
        t = time.monotonic()
        r = run(words, cwd=cwd)
        hint = ("\n(a folder or file CMake reads is not copied: add a COPY line to the Dockerfile and a !path line "
                "to its .dockerignore)")
        if rep.expect(r.returncode == 0, f"{where}: `{' '.join(words)}` in the assembled tree "
                                         f"({time.monotonic() - t:.1f} s)", (r.stdout + r.stderr)[-3000:] + hint):
            bindirs[preset] = preset_binary_dir(cwd, preset)
        return
    bindir = bindirs.get(preset)
    if bindir is None:
        rep.fail(f"{where}: cmake --build --preset {preset} before its configure step")
        return
    if full_build:
        t = time.monotonic()
        r = run(words, cwd=cwd)
        rep.expect(r.returncode == 0, f"{where}: `{' '.join(words)}` (full build, {time.monotonic() - t:.0f} s)",
                   (r.stdout + r.stderr)[-3000:])
        return
    targets = []
    if "--target" in words:
        for w in words[words.index("--target") + 1:]:
            if w.startswith("-"):
                break
            targets.append(w)
    r = run(["ninja", "-C", str(bindir), "-t", "commands"] + targets)
    n = len(r.stdout.splitlines())
    rep.expect(r.returncode == 0 and n > 0,
               f"{where}: targets {' '.join(targets) or '(all)'} resolve in the build graph ({n} commands; "
               "not compiled, SANDGATE_COMPOSE_FULL_BUILD=1 compiles them)", r.stderr.strip())


def copy_from_stage(rep, image, stage, ins, where, bindirs_by_stage, samples):
    opts, srcs, dest = df.copy_args(ins)
    ref = opts["from"]
    src_stage = next((s for s in image.stages if s.name == ref or str(s.index) == ref), None)
    if src_stage is None or src_stage.index >= stage.index:
        rep.fail(f"{where}: COPY --from={ref} names no earlier stage")
        return
    for src in srcs:
        local = src_stage.local(src)
        target = stage.local(dest)
        if dest.endswith("/"):
            target = target / PurePosixPath(src).name
        bindir = next((b for b in bindirs_by_stage.get(src_stage.index, {}).values() if local.is_relative_to(b)), None)
        if bindir is not None:
            ok = rep.expect(ninja_output(bindir, local), f"{where}: {src} is an output of the build")
            produced = "build"
        elif local.exists():
            ok, produced = True, "copy"
            rep.ok(f"{where}: {src} was copied into stage {ref}")
        else:
            sample = next(((c, l) for c, l in samples if PurePosixPath(src).is_relative_to(c)), None)
            runs = [i for i in src_stage.instructions if i.name == "RUN" and sample and str(sample[0]) in i.args]
            if sample and runs:
                s = Path(sample[1]) / PurePosixPath(src).relative_to(sample[0])
                ok = rep.expect(s.exists(), f"{where}: {src} comes from RUN line {runs[0].line}, not run here; "
                                            f"the same step's output from CI has it ({s})")
            else:
                ok = False
                rep.fail(f"{where}: nothing in stage {ref} produces {src}")
            produced = "sample"
        if ok:
            target.parent.mkdir(parents=True, exist_ok=True)
            if local.is_file():
                shutil.copy2(local, target)
            else:
                target.touch()
            image.copied_from.append((dest, src, produced))


def check_dockerfile(rep, context, dockerfile, workspace, samples, full_build):
    rel = os.path.relpath(dockerfile, REPO)
    try:
        stages = df.stages(df.parse(dockerfile), workspace)
        ignore = df.IgnoreRules(df.ignore_file(context, dockerfile))
    except df.DockerfileError as e:
        rep.fail(f"{rel}: {e}")
        return None
    image = Image(stages)
    rep.ok(f"{rel}: {len(stages)} stage(s) ({', '.join(s.image for s in stages)}); "
           f"ignore file {os.path.relpath(ignore.path, REPO) if ignore.path else 'none'}")
    bindirs_by_stage = {}
    for st in stages:
        bindirs = bindirs_by_stage.setdefault(st.index, {})
        for ins in st.instructions:
            where = f"{rel}:{ins.line}"
            try:
                if ins.name == "COPY":
                    opts, srcs, _ = df.copy_args(ins)
                    if "from" in opts:
                        copy_from_stage(rep, image, st, ins, where, bindirs_by_stage, samples)
                    else:
                        problems = df.copy_from_context(st, ins, context, ignore)
                        for p in problems:
                            rep.fail(f"{rel}: {p}")
                        if not problems:
                            rep.ok(f"{where}: COPY {' '.join(srcs)} (present, not ignored)")
                elif ins.name == "RUN":
                    run_step(rep, st, ins, where, bindirs, full_build)
                elif ins.name == "HEALTHCHECK" and st is image.final:
                    image.healthcheck = df.healthcheck(st)
                elif ins.name == "ENTRYPOINT" and st is image.final:
                    image.entrypoint = ins.exec_form()
                elif ins.name == "CMD" and st is image.final:
                    image.cmd = ins.exec_form()
            except df.DockerfileError as e:
                rep.fail(f"{rel}: {e}")
    check_runtime(rep, image, rel)
    return image


def apt_lists_for_bookworm():
    osr = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    lists = list(Path("/var/lib/apt/lists").glob("*_Packages*")) if Path("/var/lib/apt/lists").is_dir() else []
    return "VERSION_CODENAME=bookworm" in osr and bool(lists)


def in_bookworm_archive(pkg):
    r = run(["apt-cache", "madison", pkg])
    # "curl | 7.88.1-10+deb12u15 | http://deb.debian.org/debian bookworm/main amd64 Packages"
    fields = (line.split(" | ") for line in r.stdout.splitlines())
    return any(len(f) >= 3 and len(f[2].split()) > 1 and f[2].split()[1].startswith("bookworm") for f in fields)


def owning_package(path):
    p = Path(path)
    candidates = {str(p), os.path.realpath(p)}
    for c in list(candidates):
        candidates.add(c[4:] if c.startswith("/usr/") else "/usr" + c)
    for c in candidates:
        r = run(["dpkg", "-S", c])
        if r.returncode == 0:
            return r.stdout.split(":")[0].strip()
    return None


def check_runtime(rep, image, rel):
    final = image.final
    pkgs = df.apt_packages(final)
    if not pkgs:
        rep.fail(f"{rel}: the final stage installs no packages")
    elif apt_lists_for_bookworm():
        missing = [p for p in pkgs if not in_bookworm_archive(p)]
        rep.expect(not missing, f"{rel}: runtime packages exist in Debian 12's archive ({' '.join(pkgs)})",
                   f"not found: {missing}")
    else:
        rep.skip(f"{rel}: runtime packages not looked up (this host is not Debian 12 with apt lists)")
    image.packages = pkgs
    if image.entrypoint:
        p = final.local(image.entrypoint[0])
        rep.expect(p.is_file() and os.access(p, os.X_OK), f"{rel}: ENTRYPOINT {image.entrypoint[0]} is copied in and executable")
    if image.cmd:
        args = image.cmd if image.entrypoint else image.cmd[1:]
        for a in args:
            if "/" in a and "://" not in a and not a.startswith("-"):
                rep.expect(final.local(a).exists(), f"{rel}: CMD argument {a} exists in the image")
    programs = []
    if image.cmd and not image.entrypoint:
        programs.append(image.cmd[0])
    if image.healthcheck:
        test = image.healthcheck[1]
        programs.append(shlex.split(test[1])[0] if test[0] == "CMD-SHELL" else test[1])
    for prog in programs:
        path = shutil.which(prog)
        owner = owning_package(path) if path else None
        rep.expect(owner in pkgs, f"{rel}: {prog} comes from a listed package ({owner})", f"listed: {pkgs}")


def check_libraries(rep, image, rel, bin_dir):
    """Every shared library of the shipped binaries comes from a listed package."""
    for dest, src, produced in image.copied_from:
        if produced != "build":
            continue
        name = PurePosixPath(src).name
        local = Path(bin_dir) / name
        if not local.is_file():
            rep.fail(f"{rel}: {name} not found in {bin_dir} (build it)")
            continue
        r = run(["ldd", str(local)])
        if "not a dynamic executable" in (r.stdout + r.stderr):
            rep.ok(f"{rel}: {name} is static")
            continue
        libs = re.findall(r"(?:=>\s*)?(/\S+)\s+\(0x", r.stdout)
        owners = {lib: owning_package(lib) for lib in libs}
        unlisted = {lib: o for lib, o in owners.items() if o not in image.packages}
        rep.expect(not unlisted, f"{rel}: {name}'s {len(libs)} shared libraries come from listed packages "
                                 f"({' '.join(sorted(set(owners.values())))})",
                   f"unlisted: {unlisted} (add the packages to the final stage's apt-get install)")


# ---- 3. a run without an engine ---------------------------------------------


def wait_for(pred, timeout, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            return pred()
        time.sleep(0.05)
    return None


def http(method, url, body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(req, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stop(proc, timeout=20):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def check_run(rep, cfg, images, bin_dir, templates_dir, workspace):
    if cfg is None or "sandgate" not in images or "mock-model" not in images:
        rep.fail("run: needs the mock-model variant and both images checked above")
        return
    if not (Path(templates_dir) / "base").is_dir():
        rep.fail(f"run: no base template in {templates_dir} (scripts/test.sh builds it)")
        return
    work = Path(workspace) / "run"
    work.mkdir()
    services = cfg["services"]
    # Container paths of the mock-model variant, mapped to local ones: bind
    # mounts to their sources, named volumes to fresh directories.
    def mapper(svc):
        m = {}
        for src, dst, _ in volume_entries(svc):
            if src and src.startswith("/"):
                m[dst] = src
            else:
                d = work / f"volume-{src}"
                d.mkdir(exist_ok=True)
                m[dst] = str(d)
        return lambda v: next((src + v[len(dst):] for dst, src in m.items() if v == dst or v.startswith(dst + "/")), v)

    procs = []
    try:
        # The mock, from the assembled image tree (its COPY layout and import path).
        mimg, msvc = images["mock-model"], services["mock-model"]
        mmap = mapper(msvc)
        env = clean_env() | {k: mmap(str(v)) for k, v in {**mimg.final.env, **msvc.get("environment", {})}.items()}
        env |= {"MOCK_MODEL_HOST": "127.0.0.1", "MOCK_MODEL_PORT": "0"}
        mock_log = work / "mock.log"
        mock = subprocess.Popen([shutil.which(mimg.cmd[0]) or mimg.cmd[0]] + mimg.cmd[1:], cwd=mimg.final.local("."),
                                env=env, stdout=open(mock_log, "w"), stderr=subprocess.STDOUT)
        procs.append(mock)
        port = wait_for(lambda: (re.search(r"listening on http://127\.0\.0\.1:(\d+)", mock_log.read_text()) or [None, None])[1],
                        10, mock)
        if not rep.expect(port, "run: the mock model wrapper starts from the image tree", mock_log.read_text()[-2000:]):
            return

        # sandgate through the image's entrypoint, with the variant's environment.
        simg, ssvc = images["sandgate"], services["sandgate"]
        smap = mapper(ssvc)
        container_port = msvc["environment"]["MOCK_MODEL_PORT"]
        env = clean_env() | {k: smap(str(v)) for k, v in {**simg.final.env, **ssvc.get("environment", {})}.items()}
        for k, v in list(env.items()):
            env[k] = v.replace(f"http://mock-model:{container_port}", f"http://127.0.0.1:{port}")
        env |= {"SANDGATE_CONTAINER_SETUP": "0", "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
        args = list(simg.cmd)
        args[args.index("--listen") + 1] = "127.0.0.1:0"
        port_file = work / "port"
        args += ["--templates-dir", str(templates_dir), "--port-file", str(port_file),
                 "--cgroup-parent", "sgcompose" + secrets.token_hex(4)]
        out_log, err_log = work / "sandgate.out", work / "sandgate.err"
        sg = subprocess.Popen([str(simg.final.local(simg.entrypoint[0]))] + args, env=env,
                              stdout=open(out_log, "w"), stderr=open(err_log, "w"))
        procs.append(sg)
        sg_port = wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 30, sg)
        if not rep.expect(sg_port, "run: the entrypoint starts sandgate serve with the compose environment",
                          (out_log.read_text() + err_log.read_text())[-3000:]):
            return
        test = ssvc["healthcheck"]["test"]
        hc = run(["sh", "-c", test[1].replace("127.0.0.1:3000", f"127.0.0.1:{sg_port}")], env=clean_env())
        rep.expect(hc.returncode == 0, "run: the compose healthcheck command passes", hc.stderr)
        banner = wait_for(lambda: "export E2B_API_KEY" in out_log.read_text() and out_log.read_text(), 5)
        key_file = Path(smap(env["SANDGATE_DATA_DIR"])) / "local-api-key"
        key = key_file.read_text().strip() if key_file.exists() else None
        rep.expect(banner and key and f"export E2B_API_KEY={key}" in banner and
                   f"export E2B_API_URL={ssvc['environment']['SANDGATE_PUBLIC_URL']}" in banner,
                   "run: the banner prints the public URL and the key saved in the data volume", (banner or "")[-1000:])
        # The admin CLI finds the data directory through the image's ENV, as under docker compose exec.
        r = run(["sandgate", "llm", "key", "create", "local"], env=env)
        vkey = (re.search(r"sk-sg-[0-9a-f]+", r.stdout) or [None])[0]
        if not rep.expect(vkey, "run: `sandgate llm key create local` through SANDGATE_DATA_DIR", r.stdout + r.stderr):
            return
        base = f"http://127.0.0.1:{sg_port}"
        status, body = http("POST", f"{base}/v1/chat/completions",
                            {"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}]},
                            {"authorization": f"Bearer {vkey}"})
        rep.expect(status == 200 and "mock reply 1 2 3" in body, "run: OpenAI chat completion through sandgate to the mock",
                   f"{status} {body[:500]}")
        status, body = http("POST", f"{base}/v1/messages",
                            {"model": "mock-claude", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
                            {"x-api-key": vkey, "anthropic-version": "2023-06-01"})
        rep.expect(status == 200 and "mock reply 1 2 3" in body, "run: Anthropic message through sandgate to the mock",
                   f"{status} {body[:500]}")
        rc = stop(sg)
        rep.expect(rc == 0, "run: sandgate stops cleanly on SIGTERM", f"exit {rc}; {err_log.read_text()[-1500:]}")
    finally:
        for p in procs:
            stop(p, 5)


# ---- main -------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True, help="sandgate, sandgate-agent, sandgate-vmm built here")
    ap.add_argument("--templates-dir", help="holds the base template (the run part needs it)")
    ap.add_argument("--sample-output", action="append", default=[], metavar="CONTAINER_DIR=LOCAL_DIR",
                    help="a RUN step's output directory and where CI's run of the same step put it")
    a = ap.parse_args()
    samples = []
    for s in a.sample_output:
        c, sep, l = s.partition("=")
        if not sep:
            ap.error(f"--sample-output {s}: expected CONTAINER_DIR=LOCAL_DIR")
        samples.append((PurePosixPath(c), l))
    full_build = os.environ.get("SANDGATE_COMPOSE_FULL_BUILD") == "1"
    rep = Report()
    with tempfile.TemporaryDirectory(prefix="check-compose-") as ws:
        configs = check_compose(rep, ws)
        builds = {}
        for cfg in configs.values():
            for name, svc in cfg["services"].items():
                b = svc.get("build")
                if b:
                    builds[name] = (Path(b["context"]), Path(b["context"]) / b.get("dockerfile", "Dockerfile"))
        images = {}
        for name, (context, dockerfile) in sorted(builds.items()):
            image = check_dockerfile(rep, context, dockerfile, Path(ws) / name, samples, full_build)
            if image:
                images[name] = image
                check_libraries(rep, image, os.path.relpath(dockerfile, REPO), a.bin_dir)
        check_rendered(rep, configs, images)
        if a.templates_dir:
            check_run(rep, configs.get(("mock-model.yaml",)), images, a.bin_dir, a.templates_dir, ws)
        else:
            rep.skip("run: no --templates-dir")
    took = time.monotonic() - rep.t0
    if rep.failures:
        print(f"check_compose: {rep.failures} check(s) failed ({took:.1f} s)")
        return 1
    print(f"check_compose: all checks passed ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
