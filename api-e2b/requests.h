// The control plane's request parsing: each route's JSON body or query
// string, from plain HTTP values to a typed request or a kInvalid error
// that says what is wrong and where (docs/api.md). Bodies are strict: an
// unknown field, a wrong type or an out-of-range value is refused, never
// ignored. Pure functions with no I/O or state, so the control plane stays
// a thin mapping and the parsers are fuzzed on their own
// (tests/fuzz/api_fuzz.cpp). Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/http/message.h"
#include "storage/store.h"
#include "sandbox-runtime/builds/build_service.h"
#include "sandbox-runtime/lifecycle/params.h"
#include "sandbox-runtime/network/egress_policy.h"
#include "base/status.h"

namespace sg::api {

inline constexpr int64_t kMaxTimeoutS = 24 * 3600;
// Metadata key=value pairs one list request may filter on (each is one SQL
// condition); a create's metadata map has the same bound.
inline constexpr size_t kMaxMetadataFilters = 64;

// POST /sandboxes, /v2/sandboxes.
using lifecycle::CreateParams;
using lifecycle::NetworkParams;
Result<CreateParams> parse_create_request(const http::HttpRequest& req, bool v2);

// PUT /sandboxes/{id}/network (the SDK's updateNetwork): {allowOut,
// denyOut, allow_internet_access, egressProxy, rules}, replacing the
// sandbox's whole egress configuration (an omitted field is cleared).
Result<NetworkParams> parse_network_update(const http::HttpRequest& req);

// POST .../connect {"timeout", "memory"} and the v1 POST .../resume
// {"timeout", "autoPause"}: an empty body is fine; timeout in 0..24 h.
Result<std::optional<int64_t>> parse_connect_request(const http::HttpRequest& req);
Result<std::optional<int64_t>> parse_resume_request(const http::HttpRequest& req);
// POST .../pause {"memory"}: false asks for a filesystem-only pause (E2B's
// keepMemory); true when absent.
Result<bool> parse_pause_request(const http::HttpRequest& req);
// POST .../timeout {"timeout"}: required.
Result<int64_t> parse_timeout_request(const http::HttpRequest& req);

// POST /sandboxes/{id}/snapshots {name?}: a name of the snapshot's own
// template ("" when none).
struct SnapshotRequest {
  std::string name;
  bool memory = false;  // asked for explicitly (the Python SDK's mode "full")
};
Result<SnapshotRequest> parse_snapshot_request(const http::HttpRequest& req);
// POST /sandboxes/{id}/fork {count?, timeout?}: E2B's defaults, 1 fork
// living 15 s; count at most kMaxForks.
inline constexpr int64_t kMaxForks = 64;
struct ForkRequest {
  int64_t count = 1;
  int64_t timeout_s = 15;
};
Result<ForkRequest> parse_fork_request(const http::HttpRequest& req);
// GET /snapshots?sandboxID&name&limit&nextToken.
struct SnapshotQuery {
  std::string sandbox_id, name;
  int64_t limit = 100;
  int64_t after_seq = 0;
};
Result<SnapshotQuery> parse_snapshots_query(const std::string& query);

// POST /v3/templates {name ("name:tag"), alias (old name of name), tags,
// cpuCount, memoryMB, minFreeDiskMb, teamID}. tags: the tag in name and
// those in tags, each once (none: the build will be "default").
struct TemplateRequest {
  std::string name;
  std::vector<std::string> tags;
  int64_t cpu_count = 2;
  int64_t memory_mb = 1024;
};
Result<TemplateRequest> parse_template_request(const http::HttpRequest& req);

// POST /templates/tags {target: "name[:tag]", tags} and DELETE
// /templates/tags {name, tags}: target is the target or the name; the
// tags are 1 to storage::kMaxTags valid tags, each once.
struct TagsRequest {
  std::string target;
  std::vector<std::string> tags;
};
Result<TagsRequest> parse_tags_request(const http::HttpRequest& req, bool assign);

// POST /v2/templates/{id}/builds/{build} (TemplateBuildStartV2): the
// shape only; BuildService::start validates the steps.
Result<builds::BuildSpec> parse_build_request(const http::HttpRequest& req);

// GET .../builds/{build}/status?logsOffset=&limit= (limit 1..1000).
struct BuildStatusQuery {
  int64_t logs_offset = 0;
  int64_t limit = 1000;
};
Result<BuildStatusQuery> parse_build_status_query(const std::string& query);
// GET .../builds/{build}/logs?cursor=&direction=&level=&limit=&source=
// (limit 1..1000, default 100; source: every line is kept alike).
Result<storage::BuildLogQuery> parse_build_logs_query(const std::string& query);

// PATCH /templates/{id}, /v2/templates/{id} {"public"}: an empty body
// changes nothing.
Result<std::optional<bool>> parse_template_update(const http::HttpRequest& req);

// GET /sandboxes (v1: running only) and /v2/sandboxes?state=&limit=&
// nextToken=&order=&startedAfter=&template=&metadata=. tenant_id is left
// for the caller.
Result<storage::SandboxQuery> parse_list_query(const std::string& query, bool v2);

// GET .../metrics?start=&end= (unix seconds).
struct MetricsRange {
  std::optional<int64_t> start, end;
};
Result<MetricsRange> parse_metrics_query(const std::string& query);

// "/sandboxes/abc/pause" -> {"sandboxes", "abc", "pause"} (empty segments
// dropped).
std::vector<std::string> path_segments(const std::string& path);

// RFC 3339 ("2026-12-01T08:00:00Z", optional fraction, Z or +hh:mm) to
// unix seconds.
std::optional<int64_t> parse_rfc3339(const std::string& s);

// Decodes E2B's metadata query value, already percent-decoded once by the
// query parser: split on '&' and '=', each key and value decoded twice more
// (what JS 2.51 sends was measured: see tests/api-e2b/query_test.cpp).
bool decode_metadata_query(const std::string& once_decoded, std::vector<std::pair<std::string, std::string>>& out);

}  // namespace sg::api
