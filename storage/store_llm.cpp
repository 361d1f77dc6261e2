// The Store's model-proxy tables (migration 2, docs/schema.md): virtual
// keys, upstreams and per-request usage. Same rules as store.cpp: one
// transaction per method; batches prepare once and run in one transaction.
#include <algorithm>
#include <limits>

#include "storage/store.h"
#include "storage/store_internal.h"

namespace sg::storage {

namespace {

using internal::collect;
using internal::first;
using internal::tenant_from;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// Token counts come from upstream responses (a tenant may run its own
// upstream): saturate instead of wrapping into negative numbers.
int64_t to_db(uint64_t v) { return v > static_cast<uint64_t>(kInt64Max) ? kInt64Max : static_cast<int64_t>(v); }
uint64_t from_db(int64_t v) { return v < 0 ? 0 : static_cast<uint64_t>(v); }

uint64_t add_sat(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max() : a + b;
}

constexpr const char* kLlmKeyCols = "id, tenant_id, key_hash, key_prefix, name, created_at, revoked_at";

LlmKeyRow llm_key_from(const Stmt& s) {
  LlmKeyRow k;
  k.id = s.text(0);
  k.tenant_id = s.text(1);
  k.key_hash = s.text(2);
  k.key_prefix = s.text(3);
  k.name = s.text(4);
  k.created_at = s.int64(5);
  if (!s.is_null(6)) k.revoked_at = s.int64(6);
  return k;
}

constexpr const char* kUpstreamCols = "tenant_id, provider, base_url, api_key, updated_at";

UpstreamRow upstream_from(const Stmt& s) {
  UpstreamRow u;
  u.tenant_id = s.text(0);
  u.provider = s.text(1);
  u.base_url = s.text(2);
  u.api_key = s.text(3);
  u.updated_at = s.int64(4);
  return u;
}

constexpr const char* kUsageCols =
    "seq, at, tenant_id, sandbox_id, provider, route, model, stream, status, outcome, input_tokens, "
    "output_tokens, cache_read_tokens, cache_write_tokens, usage_found, duration_ms, wait_paused_ms";

LlmUsageRow usage_from(const Stmt& s) {
  LlmUsageRow r;
  r.seq = s.int64(0);
  r.at_ms = s.int64(1);
  r.tenant_id = s.text(2);
  if (!s.is_null(3)) r.sandbox_id = s.text(3);
  r.provider = s.text(4);
  r.route = s.text(5);
  r.model = s.text(6);
  r.stream = s.int64(7) != 0;
  r.status = static_cast<int>(s.int64(8));
  r.outcome = s.text(9);
  r.input_tokens = from_db(s.int64(10));
  r.output_tokens = from_db(s.int64(11));
  r.cache_read_tokens = from_db(s.int64(12));
  r.cache_write_tokens = from_db(s.int64(13));
  r.usage_found = s.int64(14) != 0;
  r.duration_ms = s.int64(15);
  r.wait_paused_ms = s.int64(16);
  return r;
}

// "tenant_id = ?1" plus, with a sandbox, "AND sandbox_id = ?2".
std::string usage_where(const std::optional<std::string>& sandbox_id) {
  return sandbox_id ? "tenant_id = ?1 AND sandbox_id = ?2" : "tenant_id = ?1";
}

}  // namespace

Status Store::insert_llm_key(const LlmKeyRow& k) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO llm_keys(id, tenant_id, key_hash, key_prefix, name, created_at, revoked_at) "
              "VALUES(?,?,?,?,?,?,?)");
  st.bind(1, k.id).bind(2, k.tenant_id).bind(3, k.key_hash).bind(4, k.key_prefix).bind(5, k.name)
      .bind(6, k.created_at).bind(7, k.revoked_at);
  return st.run();
}

Status Store::upsert_llm_key(const LlmKeyRow& k) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO llm_keys(id, tenant_id, key_hash, key_prefix, name, created_at, revoked_at) "
              "VALUES(?,?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET name = excluded.name, revoked_at = excluded.revoked_at");
  st.bind(1, k.id).bind(2, k.tenant_id).bind(3, k.key_hash).bind(4, k.key_prefix).bind(5, k.name)
      .bind(6, k.created_at).bind(7, k.revoked_at);
  return st.run();
}

Result<std::optional<TenantRow>> Store::tenant_for_llm_key_hash(const std::string& key_hash) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT t.id, t.name, t.created_at, t.max_sandboxes, t.max_memory_mb, t.disabled "
              "FROM llm_keys k JOIN tenants t ON t.id = k.tenant_id "
              "WHERE k.key_hash = ? AND k.revoked_at IS NULL AND t.disabled = 0");
  st.bind(1, key_hash);
  return first<TenantRow>(st, [](const Stmt& s) { return tenant_from(s); });
}

Result<std::vector<LlmKeyRow>> Store::list_llm_keys(const std::string& tenant_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kLlmKeyCols + " FROM llm_keys WHERE tenant_id = ? ORDER BY created_at, id");
  st.bind(1, tenant_id);
  return collect<LlmKeyRow>(st, llm_key_from);
}

Result<bool> Store::revoke_llm_key(const std::string& key_id, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE llm_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL");
  st.bind(1, now).bind(2, key_id);
  SG_TRY(st.run());
  return tx.changes() > 0;
}

Status Store::upsert_upstream(const UpstreamRow& u) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO llm_upstreams(tenant_id, provider, base_url, api_key, updated_at) VALUES(?,?,?,?,?) "
              "ON CONFLICT(tenant_id, provider) DO UPDATE SET base_url = excluded.base_url, "
              "api_key = excluded.api_key, updated_at = excluded.updated_at");
  st.bind(1, u.tenant_id).bind(2, u.provider).bind(3, u.base_url).bind(4, u.api_key).bind(5, u.updated_at);
  return st.run();
}

Result<std::optional<UpstreamRow>> Store::find_upstream(const std::string& tenant_id, const std::string& provider) {
  auto tx = db_->lock();
  // The tenant's own row sorts first ((tenant_id = '') is 0 for it).
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kUpstreamCols +
                  " FROM llm_upstreams WHERE provider = ?1 AND tenant_id IN (?2, '') "
                  "ORDER BY (tenant_id = '') LIMIT 1");
  st.bind(1, provider).bind(2, tenant_id);
  return first<UpstreamRow>(st, upstream_from);
}

Result<std::vector<UpstreamRow>> Store::list_upstreams() {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, std::string("SELECT ") + kUpstreamCols + " FROM llm_upstreams ORDER BY tenant_id, provider");
  return collect<UpstreamRow>(st, upstream_from);
}

Result<bool> Store::remove_upstream(const std::string& tenant_id, const std::string& provider) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "DELETE FROM llm_upstreams WHERE tenant_id = ? AND provider = ?");
  st.bind(1, tenant_id).bind(2, provider);
  SG_TRY(st.run());
  return tx.changes() > 0;
}

Status Store::insert_llm_usage(const std::vector<LlmUsageRow>& rows) {
  if (rows.empty()) return Status::Ok();
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(st, tx,
              "INSERT INTO llm_usage(at, tenant_id, sandbox_id, provider, route, model, stream, status, outcome, "
              "input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, usage_found, duration_ms, "
              "wait_paused_ms) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
  for (const LlmUsageRow& r : rows) {
    st.reset();
    st.bind(1, r.at_ms).bind(2, r.tenant_id).bind(3, r.sandbox_id).bind(4, r.provider).bind(5, r.route)
        .bind(6, r.model).bind(7, r.stream ? 1 : 0).bind(8, r.status).bind(9, r.outcome)
        .bind(10, to_db(r.input_tokens)).bind(11, to_db(r.output_tokens)).bind(12, to_db(r.cache_read_tokens))
        .bind(13, to_db(r.cache_write_tokens)).bind(14, r.usage_found ? 1 : 0).bind(15, r.duration_ms)
        .bind(16, r.wait_paused_ms);
    SG_TRY(st.run());
  }
  return tx.commit();
}

Result<std::vector<LlmUsageRow>> Store::list_llm_usage(const LlmUsageQuery& q) {
  size_t limit = std::min(q.limit, kMaxLlmUsagePage);
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kUsageCols + " FROM llm_usage WHERE " + usage_where(q.sandbox_id) +
                  " AND seq > ?3 ORDER BY seq LIMIT ?4");
  st.bind(1, q.tenant_id);
  if (q.sandbox_id) st.bind(2, *q.sandbox_id);
  st.bind(3, q.after_seq).bind(4, static_cast<int64_t>(limit));
  return collect<LlmUsageRow>(st, usage_from);
}

Result<LlmUsageTotals> Store::llm_usage_totals(const std::string& tenant_id,
                                               const std::optional<std::string>& sandbox_id) {
  // Summed here rather than with SQL SUM(), which fails with "integer
  // overflow" once saturated counts add past INT64_MAX.
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT input_tokens, output_tokens, cache_read_tokens, cache_write_tokens FROM llm_usage WHERE " +
                  usage_where(sandbox_id));
  st.bind(1, tenant_id);
  if (sandbox_id) st.bind(2, *sandbox_id);
  LlmUsageTotals t;
  for (;;) {
    Result<bool> row = st.step();
    if (!row) return row.error();
    if (!*row) return t;
    ++t.requests;
    t.input_tokens = add_sat(t.input_tokens, from_db(st.int64(0)));
    t.output_tokens = add_sat(t.output_tokens, from_db(st.int64(1)));
    t.cache_read_tokens = add_sat(t.cache_read_tokens, from_db(st.int64(2)));
    t.cache_write_tokens = add_sat(t.cache_write_tokens, from_db(st.int64(3)));
  }
}

}  // namespace sg::storage
