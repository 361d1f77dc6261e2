// What the KVM tests and the microVM benchmark do inside and around a
// microVM: talk to its envd over the channel (run a script, read its
// exit), and give sandboxes networks of their own on TAP devices. No
// doctest here: the benchmark uses it too.
#pragma once

#include <arpa/inet.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "base/sys.h"
#include "sandbox-runtime/network/rtnl.h"
#include "sandbox-runtime/runtime.h"

namespace sg::testing {

// Sends req to envd inside the sandbox over a channel stream and returns
// everything until EOF (Connection: close), each read bounded by
// timeout_ms; "" when the stream cannot be opened or written.
inline std::string envd_exchange(runtime::Sandbox& sb, const std::string& req, int timeout_ms) {
  auto fd = sb.open_port(49983);
  if (!fd) return "";
  if (::write(fd->get(), req.data(), req.size()) != static_cast<ssize_t>(req.size())) return "";
  std::string out;
  char buf[4096];
  for (;;) {
    struct pollfd p = {fd->get(), POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) break;
    ssize_t n = ::read(fd->get(), buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Runs a bash script inside the sandbox through envd (process.Process/Start,
// Connect streaming JSON) and returns the whole response, which ends when
// the script has exited; its end event says how.
// As root with as_root ("Authorization: Basic root:"), else envd's default
// user; each read bounded by timeout_ms.
inline std::string envd_run(runtime::Sandbox& sb, const std::string& script, bool as_root = false,
                            int timeout_ms = 180000, const std::string& token = "tok") {
  std::string msg = nlohmann::json{{"process", {{"cmd", "/bin/bash"}, {"args", {"-c", script}}}}}.dump();
  std::string body(5, '\0');
  for (int i = 0; i < 4; ++i) body[1 + i] = static_cast<char>((msg.size() >> (8 * (3 - i))) & 0xff);
  body += msg;
  std::string req = "POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    "Connect-Protocol-Version: 1\r\nContent-Type: application/connect+json\r\n" +
                    std::string(as_root ? "Authorization: Basic cm9vdDo=\r\n" : "") + "X-Access-Token: " + token +
                    "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  return envd_exchange(sb, req, timeout_ms);
}

// (Protobuf JSON leaves out a zero exitCode; the status text is always there.)
inline bool exited_with(const std::string& resp, int code) {
  return resp.find("\"status\":\"exit status " + std::to_string(code) + "\"") != std::string::npos;
}

// A SandboxNetworks for microVMs without HostNetwork: each sandbox a /30
// of 10.250.0.0/24 and a TAP made as HostNetwork::attach_tap makes one
// (host MAC, gateway address, up), no nftables. The policy on such links
// is HostNetwork's and is tested on the real kernel without KVM
// (host_network_tap_test); with these the wire is what is tested:
// virtio-net in sandgate-vmm, the guest's driver, the agent's configure.
class TestTaps final : public runtime::SandboxNetworks {
 public:
  static std::string address(uint32_t slot, uint32_t host) { return "10.250.0." + std::to_string(4 * slot + host); }

  Result<Link> reserve(const std::string& id) override {
    std::lock_guard lock(mu_);
    uint32_t k = next_++ % 64;
    slots_[id] = k;
    return Link{address(k, 2), address(k, 1)};
  }
  Result<UniqueFd> attach_tap(const std::string& id) override {
    uint32_t k;
    {
      std::lock_guard lock(mu_);
      k = slots_.at(id);
    }
    const std::string name = "sgkt" + std::to_string(k);
    Result<UniqueFd> tap = network::open_tap(name);
    if (!tap) return tap.error();
    Result<network::Rtnl> rt = network::Rtnl::open();
    if (!rt) return rt.error();
    Result<int> idx = rt->link_index(name);
    if (!idx) return idx.error();
    const uint8_t mac[6] = {0x02, 0x53, 0x47, 0xff, 0xff, 0xfe};
    if (Status s = rt->set_mac(*idx, mac); !s) return s.error();
    if (Status s = rt->add_address4(*idx, htonl((10u << 24) | (250u << 16) | (4 * k + 1)), 30); !s) return s.error();
    if (Status s = rt->set_up(*idx); !s) return s.error();
    return std::move(*tap);
  }
  Status attach(const std::string&, int) override { return internal_error("microVMs only"); }
  Status adopt(const std::string&, int) override { return not_found_error("microVMs only"); }
  Status adopt_tap(const std::string&, const std::string&) override { return not_found_error("no restarts here"); }
  void release(const std::string& id) override {
    std::lock_guard lock(mu_);
    auto it = slots_.find(id);
    if (it == slots_.end()) return;
    if (Result<network::Rtnl> rt = network::Rtnl::open(); rt) (void)rt->delete_link("sgkt" + std::to_string(it->second));
    slots_.erase(it);
    ++released_;
  }
  int released() {
    std::lock_guard lock(mu_);
    return released_;
  }

 private:
  std::mutex mu_;
  uint32_t next_ = 0;
  std::map<std::string, uint32_t> slots_;
  int released_ = 0;
};

}  // namespace sg::testing
