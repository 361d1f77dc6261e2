// The agent's microVM mode: the "configure" message (parsed once, bounded,
// understood only with --vm) and the process count that leaves out the
// guest kernel's threads.
#include <doctest/doctest.h>

#include <string>

#include "sandbox-runtime/agent/agent.h"
#include "base/sys.h"
#include "tests/support/temp_dir.h"

using namespace sg;

namespace {
auto no_procs = [] { return agent::ProcessCounts{}; };
}

TEST_CASE("configure carries its fields, in both modes") {
  std::string msg =
      R"({"type":"configure","sandboxId":"abc","envdAccessToken":"tok","env":{"A":"1","B":"two"},"unixTimeNs":1796000000000000000,"entropy":"00ff10"})";
  auto a = agent::handle_control(msg, no_procs, /*vm=*/true);
  REQUIRE(a.configure);
  CHECK(a.reply.empty());
  CHECK(a.error.empty());
  CHECK(a.configure->sandbox_id == "abc");
  CHECK(a.configure->envd_access_token == "tok");
  CHECK(a.configure->env == std::vector<std::string>{"A=1", "B=two"});
  CHECK(a.configure->unix_time_ns == 1796000000000000000);
  CHECK(a.configure->entropy == std::string("\x00\xff\x10", 3));
  // The process backend's agent takes it too (it re-keys envd there; the
  // clock and entropy are applied in vm mode only, by the caller).
  auto p = agent::handle_control(msg, no_procs, /*vm=*/false);
  REQUIRE(p.configure);
  CHECK(p.configure->envd_access_token == "tok");
  CHECK(p.reply.empty());
}

TEST_CASE("a malformed configure gets an error reply and changes nothing") {
  std::string big(70 * 1024, 'x');
  for (std::string bad : {
           std::string(R"({"type":"configure","entropy":"abc"})"),                // odd length
           std::string(R"({"type":"configure","entropy":"zz"})"),                 // not hex
           std::string(R"({"type":"configure","env":[1]})"),                      // not an object
           std::string(R"({"type":"configure","env":{"A":1}})"),                  // value not a string
           std::string(R"({"type":"configure","env":{"A=B":"1"}})"),              // '=' in a name
           std::string(R"({"type":"configure","env":{"A":")") + big + "\"}}",     // over 64 KiB
           std::string(R"({"type":"configure","unixTimeNs":"now"})"),
           std::string(R"({"type":"configure","sandboxId":7})"),
           std::string(R"({"type":"configure","network":"10.0.0.2"})"),
           std::string(R"({"type":"configure","network":{"address":"10.0.0.2","gateway":"10.0.0.1"}})"),  // no prefix
           std::string(R"({"type":"configure","network":{"address":"10.0.0.2","gateway":"10.0.0.1","prefix":31}})"),
           std::string(R"({"type":"configure","network":{"address":"10.0.0.2","gateway":"10.0.0.9","prefix":30}})"),  // not a neighbour
           std::string(R"({"type":"configure","network":{"address":"10.0.0.2","gateway":"10.0.0.2","prefix":30}})"),
           std::string(R"({"type":"configure","network":{"address":"10.0.0.2x","gateway":"10.0.0.1","prefix":30}})"),
           std::string(R"({"type":"configure","network":{"address":"::1","gateway":"10.0.0.1","prefix":30}})"),
       }) {
    auto a = agent::handle_control(bad, no_procs, true);
    CAPTURE(bad.substr(0, 80));
    CHECK_FALSE(a.configure);
    CHECK(a.error.empty());  // a bad configure is not a framing error
    CHECK(a.reply.find("\"error\"") != std::string::npos);
    CHECK(a.reply.find("\"configure\"") != std::string::npos);
  }
  CHECK_FALSE(agent::parse_vm_configure("[]"));
  CHECK(agent::parse_vm_configure(R"({"type":"configure"})"));  // every field optional
}

TEST_CASE("configure's network: eth0's address, gateway and prefix, checked") {
  auto c = agent::parse_vm_configure(
      R"({"type":"configure","network":{"address":"10.192.0.6","gateway":"10.192.0.5","prefix":30}})");
  REQUIRE(c);
  REQUIRE(c->network);
  CHECK(c->network->address == 0x0ac00006u);
  CHECK(c->network->gateway == 0x0ac00005u);
  CHECK(c->network->prefix == 30);
  auto none = agent::parse_vm_configure(R"({"type":"configure"})");
  REQUIRE(none);
  CHECK_FALSE(none->network);  // eth0 left as it is
}

TEST_CASE("count_processes can leave out kernel threads (kthreadd and its children)") {
  test::TempDir dir;
  auto proc = [&](const std::string& pid, const std::string& stat) {
    REQUIRE(sys::make_dirs(dir.path() + "/" + pid));
    REQUIRE(sys::write_file(dir.path() + "/" + pid + "/stat", stat));
  };
  proc("1", "1 (sandgate-agent) S 0 1 1 0 -1");
  proc("2", "2 (kthreadd) S 0 0 0 0 -1");
  proc("3", "3 (kworker/0:0-events) I 2 0 0 0 -1");
  proc("40", "40 (bash) S 1 40 40 0 -1");
  proc("41", "41 (a (b) c) S 40 40 40 0 -1");  // parentheses in comm
  REQUIRE(sys::make_dirs(dir.path() + "/self"));  // not a pid
  CHECK(agent::count_processes(dir.path(), 1, false) == 4);
  CHECK(agent::count_processes(dir.path(), 1, true) == 2);
}
