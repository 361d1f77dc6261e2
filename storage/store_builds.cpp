// The Store's template builds and their logs (store.h, "Templates").
#include "storage/store_internal.h"

namespace sg::storage {

using namespace internal;

namespace {

constexpr const char* kBuildCols =
    "id, template_id, tenant_id, status, reason, reason_step, cpu_count, memory_mb, created_at, updated_at, "
    "finished_at";

BuildRow build_from(const Stmt& s) {
  BuildRow b;
  b.id = s.text(0);
  b.template_id = s.text(1);
  b.tenant_id = s.text(2);
  b.status = s.text(3);
  if (!s.is_null(4)) b.reason = s.text(4);
  if (!s.is_null(5)) b.reason_step = s.text(5);
  b.cpu_count = s.int64(6);
  b.memory_mb = s.int64(7);
  b.created_at = s.int64(8);
  b.updated_at = s.int64(9);
  if (!s.is_null(10)) b.finished_at = s.int64(10);
  return b;
}

}  // namespace

Result<TemplateRow> Store::request_build(const std::string& tenant_id, const std::string& name,
                                         const TemplateRow& fresh, const BuildRow& build) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(q, tx, std::string("SELECT ") + kTemplateCols + " FROM templates WHERE name = ? AND status != 'deleted'");
  q.bind(1, name);
  Result<std::optional<TemplateRow>> found = first<TemplateRow>(q, template_from);
  if (!found) return found.error();
  TemplateRow t;
  if (*found) {
    t = **found;
    if (t.tenant_id != tenant_id)
      return conflict_error("template name '" + name + "' is taken" +
                            std::string(t.tenant_id ? " by another team" : " by this server's own template"));
    SG_TRY_STMT(b, tx, "SELECT COUNT(*) FROM template_builds WHERE template_id = ? AND status = 'building'");
    b.bind(1, t.id);
    Result<bool> row = b.step();
    if (!row) return row.error();
    if (b.int64(0) > 0) return conflict_error("template '" + name + "' has a build running; wait for it to end");
    SG_TRY_STMT(sup, tx,
                "UPDATE template_builds SET status = 'error', reason = 'superseded by a newer build request', "
                "updated_at = ?, finished_at = ? WHERE template_id = ? AND status = 'waiting'");
    sup.bind(1, build.created_at).bind(2, build.created_at).bind(3, t.id);
    SG_TRY(sup.run());
  } else {
    t = fresh;
    t.name = name;
    t.tenant_id = tenant_id;
    SG_TRY_STMT(ins, tx,
                "INSERT INTO templates(id, name, tenant_id, status, rootfs_path, cpu_count, memory_mb, disk_size_mb, "
                "created_at, updated_at, public, layers, config, build_id) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,NULL)");
    ins.bind(1, t.id).bind(2, t.name).bind(3, t.tenant_id).bind(4, t.status).bind(5, t.rootfs_path)
        .bind(6, t.cpu_count).bind(7, t.memory_mb).bind(8, t.disk_size_mb).bind(9, t.created_at)
        .bind(10, t.updated_at).bind(11, static_cast<int64_t>(t.is_public)).bind(12, t.layers).bind(13, t.config);
    SG_TRY(ins.run());
  }
  SG_TRY_STMT(st, tx,
              "INSERT INTO template_builds(id, template_id, tenant_id, status, cpu_count, memory_mb, created_at, "
              "updated_at) VALUES(?,?,?,?,?,?,?,?)");
  st.bind(1, build.id).bind(2, t.id).bind(3, tenant_id).bind(4, std::string(kBuildWaiting)).bind(5, build.cpu_count)
      .bind(6, build.memory_mb).bind(7, build.created_at).bind(8, build.created_at);
  SG_TRY(st.run());
  SG_TRY(tx.commit());
  return t;
}

Result<std::optional<BuildRow>> Store::find_build(const std::string& template_id, const std::string& build_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, std::string("SELECT ") + kBuildCols + " FROM template_builds WHERE id = ? AND template_id = ?");
  st.bind(1, build_id).bind(2, template_id);
  return first<BuildRow>(st, build_from);
}

Result<std::vector<BuildRow>> Store::list_builds(const std::string& template_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kBuildCols + " FROM template_builds WHERE template_id = ? ORDER BY created_at, id");
  st.bind(1, template_id);
  return collect<BuildRow>(st, build_from);
}

Status Store::start_build(const std::string& build_id, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE template_builds SET status = 'building', updated_at = ? WHERE id = ? AND status = 'waiting'");
  st.bind(1, now).bind(2, build_id);
  SG_TRY(st.run());
  if (tx.changes() == 0) return conflict_error("build " + build_id + " is not waiting (started already, or superseded)");
  return Status::Ok();
}

Status Store::fail_build(const std::string& build_id, const std::string& reason, const std::string& step, int64_t now) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(st, tx,
              "UPDATE template_builds SET status = 'error', reason = ?, reason_step = ?, updated_at = ?, "
              "finished_at = ? WHERE id = ?");
  st.bind(1, reason).bind(2, step).bind(3, now).bind(4, now).bind(5, build_id);
  SG_TRY(st.run());
  // A template that never had a ready build is failed with it.
  SG_TRY_STMT(t, tx,
              "UPDATE templates SET status = 'failed', updated_at = ? WHERE build_id IS NULL AND status = 'building' "
              "AND id = (SELECT template_id FROM template_builds WHERE id = ?)");
  t.bind(1, now).bind(2, build_id);
  SG_TRY(t.run());
  return tx.commit();
}

Status Store::finish_build(const std::string& build_id, const std::string& rootfs, const std::string& layers,
                           const std::string& config, int64_t now) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(st, tx,
              "UPDATE template_builds SET status = 'ready', updated_at = ?, finished_at = ? "
              "WHERE id = ? AND status = 'building'");
  st.bind(1, now).bind(2, now).bind(3, build_id);
  SG_TRY(st.run());
  if (tx.changes() == 0) return conflict_error("build " + build_id + " is not running");
  SG_TRY_STMT(t, tx,
              "UPDATE templates SET status = 'ready', rootfs_path = ?, layers = ?, config = ?, build_id = ?, "
              "updated_at = ? WHERE id = (SELECT template_id FROM template_builds WHERE id = ?) AND status != 'deleted'");
  t.bind(1, rootfs).bind(2, layers).bind(3, config).bind(4, build_id).bind(5, now).bind(6, build_id);
  SG_TRY(t.run());
  return tx.commit();
}

Result<int64_t> Store::append_build_logs(const std::string& build_id, std::vector<BuildLogRow> rows) {
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  // The next seq by the primary key's index (a COUNT would read every line).
  SG_TRY_STMT(q, tx, "SELECT COALESCE(MAX(seq) + 1, 0) FROM build_logs WHERE build_id = ?");
  q.bind(1, build_id);
  Result<bool> row = q.step();
  if (!row) return row.error();
  int64_t seq = q.int64(0);
  for (BuildLogRow& r : rows) {
    SG_TRY_STMT(st, tx, "INSERT INTO build_logs(build_id, seq, at_ms, level, step, message) VALUES(?,?,?,?,?,?)");
    st.bind(1, build_id).bind(2, seq++).bind(3, r.at_ms).bind(4, r.level).bind(5, r.step).bind(6, r.message);
    SG_TRY(st.run());
  }
  SG_TRY(tx.commit());
  return seq;
}

Result<std::vector<BuildLogRow>> Store::build_logs(const std::string& build_id, int64_t offset, int64_t limit) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT seq, at_ms, level, step, message FROM build_logs WHERE build_id = ? AND seq >= ? "
              "ORDER BY seq LIMIT ?");
  st.bind(1, build_id).bind(2, offset).bind(3, limit);
  return collect<BuildLogRow>(st, [](const Stmt& s) {
    BuildLogRow r;
    r.seq = s.int64(0);
    r.at_ms = s.int64(1);
    r.level = s.text(2);
    r.step = s.text(3);
    r.message = s.text(4);
    return r;
  });
}

}  // namespace sg::storage
