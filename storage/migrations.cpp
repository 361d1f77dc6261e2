// The schema history. Never edit a released migration: add a new one.
#include "storage/migrations.h"

namespace sg::storage {

const std::vector<Migration>& migrations() {
  static const std::vector<Migration> kList = {
      {1, "initial",
       R"sql(
CREATE TABLE tenants (
  id            TEXT PRIMARY KEY,
  name          TEXT NOT NULL UNIQUE,
  created_at    INTEGER NOT NULL,
  max_sandboxes INTEGER NOT NULL,
  max_memory_mb INTEGER NOT NULL,
  disabled      INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE api_keys (
  id         TEXT PRIMARY KEY,
  tenant_id  TEXT NOT NULL REFERENCES tenants(id),
  key_hash   TEXT NOT NULL UNIQUE,
  key_prefix TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  revoked_at INTEGER
);
CREATE INDEX api_keys_tenant ON api_keys(tenant_id);
CREATE TABLE templates (
  id           TEXT PRIMARY KEY,
  name         TEXT NOT NULL UNIQUE,
  tenant_id    TEXT REFERENCES tenants(id),
  status       TEXT NOT NULL,
  rootfs_path  TEXT NOT NULL,
  cpu_count    INTEGER NOT NULL,
  memory_mb    INTEGER NOT NULL,
  disk_size_mb INTEGER NOT NULL,
  created_at   INTEGER NOT NULL,
  updated_at   INTEGER NOT NULL
);
CREATE TABLE sandboxes (
  seq            INTEGER PRIMARY KEY AUTOINCREMENT,
  id             TEXT NOT NULL UNIQUE,
  tenant_id      TEXT NOT NULL REFERENCES tenants(id),
  template_id    TEXT NOT NULL REFERENCES templates(id),
  alias          TEXT,
  state          TEXT NOT NULL,
  backend        TEXT NOT NULL,
  metadata       TEXT NOT NULL,
  env_vars       TEXT NOT NULL,
  envd_token     TEXT NOT NULL,
  envd_version   TEXT NOT NULL,
  cpu_count      INTEGER NOT NULL,
  memory_mb      INTEGER NOT NULL,
  disk_size_mb   INTEGER NOT NULL,
  timeout_s      INTEGER NOT NULL,
  started_at     INTEGER NOT NULL,
  end_at         INTEGER NOT NULL,
  on_timeout     TEXT NOT NULL,
  auto_resume    INTEGER NOT NULL,
  allow_internet INTEGER,
  init_pid       INTEGER,
  ended_at       INTEGER,
  end_reason     TEXT
);
CREATE INDEX sandboxes_tenant_state ON sandboxes(tenant_id, state);
CREATE INDEX sandboxes_state_end ON sandboxes(state, end_at);
CREATE TABLE events (
  seq        INTEGER PRIMARY KEY AUTOINCREMENT,
  at         INTEGER NOT NULL,
  tenant_id  TEXT,
  sandbox_id TEXT,
  kind       TEXT NOT NULL,
  detail     TEXT NOT NULL
);
CREATE INDEX events_sandbox ON events(sandbox_id);
)sql"},
      // The model API proxy (wait-engine/llm): virtual keys, upstreams and
      // per-request token usage.
      {2, "llm proxy",
       R"sql(
CREATE TABLE llm_keys (
  id         TEXT PRIMARY KEY,
  tenant_id  TEXT NOT NULL REFERENCES tenants(id),
  key_hash   TEXT NOT NULL UNIQUE,
  key_prefix TEXT NOT NULL,
  name       TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  revoked_at INTEGER
);
CREATE INDEX llm_keys_tenant ON llm_keys(tenant_id);
CREATE TABLE llm_upstreams (
  tenant_id  TEXT NOT NULL,
  provider   TEXT NOT NULL,
  base_url   TEXT NOT NULL,
  api_key    TEXT NOT NULL,
  updated_at INTEGER NOT NULL,
  PRIMARY KEY (tenant_id, provider)
);
CREATE TABLE llm_usage (
  seq                INTEGER PRIMARY KEY AUTOINCREMENT,
  at                 INTEGER NOT NULL,
  tenant_id          TEXT NOT NULL,
  sandbox_id         TEXT,
  provider           TEXT NOT NULL,
  route              TEXT NOT NULL,
  model              TEXT NOT NULL,
  stream             INTEGER NOT NULL,
  status             INTEGER NOT NULL,
  outcome            TEXT NOT NULL,
  input_tokens       INTEGER NOT NULL,
  output_tokens      INTEGER NOT NULL,
  cache_read_tokens  INTEGER NOT NULL,
  cache_write_tokens INTEGER NOT NULL,
  usage_found        INTEGER NOT NULL,
  duration_ms        INTEGER NOT NULL,
  wait_paused_ms     INTEGER NOT NULL
);
CREATE INDEX llm_usage_tenant_at ON llm_usage(tenant_id, at);
CREATE INDEX llm_usage_sandbox ON llm_usage(sandbox_id);
)sql"},
      // The memory offload engine's cohort dictionaries (wait-engine/memory,
      // docs/memory-codecs.md). AUTOINCREMENT: an id is never reused, so a
      // page record naming a deleted dictionary can never match a new one.
      {3, "memory dictionaries",
       R"sql(
CREATE TABLE memory_dictionaries (
  id          INTEGER PRIMARY KEY AUTOINCREMENT,
  tenant_id   TEXT NOT NULL,
  cohort_key  TEXT NOT NULL,
  dict_hex    TEXT NOT NULL,
  level       INTEGER NOT NULL,
  created_at  INTEGER NOT NULL,
  refcount    INTEGER NOT NULL,
  saved_ppm   INTEGER NOT NULL
);
CREATE INDEX memory_dictionaries_cohort ON memory_dictionaries(tenant_id, cohort_key, id);
)sql"},
      // E2B's traffic access token: set when a create asks for
      // allowPublicTraffic false; then the sandbox's user ports need it.
      {4, "sandbox traffic token",
       R"sql(
ALTER TABLE sandboxes ADD COLUMN traffic_token TEXT;
)sql"},
      // Templates a tenant owns and shares (E2B's "public"); a deleted
      // template keeps its row for the sandboxes that ran it.
      {5, "template visibility",
       R"sql(
ALTER TABLE templates ADD COLUMN public INTEGER NOT NULL DEFAULT 0;
CREATE INDEX sandboxes_template ON sandboxes(template_id);
)sql"},
      // Template builds (issue 19): a built template's layers over its
      // base's rootfs and its configuration, its builds and their logs.
      {6, "template builds",
       R"sql(
ALTER TABLE templates ADD COLUMN layers TEXT NOT NULL DEFAULT '[]';
ALTER TABLE templates ADD COLUMN config TEXT NOT NULL DEFAULT '{}';
ALTER TABLE templates ADD COLUMN build_id TEXT;
CREATE TABLE template_builds (
  id          TEXT PRIMARY KEY,
  template_id TEXT NOT NULL REFERENCES templates(id),
  tenant_id   TEXT NOT NULL,
  status      TEXT NOT NULL,
  reason      TEXT,
  reason_step TEXT,
  cpu_count   INTEGER NOT NULL,
  memory_mb   INTEGER NOT NULL,
  created_at  INTEGER NOT NULL,
  updated_at  INTEGER NOT NULL,
  finished_at INTEGER
);
CREATE INDEX template_builds_template ON template_builds(template_id);
CREATE TABLE build_logs (
  build_id TEXT NOT NULL,
  seq      INTEGER NOT NULL,
  at_ms    INTEGER NOT NULL,
  level    TEXT NOT NULL,
  step     TEXT NOT NULL,
  message  TEXT NOT NULL,
  PRIMARY KEY (build_id, seq)
);
)sql"},
      // Template tags (issue 19): each ready build keeps its files and
      // configuration; a tag names one build of its template. A template
      // row's layers and config are its "default" build's.
      {7, "template tags",
       R"sql(
ALTER TABLE template_builds ADD COLUMN tags TEXT NOT NULL DEFAULT '';
ALTER TABLE template_builds ADD COLUMN rootfs_path TEXT;
ALTER TABLE template_builds ADD COLUMN layers TEXT;
ALTER TABLE template_builds ADD COLUMN config TEXT;
CREATE TABLE template_tags (
  template_id TEXT NOT NULL REFERENCES templates(id),
  tag         TEXT NOT NULL,
  build_id    TEXT NOT NULL REFERENCES template_builds(id),
  created_at  INTEGER NOT NULL,
  PRIMARY KEY (template_id, tag)
);
UPDATE template_builds SET
  rootfs_path = (SELECT t.rootfs_path FROM templates t WHERE t.build_id = template_builds.id),
  layers = (SELECT t.layers FROM templates t WHERE t.build_id = template_builds.id),
  config = (SELECT t.config FROM templates t WHERE t.build_id = template_builds.id)
  WHERE id IN (SELECT build_id FROM templates WHERE build_id IS NOT NULL);
INSERT INTO template_tags(template_id, tag, build_id, created_at)
  SELECT id, 'default', build_id, updated_at FROM templates WHERE build_id IS NOT NULL AND status != 'deleted';
)sql"},
      // What template builds store (layers, uploads, image roots), by
      // tenant, for quotas and collection; the build each sandbox runs.
      {8, "template files",
       R"sql(
ALTER TABLE sandboxes ADD COLUMN build_id TEXT;
CREATE INDEX sandboxes_build ON sandboxes(build_id);
CREATE TABLE template_files (
  path       TEXT PRIMARY KEY,
  tenant_id  TEXT NOT NULL,
  kind       TEXT NOT NULL,
  template_id TEXT,
  bytes      INTEGER NOT NULL,
  created_at INTEGER NOT NULL,
  used_at    INTEGER NOT NULL
);
CREATE INDEX template_files_tenant ON template_files(tenant_id);
)sql"},
      // A sandbox's egress lists (allowOut, denyOut), so a restart of
      // sandgate that takes its sandboxes back keeps their policies; and
      // snapshots: templates made of a sandbox (kind "snapshot"), or of
      // one for its forks ("fork").
      {9, "sandbox network, snapshots",
       R"sql(
ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT '{}';
CREATE TABLE snapshots (
  seq         INTEGER PRIMARY KEY AUTOINCREMENT,
  template_id TEXT NOT NULL UNIQUE REFERENCES templates(id),
  tenant_id   TEXT NOT NULL REFERENCES tenants(id),
  sandbox_id  TEXT NOT NULL,
  kind        TEXT NOT NULL,
  created_at  INTEGER NOT NULL
);
CREATE INDEX snapshots_tenant ON snapshots(tenant_id, seq);
)sql"},
      // Cluster mode (issue 22): a template copied from the node that
      // built it names that node and the revision of its record in etcd.
      {10, "template copies",
       R"sql(
ALTER TABLE templates ADD COLUMN origin_node TEXT;
ALTER TABLE templates ADD COLUMN origin_revision INTEGER NOT NULL DEFAULT 0;
)sql"},
  };
  return kList;
}

Result<int> schema_version(Db& db) {
  auto tx = db.lock();
  Result<Stmt> st = tx.prepare("PRAGMA user_version");
  if (!st) return st.error();
  Result<bool> row = st->step();
  if (!row) return row.error();
  return static_cast<int>(st->int64(0));
}

Result<int> migrate(Db& db, const std::vector<Migration>& list) {
  Result<int> cur = schema_version(db);
  if (!cur) return cur.error();
  int version = *cur;
  int newest = list.empty() ? 0 : list.back().version;
  if (version > newest)
    return internal_error("database " + db.path() + " has schema version " + std::to_string(version) +
                          ", newer than this sandgate knows (" + std::to_string(newest) +
                          "): upgrade sandgate instead of downgrading the database");
  for (const Migration& m : list) {
    if (m.version <= version) continue;
    if (m.version != version + 1)
      return internal_error("migration list has a gap before version " + std::to_string(m.version));
    auto tx = db.transaction();
    if (Status s = tx.begin_status(); !s) return s.error();
    if (Status s = tx.exec(m.sql); !s)
      return s.error().with_context("migration " + std::to_string(m.version) + " (" + m.name + ")");
    if (Status s = tx.exec("PRAGMA user_version = " + std::to_string(m.version)); !s) return s.error();
    if (Status s = tx.commit(); !s) return s.error();
    version = m.version;
  }
  return version;
}

}  // namespace sg::storage
