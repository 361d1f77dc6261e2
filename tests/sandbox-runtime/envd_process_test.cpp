// envd process.Process over real TCP: event sequences, stdin, PTY, signals,
// deadlines, Connect/List, flow control; and the codecs under it.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include "sandbox-runtime/agent/envd/process.h"
#include "sandbox-runtime/agent/envd/sha256.h"
#include "tests/sandbox-runtime/envd_harness.h"

using namespace envd_test;
using sg::envd::Code;

namespace {

std::string hex(const std::array<uint8_t, 32>& h) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t b : h) {
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}

json start_req(const std::string& script, json extra = json::object()) {
  json r{{"process", {{"cmd", "/bin/sh"}, {"args", {"-c", script}}}}, {"stdin", false}};
  for (auto& [k, v] : extra.items()) r[k] = v;
  return r;
}

// Collects a whole process stream: stdout, stderr, pty, end event, eos.
struct Run {
  int pid = 0;
  std::string out, err, pty;
  json end;
  json eos;
};

Run collect(Client& c, bool have_start = false) {
  Run r;
  if (!have_start) {
    auto s = c.next_event();
    REQUIRE(s.flags == 0);
    REQUIRE(s.msg["event"].contains("start"));
    r.pid = s.msg["event"]["start"]["pid"].get<int>();
  }
  for (;;) {
    auto e = c.next_event();
    if (e.flags & sg::envd::kFlagEndStream) {
      r.eos = e.msg;
      return r;
    }
    auto& ev = e.msg["event"];
    if (ev.contains("data")) {
      auto& d = ev["data"];
      if (d.contains("stdout")) r.out += unb64(d["stdout"]);
      if (d.contains("stderr")) r.err += unb64(d["stderr"]);
      if (d.contains("pty")) r.pty += unb64(d["pty"]);
    } else if (ev.contains("end")) {
      r.end = ev["end"];
    }
  }
}

}  // namespace

TEST_CASE("envd sha256: FIPS 180-2 vectors") {
  CHECK(hex(sg::envd::sha256("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(sg::envd::sha256("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(sg::envd::sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(hex(sg::envd::sha256(std::string(1000000, 'a'))) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // 55 and 56 bytes straddle the one/two padding block boundary.
  CHECK(hex(sg::envd::sha256(std::string(55, 'a'))) ==
        "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  CHECK(hex(sg::envd::sha256(std::string(56, 'a'))) ==
        "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
}

TEST_CASE("envd codec: base64 and envelopes") {
  CHECK(sg::envd::base64_encode("ab") == "YWI=");
  CHECK(sg::envd::base64_encode("ab", false) == "YWI");
  CHECK(sg::envd::base64_decode("YWI=").value() == "ab");
  CHECK(sg::envd::base64_decode("YWI").value() == "ab");
  CHECK(sg::envd::base64_decode("-_8").value() == sg::envd::base64_decode("+/8=").value());
  CHECK_FALSE(sg::envd::base64_decode("Y!==").has_value());
  std::string e = sg::envd::end_stream(std::nullopt);
  CHECK(e == std::string("\x02\x00\x00\x00\x02{}", 7));
  auto p = sg::envd::parse_single_envelope(sg::envd::envelope(0, "{\"a\":1}"));
  REQUIRE(p.ok());
  CHECK(p->payload == "{\"a\":1}");
  CHECK_FALSE(sg::envd::parse_single_envelope(std::string("\0\0\0\0\x09{}", 7)).ok());
}

TEST_CASE("envd end event fields follow Go's ProcessState") {
  CHECK(sg::envd::end_event_json(0) == json{{"exited", true}, {"status", "exit status 0"}});
  CHECK(sg::envd::end_event_json(3 << 8) ==
        json{{"exitCode", 3}, {"exited", true}, {"status", "exit status 3"}, {"error", "exit status 3"}});
  CHECK(sg::envd::end_event_json(SIGKILL) ==
        json{{"exitCode", -1}, {"status", "signal: killed"}, {"error", "signal: killed"}});
}

TEST_CASE("envd Start echo hi: exact event sequence and end of stream") {
  Env env;
  int status = 0;
  auto c = env.stream("process.Process/Start", start_req("echo hi"), {{"Keepalive-Ping-Interval", "50"}}, &status);
  CHECK(status == 200);
  auto s = c->next_envelope();
  CHECK(s.flags == 0);
  REQUIRE(s.msg["event"]["start"]["pid"].is_number());
  auto d = c->next_envelope();
  CHECK(d.msg == json{{"event", {{"data", {{"stdout", "aGkK"}}}}}});
  auto end = c->next_envelope();
  CHECK(end.msg == json{{"event", {{"end", {{"exited", true}, {"status", "exit status 0"}}}}}});
  auto eos = c->next_envelope();
  CHECK(eos.flags == sg::envd::kFlagEndStream);
  CHECK(eos.msg == json::object());
  c->read_body_some();
  CHECK(c->body_done());
}

TEST_CASE("envd Start: exit code, stderr, environment and cwd") {
  Env env;
  auto c = env.stream("process.Process/Start", start_req("echo oops >&2; exit 3"));
  Run r = collect(*c);
  CHECK(r.err == "oops\n");
  CHECK(r.end == json{{"exitCode", 3}, {"exited", true}, {"status", "exit status 3"}, {"error", "exit status 3"}});
  CHECK(r.eos == json::object());

  json req = start_req("echo $HOME $USER $SANDBOX_VAR $X; pwd");
  req["process"]["envs"] = {{"X", "1"}, {"SANDBOX_VAR", "overridden"}};
  req["process"]["cwd"] = "sub";
  (void)sg::sys::make_dirs(env.home + "/sub");
  c = env.stream("process.Process/Start", req);
  r = collect(*c);
  CHECK(r.out == env.home + " tester overridden 1\n" + env.home + "/sub\n");
}

TEST_CASE("envd Start: bad cwd and unknown command give invalid_argument in the end of stream") {
  Env env;
  json req = start_req("true");
  req["process"]["cwd"] = "/does/not/exist";
  int status = 0;
  auto c = env.stream("process.Process/Start", req, {}, &status);
  CHECK(status == 200);
  auto e = c->next_envelope();
  CHECK(e.flags == sg::envd::kFlagEndStream);
  CHECK(e.msg["error"]["code"] == "invalid_argument");
  c = env.stream("process.Process/Start", json{{"process", {{"cmd", "no-such-command-xyz"}}}});
  e = c->next_envelope();
  CHECK(e.msg["error"]["code"] == "invalid_argument");
  // Unknown Basic-auth user: unauthenticated.
  c = env.stream("process.Process/Start", start_req("true"), {{"Authorization", "Basic " + b64("nobody:")}});
  e = c->next_envelope();
  CHECK(e.msg["error"]["code"] == "unauthenticated");
}

TEST_CASE("envd Start with stdin: SendInput then CloseStdin") {
  Env env;
  auto c = env.stream("process.Process/Start",
                      json{{"process", {{"cmd", "cat"}}}, {"stdin", true}});
  auto s = c->next_event();
  int pid = s.msg["event"]["start"]["pid"];
  auto r = env.unary("process.Process/SendInput", {{"process", {{"pid", pid}}}, {"input", {{"stdin", b64("abc")}}}});
  CHECK(r.status == 200);
  CHECK(r.j() == json::object());
  r = env.unary("process.Process/CloseStdin", {{"process", {{"pid", pid}}}});
  CHECK(r.status == 200);
  Run run = collect(*c, true);
  CHECK(run.out == "abc");
  CHECK(run.end["status"] == "exit status 0");
  // Without stdin:true the process reads /dev/null and input is refused.
  c = env.stream("process.Process/Start", start_req("cat; echo done"));
  run = collect(*c);
  CHECK(run.out == "done\n");
}

TEST_CASE("envd PTY: size, echo and input") {
  Env env;
  json req{{"process", {{"cmd", "/bin/sh"}, {"args", {"-c", "stty size; cat"}}}},
           {"pty", {{"size", {{"cols", 100}, {"rows", 30}}}}}};
  auto c = env.stream("process.Process/Start", req);
  int pid = c->next_event().msg["event"]["start"]["pid"];
  std::string out;
  while (out.find("30 100") == std::string::npos) {
    auto e = c->next_event();
    REQUIRE(e.msg["event"].contains("data"));
    out += unb64(e.msg["event"]["data"]["pty"]);
  }
  auto r = env.unary("process.Process/SendInput", {{"process", {{"pid", pid}}}, {"input", {{"pty", b64("ping\n")}}}});
  CHECK(r.status == 200);
  r = env.unary("process.Process/Update", {{"process", {{"pid", pid}}}, {"pty", {{"size", {{"cols", 90}, {"rows", 20}}}}}});
  CHECK(r.status == 200);
  while (out.find("ping\r\nping") == std::string::npos) {
    auto e = c->next_event();
    REQUIRE(e.msg["event"].contains("data"));
    out += unb64(e.msg["event"]["data"]["pty"]);
  }
  env.unary("process.Process/SendInput", {{"process", {{"pid", pid}}}, {"input", {{"pty", b64("\x04")}}}});
  Run run = collect(*c, true);
  CHECK(run.end["exited"] == true);
  CHECK(run.eos == json::object());
}

TEST_CASE("envd SendSignal SIGKILL gives signal: killed; unknown pid is not_found") {
  Env env;
  auto c = env.stream("process.Process/Start", start_req("sleep 100"));
  int pid = c->next_event().msg["event"]["start"]["pid"];
  auto r = env.unary("process.Process/SendSignal", {{"process", {{"pid", pid}}}, {"signal", "SIGNAL_SIGKILL"}});
  CHECK(r.status == 200);
  Run run = collect(*c, true);
  CHECK(run.end == json{{"exitCode", -1}, {"status", "signal: killed"}, {"error", "signal: killed"}});
  r = env.unary("process.Process/SendSignal", {{"process", {{"pid", 999999}}}, {"signal", 9}});
  CHECK(r.status == 404);
  CHECK(r.j()["code"] == "not_found");
  CHECK(r.headers["content-type"] == "application/json");
}

TEST_CASE("envd Connect-Timeout-Ms on Start kills the process: deadline_exceeded") {
  Env env;
  auto c = env.stream("process.Process/Start", start_req("sleep 100"), {{"Connect-Timeout-Ms", "300"}});
  int pid = c->next_event().msg["event"]["start"]["pid"];
  Run run = collect(*c, true);
  CHECK(run.eos["error"]["code"] == "deadline_exceeded");
  // The process is gone: it is in the exit cache as killed.
  auto c2 = env.stream("process.Process/Connect", {{"process", {{"pid", pid}}}});
  Run r2 = collect(*c2);
  CHECK(r2.end["status"] == "signal: killed");
}

TEST_CASE("envd Connect to a finished process, List and tags") {
  Env env;
  auto c = env.stream("process.Process/Start", start_req("exit 7"));
  Run run = collect(*c);
  auto c2 = env.stream("process.Process/Connect", {{"process", {{"pid", run.pid}}}});
  Run r2 = collect(*c2);
  CHECK(r2.pid == run.pid);
  CHECK(r2.end["exitCode"] == 7);
  CHECK(r2.eos == json::object());

  json req = start_req("sleep 100");
  req["tag"] = "t1";
  auto bg = env.stream("process.Process/Start", req);
  int pid = bg->next_event().msg["event"]["start"]["pid"];
  auto l = env.unary("process.Process/List", json::object());
  REQUIRE(l.status == 200);
  auto procs = l.j()["processes"];
  REQUIRE(procs.size() == 1);
  CHECK(procs[0]["pid"] == pid);
  CHECK(procs[0]["tag"] == "t1");
  CHECK(procs[0]["config"]["cmd"] == "/bin/sh");
  CHECK(procs[0]["config"]["args"] == json{"-c", "sleep 100"});
  // Connect by tag: a second watcher of the same process.
  auto watcher = env.stream("process.Process/Connect", {{"process", {{"tag", "t1"}}}});
  CHECK(watcher->next_event().msg["event"]["start"]["pid"] == pid);
  auto k = env.unary("process.Process/SendSignal", {{"process", {{"tag", "t1"}}}, {"signal", "SIGNAL_SIGTERM"}});
  CHECK(k.status == 200);
  Run a = collect(*bg, true), b = collect(*watcher, true);
  CHECK(a.end["status"] == "signal: terminated");
  CHECK(b.end["status"] == "signal: terminated");
  auto nf = env.stream("process.Process/Connect", {{"process", {{"pid", 999999}}}});
  CHECK(nf->next_envelope().msg["error"]["code"] == "not_found");
}

TEST_CASE("envd runs processes as the request user (uid 1000, groups, home)") {
  Env env;
  json req = start_req("id -u; id -g; echo $HOME; pwd; touch f; stat -c %u f");
  auto c = env.stream("process.Process/Start", req, {{"Authorization", "Basic " + b64("user:")}});
  Run r = collect(*c);
  CHECK(r.out == "1000\n1000\n" + env.user_home + "\n" + env.user_home + "\n1000\n");
  // Supplementary groups come from the group file.
  c = env.stream("process.Process/Start", start_req("id -G"));
  r = collect(*c);
  CHECK(r.out.find("4242") != std::string::npos);
}

TEST_CASE("envd flow control: a reader that stops keeps yes bounded") {
  Env env;
  auto c = env.stream("process.Process/Start", start_req("yes"));
  c->set_rcvbuf(4096);
  int pid = c->next_event().msg["event"]["start"]["pid"];
  // The client reads nothing more: socket buffers fill, then the stream's
  // queue reaches the limit and the pump stops reading (a flow stall).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (env.server->stats().processes.flow_stalls == 0 && std::chrono::steady_clock::now() < deadline) {
    struct pollfd p = {-1, 0, 0};
    poll(&p, 0, 5);
  }
  auto st = env.server->stats();
  REQUIRE(st.processes.flow_stalls > 0);
  for (int i = 0; i < 20; ++i) {
    st = env.server->stats();
    CHECK(st.processes.pending_bytes <= sg::envd::kPendingLimit + sg::envd::kPipeChunk);
    struct pollfd p = {-1, 0, 0};
    poll(&p, 0, 10);
  }
  auto r = env.unary("process.Process/SendSignal", {{"process", {{"pid", pid}}}, {"signal", "SIGNAL_SIGKILL"}});
  CHECK(r.status == 200);
}

TEST_CASE("envd auth: token on RPCs and /envs, /health open") {
  Env env("sekrit");
  Client c(env.port());
  auto h = c.request("GET", "/health");
  CHECK(h.status == 204);
  auto r = env.unary("process.Process/List", json::object());
  CHECK(r.status == 401);
  CHECK(r.j()["code"] == 401);
  r = env.unary("process.Process/List", json::object(), {{"X-Access-Token", "wrong"}});
  CHECK(r.status == 401);
  r = env.unary("process.Process/List", json::object(), {{"X-Access-Token", "sekrit"}});
  CHECK(r.status == 200);
  Client e(env.port());
  auto envs = e.request("GET", "/envs", {{"X-Access-Token", "sekrit"}});
  CHECK(envs.status == 200);
  CHECK(envs.j()["SANDBOX_VAR"] == "yes");
  int status = 0;
  auto s = env.stream("process.Process/Start", start_req("true"), {}, &status);
  CHECK(status == 401);
  // StreamInput is client streaming: a unary content type gets 415 unimplemented JSON.
  r = env.unary("process.Process/StreamInput", json::object(), {{"X-Access-Token", "sekrit"}});
  CHECK(r.status == 415);
  CHECK(r.j()["code"] == "unimplemented");
}

namespace {

std::string http_chunk(const std::string& data) {
  char n[32];
  snprintf(n, sizeof n, "%zx\r\n", data.size());
  return n + data + "\r\n";
}

// Opens POST /process.Process/StreamInput with a chunked body; the caller
// sends chunks with send_raw(http_chunk(...)) and ends with "0\r\n\r\n".
std::unique_ptr<Client> open_stream_input(Env& env, const std::string& extra_headers = "") {
  auto c = std::make_unique<Client>(env.port());
  c->send_raw("POST /process.Process/StreamInput HTTP/1.1\r\nHost: localhost\r\n"
              "Content-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n" +
              extra_headers + "Transfer-Encoding: chunked\r\n\r\n");
  return c;
}

std::string input_env(const std::string& stdin_bytes) {
  return envelope_of(json{{"data", {{"input", {{"stdin", b64(stdin_bytes)}}}}}});
}

// Reads the StreamInput response: the end-of-stream payload, after checking
// the message envelope {} came first when ok.
json stream_input_reply(Client& c, bool ok) {
  auto h = c.read_head();
  CHECK(h.status == 200);
  CHECK(h.headers["content-type"] == "application/connect+json");
  auto e = c.next_envelope();
  if (ok) {
    CHECK(e.flags == 0);
    CHECK(e.msg == json::object());
    e = c.next_envelope();
  }
  CHECK(e.flags == sg::envd::kFlagEndStream);
  return e.msg;
}

}  // namespace

TEST_CASE("envd StreamInput: data envelopes reach cat's stdin as they arrive") {
  Env env;
  auto c = env.stream("process.Process/Start", json{{"process", {{"cmd", "cat"}}}, {"stdin", true}});
  auto s = c->next_event();
  int pid = s.msg["event"]["start"]["pid"];

  auto in = open_stream_input(env);
  in->send_raw(http_chunk(envelope_of(json{{"start", {{"process", {{"pid", pid}}}}}})));
  in->send_raw(http_chunk(input_env("abc")));
  // cat echoes the first message while the request body is still open.
  std::string out;
  while (out.size() < 3) {
    auto e = c->next_event();
    REQUIRE(e.flags == 0);
    out += unb64(e.msg["event"]["data"]["stdout"]);
  }
  CHECK(out == "abc");
  // A keepalive, then the second message split across two chunks (inside its
  // 5-byte prefix), then the end-of-stream envelope and the body's end.
  std::string second = input_env("def\n");
  in->send_raw(http_chunk(envelope_of(json{{"keepalive", json::object()}})));
  in->send_raw(http_chunk(second.substr(0, 3)));
  in->send_raw(http_chunk(second.substr(3)));
  in->send_raw(http_chunk(sg::envd::envelope(sg::envd::kFlagEndStream, "{}")) + "0\r\n\r\n");
  CHECK(stream_input_reply(*in, true) == json::object());
  // The connection stays usable.
  auto r = in->request("GET", "/health");
  CHECK(r.status == 204);

  r = env.unary("process.Process/CloseStdin", {{"process", {{"pid", pid}}}});
  CHECK(r.status == 200);
  Run run = collect(*c, true);
  CHECK(out + run.out == "abcdef\n");
  CHECK(run.end["status"] == "exit status 0");
}

TEST_CASE("envd StreamInput: body end without end-of-stream, tag selector") {
  Env env;
  json req{{"process", {{"cmd", "cat"}}}, {"stdin", true}, {"tag", "feeder"}};
  auto c = env.stream("process.Process/Start", req);
  auto s = c->next_event();
  REQUIRE(s.msg["event"].contains("start"));
  auto in = open_stream_input(env);
  in->send_raw(http_chunk(envelope_of(json{{"start", {{"process", {{"tag", "feeder"}}}}}}) + input_env("x")));
  in->send_raw(http_chunk(input_env("y")) + "0\r\n\r\n");
  CHECK(stream_input_reply(*in, true) == json::object());
  int pid = s.msg["event"]["start"]["pid"];
  CHECK(env.unary("process.Process/CloseStdin", {{"process", {{"pid", pid}}}}).status == 200);
  Run run = collect(*c, true);
  CHECK(run.out == "xy");
}

TEST_CASE("envd StreamInput errors: unknown pid, bad messages, oversized envelope") {
  Env env;
  // Unknown pid: not_found in the end-of-stream envelope of a 200.
  auto in = open_stream_input(env);
  in->send_raw(http_chunk(envelope_of(json{{"start", {{"process", {{"pid", 999999}}}}}})));
  json eos = stream_input_reply(*in, false);
  CHECK(eos["error"]["code"] == "not_found");
  in->send_raw(http_chunk(input_env("ignored")) + "0\r\n\r\n");  // discarded, then the next request
  CHECK(in->request("GET", "/health").status == 204);

  // Data before start, an unknown event, a non-JSON message, an empty body.
  for (const std::string& body :
       {input_env("a"), envelope_of(json{{"bogus", 1}}), sg::envd::envelope(0, "not json"), std::string()}) {
    auto c = open_stream_input(env);
    c->send_raw((body.empty() ? std::string() : http_chunk(body)) + "0\r\n\r\n");
    json e = stream_input_reply(*c, false);
    CHECK(e["error"]["code"] == "invalid_argument");
  }
  // A message after start that is not valid.
  auto sc = env.stream("process.Process/Start", json{{"process", {{"cmd", "cat"}}}, {"stdin", true}});
  int pid = sc->next_event().msg["event"]["start"]["pid"];
  auto c = open_stream_input(env);
  c->send_raw(http_chunk(envelope_of(json{{"start", {{"process", {{"pid", pid}}}}}})) +
              http_chunk(envelope_of(json{{"data", {{"input", {{"stdin", "!!notbase64"}}}}}})) + "0\r\n\r\n");
  CHECK(stream_input_reply(*c, false)["error"]["code"] == "invalid_argument");
  // An envelope announcing more than 16 MiB is refused before it is read.
  c = open_stream_input(env);
  c->send_raw(http_chunk(std::string("\x00\x02\x00\x00\x00", 5)));
  CHECK(stream_input_reply(*c, false)["error"]["code"] == "resource_exhausted");
  // Connect-Timeout-Ms bounds the whole call: a client that goes quiet gets
  // deadline_exceeded.
  c = open_stream_input(env, "Connect-Timeout-Ms: 300\r\n");
  c->send_raw(http_chunk(envelope_of(json{{"start", {{"process", {{"pid", pid}}}}}})));
  CHECK(stream_input_reply(*c, false)["error"]["code"] == "deadline_exceeded");
  CHECK(env.unary("process.Process/SendSignal", {{"process", {{"pid", pid}}}, {"signal", "SIGNAL_SIGKILL"}}).status == 200);
  collect(*sc, true);
}

TEST_CASE("envd keep-alive: several requests on one connection") {
  Env env;
  Client c(env.port());
  for (int i = 0; i < 3; ++i) {
    auto r = c.request("POST", "/process.Process/List", {{"Content-Type", "application/json"}}, "{}");
    CHECK(r.status == 200);
    CHECK(r.j() == json{{"processes", json::array()}});
  }
  // A chunked request body.
  c.send_raw("POST /process.Process/List HTTP/1.1\r\nContent-Type: application/json\r\n"
             "Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n1\r\n}\r\n0\r\n\r\n");
  auto r = c.read_head();
  CHECK(r.status == 200);
}

TEST_CASE("envd request head over 64 KiB is refused with 431") {
  Env env;
  Client c(env.port());
  auto r = c.request("GET", "/health", {{"X-Big", std::string(70 << 10, 'a')}});
  CHECK(r.status == 431);
  CHECK(r.j()["code"] == 431);
}

TEST_CASE("envd reconfigure: processes started after it get the new environment; the old token is refused") {
  Env env("template-token");
  env.server->reconfigure("clone-token", {"SANDBOX_VAR=clone", "PATH=/usr/local/bin:/usr/bin:/bin"});
  int status = 0;
  auto refused = env.stream("process.Process/Start", start_req("true"), {{"X-Access-Token", "template-token"}}, &status);
  CHECK(status == 401);
  auto c = env.stream("process.Process/Start", start_req("echo $SANDBOX_VAR"), {{"X-Access-Token", "clone-token"}});
  Run r = collect(*c);
  CHECK(r.out == "clone\n");
}
