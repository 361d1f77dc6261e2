// Lifecycle against the real binary: kill leaves nothing behind, timeouts
// are enforced, one sandbox's crash spares the others, state survives a
// restart of sandgate and dead sandboxes are not reported as running.
#include <doctest/doctest.h>
#include <signal.h>

#include <nlohmann/json.hpp>

#include "storage/store.h"
#include "tests/integration/state_of.h"
#include "tests/support/eventually.h"
#include "tests/support/sandgate_process.h"
#include "base/sys.h"

using namespace sg;
using namespace sg::test;
using json = nlohmann::json;

namespace {

std::string create(const SandgateProcess& s, const std::string& body = R"({"templateID":"base"})") {
  Response r = s.post("/v2/sandboxes", body);
  REQUIRE_MESSAGE(r.status == 201, r.status << " " << r.body << "\n" << s.log());
  return json::parse(r.body)["sandboxID"].get<std::string>();
}


// Alive and not a zombie (an orphaned zombie may wait a while for its reaper).
bool pid_alive(int64_t pid) {
  auto stat = sys::read_file("/proc/" + std::to_string(pid) + "/stat");
  if (!stat.ok()) return false;
  size_t paren = stat->rfind(')');
  return paren != std::string::npos && paren + 2 < stat->size() && (*stat)[paren + 2] != 'Z';
}

// Every cgroup directory the sandbox could have, v1 and v2.
std::vector<std::string> cgroup_dirs(const std::string& parent, const std::string& id) {
  std::vector<std::string> out;
  for (const char* c : {"memory", "cpu", "cpuacct", "pids", "freezer", "unified", ""})
    out.push_back(std::string("/sys/fs/cgroup/") + c + (*c ? "/" : "") + parent + "/" + id);
  return out;
}

bool mounted_under(const std::string& path) {
  auto mi = sys::read_file("/proc/self/mountinfo", 64 << 20);
  return mi.ok() && mi->find(path) != std::string::npos;
}


}  // namespace

TEST_CASE("kill leaves no process, cgroup, mount or state directory behind") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"));
  REQUIRE(s.started());
  std::string id = create(s);
  int64_t pid = state_of(s.data_dir(), id).init_pid;
  REQUIRE(pid > 0);
  CHECK(pid_alive(pid));
  bool any_cgroup = false;
  for (const std::string& d : cgroup_dirs(s.cgroup_parent(), id)) any_cgroup |= sys::path_exists(d);
  CHECK(any_cgroup);
  std::string state_dir = s.data_dir() + "/sandboxes/" + id;
  CHECK(sys::path_exists(state_dir));

  REQUIRE(s.del("/sandboxes/" + id).status == 204);
  // kill() waits for the processes before it answers: no polling here.
  CHECK_FALSE(pid_alive(pid));
  for (const std::string& d : cgroup_dirs(s.cgroup_parent(), id)) CHECK_MESSAGE(!sys::path_exists(d), d);
  CHECK_FALSE(sys::path_exists(state_dir));
  CHECK_FALSE(mounted_under(state_dir));
  CHECK(state_of(s.data_dir(), id).state == "killed");
}

TEST_CASE("timeouts are enforced: kill at endAt, or pause with autoPause") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"), {"--tick-ms", "100"});
  REQUIRE(s.started());
  std::string killed = create(s, R"({"templateID":"base","timeout":1})");
  std::string paused = create(s, R"({"templateID":"base","timeout":1,"autoPause":true})");
  std::string kept = create(s, R"({"templateID":"base","timeout":600})");
  CHECK(eventually([&] { return s.get("/sandboxes/" + killed).status == 404; }));
  CHECK(eventually([&] {
    Response r = s.get("/sandboxes/" + paused);
    return r.status == 200 && json::parse(r.body)["state"] == "paused";
  }));
  CHECK(state_of(s.data_dir(), killed).end_reason == "timeout reached");
  CHECK(json::parse(s.get("/sandboxes/" + kept).body)["state"] == "running");
  // A paused-at-timeout sandbox resumes on connect.
  CHECK(s.post("/v2/sandboxes/" + paused + "/connect", R"({"timeout":600})").status == 201);
  CHECK(json::parse(s.get("/sandboxes/" + paused).body)["state"] == "running");
}

TEST_CASE("a crashed sandbox is marked lost and does not affect another") {
  TempDir dir;
  SandgateProcess s(dir.sub("data"), {"--tick-ms", "100"});
  REQUIRE(s.started());
  std::string a = create(s);
  std::string b = create(s);
  int64_t pid_a = state_of(s.data_dir(), a).init_pid;
  REQUIRE(::kill(static_cast<pid_t>(pid_a), SIGKILL) == 0);
  CHECK(eventually([&] { return s.get("/sandboxes/" + a).status == 404; }));
  CHECK(state_of(s.data_dir(), a).state == "lost");
  // The row turns final before the runtime finishes removing the
  // sandbox's cgroups (by design: nobody sees a half-killed sandbox as
  // running), so wait for the cleanup rather than race it.
  CHECK(eventually([&] {
    for (const std::string& d : cgroup_dirs(s.cgroup_parent(), a))
      if (sys::path_exists(d)) return false;
    return true;
  }));
  // b is untouched and still works.
  CHECK(json::parse(s.get("/sandboxes/" + b).body)["state"] == "running");
  CHECK(s.post("/sandboxes/" + b + "/pause", "{}").status == 204);
  CHECK(s.post("/sandboxes/" + b + "/connect", R"({"timeout":60})").status == 201);
  CHECK(s.del("/sandboxes/" + b).status == 204);
}

TEST_CASE("tenants, keys, templates and events survive a restart; with --keep-sandboxes off sandboxes end with sandgate and are not reported running") {
  TempDir dir;
  std::string data = dir.sub("data");
  std::string key, id, template_id, parent;
  int64_t pid = 0;
  {
    SandgateProcess s(data);
    REQUIRE(s.started());
    key = s.key();
    parent = s.cgroup_parent();
    Response c = s.post("/v2/sandboxes", R"({"templateID":"base"})");
    REQUIRE(c.status == 201);
    id = json::parse(c.body)["sandboxID"];
    template_id = json::parse(c.body)["templateID"];
    pid = state_of(data, id).init_pid;
    SUBCASE("after a crash of sandgate") { s.kill9(); }
    SUBCASE("after a clean stop") {
      CHECK(s.stop() == 0);
      // A clean stop kills the sandboxes and removes the instance's cgroups.
      CHECK_FALSE(pid_alive(pid));
      for (const char* c : {"memory", "cpu", "freezer", "pids"})
        CHECK_FALSE(sys::path_exists(std::string("/sys/fs/cgroup/") + c + "/" + parent));
    }
  }
  SandgateProcess s(data, {}, parent);
  REQUIRE(s.started());
  CHECK(s.key() == key);  // same tenant, same key
  // The previous run's leftovers are gone.
  for (const std::string& d : cgroup_dirs(parent, id)) CHECK_MESSAGE(!sys::path_exists(d), d);
  CHECK_FALSE(sys::path_exists(data + "/sandboxes/" + id));
  CHECK(s.get("/v2/sandboxes").status == 200);
  CHECK(s.get("/sandboxes/" + id).status == 404);
  CHECK(json::parse(s.get("/v2/sandboxes").body).empty());
  CHECK(state_of(data, id).state == "lost");
  CHECK_FALSE(pid_alive(pid));
  // The template kept its id; events recorded before and at the restart.
  Response c = s.post("/v2/sandboxes", R"({"templateID":"base"})");
  REQUIRE(c.status == 201);
  CHECK(json::parse(c.body)["templateID"] == template_id);
  auto store = storage::Store::open(data + "/sandgate.db");
  REQUIRE(store.ok());
  auto events = (*store)->events_for_sandbox(id);
  REQUIRE(events.ok());
  REQUIRE(events->size() >= 2);
  CHECK((*events)[0].kind == "created");
  CHECK(events->back().kind == "lost");
}
