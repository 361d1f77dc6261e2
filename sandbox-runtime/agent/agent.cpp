// sandgate-agent: init of the sandbox and the sandbox end of the channel.
// See agent.h for the contract and docs/channel.md for the wire format.
#include "agent/agent.h"

#include <dirent.h>
#include <fcntl.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "sys/fd.h"
#include "sys/log.h"
#include "sys/sys.h"

namespace sg::agent {

using json = nlohmann::json;

Result<AgentConfig> parse_config(int argc, char** argv, char** envp) {
  AgentConfig cfg;
  for (int i = 1; i < argc; ++i) {
    std::string_view a(argv[i]);
    if (a == "--channel-fd" && i + 1 < argc) {
      char* end = nullptr;
      long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v < 0 || v > 1 << 20) return invalid_error(std::string("bad --channel-fd ") + argv[i]);
      cfg.channel_fd = static_cast<int>(v);
    } else if (a == "--no-loopback") {
      cfg.bring_up_loopback = false;
    } else {
      return invalid_error("unknown argument " + std::string(a) + " (usage: sandgate-agent [--channel-fd N] [--no-loopback])");
    }
  }
  if (!envp) return cfg;
  for (char** e = envp; *e; ++e) {
    std::string_view kv(*e);
    if (kv.substr(0, kAgentEnvPrefix.size()) != kAgentEnvPrefix) {
      cfg.child_env.emplace_back(kv);
      continue;
    }
    size_t eq = kv.find('=');
    std::string_view name = kv.substr(0, eq);
    std::string_view value = eq == std::string_view::npos ? std::string_view() : kv.substr(eq + 1);
    if (name == "SANDGATE_ENVD_TOKEN") cfg.envd_access_token = value;
    if (name == "SANDGATE_SANDBOX_ID") cfg.sandbox_id = value;
    // Wipe the original bytes (they back /proc/self/environ) now that the
    // value is copied.
    std::memset(*e, 0, kv.size());
  }
  // Drop the wiped entries so getenv() and any later exec see none of them.
  char** out = envp;
  for (char** e = envp; *e; ++e)
    if (**e != '\0') *out++ = *e;
  *out = nullptr;
  return cfg;
}

size_t count_processes(const std::string& proc_dir, int self_pid) {
  DIR* d = ::opendir(proc_dir.c_str());
  if (!d) return 0;
  size_t n = 0;
  while (struct dirent* e = ::readdir(d)) {
    const char* s = e->d_name;
    if (*s == '\0') continue;
    bool numeric = true;
    for (const char* c = s; *c; ++c)
      if (*c < '0' || *c > '9') numeric = false;
    if (!numeric) continue;
    if (std::atoi(s) == self_pid) continue;
    ++n;
  }
  ::closedir(d);
  return n;
}

std::string ready_message(int pid) {
  return json{{"type", "ready"}, {"agent", kAgentName}, {"envdVersion", kEnvdVersion}, {"pid", pid}}.dump();
}

ControlAction handle_control(std::string_view payload, const std::function<size_t()>& count_procs) {
  ControlAction act;
  json msg = json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false);
  if (msg.is_discarded() || !msg.is_object()) {
    act.error = "control message is not a JSON object";
    return act;
  }
  auto t = msg.find("type");
  if (t == msg.end() || !t->is_string()) {
    act.error = "control message without a string \"type\"";
    return act;
  }
  const std::string& type = t->get_ref<const std::string&>();
  if (type == "ping") {
    json reply{{"type", "pong"}};
    if (auto id = msg.find("id"); id != msg.end()) reply["id"] = *id;
    act.reply = reply.dump();
  } else if (type == "status") {
    act.reply = json{{"type", "status"}, {"processes", count_procs()}}.dump();
  } else if (type == "shutdown") {
    act.shutdown = true;
  } else {
    // Forward compatibility: a newer host may send messages this agent does
    // not know; say so instead of closing the channel.
    act.reply = json{{"type", "error"}, {"message", "unknown control message type"}, {"request", type}}.dump();
  }
  return act;
}

namespace {

Status bring_up_loopback() {
  UniqueFd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s) return sys::errno_error("socket", "AF_INET");
  struct ifreq ifr;
  std::memset(&ifr, 0, sizeof ifr);
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  // SAFETY: ifr is a zeroed ifreq with a NUL-terminated name, as SIOCGIFFLAGS expects.
  if (::ioctl(s.get(), SIOCGIFFLAGS, &ifr) != 0) return sys::errno_error("SIOCGIFFLAGS", "lo");
  ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
  // SAFETY: same ifreq, flags filled by the kernel above plus IFF_UP.
  if (::ioctl(s.get(), SIOCSIFFLAGS, &ifr) != 0) return sys::errno_error("SIOCSIFFLAGS", "lo");
  return Status::Ok();
}

// The event loop's state: the channel, its decoder and output buffer.
class Loop {
 public:
  Loop(const AgentConfig& cfg, int sigfd) : cfg_(cfg), sigfd_(sigfd) {}

  // Queues one frame; false once the output bound is exceeded.
  bool send(uint32_t stream, channel::FrameType type, std::string payload) {
    channel::encode(channel::Frame{stream, type, std::move(payload)}, out_);
    if (out_.size() > kMaxOutputBuffer) {
      LOG_ERROR("agent: host is not reading the channel (" << out_.size() << " bytes pending), closing it");
      return false;
    }
    return true;
  }

  // Writes what it can without blocking. False on a fatal write error.
  bool flush() {
    while (!out_.empty()) {
      ssize_t n = ::send(cfg_.channel_fd, out_.data(), out_.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        LOG_ERROR("agent: write channel: " << std::strerror(errno));
        return false;
      }
      out_.erase(0, static_cast<size_t>(n));
    }
    return true;
  }

  // Reads and handles what is available. False: stop the loop.
  bool on_readable() {
    char buf[64 * 1024];
    for (;;) {
      ssize_t n = ::recv(cfg_.channel_fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        LOG_ERROR("agent: read channel: " << std::strerror(errno));
        return false;
      }
      if (n == 0) {
        LOG_INFO("agent: channel closed by the host, shutting down");
        return false;
      }
      if (!decoder_.feed(std::string_view(buf, static_cast<size_t>(n)))) {
        LOG_ERROR("agent: malformed frame from the host: " << decoder_.error() << "; closing the channel");
        return false;
      }
      while (auto f = decoder_.next())
        if (!on_frame(*f)) return false;
    }
  }

  bool on_frame(const channel::Frame& f) {
    if (f.stream != channel::kControlStream) {
      // Data streams come with envd-over-channel; until then every stream
      // the host opens is refused, which the protocol allows.
      if (f.type == channel::FrameType::kReset) return true;
      return send(f.stream, channel::FrameType::kReset, "no stream services in this agent version");
    }
    if (f.type != channel::FrameType::kData) {
      LOG_ERROR("agent: control stream frame of type " << static_cast<int>(f.type) << "; closing the channel");
      return false;
    }
    ControlAction act = handle_control(f.payload, [] { return count_processes("/proc", ::getpid()); });
    if (!act.error.empty()) {
      LOG_ERROR("agent: " << act.error << "; closing the channel");
      return false;
    }
    if (!act.reply.empty() && !send(channel::kControlStream, channel::FrameType::kData, std::move(act.reply)))
      return false;
    if (act.shutdown) {
      LOG_INFO("agent: shutdown requested by the host");
      return false;
    }
    return true;
  }

  // Handles pending signals. False on SIGTERM.
  bool on_signal() {
    bool keep = true;
    for (;;) {
      struct signalfd_siginfo si;
      ssize_t n = ::read(sigfd_, &si, sizeof si);
      if (n != static_cast<ssize_t>(sizeof si)) break;
      if (si.ssi_signo == SIGTERM) {
        LOG_INFO("agent: SIGTERM, shutting down");
        keep = false;
      }
    }
    reap();
    return keep;
  }

  // PID 1 duty: collect every zombie, ours or reparented to us.
  static void reap() {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
  }

  bool want_write() const { return !out_.empty(); }

 private:
  const AgentConfig& cfg_;
  int sigfd_;
  channel::Decoder decoder_;
  std::string out_;
};

}  // namespace

int run(const AgentConfig& cfg) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  sigaddset(&set, SIGTERM);
  if (::sigprocmask(SIG_BLOCK, &set, nullptr) != 0) {
    LOG_ERROR("agent: sigprocmask: " << std::strerror(errno));
    return 1;
  }
  UniqueFd sigfd(::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!sigfd) {
    LOG_ERROR("agent: signalfd: " << std::strerror(errno));
    return 1;
  }
  int fl = ::fcntl(cfg.channel_fd, F_GETFL);
  if (fl < 0 || ::fcntl(cfg.channel_fd, F_SETFL, fl | O_NONBLOCK) != 0) {
    LOG_ERROR("agent: channel fd " << cfg.channel_fd << ": " << std::strerror(errno));
    return 1;
  }
  ::fcntl(cfg.channel_fd, F_SETFD, FD_CLOEXEC);
  if (cfg.bring_up_loopback) {
    if (Status s = bring_up_loopback(); !s) LOG_WARN("agent: loopback: " << s.error().message());
  }

  Loop loop(cfg, sigfd.get());
  bool running = loop.send(channel::kControlStream, channel::FrameType::kData, ready_message(::getpid())) && loop.flush();
  while (running) {
    struct pollfd fds[2];
    fds[0] = {cfg.channel_fd, static_cast<short>(POLLIN | (loop.want_write() ? POLLOUT : 0)), 0};
    fds[1] = {sigfd.get(), POLLIN, 0};
    int n = ::poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      LOG_ERROR("agent: poll: " << std::strerror(errno));
      break;
    }
    if (fds[1].revents & POLLIN) running = loop.on_signal();
    if (running && (fds[0].revents & (POLLIN | POLLHUP | POLLERR))) running = loop.on_readable();
    if (running) running = loop.flush();
  }
  // Best effort: what the host should still see (e.g. a last pong) goes out
  // before the channel closes.
  loop.flush();
  ::close(cfg.channel_fd);
  // Nothing may outlive init: kill every other process in the namespace and
  // reap them, so the host sees init exit only once the sandbox is empty.
  ::kill(-1, SIGKILL);
  while (::waitpid(-1, nullptr, 0) > 0 || errno == EINTR) {
  }
  return 0;
}

}  // namespace sg::agent
