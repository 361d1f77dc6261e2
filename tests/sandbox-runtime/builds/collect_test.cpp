// BuildService's collection of template files (build_service.h,
// collect_garbage) and its quotas at build start, on a real store and real
// directories, with a FakeRuntime and no workers: what a tag, a template
// row or a live sandbox uses stays; the unused go when their template is
// deleted or when unused past keep_unused.
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <sys/time.h>

#include <vector>

#include "base/sys.h"
#include "sandbox-runtime/builds/build_service.h"
#include "tests/support/fake_runtime.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_store.h"

using namespace sg;

namespace {

struct Fixture {
  test::TempDir dir;
  std::unique_ptr<storage::Store> store = test::open_store_with_base(dir);
  test::FakeRuntime rt;
  int64_t now = 1'000'000;
  std::unique_ptr<builds::BuildService> svc;

  std::vector<std::string> dropped;  // drop_prepared's calls (the kvm runtime's image and snapshots)

  Fixture() {
    storage::TenantRow t;
    t.id = "t1";
    t.name = "acme";
    t.max_sandboxes = 10;
    t.max_memory_mb = 100000;
    REQUIRE(store->insert_tenant(t));
    builds::BuildConfig c;
    c.data_dir = dir.sub("data");
    c.workers = 0;
    c.clock = [this] { return now; };
    c.keep_unused = std::chrono::seconds(100);
    c.tenant_max_bytes = 1 << 20;
    c.tenant_max_builds = 1;
    c.drop_prepared = [this](const std::string& root) {
      dropped.push_back(root);
      return uint64_t{4096};
    };
    svc = std::make_unique<builds::BuildService>(*store, rt, c);
  }

  // A directory of `kb` KiB under data/, recorded as a template file.
  std::string file(const std::string& name, const char* kind, const std::string& template_id, int kb,
                   int64_t used_at) {
    std::string p = dir.sub("data/" + name);
    REQUIRE(sys::make_dirs(p, 0755));
    REQUIRE(sys::write_file(p + "/f", std::string(static_cast<size_t>(kb) * 1024, 'x')));
    REQUIRE(store->add_template_file(storage::TemplateFileRow{p, "t1", kind, template_id,
                                                              static_cast<int64_t>(sys::disk_usage(p)), used_at,
                                                              used_at}));
    return p;
  }

  // A ready build of template `name` (tags: none = default) with layers.
  std::string build(const std::string& name, std::vector<std::string> layers, std::vector<std::string> tags = {}) {
    static int n = 0;
    storage::TemplateRow fresh;
    fresh.id = "tpl-" + name;
    fresh.status = "building";
    storage::BuildRow b;
    b.id = "b" + std::to_string(++n);
    b.created_at = now;
    b.tags = std::move(tags);
    REQUIRE(store->request_build("t1", name, fresh, b));
    REQUIRE(store->start_build(b.id, now));
    std::string json = "[";
    for (size_t i = 0; i < layers.size(); ++i) json += (i ? ",\"" : "\"") + layers[i] + "\"";
    json += "]";
    REQUIRE(store->finish_build(b.id, dir.sub("rootfs"), json, "{}", now));
    return b.id;
  }
};

bool exists(const std::string& p) { return sys::path_exists(p); }

}  // namespace

TEST_CASE("collection: what templates, tags and live sandboxes use stays; the rest goes when stale or deleted") {
  Fixture f;
  std::string tagged = f.file("layers/tagged", storage::kFileLayer, "tpl-app", 8, f.now);
  std::string cached = f.file("layers/cached", storage::kFileLayer, "tpl-app", 8, f.now);     // a failed build's step
  std::string stale = f.file("layers/stale", storage::kFileLayer, "tpl-app", 8, f.now - 500);  // unused for long
  std::string running = f.file("layers/running", storage::kFileLayer, "tpl-app", 8, f.now - 500);
  std::string gone = f.file("layers/gone", storage::kFileLayer, "tpl-old", 8, f.now);
  std::string upload_new = f.file("template-files/t1/new", storage::kFileUpload, "tpl-app", 4, f.now);
  std::string upload_old = f.file("template-files/t1/old", storage::kFileUpload, "tpl-app", 4, f.now - 500);

  f.build("app", {running});  // default, then moved off below
  std::string moved = f.build("app", {tagged});
  REQUIRE(f.store->assign_tags("t1", "app", {"default"}, f.now));
  (void)moved;
  // A sandbox still runs the first build (its tag moved on).
  storage::SandboxRow sb;
  sb.id = "sb1";
  sb.tenant_id = "t1";
  sb.template_id = "tpl-app";
  sb.build_id = "b1";
  sb.state = storage::kStateRunning;
  sb.backend = "process";
  sb.envd_token = "x";
  sb.envd_version = "0";
  sb.memory_mb = 1;
  REQUIRE(f.store->insert_sandbox_within_quota(sb, 10, 100000));
  // A deleted template: its layer goes at once, however recent.
  f.build("old", {gone});
  REQUIRE(f.store->delete_template("t1", "tpl-old", f.now));

  std::string blobs = f.dir.sub("data/images/blobs");
  REQUIRE(sys::make_dirs(blobs, 0755));
  REQUIRE(sys::write_file(blobs + "/sha256-old", "old"));
  REQUIRE(sys::write_file(blobs + "/sha256-new", "new"));
  struct timeval old_times[2] = {{f.now - 500, 0}, {f.now - 500, 0}};
  REQUIRE(::utimes((blobs + "/sha256-old").c_str(), old_times) == 0);
  struct timeval new_times[2] = {{f.now, 0}, {f.now, 0}};
  REQUIRE(::utimes((blobs + "/sha256-new").c_str(), new_times) == 0);

  int64_t before = *f.store->template_bytes("t1");
  Result<uint64_t> freed = f.svc->collect_garbage();
  REQUIRE(freed);
  CHECK(exists(tagged));
  CHECK(exists(cached));
  CHECK(exists(running));
  CHECK(exists(upload_new));
  CHECK_FALSE(exists(stale));
  CHECK_FALSE(exists(gone));
  CHECK_FALSE(exists(upload_old));
  CHECK_FALSE(exists(blobs + "/sha256-old"));
  CHECK(exists(blobs + "/sha256-new"));
  CHECK(*freed > 0);
  CHECK(*f.store->template_bytes("t1") < before);

  // The sandbox ends: its build's layer is unused now, and stale.
  REQUIRE(f.store->finish("sb1", storage::kStateKilled, "", f.now));
  REQUIRE(f.svc->collect_garbage());
  CHECK_FALSE(exists(running));
  CHECK(exists(tagged));
  // Time passes: the cache goes, what the template uses stays.
  f.now += 1000;
  REQUIRE(f.svc->collect_garbage());
  CHECK_FALSE(exists(cached));
  CHECK(exists(tagged));
  auto files = f.store->template_files();
  REQUIRE(files);
  REQUIRE(files->size() == 1);
  CHECK(files->front().path == tagged);
}

TEST_CASE("quotas at build start: stored bytes past the limit, and builds queued per tenant") {
  Fixture f;
  auto request = [&](const std::string& name) {
    auto r = f.svc->request("t1", name, {}, 1, 512);
    REQUIRE(r);
    return *r;
  };
  builds::BuildSpec spec;
  spec.from_template = "base";
  auto first = request("one");
  REQUIRE(f.svc->start("t1", first.tpl.id, first.build_id, spec));  // queued: no workers here
  auto second = request("two");
  Status busy = f.svc->start("t1", second.tpl.id, second.build_id, spec);
  REQUIRE_FALSE(busy);
  CHECK(busy.error().kind() == ErrorKind::kQuota);
  CHECK(busy.error().message().find("1 builds queued or running, the limit is 1") != std::string::npos);
  // The refused build is still waiting: nothing changed.
  CHECK(f.store->find_build(second.tpl.id, second.build_id)->value().status == storage::kBuildWaiting);

  f.file("layers/big", storage::kFileLayer, second.tpl.id, 1100, f.now);  // over 1 MiB
  f.svc->stop();  // the queued build fails; the queue is empty
  auto third = request("three");
  Status full = f.svc->start("t1", third.tpl.id, third.build_id, spec);
  REQUIRE_FALSE(full);
  CHECK(full.error().kind() == ErrorKind::kQuota);
  CHECK(full.error().message().find("the limit is 1 MiB") != std::string::npos);
}

TEST_CASE("upload links: signed for one template and hash, expire, and count against the tenant's storage") {
  Fixture f;
  auto r = f.svc->request("t1", "up", {}, 1, 512);
  REQUIRE(r);
  std::string hash(64, 'a');
  auto link = f.svc->file_link("t1", r->tpl.id, hash);
  REQUIRE(link);
  CHECK_FALSE(link->present);
  std::string query = link->target.substr(link->target.find('?') + 1);
  REQUIRE(f.svc->upload(r->tpl.id, hash, query, std::string(8192, 'x')));
  CHECK(f.svc->file_link("t1", r->tpl.id, hash)->present);
  int64_t kept = *f.store->template_bytes("t1");
  CHECK(kept >= 8192);
  // The same bytes again replace the row: counted once.
  REQUIRE(f.svc->upload(r->tpl.id, hash, query, std::string(8192, 'x')));
  CHECK(*f.store->template_bytes("t1") == kept);
  // Past its time the link is refused, saying so; the upload is unchanged.
  f.now += 3601;
  Status late = f.svc->upload(r->tpl.id, hash, query, "other");
  REQUIRE_FALSE(late);
  CHECK(late.error().kind() == ErrorKind::kUnauthorized);
  CHECK(late.error().message().find("expired") != std::string::npos);
  CHECK(*sys::read_file(f.dir.sub("data/template-files/t1/" + hash), 1 << 20) == std::string(8192, 'x'));
  // Past the storage limit an upload is refused.
  auto fresh = f.svc->file_link("t1", r->tpl.id, std::string(64, 'b'));
  REQUIRE(fresh);
  Status big = f.svc->upload(r->tpl.id, std::string(64, 'b'), fresh->target.substr(fresh->target.find('?') + 1),
                             std::string(1 << 20, 'y'));
  REQUIRE_FALSE(big);
  CHECK(big.error().kind() == ErrorKind::kQuota);
  CHECK_FALSE(sys::path_exists(f.dir.sub("data/template-files/t1/" + std::string(64, 'b'))));
}

TEST_CASE("collection: what the runtime made of a collected layer goes with it (drop_prepared), once") {
  Fixture f;
  std::string kept = f.file("layers/kept", storage::kFileLayer, "tpl-app", 8, f.now);
  std::string gone = f.file("layers/gone", storage::kFileLayer, "tpl-old", 8, f.now);
  f.build("app", {kept});
  f.build("old", {gone});
  REQUIRE(f.store->delete_template("t1", "tpl-old", f.now));
  Result<uint64_t> freed = f.svc->collect_garbage();
  REQUIRE(freed);
  CHECK(f.dropped == std::vector<std::string>{gone});
  CHECK(*freed >= 4096 + 8 * 1024);
  REQUIRE(f.svc->collect_garbage());
  CHECK(f.dropped.size() == 1);
}
