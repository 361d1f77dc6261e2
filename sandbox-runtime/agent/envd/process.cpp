// Process spawning, output pumps with flow control, and the exit cache.
#include "sandbox-runtime/agent/envd/process.h"

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/fd.h"
#include "base/log.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

namespace sg::envd {

using Clock = std::chrono::steady_clock;

struct Proc {
  pid_t pid = 0;
  json config;
  std::optional<std::string> tag;
  bool pty = false;
  UniqueFd pidfd, wake, out, err;
  // The PTY master: input and resize use master (kept open for the Proc's
  // life); the pump reads and closes its own duplicate, pty_out, so closing
  // at EOF never races with a concurrent SendInput or Update.
  UniqueFd master, pty_out;
  std::mutex in_mu;
  UniqueFd in;  // GUARDED_BY(in_mu): stdin pipe write end
  bool has_deadline = false;
  Clock::time_point deadline;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Subscription*> subs;  // GUARDED_BY(mu)
  bool ended = false;               // GUARDED_BY(mu)
  int end_status = 0;               // GUARDED_BY(mu)
  bool timed_out = false;           // GUARDED_BY(mu)
  bool pump_blocked = false;        // GUARDED_BY(mu)

  void poke() {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake.get(), &one, sizeof one);
  }
};

namespace {

const char* go_signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "hangup";
    case SIGINT: return "interrupt";
    case SIGQUIT: return "quit";
    case SIGILL: return "illegal instruction";
    case SIGTRAP: return "trace/breakpoint trap";
    case SIGABRT: return "aborted";
    case SIGBUS: return "bus error";
    case SIGFPE: return "floating point exception";
    case SIGKILL: return "killed";
    case SIGUSR1: return "user defined signal 1";
    case SIGSEGV: return "segmentation fault";
    case SIGUSR2: return "user defined signal 2";
    case SIGPIPE: return "broken pipe";
    case SIGALRM: return "alarm clock";
    case SIGTERM: return "terminated";
    default: return nullptr;
  }
}

// What the forked child needs, all prepared before fork().
struct ChildArgs {
  const char* exe;
  char* const* argv;
  char* const* envp;
  const char* cwd;
  uid_t uid;
  gid_t gid;
  const gid_t* groups;
  size_t ngroups;
  int in_fd, out_fd, err_fd;  // for a PTY all three are the slave
  bool pty;
  int err_pipe;
};

// Runs in the forked child of a multi-threaded process: async-signal-safe
// calls only, on memory prepared by the parent.
[[noreturn]] void child_main(const ChildArgs& a) {
  int step = 0;
  sigset_t none;
  sigemptyset(&none);
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  for (int s = 1; s < NSIG; ++s) ::sigaction(s, &dfl, nullptr);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (::setsid() < 0) { step = 1; goto fail; }
  if (a.pty && ::ioctl(a.in_fd, TIOCSCTTY, 0) < 0) { step = 2; goto fail; }
  if (::dup2(a.in_fd, 0) < 0 || ::dup2(a.out_fd, 1) < 0 || ::dup2(a.err_fd, 2) < 0) { step = 3; goto fail; }
  if (::syscall(SYS_setgroups, a.ngroups, a.groups) < 0) { step = 4; goto fail; }
  if (::syscall(SYS_setresgid, a.gid, a.gid, a.gid) < 0) { step = 5; goto fail; }
  if (::syscall(SYS_setresuid, a.uid, a.uid, a.uid) < 0) { step = 6; goto fail; }
  if (::chdir(a.cwd) < 0) { step = 7; goto fail; }
  ::syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
  ::execve(a.exe, a.argv, a.envp);
  step = 8;
fail:
  int msg[2] = {step, errno};
  [[maybe_unused]] ssize_t n = ::write(a.err_pipe, msg, sizeof msg);
  ::_exit(127);
}

const char* step_name(int step) {
  switch (step) {
    case 1: return "setsid";
    case 2: return "TIOCSCTTY";
    case 3: return "dup2";
    case 4: return "setgroups";
    case 5: return "setgid";
    case 6: return "setuid";
    case 7: return "chdir";
    case 8: return "execve";
    default: return "child";
  }
}

bool set_nonblock(int fd) {
  int fl = ::fcntl(fd, F_GETFL);
  return fl >= 0 && ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

int ms_until(Clock::time_point t) {
  auto d = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  if (d < 0) return 0;
  return d > 3600000 ? 3600000 : static_cast<int>(d);
}

}  // namespace

std::string wait_status_string(int st) {
  if (WIFEXITED(st)) return "exit status " + std::to_string(WEXITSTATUS(st));
  if (WIFSIGNALED(st)) {
    const char* n = go_signal_name(WTERMSIG(st));
    std::string s = "signal: " + (n ? std::string(n) : "signal " + std::to_string(WTERMSIG(st)));
    if (WCOREDUMP(st)) s += " (core dumped)";
    return s;
  }
  return "unknown status";
}

json end_event_json(int st) {
  json end = json::object();
  std::string s = wait_status_string(st);
  if (WIFEXITED(st)) {
    int code = WEXITSTATUS(st);
    if (code != 0) end["exitCode"] = code;
    end["exited"] = true;
    end["status"] = s;
    if (code != 0) end["error"] = s;
  } else {
    end["exitCode"] = -1;
    end["status"] = s;
    end["error"] = s;
  }
  return end;
}

Subscription::~Subscription() {
  if (!proc_) return;
  std::lock_guard<std::mutex> g(proc_->mu);
  auto& v = proc_->subs;
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] == this) {
      v.erase(v.begin() + static_cast<long>(i));
      break;
    }
  if (proc_->pump_blocked) proc_->poke();
}

size_t Subscription::pending() const {
  if (!proc_) return 0;
  std::lock_guard<std::mutex> g(proc_->mu);
  return pending_;
}

std::optional<ProcEvent> Subscription::next(Clock::time_point deadline) {
  if (!proc_) {
    if (queue_.empty()) return std::nullopt;
    ProcEvent e = std::move(queue_.front());
    queue_.pop_front();
    return e;
  }
  std::unique_lock<std::mutex> l(proc_->mu);
  if (!proc_->cv.wait_until(l, deadline, [&] { return !queue_.empty(); })) return std::nullopt;
  ProcEvent e = std::move(queue_.front());
  queue_.pop_front();
  pending_ -= e.data.size();
  if (proc_->pump_blocked && pending_ < kPendingLimit) proc_->poke();
  return e;
}

ProcessManager::ProcessManager(agent::Reaper& reaper, SpawnFn spawn)
    : reaper_(reaper), spawn_(spawn ? std::move(spawn) : SpawnFn(spawn_detached)) {}

ProcessManager::~ProcessManager() { shutdown(); }

RpcResult<std::shared_ptr<Subscription>> ProcessManager::start(const StartSpec& spec) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (shutting_down_) return rpc_error(Code::kUnavailable, "envd is shutting down");
  }
  auto p = std::make_shared<Proc>();
  p->config = spec.config;
  p->tag = spec.tag;
  p->pty = spec.pty;
  if (spec.timeout.count() > 0) {
    p->has_deadline = true;
    p->deadline = Clock::now() + spec.timeout;
  }
  p->wake = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!p->wake) return rpc_errno("eventfd", "for process", errno);

  UniqueFd child_in, child_out, child_err, slave;
  if (spec.pty) {
    int m = -1, s = -1;
    struct winsize ws = {};
    ws.ws_col = spec.cols ? spec.cols : 80;
    ws.ws_row = spec.rows ? spec.rows : 24;
    if (::openpty(&m, &s, nullptr, nullptr, &ws) < 0) return rpc_errno("openpty", "", errno);
    p->master = UniqueFd(m);
    slave = UniqueFd(s);
    ::fcntl(m, F_SETFD, FD_CLOEXEC);
    ::fcntl(s, F_SETFD, FD_CLOEXEC);
    set_nonblock(m);
    p->pty_out = UniqueFd(::fcntl(m, F_DUPFD_CLOEXEC, 3));
    if (!p->pty_out) return rpc_errno("dup", "PTY master", errno);
  } else {
    int fds[2];
    if (spec.stdin_pipe) {
      if (::pipe2(fds, O_CLOEXEC) < 0) return rpc_errno("pipe", "stdin", errno);
      child_in = UniqueFd(fds[0]);
      p->in = UniqueFd(fds[1]);
      set_nonblock(fds[1]);
    } else {
      child_in = UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      if (!child_in) return rpc_errno("open", "/dev/null", errno);
    }
    if (::pipe2(fds, O_CLOEXEC) < 0) return rpc_errno("pipe", "stdout", errno);
    p->out = UniqueFd(fds[0]);
    child_out = UniqueFd(fds[1]);
    if (::pipe2(fds, O_CLOEXEC) < 0) return rpc_errno("pipe", "stderr", errno);
    p->err = UniqueFd(fds[0]);
    child_err = UniqueFd(fds[1]);
    set_nonblock(p->out.get());
    set_nonblock(p->err.get());
  }
  int ep[2];
  if (::pipe2(ep, O_CLOEXEC) < 0) return rpc_errno("pipe", "exec status", errno);
  UniqueFd err_r(ep[0]), err_w(ep[1]);

  // Everything the child touches, prepared before fork.
  std::vector<char*> argv, envp;
  for (auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  ChildArgs ca{spec.exe.c_str(), argv.data(), envp.data(), spec.cwd.c_str(), spec.user.uid, spec.user.gid,
               spec.user.groups.data(), spec.user.groups.size(),
               spec.pty ? slave.get() : child_in.get(), spec.pty ? slave.get() : child_out.get(),
               spec.pty ? slave.get() : child_err.get(), spec.pty, err_w.get()};

  auto sub = std::shared_ptr<Subscription>(new Subscription());
  int pidfd = -1;
  int fork_errno = 0;
  pid_t pid = reaper_.spawn([&]() -> pid_t {
    pid_t c = ::fork();
    if (c == 0) child_main(ca);
    if (c < 0) {
      fork_errno = errno;
      return c;
    }
    // Under the reaper's lock: the child cannot be reaped before its pidfd
    // exists, so the pidfd always refers to it.
    pidfd = static_cast<int>(::syscall(SYS_pidfd_open, c, 0));
    return c;
  });
  if (pid < 0) return rpc_errno("fork", spec.exe, fork_errno);
  p->pid = pid;
  p->pidfd = UniqueFd(pidfd);
  err_w.reset();
  slave.reset();
  child_in.reset();
  child_out.reset();
  child_err.reset();
  int msg[2];
  ssize_t n;
  do n = ::read(err_r.get(), msg, sizeof msg);
  while (n < 0 && errno == EINTR);
  if (n == sizeof msg) {
    reaper_.wait(pid, std::chrono::seconds(10));
    std::string what = std::string(step_name(msg[0])) + " " + (msg[0] == 7 ? spec.cwd : spec.exe);
    return rpc_errno("start process:", what, msg[1]);
  }
  if (!p->pidfd) {
    ::kill(pid, SIGKILL);
    reaper_.wait(pid, std::chrono::seconds(10));
    return rpc_errno("pidfd_open", std::to_string(pid), errno);
  }
  sub->pid_ = pid;
  sub->proc_ = p;
  p->subs.push_back(sub.get());
  {
    std::lock_guard<std::mutex> g(mu_);
    running_[pid] = p;
    ++active_pumps_;
  }
  ++started_;
  if (!spawn_([this, p] { pump(p); })) {
    // No thread (the sandbox used up its pids): the process goes, through
    // the same end as any other, so a Connect that found it meanwhile gets
    // its end event; this request gets the error.
    ::syscall(SYS_pidfd_send_signal, p->pidfd.get(), SIGKILL, nullptr, 0);
    std::optional<int> st = reaper_.wait(pid, std::chrono::seconds(10));
    finish(p, st.value_or(SIGKILL), false);
    return rpc_error(Code::kResourceExhausted, "start process " + spec.exe +
                                                   ": no thread for its output (the sandbox is out of processes "
                                                   "or threads, pids limit), so it was killed; retry after some exit");
  }
  return sub;
}

void ProcessManager::pump(std::shared_ptr<Proc> p) {
  struct Src {
    UniqueFd* fd;
    ProcEvent::Kind kind;
    size_t chunk;
  };
  std::vector<Src> srcs;
  if (p->pty) srcs.push_back({&p->pty_out, ProcEvent::kPty, kPtyChunk});
  else {
    srcs.push_back({&p->out, ProcEvent::kStdout, kPipeChunk});
    srcs.push_back({&p->err, ProcEvent::kStderr, kPipeChunk});
  }
  std::string buf(kPipeChunk, '\0');
  bool exited = false, timed_out = false, was_blocked = false;
  int drain_rounds = 0;
  for (;;) {
    bool can_read = true;
    {
      std::lock_guard<std::mutex> g(p->mu);
      for (auto* s : p->subs)
        if (s->pending_ >= kPendingLimit) can_read = false;
      p->pump_blocked = !can_read;
    }
    if (!can_read && !was_blocked) ++flow_stalls_;
    was_blocked = !can_read;
    bool any_open = false;
    for (auto& s : srcs) any_open |= s.fd->valid();
    // After the exit, drain what the pipes hold, but never wait for a
    // grandchild that inherited them.
    if (exited && (!any_open || drain_rounds > 64)) break;
    std::vector<struct pollfd> pf;
    pf.push_back({p->wake.get(), POLLIN, 0});
    if (!exited) pf.push_back({p->pidfd.get(), POLLIN, 0});
    size_t first_src = pf.size();
    std::vector<Src*> polled;
    if (can_read)
      for (auto& s : srcs)
        if (s.fd->valid()) {
          pf.push_back({s.fd->get(), POLLIN, 0});
          polled.push_back(&s);
        }
    int timeout = exited ? (can_read ? 0 : 1000) : -1;
    if (p->has_deadline && !timed_out && !exited) timeout = ms_until(p->deadline);
    int r = ::poll(pf.data(), pf.size(), timeout);
    if (r < 0 && errno != EINTR) {
      LOG_ERROR("envd: poll for process " << p->pid << ": " << std::strerror(errno));
      break;
    }
    if (p->has_deadline && !timed_out && !exited && Clock::now() >= p->deadline) {
      ::syscall(SYS_pidfd_send_signal, p->pidfd.get(), SIGKILL, nullptr, 0);
      timed_out = true;
    }
    if (r <= 0) {
      if (exited && can_read) break;
      continue;
    }
    if (pf[0].revents) {
      uint64_t v;
      [[maybe_unused]] ssize_t k = ::read(p->wake.get(), &v, sizeof v);
    }
    if (!exited && (pf[1].revents & (POLLIN | POLLHUP | POLLERR))) exited = true;
    for (size_t i = 0; i < polled.size(); ++i) {
      if (!pf[first_src + i].revents) continue;
      Src& s = *polled[i];
      ssize_t n = ::read(s.fd->get(), buf.data(), s.chunk);
      if (n > 0) {
        std::lock_guard<std::mutex> g(p->mu);
        for (auto* sub : p->subs) {
          sub->queue_.push_back({s.kind, std::string(buf.data(), static_cast<size_t>(n)), 0, false});
          sub->pending_ += static_cast<size_t>(n);
        }
        p->cv.notify_all();
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        // EOF, or EIO from a PTY master whose slave side is all closed.
        s.fd->reset();
      }
    }
    if (exited) ++drain_rounds;
  }
  for (auto& s : srcs) s.fd->reset();
  std::optional<int> st = reaper_.wait(p->pid, std::chrono::seconds(30));
  if (!st) {
    LOG_WARN("envd: no wait status for process " << p->pid << " (not reaped within 30 s)");
    st = SIGKILL;  // a wait status of "killed by SIGKILL"
  }
  finish(p, *st, timed_out);
}

void ProcessManager::finish(const std::shared_ptr<Proc>& p, int status, bool timed_out) {
  {
    std::lock_guard<std::mutex> g(mu_);
    running_.erase(p->pid);
    if (exited_.size() >= kExitCacheSize && !exited_order_.empty()) {
      exited_.erase(exited_order_.front());
      exited_order_.pop_front();
    }
    exited_[p->pid] = Exited{p->config, p->tag, status};
    exited_order_.push_back(p->pid);
  }
  {
    std::lock_guard<std::mutex> g(p->mu);
    p->ended = true;
    p->end_status = status;
    p->timed_out = timed_out;
    for (auto* sub : p->subs) sub->queue_.push_back({ProcEvent::kEnd, {}, status, timed_out});
    p->cv.notify_all();
  }
  // Notified under the lock: once the count reads 0 the manager may be
  // destroyed, so nothing of it may be touched after the unlock.
  std::lock_guard<std::mutex> g(mu_);
  --active_pumps_;
  pumps_done_.notify_all();
}

std::shared_ptr<Proc> ProcessManager::find(pid_t pid, const std::string& tag) {
  std::lock_guard<std::mutex> g(mu_);
  if (pid > 0) {
    auto it = running_.find(pid);
    return it == running_.end() ? nullptr : it->second;
  }
  if (tag.empty()) return nullptr;
  for (auto& [k, v] : running_)
    if (v->tag && *v->tag == tag) return v;
  return nullptr;
}

static RpcError process_not_found(pid_t pid, const std::string& tag) {
  return rpc_error(Code::kNotFound, pid > 0 ? "process with pid " + std::to_string(pid) + " not found"
                                            : "process with tag '" + tag + "' not found");
}

RpcResult<std::shared_ptr<Subscription>> ProcessManager::connect(pid_t pid, const std::string& tag) {
  auto exited_sub = [](pid_t id, int status) {
    auto sub = std::shared_ptr<Subscription>(new Subscription());
    sub->pid_ = id;
    sub->queue_.push_back({ProcEvent::kEnd, {}, status, false});
    return sub;
  };
  if (auto p = find(pid, tag)) {
    std::lock_guard<std::mutex> g(p->mu);
    if (p->ended) return exited_sub(p->pid, p->end_status);
    auto sub = std::shared_ptr<Subscription>(new Subscription());
    sub->pid_ = p->pid;
    sub->proc_ = p;
    p->subs.push_back(sub.get());
    return sub;
  }
  std::lock_guard<std::mutex> g(mu_);
  if (pid > 0) {
    auto it = exited_.find(pid);
    if (it != exited_.end()) return exited_sub(pid, it->second.status);
  } else {
    for (auto it = exited_order_.rbegin(); it != exited_order_.rend(); ++it) {
      auto& e = exited_.at(*it);
      if (e.tag && *e.tag == tag && !tag.empty()) return exited_sub(*it, e.status);
    }
  }
  return process_not_found(pid, tag);
}

std::vector<ProcessInfo> ProcessManager::list() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<ProcessInfo> out;
  for (auto& [pid, p] : running_) out.push_back({pid, p->config, p->tag});
  return out;
}

RpcResult<pid_t> ProcessManager::lookup(pid_t pid, const std::string& tag) {
  auto p = find(pid, tag);
  if (!p) return process_not_found(pid, tag);
  return p->pid;
}

RpcStatus ProcessManager::send_input(pid_t pid, const std::string& tag, bool pty, const std::string& data) {
  auto p = find(pid, tag);
  if (!p) return process_not_found(pid, tag);
  std::lock_guard<std::mutex> g(p->in_mu);
  int fd = -1;
  if (p->pty) fd = p->master.get();
  else if (!pty) fd = p->in.get();
  if (fd < 0)
    return rpc_error(Code::kFailedPrecondition,
                     pty ? "process " + std::to_string(p->pid) + " has no PTY"
                         : "stdin of process " + std::to_string(p->pid) + " is not open (start it with stdin: true)");
  std::string_view rest(data);
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (!rest.empty()) {
    ssize_t n = ::write(fd, rest.data(), rest.size());
    if (n > 0) {
      rest.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      struct pollfd pfd = {fd, POLLOUT, 0};
      if (::poll(&pfd, 1, ms_until(deadline)) == 0)
        return rpc_error(Code::kDeadlineExceeded, "write to stdin of process " + std::to_string(p->pid) +
                                                      ": the process is not reading its input");
      continue;
    }
    return rpc_errno("write stdin of process", std::to_string(p->pid), errno);
  }
  return rpc_ok();
}

RpcStatus ProcessManager::close_stdin(pid_t pid, const std::string& tag) {
  auto p = find(pid, tag);
  if (!p) return process_not_found(pid, tag);
  if (p->pty) return rpc_error(Code::kFailedPrecondition, "cannot close stdin of a PTY process; send EOT (\\x04)");
  std::lock_guard<std::mutex> g(p->in_mu);
  p->in.reset();
  return rpc_ok();
}

RpcStatus ProcessManager::signal(pid_t pid, const std::string& tag, int sig) {
  auto p = find(pid, tag);
  if (!p) return process_not_found(pid, tag);
  if (::syscall(SYS_pidfd_send_signal, p->pidfd.get(), sig, nullptr, 0) < 0 && errno != ESRCH)
    return rpc_errno("signal process", std::to_string(p->pid), errno);
  return rpc_ok();
}

RpcStatus ProcessManager::resize(pid_t pid, const std::string& tag, uint16_t cols, uint16_t rows) {
  auto p = find(pid, tag);
  if (!p) return process_not_found(pid, tag);
  if (!p->pty) return rpc_error(Code::kFailedPrecondition, "process " + std::to_string(p->pid) + " has no PTY");
  struct winsize ws = {};
  ws.ws_col = cols;
  ws.ws_row = rows;
  if (::ioctl(p->master.get(), TIOCSWINSZ, &ws) < 0) return rpc_errno("TIOCSWINSZ process", std::to_string(p->pid), errno);
  return rpc_ok();
}

void ProcessManager::shutdown() {
  std::unique_lock<std::mutex> l(mu_);
  shutting_down_ = true;
  for (auto& [pid, p] : running_) ::syscall(SYS_pidfd_send_signal, p->pidfd.get(), SIGKILL, nullptr, 0);
  // Pumps end once their process is reaped (the reaper is driven by the
  // agent's main loop, or the test's reaper thread).
  if (!pumps_done_.wait_for(l, std::chrono::seconds(40), [&] { return active_pumps_ == 0; }))
    LOG_ERROR("envd: " << active_pumps_ << " process pumps still running at shutdown");
}

ProcessStats ProcessManager::stats() {
  ProcessStats s;
  std::vector<std::shared_ptr<Proc>> procs;
  {
    std::lock_guard<std::mutex> g(mu_);
    s.running = running_.size();
    for (auto& [pid, p] : running_) procs.push_back(p);
  }
  for (auto& p : procs) {
    std::lock_guard<std::mutex> g(p->mu);
    for (auto* sub : p->subs) s.pending_bytes += sub->pending_;
  }
  s.flow_stalls = flow_stalls_;
  s.started = started_;
  return s;
}

}  // namespace sg::envd
