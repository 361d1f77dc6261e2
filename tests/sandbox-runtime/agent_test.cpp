// Agent pieces that need no sandbox: config parsing and environment
// scrubbing, control message handling, process and runnable counting on a
// fake /proc, OPEN targets against a listener on 127.0.0.1.
// The event loop itself is tested through a real sandbox in
// process_runtime_test.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "sandbox-runtime/agent/agent.h"
#include "tests/support/temp_dir.h"
#include "base/sys.h"

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

TEST_CASE("agent: SANDGATE_USERNS_FD names the user namespace to join; a malformed one is refused") {
  std::string a0 = "sandgate-agent";
  char* argv[] = {a0.data(), nullptr};
  std::string ok = "SANDGATE_USERNS_FD=5";
  char* envp[] = {ok.data(), nullptr};
  auto cfg = agent::parse_config(1, argv, envp);
  REQUIRE(cfg);
  CHECK(cfg->userns_fd == 5);
  std::string none = "HOME=/root";
  char* envp_none[] = {none.data(), nullptr};
  CHECK(agent::parse_config(1, argv, envp_none)->userns_fd == -1);
  for (std::string bad : {"SANDGATE_USERNS_FD=", "SANDGATE_USERNS_FD=-1", "SANDGATE_USERNS_FD=5x",
                          "SANDGATE_USERNS_FD=99999"}) {
    CAPTURE(bad);
    char* envp_bad[] = {bad.data(), nullptr};
    auto r = agent::parse_config(1, argv, envp_bad);
    REQUIRE_FALSE(r);
    CHECK(r.error().message().find("SANDGATE_USERNS_FD") != std::string::npos);
  }
}

TEST_CASE("agent: parse_config rejects unknown arguments") {
  std::string a0 = "sandgate-agent", a1 = "--bogus";
  char* argv[] = {a0.data(), a1.data(), nullptr};
  CHECK_FALSE(agent::parse_config(2, argv, nullptr));
  // An empty number is not 0.
  std::string b1 = "--channel-fd", b2 = "";
  char* argv2[] = {a0.data(), b1.data(), b2.data(), nullptr};
  CHECK_FALSE(agent::parse_config(3, argv2, nullptr));
}

TEST_CASE("agent: --model-proxy-port sets or disables the model API proxy listener") {
  auto parse = [](std::vector<std::string> args) {
    args.insert(args.begin(), "sandgate-agent");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    return agent::parse_config(static_cast<int>(args.size()), argv.data(), nullptr);
  };
  auto def = parse({});
  REQUIRE(def);
  CHECK(def->model_proxy_port == 49982);
  auto off = parse({"--model-proxy-port", "0"});
  REQUIRE(off);
  CHECK(off->model_proxy_port == 0);
  auto other = parse({"--vm", "--model-proxy-port", "8080"});
  REQUIRE(other);
  CHECK(other->model_proxy_port == 8080);
  CHECK(other->vm);
  for (std::string bad : {"65536", "-1", "80x", ""}) {
    CAPTURE(bad);
    CHECK_FALSE(parse({"--model-proxy-port", bad}));
  }
  CHECK_FALSE(parse({"--model-proxy-port"}));  // missing value
}

TEST_CASE("agent: ping, status, shutdown, unknown and malformed control messages") {
  auto procs = [] { return agent::ProcessCounts{4, 1, false}; };
  auto r = agent::handle_control(R"({"type":"ping","id":42})", procs);
  CHECK(r.error.empty());
  CHECK(json::parse(r.reply) == json{{"type", "pong"}, {"id", 42}});
  r = agent::handle_control(R"({"type":"status"})", procs);
  CHECK(json::parse(r.reply) == json{{"type", "status"}, {"processes", 4}, {"runnable", 1}});
  // "truncated" appears only when the runnable scan hit a bound.
  r = agent::handle_control(R"({"type":"status"})", [] { return agent::ProcessCounts{5000, 0, true}; });
  CHECK(json::parse(r.reply) == json{{"type", "status"}, {"processes", 5000}, {"runnable", 0}, {"truncated", true}});
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

namespace {

// A fake procfs: PID/stat plus PID/task/TID/stat for each thread.
struct FakeProc {
  test::TempDir dir;
  void thread(int pid, int tid, const std::string& comm, const std::string& rest) {
    std::string t = dir.path() + "/" + std::to_string(pid) + "/task/" + std::to_string(tid);
    REQUIRE(sys::make_dirs(t));
    REQUIRE(sys::write_file(t + "/stat", std::to_string(tid) + " (" + comm + ") " + rest));
    if (pid == tid)
      REQUIRE(sys::write_file(dir.path() + "/" + std::to_string(pid) + "/stat",
                              std::to_string(pid) + " (" + comm + ") " + rest));
  }
  // A single-threaded process in state st with parent ppid.
  void process(int pid, const std::string& comm, char st, int ppid = 1) {
    thread(pid, pid, comm, std::string(1, st) + " " + std::to_string(ppid) + " 1 1 0 -1 4194304 0 0");
  }
  void raw_thread_stat(int pid, const std::string& content) {
    std::string t = dir.path() + "/" + std::to_string(pid) + "/task/" + std::to_string(pid);
    REQUIRE(sys::make_dirs(t));
    REQUIRE(sys::write_file(t + "/stat", content));
    REQUIRE(sys::write_file(dir.path() + "/" + std::to_string(pid) + "/stat", content));
  }
};

}  // namespace

TEST_CASE("agent: count_runnable counts processes with an R or D thread") {
  FakeProc p;
  p.process(1, "sandgate-agent", 'R', 0);  // the agent itself: never counted
  p.process(10, "python3", 'R');
  p.process(11, "dd", 'D');
  p.process(12, "bash", 'S');
  p.process(13, "defunct", 'Z');
  p.process(17, "stopped", 'T');
  p.process(18, "idle", 'I');
  // Multi-threaded: main thread asleep, one worker runnable; counted once.
  p.thread(14, 14, "node", "S 1 14 14 0 -1");
  p.thread(14, 15, "node-worker", "S 1 14 14 0 -1");
  p.thread(14, 16, "node-worker", "R 1 14 14 0 -1");
  p.thread(14, 19, "node-worker", "D 1 14 14 0 -1");
  // comm with spaces and parentheses that look like a state: the state is after the last ')'.
  p.thread(20, 20, "x) R (y", "S 1 20 20 0 -1");
  p.thread(21, 21, "a (b) c", "R 1 21 21 0 -1");
  // Malformed stat files count as not runnable.
  p.raw_thread_stat(30, "");
  p.raw_thread_stat(31, "31 (no closing paren R 1");
  p.raw_thread_stat(32, "32 (trunc)");
  p.raw_thread_stat(33, "33 (nospace)R 1");
  // A process directory without task/ (it exited mid-scan, or an old
  // procfs): its PID/stat decides.
  REQUIRE(sys::make_dirs(p.dir.path() + "/40"));
  REQUIRE(sys::write_file(p.dir.path() + "/40/stat", "40 (solo) R 1 40 40 0 -1"));
  REQUIRE(sys::make_dirs(p.dir.path() + "/41"));  // neither task/ nor stat
  // Not processes.
  for (const char* n : {"self", "sys", "12a"}) REQUIRE(sys::make_dirs(p.dir.path() + "/" + n));

  auto rc = agent::count_runnable(p.dir.path(), 1);
  CHECK(rc.runnable == 5);  // 10, 11, 14, 21, 40
  CHECK_FALSE(rc.truncated);
  // Seen from another pid, the "agent" at 1 is a runnable process too.
  CHECK(agent::count_runnable(p.dir.path(), 99).runnable == 6);
  CHECK(agent::count_runnable(p.dir.path() + "/missing", 1).runnable == 0);
}

TEST_CASE("agent: count_runnable leaves out kernel threads in vm mode") {
  FakeProc p;
  p.process(1, "sandgate-agent", 'S', 0);
  p.process(2, "kthreadd", 'R', 0);
  p.process(3, "kworker/0:0-events", 'R', 2);
  p.process(4, "kworker/u2:1", 'D', 2);
  p.process(40, "bash", 'S');
  p.process(41, "make", 'R', 40);
  CHECK(agent::count_runnable(p.dir.path(), 1, /*skip_kernel_threads=*/true).runnable == 1);
  CHECK(agent::count_runnable(p.dir.path(), 1, /*skip_kernel_threads=*/false).runnable == 4);
}

TEST_CASE("agent: count_runnable is bounded and says so when truncated") {
  FakeProc p;
  // Three asleep threads: with a bound of two, whether a third would be
  // runnable is unknown.
  for (int tid : {50, 51, 52}) p.thread(50, tid, "busy", "S 1 50 50 0 -1");
  auto all = agent::count_runnable(p.dir.path(), 1, false, 4096, 64);
  CHECK(all.runnable == 0);
  CHECK_FALSE(all.truncated);
  auto few = agent::count_runnable(p.dir.path(), 1, false, 4096, 2);
  CHECK(few.runnable == 0);
  CHECK(few.truncated);
  // A runnable thread found within the bound needs no more reading.
  FakeProc q;
  q.process(60, "one", 'R');
  CHECK_FALSE(agent::count_runnable(q.dir.path(), 1, false, 4096, 1).truncated);
  // The process bound.
  FakeProc r;
  for (int pid = 70; pid < 75; ++pid) r.process(pid, "w", 'R');
  auto capped = agent::count_runnable(r.dir.path(), 1, false, 3, 64);
  CHECK(capped.runnable == 3);
  CHECK(capped.truncated);
  auto uncapped = agent::count_runnable(r.dir.path(), 1, false, 5, 64);
  CHECK(uncapped.runnable == 5);
  CHECK_FALSE(uncapped.truncated);
}
