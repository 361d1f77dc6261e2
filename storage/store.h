// Store: the repository layer over the SQLite schema (docs/schema.md).
//
// Every method is one short transaction. All of them block on SQLite and run
// on worker threads, never on io threads. Rows are plain structs; JSON
// columns (metadata, env_vars) are carried as serialised text.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "storage/db.h"
#include "base/status.h"

namespace sg::storage {

struct TenantRow {
  std::string id;
  std::string name;
  int64_t created_at = 0;
  int64_t max_sandboxes = 0;
  int64_t max_memory_mb = 0;
  bool disabled = false;
};

struct ApiKeyRow {
  std::string id;
  std::string tenant_id;
  std::string key_hash;    // hex SHA-256 of the whole key; the key itself is never stored
  std::string key_prefix;  // first characters, to tell keys apart in listings
  int64_t created_at = 0;
  std::optional<int64_t> revoked_at;
};

struct TemplateRow {
  std::string id;
  std::string name;
  std::optional<std::string> tenant_id;  // nullopt: public to every tenant
  std::string status;                    // "building", "ready", "failed"
  std::string rootfs_path;
  int64_t cpu_count = 2;
  int64_t memory_mb = 512;
  int64_t disk_size_mb = 1024;
  int64_t created_at = 0;
  int64_t updated_at = 0;
  // Shared with every tenant by its owner. A template without an owner
  // (tenant_id nullopt: the server's own, like base) is public too.
  bool is_public = false;
  // A built template: its layers over rootfs_path (a JSON array of
  // directories, lowest first), its configuration (JSON: env, user,
  // workdir, startCmd, readyCmd) and the build that made them.
  std::string layers = "[]";
  std::string config = "{}";
  std::optional<std::string> build_id;
  // Cluster mode: a copy of a template another node built (that node's
  // id), made from its etcd record at origin_revision; nullopt: made here.
  std::optional<std::string> origin_node;
  int64_t origin_revision = 0;
};

// Template build states (E2B's TemplateBuildStatus).
inline constexpr const char* kBuildWaiting = "waiting";
inline constexpr const char* kBuildBuilding = "building";
inline constexpr const char* kBuildReady = "ready";
inline constexpr const char* kBuildError = "error";

struct BuildRow {
  std::string id;  // a UUID
  std::string template_id;
  std::string tenant_id;
  std::string status;  // kBuild*
  std::optional<std::string> reason;
  std::optional<std::string> reason_step;
  int64_t cpu_count = 2;
  int64_t memory_mb = 1024;
  int64_t created_at = 0;
  int64_t updated_at = 0;
  std::optional<int64_t> finished_at;
  // The tags it asked for (given to it when it ends ready; none: "default").
  std::vector<std::string> tags;
};

// GET .../builds/{build}/logs: lines at or after (forward) or at or
// before (backward) cursor_ms, at min_level or above (0 debug, 1 info,
// 2 warn, 3 error), at most limit, in that direction's order.
struct BuildLogQuery {
  std::optional<int64_t> cursor_ms;
  bool forward = true;
  int min_level = 0;
  int64_t limit = 100;
};

// A file tree a template build stored: a layer, an upload, an image root.
inline constexpr const char* kFileLayer = "layer";
inline constexpr const char* kFileUpload = "upload";
inline constexpr const char* kFileImage = "image";
struct TemplateFileRow {
  std::string path;
  std::string tenant_id;  // whose build made it (an image: the first to pull it)
  std::string kind;       // kFile*
  std::string template_id;  // the template whose build made it
  int64_t bytes = 0;      // on disk (allocated blocks)
  int64_t created_at = 0;
  int64_t used_at = 0;  // last made, uploaded or taken from the cache
  // Read only: whether template_id is a template not deleted.
  bool template_live = false;
};

// A tag: a name for one ready build of a template.
inline constexpr const char* kDefaultTag = "default";
inline constexpr size_t kMaxTags = 16;

struct TagRow {
  std::string tag;
  std::string build_id;
  int64_t created_at = 0;
};

// Cluster mode (docs/cluster.md, "Templates between nodes"): a template
// as nodes share it, its row and each tag's build.
struct SharedBuild {
  std::string tag, build_id, rootfs_path, layers, config;
  int64_t cpu_count = 0, memory_mb = 0;
};
struct SharedTemplate {
  TemplateRow row;
  std::string team;  // the owner tenant's name
  std::vector<SharedBuild> tags;
};

// A template as clients name it: "[team/]name[:tag]" (or its id for name).
struct TemplateRef {
  std::string team;  // "" when not given
  std::string name;
  std::string tag;   // kDefaultTag when not given
};
// kInvalid for an empty name or tag, a bad tag, more than one '/' or ':'.
Result<TemplateRef> parse_template_ref(std::string_view ref);
// 1 to 128 of A-Z a-z 0-9 '.', '_', '-', starting with a letter or digit.
bool valid_tag(std::string_view tag);

struct BuildLogRow {
  int64_t seq = 0;  // from 0, per build
  int64_t at_ms = 0;
  std::string level;  // debug, info, warn, error
  std::string step;   // "1".., "base", "finalize", or ""
  std::string message;
};

inline constexpr const char* kTemplateDeleted = "deleted";

// How a template has been used, from its sandboxes' rows.
struct TemplateUsage {
  int64_t spawn_count = 0;                // sandboxes ever created from it
  std::optional<int64_t> last_spawned_at;  // the newest one's start
  int64_t live = 0;                       // those creating, running or paused
};

// Sandbox states. creating -> running <-> paused; any -> killed | lost | failed.
inline constexpr const char* kStateCreating = "creating";
inline constexpr const char* kStateRunning = "running";
inline constexpr const char* kStatePaused = "paused";
// A sandbox's on_timeout for autoPause with autoPauseMemory false: its
// files only (clients see "pause").
inline constexpr const char* kOnTimeoutPauseFiles = "pause-files";
inline constexpr const char* kStateKilled = "killed";  // deleted by a client or timed out
inline constexpr const char* kStateLost = "lost";      // its processes died (crash, sandgate restart)
inline constexpr const char* kStateFailed = "failed";  // create did not complete

struct SandboxRow {
  int64_t seq = 0;
  std::string id;
  std::string tenant_id;
  std::string template_id;
  std::optional<std::string> alias;
  std::string state;
  std::string backend;
  std::string metadata = "{}";
  std::string env_vars = "{}";
  std::string envd_token;
  std::string envd_version;
  int64_t cpu_count = 0;
  int64_t memory_mb = 0;
  int64_t disk_size_mb = 0;
  int64_t timeout_s = 0;
  int64_t started_at = 0;
  int64_t end_at = 0;
  std::string on_timeout = "kill";  // "kill", "pause" or kOnTimeoutPauseFiles
  bool auto_resume = false;
  std::optional<bool> allow_internet;
  std::optional<int64_t> init_pid;
  std::optional<int64_t> ended_at;
  std::optional<std::string> end_reason;
  // E2B's trafficAccessToken (allowPublicTraffic false): user ports need
  // it in the e2b-traffic-access-token header. Unset: ports are public.
  std::optional<std::string> traffic_token;
  // The template build it runs (none for the server's own templates and
  // snapshots): what its files are, for snapshots and collection.
  std::optional<std::string> build_id;
  // The egress lists as the client gave them: {"allowOut":[...],"denyOut":[...]}.
  std::string network = "{}";
};

// A template made of a sandbox's files (POST /sandboxes/{id}/snapshots),
// or of one for its forks.
inline constexpr const char* kSnapshotKind = "snapshot";
inline constexpr const char* kForkKind = "fork";
// A filesystem-only pause's (keepMemory false): the files the sandbox
// resumes from; hidden, deleted when the sandbox ends. Once the sandbox
// has started again from them, "resumed": the files it runs on.
inline constexpr const char* kPauseKind = "pause";
inline constexpr const char* kResumedKind = "resumed";
struct SnapshotRow {
  int64_t seq = 0;
  std::string template_id;
  std::string tenant_id;
  std::string sandbox_id;
  std::string kind = kSnapshotKind;
  int64_t created_at = 0;
  std::string name;  // read only: its template's name
  std::string build_id;  // written only: the build add_snapshot makes
};

struct EventRow {
  int64_t seq = 0;
  int64_t at = 0;
  std::optional<std::string> tenant_id;
  std::optional<std::string> sandbox_id;
  std::string kind;
  std::string detail;
};

// Model API proxy (wait-engine/llm). A virtual key: what a sandbox presents
// to the proxy instead of a provider key; separate from the E2B API keys.
struct LlmKeyRow {
  std::string id;          // "lk_" + 16 hex, what `llm key revoke` takes
  std::string tenant_id;
  std::string key_hash;    // hex SHA-256 of the whole key; the key itself is never stored
  std::string key_prefix;  // "sk-sg-" + 6 hex + "...", for listings
  std::string name;        // operator's label, may be empty
  int64_t created_at = 0;  // unix seconds
  std::optional<int64_t> revoked_at;
};

// Where the proxy sends a provider's requests. api_key is the provider's
// secret: stored (the file is 0600) but never printed or logged.
struct UpstreamRow {
  std::string tenant_id;  // "" = global, for tenants without their own
  std::string provider;   // "openai" | "anthropic"
  std::string base_url;   // normalised by tenancy::check_upstream
  std::string api_key;
  int64_t updated_at = 0;
};

// One proxied model request. Token counts are stored as SQLite's signed
// 64-bit integers, saturated at INT64_MAX.
struct LlmUsageRow {
  int64_t seq = 0;     // assigned on insert; ignored by insert_llm_usage
  int64_t at_ms = 0;   // unix milliseconds
  std::string tenant_id;
  std::optional<std::string> sandbox_id;  // nullopt: the key was not bound to a sandbox
  std::string provider;
  std::string route;   // e.g. "/v1/chat/completions"
  std::string model;
  bool stream = false;
  int status = 0;       // HTTP status sent to the client, 0 if none
  std::string outcome;  // completed | upstream_error | client_gone | cancelled | refused
  uint64_t input_tokens = 0, output_tokens = 0, cache_read_tokens = 0, cache_write_tokens = 0;
  bool usage_found = false;
  int64_t duration_ms = 0;
  int64_t wait_paused_ms = 0;
};

struct LlmUsageQuery {
  std::string tenant_id;                  // required: rows of other tenants are never returned
  std::optional<std::string> sandbox_id;  // only this sandbox's rows
  int64_t after_seq = 0;                  // pagination cursor (exclusive)
  size_t limit = 100;                     // capped at kMaxLlmUsagePage
};
inline constexpr size_t kMaxLlmUsagePage = 1000;

struct LlmUsageTotals {
  uint64_t requests = 0, input_tokens = 0, output_tokens = 0, cache_read_tokens = 0, cache_write_tokens = 0;
};

// Memory offload engine (wait-engine/memory): a published cohort
// dictionary. bytes is the zstd dictionary itself (stored hex-encoded:
// Stmt binds text only). saved_ppm: what it saved on held-out pages, in
// parts per million of their plain-zstd size.
struct MemoryDictionaryRow {
  int64_t id = 0;  // assigned on insert
  std::string tenant_id;
  std::string cohort_key;
  std::string bytes;
  int64_t level = 3;
  int64_t created_at = 0;
  int64_t refcount = 1;
  int64_t saved_ppm = 0;
};

struct SandboxQuery {
  std::string tenant_id;
  std::vector<std::string> states;  // empty: running and paused
  // Every pair must be present in the sandbox's metadata.
  std::vector<std::pair<std::string, std::string>> metadata;
  std::optional<std::string> template_id;
  std::optional<int64_t> started_after;  // unix seconds
  int64_t after_seq = 0;            // pagination cursor (exclusive)
  bool descending = false;
  int64_t limit = 100;
};

class Store {
 public:
  // Opens the database, applies migrations.
  static Result<std::unique_ptr<Store>> open(const std::string& path);
  Db& db() { return *db_; }

  // Tenants and keys.
  Status insert_tenant(const TenantRow& t);
  Result<std::optional<TenantRow>> find_tenant_by_name(const std::string& name);
  Result<std::optional<TenantRow>> find_tenant(const std::string& id);
  Result<std::vector<TenantRow>> list_tenants();
  Status set_tenant_limits(const std::string& id, int64_t max_sandboxes, int64_t max_memory_mb);
  Status insert_key(const ApiKeyRow& k);
  // Cluster mode's mirror of the tenants and keys in etcd: inserts, or
  // updates what may change (a tenant's name, limits and disabled flag; a
  // key's revocation). kInternal when another tenant holds the name here.
  Status upsert_tenant(const TenantRow& t);
  Status upsert_key(const ApiKeyRow& k);
  // The tenant owning an unrevoked key with this hash, if its tenant is enabled.
  Result<std::optional<TenantRow>> tenant_for_key_hash(const std::string& key_hash);
  Result<std::vector<ApiKeyRow>> list_keys(const std::string& tenant_id);
  // Revokes one key (by id); returns false when no unrevoked key had that id.
  Result<bool> revoke_key(const std::string& key_id, int64_t now);
  // Revokes all keys of a tenant (API and model-proxy keys) and disables it;
  // returns the number of keys revoked.
  Result<int64_t> revoke_tenant(const std::string& tenant_id, int64_t now);

  // Templates.
  Status upsert_template(const TemplateRow& t);
  // By id or by name, visible to the tenant (public or its own); never a
  // deleted one.
  Result<std::optional<TemplateRow>> find_template(const std::string& tenant_id, const std::string& ref);
  // A template as clients name it (parse_template_ref) with the build
  // its tag names: rootfs_path, layers, config, build_id, cpu_count and
  // memory_mb are that build's. nullopt for no such template (or a team that is not its
  // owner's); kNotFound naming the tag for a template without that tag.
  // A template without any tag (the server's own) is its row, as
  // "default".
  Result<std::optional<TemplateRow>> resolve_template(const std::string& tenant_id, const std::string& ref);
  // A template's tags, by tag.
  Result<std::vector<TagRow>> list_tags(const std::string& template_id);
  // Points each tag at the build `target` ("name[:tag]" of the tenant's
  // own template) names; "default" moves the template's row to it too.
  // Returns the build id. kNotFound: no such template or tag; kInvalid:
  // not the tenant's, a bad tag.
  Result<std::string> assign_tags(const std::string& tenant_id, const std::string& target,
                                  const std::vector<std::string>& tags, int64_t now);
  // Removes the tags from the tenant's template `name`: kNotFound for a
  // tag it does not have (nothing removed), kInvalid for "default".
  Status remove_tags(const std::string& tenant_id, const std::string& name, const std::vector<std::string>& tags);
  // Every template the tenant can see, oldest first.
  Result<std::vector<TemplateRow>> list_templates(const std::string& tenant_id);
  Result<TemplateUsage> template_usage(const std::string& id);
  Status set_template_status(const std::string& id, const std::string& status, int64_t now);
  // The owner's changes. kNotFound for a template the tenant cannot see,
  // kInvalid for one it sees but does not own (a public template of
  // another tenant, or the server's own).
  Status set_template_public(const std::string& tenant_id, const std::string& id, bool is_public, int64_t now);
  // A build request (POST /v3/templates): the tenant's template of that
  // name (made, status "building", when there is none; kConflict when
  // another tenant has the name or a build of it is running) and a new
  // build row, waiting. Builds of it still waiting are superseded (error).
  Result<TemplateRow> request_build(const std::string& tenant_id, const std::string& name, const TemplateRow& fresh,
                                    const BuildRow& build);
  Result<std::optional<BuildRow>> find_build(const std::string& template_id, const std::string& build_id);
  Result<std::vector<BuildRow>> list_builds(const std::string& template_id);
  // waiting -> building; kConflict from any other state.
  Status start_build(const std::string& build_id, int64_t now);
  // Ends a build in error (reason and step say why) and, when the template
  // never had a ready build, the template too.
  Status fail_build(const std::string& build_id, const std::string& reason, const std::string& step, int64_t now);
  // Ends a build ready: it keeps its files and configuration, its tags
  // (default: "default") name it, and with "default" the template's row
  // takes them, in one transaction.
  Status finish_build(const std::string& build_id, const std::string& rootfs, const std::string& layers,
                      const std::string& config, int64_t now);
  // Appends log lines (seq assigned from the build's count) and returns
  // the count after.
  Result<int64_t> append_build_logs(const std::string& build_id, std::vector<BuildLogRow> rows);
  // Lines seq >= offset, at most limit.
  Result<std::vector<BuildLogRow>> build_logs(const std::string& build_id, int64_t offset, int64_t limit);
  Result<std::vector<BuildLogRow>> build_logs(const std::string& build_id, const BuildLogQuery& q);
  // Template files: records one (replacing a row of the same path), or
  // that it was used now.
  Status add_template_file(const TemplateFileRow& f);
  Status touch_template_file(const std::string& path, int64_t now);
  // The file's bytes changed (a pause's memory packed): counted anew.
  Status set_template_file_bytes(const std::string& path, int64_t bytes);
  Status drop_template_file(const std::string& path);
  Result<std::vector<TemplateFileRow>> template_files();
  // What the tenant's template files take, in bytes.
  Result<int64_t> template_bytes(const std::string& tenant_id);
  // The file trees templates still need, as (rootfs, layers JSON) pairs:
  // every template's row, every tagged build, every build a sandbox
  // creating, running or paused runs.
  Result<std::vector<std::pair<std::string, std::string>>> template_roots_in_use();
  // What a sandbox runs: its template's row (whatever its status) with
  // rootfs_path, layers and config those of the build it runs, if any.
  Result<TemplateRow> template_of_sandbox(const SandboxRow& r);
  // Snapshots. Adds one, in one transaction: its template row (ready),
  // the snapshot row, a ready build of the template (s.build_id) with its
  // files, tagged "default", and its layer's file row. A snapshot (kind
  // "snapshot") named as one of the tenant's earlier ones is a new build
  // of that template (as E2B does; sandboxes of the older build keep its
  // files); any other template of that name is kConflict. kQuota (nothing
  // added) when the tenant's template files would pass max_bytes (0: no
  // limit). Returns the template's id.
  Result<std::string> add_snapshot(const TemplateRow& t, const SnapshotRow& s, const TemplateFileRow& f,
                                   int64_t max_bytes);
  // The tenant's snapshots of kind "snapshot" whose template is not
  // deleted, oldest first, after seq `after`, at most limit; a sandbox id
  // or template name narrows them.
  Result<std::vector<SnapshotRow>> list_snapshots(const std::string& tenant_id, const std::string& sandbox_id,
                                                  const std::string& name, int64_t after, int64_t limit);
  // The newest not-deleted template of the sandbox's snapshots of kind
  // (kPauseKind: a filesystem-only pause it has not been started from;
  // kResumedKind: the files it runs on since); nullopt when none.
  Result<std::optional<TemplateRow>> paused_files(const std::string& sandbox_id, const char* kind = kPauseKind);
  // The pause's files are what the sandbox runs on now (kResumedKind).
  Status mark_resumed(const std::string& template_id);
  // Marks the templates of the sandbox's filesystem-only pauses deleted,
  // every one (it ended) or those it never started from (stale_only: a
  // pause cut short by a crash); the collector removes their files once
  // no sandbox runs them.
  Status drop_paused_files(const std::string& sandbox_id, bool stale_only = false);
  // paused -> running with a new init (a sandbox resumed from its files).
  Status set_resumed(const std::string& id, int64_t init_pid, const std::string& envd_version);
  // Marks it deleted and frees its name, in one transaction that refuses
  // (kConflict) while a sandbox of it is creating, running or paused.
  // The row stays for the sandboxes that ran it.
  Status delete_template(const std::string& tenant_id, const std::string& id, int64_t now);

  // Cluster mode. The tenants' ready templates made here (built, or
  // snapshots; not pauses, not copies), each with its tags' builds.
  Result<std::vector<SharedTemplate>> shared_templates();
  // Installs a copy of another node's template (row.origin_node and
  // origin_revision set): the row, a ready build per tag, the tags exactly
  // those, in one transaction (a copy of an older revision is replaced).
  // kConflict when a template made here has its id or name.
  Status install_template_copy(const SharedTemplate& t);
  // The copies not deleted: id -> origin_revision.
  Result<std::map<std::string, int64_t>> template_copies();
  // Marks a copy deleted (its origin changed or deleted it); sandboxes
  // running it keep its files until they end (the collector).
  Status drop_template_copy(const std::string& id, int64_t now);

  // Sandboxes.
  // Inserts the row (state "creating") if the tenant stays within
  // max_sandboxes live sandboxes and max_memory_mb of their memory; else a
  // kQuota error naming the limit. Atomic with respect to other inserts.
  Status insert_sandbox_within_quota(const SandboxRow& row, int64_t max_sandboxes, int64_t max_memory_mb);
  // A sandbox of this tenant in any state, or nullopt.
  Result<std::optional<SandboxRow>> get_sandbox(const std::string& tenant_id, const std::string& id);
  Result<std::vector<SandboxRow>> list_sandboxes(const SandboxQuery& q);
  // Every sandbox in creating, running or paused, all tenants (recovery).
  Result<std::vector<SandboxRow>> list_live();
  // running sandboxes whose end_at <= now.
  Result<std::vector<SandboxRow>> list_expired(int64_t now);
  // Compare-and-set of the state: true when the row was in one of `from`.
  Result<bool> transition(const std::string& id, const std::vector<std::string>& from, const std::string& to);
  Status set_running(const std::string& id, int64_t init_pid, const std::string& envd_version);
  Status set_end_at(const std::string& id, int64_t end_at);
  // allow_internet and the egress lists (SandboxRow::network) at once.
  Status set_network(const std::string& id, std::optional<bool> allow, const std::string& network);
  // Moves to a final state (killed, lost, failed) with a reason; false when already final.
  Result<bool> finish(const std::string& id, const std::string& state, const std::string& reason, int64_t now);

  // Events.
  Status add_event(const std::optional<std::string>& tenant_id, const std::optional<std::string>& sandbox_id,
                   const std::string& kind, const std::string& detail, int64_t now);
  // Many events in one transaction (the wait coordinator records every
  // state transition); each row's own `at` is stored, seq is assigned. All
  // or none are inserted.
  Status add_events(const std::vector<EventRow>& rows);
  Result<std::vector<EventRow>> events_for_sandbox(const std::string& sandbox_id);

  // Model-proxy keys (store_llm.cpp). Ids and hashes are random, so a
  // duplicate is an internal error.
  Status insert_llm_key(const LlmKeyRow& k);
  // Cluster mode's mirror (as upsert_key): a key's name and revocation may change.
  Status upsert_llm_key(const LlmKeyRow& k);
  // The tenant of an unrevoked key with this hash whose tenant is not
  // disabled; nullopt otherwise.
  Result<std::optional<TenantRow>> tenant_for_llm_key_hash(const std::string& key_hash);
  Result<std::vector<LlmKeyRow>> list_llm_keys(const std::string& tenant_id);
  // False when no unrevoked key had that id.
  Result<bool> revoke_llm_key(const std::string& key_id, int64_t now);

  // Upstreams: insert or replace the (tenant_id, provider) row.
  Status upsert_upstream(const UpstreamRow& u);
  // The tenant's own upstream for provider, else the global one, else nullopt.
  Result<std::optional<UpstreamRow>> find_upstream(const std::string& tenant_id, const std::string& provider);
  // Every row, global ones first, then by tenant id and provider.
  Result<std::vector<UpstreamRow>> list_upstreams();
  // False when there was no such row.
  Result<bool> remove_upstream(const std::string& tenant_id, const std::string& provider);

  // Usage: all rows in one transaction (the proxy batches them from a writer
  // thread); all or none are inserted.
  Status insert_llm_usage(const std::vector<LlmUsageRow>& rows);
  // The tenant's rows (optionally one sandbox's) with seq > after_seq, in
  // seq order, at most min(limit, kMaxLlmUsagePage).
  Result<std::vector<LlmUsageRow>> list_llm_usage(const LlmUsageQuery& q);
  // Sums over the tenant's rows (optionally one sandbox's); saturating.
  Result<LlmUsageTotals> llm_usage_totals(const std::string& tenant_id, const std::optional<std::string>& sandbox_id);

  // Memory dictionaries (store_memory.cpp). Every lookup is by tenant.
  // Inserts with row.refcount references; returns the new id.
  Result<int64_t> insert_memory_dictionary(const MemoryDictionaryRow& row);
  // The cohort's newest dictionary, with its refcount raised by one (in one
  // transaction); nullopt when the cohort has none.
  Result<std::optional<MemoryDictionaryRow>> acquire_memory_dictionary(const std::string& tenant_id,
                                                                       const std::string& cohort_key);
  // One dictionary of this tenant, refcount unchanged.
  Result<std::optional<MemoryDictionaryRow>> get_memory_dictionary(const std::string& tenant_id, int64_t id);
  // Drops one reference and deletes the row at zero; returns the references
  // left, or nullopt when the tenant has no such dictionary.
  Result<std::optional<int64_t>> release_memory_dictionary(const std::string& tenant_id, int64_t id);

 private:
  explicit Store(std::unique_ptr<Db> db) : db_(std::move(db)) {}
  std::unique_ptr<Db> db_;
};

}  // namespace sg::storage
