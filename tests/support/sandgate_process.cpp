// SandgateProcess implementation: fork/exec with stdout on a pipe.
#include "tests/support/sandgate_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "sandbox-runtime/templates/template_builder.h"
#include "storage/store.h"
#include "base/sys.h"

namespace sg::test {

std::string sandgate_bin() {
  // SANDGATE_TEST_BIN runs the same tests against another build (an older
  // one, to show a regression test fails there).
  if (const char* b = std::getenv("SANDGATE_TEST_BIN"); b && *b) return b;
  return SANDGATE_BIN;
}

std::optional<SandboxState> sandbox_state(const std::string& data_dir, const std::string& id) {
  auto store = storage::Store::open(data_dir + "/sandgate.db");
  if (!store.ok()) return std::nullopt;
  auto tx = (*store)->db().lock();
  auto st = tx.prepare("SELECT state, COALESCE(init_pid, 0), COALESCE(end_reason, '') FROM sandboxes WHERE id = ?");
  if (!st.ok()) return std::nullopt;
  st->bind(1, id);
  auto row = st->step();
  if (!row.ok() || !*row) return std::nullopt;
  return SandboxState{st->text(0), st->int64(1), st->text(2)};
}

std::string test_templates_dir() {
  static std::once_flag once;
  static std::string dir;
  std::call_once(once, [] {
    std::string d = SANDGATE_TESTS_TEMPLATES_DIR;
    if (!templates::rootfs_ready(d + "/base")) {
      std::fprintf(stderr, "building the test base template in %s/base (debootstrap, about a minute)...\n",
                   d.c_str());
      CliResult r = run_sandgate({"template", "build", "--templates-dir", d});
      if (r.exit_code != 0) {
        std::fprintf(stderr, "template build failed: %s\n", r.err.c_str());
        return;
      }
    }
    dir = d;
  });
  return dir;
}

namespace {

struct Spawned {
  pid_t pid = -1;
  int out_fd = -1;
  int err_fd = -1;
};

Spawned spawn(const std::vector<std::string>& args, const std::string& stderr_file) {
  int out[2], err[2] = {-1, -1};
  if (::pipe2(out, O_CLOEXEC) != 0) return {};
  if (stderr_file.empty() && ::pipe2(err, O_CLOEXEC) != 0) return {};
  std::vector<std::string> full = {sandgate_bin()};
  full.insert(full.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : full) argv.push_back(a.data());
  argv.push_back(nullptr);
  int log_fd = stderr_file.empty() ? -1 : ::open(stderr_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(stderr_file.empty() ? err[1] : log_fd, 2);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  ::close(out[1]);
  if (err[1] >= 0) ::close(err[1]);
  if (log_fd >= 0) ::close(log_fd);
  return {pid, out[0], err[0]};
}

// Reads fd until EOF into s.
void drain(int fd, std::string& s) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    s.append(buf, static_cast<size_t>(n));
  }
}

}  // namespace

CliResult run_sandgate(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  CliResult r;
  Spawned s = spawn(args, "");
  if (s.pid < 0) return r;
  // Read both pipes without deadlock: poll them together.
  pollfd fds[2] = {{s.out_fd, POLLIN, 0}, {s.err_fd, POLLIN, 0}};
  int open_n = 2;
  char buf[4096];
  uint64_t deadline = timeout.count() > 0 ? sys::monotonic_ns() + static_cast<uint64_t>(timeout.count()) * 1000000ull : 0;
  while (open_n > 0) {
    int wait_ms = -1;
    if (deadline) {
      uint64_t now = sys::monotonic_ns();
      if (now >= deadline) {
        // Still running: ended, and reported as timed out.
        ::kill(s.pid, SIGKILL);
        for (pollfd& f : fds)
          if (f.fd >= 0) ::close(f.fd);
        ::waitpid(s.pid, nullptr, 0);
        r.exit_code = kTimedOut;
        return r;
      }
      wait_ms = static_cast<int>((deadline - now) / 1000000ull) + 1;
    }
    if (::poll(fds, 2, wait_ms) < 0 && errno == EINTR) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_n;
      } else {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(n));
      }
    }
  }
  int st = 0;
  ::waitpid(s.pid, &st, 0);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

SandgateProcess::SandgateProcess(std::string data_dir, std::vector<std::string> extra, std::string cgroup_parent)
    : data_dir_(std::move(data_dir)),
      cgroup_parent_(cgroup_parent.empty() ? "sgtest-" + sys::random_hex(6) : std::move(cgroup_parent)) {
  std::string templates = test_templates_dir();
  if (templates.empty()) return;
  std::vector<std::string> args = {"serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir_,
                                   "--templates-dir", templates, "--cgroup-parent", cgroup_parent_,
                                   // Sandboxes end with the server (the restart tests say otherwise).
                                   "--keep-sandboxes", "off",
                                   // Loopback only: these tests are about the API (an allowOut
                                   // is refused); the e2e tests run the default network.
                                   "--network", "off"};
  args.insert(args.end(), extra.begin(), extra.end());
  Spawned s = spawn(args, data_dir_ + ".log");
  if (s.pid < 0) return;
  pid_ = s.pid;
  // Read the banner with a deadline; the key line follows the URL line.
  std::string out;
  uint64_t deadline = sys::monotonic_ns() + 60ull * 1000000000ull;
  char buf[4096];
  while (sys::monotonic_ns() < deadline) {
    size_t key_at = out.find("API key (tenant \"local\"): ");
    if (key_at != std::string::npos && out.find('\n', key_at) != std::string::npos) break;
    pollfd p{s.out_fd, POLLIN, 0};
    int r = ::poll(&p, 1, 1000);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) continue;
    ssize_t n = ::read(s.out_fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  // The rest of stdout is not needed; keep the pipe drained so the server
  // never blocks on it.
  int fd = s.out_fd;
  std::thread([fd] {
    std::string sink;
    drain(fd, sink);
    ::close(fd);
  }).detach();
  const std::string marker = "listening on http://127.0.0.1:";
  size_t at = out.find(marker);
  size_t key_at = out.find("API key (tenant \"local\"): ");
  if (at == std::string::npos || key_at == std::string::npos) {
    std::fprintf(stderr, "sandgate did not start; stdout:\n%s\nstderr:\n%s\n", out.c_str(), log().c_str());
    return;
  }
  port_ = std::atoi(out.c_str() + at + marker.size());
  key_at += std::strlen("API key (tenant \"local\"): ");
  key_ = out.substr(key_at, out.find('\n', key_at) - key_at);
}

SandgateProcess::~SandgateProcess() {
  if (pid_ > 0) stop();
}

std::string SandgateProcess::log() const {
  Result<std::string> r = sys::read_file(data_dir_ + ".log", 16 << 20);
  return r ? *r : "";
}

int SandgateProcess::stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  int st = 0;
  ::waitpid(pid_, &st, 0);
  pid_ = -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

void SandgateProcess::kill9() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int st = 0;
  ::waitpid(pid_, &st, 0);
  pid_ = -1;
}

Response SandgateProcess::get(const std::string& target, const std::string& key) const {
  return client().request("GET", target, "", {{"X-API-KEY", key.empty() ? key_ : key}});
}
Response SandgateProcess::post(const std::string& target, const std::string& body, const std::string& key) const {
  return client().request("POST", target, body, {{"X-API-KEY", key.empty() ? key_ : key}});
}
Response SandgateProcess::del(const std::string& target, const std::string& key) const {
  return client().request("DELETE", target, "", {{"X-API-KEY", key.empty() ? key_ : key}});
}

}  // namespace sg::test
