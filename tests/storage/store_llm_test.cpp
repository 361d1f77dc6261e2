// Store, model-proxy tables: keys, upstream precedence, usage batches and
// totals, tenant scoping, batched events.
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <limits>

#include "storage/store.h"
#include "tests/support/temp_dir.h"

using namespace sg;
using namespace sg::storage;

namespace {

TenantRow tenant(const std::string& id) {
  TenantRow t;
  t.id = id;
  t.name = "name-" + id;
  t.created_at = 1;
  t.max_sandboxes = 2;
  t.max_memory_mb = 1024;
  return t;
}

LlmKeyRow llm_key(const std::string& id, const std::string& tenant_id, const std::string& hash) {
  LlmKeyRow k;
  k.id = id;
  k.tenant_id = tenant_id;
  k.key_hash = hash;
  k.key_prefix = "sk-sg-abcdef...";
  k.name = "label " + id;
  k.created_at = 5;
  return k;
}

LlmUsageRow usage(const std::string& tenant_id, std::optional<std::string> sandbox_id, uint64_t in, uint64_t out) {
  LlmUsageRow r;
  r.at_ms = 1'700'000'000'000;
  r.tenant_id = tenant_id;
  r.sandbox_id = std::move(sandbox_id);
  r.provider = "openai";
  r.route = "/v1/chat/completions";
  r.model = "gpt-x";
  r.stream = true;
  r.status = 200;
  r.outcome = "completed";
  r.input_tokens = in;
  r.output_tokens = out;
  r.cache_read_tokens = 3;
  r.cache_write_tokens = 4;
  r.usage_found = true;
  r.duration_ms = 1234;
  r.wait_paused_ms = 1000;
  return r;
}

std::unique_ptr<Store> open_with_tenants(const test::TempDir& dir) {
  auto s = Store::open(dir.sub("llm.db"));
  REQUIRE(s.ok());
  REQUIRE((*s)->insert_tenant(tenant("a")).ok());
  REQUIRE((*s)->insert_tenant(tenant("b")).ok());
  return std::move(*s);
}

}  // namespace

TEST_CASE("llm keys: the hash finds the tenant until the key is revoked or the tenant disabled") {
  test::TempDir dir;
  auto s = open_with_tenants(dir);
  REQUIRE(s->insert_llm_key(llm_key("lk1", "a", "h1")).ok());
  REQUIRE(s->insert_llm_key(llm_key("lk2", "a", "h2")).ok());
  REQUIRE(s->insert_llm_key(llm_key("lk3", "b", "h3")).ok());
  auto t = s->tenant_for_llm_key_hash("h1");
  REQUIRE(t.ok());
  REQUIRE(t->has_value());
  CHECK((*t)->id == "a");
  CHECK((*t)->name == "name-a");
  CHECK((*t)->max_sandboxes == 2);
  CHECK_FALSE((*s->tenant_for_llm_key_hash("nope")).has_value());
  // An E2B key hash is not a model-proxy key hash, nor the other way round.
  REQUIRE(s->insert_key({"k1", "a", "e2bhash", "e2b_...", 1, std::nullopt}).ok());
  CHECK_FALSE((*s->tenant_for_llm_key_hash("e2bhash")).has_value());
  CHECK_FALSE((*s->tenant_for_key_hash("h1")).has_value());

  // A duplicate hash is refused, not silently shared.
  CHECK_FALSE(s->insert_llm_key(llm_key("lk9", "b", "h1")).ok());
  // The tenant must exist.
  CHECK_FALSE(s->insert_llm_key(llm_key("lk8", "nobody", "h8")).ok());

  CHECK(*s->revoke_llm_key("lk1", 9));
  CHECK_FALSE(*s->revoke_llm_key("lk1", 10));
  CHECK_FALSE(*s->revoke_llm_key("missing", 10));
  CHECK_FALSE((*s->tenant_for_llm_key_hash("h1")).has_value());
  CHECK((*s->tenant_for_llm_key_hash("h2")).has_value());

  // Tenant scoping of listings.
  auto la = *s->list_llm_keys("a");
  REQUIRE(la.size() == 2);
  CHECK(la[0].id == "lk1");
  CHECK(la[0].revoked_at == 9);
  CHECK(la[0].name == "label lk1");
  CHECK(la[0].key_prefix == "sk-sg-abcdef...");
  CHECK_FALSE(la[1].revoked_at.has_value());
  auto lb = *s->list_llm_keys("b");
  REQUIRE(lb.size() == 1);
  CHECK(lb[0].id == "lk3");

  // revoke_tenant revokes both kinds of keys and counts them.
  CHECK(*s->revoke_tenant("a", 20) == 2);
  CHECK_FALSE((*s->tenant_for_llm_key_hash("h2")).has_value());
  CHECK((*s->list_llm_keys("a"))[1].revoked_at == 20);
  CHECK((*s->tenant_for_llm_key_hash("h3")).has_value());
}

TEST_CASE("llm keys: a disabled tenant's unrevoked key does not authenticate") {
  test::TempDir dir;
  auto s = open_with_tenants(dir);
  REQUIRE(s->insert_llm_key(llm_key("lk1", "a", "h1")).ok());
  {
    auto tx = s->db().lock();
    REQUIRE(tx.exec("UPDATE tenants SET disabled = 1 WHERE id = 'a'").ok());
  }
  CHECK_FALSE((*s->tenant_for_llm_key_hash("h1")).has_value());
  CHECK_FALSE((*s->list_llm_keys("a"))[0].revoked_at.has_value());
}

TEST_CASE("upstreams: the tenant's own beats the global one, per provider") {
  test::TempDir dir;
  auto s = open_with_tenants(dir);
  CHECK_FALSE((*s->find_upstream("a", "openai")).has_value());
  REQUIRE(s->upsert_upstream({"", "openai", "https://global.example", "sk-global", 1}).ok());
  auto g = *s->find_upstream("a", "openai");
  REQUIRE(g.has_value());
  CHECK(g->tenant_id == "");
  CHECK(g->base_url == "https://global.example");
  CHECK(g->api_key == "sk-global");
  REQUIRE(s->upsert_upstream({"a", "openai", "https://a.example", "sk-a", 2}).ok());
  auto own = *s->find_upstream("a", "openai");
  REQUIRE(own.has_value());
  CHECK(own->tenant_id == "a");
  CHECK(own->api_key == "sk-a");
  CHECK(own->updated_at == 2);
  // Tenant b still gets the global one; nobody gets another provider's.
  CHECK((*s->find_upstream("b", "openai"))->tenant_id == "");
  CHECK_FALSE((*s->find_upstream("a", "anthropic")).has_value());
  REQUIRE(s->upsert_upstream({"b", "anthropic", "https://b.example", "sk-ant-b", 3}).ok());
  CHECK_FALSE((*s->find_upstream("a", "anthropic")).has_value());
  CHECK((*s->find_upstream("b", "anthropic"))->base_url == "https://b.example");

  // Upsert replaces in place.
  REQUIRE(s->upsert_upstream({"a", "openai", "https://a2.example/v1", "sk-a2", 4}).ok());
  auto replaced = *s->find_upstream("a", "openai");
  CHECK(replaced->base_url == "https://a2.example/v1");
  CHECK(replaced->api_key == "sk-a2");
  CHECK(replaced->updated_at == 4);

  auto all = *s->list_upstreams();
  REQUIRE(all.size() == 3);
  CHECK(all[0].tenant_id == "");
  CHECK(all[1].tenant_id == "a");
  CHECK(all[2].tenant_id == "b");

  // Removing the tenant's own falls back to the global one.
  CHECK(*s->remove_upstream("a", "openai"));
  CHECK_FALSE(*s->remove_upstream("a", "openai"));
  CHECK((*s->find_upstream("a", "openai"))->tenant_id == "");
  CHECK(*s->remove_upstream("", "openai"));
  CHECK_FALSE((*s->find_upstream("a", "openai")).has_value());
  CHECK(s->list_upstreams()->size() == 1);
}

TEST_CASE("llm usage: a batch is stored whole, read back in order, scoped to its tenant") {
  test::TempDir dir;
  auto s = open_with_tenants(dir);
  std::vector<LlmUsageRow> batch;
  for (int i = 0; i < 5; ++i) batch.push_back(usage("a", i % 2 ? std::optional<std::string>("sb1") : std::nullopt, 10 + i, 100));
  batch.push_back(usage("b", std::string("sb1"), 7, 7));
  batch[2].outcome = "client_gone";
  batch[2].status = 0;
  batch[2].stream = false;
  batch[2].usage_found = false;
  REQUIRE(s->insert_llm_usage(batch).ok());
  REQUIRE(s->insert_llm_usage({}).ok());

  LlmUsageQuery q;
  q.tenant_id = "a";
  auto rows = *s->list_llm_usage(q);
  REQUIRE(rows.size() == 5);
  for (size_t i = 1; i < rows.size(); ++i) CHECK(rows[i].seq > rows[i - 1].seq);
  for (const auto& r : rows) CHECK(r.tenant_id == "a");
  CHECK(rows[0].input_tokens == 10);
  CHECK(rows[4].input_tokens == 14);
  CHECK_FALSE(rows[0].sandbox_id.has_value());
  CHECK(rows[1].sandbox_id == "sb1");
  CHECK(rows[0].at_ms == 1'700'000'000'000);
  CHECK(rows[0].provider == "openai");
  CHECK(rows[0].route == "/v1/chat/completions");
  CHECK(rows[0].model == "gpt-x");
  CHECK(rows[0].stream);
  CHECK(rows[0].status == 200);
  CHECK(rows[0].outcome == "completed");
  CHECK(rows[0].output_tokens == 100);
  CHECK(rows[0].cache_read_tokens == 3);
  CHECK(rows[0].cache_write_tokens == 4);
  CHECK(rows[0].usage_found);
  CHECK(rows[0].duration_ms == 1234);
  CHECK(rows[0].wait_paused_ms == 1000);
  CHECK(rows[2].outcome == "client_gone");
  CHECK(rows[2].status == 0);
  CHECK_FALSE(rows[2].stream);
  CHECK_FALSE(rows[2].usage_found);

  // Sandbox filter, still tenant-scoped: b's sb1 row never shows for a.
  q.sandbox_id = "sb1";
  auto sb = *s->list_llm_usage(q);
  REQUIRE(sb.size() == 2);
  CHECK(sb[0].input_tokens == 11);
  CHECK(sb[1].input_tokens == 13);

  // Paging by cursor.
  q.sandbox_id.reset();
  q.limit = 2;
  auto p1 = *s->list_llm_usage(q);
  REQUIRE(p1.size() == 2);
  q.after_seq = p1.back().seq;
  auto p2 = *s->list_llm_usage(q);
  REQUIRE(p2.size() == 2);
  CHECK(p2[0].input_tokens == 12);
  q.after_seq = p2.back().seq;
  q.limit = 100;
  auto p3 = *s->list_llm_usage(q);
  REQUIRE(p3.size() == 1);
  CHECK(p3[0].input_tokens == 14);
  q.limit = 0;
  q.after_seq = 0;
  CHECK(s->list_llm_usage(q)->empty());

  LlmUsageQuery qb;
  qb.tenant_id = "b";
  auto rb = *s->list_llm_usage(qb);
  REQUIRE(rb.size() == 1);
  CHECK(rb[0].input_tokens == 7);
  LlmUsageQuery qc;
  qc.tenant_id = "nobody";
  CHECK(s->list_llm_usage(qc)->empty());

  auto ta = *s->llm_usage_totals("a", std::nullopt);
  CHECK(ta.requests == 5);
  CHECK(ta.input_tokens == 10 + 11 + 12 + 13 + 14);
  CHECK(ta.output_tokens == 500);
  CHECK(ta.cache_read_tokens == 15);
  CHECK(ta.cache_write_tokens == 20);
  auto tsb = *s->llm_usage_totals("a", std::string("sb1"));
  CHECK(tsb.requests == 2);
  CHECK(tsb.input_tokens == 24);
  auto tb = *s->llm_usage_totals("b", std::string("sb1"));
  CHECK(tb.requests == 1);
  CHECK(tb.input_tokens == 7);
  auto none = *s->llm_usage_totals("b", std::string("other"));
  CHECK(none.requests == 0);
  CHECK(none.input_tokens == 0);
}

TEST_CASE("llm usage: a batch with a bad row inserts nothing") {
  test::TempDir dir;
  auto s = open_with_tenants(dir);
  std::vector<LlmUsageRow> batch = {usage("a", std::nullopt, 1, 1), usage("a", std::nullopt, 2, 2)};
  {
    // A trigger makes the second row fail, as a full disk would.
    auto tx = s->db().lock();
    REQUIRE(tx.exec("CREATE TRIGGER refuse BEFORE INSERT ON llm_usage WHEN NEW.input_tokens = 2 "
                    "BEGIN SELECT RAISE(ABORT, 'refused'); END;")
                .ok());
  }
  CHECK_FALSE(s->insert_llm_usage(batch).ok());
  LlmUsageQuery q;
  q.tenant_id = "a";
  CHECK(s->list_llm_usage(q)->empty());
  CHECK(s->llm_usage_totals("a", std::nullopt)->requests == 0);
}

TEST_CASE("llm usage: token counts past INT64_MAX saturate instead of wrapping negative") {
  test::TempDir dir;
  auto s = open_with_tenants(dir);
  constexpr uint64_t kHuge = std::numeric_limits<uint64_t>::max();
  constexpr uint64_t kI64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  REQUIRE(s->insert_llm_usage({usage("a", std::nullopt, kHuge, kI64), usage("a", std::nullopt, kHuge, 5)}).ok());
  LlmUsageQuery q;
  q.tenant_id = "a";
  auto rows = *s->list_llm_usage(q);
  REQUIRE(rows.size() == 2);
  CHECK(rows[0].input_tokens == kI64);
  CHECK(rows[0].output_tokens == kI64);
  // Two saturated rows sum past INT64_MAX without an overflow error.
  auto t = s->llm_usage_totals("a", std::nullopt);
  REQUIRE(t.ok());
  CHECK(t->input_tokens == 2 * kI64);
  CHECK(t->output_tokens == kI64 + 5);
  REQUIRE(s->insert_llm_usage({usage("a", std::nullopt, kHuge, 0), usage("a", std::nullopt, kHuge, 0)}).ok());
  CHECK(s->llm_usage_totals("a", std::nullopt)->input_tokens == kHuge);
}

TEST_CASE("add_events: many events in one transaction, each with its own time") {
  test::TempDir dir;
  auto s = open_with_tenants(dir);
  std::vector<EventRow> evs;
  for (int i = 0; i < 50; ++i) {
    EventRow e;
    e.at = 100 + i;
    e.tenant_id = "a";
    e.sandbox_id = i % 2 ? "sb1" : "sb2";
    e.kind = i % 2 ? "paused" : "resumed";
    e.detail = "{\"i\":" + std::to_string(i) + "}";
    evs.push_back(e);
  }
  evs[3].tenant_id.reset();
  REQUIRE(s->add_events(evs).ok());
  REQUIRE(s->add_events({}).ok());
  auto sb1 = *s->events_for_sandbox("sb1");
  REQUIRE(sb1.size() == 25);
  CHECK(sb1[0].at == 101);
  CHECK(sb1[0].kind == "paused");
  CHECK(sb1[0].detail == "{\"i\":1}");
  CHECK_FALSE(sb1[1].tenant_id.has_value());
  CHECK(sb1[2].tenant_id == "a");
  for (size_t i = 1; i < sb1.size(); ++i) CHECK(sb1[i].seq > sb1[i - 1].seq);
  CHECK(s->events_for_sandbox("sb2")->size() == 25);

  // All or none: a failing row rolls back the rows before it.
  {
    auto tx = s->db().lock();
    REQUIRE(tx.exec("CREATE TRIGGER refuse BEFORE INSERT ON events WHEN NEW.kind = 'bad' "
                    "BEGIN SELECT RAISE(ABORT, 'refused'); END;")
                .ok());
  }
  std::vector<EventRow> bad(3, evs[0]);
  for (auto& e : bad) e.sandbox_id = "sb3";
  bad[2].kind = "bad";
  CHECK_FALSE(s->add_events(bad).ok());
  CHECK(s->events_for_sandbox("sb3")->empty());
}

TEST_CASE("a new database file is created with mode 0600") {
  test::TempDir dir;
  mode_t old = ::umask(022);
  auto s = Store::open(dir.sub("mode.db"));
  ::umask(old);
  REQUIRE(s.ok());
  struct stat st {};
  REQUIRE(::stat(dir.sub("mode.db").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::stat(dir.sub("mode.db-wal").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
}
