#!/usr/bin/env python3
# sandgate's code interpreter: E2B's port-49999 API, served inside a sandbox
# of the code-interpreter-v1 template (docs/code-interpreter.md).
#
#   POST   /execute                {code, context_id?, language?, env_vars?}
#          -> 200, a stream of JSON lines: stdout, stderr, result, error,
#             number_of_executions, end_of_execution
#   POST   /contexts               {language?, cwd?} -> {id, language, cwd}
#   GET    /contexts               -> [{id, language, cwd}]
#   DELETE /contexts/{id}          -> 204
#   POST   /contexts/{id}/restart  -> 204
#   GET    /health                 -> 200 once the default Python kernel is up
#
# Python (and R, where installed) run in Jupyter kernels reached with
# jupyter_client; JavaScript and TypeScript in a Node.js executor of this
# project (node_executor.mjs); bash in a bash process fed one file per cell.
# A query (?source=...) is ignored. Every execution is bounded: its output
# (MAX_OUTPUT bytes, then one marker), and its time by the client: a closed
# connection interrupts it.
import codecs
import json
import os
import queue
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = int(os.environ.get("SANDGATE_CI_PORT", "49999"))
MAX_BODY = 16 << 20
MAX_OUTPUT = int(os.environ.get("SANDGATE_CI_MAX_OUTPUT", str(8 << 20)))
FLOOD_FACTOR = 4
MAX_CONTEXTS = 64
DEFAULT_CWD = "/home/user"
LANGUAGES = ("python", "javascript", "typescript", "bash", "r", "java")
ALIASES = {"js": "javascript", "ts": "typescript", "sh": "bash", "py": "python", "python3": "python"}

# Jupyter MIME types -> the fields of E2B's result message.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "application/vnd.sandgate.chart+json": "chart",
    "application/vnd.sandgate.data+json": "data",
}


def now_iso():
    return datetime.now(timezone.utc).isoformat()


def result_message(bundle, is_main):
    out = {"type": "result", "is_main_result": bool(is_main)}
    extra = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field:
            out[field] = value
        else:
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out


def peer_closed(sock):
    """For a socket select() found readable: whether that was the peer's
    close (EOF) rather than data."""
    return sock.recv(1, socket.MSG_PEEK) == b""


class Sink:
    """One execution's output: JSON lines to the client, bounded, and
    whether the client is still there."""

    def __init__(self, handler):
        self.handler = handler
        self.sent = {"stream": 0, "result": 0}  # bytes of each budget
        self.dropped = 0  # bytes of printed output past the budget
        self.truncated = set()
        self.gone = False

    def flooding(self):
        """True once the execution printed FLOOD_FACTOR times the budget:
        the executor then interrupts it, so that a print loop cannot keep
        the server and the kernel busy (and their memory growing) for
        output nobody receives."""
        return self.dropped > MAX_OUTPUT * FLOOD_FACTOR

    def emit(self, msg):
        if self.gone:
            return
        kind = msg.get("type")
        if kind in ("stdout", "stderr", "result"):
            # Printed text and results have a budget each, so that a flood
            # of prints still lets the result through.
            budget = "result" if kind == "result" else "stream"
            size = sum(len(v) for v in msg.values() if isinstance(v, str)) + 64
            if budget in self.truncated:
                if budget == "stream":
                    self.dropped += size
                return
            if self.sent[budget] + size > MAX_OUTPUT:
                self.truncated.add(budget)
                room = MAX_OUTPUT - self.sent[budget]
                if kind != "result" and room > 0:
                    # What fits of this text, then the marker.
                    self._write({**msg, "text": msg["text"][:room]})
                what = "results" if kind == "result" else "printed output"
                self._write({"type": "stderr", "timestamp": now_iso(),
                             "text": f"[sandgate: output truncated: this execution's {what} passed "
                                     f"{MAX_OUTPUT} bytes; the rest is dropped]\n"})
                return
            self.sent[budget] += size
        self._write(msg)

    def emit_note(self, text):
        """A line of sandgate's own on stderr, outside the budgets."""
        self._write({"type": "stderr", "timestamp": now_iso(), "text": text})

    def _write(self, msg):
        try:
            self.handler.write_chunk(json.dumps(msg) + "\n")
        except OSError:
            self.gone = True

    def client_gone(self):
        """True once the client closed its connection (the SDK's timeout)."""
        if self.gone:
            return True
        try:
            r, _, _ = select.select([self.handler.connection], [], [], 0)
            self.gone = bool(r) and peer_closed(self.handler.connection)
        except OSError:
            self.gone = True
        return self.gone


class JupyterContext:
    """A context on a Jupyter kernel (python: ipykernel; r: IRkernel)."""

    KERNELS = {"python": "python3", "r": "ir"}

    def __init__(self, language, cwd):
        self.language = language
        self.cwd = cwd
        self.km = self.client = None
        self.start()

    def start(self):
        # A manager per kernel: shutting one down ends its zmq context.
        from jupyter_client import KernelManager
        self.km = KernelManager(kernel_name=self.KERNELS[self.language])
        env = dict(os.environ)
        env.pop("SANDGATE_CI_PORT", None)
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.client = self.km.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        if self.language == "python":
            with open(os.path.join(HERE, "ipython_startup.py")) as f:
                self._run_silent(f.read())

    def stop(self):
        try:
            self.client.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)

    def restart(self):
        self.stop()
        self.start()

    def alive(self):
        return self.km.is_alive()

    def _run_silent(self, code, timeout=60):
        msg_id = self.client.execute(code, silent=True, store_history=False, allow_stdin=False)
        self._reply(msg_id, timeout)

    def _reply(self, msg_id, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_shell_msg(timeout=0.5)
            except queue.Empty:
                if not self.alive():
                    return None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
        return None

    def execute(self, code, env_vars, sink):
        if env_vars and self.language == "python":
            self._run_silent("import os as __sg_os\n__sg_env_saved = {k: __sg_os.environ.get(k) for k in %r}\n"
                             "__sg_os.environ.update(%r)\n" % (list(env_vars), env_vars))
        try:
            self._execute(code, sink)
        finally:
            if env_vars and self.language == "python" and self.alive():
                self._run_silent("for __sg_k, __sg_v in __sg_env_saved.items():\n"
                                 "    __sg_os.environ.pop(__sg_k, None) if __sg_v is None else "
                                 "__sg_os.environ.__setitem__(__sg_k, __sg_v)\n"
                                 "del __sg_env_saved, __sg_k, __sg_v\n")

    def _execute(self, code, sink):
        # Not stop_on_error: a context runs one request at a time (its lock),
        # so there is never a queued one to abort, and ipykernel 6.17's
        # abort window after an error (a timed-out cell's KeyboardInterrupt)
        # could outlast it and abort the next request, which then answered
        # with nothing at all.
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        interrupted = False
        checked = time.monotonic()
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                msg = None
            # Every 0.2 s, output flowing or not: is the kernel alive, and
            # is the client still there?
            if msg is None or time.monotonic() - checked > 0.2:
                checked = time.monotonic()
                if not self.alive():
                    sink.emit({"type": "error", "name": "KernelDied",
                               "value": f"the {self.language} kernel died during this execution; "
                                        "its state is lost: restart the context to go on",
                               "traceback": ""})
                    return
                if not interrupted and (sink.client_gone() or sink.flooding()):
                    if sink.flooding():
                        sink.emit_note(f"[sandgate: this execution printed over {FLOOD_FACTOR * MAX_OUTPUT >> 20} "
                                       "MiB more than was sent; it was interrupted]\n")
                    self.km.interrupt_kernel()
                    interrupted = True
            if msg is None:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                sink.emit({"type": "stdout" if content["name"] == "stdout" else "stderr",
                           "text": content["text"], "timestamp": now_iso()})
            elif kind == "execute_result":
                sink.emit(result_message(content["data"], True))
            elif kind == "display_data":
                sink.emit(result_message(content["data"], False))
            elif kind == "error":
                sink.emit({"type": "error", "name": content["ename"], "value": content["evalue"],
                           "traceback": "\n".join(content["traceback"])})
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self._reply(msg_id, 10)
        if reply and reply["content"].get("execution_count") is not None:
            sink.emit({"type": "number_of_executions", "execution_count": reply["content"]["execution_count"]})


class ProcessContext:
    """A context on a process of ours that runs one cell at a time: it reads
    requests on one pipe and answers on another (their descriptor numbers
    are its last two arguments); what the cell prints arrives on its stdout
    and stderr, written before the answer."""

    def __init__(self, language, cwd):
        self.language = language
        self.cwd = cwd
        self.proc = None
        self.count = 0
        self.start()

    def argv(self):
        raise NotImplementedError

    def request(self, code, env_vars):
        return (json.dumps({"code": code, "env": env_vars}) + "\n").encode()

    def start(self):
        req_r, self.req_w = os.pipe()
        self.ans_r, ans_w = os.pipe()
        env = dict(os.environ)
        env.pop("SANDGATE_CI_PORT", None)
        self.proc = subprocess.Popen(self.argv() + [str(req_r), str(ans_w)], cwd=self.cwd, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, pass_fds=(req_r, ans_w))
        os.close(req_r)
        os.close(ans_w)
        self.answers = b""
        self.decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("stdout", "stderr")}
        for f in (self.proc.stdout, self.proc.stderr):
            os.set_blocking(f.fileno(), False)
        self.count = 0

    def stop(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for fd in (self.req_w, self.ans_r):
            try:
                os.close(fd)
            except OSError:
                pass
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()

    def restart(self):
        self.stop()
        self.start()

    def alive(self):
        return self.proc.poll() is None

    def interrupt(self):
        """What the language does on a client that left: Node breaks the
        script (SIGINT); bash cannot break a loop of builtins, so its
        context starts anew."""
        os.kill(self.proc.pid, signal.SIGINT)

    def _drain(self, sink):
        # A bounded number of reads per call, so that a flood does not keep
        # the loop from its other checks; the decoders keep a character
        # split between reads whole.
        for f, kind in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            for _ in range(16):
                try:
                    data = os.read(f.fileno(), 65536)
                except BlockingIOError:
                    break
                if not data:
                    break
                text = self.decoders[kind].decode(data)
                if text:
                    sink.emit({"type": kind, "text": text, "timestamp": now_iso()})

    def _pending(self):
        r, _, _ = select.select([self.proc.stdout.fileno(), self.proc.stderr.fileno()], [], [], 0)
        return bool(r) and self.alive()

    def execute(self, code, env_vars, sink):
        self.count += 1
        os.write(self.req_w, self.request(code, env_vars or {}))
        interrupted_at = None
        while True:
            if b"\n" in self.answers:
                line, self.answers = self.answers.split(b"\n", 1)
                # Everything the cell printed was written before its answer
                # (bounded: what it left running may go on printing).
                for _ in range(64):
                    if not self._pending():
                        break
                    self._drain(sink)
                self._answer(json.loads(line), sink)
                return
            fds = [self.ans_r, self.proc.stdout.fileno(), self.proc.stderr.fileno()]
            r, _, _ = select.select(fds, [], [], 0.2)
            if self.proc.stdout.fileno() in r or self.proc.stderr.fileno() in r:
                self._drain(sink)
            if self.ans_r in r:
                data = os.read(self.ans_r, 1 << 20)
                if data:
                    self.answers += data
                    continue
            if not self.alive() or (self.ans_r in r and not data):
                self._drain(sink)
                code_ = self.proc.poll()
                sink.emit({"type": "error", "name": "KernelDied",
                           "value": f"the {self.language} process of this context exited"
                                    f"{'' if code_ is None else f' (status {code_})'} during this execution; "
                                    "its state is lost: restart the context to go on",
                           "traceback": ""})
                return
            if (sink.client_gone() or sink.flooding()) and interrupted_at is None:
                if sink.flooding():
                    sink.emit_note(f"[sandgate: this execution printed over {FLOOD_FACTOR * MAX_OUTPUT >> 20} "
                                   "MiB more than was sent; it was interrupted]\n")
                interrupted_at = time.monotonic()
                self.interrupt()
            elif interrupted_at is not None and time.monotonic() - interrupted_at > 5:
                # Did not stop on SIGINT: a new process, state lost.
                self.restart()
                return

    def _answer(self, ans, sink):
        if ans.get("error"):
            sink.emit({"type": "error", **ans["error"]})
        if ans.get("result") is not None:
            sink.emit(result_message(ans["result"], True))
        sink.emit({"type": "number_of_executions", "execution_count": self.count})


class NodeContext(ProcessContext):
    def argv(self):
        return ["node", os.path.join(HERE, "node_executor.mjs"), self.language]


class BashContext(ProcessContext):
    # The loop waits for a line on the request pipe, then sources the cell
    # the server wrote to a file, so that a syntax error fails that cell only
    # and variables, functions and the directory persist. A cell's env_vars
    # are exported around it and put back after. The answer is the cell's
    # exit status. The cell runs without the two pipes.
    LOOP = r"""
__sg_dir=$1 __sg_req=$2 __sg_ans=$3
while IFS= read -r __sg_line <&"$__sg_req"; do
  __sg_restore=
  if [ -s "$__sg_dir/env.names" ]; then
    for __sg_k in $(cat "$__sg_dir/env.names"); do
      if [ -n "${!__sg_k+x}" ]; then
        __sg_restore+="$(printf 'export %s=%q' "$__sg_k" "${!__sg_k}")"$'\n'
      else
        __sg_restore+="unset $__sg_k"$'\n'
      fi
    done
    . "$__sg_dir/env"
  fi
  . "$__sg_dir/cell" {__sg_req}<&- {__sg_ans}>&-
  __sg_rc=$?
  eval "$__sg_restore"
  printf '{"status": %d}\n' "$__sg_rc" >&"$__sg_ans"
done
"""

    def argv(self):
        self.dir = tempfile.mkdtemp(prefix=".sandgate-bash.", dir="/tmp")
        return ["bash", "-c", self.LOOP, "bash", self.dir]

    def request(self, code, env_vars):
        with open(os.path.join(self.dir, "cell"), "w") as f:
            f.write(code + "\n")
        with open(os.path.join(self.dir, "env"), "w") as f:
            for k, v in env_vars.items():
                f.write(f"export {k}={shlex.quote(v)}\n")
        with open(os.path.join(self.dir, "env.names"), "w") as f:
            f.write(" ".join(env_vars))
        return b"\n"

    def interrupt(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()  # dead before the next execution asks alive()

    def _answer(self, ans, sink):
        status = ans.get("status", 0)
        if status != 0:
            ans = {"error": {"name": "CommandExitError", "value": f"exit status {status}",
                             "traceback": f"the cell's last command exited with status {status}"}}
        super()._answer(ans, sink)


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.defaults = {}
        self.locks = {}

    def make(self, language, cwd):
        if language in ("python", "r"):
            if language == "r" and not os.path.isdir("/usr/share/jupyter/kernels/ir"):
                raise LookupError("language 'r' is not installed in this template "
                                  "(it needs r-cran-irkernel and its kernelspec)")
            return JupyterContext(language, cwd)
        if language in ("javascript", "typescript"):
            return NodeContext(language, cwd)
        if language == "bash":
            return BashContext(language, cwd)
        if language == "java":
            raise LookupError("language 'java' is not supported by this template: Debian packages no Jupyter "
                              "kernel for Java (supported: python, javascript, typescript, bash, r)")
        raise LookupError(f"unknown language '{language}' (supported: python, javascript, typescript, bash, r)")

    def create(self, language, cwd, default=False):
        with self.lock:
            if len(self.by_id) >= MAX_CONTEXTS:
                raise OverflowError(f"at most {MAX_CONTEXTS} contexts; remove one first")
        ctx = self.make(language, cwd)
        ctx.id = str(uuid.uuid4())
        with self.lock:
            self.by_id[ctx.id] = ctx
            self.locks[ctx.id] = threading.Lock()
            if default:
                self.defaults[language] = ctx.id
        return ctx

    def default_for(self, language):
        with self.lock:
            cid = self.defaults.get(language)
            if cid in self.by_id:
                return self.by_id[cid]
        return self.create(language, DEFAULT_CWD, default=True)

    def get(self, cid):
        with self.lock:
            return self.by_id.get(cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.by_id.pop(cid, None)
            lock = self.locks.pop(cid, None)
            for lang, d in list(self.defaults.items()):
                if d == cid:
                    del self.defaults[lang]
        if ctx:
            with lock:
                ctx.stop()
        return ctx is not None

    def lock_of(self, cid):
        with self.lock:
            return self.locks.get(cid)

    def describe(self, ctx):
        return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}


CONTEXTS = Contexts()
READY = threading.Event()


def normalize_language(value):
    if value is None or value == "":
        return "python"
    if not isinstance(value, str):
        raise LookupError("language must be a string")
    lang = value.strip().lower()
    return ALIASES.get(lang, lang)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sandgate-code-interpreter"

    def log_message(self, fmt, *args):
        pass

    def send_plain(self, status, reason, body=b""):
        if isinstance(body, str):
            body = body.encode()
        self.send_response(status, reason)
        self.send_header("Content-Length", str(len(body)))
        if body:
            self.send_header("Content-Type", "application/json" if body[:1] in b"[{" else "text/plain")
        self.end_headers()
        if body:
            self.wfile.write(body)

    def send_json(self, status, value):
        self.send_plain(status, None, json.dumps(value))

    def send_error_json(self, status, message):
        # The SDKs show the reason phrase ("400 <reason>") for most codes
        # and the body for 404: both say what is wrong.
        reason = re.sub(r"[\r\n]", " ", message)[:200]
        self.send_plain(status, reason, json.dumps({"error": message}))

    def read_json(self):
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise ValueError("chunked request bodies are not accepted; send Content-Length")
        try:
            n = int(length or "0")
        except ValueError:
            raise ValueError("bad Content-Length")
        if n < 0 or n > MAX_BODY:
            raise ValueError(f"body of {n} bytes: the limit is {MAX_BODY}")
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"malformed JSON: {e}")
        if not isinstance(value, dict):
            raise ValueError("the body must be a JSON object")
        return value

    def route(self):
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def do_GET(self):
        path = self.route()
        if path == "/health":
            if READY.is_set():
                return self.send_plain(200, None, "OK")
            return self.send_plain(503, "starting", "starting")
        if path == "/contexts":
            with CONTEXTS.lock:
                items = list(CONTEXTS.by_id.values())
            return self.send_json(200, [CONTEXTS.describe(c) for c in items])
        self.send_error_json(404, f"no route GET {path}")

    def do_DELETE(self):
        path = self.route()
        m = re.fullmatch(r"/contexts/([^/]+)", path)
        if not m:
            return self.send_error_json(404, f"no route DELETE {path}")
        if not CONTEXTS.remove(m.group(1)):
            return self.send_error_json(404, f"context '{m.group(1)}' not found")
        self.send_plain(204, None)

    def do_POST(self):
        path = self.route()
        try:
            body = self.read_json()
        except ValueError as e:
            self.close_connection = True
            return self.send_error_json(400, str(e))
        if path == "/execute":
            return self.execute(body)
        if path == "/contexts":
            try:
                lang = normalize_language(body.get("language"))
                cwd = body.get("cwd") or DEFAULT_CWD
                if not isinstance(cwd, str) or not os.path.isdir(cwd):
                    raise FileNotFoundError(f"cwd '{cwd}' is not a directory")
                ctx = CONTEXTS.create(lang, cwd)
            except (LookupError, FileNotFoundError, OverflowError) as e:
                return self.send_error_json(400, str(e))
            return self.send_json(200, CONTEXTS.describe(ctx))
        m = re.fullmatch(r"/contexts/([^/]+)/restart", path)
        if m:
            ctx = CONTEXTS.get(m.group(1))
            if not ctx:
                return self.send_error_json(404, f"context '{m.group(1)}' not found")
            with CONTEXTS.lock_of(ctx.id):
                ctx.restart()
            return self.send_plain(204, None)
        self.send_error_json(404, f"no route POST {path}")

    def write_chunk(self, text):
        data = text.encode()
        self.send_all(b"%x\r\n%s\r\n" % (len(data), data))

    def send_all(self, data):
        """Writes to the client without ever blocking for good: a client that
        stops reading holds the write back (backpressure), but one that has
        left (its end reads EOF; behind the gateway, the stream's close) is
        noticed while waiting, as OSError."""
        self.wfile.flush()
        sock = self.connection
        view = memoryview(data)
        while view:
            r, w, _ = select.select([sock], [sock], [], 0.2)
            if r and peer_closed(sock):
                raise ConnectionResetError("the client left")
            if not w:
                continue
            try:
                n = sock.send(view[:65536], socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            view = view[n:]

    def execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            return self.send_error_json(400, "field 'code' (a string) is required")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
                isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and isinstance(v, str)
                and "\0" not in v for k, v in env_vars.items()):
            return self.send_error_json(400, "field 'env_vars' must map variable names to strings")
        cid = body.get("context_id")
        unsupported = None
        ctx = lock = None
        if cid:
            if not isinstance(cid, str) or not CONTEXTS.get(cid):
                return self.send_error_json(404, f"context '{cid}' not found")
            ctx = CONTEXTS.get(cid)
        else:
            try:
                ctx = CONTEXTS.default_for(normalize_language(body.get("language")))
            except (LookupError, OverflowError) as e:
                unsupported = str(e)
        if ctx is not None:
            lock = CONTEXTS.lock_of(ctx.id)
            if lock is None:
                return self.send_error_json(404, f"context '{ctx.id}' not found")
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sink = Sink(self)
        if unsupported is not None:
            # As an execution error, which the SDKs show with its message.
            sink.emit({"type": "error", "name": "UnsupportedLanguage", "value": unsupported, "traceback": ""})
            return self.end_stream(sink)
        with lock:
            if not ctx.alive():
                sink.emit({"type": "stderr", "timestamp": now_iso(),
                           "text": f"[sandgate: the {ctx.language} kernel of this context had died; "
                                   "started a new one (its state is lost)]\n"})
                ctx.restart()
            try:
                ctx.execute(code, env_vars, sink)
            except Exception as e:  # the kernel's channels broke: say so
                sink.emit({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""})
        self.end_stream(sink)

    def end_stream(self, sink):
        sink.emit({"type": "end_of_execution"})
        if not sink.gone:
            try:
                self.send_all(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True
        else:
            self.close_connection = True


def main():
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def warm():
        CONTEXTS.default_for("python")
        READY.set()

    threading.Thread(target=warm, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
