"""A Dockerfile model for checking compose/ without a container engine.

parse() reads the instructions the sandgate Dockerfiles use (FROM ... AS,
COPY, RUN, WORKDIR, ENV, USER, VOLUME, EXPOSE, HEALTHCHECK, ENTRYPOINT, CMD)
with Docker's line continuations and comment lines; IgnoreRules applies a
.dockerignore; Stage.copy_from_context() does what the builder does for a
COPY from the build context (a directory source copies its contents, files
go into a destination ending in "/"), so a tree assembled this way holds
exactly what the image build would see. Anything outside that subset is an
error here rather than a guess: the check must not pass on a file it cannot
read the way Docker does.
"""

import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath


class DockerfileError(Exception):
    pass


@dataclass
class Instruction:
    line: int
    name: str  # upper case
    args: str  # the rest, continuations joined

    def exec_form(self):
        """The JSON array of an exec-form instruction, or None."""
        s = self.args.strip()
        if not s.startswith("["):
            return None
        try:
            v = json.loads(s)
        except json.JSONDecodeError as e:
            raise DockerfileError(f"line {self.line}: {self.name} is not valid JSON: {e}")
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise DockerfileError(f"line {self.line}: {self.name} must be a JSON array of strings")
        return v


@dataclass
class Stage:
    index: int
    image: str
    name: str | None
    root: Path  # where this stage's copied files are assembled
    workdir: str = "/"
    env: dict = field(default_factory=dict)
    instructions: list = field(default_factory=list)

    def local(self, container_path):
        """The assembled tree's path for a path inside this stage."""
        p = PurePosixPath(self.workdir) / container_path
        return self.root / str(p).lstrip("/")


def parse(path):
    """Instructions of a Dockerfile, continuations joined, comment lines dropped."""
    out = []
    pending, start = None, 0
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and pending is None):
            continue
        if pending is None:
            pending, start = "", n
        cont = raw.rstrip().endswith("\\")
        pending += (raw.rstrip()[:-1] if cont else raw) + " "
        if not cont:
            words = pending.strip().split(None, 1)
            out.append(Instruction(start, words[0].upper(), words[1] if len(words) > 1 else ""))
            pending = None
    if pending is not None:
        raise DockerfileError(f"line {start}: continuation runs past the end of the file")
    return out


def stages(instructions, workspace):
    """Splits instructions into stages, each with its own assembly root."""
    result = []
    for ins in instructions:
        if ins.name == "FROM":
            words = ins.args.split()
            if any(w.startswith("--") for w in words):
                raise DockerfileError(f"line {ins.line}: FROM options are not emulated")
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            if len(words) not in (1, 3) or (len(words) == 3 and name is None):
                raise DockerfileError(f"line {ins.line}: expected FROM IMAGE [AS NAME]")
            root = Path(workspace) / f"stage{len(result)}"
            root.mkdir(parents=True)
            result.append(Stage(len(result), words[0], name, root))
            continue
        if not result:
            raise DockerfileError(f"line {ins.line}: {ins.name} before the first FROM")
        st = result[-1]
        st.instructions.append(ins)
        if ins.name == "WORKDIR":
            st.workdir = str(PurePosixPath(st.workdir) / ins.args.strip())
        elif ins.name == "ENV":
            st.env.update(parse_env(ins))
        elif ins.name == "ARG":
            raise DockerfileError(f"line {ins.line}: ARG is not emulated")
    return result


def parse_env(ins):
    words = shlex.split(ins.args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    env = {}
    for w in words:
        k, sep, v = w.partition("=")
        if not sep:
            raise DockerfileError(f"line {ins.line}: ENV mixes KEY=VALUE and KEY VALUE forms")
        env[k] = v
    return env


def copy_args(ins):
    """(options, sources, destination) of a COPY."""
    form = ins.exec_form()
    words = form if form is not None else shlex.split(ins.args)
    opts = {}
    while words and words[0].startswith("--"):
        k, _, v = words.pop(0)[2:].partition("=")
        opts[k] = v
    if len(words) < 2:
        raise DockerfileError(f"line {ins.line}: COPY needs a source and a destination")
    for k in opts:
        if k not in ("from", "chown", "chmod"):
            raise DockerfileError(f"line {ins.line}: COPY --{k} is not emulated")
    srcs, dest = words[:-1], words[-1]
    if len(srcs) > 1 and not dest.endswith("/"):
        raise DockerfileError(f"line {ins.line}: COPY of several sources needs a destination ending in /")
    for s in srcs:
        if any(c in s for c in "*?["):
            raise DockerfileError(f"line {ins.line}: wildcard source {s} is not emulated: name the paths")
    return opts, srcs, dest


class IgnoreRules:
    """A .dockerignore restricted to "*", plain paths and "!path".

    For that subset Docker's rule is: a pattern matches a path when it names
    the path or one of its parent directories, "*" matches everything, and
    the last matching pattern decides.
    """

    def __init__(self, path):
        self.path = path
        self.rules = []
        if path is None:
            return
        for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pat = line[1:] if include else line
            pat = pat.strip().lstrip("/").removeprefix("./").rstrip("/")
            if pat != "*" and any(c in pat for c in "*?[\\"):
                raise DockerfileError(f"{path}:{n}: pattern {line} is outside the emulated subset")
            self.rules.append((pat, include))

    def excluded(self, rel):
        rel = str(PurePosixPath(rel))
        verdict = False
        for pat, include in self.rules:
            if pat == "*" or rel == pat or rel.startswith(pat + "/"):
                verdict = not include
        return verdict


def ignore_file(context, dockerfile):
    """The ignore file BuildKit uses: DOCKERFILE.dockerignore, else CONTEXT/.dockerignore."""
    specific = Path(str(dockerfile) + ".dockerignore")
    if specific.is_file():
        return specific
    generic = Path(context) / ".dockerignore"
    return generic if generic.is_file() else None


def copy_from_context(stage, ins, context, ignore):
    """Applies a COPY from the build context to the stage's tree.

    Returns a list of problems (missing or ignored sources); copies the rest.
    """
    problems = []
    _, srcs, dest = copy_args(ins)
    context = Path(context)
    for src in srcs:
        rel = os.path.normpath(src.lstrip("/"))
        if rel.startswith(".."):
            problems.append(f"line {ins.line}: COPY source {src} is outside the build context")
            continue
        local = context / rel
        if not local.exists():
            problems.append(f"line {ins.line}: COPY source {src} does not exist in the build context {context}")
            continue
        if ignore.excluded(rel):
            problems.append(f"line {ins.line}: COPY source {src} is excluded by {ignore.path}")
            continue
        if local.is_dir():
            target = stage.local(dest)
            _copy_tree(local, target, rel, ignore)
        else:
            target = stage.local(dest)
            if dest.endswith("/") or target.is_dir():
                target = target / local.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local, target)
    return problems


def _copy_tree(src, dst, rel, ignore):
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        r = f"{rel}/{entry.name}"
        if ignore.excluded(r):
            continue
        if entry.is_dir() and not entry.is_symlink():
            _copy_tree(entry, dst / entry.name, r, ignore)
        else:
            shutil.copy2(entry, dst / entry.name, follow_symlinks=False)


def shell_commands(script):
    """Simple commands of a shell-form RUN: word lists split at && || ; |."""
    lex = shlex.shlex(script, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands, cur = [], []
    for tok in lex:
        if tok in ("&&", "||", ";", "|", "&"):
            if cur:
                commands.append(cur)
            cur = []
        else:
            cur.append(tok)
    if cur:
        commands.append(cur)
    return commands


def strip_assignments(words):
    """The command without leading VAR=value words."""
    i = 0
    while i < len(words) and "=" in words[i] and not words[i].startswith("-") and words[i].split("=", 1)[0].isidentifier():
        i += 1
    return words[i:]


def apt_packages(stage):
    """Packages named by `apt-get install` in a stage's RUN steps."""
    pkgs = []
    for ins in stage.instructions:
        if ins.name != "RUN" or ins.exec_form() is not None:
            continue
        for cmd in shell_commands(ins.args):
            words = strip_assignments(cmd)
            if len(words) >= 2 and words[0] in ("apt-get", "apt") and "install" in words:
                after = words[words.index("install") + 1:]
                pkgs += [w for w in after if not w.startswith("-")]
    return pkgs


def healthcheck(stage):
    """(options, command) of the stage's HEALTHCHECK: command as Docker stores it."""
    for ins in stage.instructions:
        if ins.name != "HEALTHCHECK":
            continue
        words = ins.args.split()
        opts = {}
        while words and words[0].startswith("--"):
            k, _, v = words.pop(0)[2:].partition("=")
            opts[k] = v
        if not words or words[0].upper() != "CMD":
            raise DockerfileError(f"line {ins.line}: expected HEALTHCHECK [OPTIONS] CMD ...")
        rest = ins.args.split("CMD", 1)[1].strip()
        form = Instruction(ins.line, "CMD", rest).exec_form()
        return opts, (form if form is not None else ["CMD-SHELL", rest])
    return None
