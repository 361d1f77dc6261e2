// Snapshots: templates made of a sandbox's writable layer (store.h).
#include "storage/store_internal.h"

namespace sg::storage {

using namespace internal;

Result<TemplateRow> Store::template_of_sandbox(const SandboxRow& r) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, std::string("SELECT ") + kTemplateCols + " FROM templates WHERE id = ?");
  st.bind(1, r.template_id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  if (!*row) return not_found_error("template '" + r.template_id + "' of sandbox " + r.id + " not found");
  TemplateRow t = template_from(st);
  if (!r.build_id) return t;
  SG_TRY_STMT(b, tx, "SELECT rootfs_path, layers, config FROM template_builds WHERE id = ? AND layers IS NOT NULL");
  b.bind(1, *r.build_id);
  Result<bool> built = b.step();
  if (!built) return built.error();
  if (*built) {
    t.rootfs_path = b.text(0);
    t.layers = b.text(1);
    t.config = b.is_null(2) ? std::string("{}") : b.text(2);
    t.build_id = r.build_id;
  }
  return t;
}

Result<std::string> Store::add_snapshot(const TemplateRow& t, const SnapshotRow& s, const TemplateFileRow& f,
                                        int64_t max_bytes) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  // A name in use: a snapshot of the tenant's takes a new build (as E2B
  // does); anything else is a conflict.
  std::string template_id = t.id;
  SG_TRY_STMT(named, tx,
              "SELECT t.id, t.tenant_id, (SELECT kind FROM snapshots WHERE template_id = t.id) FROM templates t "
              "WHERE t.name = ?");
  named.bind(1, t.name);
  Result<bool> row = named.step();
  if (!row) return row.error();
  bool reuse = false;
  if (*row) {
    bool mine = !named.is_null(1) && t.tenant_id && named.text(1) == *t.tenant_id;
    if (!mine || named.is_null(2) || named.text(2) != kSnapshotKind || s.kind != std::string(kSnapshotKind))
      return conflict_error("a template named '" + t.name + "' exists; choose another name");
    template_id = named.text(0);
    reuse = true;
  }
  SG_TRY(named.run());
  if (max_bytes > 0) {
    SG_TRY_STMT(used, tx, "SELECT COALESCE(SUM(bytes), 0) FROM template_files WHERE tenant_id = ?");
    used.bind(1, f.tenant_id);
    Result<bool> u = used.step();
    if (!u) return u.error();
    int64_t total = used.int64(0) + f.bytes;
    if (total > max_bytes)
      return Error(ErrorKind::kQuota, "quota exceeded: this snapshot's " + std::to_string(f.bytes >> 20) +
                                          " MiB would take this team's templates to " + std::to_string(total >> 20) +
                                          " MiB, the limit is " + std::to_string(max_bytes >> 20) +
                                          " MiB; delete templates or snapshots to free space");
  }
  if (!reuse) {
    SG_TRY_STMT(ins, tx,
                "INSERT INTO templates(id, name, tenant_id, status, rootfs_path, cpu_count, memory_mb, "
                "disk_size_mb, created_at, updated_at, public, layers, config, build_id) "
                "VALUES(?,?,?,?,?,?,?,?,?,?,0,?,?,NULL)");
    ins.bind(1, t.id).bind(2, t.name).bind(3, t.tenant_id).bind(4, t.status).bind(5, t.rootfs_path)
        .bind(6, t.cpu_count).bind(7, t.memory_mb).bind(8, t.disk_size_mb).bind(9, t.created_at)
        .bind(10, t.updated_at).bind(11, t.layers).bind(12, t.config);
    SG_TRY(ins.run());
    SG_TRY_STMT(snap, tx,
                "INSERT INTO snapshots(template_id, tenant_id, sandbox_id, kind, created_at) VALUES(?,?,?,?,?)");
    snap.bind(1, template_id).bind(2, s.tenant_id).bind(3, s.sandbox_id).bind(4, s.kind).bind(5, s.created_at);
    SG_TRY(snap.run());
  } else {
    SG_TRY_STMT(snap, tx, "UPDATE snapshots SET sandbox_id = ?, created_at = ? WHERE template_id = ?");
    snap.bind(1, s.sandbox_id).bind(2, s.created_at).bind(3, template_id);
    SG_TRY(snap.run());
  }
  // Each snapshot is a ready build of its template, tagged "default": a
  // sandbox created from it runs that build, whose files stay while it
  // runs even after a newer snapshot of the same name took the tag.
  std::string build_id = s.build_id;
  SG_TRY_STMT(b, tx,
              "INSERT INTO template_builds(id, template_id, tenant_id, status, cpu_count, memory_mb, created_at, "
              "updated_at, finished_at, tags, rootfs_path, layers, config) VALUES(?,?,?,'ready',?,?,?,?,?,'',?,?,?)");
  b.bind(1, build_id).bind(2, template_id).bind(3, s.tenant_id).bind(4, t.cpu_count).bind(5, t.memory_mb)
      .bind(6, s.created_at).bind(7, s.created_at).bind(8, s.created_at).bind(9, t.rootfs_path).bind(10, t.layers)
      .bind(11, t.config);
  SG_TRY(b.run());
  SG_TRY(set_tag(tx, template_id, kDefaultTag, build_id, s.created_at));
  SG_TRY_STMT(file, tx,
              "INSERT OR REPLACE INTO template_files(path, tenant_id, kind, template_id, bytes, created_at, used_at) "
              "VALUES(?,?,?,?,?,?,?)");
  file.bind(1, f.path).bind(2, f.tenant_id).bind(3, f.kind).bind(4, template_id).bind(5, f.bytes)
      .bind(6, f.created_at).bind(7, f.used_at);
  SG_TRY(file.run());
  SG_TRY(tx.commit());
  return template_id;
}

Result<std::vector<SnapshotRow>> Store::list_snapshots(const std::string& tenant_id, const std::string& sandbox_id,
                                                       const std::string& name, int64_t after, int64_t limit) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT s.seq, s.template_id, s.tenant_id, s.sandbox_id, s.kind, s.created_at, t.name "
              "FROM snapshots s JOIN templates t ON t.id = s.template_id "
              "WHERE s.tenant_id = ?1 AND s.kind = 'snapshot' AND t.status != 'deleted' AND s.seq > ?2 "
              "AND (?3 = '' OR s.sandbox_id = ?3) AND (?4 = '' OR t.name = ?4 OR t.id = ?4) "
              "ORDER BY s.seq LIMIT ?5");
  st.bind(1, tenant_id).bind(2, after).bind(3, sandbox_id).bind(4, name).bind(5, limit);
  return collect<SnapshotRow>(st, [](const Stmt& s) {
    SnapshotRow r;
    r.seq = s.int64(0);
    r.template_id = s.text(1);
    r.tenant_id = s.text(2);
    r.sandbox_id = s.text(3);
    r.kind = s.text(4);
    r.created_at = s.int64(5);
    r.name = s.text(6);
    return r;
  });
}

Result<std::optional<TemplateRow>> Store::paused_files(const std::string& sandbox_id, const char* kind) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kTemplateCols +
                  " FROM templates WHERE status != 'deleted' AND id = (SELECT s.template_id FROM snapshots s "
                  "WHERE s.sandbox_id = ? AND s.kind = ? ORDER BY s.seq DESC LIMIT 1)");
  st.bind(1, sandbox_id).bind(2, std::string(kind));
  Result<bool> row = st.step();
  if (!row) return row.error();
  if (!*row) return std::optional<TemplateRow>();
  return std::optional<TemplateRow>(template_from(st));
}

Status Store::mark_resumed(const std::string& template_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE snapshots SET kind = 'resumed' WHERE template_id = ? AND kind = 'pause'");
  st.bind(1, template_id);
  return st.run();
}

Status Store::drop_paused_files(const std::string& sandbox_id, bool stale_only) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("UPDATE templates SET status = 'deleted' WHERE status != 'deleted' AND id IN "
                          "(SELECT template_id FROM snapshots WHERE sandbox_id = ? AND ") +
                  (stale_only ? "kind = 'pause')" : "kind IN ('pause', 'resumed'))"));
  st.bind(1, sandbox_id);
  return st.run();
}

Status Store::set_resumed(const std::string& id, int64_t init_pid, const std::string& envd_version) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "UPDATE sandboxes SET state = 'running', init_pid = ?, envd_version = ? WHERE id = ? AND state = 'paused'");
  st.bind(1, init_pid).bind(2, envd_version).bind(3, id);
  SG_TRY(st.run());
  if (tx.changes() == 0) return conflict_error("sandbox " + id + " is no longer paused");
  return Status::Ok();
}

}  // namespace sg::storage
