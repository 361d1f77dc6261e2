// What a create asks of the lifecycle core: the parsed form of E2B's
// create body (api-e2b/requests.h parses it) and of a network update.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "sandbox-runtime/network/egress_policy.h"

namespace sg::lifecycle {

// A sandbox's egress as the client gave it (E2B's `network.allowOut` /
// `denyOut` and `allow_internet_access`), parsed into the policy; the
// lists are kept as given for GET /sandboxes/{id}.
struct NetworkParams {
  std::optional<bool> allow_internet;
  std::vector<std::string> allow_out, deny_out;
  network::EgressPolicy egress;
  bool asks_egress = false;  // a non-empty allowOut: a server without egress refuses it
};

struct CreateParams {
  std::string template_ref;
  int64_t timeout_s = 300;
  std::map<std::string, std::string> metadata;
  std::map<std::string, std::string> env_vars;
  bool on_timeout_pause = false;  // autoPause
  // autoPauseMemory false: the timeout's pause keeps the files only (a
  // filesystem-only pause where the runtime can copy them out).
  bool on_timeout_pause_files = false;
  // autoResume {enabled}: whether traffic to the sandbox while it is
  // paused resumes it. Omitted: yes (sandgate's transparent resume).
  bool auto_resume = true;
  // network.allowPublicTraffic: false gives the sandbox a traffic access
  // token that its user ports require.
  bool public_traffic = true;
  NetworkParams network;  // allow_internet_access and network.allowOut / denyOut
};

}  // namespace sg::lifecycle
