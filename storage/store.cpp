// Repository layer: one transaction per method, rows mapped by column order.
#include "storage/store.h"

#include "storage/migrations.h"
#include "storage/store_internal.h"

namespace sg::storage {

namespace {

using internal::collect;
using internal::first;
using internal::kTenantCols;
using internal::tenant_from;
using internal::kTemplateCols;
using internal::template_from;


constexpr const char* kSandboxCols =
    "seq, id, tenant_id, template_id, alias, state, backend, metadata, env_vars, envd_token, envd_version, "
    "cpu_count, memory_mb, disk_size_mb, timeout_s, started_at, end_at, on_timeout, auto_resume, "
    "allow_internet, init_pid, ended_at, end_reason, traffic_token, network, build_id";

SandboxRow sandbox_from(const Stmt& s) {
  SandboxRow r;
  r.seq = s.int64(0);
  r.id = s.text(1);
  r.tenant_id = s.text(2);
  r.template_id = s.text(3);
  if (!s.is_null(4)) r.alias = s.text(4);
  r.state = s.text(5);
  r.backend = s.text(6);
  r.metadata = s.text(7);
  r.env_vars = s.text(8);
  r.envd_token = s.text(9);
  r.envd_version = s.text(10);
  r.cpu_count = s.int64(11);
  r.memory_mb = s.int64(12);
  r.disk_size_mb = s.int64(13);
  r.timeout_s = s.int64(14);
  r.started_at = s.int64(15);
  r.end_at = s.int64(16);
  r.on_timeout = s.text(17);
  r.auto_resume = s.int64(18) != 0;
  if (!s.is_null(19)) r.allow_internet = s.int64(19) != 0;
  if (!s.is_null(20)) r.init_pid = s.int64(20);
  if (!s.is_null(21)) r.ended_at = s.int64(21);
  if (!s.is_null(22)) r.end_reason = s.text(22);
  if (!s.is_null(23)) r.traffic_token = s.text(23);
  r.network = s.text(24);
  if (!s.is_null(25)) r.build_id = s.text(25);
  return r;
}

std::string sandbox_select(const std::string& where) {
  return std::string("SELECT ") + kSandboxCols + " FROM sandboxes WHERE " + where;
}

}  // namespace

Result<std::unique_ptr<Store>> Store::open(const std::string& path) {
  Result<std::unique_ptr<Db>> db = Db::open(path);
  if (!db) return db.error();
  Result<int> v = migrate(**db);
  if (!v) return v.error();
  return std::unique_ptr<Store>(new Store(std::move(*db)));
}

Status Store::insert_tenant(const TenantRow& t) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO tenants(id, name, created_at, max_sandboxes, max_memory_mb, disabled) "
              "VALUES(?,?,?,?,?,?)");
  st.bind(1, t.id).bind(2, t.name).bind(3, t.created_at).bind(4, t.max_sandboxes).bind(5, t.max_memory_mb)
      .bind(6, t.disabled ? 1 : 0);
  return st.run();
}

Status Store::upsert_tenant(const TenantRow& t) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO tenants(id, name, created_at, max_sandboxes, max_memory_mb, disabled) "
              "VALUES(?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET name = excluded.name, "
              "max_sandboxes = excluded.max_sandboxes, max_memory_mb = excluded.max_memory_mb, "
              "disabled = excluded.disabled");
  st.bind(1, t.id).bind(2, t.name).bind(3, t.created_at).bind(4, t.max_sandboxes).bind(5, t.max_memory_mb)
      .bind(6, t.disabled ? 1 : 0);
  return st.run();
}

Status Store::upsert_key(const ApiKeyRow& k) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO api_keys(id, tenant_id, key_hash, key_prefix, created_at, revoked_at) "
              "VALUES(?,?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET revoked_at = excluded.revoked_at");
  st.bind(1, k.id).bind(2, k.tenant_id).bind(3, k.key_hash).bind(4, k.key_prefix).bind(5, k.created_at)
      .bind(6, k.revoked_at);
  return st.run();
}

Result<std::optional<TenantRow>> Store::find_tenant_by_name(const std::string& name) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, std::string("SELECT ") + kTenantCols + " FROM tenants WHERE name = ?");
  st.bind(1, name);
  return first<TenantRow>(st, [](const Stmt& s) { return tenant_from(s); });
}

Result<std::optional<TenantRow>> Store::find_tenant(const std::string& id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, std::string("SELECT ") + kTenantCols + " FROM tenants WHERE id = ?");
  st.bind(1, id);
  return first<TenantRow>(st, [](const Stmt& s) { return tenant_from(s); });
}

Result<std::vector<TenantRow>> Store::list_tenants() {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, std::string("SELECT ") + kTenantCols + " FROM tenants ORDER BY created_at, name");
  return collect<TenantRow>(st, [](const Stmt& s) { return tenant_from(s); });
}

Status Store::set_tenant_limits(const std::string& id, int64_t max_sandboxes, int64_t max_memory_mb) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE tenants SET max_sandboxes = ?, max_memory_mb = ? WHERE id = ?");
  st.bind(1, max_sandboxes).bind(2, max_memory_mb).bind(3, id);
  SG_TRY(st.run());
  if (tx.changes() == 0) return not_found_error("tenant " + id + " not found");
  return Status::Ok();
}

Status Store::insert_key(const ApiKeyRow& k) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO api_keys(id, tenant_id, key_hash, key_prefix, created_at, revoked_at) "
              "VALUES(?,?,?,?,?,?)");
  st.bind(1, k.id).bind(2, k.tenant_id).bind(3, k.key_hash).bind(4, k.key_prefix).bind(5, k.created_at)
      .bind(6, k.revoked_at);
  return st.run();
}

Result<std::optional<TenantRow>> Store::tenant_for_key_hash(const std::string& key_hash) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT t.id, t.name, t.created_at, t.max_sandboxes, t.max_memory_mb, t.disabled "
              "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
              "WHERE k.key_hash = ? AND k.revoked_at IS NULL AND t.disabled = 0");
  st.bind(1, key_hash);
  return first<TenantRow>(st, [](const Stmt& s) { return tenant_from(s); });
}

Result<std::vector<ApiKeyRow>> Store::list_keys(const std::string& tenant_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT id, tenant_id, key_hash, key_prefix, created_at, revoked_at FROM api_keys "
              "WHERE tenant_id = ? ORDER BY created_at, id");
  st.bind(1, tenant_id);
  return collect<ApiKeyRow>(st, [](const Stmt& s) {
    ApiKeyRow k;
    k.id = s.text(0);
    k.tenant_id = s.text(1);
    k.key_hash = s.text(2);
    k.key_prefix = s.text(3);
    k.created_at = s.int64(4);
    if (!s.is_null(5)) k.revoked_at = s.int64(5);
    return k;
  });
}

Result<bool> Store::revoke_key(const std::string& key_id, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL");
  st.bind(1, now).bind(2, key_id);
  SG_TRY(st.run());
  return tx.changes() > 0;
}

Result<int64_t> Store::revoke_tenant(const std::string& tenant_id, int64_t now) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(keys, tx, "UPDATE api_keys SET revoked_at = ? WHERE tenant_id = ? AND revoked_at IS NULL");
  keys.bind(1, now).bind(2, tenant_id);
  SG_TRY(keys.run());
  int64_t n = tx.changes();
  SG_TRY_STMT(llm, tx, "UPDATE llm_keys SET revoked_at = ? WHERE tenant_id = ? AND revoked_at IS NULL");
  llm.bind(1, now).bind(2, tenant_id);
  SG_TRY(llm.run());
  n += tx.changes();
  SG_TRY_STMT(t, tx, "UPDATE tenants SET disabled = 1 WHERE id = ?");
  t.bind(1, tenant_id);
  SG_TRY(t.run());
  if (tx.changes() == 0) return not_found_error("tenant " + tenant_id + " not found");
  SG_TRY(tx.commit());
  return n;
}

Status Store::upsert_template(const TemplateRow& t) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT INTO templates(id, name, tenant_id, status, rootfs_path, cpu_count, memory_mb, "
              "disk_size_mb, created_at, updated_at, public, layers, config, build_id) "
              "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
              "ON CONFLICT(id) DO UPDATE SET name = excluded.name, status = excluded.status, "
              "rootfs_path = excluded.rootfs_path, cpu_count = excluded.cpu_count, "
              "memory_mb = excluded.memory_mb, disk_size_mb = excluded.disk_size_mb, "
              "updated_at = excluded.updated_at, public = excluded.public, layers = excluded.layers, "
              "config = excluded.config, build_id = excluded.build_id");
  st.bind(1, t.id).bind(2, t.name).bind(3, t.tenant_id).bind(4, t.status).bind(5, t.rootfs_path)
      .bind(6, t.cpu_count).bind(7, t.memory_mb).bind(8, t.disk_size_mb).bind(9, t.created_at)
      .bind(10, t.updated_at).bind(11, static_cast<int64_t>(t.is_public)).bind(12, t.layers).bind(13, t.config)
      .bind(14, t.build_id);
  return st.run();
}

Result<std::optional<TemplateRow>> Store::find_template(const std::string& tenant_id, const std::string& ref) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kTemplateCols +
                  " FROM templates WHERE (id = ?1 OR name = ?1) AND status != 'deleted' "
                  "AND (tenant_id IS NULL OR tenant_id = ?2 OR public != 0) "
                  "ORDER BY (id = ?1) DESC, (tenant_id = ?2) DESC LIMIT 1");
  st.bind(1, ref).bind(2, tenant_id);
  return first<TemplateRow>(st, template_from);
}

Result<std::vector<TemplateRow>> Store::list_templates(const std::string& tenant_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kTemplateCols +
                  " FROM templates WHERE status != 'deleted' "
                  "AND (tenant_id IS NULL OR tenant_id = ?1 OR public != 0) "
                  "AND id NOT IN (SELECT template_id FROM snapshots) ORDER BY created_at, id");
  st.bind(1, tenant_id);
  return collect<TemplateRow>(st, template_from);
}

Result<TemplateUsage> Store::template_usage(const std::string& id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT COUNT(*), MAX(started_at), "
              "SUM(CASE WHEN state IN ('creating', 'running', 'paused') THEN 1 ELSE 0 END) "
              "FROM sandboxes WHERE template_id = ?");
  st.bind(1, id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  TemplateUsage u;
  u.spawn_count = st.int64(0);
  if (!st.is_null(1)) u.last_spawned_at = st.int64(1);
  u.live = st.is_null(2) ? 0 : st.int64(2);
  return u;
}

namespace {
// The template the tenant owns, within tx; kNotFound when it cannot see
// it, kInvalid when it sees but does not own it.
Status check_owner(Db::Tx& tx, const std::string& tenant_id, const std::string& id) {
  SG_TRY_STMT(st, tx, "SELECT tenant_id, public, origin_node FROM templates WHERE id = ? AND status != 'deleted'");
  st.bind(1, id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  bool visible = *row && (st.is_null(0) || st.text(0) == tenant_id || st.int64(1) != 0);
  if (!visible) return not_found_error("template '" + id + "' not found");
  if (st.is_null(0) || st.text(0) != tenant_id)
    return invalid_error("template '" + id + "' belongs to " +
                         std::string(st.is_null(0) ? "this server" : "another team") + ": only its owner can change it");
  if (!st.is_null(2)) return internal::copy_error(id, st.text(2));
  return Status::Ok();
}
}  // namespace

Status Store::set_template_public(const std::string& tenant_id, const std::string& id, bool is_public, int64_t now) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY(check_owner(tx, tenant_id, id));
  SG_TRY_STMT(st, tx, "UPDATE templates SET public = ?, updated_at = ? WHERE id = ?");
  st.bind(1, static_cast<int64_t>(is_public)).bind(2, now).bind(3, id);
  SG_TRY(st.run());
  return tx.commit();
}

Status Store::delete_template(const std::string& tenant_id, const std::string& id, int64_t now) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY(check_owner(tx, tenant_id, id));
  SG_TRY_STMT(q, tx,
              "SELECT COUNT(*) FROM sandboxes WHERE template_id = ? AND state IN ('creating', 'running', 'paused')");
  q.bind(1, id);
  Result<bool> row = q.step();
  if (!row) return row.error();
  if (int64_t live = q.int64(0); live > 0)
    return conflict_error("template '" + id + "' is in use by " + std::to_string(live) +
                          " sandboxes; kill them first");
  // The name is freed for a new template; the row keeps the old one's id.
  SG_TRY_STMT(st, tx, "UPDATE templates SET status = 'deleted', name = id || '~deleted', updated_at = ? WHERE id = ?");
  st.bind(1, now).bind(2, id);
  SG_TRY(st.run());
  return tx.commit();
}

Status Store::set_template_status(const std::string& id, const std::string& status, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE templates SET status = ?, updated_at = ? WHERE id = ?");
  st.bind(1, status).bind(2, now).bind(3, id);
  return st.run();
}

Status Store::insert_sandbox_within_quota(const SandboxRow& r, int64_t max_sandboxes, int64_t max_memory_mb) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(q, tx,
              "SELECT COUNT(*), COALESCE(SUM(memory_mb), 0) FROM sandboxes "
              "WHERE tenant_id = ? AND state IN ('creating', 'running', 'paused')");
  q.bind(1, r.tenant_id);
  Result<bool> row = q.step();
  if (!row) return row.error();
  int64_t count = q.int64(0), mem = q.int64(1);
  if (count + 1 > max_sandboxes)
    return Error(ErrorKind::kQuota, "quota exceeded: tenant has " + std::to_string(count) +
                                        " sandboxes, the limit is " + std::to_string(max_sandboxes) +
                                        " concurrent sandboxes; kill one and retry");
  if (mem + r.memory_mb > max_memory_mb)
    return Error(ErrorKind::kQuota, "quota exceeded: tenant sandboxes use " + std::to_string(mem) +
                                        " MB of memory, this one needs " + std::to_string(r.memory_mb) +
                                        " MB more and the limit is " + std::to_string(max_memory_mb) + " MB");
  SG_TRY_STMT(st, tx,
              "INSERT INTO sandboxes(id, tenant_id, template_id, alias, state, backend, metadata, env_vars, "
              "envd_token, envd_version, cpu_count, memory_mb, disk_size_mb, timeout_s, started_at, end_at, "
              "on_timeout, auto_resume, allow_internet, init_pid, ended_at, end_reason, traffic_token, build_id, network) "
              "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
  st.bind(1, r.id).bind(2, r.tenant_id).bind(3, r.template_id).bind(4, r.alias).bind(5, r.state)
      .bind(6, r.backend).bind(7, r.metadata).bind(8, r.env_vars).bind(9, r.envd_token).bind(10, r.envd_version)
      .bind(11, r.cpu_count).bind(12, r.memory_mb).bind(13, r.disk_size_mb).bind(14, r.timeout_s)
      .bind(15, r.started_at).bind(16, r.end_at).bind(17, r.on_timeout).bind(18, r.auto_resume ? 1 : 0);
  if (r.allow_internet) st.bind(19, *r.allow_internet ? 1 : 0); else st.bind(19, std::nullopt);
  st.bind(20, r.init_pid).bind(21, r.ended_at).bind(22, r.end_reason).bind(23, r.traffic_token).bind(24, r.build_id);
  st.bind(25, r.network);
  SG_TRY(st.run());
  return tx.commit();
}

Result<std::optional<SandboxRow>> Store::get_sandbox(const std::string& tenant_id, const std::string& id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, sandbox_select("id = ? AND tenant_id = ?"));
  st.bind(1, id).bind(2, tenant_id);
  return first<SandboxRow>(st, sandbox_from);
}

Result<std::vector<SandboxRow>> Store::list_sandboxes(const SandboxQuery& q) {
  std::vector<std::string> states = q.states;
  if (states.empty()) states = {kStateRunning, kStatePaused};
  std::string where = "tenant_id = ? AND state IN (";
  for (size_t i = 0; i < states.size(); ++i) where += i ? ",?" : "?";
  where += ")";
  for (size_t i = 0; i < q.metadata.size(); ++i)
    where += " AND EXISTS (SELECT 1 FROM json_each(sandboxes.metadata) WHERE key = ? AND value = ?)";
  if (q.template_id) where += " AND template_id = ?";
  if (q.started_after) where += " AND started_at > ?";
  if (q.after_seq > 0) where += q.descending ? " AND seq < ?" : " AND seq > ?";
  where += q.descending ? " ORDER BY seq DESC" : " ORDER BY seq ASC";
  where += " LIMIT ?";
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, sandbox_select(where));
  int i = 1;
  st.bind(i++, q.tenant_id);
  for (const std::string& s : states) st.bind(i++, s);
  for (const auto& [k, v] : q.metadata) {
    st.bind(i++, k);
    st.bind(i++, v);
  }
  if (q.template_id) st.bind(i++, *q.template_id);
  if (q.started_after) st.bind(i++, *q.started_after);
  if (q.after_seq > 0) st.bind(i++, q.after_seq);
  st.bind(i++, q.limit);
  return collect<SandboxRow>(st, sandbox_from);
}

Result<std::vector<SandboxRow>> Store::list_live() {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, sandbox_select("state IN ('creating', 'running', 'paused') ORDER BY seq"));
  return collect<SandboxRow>(st, sandbox_from);
}

Result<std::vector<SandboxRow>> Store::list_expired(int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, sandbox_select("state = 'running' AND end_at <= ? ORDER BY end_at"));
  st.bind(1, now);
  return collect<SandboxRow>(st, sandbox_from);
}

Result<bool> Store::transition(const std::string& id, const std::vector<std::string>& from, const std::string& to) {
  std::string sql = "UPDATE sandboxes SET state = ? WHERE id = ? AND state IN (";
  for (size_t i = 0; i < from.size(); ++i) sql += i ? ",?" : "?";
  sql += ")";
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, sql);
  st.bind(1, to).bind(2, id);
  int i = 3;
  for (const std::string& s : from) st.bind(i++, s);
  SG_TRY(st.run());
  return tx.changes() > 0;
}

Status Store::set_running(const std::string& id, int64_t init_pid, const std::string& envd_version) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "UPDATE sandboxes SET state = 'running', init_pid = ?, envd_version = ? "
              "WHERE id = ? AND state = 'creating'");
  st.bind(1, init_pid).bind(2, envd_version).bind(3, id);
  SG_TRY(st.run());
  if (tx.changes() == 0) return conflict_error("sandbox " + id + " is no longer being created");
  return Status::Ok();
}

Status Store::set_end_at(const std::string& id, int64_t end_at) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE sandboxes SET end_at = ? WHERE id = ?");
  st.bind(1, end_at).bind(2, id);
  return st.run();
}

Status Store::set_network(const std::string& id, std::optional<bool> allow, const std::string& network) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE sandboxes SET allow_internet = ?, network = ? WHERE id = ?");
  if (allow) st.bind(1, *allow ? 1 : 0); else st.bind(1, std::nullopt);
  st.bind(2, network).bind(3, id);
  return st.run();
}

Result<bool> Store::finish(const std::string& id, const std::string& state, const std::string& reason, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "UPDATE sandboxes SET state = ?, end_reason = ?, ended_at = ? "
              "WHERE id = ? AND state IN ('creating', 'running', 'paused')");
  st.bind(1, state).bind(2, reason).bind(3, now).bind(4, id);
  SG_TRY(st.run());
  return tx.changes() > 0;
}

Status Store::add_event(const std::optional<std::string>& tenant_id, const std::optional<std::string>& sandbox_id,
                        const std::string& kind, const std::string& detail, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "INSERT INTO events(at, tenant_id, sandbox_id, kind, detail) VALUES(?,?,?,?,?)");
  st.bind(1, now).bind(2, tenant_id).bind(3, sandbox_id).bind(4, kind).bind(5, detail);
  return st.run();
}

Status Store::add_events(const std::vector<EventRow>& rows) {
  if (rows.empty()) return Status::Ok();
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(st, tx, "INSERT INTO events(at, tenant_id, sandbox_id, kind, detail) VALUES(?,?,?,?,?)");
  for (const EventRow& e : rows) {
    st.reset();
    st.bind(1, e.at).bind(2, e.tenant_id).bind(3, e.sandbox_id).bind(4, e.kind).bind(5, e.detail);
    SG_TRY(st.run());
  }
  return tx.commit();
}

Result<std::vector<EventRow>> Store::events_for_sandbox(const std::string& sandbox_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "SELECT seq, at, tenant_id, sandbox_id, kind, detail FROM events WHERE sandbox_id = ? ORDER BY seq");
  st.bind(1, sandbox_id);
  return collect<EventRow>(st, [](const Stmt& s) {
    EventRow e;
    e.seq = s.int64(0);
    e.at = s.int64(1);
    if (!s.is_null(2)) e.tenant_id = s.text(2);
    if (!s.is_null(3)) e.sandbox_id = s.text(3);
    e.kind = s.text(4);
    e.detail = s.text(5);
    return e;
  });
}

}  // namespace sg::storage
