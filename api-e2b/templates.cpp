// Template routes of the control plane (docs/api.md, "Templates"): the
// templates a tenant can see (its own, and public ones such as base), in
// E2B's Template, TemplateWithBuilds, TemplateAliasResponse and
// TemplateTag shapes; the owner's visibility change and delete; and the
// build API over builds::BuildService (request, upload link, upload,
// start, status).
//
// A built template's current build is the last that ended ready; the
// server's own templates (base) have one build whose id is derived from
// the template's (build_id()). The current build is tagged "default".
#include <openssl/sha.h>

#include <nlohmann/json.hpp>

#include "api-e2b/control_plane.h"
#include "api-e2b/requests.h"
#include "base/sys.h"
#include "sandbox-runtime/channel/control_message.h"

namespace sg::api {

using http::HttpResponse;
using json = nlohmann::json;

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// A stable UUID-shaped id for a template's one build (E2B's buildID is a
// UUID): the first 16 bytes of SHA-256("build:" + template id), version 4
// and variant bits set.
std::string build_id(const storage::TemplateRow& t) {
  if (t.build_id) return *t.build_id;
  std::string in = "build:" + t.id;
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(in.data()), in.size(), d);
  d[6] = static_cast<unsigned char>((d[6] & 0x0f) | 0x40);
  d[8] = static_cast<unsigned char>((d[8] & 0x3f) | 0x80);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += hex[d[i] >> 4];
    out += hex[d[i] & 15];
  }
  return out;
}

// E2B's TemplateBuildStatus for a template row's status.
const char* build_status(const storage::TemplateRow& t) {
  if (t.status == "ready") return "ready";
  if (t.status == "building") return "building";
  return "error";
}

json build_row_json(const storage::BuildRow& b) {
  json j = {{"buildID", b.id},
            {"status", b.status},
            {"cpuCount", b.cpu_count},
            {"memoryMB", b.memory_mb},
            {"envdVersion", channel::kEnvdVersion},
            {"createdAt", sys::format_rfc3339(b.created_at)},
            {"updatedAt", sys::format_rfc3339(b.updated_at)}};
  if (b.finished_at) j["finishedAt"] = sys::format_rfc3339(*b.finished_at);
  return j;
}

json log_json(const storage::BuildLogRow& l) {
  char ms[8];
  std::snprintf(ms, sizeof ms, ".%03d", static_cast<int>(l.at_ms % 1000));
  std::string ts = sys::format_rfc3339(l.at_ms / 1000);
  ts.insert(ts.size() - 1, ms);  // ...:05.123Z
  json j = {{"timestamp", ts}, {"level", l.level}, {"message", l.message}};
  if (!l.step.empty()) j["step"] = l.step;
  return j;
}

json time_or_null(const std::optional<int64_t>& t) { return t ? json(sys::format_rfc3339(*t)) : json(nullptr); }

// The fields Template and TemplateWithBuilds share.
json common_json(const storage::TemplateRow& t, const storage::TemplateUsage& u) {
  return json{{"templateID", t.id},
              {"createdAt", sys::format_rfc3339(t.created_at)},
              {"updatedAt", sys::format_rfc3339(t.updated_at)},
              {"lastSpawnedAt", time_or_null(u.last_spawned_at)},
              {"spawnCount", u.spawn_count},
              {"public", t.is_public},
              {"aliases", json::array({t.name})},
              {"names", json::array({t.name})}};
}

json template_json(const storage::TemplateRow& t, const storage::TemplateUsage& u) {
  json j = common_json(t, u);
  j["buildID"] = build_id(t);
  j["buildStatus"] = build_status(t);
  j["buildCount"] = 1;
  j["cpuCount"] = t.cpu_count;
  j["memoryMB"] = t.memory_mb;
  j["diskSizeMB"] = t.disk_size_mb;
  j["envdVersion"] = channel::kEnvdVersion;
  j["createdBy"] = nullptr;
  return j;
}

json build_json(const storage::TemplateRow& t) {
  json b = {{"buildID", build_id(t)},
            {"status", build_status(t)},
            {"cpuCount", t.cpu_count},
            {"memoryMB", t.memory_mb},
            {"diskSizeMB", t.disk_size_mb},
            {"envdVersion", channel::kEnvdVersion},
            {"createdAt", sys::format_rfc3339(t.created_at)},
            {"updatedAt", sys::format_rfc3339(t.updated_at)}};
  if (t.status != "building") b["finishedAt"] = sys::format_rfc3339(t.updated_at);
  return b;
}

}  // namespace

HttpResponse ControlPlane::list_templates(const Call& c) {
  Result<std::vector<storage::TemplateRow>> rows = store_.list_templates(c.tenant.id);
  if (!rows) return error_response(rows.error());
  json out = json::array();
  for (const storage::TemplateRow& t : *rows) {
    Result<storage::TemplateUsage> u = store_.template_usage(t.id);
    if (!u) return error_response(u.error());
    out.push_back(template_json(t, *u));
  }
  return http::json_body(200, dump(out));
}

HttpResponse ControlPlane::get_template(const Call& c) {
  Result<std::optional<storage::TemplateRow>> t = store_.find_template(c.tenant.id, c.id);
  if (!t) return error_response(t.error());
  if (!*t) return http::json_error(404, "template '" + c.id + "' not found");
  Result<storage::TemplateUsage> u = store_.template_usage((*t)->id);
  if (!u) return error_response(u.error());
  json j = common_json(**t, *u);
  Result<std::vector<storage::BuildRow>> builds = store_.list_builds((*t)->id);
  if (!builds) return error_response(builds.error());
  j["builds"] = json::array();
  if (builds->empty()) j["builds"].push_back(build_json(**t));  // the server's own
  for (const storage::BuildRow& b : *builds) j["builds"].push_back(build_row_json(b));
  return http::json_body(200, dump(j));
}

HttpResponse ControlPlane::template_alias(const Call& c) {
  Result<std::optional<storage::TemplateRow>> t = store_.find_template(c.tenant.id, c.id);
  if (!t) return error_response(t.error());
  if (!*t || (*t)->name != c.id) return http::json_error(404, "template alias '" + c.id + "' not found");
  return http::json_body(200, dump(json{{"templateID", (*t)->id}, {"public", (*t)->is_public}}));
}

HttpResponse ControlPlane::template_tags(const Call& c) {
  Result<std::optional<storage::TemplateRow>> t = store_.find_template(c.tenant.id, c.id);
  if (!t) return error_response(t.error());
  if (!*t) return http::json_error(404, "template '" + c.id + "' not found");
  Result<std::vector<storage::TagRow>> tags = store_.list_tags((*t)->id);
  if (!tags) return error_response(tags.error());
  json out = json::array();
  for (const storage::TagRow& g : *tags)
    out.push_back({{"tag", g.tag}, {"buildID", g.build_id}, {"createdAt", sys::format_rfc3339(g.created_at)}});
  // The server's own templates have their one build as "default".
  if (tags->empty() && (*t)->status == "ready")
    out.push_back({{"tag", storage::kDefaultTag}, {"buildID", build_id(**t)},
                   {"createdAt", sys::format_rfc3339((*t)->created_at)}});
  return http::json_body(200, dump(out));
}

HttpResponse ControlPlane::assign_tags(const Call& c) {
  Result<TagsRequest> r = parse_tags_request(c.req, true);
  if (!r) return error_response(r.error());
  Result<std::string> build = store_.assign_tags(c.tenant.id, r->target, r->tags, sys::unix_seconds());
  if (!build) return error_response(build.error());
  if (builds_) builds_->collect_soon();
  return http::json_body(201, dump(json{{"buildID", *build}, {"tags", r->tags}}));
}

HttpResponse ControlPlane::remove_tags(const Call& c) {
  Result<TagsRequest> r = parse_tags_request(c.req, false);
  if (!r) return error_response(r.error());
  if (Status s = store_.remove_tags(c.tenant.id, r->target, r->tags); !s) return error_response(s.error());
  if (builds_) builds_->collect_soon();
  return http::no_content(204);
}

HttpResponse ControlPlane::update_template(const Call& c) {
  Result<std::optional<bool>> pub = parse_template_update(c.req);
  if (!pub) return error_response(pub.error());
  Result<std::optional<storage::TemplateRow>> t = store_.find_template(c.tenant.id, c.id);
  if (!t) return error_response(t.error());
  if (!*t) return http::json_error(404, "template '" + c.id + "' not found");
  if (*pub) {
    if (Status s = store_.set_template_public(c.tenant.id, (*t)->id, **pub, sys::unix_seconds()); !s)
      return error_response(s.error());
  } else if ((*t)->tenant_id != c.tenant.id) {
    return error_response(invalid_error("template '" + c.id + "' belongs to " +
                                        ((*t)->tenant_id ? "another team" : std::string("this server")) +
                                        ": only its owner can change it"));
  }
  if (c.v2) return http::json_body(200, dump(json{{"names", json::array({(*t)->name})}}));
  return http::no_content(200);
}

HttpResponse ControlPlane::delete_template(const Call& c) {
  // A snapshot id names its template with a tag (E2B's "id:default",
  // "team/name:default"): the template goes with every tag.
  std::string ref;
  if (!http::percent_decode(c.id, ref)) ref = c.id;
  if (ref.find_first_of(":/") != std::string::npos)
    if (Result<storage::TemplateRef> r = storage::parse_template_ref(ref); r) ref = r->name;
  Result<std::optional<storage::TemplateRow>> t = store_.find_template(c.tenant.id, ref);
  if (!t) return error_response(t.error());
  if (!*t) return http::json_error(404, "template '" + c.id + "' not found");
  if (Status s = store_.delete_template(c.tenant.id, (*t)->id, sys::unix_seconds()); !s)
    return error_response(s.error());
  if (builds_) builds_->collect_soon();  // its layers go
  return http::no_content(204);
}

HttpResponse ControlPlane::no_builds() const {
  return http::json_error(501, "template builds are not supported by this server (it runs without a build service)");
}

HttpResponse ControlPlane::request_build(const Call& c) {
  if (!builds_) return no_builds();
  Result<TemplateRequest> r = parse_template_request(c.req);
  if (!r) return error_response(r.error());
  Result<builds::BuildService::Requested> got =
      builds_->request(c.tenant.id, r->name, r->tags, r->cpu_count, r->memory_mb);
  if (!got) return error_response(got.error());
  json j = {{"templateID", got->tpl.id},
            {"buildID", got->build_id},
            {"names", json::array({got->tpl.name})},
            {"aliases", json::array({got->tpl.name})},
            {"tags", r->tags.empty() ? json::array({storage::kDefaultTag}) : json(r->tags)},
            {"public", got->tpl.is_public}};
  return http::json_body(202, dump(j));
}

HttpResponse ControlPlane::file_link(const Call& c) {
  if (!builds_) return no_builds();
  Result<builds::BuildService::FileLink> link = builds_->file_link(c.tenant.id, c.id, c.arg2);
  if (!link) return error_response(link.error());
  std::string base = cfg_.public_url;
  if (base.empty()) {
    std::string host = c.req.header("host");
    if (host.empty()) return http::json_error(400, "a Host header is needed for the upload link");
    base = cfg_.scheme + "://" + host;
  }
  while (!base.empty() && base.back() == '/') base.pop_back();
  json j = {{"present", link->present}};
  if (!link->present) j["url"] = base + link->target;
  return http::json_body(201, dump(j));
}

HttpResponse ControlPlane::upload(const http::HttpRequest& req) {
  if (!builds_) return no_builds();
  std::vector<std::string> seg = path_segments(req.path);
  if (seg.size() != 4) return http::json_error(404, "no route for PUT " + req.path);
  if (Status s = builds_->upload(seg[2], seg[3], req.query, req.body); !s) return error_response(s.error());
  return http::no_content(200);
}

HttpResponse ControlPlane::start_build(const Call& c) {
  if (!builds_) return no_builds();
  Result<builds::BuildSpec> spec = parse_build_request(c.req);
  if (!spec) return error_response(spec.error());
  if (Status s = builds_->start(c.tenant.id, c.id, c.arg2, std::move(*spec)); !s) return error_response(s.error());
  // An empty 202 with Content-Length 0 (a chunked one breaks the JS SDK).
  return http::no_content(202);
}

HttpResponse ControlPlane::build_status(const Call& c) {
  if (!builds_) return no_builds();
  Result<BuildStatusQuery> q = parse_build_status_query(c.req.query);
  if (!q) return error_response(q.error());
  Result<builds::BuildService::Status_> st = builds_->status(c.tenant.id, c.id, c.arg2, q->logs_offset, q->limit);
  if (!st) return error_response(st.error());
  json entries = json::array(), lines = json::array();
  for (const storage::BuildLogRow& l : st->logs) {
    entries.push_back(log_json(l));
    lines.push_back(l.message);
  }
  json j = {{"templateID", st->build.template_id},
            {"buildID", st->build.id},
            {"status", st->build.status},
            {"logEntries", entries},
            {"logs", lines}};
  if (st->build.status == storage::kBuildError) {
    json reason = {{"message", st->build.reason.value_or("the build failed")}};
    if (st->build.reason_step) reason["step"] = *st->build.reason_step;
    reason["logEntries"] = json::array();
    for (const storage::BuildLogRow& l : st->reason_logs) reason["logEntries"].push_back(log_json(l));
    j["reason"] = reason;
  }
  return http::json_body(200, dump(j));
}

HttpResponse ControlPlane::build_logs(const Call& c) {
  if (!builds_) return no_builds();
  Result<storage::BuildLogQuery> q = parse_build_logs_query(c.req.query);
  if (!q) return error_response(q.error());
  Result<std::vector<storage::BuildLogRow>> logs = builds_->logs(c.tenant.id, c.id, c.arg2, *q);
  if (!logs) return error_response(logs.error());
  json out = json::array();
  for (const storage::BuildLogRow& l : *logs) out.push_back(log_json(l));
  return http::json_body(200, dump(json{{"logs", out}}));
}

}  // namespace sg::api
