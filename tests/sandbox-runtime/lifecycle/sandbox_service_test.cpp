// SandboxService (api-e2b/sandboxes.h), the lifecycle core, without root,
// a rootfs or a real runtime: a FakeRuntime (tests/support/fake_runtime.h),
// SQLite in a temp dir and an injected clock. The fault loop at the end
// fails each runtime call of each lifecycle operation in turn and checks
// that the sandbox ends in a state its row and the runtime agree on, and
// that nothing leaks.
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <atomic>
#include <fstream>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <memory>
#include <string>
#include <vector>

#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "sandbox-runtime/lifecycle/state.h"
#include "base/sys.h"
#include "storage/store.h"
#include "tests/support/fake_runtime.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_store.h"
#include "wait-engine/memory/pause_pack.h"

using sg::ErrorKind;
using sg::lifecycle::CreateParams;
using sg::lifecycle::SandboxService;
using sg::lifecycle::ServiceConfig;
using sg::test::FakeRuntime;
using Op = FakeRuntime::Op;

namespace {

// A GuestMemoryStore that records what the core asks of it; offload can be
// told to fail or to lose the sandbox's memory.
struct FakeMemory : sg::lifecycle::GuestMemoryStore {
  std::mutex mu;
  int offloads = 0, prefetches = 0, forgets = 0;
  bool fail_offload = false;
  std::string last_cohort;
  std::vector<std::pair<std::string, std::string>> lost;
  sg::Result<std::string> offload(const std::string& id, const sg::lifecycle::OffloadRequest& r,
                                  const std::atomic<bool>&) override {
    std::lock_guard<std::mutex> g(mu);
    ++offloads;
    last_cohort = r.tenant_id + "/" + r.template_id;
    if (fail_offload) return sg::Error(ErrorKind::kQuota, "no room");
    return std::string("offloaded");
  }
  sg::Result<uint64_t> prefetch(const std::string&) override {
    std::lock_guard<std::mutex> g(mu);
    ++prefetches;
    return uint64_t{7};
  }
  void forget(const std::string&) override {
    std::lock_guard<std::mutex> g(mu);
    ++forgets;
  }
  uint64_t pool_bytes(const std::string&) const override { return 4096; }
  std::vector<std::pair<std::string, std::string>> take_lost() override {
    std::lock_guard<std::mutex> g(mu);
    std::vector<std::pair<std::string, std::string>> out;
    out.swap(lost);
    return out;
  }
};

struct Harness {
  sg::test::TempDir dir;
  std::unique_ptr<sg::storage::Store> store;
  FakeRuntime rt;
  FakeMemory memory;
  int64_t now = 1'700'000'000;
  sg::storage::TenantRow tenant;
  std::unique_ptr<SandboxService> svc;

  explicit Harness(ServiceConfig cfg = {}, bool with_memory = false) {
    store = sg::test::open_store_with_base(dir);
    tenant.id = "t1";
    tenant.name = "tenant-one";
    tenant.created_at = now;
    tenant.max_sandboxes = 100;
    tenant.max_memory_mb = 1 << 20;
    REQUIRE(store->insert_tenant(tenant));
    svc = std::make_unique<SandboxService>(*store, rt, cfg, [this] { return now; }, with_memory ? &memory : nullptr);
  }

  CreateParams params(int64_t timeout_s = 300) {
    CreateParams p;
    p.template_ref = "base";
    p.timeout_s = timeout_s;
    return p;
  }

  std::string create(CreateParams p) {
    auto row = svc->create(tenant, p);
    REQUIRE_MESSAGE(row, (row ? "" : row.error().message()));
    return row->id;
  }
  std::string create() { return create(params()); }

  // The row's state as stored ("" when there is no row).
  std::string row_state(const std::string& id) {
    auto r = store->get_sandbox(tenant.id, id);
    REQUIRE(r);
    return *r ? (*r)->state : std::string();
  }
  int64_t end_at(const std::string& id) {
    auto r = store->get_sandbox(tenant.id, id);
    REQUIRE(r);
    REQUIRE(*r);
    return (*r)->end_at;
  }

  sg::http::HttpRequest envd_request(const std::string& id, const std::string& path = "/files") {
    sg::http::HttpRequest h;
    h.method = "GET";
    h.path = path;
    h.target = path;
    auto r = store->get_sandbox(tenant.id, id);
    if (r && *r) h.headers["x-access-token"] = (*r)->envd_token;
    return h;
  }
};

// The invariant of every sandbox at rest: the row, the runtime and the
// lifecycle state agree, and nothing leaked.
void check_consistent(Harness& h, const std::string& id) {
  using sg::lifecycle::State;
  std::string st = h.row_state(id);
  INFO("sandbox " << id << " row state " << st);
  FakeRuntime::Record rec = h.rt.record(id);
  auto live = h.svc->state(id);
  if (live) {
    INFO("lifecycle state " << std::string(sg::lifecycle::name(*live)));
    CHECK(std::string(sg::lifecycle::stored_state(*live)) == st);
    CHECK_FALSE(rec.killed);
    bool stopped = *live == State::kPaused || *live == State::kWaitPaused || *live == State::kOffloaded;
    CHECK(rec.paused == stopped);
    CHECK((*live == State::kRunning || stopped));
  } else {
    CHECK((st == "killed" || st == "lost" || st == "failed"));
    if (h.rt.exists(id)) CHECK(rec.killed);
  }
  CHECK(h.rt.leaked().empty());
}

// Snapshots, forks and pauses to disk on: their layers under dir.
ServiceConfig with_snapshots(sg::test::TempDir& dir) {
  ServiceConfig cfg;
  cfg.snapshot_dir = dir.sub("layers");
  return cfg;
}

}  // namespace

TEST_CASE("lifecycle core: create runs the sandbox and records it") {
  Harness h;
  CreateParams p = h.params(120);
  p.env_vars["FOO"] = "bar";
  std::string id = h.create(p);
  CHECK(h.row_state(id) == "running");
  CHECK(h.end_at(id) == h.now + 120);
  CHECK(h.svc->live_count() == 1);
  FakeRuntime::Record rec = h.rt.record(id);
  CHECK(rec.spec.memory_mb == 512);
  CHECK(rec.spec.envd_access_token.size() == 32);
  bool foo = false, openai = false;
  for (auto& [k, v] : rec.spec.env) {
    foo |= k == "FOO" && v == "bar";
    openai |= k == "OPENAI_BASE_URL";
  }
  CHECK(foo);
  CHECK(openai);
  check_consistent(h, id);
}

TEST_CASE("lifecycle core: an unknown or unready template changes nothing") {
  Harness h;
  CreateParams p = h.params();
  p.template_ref = "nope";
  auto r = h.svc->create(h.tenant, p);
  REQUIRE_FALSE(r);
  CHECK(r.error().kind() == ErrorKind::kNotFound);
  CHECK(h.rt.calls(Op::kCreate) == 0);
  auto t = p;
  t.timeout_s = -1;
  t.template_ref = "base";
  CHECK(h.svc->create(h.tenant, t).error().kind() == ErrorKind::kInvalid);
  CHECK(h.svc->live_count() == 0);
}

TEST_CASE("lifecycle core: pause, a second pause conflicts, connect resumes with a fresh timeout") {
  Harness h;
  std::string id = h.create();
  REQUIRE(h.svc->pause(h.tenant.id, id));
  CHECK(h.row_state(id) == "paused");
  CHECK(h.rt.record(id).paused);
  auto again = h.svc->pause(h.tenant.id, id);
  REQUIRE_FALSE(again);
  CHECK(again.error().kind() == ErrorKind::kConflict);
  h.now += 1000;
  auto c = h.svc->connect(h.tenant.id, id, 60);
  REQUIRE(c);
  CHECK(c->resumed);
  CHECK(c->row.state == "running");
  CHECK(h.end_at(id) == h.now + 60);
  CHECK_FALSE(h.rt.record(id).paused);
  // Connecting to a running one only extends its timeout.
  auto c2 = h.svc->connect(h.tenant.id, id, 600);
  REQUIRE(c2);
  CHECK_FALSE(c2->resumed);
  CHECK(h.end_at(id) == h.now + 600);
  check_consistent(h, id);
}

TEST_CASE("lifecycle core: kill ends it everywhere; other tenants see nothing") {
  Harness h;
  std::string id = h.create();
  CHECK(h.svc->kill("someone-else", id).error().kind() == ErrorKind::kNotFound);
  CHECK(h.svc->pause("someone-else", id).error().kind() == ErrorKind::kNotFound);
  REQUIRE(h.svc->kill(h.tenant.id, id));
  CHECK(h.row_state(id) == "killed");
  CHECK(h.rt.record(id).killed);
  CHECK(h.svc->live_count() == 0);
  CHECK(h.svc->get(h.tenant.id, id).error().kind() == ErrorKind::kNotFound);
  CHECK(h.svc->kill(h.tenant.id, id).error().kind() == ErrorKind::kNotFound);
  check_consistent(h, id);
}

TEST_CASE("lifecycle core: timeouts kill, or pause with onTimeout=pause") {
  Harness h;
  std::string killed = h.create(h.params(10));
  CreateParams p = h.params(10);
  p.on_timeout_pause = true;
  std::string paused = h.create(p);
  h.now += 5;
  h.svc->tick();
  CHECK(h.row_state(killed) == "running");
  h.now += 6;
  h.svc->tick();
  CHECK(h.row_state(killed) == "killed");
  CHECK(h.row_state(paused) == "paused");
  h.svc->tick();  // still expired, already paused: nothing changes
  CHECK(h.row_state(paused) == "paused");
  CHECK(h.rt.record(paused).pauses == 1);
  check_consistent(h, killed);
  check_consistent(h, paused);
}

TEST_CASE("lifecycle core: a sandbox whose processes died is lost at the next tick") {
  Harness h;
  std::string id = h.create();
  h.rt.set_dead(id);
  h.svc->tick();
  CHECK(h.row_state(id) == "lost");
  CHECK(h.svc->live_count() == 0);
  auto ev = h.store->events_for_sandbox(id);
  REQUIRE(ev);
  bool lost = false;
  for (auto& e : *ev) lost |= e.kind == "lost";
  CHECK(lost);
}

TEST_CASE("lifecycle core: a wait pause is invisible; a client's pause during it wins") {
  Harness h;
  std::string id = h.create();
  REQUIRE(h.svc->wait_pause(id));
  CHECK(h.rt.record(id).paused);
  CHECK(h.row_state(id) == "running");  // clients still see it running
  REQUIRE(h.svc->wait_resume(id));
  CHECK_FALSE(h.rt.record(id).paused);
  // Paused by a client while wait-paused: the wait's resume leaves it paused.
  REQUIRE(h.svc->wait_pause(id));
  REQUIRE(h.svc->pause(h.tenant.id, id));
  REQUIRE(h.svc->wait_resume(id));
  CHECK(h.rt.record(id).paused);
  CHECK(h.row_state(id) == "paused");
  // A wait pause of a paused sandbox changes nothing either.
  REQUIRE(h.svc->wait_pause(id));
  REQUIRE(h.svc->connect(h.tenant.id, id, 60));
  CHECK_FALSE(h.rt.record(id).paused);
  CHECK(h.svc->wait_idle(id, std::chrono::milliseconds(100)).value());
  // No memory engine: offload is refused, the sandbox untouched.
  std::atomic<bool> cancel{false};
  CHECK(h.svc->wait_offload(id, cancel).error().kind() == ErrorKind::kUnavailable);
  REQUIRE(h.svc->kill(h.tenant.id, id));
  check_consistent(h, id);
}

TEST_CASE("lifecycle core: traffic resumes a paused sandbox only with its credentials and autoResume") {
  Harness h;
  std::string id = h.create();
  REQUIRE(h.svc->pause(h.tenant.id, id));
  sg::http::HttpRequest bad = h.envd_request(id);
  bad.headers["x-access-token"] = "wrong";
  CHECK(h.svc->open_port(id, 49983, bad).error().kind() == ErrorKind::kUnauthorized);
  CHECK(h.row_state(id) == "paused");
  h.now += 50;
  auto fd = h.svc->open_port(id, 49983, h.envd_request(id));
  REQUIRE(fd);
  CHECK(h.row_state(id) == "running");
  CHECK(h.end_at(id) == h.now + 300);  // its timeout starts again

  CreateParams p = h.params();
  p.auto_resume = false;
  std::string manual = h.create(p);
  REQUIRE(h.svc->pause(h.tenant.id, manual));
  CHECK(h.svc->open_port(manual, 49983, h.envd_request(manual)).error().kind() == ErrorKind::kConflict);
  CHECK(h.row_state(manual) == "paused");
  CHECK(h.svc->open_port("no-such-sandbox", 49983, h.envd_request(manual)).error().kind() ==
        ErrorKind::kNotFound);
  check_consistent(h, id);
  check_consistent(h, manual);
}

TEST_CASE("lifecycle core: a revoked tenant's sandboxes end at the next tick") {
  Harness h;
  std::string a = h.create(), b = h.create();
  REQUIRE(h.svc->pause(h.tenant.id, b));
  REQUIRE(h.store->revoke_tenant(h.tenant.id, h.now));
  h.svc->tick();
  CHECK(h.row_state(a) == "killed");
  CHECK(h.row_state(b) == "killed");
  CHECK(h.rt.unkilled().empty());
}

TEST_CASE("lifecycle core: shutdown ends every live sandbox as lost") {
  Harness h;
  std::string a = h.create(), b = h.create();
  REQUIRE(h.svc->pause(h.tenant.id, b));
  h.svc->shutdown();
  CHECK(h.row_state(a) == "lost");
  CHECK(h.row_state(b) == "lost");
  CHECK(h.rt.unkilled().empty());
  CHECK(h.svc->live_count() == 0);
}

TEST_CASE("lifecycle core: with sandboxes that outlive sandgate, a stop keeps them and the next start takes them back") {
  Harness h;
  h.rt.set_outlive(true);
  std::string running = h.create(), paused = h.create(), waiting = h.create(), dies = h.create(),
              killed = h.create();
  REQUIRE(h.svc->pause(h.tenant.id, paused));
  REQUIRE(h.svc->wait_pause(waiting));
  REQUIRE(h.svc->kill(h.tenant.id, killed));
  // A sandbox with no row (a warm pool's, a build step's) is removed.
  auto rowless = h.rt.create([] {
    sg::runtime::SandboxSpec s;
    s.id = "rowless";
    return s;
  }());
  REQUIRE(rowless);
  rowless->reset();
  h.svc->shutdown();
  h.svc.reset();
  CHECK(h.row_state(running) == "running");
  CHECK(h.row_state(paused) == "paused");
  CHECK(h.row_state(waiting) == "running");
  CHECK(h.rt.unkilled().size() == 5);  // running, paused, waiting, dies, rowless
  h.rt.set_dead(dies);

  h.svc = std::make_unique<SandboxService>(*h.store, h.rt, ServiceConfig{}, [&h] { return h.now; });
  REQUIRE(h.svc->recover());
  CHECK(h.svc->state(running).value() == sg::lifecycle::State::kRunning);
  CHECK(h.svc->state(paused).value() == sg::lifecycle::State::kPaused);
  // Wait-paused when sandgate went: the model request went with it, so it runs.
  CHECK(h.svc->state(waiting).value() == sg::lifecycle::State::kRunning);
  CHECK_FALSE(h.rt.record(waiting).paused);
  CHECK(h.rt.record(paused).paused);
  CHECK(h.row_state(dies) == "lost");
  CHECK(h.row_state(killed) == "killed");
  CHECK(h.rt.record("rowless").killed);
  for (const std::string& id : {running, paused, waiting}) {
    CHECK(h.rt.record(id).recovers == 1);
    check_consistent(h, id);
  }
  // They serve as before: connect resumes the paused one, kill ends them.
  REQUIRE(h.svc->connect(h.tenant.id, paused, 60));
  CHECK_FALSE(h.rt.record(paused).paused);
  for (const std::string& id : {running, paused, waiting}) REQUIRE(h.svc->kill(h.tenant.id, id));
  CHECK(h.rt.unkilled().empty());
}

TEST_CASE("lifecycle core: a runtime whose sandboxes do not outlive sandgate: the next start marks them lost") {
  Harness h;
  std::string a = h.create();
  h.svc.reset();  // a crash: nothing stopped in order
  h.svc = std::make_unique<SandboxService>(*h.store, h.rt, ServiceConfig{}, [&h] { return h.now; });
  REQUIRE(h.svc->recover());
  CHECK(h.row_state(a) == "lost");
  CHECK(h.svc->live_count() == 0);
}

TEST_CASE("lifecycle core: a snapshot is a template of the sandbox's files; a failed copy or the quota leaves nothing") {
  sg::test::TempDir layers;
  ServiceConfig cfg = with_snapshots(layers);
  cfg.template_max_bytes = 1 << 20;
  Harness h(cfg);
  std::string id = h.create();
  auto snap = h.svc->snapshot(h.tenant.id, id, "");
  REQUIRE_MESSAGE(snap, (snap ? "" : snap.error().message()));
  CHECK(snap->sandbox_id == id);
  auto t = h.store->resolve_template(h.tenant.id, snap->template_id + ":default");
  REQUIRE(t);
  REQUIRE(*t);
  CHECK((*t)->status == "ready");
  auto layers_json = nlohmann::json::parse((*t)->layers);
  REQUIRE(layers_json.size() == 1);
  CHECK(sg::sys::read_file(layers_json[0].get<std::string>() + "/layer").value() == id);
  // A sandbox from it runs it.
  CreateParams p = h.params();
  p.template_ref = snap->template_id;
  std::string child = h.create(p);
  CHECK(h.rt.record(child).spec.layers.size() == 1);

  // The copy fails (a full disk): no layer, no template, the sandbox runs on.
  auto before = h.store->list_snapshots(h.tenant.id, "", "", 0, 100);
  REQUIRE(before);
  h.rt.fail_at(FakeRuntime::Op::kExport, 1);
  auto failed = h.svc->snapshot(h.tenant.id, id, "full");
  REQUIRE_FALSE(failed);
  CHECK(failed.error().message().find("No space left") != std::string::npos);
  auto after = h.store->list_snapshots(h.tenant.id, "", "", 0, 100);
  REQUIRE(after);
  CHECK(after->size() == before->size());
  CHECK_FALSE(h.store->resolve_template(h.tenant.id, "full").value());
  size_t dirs = 0;
  for (const auto& e : std::filesystem::directory_iterator(cfg.snapshot_dir)) dirs += e.is_directory();
  CHECK(dirs == 1);  // the first snapshot's only
  CHECK(h.svc->state(id).value() == sg::lifecycle::State::kRunning);

  // Past the tenant's template storage: refused, nothing kept.
  h.store->add_template_file({layers.sub("big"), h.tenant.id, sg::storage::kFileLayer, "x", 2 << 20, h.now, h.now});
  auto over = h.svc->snapshot(h.tenant.id, id, "over");
  REQUIRE_FALSE(over);
  CHECK(over.error().kind() == ErrorKind::kQuota);
  dirs = 0;
  for (const auto& e : std::filesystem::directory_iterator(cfg.snapshot_dir)) dirs += e.is_directory();
  CHECK(dirs == 1);
  // Unknown and other tenants' sandboxes: not found.
  CHECK(h.svc->snapshot(h.tenant.id, "nosuch", "").error().kind() == ErrorKind::kNotFound);
  CHECK(h.svc->snapshot("other-tenant", id, "").error().kind() == ErrorKind::kNotFound);
  for (const std::string& s : {id, child}) REQUIRE(h.svc->kill(h.tenant.id, s));
}

TEST_CASE("lifecycle core: a filesystem-only pause keeps the files, ends the processes, and connect starts them again; it survives a restart") {
  using sg::lifecycle::State;
  sg::test::TempDir layers;
  ServiceConfig cfg = with_snapshots(layers);
  Harness h(cfg);
  std::string id = h.create();
  int first_pid = h.rt.record(id).pid;
  REQUIRE(h.svc->pause(h.tenant.id, id, /*keep_memory=*/false));
  CHECK(h.row_state(id) == "paused");
  CHECK(h.svc->state(id).value() == State::kPersisted);
  CHECK(h.rt.record(id).killed);  // its processes and memory are gone
  auto files = h.store->paused_files(id);
  REQUIRE(files);
  REQUIRE(*files);
  CHECK(h.svc->pause(h.tenant.id, id, false).error().kind() == ErrorKind::kConflict);
  CHECK(h.svc->pause(h.tenant.id, id).error().kind() == ErrorKind::kConflict);
  // Traffic does not wake it: only connect does.
  CHECK(h.svc->open_port(id, 49983, h.envd_request(id)).error().kind() == ErrorKind::kConflict);
  CHECK(h.svc->snapshot(h.tenant.id, id, "").error().kind() == ErrorKind::kConflict);

  // A restart (the fake runtime's sandboxes do not outlive it): still paused, from its files.
  h.svc->shutdown();
  h.svc = std::make_unique<SandboxService>(*h.store, h.rt, cfg, [&h] { return h.now; });
  REQUIRE(h.svc->recover());
  CHECK(h.row_state(id) == "paused");
  CHECK(h.svc->state(id).value() == State::kPersisted);

  auto c = h.svc->connect(h.tenant.id, id, 60);
  REQUIRE_MESSAGE(c, (c ? "" : c.error().message()));
  CHECK(c->resumed);
  CHECK(h.row_state(id) == "running");
  CHECK(h.svc->state(id).value() == State::kRunning);
  FakeRuntime::Record rec = h.rt.record(id);
  CHECK_FALSE(rec.killed);
  CHECK(rec.pid != first_pid);
  // The same id and token, on the pause's files.
  auto row = h.store->get_sandbox(h.tenant.id, id);
  REQUIRE(row);
  CHECK(rec.spec.envd_access_token == (*row)->envd_token);
  CHECK(rec.spec.layers == std::vector<std::string>{nlohmann::json::parse((*files)->layers)[0].get<std::string>()});
  CHECK((*row)->init_pid == rec.pid);

  // A copy that fails leaves it running, as its row says.
  h.rt.fail_at(FakeRuntime::Op::kExport, 1);
  CHECK_FALSE(h.svc->pause(h.tenant.id, id, false));
  CHECK(h.row_state(id) == "running");
  CHECK(h.svc->state(id).value() == State::kRunning);
  CHECK_FALSE(h.rt.record(id).killed);

  // Paused again without memory, then killed: its files go with it.
  REQUIRE(h.svc->pause(h.tenant.id, id, false));
  REQUIRE(h.svc->kill(h.tenant.id, id));
  CHECK(h.row_state(id) == "killed");
  CHECK_FALSE(h.store->paused_files(id).value());
  CHECK(h.rt.unkilled().empty());
}

TEST_CASE("lifecycle core: where snapshots keep memory (kvm) every pause goes to disk and traffic resumes it; memory asked elsewhere is 400") {
  using sg::lifecycle::State;
  sg::test::TempDir layers;
  ServiceConfig cfg = with_snapshots(layers);
  Harness h(cfg);
  std::string plain = h.create();
  // Files only here: a snapshot asked with its memory is refused, nothing made.
  auto refused = h.svc->snapshot(h.tenant.id, plain, "", /*with_memory=*/true);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().kind() == ErrorKind::kInvalid);
  CHECK(h.store->list_snapshots(h.tenant.id, "", "", 0, 100).value().empty());

  h.rt.set_snapshots_memory(true);
  CreateParams p = h.params();
  p.auto_resume = true;
  std::string id = h.create(p);
  int first_pid = h.rt.record(id).pid;
  // A pause that asks to keep the memory goes to disk too.
  REQUIRE(h.svc->pause(h.tenant.id, id, /*keep_memory=*/true));
  CHECK(h.row_state(id) == "paused");
  CHECK(h.svc->state(id).value() == State::kPersisted);
  CHECK(h.rt.record(id).killed);
  // Traffic resumes it (autoResume), from its snapshot: same id and token.
  auto fd = h.svc->open_port(id, 49983, h.envd_request(id));
  REQUIRE_MESSAGE(fd, (fd ? "" : fd.error().message()));
  CHECK(h.row_state(id) == "running");
  CHECK(h.svc->state(id).value() == State::kRunning);
  CHECK(h.rt.record(id).pid != first_pid);
  CHECK(h.rt.record(id).spec.envd_access_token == h.store->get_sandbox(h.tenant.id, id).value()->envd_token);
  REQUIRE(h.svc->snapshot(h.tenant.id, id, "", /*with_memory=*/true));
  for (const std::string& s : {plain, id}) REQUIRE(h.svc->kill(h.tenant.id, s));
}

namespace {
std::string pause_layer(Harness& h, const std::string& id) {
  auto files = h.store->paused_files(id).value();
  REQUIRE(files);
  nlohmann::json l = nlohmann::json::parse(files->layers);
  REQUIRE(l.is_array());
  REQUIRE_FALSE(l.empty());
  return l.back().get<std::string>();
}
// Snapshots on, microVM pauses packed by packer.
ServiceConfig with_packer(sg::test::TempDir& dir, sg::memory::PausePacker& packer) {
  ServiceConfig cfg = with_snapshots(dir);
  cfg.pause_packer = &packer;
  return cfg;
}
ino_t inode_of(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_ino;
}
}  // namespace

TEST_CASE("lifecycle core: a microVM's pause keeps its memory packed against its base, and a resume unpacks and checks it") {
  using sg::lifecycle::State;
  sg::test::TempDir layers;
  sg::memory::PausePacker packer;
  Harness h(with_packer(layers, packer));
  h.rt.set_snapshots_memory(true);
  // The memory the sandbox was restored from: 6 zero pages and 2 others,
  // so the pause differs from it in its last 2 pages.
  const std::string base = layers.sub("template-memory");
  REQUIRE(sg::sys::write_file(base, std::string(6 * 4096, '\0') + std::string(2 * 4096, 'x')));
  h.rt.set_template_memory(base);
  std::string id = h.create();
  REQUIRE(h.svc->pause(h.tenant.id, id, true));
  std::string dir = pause_layer(h, id);
  CHECK_FALSE(sg::sys::path_exists(dir + "/memory"));
  CHECK(sg::sys::path_exists(dir + "/memory.sgm"));
  CHECK(inode_of(dir + "/memory.base") == inode_of(base));
  // The tenant's storage counts the packed pause, not the RAM nor the base.
  bool counted = false;
  const auto files = h.store->template_files().value();
  for (const auto& f : files)
    if (f.path == dir) {
      counted = true;
      CHECK(f.bytes > 0);
      CHECK(f.bytes < static_cast<int64_t>(FakeRuntime::vm_memory(id).size()));
    }
  CHECK(counted);
  // Resumed: the memory is whole again before the sandbox is restored.
  REQUIRE(h.svc->connect(h.tenant.id, id, 60));
  CHECK(h.svc->state(id).value() == State::kRunning);
  CHECK(sg::sys::read_file(dir + "/memory", 1 << 20).value() == FakeRuntime::vm_memory(id));

  // It runs from that memory now, and is paused again: packed against the
  // first base, not the pause it came from.
  h.rt.set_template_memory(dir + "/memory");
  REQUIRE(h.svc->pause(h.tenant.id, id, true));
  std::string dir2 = pause_layer(h, id);
  REQUIRE(dir2 != dir);
  CHECK(inode_of(dir2 + "/memory.base") == inode_of(base));
  // Damaged on disk: the resume is refused with why, nothing is restored
  // from it, and the sandbox stays paused with its files.
  {
    std::fstream f(dir2 + "/memory.sgm", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.put('\x7f');
  }
  int creates = h.rt.calls(Op::kCreate);
  auto refused = h.svc->connect(h.tenant.id, id, 60);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().message().find("checksum mismatch") != std::string::npos);
  CHECK(h.rt.calls(Op::kCreate) == creates);
  CHECK(h.svc->state(id).value() == State::kPersisted);
  CHECK(h.row_state(id) == "paused");
  CHECK_FALSE(sg::sys::path_exists(dir2 + "/memory"));
  REQUIRE(h.svc->kill(h.tenant.id, id));
  CHECK_FALSE(h.store->paused_files(id).value());
}

TEST_CASE("lifecycle core: a pause whose memory cannot be packed keeps it as written and resumes the same") {
  using sg::lifecycle::State;
  sg::test::TempDir layers;
  sg::memory::PausePacker packer;
  Harness h(with_packer(layers, packer));
  h.rt.set_snapshots_memory(true);
  h.rt.set_template_memory(layers.sub("no-such-base"));  // gone: nothing to pack against
  std::string id = h.create();
  REQUIRE(h.svc->pause(h.tenant.id, id, true));
  std::string dir = pause_layer(h, id);
  CHECK(sg::sys::read_file(dir + "/memory", 1 << 20).value() == FakeRuntime::vm_memory(id));
  CHECK_FALSE(sg::sys::path_exists(dir + "/memory.sgm"));
  CHECK_FALSE(sg::sys::path_exists(dir + "/memory.base"));
  REQUIRE(h.svc->connect(h.tenant.id, id, 60));
  CHECK(h.svc->state(id).value() == State::kRunning);
  REQUIRE(h.svc->kill(h.tenant.id, id));
}

TEST_CASE("lifecycle core: a timeout with autoPauseMemory false pauses to disk") {
  using sg::lifecycle::State;
  sg::test::TempDir layers;
  ServiceConfig cfg = with_snapshots(layers);
  Harness h(cfg);
  CreateParams p = h.params(10);
  p.on_timeout_pause = true;
  p.on_timeout_pause_files = true;
  std::string id = h.create(p);
  h.now += 11;
  h.svc->tick();
  CHECK(h.row_state(id) == "paused");
  CHECK(h.svc->state(id).value() == State::kPersisted);
  CHECK(h.rt.record(id).killed);
  REQUIRE(h.svc->connect(h.tenant.id, id, 60));
  CHECK(h.svc->state(id).value() == State::kRunning);
  REQUIRE(h.svc->kill(h.tenant.id, id));
}

TEST_CASE("lifecycle core: a filesystem-only pause cut short by a crash: the next start takes the sandbox back as it is, paused, and forgets the copy") {
  using sg::lifecycle::State;
  sg::test::TempDir layers;
  ServiceConfig cfg = with_snapshots(layers);
  Harness h(cfg);
  h.rt.set_outlive(true);
  std::string id = h.create();
  // The copy and the row are made, then the processes cannot be ended
  // (both kills fail) and sandgate crashes before a tick retries.
  h.rt.fail_next(FakeRuntime::Op::kKill, 2);
  REQUIRE(h.svc->pause(h.tenant.id, id, false));
  CHECK(h.row_state(id) == "paused");
  REQUIRE(h.store->paused_files(id).value());
  h.rt.clear_faults();
  h.svc.reset();  // a crash: no stop in order

  h.svc = std::make_unique<SandboxService>(*h.store, h.rt, cfg, [&h] { return h.now; });
  REQUIRE(h.svc->recover());
  // Its processes were still there: it is paused with them (more than was
  // asked), and the copy is not what it runs.
  CHECK(h.svc->state(id).value() == State::kPaused);
  CHECK(h.rt.record(id).recovers == 1);
  CHECK_FALSE(h.store->paused_files(id).value());
  auto c = h.svc->connect(h.tenant.id, id, 60);
  REQUIRE(c);
  CHECK(h.row_state(id) == "running");
  REQUIRE(h.svc->kill(h.tenant.id, id));
  CHECK(h.rt.unkilled().empty());
}

// Each lifecycle operation with its Nth runtime call failing, for every N
// up to the number of runtime calls the operation makes: the operation
// reports an error (or copes), and afterwards the row, the runtime and the
// service agree, nothing leaks, and the sandbox can still be killed.
TEST_CASE("lifecycle core: every runtime fault in every operation leaves a legal, leak-free state") {
  struct Step {
    const char* name;
    bool paused_first;  // the operation starts from a paused sandbox
    std::function<void(Harness&, const std::string&)> run;
  };
  std::vector<Step> steps = {
      {"pause", false, [](Harness& h, const std::string& id) { (void)h.svc->pause(h.tenant.id, id); }},
      {"connect", true, [](Harness& h, const std::string& id) { (void)h.svc->connect(h.tenant.id, id, 60); }},
      {"traffic", true,
       [](Harness& h, const std::string& id) { (void)h.svc->open_port(id, 49983, h.envd_request(id)); }},
      {"kill", false, [](Harness& h, const std::string& id) { (void)h.svc->kill(h.tenant.id, id); }},
      {"wait pause+resume", false,
       [](Harness& h, const std::string& id) {
         (void)h.svc->wait_pause(id);
         (void)h.svc->wait_resume(id);
       }},
      {"wait pause+offload+resume", false,
       [](Harness& h, const std::string& id) {
         std::atomic<bool> cancel{false};
         (void)h.svc->wait_pause(id);
         (void)h.svc->wait_offload(id, cancel);
         (void)h.svc->wait_resume(id);
       }},
      {"timeout pause", false,
       [](Harness& h, const std::string& id) {
         h.now += 10'000;
         h.svc->tick();
       }},
      {"tick", false, [](Harness& h, const std::string&) { h.svc->tick(); }},
  };
  const Op ops[] = {Op::kPause, Op::kResume, Op::kKill, Op::kUsage, Op::kOpenPort, Op::kControl};
  int fired = 0;
  for (const Step& step : steps) {
    for (Op op : ops) {
      for (int n = 1; n <= 2; ++n) {
        Harness h({}, true);
        CreateParams p = h.params(300);
        p.on_timeout_pause = std::string(step.name) == "timeout pause";
        std::string id = h.create(p);
        if (step.paused_first) REQUIRE(h.svc->pause(h.tenant.id, id));
        h.rt.fail_at(op, n);
        step.run(h, id);
        fired += h.rt.faults_fired();
        h.rt.clear_faults();
        INFO(std::string(step.name) << ": call " << n << " of op " << static_cast<int>(op) << " failed");
        CHECK(h.rt.leaked().empty());  // a handle whose kill failed is kept, not dropped
        h.svc->tick();                 // which kills it again
        check_consistent(h, id);
        // Whatever happened, a kill ends it cleanly.
        (void)h.svc->kill(h.tenant.id, id);
        CHECK(h.rt.unkilled().empty());
        CHECK(h.svc->live_count() == 0);
      }
    }
  }
  CHECK(fired >= 10);  // the loop did inject faults
}

TEST_CASE("lifecycle core: a create the runtime fails leaves a failed row and nothing running") {
  Harness h;
  h.rt.fail_at(Op::kCreate, 1);
  auto r = h.svc->create(h.tenant, h.params());
  REQUIRE_FALSE(r);
  CHECK(r.error().kind() == ErrorKind::kInternal);
  auto rows = h.store->list_sandboxes(sg::storage::SandboxQuery{h.tenant.id});
  REQUIRE(rows);
  CHECK(rows->empty());  // a failed create is not listed
  CHECK(h.svc->live_count() == 0);
  CHECK(h.rt.unkilled().empty());
  // The quota slot is free again: the next create works.
  CHECK(h.svc->create(h.tenant, h.params()));
}

TEST_CASE("lifecycle core: a sandbox whose kill keeps failing is ended for clients and killed by later ticks") {
  Harness h;
  std::string id = h.create();
  h.rt.fail_next(Op::kKill, 3);  // the kill, its retry, and the first tick's
  CHECK_FALSE(h.svc->kill(h.tenant.id, id));
  CHECK(h.row_state(id) == "killed");
  CHECK(h.svc->live_count() == 0);
  CHECK_FALSE(h.rt.record(id).killed);
  CHECK(h.rt.leaked().empty());  // still held: not dropped
  h.svc->tick();
  CHECK_FALSE(h.rt.record(id).killed);
  h.svc->tick();
  CHECK(h.rt.record(id).killed);
  CHECK(h.rt.record(id).kills == 4);
  CHECK(h.rt.unkilled().empty());
}

TEST_CASE("lifecycle core: an offload moves a wait-paused sandbox to offloaded; the wait's resume prefetches") {
  using sg::lifecycle::State;
  Harness h({}, true);
  std::string id = h.create();
  std::atomic<bool> cancel{false};
  // Only a wait-paused sandbox is offloaded.
  CHECK(h.svc->wait_offload(id, cancel).error().kind() == ErrorKind::kConflict);
  REQUIRE(h.svc->wait_pause(id));
  REQUIRE(h.svc->wait_offload(id, cancel));
  CHECK(h.svc->state(id).value() == State::kOffloaded);
  CHECK(h.memory.last_cohort == h.tenant.id + "/tpl-base");
  CHECK(h.row_state(id) == "running");  // invisible to clients
  CHECK(h.svc->wait_offload(id, cancel).error().kind() == ErrorKind::kConflict);  // once per wait
  REQUIRE(h.svc->wait_resume(id));
  CHECK(h.svc->state(id).value() == State::kRunning);
  CHECK(h.memory.prefetches == 1);
  CHECK_FALSE(h.rt.record(id).paused);
  // A refused offload leaves it wait-paused, whole.
  h.memory.fail_offload = true;
  REQUIRE(h.svc->wait_pause(id));
  CHECK(h.svc->wait_offload(id, cancel).error().kind() == ErrorKind::kQuota);
  CHECK(h.svc->state(id).value() == State::kWaitPaused);
  // A client's pause while offloaded wins over the wait's resume.
  h.memory.fail_offload = false;
  REQUIRE(h.svc->wait_offload(id, cancel));
  REQUIRE(h.svc->pause(h.tenant.id, id));
  CHECK(h.svc->state(id).value() == State::kPaused);
  REQUIRE(h.svc->wait_resume(id));
  CHECK(h.svc->state(id).value() == State::kPaused);
  REQUIRE(h.svc->kill(h.tenant.id, id));
  CHECK(h.memory.forgets == 1);
}

TEST_CASE("lifecycle core: a sandbox whose memory was lost is ended as lost by the next tick") {
  Harness h({}, true);
  std::string id = h.create();
  REQUIRE(h.svc->wait_pause(id));
  std::atomic<bool> cancel{false};
  REQUIRE(h.svc->wait_offload(id, cancel));
  h.memory.lost.emplace_back(id, "pool record unreadable");
  h.svc->tick();
  CHECK(h.row_state(id) == "lost");
  CHECK(h.rt.record(id).killed);
  CHECK(h.svc->live_count() == 0);
  CHECK(h.svc->memory_in_use() == 0);
}

// The egress policy table (network/egress_policies.h): the core writes each
// live sandbox's policy at create, replaces it on a network update (which
// tells the listener, the egress proxy in the gateway) and removes it at
// the end; a sandbox that may not get out is never in it.
TEST_CASE("lifecycle core: each live sandbox's egress policy is in the table from create to end") {
  struct Listener : sg::network::EgressPolicies::Listener {
    std::vector<std::string> changed;
    void policy_changed(const std::string& id) override { changed.push_back(id); }
  } listener;
  sg::network::EgressPolicies policies;
  policies.listen(&listener);
  ServiceConfig cfg;
  cfg.egress = true;
  cfg.egress_policies = &policies;
  Harness h(cfg);
  CreateParams p = h.params();
  p.network.allow_internet = false;
  p.network.allow_out = {"example.com"};
  p.network.egress = *sg::network::parse_egress_policy({"example.com"}, {}, false);
  std::string id = h.create(p);
  auto pol = policies.get(id);
  REQUIRE(pol);
  CHECK_FALSE(pol->internet);
  CHECK(pol->allow_names == std::vector<std::string>{"example.com"});
  CHECK(listener.changed == std::vector<std::string>{id});

  sg::lifecycle::NetworkParams open;
  open.allow_internet = true;
  open.egress = *sg::network::parse_egress_policy({}, {}, true);
  REQUIRE(h.svc->update_network(h.tenant.id, id, open));
  CHECK(policies.get(id)->internet);
  CHECK(listener.changed.size() == 2);
  // Another tenant's update changes nothing.
  CHECK_FALSE(h.svc->update_network("t-other", id, sg::lifecycle::NetworkParams{}));
  CHECK(listener.changed.size() == 2);

  REQUIRE(h.svc->kill(h.tenant.id, id));
  CHECK_FALSE(policies.get(id));
  CHECK(listener.changed.size() == 3);
  CHECK(policies.size() == 0);
  policies.unlisten(&listener);
}
