// The egress proxy (docs/egress.md): sandboxes' only way out. A sandbox
// process connects to 127.0.0.1:49984 inside (HTTP_PROXY/HTTPS_PROXY point
// there), the agent forwards the connection over the channel
// ({"service":"egress"}), and here it is one HTTP proxy request:
//   CONNECT host:port HTTP/1.1        a tunnel (HTTPS and anything else)
//   GET http://host[:port]/path ...   one plain HTTP request, forwarded
// The destination is resolved here and every address is checked against
// the sandbox's policy (api-e2b/egress_policy.h) before a connection is
// made, so the policy holds on the host whatever the sandbox runs; a
// refusal is a 403 whose body says why.
//
// The sandbox is hostile: the request head is bounded (16 KiB) and must
// arrive within head_timeout, connects time out, a tunnel idle for
// idle_timeout is closed, and connections are bounded per sandbox and in
// all (more are answered 429 and closed). One thread per connection: each
// is mostly waiting in poll.
//
// Thread safety: adopt() from any thread; the destructor closes every
// connection and joins their threads.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "sandbox-runtime/network/egress_policies.h"
#include "sandbox-runtime/network/egress_policy.h"
#include "base/fd.h"
#include "base/status.h"

namespace sg::gateway {

struct EgressConfig {
  bool allow_internal = false;  // --egress-allow-private: the host's internal networks too
  size_t max_per_sandbox = 64;
  size_t max_total = 1024;
  std::chrono::milliseconds head_timeout{30000};
  std::chrono::milliseconds connect_timeout{10000};
  std::chrono::milliseconds idle_timeout{600000};
};

struct EgressStats {
  uint64_t connections = 0;  // adopted
  uint64_t allowed = 0;      // reached their destination
  uint64_t denied = 0;       // refused by a policy (403)
  uint64_t failed = 0;       // bad requests, unresolvable or unreachable destinations
  uint64_t refused = 0;      // over the connection limits (429)
  uint64_t bytes_out = 0, bytes_in = 0;  // sandbox -> destination, back
};

class EgressProxy final : public network::EgressPolicies::Listener {
 public:
  // Names to addresses (getaddrinfo by default; tests give their own).
  using Resolver = std::function<Result<std::vector<std::array<uint8_t, 16>>>(const std::string& host)>;

  // policies: each sandbox's policy (no entry: it may not get out), which
  // must outlive the proxy; the proxy listens to it from here to its
  // destructor, rechecking a sandbox's open connections when it changes.
  EgressProxy(EgressConfig cfg, network::EgressPolicies& policies, Resolver resolve = {});
  ~EgressProxy() override;
  EgressProxy(const EgressProxy&) = delete;
  EgressProxy& operator=(const EgressProxy&) = delete;

  // Serves one connection from a sandbox on a thread of its own.
  void adopt(UniqueFd conn, const std::string& sandbox_id);
  // The sandbox's policy changed: its open connections are decided again
  // by the current one, and those it refuses (all of them, if it has none
  // now) are closed; connections still reading their head are decided
  // when it is in.
  void recheck(const std::string& sandbox_id);
  void policy_changed(const std::string& sandbox_id) override { recheck(sandbox_id); }
  EgressStats stats();

 private:
  void serve(int fd, const std::string& sandbox_id);

  EgressConfig cfg_;
  network::EgressPolicies& policies_;
  Resolver resolve_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;                    // GUARDED_BY(mu_)
  std::map<std::string, size_t> per_sandbox_;  // GUARDED_BY(mu_)
  struct Open {
    std::string sandbox_id;
    // Its destination is known (the host, the address being tried):
    // recheck decides it.
    bool decided = false;
    std::string host;
    std::array<uint8_t, 16> addr{};
  };
  std::map<int, Open> open_;                 // GUARDED_BY(mu_): client fds being served
  size_t threads_ = 0;                       // GUARDED_BY(mu_)
  EgressStats stats_;                        // GUARDED_BY(mu_)
};

}  // namespace sg::gateway
