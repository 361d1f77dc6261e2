// EtcdCluster: real etcd members (Debian's etcd-server, installed by
// scripts/install-deps.sh) started by a test on free loopback ports in a
// temp dir, killed and removed at the end. Ready once every member answers
// a read (a leader is elected).
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "base/blocking_http.h"
#include "base/sys.h"
#include "tests/support/eventually.h"

extern char** environ;

namespace sg::test {

// A port nothing listens on now (bound and released; the kernel does not
// hand it out again at once).
inline uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

class EtcdCluster {
 public:
  // Starts `members` members with data under dir; ok() says whether they
  // came up.
  EtcdCluster(const std::string& dir, int members) {
    std::string initial;
    for (int i = 0; i < members; ++i) {
      Member m;
      m.name = "m" + std::to_string(i);
      m.client = free_port();
      m.peer = free_port();
      members_.push_back(m);
      initial += (i ? "," : "") + m.name + "=http://127.0.0.1:" + std::to_string(m.peer);
    }
    for (Member& m : members_) {
      std::string c = "http://127.0.0.1:" + std::to_string(m.client);
      std::string p = "http://127.0.0.1:" + std::to_string(m.peer);
      std::vector<std::string> argv = {"etcd", "--name", m.name, "--data-dir", dir + "/" + m.name,
                                       "--listen-client-urls", c, "--advertise-client-urls", c,
                                       "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                                       "--initial-cluster", initial, "--initial-cluster-state", "new",
                                       "--initial-cluster-token", "sandgate-test", "--logger", "zap", "--log-outputs",
                                       dir + "/" + m.name + ".log", "--heartbeat-interval", "50",
                                       "--election-timeout", "500"};
      m.pid = spawn(argv);
    }
    ok_ = eventually([&] {
      for (const Member& m : members_)
        if (m.pid > 0 && !answers(m.client)) return false;
      return true;
    }, 30);
  }
  ~EtcdCluster() {
    for (Member& m : members_) kill(m);
  }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  bool ok() const { return ok_; }
  std::vector<net::Endpoint> endpoints() const {
    std::vector<net::Endpoint> out;
    for (const Member& m : members_) out.push_back(net::Endpoint{"127.0.0.1", m.client});
    return out;
  }
  std::string url() const {
    std::string u = "etcd://";
    for (size_t i = 0; i < members_.size(); ++i) u += (i ? "," : "") + endpoints()[i].str();
    return u;
  }
  // SIGKILLs member i (a member lost, not a clean stop).
  void kill_member(size_t i) { kill(members_[i]); }

 private:
  struct Member {
    std::string name;
    uint16_t client = 0, peer = 0;
    pid_t pid = -1;
  };

  static pid_t spawn(const std::vector<std::string>& args) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
    return pid;
  }
  static void kill(Member& m) {
    if (m.pid <= 0) return;
    ::kill(m.pid, SIGKILL);
    ::waitpid(m.pid, nullptr, 0);
    m.pid = -1;
  }
  static bool answers(uint16_t port) {
    net::Request r;
    r.method = "POST";
    r.target = "/v3/kv/range";
    r.body = R"({"key":"AA=="})";
    Result<net::Response> res = net::request(net::Endpoint{"127.0.0.1", port}, r, std::chrono::milliseconds(500));
    return res && res->status == 200;
  }

  std::vector<Member> members_;
  bool ok_ = false;
};

}  // namespace sg::test
