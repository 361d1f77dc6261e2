// sandgate-agent: init of the sandbox and the sandbox end of the channel.
// See agent.h for the contract and docs/channel.md for the wire format.
#include "sandbox-runtime/agent/agent.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <linux/random.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <system_error>
#include <thread>

#include "sandbox-runtime/agent/envd/server.h"
#include "sandbox-runtime/agent/harden.h"
#include "sandbox-runtime/agent/reaper.h"
#include "sandbox-runtime/agent/service_forwarder.h"
#include "sandbox-runtime/channel/control_message.h"
#include "sandbox-runtime/channel/mux.h"
#include "sandbox-runtime/network/rtnl.h"
#include "base/fd.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::agent {

using json = nlohmann::json;

Result<AgentConfig> parse_config(int argc, char** argv, char** envp) {
  AgentConfig cfg;
  for (int i = 1; i < argc; ++i) {
    std::string_view a(argv[i]);
    if (a == "--channel-fd" && i + 1 < argc) {
      char* end = nullptr;
      long v = std::strtol(argv[++i], &end, 10);
      if (end == argv[i] || *end != '\0' || v < 0 || v > 1 << 20)
        return invalid_error(std::string("bad --channel-fd ") + argv[i]);
      cfg.channel_fd = static_cast<int>(v);
    } else if (a == "--no-loopback") {
      cfg.bring_up_loopback = false;
    } else if (a == "--vm") {
      cfg.vm = true;
    } else if ((a == "--model-proxy-port" || a == "--egress-proxy-port") && i + 1 < argc) {
      char* end = nullptr;
      long v = std::strtol(argv[++i], &end, 10);
      if (end == argv[i] || *end != '\0' || v < 0 || v > 65535)
        return invalid_error("bad " + std::string(a) + " " + argv[i] + " (0..65535; 0 disables the listener)");
      (a == "--model-proxy-port" ? cfg.model_proxy_port : cfg.egress_proxy_port) = static_cast<uint16_t>(v);
    } else {
      return invalid_error("unknown argument " + std::string(a) +
                           " (usage: sandgate-agent [--channel-fd N] [--no-loopback] [--vm] [--model-proxy-port N]"
                           " [--egress-proxy-port N])");
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
    if (name == "SANDGATE_REATTACH") cfg.reattach = value == "1";
    if (name == "SANDGATE_NAMESERVER") {
      struct in_addr a {};
      std::string v(value);
      if (::inet_pton(AF_INET, v.c_str(), &a) != 1) return invalid_error("SANDGATE_NAMESERVER '" + v + "'");
      cfg.nameserver = v;
    }
    if (name == "SANDGATE_USERNS_FD") {
      std::string v(value);
      char* end = nullptr;
      long fd = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || fd < 0 || fd > 1024) return invalid_error("SANDGATE_USERNS_FD '" + v + "'");
      cfg.userns_fd = static_cast<int>(fd);
    }
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

namespace {
// Parent pid from /proc/N/stat ("pid (comm) state ppid ..."; comm may hold
// spaces and parentheses, so parse after the last ')').
int parent_pid(const std::string& proc_dir, const char* pid) {
  auto stat = sys::read_file(proc_dir + "/" + pid + "/stat", 4096);
  if (!stat) return -1;
  size_t rp = stat->rfind(')');
  if (rp == std::string::npos || rp + 4 > stat->size()) return -1;
  return std::atoi(stat->c_str() + rp + 4);
}

bool numeric_name(const char* s) {
  if (*s == '\0') return false;
  for (const char* c = s; *c; ++c)
    if (*c < '0' || *c > '9') return false;
  return true;
}

// The state letter of a /proc stat file ("pid (comm) S ..."), 0 if malformed.
char stat_state(const std::string& path) {
  auto stat = sys::read_file(path, 4096);
  if (!stat) return 0;
  size_t rp = stat->rfind(')');
  if (rp == std::string::npos || rp + 2 >= stat->size() || (*stat)[rp + 1] != ' ') return 0;
  return (*stat)[rp + 2];
}

bool busy_state(char c) { return c == 'R' || c == 'D'; }

enum class ThreadScan { kIdle, kBusy, kTruncated };

// Whether any of the first max_threads threads of process dir is R or D.
ThreadScan scan_threads(const std::string& dir, size_t max_threads) {
  DIR* d = ::opendir((dir + "/task").c_str());
  // No task directory (gone meanwhile, or a procfs without one): the main
  // thread's state in PID/stat is all there is.
  if (!d) return busy_state(stat_state(dir + "/stat")) ? ThreadScan::kBusy : ThreadScan::kIdle;
  ThreadScan r = ThreadScan::kIdle;
  size_t seen = 0;
  while (struct dirent* e = ::readdir(d)) {
    if (!numeric_name(e->d_name)) continue;
    if (seen == max_threads) {
      r = ThreadScan::kTruncated;
      break;
    }
    ++seen;
    if (busy_state(stat_state(dir + "/task/" + e->d_name + "/stat"))) {
      r = ThreadScan::kBusy;
      break;
    }
  }
  ::closedir(d);
  return r;
}
}  // namespace

size_t count_processes(const std::string& proc_dir, int self_pid, bool skip_kernel_threads) {
  DIR* d = ::opendir(proc_dir.c_str());
  if (!d) return 0;
  size_t n = 0;
  while (struct dirent* e = ::readdir(d)) {
    const char* s = e->d_name;
    if (!numeric_name(s)) continue;
    if (std::atoi(s) == self_pid) continue;
    if (skip_kernel_threads && (std::atoi(s) == 2 || parent_pid(proc_dir, s) == 2)) continue;
    ++n;
  }
  ::closedir(d);
  return n;
}

RunnableCount count_runnable(const std::string& proc_dir, int self_pid, bool skip_kernel_threads, size_t max_processes,
                             size_t max_threads) {
  RunnableCount rc;
  DIR* d = ::opendir(proc_dir.c_str());
  if (!d) return rc;
  size_t scanned = 0;
  while (struct dirent* e = ::readdir(d)) {
    const char* s = e->d_name;
    if (!numeric_name(s)) continue;
    if (std::atoi(s) == self_pid) continue;
    if (skip_kernel_threads && (std::atoi(s) == 2 || parent_pid(proc_dir, s) == 2)) continue;
    if (scanned == max_processes) {
      rc.truncated = true;
      break;
    }
    ++scanned;
    switch (scan_threads(proc_dir + "/" + s, max_threads)) {
      case ThreadScan::kBusy: ++rc.runnable; break;
      case ThreadScan::kTruncated: rc.truncated = true; break;
      case ThreadScan::kIdle: break;
    }
  }
  ::closedir(d);
  return rc;
}

std::string ready_message(int pid) {
  return json{{"type", "ready"}, {"agent", kAgentName}, {"envdVersion", kEnvdVersion}, {"pid", pid}}.dump();
}

static Result<VmConfigure> configure_from_json(const json& msg);

ControlAction handle_control(std::string_view payload, const std::function<ProcessCounts()>& count_procs, bool vm) {
  (void)vm;  // both modes take every message; the caller applies configure by mode
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
    ProcessCounts pc = count_procs();
    json reply{{"type", "status"}, {"processes", pc.processes}, {"runnable", pc.runnable}};
    if (pc.truncated) reply["truncated"] = true;
    act.reply = reply.dump();
  } else if (type == "shutdown") {
    act.shutdown = true;
  } else if (type == "configure") {
    auto c = configure_from_json(msg);
    if (c) act.configure = std::move(*c);
    else act.reply = json{{"type", "error"}, {"message", c.error().message()}, {"request", type}}.dump();
  } else {
    // Forward compatibility: a newer host may send messages this agent does
    // not know; say so instead of closing the channel.
    act.reply = json{{"type", "error"}, {"message", "unknown control message type"}, {"request", type}}.dump();
  }
  return act;
}

Result<VmConfigure> parse_vm_configure(std::string_view payload) {
  return configure_from_json(json::parse(payload.begin(), payload.end(), nullptr, /*allow_exceptions=*/false));
}

static Result<VmConfigure> configure_from_json(const json& msg) {
  if (!msg.is_object()) return invalid_error("configure: not a JSON object");
  VmConfigure c;
  auto str = [&](const char* k, std::string* out, size_t max) -> Status {
    auto it = msg.find(k);
    if (it == msg.end()) return {};
    if (!it->is_string() || it->get_ref<const std::string&>().size() > max) return invalid_error(std::string("configure: bad ") + k);
    *out = it->get<std::string>();
    return {};
  };
  if (Status s = str("sandboxId", &c.sandbox_id, 64); !s) return s.error();
  if (Status s = str("envdAccessToken", &c.envd_access_token, 256); !s) return s.error();
  std::string entropy_hex;
  if (Status s = str("entropy", &entropy_hex, 1024); !s) return s.error();
  if (entropy_hex.size() % 2) return invalid_error("configure: bad entropy");
  for (size_t i = 0; i < entropy_hex.size(); i += 2) {
    char b[3] = {entropy_hex[i], entropy_hex[i + 1], 0};
    char* end = nullptr;
    long v = std::strtol(b, &end, 16);
    if (*end) return invalid_error("configure: bad entropy");
    c.entropy.push_back(static_cast<char>(v));
  }
  if (auto it = msg.find("unixTimeNs"); it != msg.end()) {
    if (!it->is_number_integer()) return invalid_error("configure: bad unixTimeNs");
    c.unix_time_ns = it->get<int64_t>();
  }
  if (auto it = msg.find("network"); it != msg.end()) {
    auto addr = [&](const char* k, uint32_t* out) {
      auto a = it->find(k);
      struct in_addr v {};
      if (a == it->end() || !a->is_string() || ::inet_pton(AF_INET, a->get_ref<const std::string&>().c_str(), &v) != 1)
        return false;
      *out = ntohl(v.s_addr);
      return true;
    };
    VmConfigure::Network n;
    auto prefix = it->is_object() ? it->find("prefix") : it->end();
    if (!it->is_object() || !addr("address", &n.address) || !addr("gateway", &n.gateway) || prefix == it->end() ||
        !prefix->is_number_integer() || prefix->get<int>() < 1 || prefix->get<int>() > 30)
      return invalid_error("configure: network wants {address, gateway, prefix 1..30}");
    n.prefix = prefix->get<int>();
    uint32_t mask = ~0u << (32 - n.prefix);
    if ((n.address & mask) != (n.gateway & mask) || n.address == n.gateway)
      return invalid_error("configure: the network's gateway is not a neighbour of its address");
    c.network = n;
  }
  if (auto it = msg.find("env"); it != msg.end()) {
    if (!it->is_object()) return invalid_error("configure: env must be an object");
    size_t total = 0;
    for (auto& [k, v] : it->items()) {
      if (!v.is_string() || k.empty() || k.find('=') != std::string::npos) return invalid_error("configure: bad env entry");
      total += k.size() + v.get_ref<const std::string&>().size() + 1;
      if (total > 64 * 1024) return invalid_error("configure: env larger than 64 KiB");
      c.env.push_back(k + "=" + v.get<std::string>());
    }
  }
  return c;
}

namespace {

// Puts a tty channel (the microVM's hvc0) in raw mode: 8-bit clean, no
// echo, no line editing, no signals, no flow-control characters.
Status make_raw(int fd) {
  if (!::isatty(fd)) return {};
  struct termios t {};
  if (::tcgetattr(fd, &t) != 0) return sys::errno_error("tcgetattr", "channel");
  ::cfmakeraw(&t);
  t.c_cc[VMIN] = 1;
  t.c_cc[VTIME] = 0;
  if (::tcsetattr(fd, TCSANOW, &t) != 0) return sys::errno_error("tcsetattr", "channel");
  return {};
}

// Applies the clock and entropy parts of "configure" (microVMs only: a
// clone resumes with the template's clock and RNG state).
void apply_vm_configure(const VmConfigure& c) {
  if (c.unix_time_ns > 0) {
    struct timespec ts {};
    ts.tv_sec = c.unix_time_ns / 1000000000;
    ts.tv_nsec = c.unix_time_ns % 1000000000;
    if (::clock_settime(CLOCK_REALTIME, &ts) != 0) LOG_WARN("agent: clock_settime: " << std::strerror(errno));
  }
  if (!c.entropy.empty()) {
    UniqueFd r(::open("/dev/urandom", O_WRONLY | O_CLOEXEC));
    if (r) {
      std::vector<uint8_t> buf(sizeof(struct rand_pool_info) + c.entropy.size());
      auto* info = reinterpret_cast<struct rand_pool_info*>(buf.data());
      info->entropy_count = static_cast<int>(c.entropy.size() * 8);
      info->buf_size = static_cast<int>(c.entropy.size());
      std::memcpy(buf.data() + sizeof(struct rand_pool_info), c.entropy.data(), c.entropy.size());
      if (::ioctl(r.get(), RNDADDENTROPY, info) != 0) LOG_WARN("agent: RNDADDENTROPY: " << std::strerror(errno));
      (void)::ioctl(r.get(), RNDRESEEDCRNG);
    }
  }
}

Status write_resolv_conf(const std::string& nameserver);

// eth0 of a microVM (virtio-net) as "configure" says: its old addresses
// (a clone's template or parent had its own) replaced by the new one, up,
// the default route through the gateway, which is the DNS server too.
Status apply_vm_network(const VmConfigure::Network& n) {
  Result<network::Rtnl> rt = network::Rtnl::open();
  if (!rt) return rt.error();
  Result<int> eth = rt->link_index("eth0");
  if (!eth) return eth.error().with_context("the microVM has no eth0 (virtio_net)");
  Result<std::vector<std::pair<uint32_t, int>>> old = rt->addresses4(*eth);
  if (!old) return old.error();
  bool have = false;
  for (auto [a, prefix] : *old) {
    if (a == n.address && prefix == n.prefix) {
      have = true;
      continue;
    }
    if (Status s = rt->delete_address4(*eth, htonl(a), prefix); !s) return s;
  }
  if (!have)
    if (Status s = rt->add_address4(*eth, htonl(n.address), n.prefix); !s) return s;
  if (Status s = rt->set_up(*eth); !s) return s;
  if (Status s = rt->add_default_route4(*eth, htonl(n.gateway), true); !s) return s;
  // ping without privileges (ICMP datagram sockets), as a process
  // sandbox's namespace has it (host_network.cpp, set_ping_group_range).
  if (Status s = sys::write_file("/proc/sys/net/ipv4/ping_group_range", "0 2147483647"); !s)
    LOG_WARN("agent: ping_group_range: " << s.error().message());
  struct in_addr g {};
  g.s_addr = htonl(n.gateway);
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &g, text, sizeof text);
  return write_resolv_conf(text);
}

// /etc/resolv.conf naming the host's DNS forwarder, replacing whatever the
// template had there (a file, or a symlink into a resolver the sandbox
// does not run).
Status write_resolv_conf(const std::string& nameserver) {
  const char* path = "/etc/resolv.conf";
  if (::unlink(path) != 0 && errno != ENOENT) return sys::errno_error("unlink", path);
  UniqueFd f(::open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!f) return sys::errno_error("create", path);
  std::string text = "# the sandbox's DNS server: sandgate's forwarder on the host\nnameserver " + nameserver +
                     "\noptions edns0\n";
  if (::write(f.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    return sys::errno_error("write", path);
  return Status::Ok();
}

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

}  // namespace

Result<UniqueFd> connect_loopback(uint16_t port, std::chrono::milliseconds timeout) {
  std::string what = "port " + std::to_string(port);
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s) return sys::errno_error("socket", what);
  // Relayed bytes arrive in pieces (request head, then body): no Nagle
  // delay between them.
  int one = 1;
  ::setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct sockaddr_in a;
  std::memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  // SAFETY: a is a fully initialised sockaddr_in and its size is passed.
  int r = ::connect(s.get(), reinterpret_cast<const struct sockaddr*>(&a), sizeof a);
  int err = r == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    struct pollfd p = {s.get(), POLLOUT, 0};
    int n;
    do n = ::poll(&p, 1, static_cast<int>(timeout.count()));
    while (n < 0 && errno == EINTR);
    if (n == 0) return Error(ErrorKind::kTimeout, "connect to " + what + " timed out");
    socklen_t len = sizeof err;
    if (n < 0 || ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  }
  if (err == ECONNREFUSED) return not_found_error("connection refused on " + what);
  if (err != 0) return sys::errno_error("connect", what, err);
  return s;
}

Result<UniqueFd> open_stream_target(std::string_view open_payload, std::chrono::milliseconds timeout) {
  json msg = json::parse(open_payload.begin(), open_payload.end(), nullptr, /*allow_exceptions=*/false);
  if (msg.is_discarded() || !msg.is_object()) return invalid_error("OPEN payload is not a JSON object");
  auto port = msg.find("port");
  if (port != msg.end()) {
    if (!port->is_number_integer() || port->get<int64_t>() < 1 || port->get<int64_t>() > 65535)
      return invalid_error("OPEN \"port\" must be an integer in 1..65535");
    return connect_loopback(static_cast<uint16_t>(port->get<int64_t>()), timeout);
  }
  if (msg.contains("service")) return not_found_error("the agent offers no services; open {\"port\":N}");
  return invalid_error("OPEN payload has neither \"port\" nor \"service\"");
}

namespace {

// Collects zombies from sig_fd's SIGCHLD on a thread of its own while the
// agent tears down (the Mux loop that did it is gone by then) and envd
// waits for the statuses of the processes it killed.
class TeardownReaper {
 public:
  TeardownReaper(Reaper& r, int sig_fd) : reaper_(r), sig_fd_(sig_fd), wake_(::eventfd(0, EFD_CLOEXEC)) {
    // Guarded: the sandbox may have used up its threads (a fork bomb under
    // the pids limit), and PID 1 must not die of it. Without this thread
    // envd's stop still ends, its pumps' waits for statuses time out.
    try {
      thread_ = std::thread([this] {
        for (;;) {
          reaper_.reap_all();
          struct pollfd p[2] = {{sig_fd_, POLLIN, 0}, {wake_.get(), POLLIN, 0}};
          if (::poll(p, 2, -1) < 0 && errno != EINTR) return;
          if (p[1].revents & POLLIN) return;
          struct signalfd_siginfo si;
          while (::read(sig_fd_, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
          }
        }
      });
    } catch (const std::system_error& e) {
      LOG_ERROR("agent: no thread to reap during teardown (" << e.what() << "); envd's stop waits for timeouts");
    }
  }
  ~TeardownReaper() {
    if (!thread_.joinable()) return;
    uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof one) < 0) LOG_ERROR("agent: eventfd write: " << std::strerror(errno));
    thread_.join();
  }

 private:
  Reaper& reaper_;
  int sig_fd_;
  UniqueFd wake_;
  std::thread thread_;
};

}  // namespace

namespace {

// The spare socketpair a later host re-attaches through
// (channel::kReattachFd): its other end is kept on that number, replacing
// what was there, and this end is returned.
Result<UniqueFd> make_reattach_pair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return sys::errno_error("socketpair", "re-attach channel");
  UniqueFd mine(sv[0]), theirs(sv[1]);
  if (mine.get() == channel::kReattachFd) {
    mine.reset(::fcntl(sv[0], F_DUPFD_CLOEXEC, channel::kReattachFd + 1));
    if (!mine) return sys::errno_error("fcntl F_DUPFD_CLOEXEC", "re-attach channel");
  }
  if (theirs.get() != channel::kReattachFd && ::dup3(theirs.get(), channel::kReattachFd, O_CLOEXEC) < 0)
    return sys::errno_error("dup3", "re-attach channel");
  if (theirs.get() == channel::kReattachFd) (void)theirs.release();
  return mine;
}

// Between hosts: zombies are reaped, SIGTERM ends the wait, and a host's
// hello on the spare pair makes it the channel (a fresh spare replaces
// it). Returns the channel, or an empty fd when the agent is to end.
UniqueFd wait_for_host(UniqueFd& spare, int sig_fd, Reaper& reaper) {
  constexpr int kHelloTimeoutMs = 5000;
  for (;;) {
    struct pollfd p[2] = {{spare.get(), POLLIN, 0}, {sig_fd, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      LOG_ERROR("agent: poll while waiting for a host: " << std::strerror(errno));
      return UniqueFd();
    }
    if (p[1].revents & POLLIN) {
      bool term = false;
      struct signalfd_siginfo si;
      while (::read(sig_fd, &si, sizeof si) == static_cast<ssize_t>(sizeof si))
        if (si.ssi_signo == SIGTERM) term = true;
      reaper.reap_all();
      if (term) {
        LOG_INFO("agent: SIGTERM while no host is attached, shutting down");
        return UniqueFd();
      }
    }
    if (!(p[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    char hello[sizeof channel::kReattachHello];
    size_t got = 0;
    uint64_t deadline = sys::monotonic_ns() + kHelloTimeoutMs * 1000000ull;
    while (got < sizeof hello) {
      uint64_t now = sys::monotonic_ns();
      if (now >= deadline) break;
      struct pollfd q = {spare.get(), POLLIN, 0};
      int r = ::poll(&q, 1, static_cast<int>((deadline - now) / 1000000 + 1));
      if (r < 0 && errno != EINTR) break;
      if (r <= 0) continue;
      ssize_t n = ::recv(spare.get(), hello + got, sizeof hello - got, MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    bool ok = got == sizeof hello && std::memcmp(hello, channel::kReattachHello, sizeof hello) == 0;
    Result<UniqueFd> fresh = make_reattach_pair();  // the old spare's other end goes with it
    if (!fresh) {
      LOG_ERROR("agent: " << fresh.error().message() << "; no host can re-attach after this one");
      if (ok) return std::move(spare);
      return UniqueFd();
    }
    UniqueFd old = std::move(spare);
    spare = std::move(*fresh);
    if (ok) return old;
    LOG_WARN("agent: a bad hello on the re-attach channel (" << got << " bytes); waiting for a host");
  }
}

}  // namespace

int run(const AgentConfig& cfg) {
  // A re-attaching agent (process sandboxes that outlive their host) keeps
  // the spare pair the next host comes through, made first: its fixed
  // number must not be a descriptor anything else opened.
  UniqueFd spare;
  if (cfg.reattach) {
    Result<UniqueFd> p = ::fcntl(channel::kReattachFd, F_GETFD) >= 0
                             ? Result<UniqueFd>(internal_error("descriptor " + std::to_string(channel::kReattachFd) +
                                                               " is in use at start"))
                             : make_reattach_pair();
    if (p) spare = std::move(*p);
    else LOG_ERROR("agent: re-attach: " << p.error().message() << "; the sandbox ends with its host");
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  sigaddset(&set, SIGTERM);
  if (::sigprocmask(SIG_BLOCK, &set, nullptr) != 0) {
    LOG_ERROR("agent: sigprocmask: " << std::strerror(errno));
    return 1;
  }
  // A stream's local end closing under a write is EPIPE, never a signal.
  ::signal(SIGPIPE, SIG_IGN);
  UniqueFd sigfd(::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!sigfd) {
    LOG_ERROR("agent: signalfd: " << std::strerror(errno));
    return 1;
  }
  if (::fcntl(cfg.channel_fd, F_SETFD, FD_CLOEXEC) != 0) {
    LOG_ERROR("agent: channel fd " << cfg.channel_fd << ": " << std::strerror(errno));
    return 1;
  }
  if (cfg.bring_up_loopback) {
    if (Status s = bring_up_loopback(); !s) LOG_WARN("agent: loopback: " << s.error().message());
  }
  if (cfg.vm)
    if (Status s = make_raw(cfg.channel_fd); !s) {
      LOG_ERROR("agent: " << s.error().message());
      return 1;
    }

  Reaper reaper;
  // envd: the E2B API inside the sandbox, reached by the host through a
  // channel stream to this port. Created after the signal mask is set, so
  // its threads block SIGCHLD/SIGTERM too (the signalfd gets them).
  std::unique_ptr<envd::Server> envd_server;
  auto start_envd = [&](std::string token, std::vector<std::string> env) {
    envd::EnvdConfig ec;
    ec.access_token = std::move(token);
    ec.default_env = std::move(env);
    ec.version = kEnvdVersion;
    envd_server = std::make_unique<envd::Server>(ec, reaper);
    if (Status s = envd_server->listen("127.0.0.1", kEnvdPort); !s)
      LOG_ERROR("agent: envd: " << s.error().message() << "; the sandbox runs without envd");
    else if (Status st = envd_server->start(); !st)
      LOG_ERROR("agent: envd: " << st.error().message() << "; the sandbox runs without envd");
  };
  if (!cfg.vm && ::getpid() == 1) {
    // The process backend's sandbox: harden it before anything else runs
    // in it (a microVM's kernel is the boundary there). Not run half-hardened.
    if (Status s = harden_sandbox(cfg.userns_fd); !s) {
      LOG_ERROR("agent: hardening the sandbox: " << s.error().message());
      return 1;
    }
  }
  if (!cfg.nameserver.empty()) {
    // After the user namespace is joined: the file is the sandbox root's.
    if (Status s = write_resolv_conf(cfg.nameserver); !s) LOG_WARN("agent: " << s.error().message());
  }
  if (!cfg.vm) start_envd(cfg.envd_access_token, cfg.child_env);

  // Whether the agent is to end (SIGTERM, the host's shutdown), as
  // opposed to its host being gone (channel EOF), after which a
  // re-attaching agent waits for the next host.
  bool stopping = false;
  auto serve_channel = [&](int channel_fd) -> Status {
    channel::MuxConfig mc;
    mc.channel_fd = channel_fd;
    mc.odd_ids = false;  // the host opens odd ids
    mc.max_control_out = kMaxOutputBuffer;
    channel::Mux* mux_ptr = nullptr;
    auto on_open = [](std::string_view payload) { return open_stream_target(payload, kConnectTimeout); };
    auto scan_procs = [&] {
      ProcessCounts pc;
      pc.processes = count_processes("/proc", ::getpid(), cfg.vm);
      RunnableCount rc = count_runnable("/proc", ::getpid(), cfg.vm);
      pc.runnable = rc.runnable;
      pc.truncated = rc.truncated;
      return pc;
    };
    auto on_control = [&](std::string_view payload) {
      ControlAction act = handle_control(payload, scan_procs, cfg.vm);
      if (!act.error.empty()) {
        mux_ptr->fail(act.error);
        return;
      }
      if (act.configure) {
        // The clock and entropy are a clone's, not a process sandbox's (the
        // host's clock; no CAP_SYS_TIME).
        if (cfg.vm) apply_vm_configure(*act.configure);
        if (cfg.vm && act.configure->network)
          if (Status s = apply_vm_network(*act.configure->network); !s) {
            (void)mux_ptr->send_control(
                json{{"type", "error"}, {"message", "configure network: " + s.error().message()}, {"request", "configure"}}.dump());
            return;
          }
        std::vector<std::string> env = cfg.child_env;
        env.insert(env.end(), act.configure->env.begin(), act.configure->env.end());
        // A second configure is a clone of a snapshot taken with envd running
        // (a template whose start command runs in its snapshot): the clone's
        // own token and environment replace the template's.
        if (envd_server)
          envd_server->reconfigure(act.configure->envd_access_token, std::move(env));
        else
          start_envd(act.configure->envd_access_token, std::move(env));
        act.reply = json{{"type", "configured"}}.dump();
      }
      if (!act.reply.empty()) (void)mux_ptr->send_control(std::move(act.reply));  // failure closes the channel
      if (act.shutdown) {
        LOG_INFO("agent: shutdown requested by the host");
        stopping = true;
        mux_ptr->stop();
      }
    };
    channel::Mux mux(mc, on_open, on_control);
    mux_ptr = &mux;
    mux.watch_fd(sigfd.get(), [&] {
      for (;;) {
        struct signalfd_siginfo si;
        if (::read(sigfd.get(), &si, sizeof si) != static_cast<ssize_t>(sizeof si)) break;
        if (si.ssi_signo == SIGTERM) {
          LOG_INFO("agent: SIGTERM, shutting down");
          stopping = true;
          mux.stop();
        }
      }
      // PID 1 duty: collect every zombie, ours or reparented to us.
      reaper.reap_all();
    });
    // The model API proxy: sandbox connections to 127.0.0.1:49982 become
    // {"service":"llm"} streams to the host. Listening before "configure" is
    // fine in a microVM: loopback is up and the host's opener needs no token.
    // The egress proxy the same way, at 127.0.0.1:49984. Both belong to
    // this channel: between hosts nothing listens there.
    std::optional<ServiceForwarder> llm, egress;
    auto forward = [&](std::optional<ServiceForwarder>& f, std::string_view service, uint16_t port, const char* what) {
      if (port == 0) return;
      f.emplace(mux, std::string(service), kMaxServiceStreams);
      if (Status ls = f->listen(port); !ls) {
        LOG_WARN("agent: " << what << ": " << ls.error().message() << "; the sandbox runs without it");
        f.reset();
      } else {
        ServiceForwarder* fp = &*f;
        mux.watch_fd(fp->fd(), [fp] { fp->on_readable(); });
      }
    };
    forward(llm, channel::kServiceLlm, cfg.model_proxy_port, "model API proxy");
    forward(egress, channel::kServiceEgress, cfg.egress_proxy_port, "egress proxy");
    if (Status s = mux.send_control(ready_message(::getpid())); !s) return s;
    return mux.run();
  };

  UniqueFd channel(cfg.channel_fd);
  for (;;) {
    Status s = serve_channel(channel.get());
    // A host that died mid-frame is gone as one that closed cleanly; a
    // host that sent something malformed is answered by shutting down.
    if (!s && (s.error().kind() != ErrorKind::kUnavailable || stopping || !spare)) {
      LOG_ERROR("agent: channel: " << s.error().message() << "; shutting down");
      break;
    }
    if (stopping || !spare) {
      LOG_INFO("agent: channel closed or shutdown requested; shutting down");
      break;
    }
    LOG_INFO("agent: the host is gone; the sandbox runs on and waits for the next one");
    channel.reset();
    channel = wait_for_host(spare, sigfd.get(), reaper);
    if (!channel) break;
    LOG_INFO("agent: a host re-attached");
  }
  channel.reset();
  spare.reset();
  // Nothing may outlive init: kill every other process in the namespace and
  // reap them, so the host sees init exit only once the sandbox is empty.
  ::kill(-1, SIGKILL);
  {
    // envd waits for the statuses of the processes it started, which
    // only a reaper can deliver now that the Mux loop is gone.
    TeardownReaper teardown(reaper, sigfd.get());
    if (envd_server) envd_server->stop();
  }
  while (::waitpid(-1, nullptr, 0) > 0 || errno == EINTR) {
  }
  return 0;
}

}  // namespace sg::agent
