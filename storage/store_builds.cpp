// The Store's template builds and their logs (store.h, "Templates").
#include "storage/store_internal.h"

namespace sg::storage {

using namespace internal;

namespace {

constexpr const char* kBuildCols =
    "id, template_id, tenant_id, status, reason, reason_step, cpu_count, memory_mb, created_at, updated_at, "
    "finished_at, tags";

// Tags are stored space-separated (valid_tag has no spaces).
std::string join_tags(const std::vector<std::string>& tags) {
  std::string out;
  for (const std::string& t : tags) out += (out.empty() ? "" : " ") + t;
  return out;
}

std::vector<std::string> split_tags(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    size_t sp = s.find(' ');
    if (sp != 0) out.emplace_back(s.substr(0, sp));
    if (sp == std::string_view::npos) break;
    s.remove_prefix(sp + 1);
  }
  return out;
}

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
  b.tags = split_tags(s.text(11));
  return b;
}

// The template `name` (a name or an id) visible to the tenant, within tx:
// its id, or kNotFound; kInvalid when the tenant does not own it.
Result<std::string> owned_template(Db::Tx& tx, const std::string& tenant_id, const std::string& name) {
  SG_TRY_STMT(st, tx,
              "SELECT id, tenant_id, origin_node FROM templates WHERE (id = ?1 OR name = ?1) AND status != 'deleted' "
              "AND (tenant_id IS NULL OR tenant_id = ?2 OR public != 0) "
              "ORDER BY (id = ?1) DESC, (tenant_id = ?2) DESC LIMIT 1");
  st.bind(1, name).bind(2, tenant_id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  if (!*row) return not_found_error("template '" + name + "' not found");
  if (st.is_null(1) || st.text(1) != tenant_id)
    return invalid_error("template '" + name + "' belongs to " +
                         std::string(st.is_null(1) ? "this server" : "another team") + ": only its owner can tag it");
  if (!st.is_null(2)) return copy_error(name, st.text(2));
  return st.text(0);
}

}  // namespace

// Points tag at build_id (a ready build of template_id); "default" moves
// the template's row to the build's files and configuration.
Status internal::set_tag(Db::Tx& tx, const std::string& template_id, const std::string& tag, const std::string& build_id,
               int64_t now) {
  SG_TRY_STMT(st, tx,
              "INSERT INTO template_tags(template_id, tag, build_id, created_at) VALUES(?,?,?,?) "
              "ON CONFLICT(template_id, tag) DO UPDATE SET build_id = excluded.build_id, "
              "created_at = excluded.created_at");
  st.bind(1, template_id).bind(2, tag).bind(3, build_id).bind(4, now);
  SG_TRY(st.run());
  if (tag != kDefaultTag) return Status::Ok();
  SG_TRY_STMT(t, tx,
              "UPDATE templates SET rootfs_path = b.rootfs_path, layers = b.layers, config = b.config, "
              "build_id = b.id, cpu_count = b.cpu_count, memory_mb = b.memory_mb, updated_at = ?1 FROM "
              "(SELECT id, rootfs_path, layers, config, cpu_count, memory_mb FROM template_builds WHERE id = ?2) AS b "
              "WHERE templates.id = ?3");
  t.bind(1, now).bind(2, build_id).bind(3, template_id);
  return t.run();
}


bool valid_tag(std::string_view tag) {
  auto alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); };
  if (tag.empty() || tag.size() > 128 || !alnum(tag[0])) return false;
  for (char c : tag)
    if (!alnum(c) && c != '.' && c != '_' && c != '-') return false;
  return true;
}

Result<TemplateRef> parse_template_ref(std::string_view ref) {
  std::string whole(ref);
  TemplateRef r;
  r.tag = kDefaultTag;
  if (size_t slash = ref.find('/'); slash != std::string_view::npos) {
    r.team = std::string(ref.substr(0, slash));
    ref.remove_prefix(slash + 1);
    if (r.team.empty() || ref.find('/') != std::string_view::npos)
      return invalid_error("template '" + whole + "': want [team/]name[:tag]");
  }
  if (size_t colon = ref.find(':'); colon != std::string_view::npos) {
    std::string_view tag = ref.substr(colon + 1);
    ref = ref.substr(0, colon);
    if (!valid_tag(tag))
      return invalid_error("template '" + whole + "': tag '" + std::string(tag) +
                           "' must be 1 to 128 of letters, digits, '.', '_' and '-'");
    r.tag = std::string(tag);
  }
  if (ref.empty()) return invalid_error("template '" + whole + "': an empty name");
  r.name = std::string(ref);
  return r;
}

Result<std::optional<TemplateRow>> Store::resolve_template(const std::string& tenant_id, const std::string& ref) {
  Result<TemplateRef> r = parse_template_ref(ref);
  if (!r) return r.error();
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kTemplateCols +
                  ", (SELECT name FROM tenants WHERE tenants.id = templates.tenant_id) FROM templates "
                  "WHERE (id = ?1 OR name = ?1) AND status != 'deleted' "
                  "AND (tenant_id IS NULL OR tenant_id = ?2 OR public != 0) "
                  "ORDER BY (id = ?1) DESC, (tenant_id = ?2) DESC LIMIT 1");
  st.bind(1, r->name).bind(2, tenant_id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  if (!*row) return std::optional<TemplateRow>();
  TemplateRow t = template_from(st);
  if (!r->team.empty() && (st.is_null(16) || st.text(16) != r->team)) return std::optional<TemplateRow>();
  SG_TRY_STMT(g, tx,
              "SELECT b.id, b.rootfs_path, b.layers, b.config, b.cpu_count, b.memory_mb FROM template_tags g "
              "JOIN template_builds b ON b.id = g.build_id WHERE g.template_id = ? AND g.tag = ?");
  g.bind(1, t.id).bind(2, r->tag);
  Result<bool> tagged = g.step();
  if (!tagged) return tagged.error();
  if (*tagged) {
    t.build_id = g.text(0);
    t.rootfs_path = g.text(1);
    t.layers = g.text(2);
    t.config = g.text(3);
    t.cpu_count = g.int64(4);
    t.memory_mb = g.int64(5);
    t.status = "ready";
    return std::optional<TemplateRow>(std::move(t));
  }
  SG_TRY_STMT(n, tx, "SELECT COUNT(*) FROM template_tags WHERE template_id = ?");
  n.bind(1, t.id);
  Result<bool> counted = n.step();
  if (!counted) return counted.error();
  // Untagged: the server's own templates, and one whose first build has
  // not ended ready (its status says which).
  if (n.int64(0) == 0 && r->tag == kDefaultTag) return std::optional<TemplateRow>(std::move(t));
  return not_found_error("template '" + t.name + "' has no tag '" + r->tag + "'");
}

Result<std::vector<TagRow>> Store::list_tags(const std::string& template_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "SELECT tag, build_id, created_at FROM template_tags WHERE template_id = ? ORDER BY tag");
  st.bind(1, template_id);
  return collect<TagRow>(st, [](const Stmt& s) { return TagRow{s.text(0), s.text(1), s.int64(2)}; });
}

Result<std::string> Store::assign_tags(const std::string& tenant_id, const std::string& target,
                                       const std::vector<std::string>& tags, int64_t now) {
  Result<TemplateRef> r = parse_template_ref(target);
  if (!r) return r.error();
  if (!r->team.empty()) return invalid_error("target '" + target + "': name the template without a team");
  if (tags.empty() || tags.size() > kMaxTags)
    return invalid_error("want 1 to " + std::to_string(kMaxTags) + " tags, got " + std::to_string(tags.size()));
  for (const std::string& tag : tags)
    if (!valid_tag(tag)) return invalid_error("tag '" + tag + "' must be 1 to 128 of letters, digits, '.', '_' and '-'");
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  Result<std::string> id = owned_template(tx, tenant_id, r->name);
  if (!id) return id.error();
  SG_TRY_STMT(q, tx, "SELECT build_id FROM template_tags WHERE template_id = ? AND tag = ?");
  q.bind(1, *id).bind(2, r->tag);
  Result<bool> row = q.step();
  if (!row) return row.error();
  if (!*row) return not_found_error("template '" + r->name + "' has no tag '" + r->tag + "'");
  std::string build = q.text(0);
  for (const std::string& tag : tags) SG_TRY(set_tag(tx, *id, tag, build, now));
  SG_TRY(tx.commit());
  return build;
}

Status Store::remove_tags(const std::string& tenant_id, const std::string& name, const std::vector<std::string>& tags) {
  Result<TemplateRef> r = parse_template_ref(name);
  if (!r) return r.error();
  if (!r->team.empty() || name.find(':') != std::string::npos) return invalid_error("name '" + name + "': want the template's name alone");
  if (tags.empty() || tags.size() > kMaxTags)
    return invalid_error("want 1 to " + std::to_string(kMaxTags) + " tags, got " + std::to_string(tags.size()));
  auto tx = db_->transaction();
  SG_TRY(tx.begin_status());
  Result<std::string> id = owned_template(tx, tenant_id, r->name);
  if (!id) return id.error();
  for (const std::string& tag : tags) {
    if (tag == kDefaultTag)
      return invalid_error("the 'default' tag cannot be removed: assign it to another build instead");
    SG_TRY_STMT(st, tx, "DELETE FROM template_tags WHERE template_id = ? AND tag = ?");
    st.bind(1, *id).bind(2, tag);
    SG_TRY(st.run());
    if (tx.changes() == 0) return not_found_error("template '" + r->name + "' has no tag '" + tag + "'");
  }
  return tx.commit();
}

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
    if (t.origin_node) return copy_error(name, *t.origin_node);
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
              "updated_at, tags) VALUES(?,?,?,?,?,?,?,?,?)");
  st.bind(1, build.id).bind(2, t.id).bind(3, tenant_id).bind(4, std::string(kBuildWaiting)).bind(5, build.cpu_count)
      .bind(6, build.memory_mb).bind(7, build.created_at).bind(8, build.created_at).bind(9, join_tags(build.tags));
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
              "UPDATE template_builds SET status = 'ready', updated_at = ?, finished_at = ?, rootfs_path = ?, "
              "layers = ?, config = ? WHERE id = ? AND status = 'building' RETURNING template_id, tags");
  st.bind(1, now).bind(2, now).bind(3, rootfs).bind(4, layers).bind(5, config).bind(6, build_id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  if (!*row) return conflict_error("build " + build_id + " is not running");
  std::string template_id = st.text(0);
  std::vector<std::string> tags = split_tags(st.text(1));
  SG_TRY(st.run());  // the UPDATE's RETURNING row read; step it to its end
  if (tags.empty()) tags.push_back(kDefaultTag);
  SG_TRY_STMT(t, tx, "UPDATE templates SET status = 'ready', updated_at = ? WHERE id = ? AND status != 'deleted'");
  t.bind(1, now).bind(2, template_id);
  SG_TRY(t.run());
  if (tx.changes() == 0) return tx.commit();  // deleted meanwhile: the build is kept, untagged
  for (const std::string& tag : tags) SG_TRY(set_tag(tx, template_id, tag, build_id, now));
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

namespace {
BuildLogRow log_from(const Stmt& s) {
  BuildLogRow r;
  r.seq = s.int64(0);
  r.at_ms = s.int64(1);
  r.level = s.text(2);
  r.step = s.text(3);
  r.message = s.text(4);
  return r;
}
}  // namespace

Result<std::vector<BuildLogRow>> Store::build_logs(const std::string& build_id, const BuildLogQuery& q) {
  auto tx = db_->lock();
  std::string sql =
      "SELECT seq, at_ms, level, step, message FROM build_logs WHERE build_id = ?1 "
      "AND (CASE level WHEN 'debug' THEN 0 WHEN 'info' THEN 1 WHEN 'warn' THEN 2 ELSE 3 END) >= ?2";
  if (q.cursor_ms) sql += q.forward ? " AND at_ms >= ?3" : " AND at_ms <= ?3";
  sql += q.forward ? " ORDER BY seq LIMIT ?4" : " ORDER BY seq DESC LIMIT ?4";
  SG_TRY_STMT(st, tx, sql);
  st.bind(1, build_id).bind(2, q.min_level).bind(4, q.limit);
  if (q.cursor_ms) st.bind(3, *q.cursor_ms);
  return collect<BuildLogRow>(st, log_from);
}

Result<std::vector<BuildLogRow>> Store::build_logs(const std::string& build_id, int64_t offset, int64_t limit) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT seq, at_ms, level, step, message FROM build_logs WHERE build_id = ? AND seq >= ? "
              "ORDER BY seq LIMIT ?");
  st.bind(1, build_id).bind(2, offset).bind(3, limit);
  return collect<BuildLogRow>(st, log_from);
}

Status Store::add_template_file(const TemplateFileRow& f) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "INSERT OR REPLACE INTO template_files(path, tenant_id, kind, template_id, bytes, created_at, used_at) "
              "VALUES(?,?,?,?,?,?,?)");
  st.bind(1, f.path).bind(2, f.tenant_id).bind(3, f.kind).bind(4, f.template_id).bind(5, f.bytes)
      .bind(6, f.created_at).bind(7, f.used_at);
  return st.run();
}

Status Store::touch_template_file(const std::string& path, int64_t now) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE template_files SET used_at = MAX(used_at, ?) WHERE path = ?");
  st.bind(1, now).bind(2, path);
  return st.run();
}

Status Store::set_template_file_bytes(const std::string& path, int64_t bytes) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "UPDATE template_files SET bytes = ? WHERE path = ?");
  st.bind(1, bytes).bind(2, path);
  return st.run();
}

Status Store::drop_template_file(const std::string& path) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "DELETE FROM template_files WHERE path = ?");
  st.bind(1, path);
  return st.run();
}

Result<std::vector<TemplateFileRow>> Store::template_files() {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT path, tenant_id, kind, template_id, bytes, created_at, used_at, EXISTS(SELECT 1 FROM templates t "
              "WHERE t.id = template_files.template_id AND t.status != 'deleted') FROM template_files ORDER BY path");
  return collect<TemplateFileRow>(st, [](const Stmt& s) {
    return TemplateFileRow{s.text(0), s.text(1), s.text(2), s.text(3), s.int64(4), s.int64(5), s.int64(6),
                           s.int64(7) != 0};
  });
}

Result<int64_t> Store::template_bytes(const std::string& tenant_id) {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx, "SELECT COALESCE(SUM(bytes), 0) FROM template_files WHERE tenant_id = ?");
  st.bind(1, tenant_id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  return st.int64(0);
}

Result<std::vector<std::pair<std::string, std::string>>> Store::template_roots_in_use() {
  auto tx = db_->lock();
  SG_TRY_STMT(st, tx,
              "SELECT rootfs_path, layers FROM templates WHERE status != 'deleted' "
              "UNION SELECT b.rootfs_path, b.layers FROM template_builds b "
              "JOIN template_tags g ON g.build_id = b.id JOIN templates t ON t.id = g.template_id "
              "WHERE t.status != 'deleted' AND b.layers IS NOT NULL "
              "UNION SELECT b.rootfs_path, b.layers FROM template_builds b JOIN sandboxes s ON s.build_id = b.id "
              "WHERE s.state IN ('creating', 'running', 'paused') AND b.layers IS NOT NULL "
              // A deleted template's files while a sandbox still runs it
              // (forks run a snapshot deleted as they start).
              "UNION SELECT t.rootfs_path, t.layers FROM templates t JOIN sandboxes s ON s.template_id = t.id "
              "WHERE s.state IN ('creating', 'running', 'paused')");
  return collect<std::pair<std::string, std::string>>(
      st, [](const Stmt& s) { return std::pair<std::string, std::string>(s.text(0), s.text(1)); });
}

}  // namespace sg::storage
