// control_type(): the "type" of a control message (docs/channel.md), or ""
// when it has none or it is not a string. Every reader of control messages
// uses it: json::value() would throw on a non-string "type", and the bytes
// come from the other end of the channel.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace sg::channel {

// The envd API version the agent serves (its "ready" frame reports it, the
// control plane hands it to clients as envdVersion).
inline constexpr const char* kEnvdVersion = "0.6.13";

// Re-attaching a host to a process sandbox whose previous host is gone
// (docs/channel.md, "Re-attach"): the agent keeps one end of a spare
// socketpair on this descriptor number for its whole life. A new host
// takes a copy with pidfd_getfd (which needs ptrace rights over the agent:
// the host's root, never a sandbox process), writes kReattachHello on it,
// and the agent then serves the channel on the pair and sends "ready"
// again, keeping a fresh spare here for the next time.
inline constexpr int kReattachFd = 9;
inline constexpr char kReattachHello[8] = {'S', 'G', 'A', 'T', 'T', 'A', 'C', 'H'};

inline std::string control_type(const nlohmann::json& msg) {
  if (!msg.is_object()) return {};
  auto it = msg.find("type");
  return it != msg.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace sg::channel
