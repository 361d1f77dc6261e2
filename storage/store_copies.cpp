// The Store's templates shared between cluster nodes (store.h, "Cluster
// mode"; docs/cluster.md "Templates between nodes").
#include "storage/store_internal.h"

namespace sg::storage {

using namespace internal;

Result<std::vector<SharedTemplate>> Store::shared_templates() {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kTemplateCols +
                  ", (SELECT name FROM tenants WHERE tenants.id = templates.tenant_id) FROM templates "
                  "WHERE status != 'deleted' AND tenant_id IS NOT NULL AND origin_node IS NULL "
                  "AND id NOT IN (SELECT template_id FROM snapshots WHERE kind != ?) "
                  "AND EXISTS (SELECT 1 FROM template_tags g WHERE g.template_id = templates.id) "
                  "ORDER BY created_at, id");
  st.bind(1, std::string(kSnapshotKind));
  std::vector<SharedTemplate> out;
  for (;;) {
    Result<bool> row = st.step();
    if (!row) return row.error();
    if (!*row) break;
    SharedTemplate t;
    t.row = template_from(st);
    t.team = st.is_null(16) ? std::string() : st.text(16);
    out.push_back(std::move(t));
  }
  for (SharedTemplate& t : out) {
    SG_TRY_STMT(g, tx,
                "SELECT g.tag, b.id, b.rootfs_path, b.layers, b.config, b.cpu_count, b.memory_mb FROM template_tags g "
                "JOIN template_builds b ON b.id = g.build_id WHERE g.template_id = ? ORDER BY g.tag");
    g.bind(1, t.row.id);
    for (;;) {
      Result<bool> row = g.step();
      if (!row) return row.error();
      if (!*row) break;
      t.tags.push_back(SharedBuild{g.text(0), g.text(1), g.text(2), g.text(3), g.text(4), g.int64(5), g.int64(6)});
    }
  }
  return out;
}

Status Store::install_template_copy(const SharedTemplate& t) {
  const TemplateRow& r = t.row;
  if (!r.origin_node || !r.tenant_id) return invalid_error("a template copy needs its origin node and owner");
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(q, tx,
              "SELECT id FROM templates WHERE (id = ?1 OR (name = ?2 AND status != 'deleted')) "
              "AND origin_node IS NULL");
  q.bind(1, r.id).bind(2, r.name);
  Result<bool> clash = q.step();
  if (!clash) return clash.error();
  if (*clash)
    return conflict_error("template '" + r.name + "' of node " + *r.origin_node + " cannot be copied here: " +
                          (q.text(0) == r.id ? std::string("a template made here has its id")
                                             : "template " + q.text(0) + " here has its name"));
  // A copy of that name under another id: its origin made it again.
  SG_TRY_STMT(old, tx,
              "UPDATE templates SET status = 'deleted', name = id || '~deleted', updated_at = ? "
              "WHERE name = ? AND id != ? AND origin_node IS NOT NULL");
  old.bind(1, r.updated_at).bind(2, r.name).bind(3, r.id);
  SG_TRY(old.run());
  SG_TRY_STMT(st, tx,
              "INSERT INTO templates(id, name, tenant_id, status, rootfs_path, cpu_count, memory_mb, disk_size_mb, "
              "created_at, updated_at, public, layers, config, build_id, origin_node, origin_revision) "
              "VALUES(?,?,?,'ready',?,?,?,?,?,?,?,?,?,?,?,?) "
              "ON CONFLICT(id) DO UPDATE SET name = excluded.name, status = 'ready', "
              "rootfs_path = excluded.rootfs_path, cpu_count = excluded.cpu_count, memory_mb = excluded.memory_mb, "
              "disk_size_mb = excluded.disk_size_mb, updated_at = excluded.updated_at, public = excluded.public, "
              "layers = excluded.layers, config = excluded.config, build_id = excluded.build_id, "
              "origin_node = excluded.origin_node, origin_revision = excluded.origin_revision");
  st.bind(1, r.id).bind(2, r.name).bind(3, r.tenant_id).bind(4, r.rootfs_path).bind(5, r.cpu_count)
      .bind(6, r.memory_mb).bind(7, r.disk_size_mb).bind(8, r.created_at).bind(9, r.updated_at)
      .bind(10, static_cast<int64_t>(r.is_public)).bind(11, r.layers).bind(12, r.config).bind(13, r.build_id)
      .bind(14, r.origin_node).bind(15, r.origin_revision);
  SG_TRY(st.run());
  SG_TRY_STMT(del, tx, "DELETE FROM template_tags WHERE template_id = ?");
  del.bind(1, r.id);
  SG_TRY(del.run());
  for (const SharedBuild& b : t.tags) {
    // A build's files never change: one copied before is the same.
    SG_TRY_STMT(ins, tx,
                "INSERT INTO template_builds(id, template_id, tenant_id, status, cpu_count, memory_mb, created_at, "
                "updated_at, finished_at, tags, rootfs_path, layers, config) VALUES(?,?,?,'ready',?,?,?,?,?,'',?,?,?) "
                "ON CONFLICT(id) DO NOTHING");
    ins.bind(1, b.build_id).bind(2, r.id).bind(3, r.tenant_id).bind(4, b.cpu_count).bind(5, b.memory_mb)
        .bind(6, r.updated_at).bind(7, r.updated_at).bind(8, r.updated_at).bind(9, b.rootfs_path).bind(10, b.layers)
        .bind(11, b.config);
    SG_TRY(ins.run());
    SG_TRY(set_tag(tx, r.id, b.tag, b.build_id, r.updated_at));
  }
  return tx.commit();
}

Result<std::map<std::string, int64_t>> Store::template_copies() {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "SELECT id, origin_revision FROM templates WHERE origin_node IS NOT NULL AND status != 'deleted'");
  std::map<std::string, int64_t> out;
  for (;;) {
    Result<bool> row = st.step();
    if (!row) return row.error();
    if (!*row) return out;
    out[st.text(0)] = st.int64(1);
  }
}

Status Store::drop_template_copy(const std::string& id, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "UPDATE templates SET status = 'deleted', name = id || '~deleted', updated_at = ? "
              "WHERE id = ? AND origin_node IS NOT NULL AND status != 'deleted'");
  st.bind(1, now).bind(2, id);
  return st.run();
}

}  // namespace sg::storage
