// Agent pieces that need no sandbox: config parsing and environment
// scrubbing, control message handling, process counting on a fake /proc,
// OPEN targets against a listener on 127.0.0.1.
// The event loop itself is tested through a real sandbox in
// process_runtime_test.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "agent/agent.h"
#include "sys/sys.h"

using namespace sg;
using nlohmann::json;

TEST_CASE("agent: parse_config takes SANDGATE_* vars and scrubs them") {
  std::string e1 = "HOME=/root", e2 = "SANDGATE_ENVD_TOKEN=secret-token", e3 = "PATH=/bin",
              e4 = "SANDGATE_SANDBOX_ID=abc";
  char* envp[] = {e1.data(), e2.data(), e3.data(), e4.data(), nullptr};
  std::string a0 = "sandgate-agent", a1 = "--channel-fd", a2 = "7";
  char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
  auto cfg = agent::parse_config(3, argv, envp);
  REQUIRE(cfg);
  CHECK(cfg->channel_fd == 7);
  CHECK(cfg->envd_access_token == "secret-token");
  CHECK(cfg->sandbox_id == "abc");
  CHECK(cfg->child_env == std::vector<std::string>{"HOME=/root", "PATH=/bin"});
  // The original bytes are wiped and the entries dropped from envp.
  CHECK(std::memchr(e2.data(), 's', e2.size()) == nullptr);
  CHECK(std::string(envp[0]) == "HOME=/root");
  CHECK(std::string(envp[1]) == "PATH=/bin");
  CHECK(envp[2] == nullptr);
}

TEST_CASE("agent: parse_config rejects unknown arguments") {
  std::string a0 = "sandgate-agent", a1 = "--bogus";
  char* argv[] = {a0.data(), a1.data(), nullptr};
  CHECK_FALSE(agent::parse_config(2, argv, nullptr));
}

TEST_CASE("agent: ping, status, shutdown, unknown and malformed control messages") {
  auto procs = [] { return size_t{4}; };
  auto r = agent::handle_control(R"({"type":"ping","id":42})", procs);
  CHECK(r.error.empty());
  CHECK(json::parse(r.reply) == json{{"type", "pong"}, {"id", 42}});
  r = agent::handle_control(R"({"type":"status"})", procs);
  CHECK(json::parse(r.reply) == json{{"type", "status"}, {"processes", 4}});
  r = agent::handle_control(R"({"type":"shutdown"})", procs);
  CHECK(r.shutdown);
  CHECK(r.reply.empty());
  r = agent::handle_control(R"({"type":"later-feature"})", procs);
  CHECK(r.error.empty());
  CHECK(json::parse(r.reply)["type"] == "error");
  for (const char* bad : {"", "not json", "[1,2]", R"({"id":1})", R"({"type":5})", "{\"type\":\"ping\""}) {
    CAPTURE(bad);
    CHECK_FALSE(agent::handle_control(bad, procs).error.empty());
  }
}

TEST_CASE("agent: ready message") {
  json j = json::parse(agent::ready_message(1));
  CHECK(j == json{{"type", "ready"}, {"agent", "sandgate-agent"}, {"envdVersion", "0.6.13"}, {"pid", 1}});
}

TEST_CASE("agent: count_processes counts numeric entries except itself") {
  std::string dir = "/tmp/sgtest-proc-" + sys::random_hex(6);
  REQUIRE(sys::make_dirs(dir));
  for (const char* n : {"1", "7", "123", "self", "sys", "12a"}) REQUIRE(sys::make_dirs(dir + "/" + n));
  REQUIRE(sys::write_file(dir + "/99", ""));  // a file, as /proc never has, still counted by name
  CHECK(agent::count_processes(dir, 1) == 3);
  CHECK(agent::count_processes(dir, 5) == 4);
  CHECK(agent::count_processes(dir + "/missing", 1) == 0);
  REQUIRE(sys::remove_tree(dir));
}

TEST_CASE("agent: OPEN targets: {\"port\":N} connects to loopback, refusals carry the RESET reason") {
  UniqueFd l(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(l);
  struct sockaddr_in a {};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(l.get(), 4) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(l.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0);
  int port = ntohs(a.sin_port);
  auto ms = std::chrono::milliseconds(2000);
  auto c = agent::open_stream_target("{\"port\":" + std::to_string(port) + "}", ms);
  REQUIRE_MESSAGE(c, (c ? "" : c.error().message()));
  UniqueFd accepted(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
  CHECK(accepted);
  // Closing the listener frees the port: nothing listens there now.
  l.reset();
  auto r = agent::open_stream_target("{\"port\":" + std::to_string(port) + "}", ms);
  REQUIRE_FALSE(r);
  CHECK(r.error().message() == "connection refused on port " + std::to_string(port));
  for (const char* bad : {"", "[]", "{}", R"({"port":0})", R"({"port":70000})", R"({"port":"80"})"}) {
    CAPTURE(bad);
    auto b = agent::open_stream_target(bad, ms);
    REQUIRE_FALSE(b);
    CHECK(b.error().kind() == ErrorKind::kInvalid);
  }
  auto svc = agent::open_stream_target(R"({"service":"x"})", ms);
  REQUIRE_FALSE(svc);
  CHECK(svc.error().kind() == ErrorKind::kNotFound);
}
