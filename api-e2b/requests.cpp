// Control-plane request parsing (requests.h).
#include "api-e2b/requests.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cstdint>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "base/http/message.h"

namespace sg::api {

using http::HttpRequest;
using json = nlohmann::json;

namespace {

// Parses a JSON object body. An empty body is an empty object when
// empty_ok. Errors are client errors with the reason.
Result<json> parse_body(const HttpRequest& req, bool empty_ok) {
  std::string ct = req.header("content-type");
  // curl -d sends application/x-www-form-urlencoded by default; its body is
  // still the JSON the user typed, so accept it as JSON.
  if (!req.body.empty() && !ct.empty() && ct.find("application/json") == std::string::npos &&
      ct.find("application/x-www-form-urlencoded") == std::string::npos)
    return invalid_error("unsupported content type '" + ct + "': send application/json");
  if (req.body.empty()) {
    if (empty_ok) return json::object();
    return invalid_error("request body is empty: a JSON object is required");
  }
  json j = json::parse(req.body, nullptr, false);
  if (j.is_discarded()) return invalid_error("request body is not valid JSON");
  if (!j.is_object()) return invalid_error("request body must be a JSON object");
  return j;
}

Status only_fields(const json& j, const std::set<std::string>& allowed) {
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!allowed.count(it.key())) return invalid_error("unknown field '" + it.key() + "' in request body");
  return Status::Ok();
}

Result<std::optional<int64_t>> opt_int(const json& j, const char* name, int64_t lo, int64_t hi) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return std::optional<int64_t>();
  if (!it->is_number_integer() && !it->is_number_unsigned())
    return invalid_error(std::string("field '") + name + "' must be an integer");
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(hi))
    return invalid_error(std::string("field '") + name + "' must be between " + std::to_string(lo) + " and " +
                         std::to_string(hi));
  int64_t v = it->get<int64_t>();
  if (v < lo || v > hi)
    return invalid_error(std::string("field '") + name + "' must be between " + std::to_string(lo) + " and " +
                         std::to_string(hi));
  return std::optional<int64_t>(v);
}

Result<std::optional<bool>> opt_bool(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return std::optional<bool>();
  if (!it->is_boolean()) return invalid_error(std::string("field '") + name + "' must be a boolean");
  return std::optional<bool>(it->get<bool>());
}

Result<std::map<std::string, std::string>> opt_string_map(const json& j, const char* name, size_t max_entries,
                                                          size_t max_len) {
  std::map<std::string, std::string> out;
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_object()) return invalid_error(std::string("field '") + name + "' must be an object of strings");
  if (it->size() > max_entries)
    return invalid_error(std::string("field '") + name + "' has more than " + std::to_string(max_entries) +
                         " entries");
  for (auto e = it->begin(); e != it->end(); ++e) {
    if (!e->is_string())
      return invalid_error(std::string("field '") + name + "." + e.key() + "' must be a string");
    if (e.key().empty() || e.key().size() > max_len || e->get_ref<const std::string&>().size() > max_len)
      return invalid_error(std::string("field '") + name + "' has an empty or over-long key or value (limit " +
                           std::to_string(max_len) + " bytes)");
    out[e.key()] = e->get<std::string>();
  }
  return out;
}

// allowOut, denyOut, rules and egressProxy of obj (a create's `network`,
// or an update's body; prefix names the fields in errors), with the
// internet flag: the policy they make.
Result<NetworkParams> parse_network_fields(const json& obj, const std::string& prefix, std::optional<bool> internet) {
  NetworkParams p;
  p.allow_internet = internet;
  std::vector<std::string>* lists[2] = {&p.allow_out, &p.deny_out};
  const char* names[2] = {"allowOut", "denyOut"};
  for (int k = 0; k < 2; ++k) {
    auto l = obj.find(names[k]);
    if (l == obj.end() || l->is_null()) continue;
    if (!l->is_array()) return invalid_error("field '" + prefix + names[k] + "' must be an array");
    for (const json& e : *l) {
      if (!e.is_string()) return invalid_error("field '" + prefix + names[k] + "' must hold strings");
      lists[k]->push_back(e.get<std::string>());
    }
  }
  // Header injection into HTTPS requests would mean intercepting TLS.
  if (auto r = obj.find("rules"); r != obj.end() && !r->is_null() && !(r->is_object() && r->empty()))
    return invalid_error("field '" + prefix + "rules': request transforms are not supported by this server");
  // A proxy of the client's own: the gateway's egress proxy is the only way out.
  if (auto e = obj.find("egressProxy"); e != obj.end() && !e->is_null())
    return invalid_error("field '" + prefix + "egressProxy': an egress proxy of your own is not supported by this server");
  auto pol = network::parse_egress_policy(p.allow_out, p.deny_out, internet, prefix);
  if (!pol) return pol.error();
  p.egress = std::move(*pol);
  p.asks_egress = !p.allow_out.empty();
  return p;
}

Result<CreateParams> parse_create(const json& j, bool v2) {
  std::set<std::string> allowed = {"templateID", "timeout", "metadata", "envVars", "mcp", "network", "iam",
                                   "autoPause", "autoPauseMemory", "autoResume", "allow_internet_access",
                                   "volumeMounts"};
  if (!v2) allowed.insert("secure");
  if (Status s = only_fields(j, allowed); !s) return s.error();
  CreateParams p;
  auto tpl = j.find("templateID");
  if (tpl == j.end() || !tpl->is_string() || tpl->get_ref<const std::string&>().empty())
    return invalid_error("field 'templateID' is required and must be a non-empty string");
  p.template_ref = tpl->get<std::string>();
  if (p.template_ref.size() > 256) return invalid_error("field 'templateID' is longer than 256 characters");
  // Spec defaults: 300 s on v2, 15 s on v1 (the SDKs always send it).
  auto timeout = opt_int(j, "timeout", 0, kMaxTimeoutS);
  if (!timeout) return timeout.error();
  p.timeout_s = timeout->value_or(v2 ? 300 : 15);
  auto md = opt_string_map(j, "metadata", 64, 1024);
  if (!md) return md.error();
  p.metadata = std::move(*md);
  auto env = opt_string_map(j, "envVars", 256, 32 * 1024);
  if (!env) return env.error();
  p.env_vars = std::move(*env);
  for (const auto& [k, v] : p.env_vars)
    if (k.find('=') != std::string::npos || k.find('\0') != std::string::npos || v.find('\0') != std::string::npos)
      return invalid_error("field 'envVars' has an invalid name '" + k + "'");
  auto pause = opt_bool(j, "autoPause");
  if (!pause) return pause.error();
  p.on_timeout_pause = pause->value_or(false);
  auto pause_mem = opt_bool(j, "autoPauseMemory");
  if (!pause_mem) return pause_mem.error();
  p.on_timeout_pause_files = p.on_timeout_pause && *pause_mem && !**pause_mem;
  auto secure = opt_bool(j, "secure");
  if (!secure) return secure.error();
  auto internet = opt_bool(j, "allow_internet_access");
  if (!internet) return internet.error();
  const std::optional<bool> internet_flag = *internet;
  if (auto ar = j.find("autoResume"); ar != j.end() && !ar->is_null()) {
    if (!ar->is_object()) return invalid_error("field 'autoResume' must be an object {\"enabled\": bool}");
    if (Status s = only_fields(*ar, {"enabled"}); !s) return s.error().with_context("autoResume");
    auto en = opt_bool(*ar, "enabled");
    if (!en) return en.error();
    p.auto_resume = en->value_or(false);
  }
  if (auto m = j.find("mcp"); m != j.end() && !m->is_null()) {
    if (!m->is_object()) return invalid_error("field 'mcp' must be an object or null");
    if (!m->empty()) return invalid_error("field 'mcp': the MCP gateway is not supported by this server");
  }
  if (auto v = j.find("volumeMounts"); v != j.end() && !v->is_null()) {
    if (!v->is_array()) return invalid_error("field 'volumeMounts' must be an array");
    if (!v->empty()) return invalid_error("field 'volumeMounts': volume mounts are not supported by this server");
  }
  if (auto i = j.find("iam"); i != j.end() && !i->is_null()) {
    if (!i->is_object()) return invalid_error("field 'iam' must be an object");
    if (!i->empty() && !(i->size() == 1 && i->contains("tokens") && (*i)["tokens"].empty()))
      return invalid_error("field 'iam': IAM tokens are not supported by this server");
  }
  if (auto n = j.find("network"); n != j.end() && !n->is_null()) {
    if (!n->is_object()) return invalid_error("field 'network' must be an object");
    if (Status s = only_fields(*n, {"allowOut", "denyOut", "allowPublicTraffic", "maskRequestHost", "httpsPorts",
                                    "rules", "egressProxy"});
        !s)
      return s.error().with_context("network");
    auto pub = opt_bool(*n, "allowPublicTraffic");
    if (!pub) return pub.error();
    p.public_traffic = pub->value_or(true);
    auto l = n->find("httpsPorts");
    if (l != n->end() && !l->is_null() && !l->is_array()) return invalid_error("field 'network.httpsPorts' must be an array");
    auto net = parse_network_fields(*n, "network.", internet_flag);
    if (!net) return net.error();
    p.network = std::move(*net);
  } else {
    auto net = parse_network_fields(json::object(), "network.", internet_flag);
    if (!net) return net.error();
    p.network = std::move(*net);
  }
  return p;
}

// Bodies of the routes that take only a timeout and flags.
Result<std::optional<int64_t>> parse_timeout_body(const HttpRequest& req, const std::set<std::string>& fields,
                                                  const char* flag) {
  Result<json> body = parse_body(req, true);
  if (!body) return body.error();
  if (Status s = only_fields(*body, fields); !s) return s.error();
  auto timeout = opt_int(*body, "timeout", 0, kMaxTimeoutS);
  if (!timeout) return timeout.error();
  if (auto f = opt_bool(*body, flag); !f) return f.error();
  return *timeout;
}

}  // namespace

bool decode_metadata_query(const std::string& once, std::vector<std::pair<std::string, std::string>>& out) {
  // As E2B's API does it (Go: url.ParseQuery on the value, then
  // url.QueryUnescape of each key and value): two more decodes after the
  // query parser's, '+' as space. JS 2.51 encodes each part twice before
  // joining; a client that encodes once decodes the same, since the second
  // decode finds no escapes left.
  out.clear();
  std::string_view rest(once);
  while (!rest.empty()) {
    size_t amp = rest.find('&');
    std::string_view part = rest.substr(0, amp);
    rest = amp == std::string_view::npos ? std::string_view() : rest.substr(amp + 1);
    if (part.empty()) continue;
    size_t eq = part.find('=');
    if (eq == std::string_view::npos) return false;
    std::string k1, v1, k, v;
    if (!http::percent_decode(part.substr(0, eq), k1, true) || !http::percent_decode(part.substr(eq + 1), v1, true) ||
        !http::percent_decode(k1, k, true) || !http::percent_decode(v1, v, true))
      return false;
    out.emplace_back(std::move(k), std::move(v));
  }
  return true;
}

std::optional<int64_t> parse_rfc3339(const std::string& s) {
  struct tm tm = {};
  const char* rest = strptime(s.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  if (!rest) return std::nullopt;
  if (*rest == '.')
    do ++rest;
    while (*rest >= '0' && *rest <= '9');
  int64_t offset = 0;
  if (*rest == 'Z' || *rest == 'z') {
    ++rest;
  } else if (*rest == '+' || *rest == '-') {
    int hh = 0, mm = 0;
    if (std::sscanf(rest + 1, "%2d:%2d", &hh, &mm) != 2) return std::nullopt;
    offset = (hh * 3600 + mm * 60) * (*rest == '+' ? 1 : -1);
    rest += 6;
  } else {
    return std::nullopt;
  }
  if (*rest) return std::nullopt;
  return static_cast<int64_t>(timegm(&tm)) - offset;
}

std::vector<std::string> path_segments(const std::string& path) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < path.size()) {
    if (path[i] == '/') {
      ++i;
      continue;
    }
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    out.push_back(path.substr(i, j - i));
    i = j;
  }
  return out;
}

Result<CreateParams> parse_create_request(const HttpRequest& req, bool v2) {
  Result<json> body = parse_body(req, false);
  if (!body) return body.error();
  return parse_create(*body, v2);
}

Result<std::optional<int64_t>> parse_connect_request(const HttpRequest& req) {
  return parse_timeout_body(req, {"timeout", "memory"}, "memory");
}

Result<std::optional<int64_t>> parse_resume_request(const HttpRequest& req) {
  return parse_timeout_body(req, {"timeout", "autoPause"}, "autoPause");
}

Result<bool> parse_pause_request(const HttpRequest& req) {
  Result<json> body = parse_body(req, true);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"memory"}); !s) return s.error();
  auto mem = opt_bool(*body, "memory");
  if (!mem) return mem.error();
  return mem->value_or(true);
}

Result<NetworkParams> parse_network_update(const HttpRequest& req) {
  Result<json> body = parse_body(req, true);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"allowOut", "denyOut", "allow_internet_access", "egressProxy", "rules"}); !s)
    return s.error();
  auto internet = opt_bool(*body, "allow_internet_access");
  if (!internet) return internet.error();
  return parse_network_fields(*body, "", *internet);
}

Result<int64_t> parse_timeout_request(const HttpRequest& req) {
  Result<json> body = parse_body(req, false);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"timeout"}); !s) return s.error();
  auto timeout = opt_int(*body, "timeout", 0, kMaxTimeoutS);
  if (!timeout) return timeout.error();
  if (!*timeout) return invalid_error("field 'timeout' is required");
  return **timeout;
}

Result<SnapshotRequest> parse_snapshot_request(const HttpRequest& req) {
  Result<json> body = parse_body(req, true);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"name", "memory"}); !s) return s.error();
  SnapshotRequest r;
  auto memory = opt_bool(*body, "memory");
  if (!memory) return memory.error();
  // Whether the backend can keep the memory is the service's to say.
  r.memory = memory->value_or(false);
  auto it = body->find("name");
  if (it == body->end() || it->is_null()) return r;
  if (!it->is_string()) return invalid_error("field 'name' must be a string");
  const std::string& n = it->get_ref<const std::string&>();
  // A template name of its own: E2B's names with a tag are built by its
  // tags API; here a snapshot is the default tag of a new template.
  bool ok = !n.empty() && n.size() <= 64 && ((n[0] >= 'a' && n[0] <= 'z') || (n[0] >= '0' && n[0] <= '9'));
  for (char ch : n)
    ok = ok && ((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '-' || ch == '_' || ch == '.');
  if (!ok)
    return invalid_error("field 'name' must be 1 to 64 of a-z 0-9 '-' '_' '.', starting with a letter or digit "
                         "(a tag after ':' is not supported for snapshots)");
  r.name = n;
  return r;
}

Result<ForkRequest> parse_fork_request(const HttpRequest& req) {
  Result<json> body = parse_body(req, true);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"count", "timeout"}); !s) return s.error();
  ForkRequest r;
  auto count = opt_int(*body, "count", 1, kMaxForks);
  if (!count) return count.error();
  if (*count) r.count = **count;
  auto timeout = opt_int(*body, "timeout", 0, kMaxTimeoutS);
  if (!timeout) return timeout.error();
  if (*timeout) r.timeout_s = **timeout;
  return r;
}

namespace {

Result<std::optional<std::string>> opt_string(const json& j, const char* name, size_t max_len) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return std::optional<std::string>();
  if (!it->is_string()) return invalid_error(std::string("field '") + name + "' must be a string");
  if (it->get_ref<const std::string&>().size() > max_len)
    return invalid_error(std::string("field '") + name + "' is longer than " + std::to_string(max_len) + " bytes");
  return std::optional<std::string>(it->get<std::string>());
}

Result<std::vector<std::string>> string_array(const json& j, const std::string& where, size_t max_items, size_t max_len) {
  std::vector<std::string> out;
  if (j.is_null()) return out;
  if (!j.is_array()) return invalid_error("field '" + where + "' must be an array of strings");
  if (j.size() > max_items) return invalid_error("field '" + where + "' has more than " + std::to_string(max_items) + " items");
  for (const json& e : j) {
    if (!e.is_string()) return invalid_error("field '" + where + "' must be an array of strings");
    if (e.get_ref<const std::string&>().size() > max_len)
      return invalid_error("field '" + where + "' has an item longer than " + std::to_string(max_len) + " bytes");
    out.push_back(e.get<std::string>());
  }
  return out;
}

}  // namespace

Result<TemplateRequest> parse_template_request(const HttpRequest& req) {
  Result<json> body = parse_body(req, false);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"name", "alias", "tags", "cpuCount", "memoryMB", "minFreeDiskMb", "teamID"}); !s)
    return s.error();
  TemplateRequest r;
  auto name = opt_string(*body, "name", 256);
  if (!name) return name.error();
  auto alias = opt_string(*body, "alias", 256);
  if (!alias) return alias.error();
  if (!*name && !*alias) return invalid_error("field 'name' is required");
  // "name:tag" and tags: the tags the build gets when it ends ready
  // (none: "default").
  const std::string& whole = *name ? **name : **alias;
  Result<storage::TemplateRef> ref = storage::parse_template_ref(whole);
  if (!ref) return ref.error();
  if (!ref->team.empty()) return invalid_error("field 'name': a template is built under its own name, without a team");
  r.name = ref->name;
  std::vector<std::string> tags;
  if (whole.find(':') != std::string::npos) tags.push_back(ref->tag);
  if (auto it = body->find("tags"); it != body->end()) {
    auto more = string_array(*it, "tags", storage::kMaxTags, 128);
    if (!more) return more.error();
    tags.insert(tags.end(), more->begin(), more->end());
  }
  for (const std::string& t : tags) {
    if (!storage::valid_tag(t))
      return invalid_error("tag '" + t + "' must be 1 to 128 of letters, digits, '.', '_' and '-'");
    if (std::find(r.tags.begin(), r.tags.end(), t) == r.tags.end()) r.tags.push_back(t);
  }
  if (r.tags.size() > storage::kMaxTags) return invalid_error("more than " + std::to_string(storage::kMaxTags) + " tags");
  auto cpu = opt_int(*body, "cpuCount", 1, 64);
  if (!cpu) return cpu.error();
  auto mem = opt_int(*body, "memoryMB", 128, 65536);
  if (!mem) return mem.error();
  auto disk = opt_int(*body, "minFreeDiskMb", 0, 1 << 24);
  if (!disk) return disk.error();
  if (*cpu) r.cpu_count = **cpu;
  if (*mem) r.memory_mb = **mem;
  return r;
}

Result<TagsRequest> parse_tags_request(const HttpRequest& req, bool assign) {
  Result<json> body = parse_body(req, false);
  if (!body) return body.error();
  const char* field = assign ? "target" : "name";
  if (Status s = only_fields(*body, {field, "tags"}); !s) return s.error();
  TagsRequest r;
  auto target = opt_string(*body, field, 512);
  if (!target) return target.error();
  if (!*target || (*target)->empty()) return invalid_error(std::string("field '") + field + "' is required");
  r.target = **target;
  auto it = body->find("tags");
  if (it == body->end()) return invalid_error("field 'tags' is required");
  auto tags = string_array(*it, "tags", storage::kMaxTags, 128);
  if (!tags) return tags.error();
  if (tags->empty()) return invalid_error("field 'tags' must name at least one tag");
  for (const std::string& t : *tags) {
    if (!storage::valid_tag(t))
      return invalid_error("tag '" + t + "' must be 1 to 128 of letters, digits, '.', '_' and '-'");
    if (std::find(r.tags.begin(), r.tags.end(), t) == r.tags.end()) r.tags.push_back(t);
  }
  return r;
}

Result<builds::BuildSpec> parse_build_request(const HttpRequest& req) {
  Result<json> body = parse_body(req, false);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"fromImage", "fromTemplate", "fromImageRegistry", "steps", "startCmd", "readyCmd",
                                     "force"});
      !s)
    return s.error();
  builds::BuildSpec b;
  for (auto [field, out] : {std::pair{"fromImage", &b.from_image}, std::pair{"fromTemplate", &b.from_template},
                            std::pair{"startCmd", &b.start_cmd}, std::pair{"readyCmd", &b.ready_cmd}}) {
    auto v = opt_string(*body, field, 64 << 10);
    if (!v) return v.error();
    if (*v) *out = **v;
  }
  if (auto it = body->find("fromImageRegistry"); it != body->end() && !it->is_null()) {
    if (!it->is_object()) return invalid_error("field 'fromImageRegistry' must be an object");
    b.registry_auth = true;
    for (auto [field, out] : {std::pair{"type", &b.registry_type}, std::pair{"username", &b.registry_username},
                              std::pair{"password", &b.registry_password}}) {
      auto v = opt_string(*it, field, 8192);
      if (!v) return Error(ErrorKind::kInvalid, "fromImageRegistry: " + v.error().message());
      if (*v) *out = **v;
    }
  }
  auto force = opt_bool(*body, "force");
  if (!force) return force.error();
  b.force = force->value_or(false);
  if (auto it = body->find("steps"); it != body->end() && !it->is_null()) {
    if (!it->is_array()) return invalid_error("field 'steps' must be an array");
    if (it->size() > 256) return invalid_error("field 'steps' has more than 256 steps");
    for (size_t i = 0; i < it->size(); ++i) {
      const json& st = (*it)[i];
      std::string where = "steps[" + std::to_string(i) + "]";
      if (!st.is_object()) return invalid_error("field '" + where + "' must be an object");
      if (Status s = only_fields(st, {"type", "args", "filesHash", "force", "forceUpload", "resolveSymlinks", "gzip"}); !s)
        return Error(ErrorKind::kInvalid, where + ": " + s.error().message());
      builds::Step step;
      auto type = opt_string(st, "type", 16);
      if (!type) return Error(ErrorKind::kInvalid, where + ": " + type.error().message());
      if (!*type) return invalid_error("field '" + where + ".type' is required");
      step.type = **type;
      if (auto a = st.find("args"); a != st.end()) {
        auto args = string_array(*a, where + ".args", 1024, 64 << 10);
        if (!args) return args.error();
        step.args = std::move(*args);
      }
      auto hash = opt_string(st, "filesHash", 128);
      if (!hash) return Error(ErrorKind::kInvalid, where + ": " + hash.error().message());
      step.files_hash = hash->value_or("");
      for (const char* flag : {"force", "forceUpload", "resolveSymlinks", "gzip"}) {
        auto f = opt_bool(st, flag);
        if (!f) return Error(ErrorKind::kInvalid, where + ": " + f.error().message());
        if (std::string(flag) == "force") step.force = f->value_or(false);
      }
      b.steps.push_back(std::move(step));
    }
  }
  return b;
}

namespace {
// A query value that is a whole decimal number in lo..hi; nullopt
// otherwise (each caller says what it wanted).
std::optional<int64_t> query_int(const std::string& v, int64_t lo, int64_t hi) {
  char* end = nullptr;
  long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || n < lo || n > hi) return std::nullopt;
  return n;
}
}  // namespace

Result<BuildStatusQuery> parse_build_status_query(const std::string& query) {
  std::vector<std::pair<std::string, std::string>> q;
  if (!http::parse_query(query, q)) return invalid_error("malformed query string");
  BuildStatusQuery out;
  for (const auto& [k, v] : q) {
    if (k != "logsOffset" && k != "limit") continue;
    std::optional<int64_t> n = query_int(v, 0, int64_t{1} << 40);
    if (!n) return invalid_error("query '" + k + "' must be a non-negative integer");
    if (k == "logsOffset") out.logs_offset = *n;
    if (k == "limit") out.limit = std::min<int64_t>(std::max<int64_t>(*n, 1), 1000);
  }
  return out;
}

Result<storage::BuildLogQuery> parse_build_logs_query(const std::string& query) {
  std::vector<std::pair<std::string, std::string>> q;
  if (!http::parse_query(query, q)) return invalid_error("malformed query string");
  storage::BuildLogQuery out;
  for (const auto& [k, v] : q) {
    if (k == "cursor") {
      std::optional<int64_t> n = query_int(v, 0, int64_t{1} << 50);
      if (!n) return invalid_error("query 'cursor' must be a time in milliseconds");
      out.cursor_ms = *n;
    } else if (k == "limit") {
      std::optional<int64_t> n = query_int(v, 1, 1000);
      if (!n) return invalid_error("query 'limit' must be 1 to 1000");
      out.limit = *n;
    } else if (k == "direction") {
      if (v != "forward" && v != "backward") return invalid_error("query 'direction' must be forward or backward");
      out.forward = v == "forward";
    } else if (k == "level") {
      static const char* kLevels[] = {"debug", "info", "warn", "error"};
      auto it = std::find(std::begin(kLevels), std::end(kLevels), v);
      if (it == std::end(kLevels)) return invalid_error("query 'level' must be debug, info, warn or error");
      out.min_level = static_cast<int>(it - std::begin(kLevels));
    } else if (k == "source") {
      if (v != "temporary" && v != "persistent") return invalid_error("query 'source' must be temporary or persistent");
    }
  }
  return out;
}

Result<std::optional<bool>> parse_template_update(const HttpRequest& req) {
  Result<json> body = parse_body(req, true);
  if (!body) return body.error();
  if (Status s = only_fields(*body, {"public"}); !s) return s.error();
  return opt_bool(*body, "public");
}

Result<storage::SandboxQuery> parse_list_query(const std::string& query, bool v2) {
  std::vector<std::pair<std::string, std::string>> q;
  if (!http::parse_query(query, q)) return invalid_error("malformed query string");
  storage::SandboxQuery sq;
  sq.limit = 100;
  if (!v2) sq.states = {storage::kStateRunning};
  for (const auto& [k, v] : q) {
    if (k == "metadata") {
      std::vector<std::pair<std::string, std::string>> md;
      if (!decode_metadata_query(v, md)) return invalid_error("malformed metadata filter '" + v + "'");
      sq.metadata.insert(sq.metadata.end(), md.begin(), md.end());
      // One SQL condition per pair: bounded like a create's metadata map.
      if (sq.metadata.size() > kMaxMetadataFilters)
        return invalid_error("too many metadata filters (" + std::to_string(sq.metadata.size()) + "): at most " +
                             std::to_string(kMaxMetadataFilters) + " key=value pairs");
    } else if (k == "state" && v2) {
      sq.states.clear();
      std::string_view rest(v);
      while (!rest.empty()) {
        size_t c = rest.find(',');
        std::string s(rest.substr(0, c));
        rest = c == std::string_view::npos ? std::string_view() : rest.substr(c + 1);
        if (s != storage::kStateRunning && s != storage::kStatePaused)
          return invalid_error("invalid state filter '" + s + "': use running and/or paused");
        sq.states.push_back(s);
      }
    } else if (k == "limit" && v2) {
      std::optional<int64_t> l = query_int(v, 1, 100);
      if (!l) return invalid_error("invalid limit '" + v + "': use an integer from 1 to 100");
      sq.limit = *l;
    } else if (k == "nextToken" && v2 && !v.empty()) {
      std::optional<int64_t> s = query_int(v, 1, INT64_MAX);
      if (!s) return invalid_error("invalid nextToken '" + v + "'");
      sq.after_seq = *s;
    } else if (k == "order" && v2) {
      if (v != "asc" && v != "desc") return invalid_error("invalid order '" + v + "': use asc or desc");
      sq.descending = v == "desc";
    } else if (k == "startedAfter" && v2 && !v.empty()) {
      std::optional<int64_t> t = parse_rfc3339(v);
      if (!t) return invalid_error("invalid startedAfter '" + v + "': use RFC 3339");
      // The SDK means "at or after"; the store compares strictly.
      sq.started_after = *t - 1;
    } else if (k == "template" && v2 && !v.empty()) {
      sq.template_id = v;
    }
  }
  return sq;
}

Result<MetricsRange> parse_metrics_query(const std::string& query) {
  std::vector<std::pair<std::string, std::string>> q;
  if (!http::parse_query(query, q)) return invalid_error("malformed query string");
  MetricsRange r;
  for (const auto& [k, v] : q) {
    if (k != "start" && k != "end") continue;
    std::optional<int64_t> x = query_int(v, 0, INT64_MAX);
    if (!x) return invalid_error("invalid " + k + " '" + v + "': use unix seconds");
    (k == "start" ? r.start : r.end) = *x;
  }
  return r;
}

Result<SnapshotQuery> parse_snapshots_query(const std::string& query) {
  std::vector<std::pair<std::string, std::string>> q;
  if (!http::parse_query(query, q)) return invalid_error("malformed query string");
  SnapshotQuery sq;
  for (const auto& [k, v] : q) {
    if (k == "sandboxID") {
      if (v.size() > 64) return invalid_error("invalid sandboxID");
      sq.sandbox_id = v;
    } else if (k == "name") {
      if (v.size() > 256) return invalid_error("invalid name");
      sq.name = v;
    } else if (k == "limit") {
      std::optional<int64_t> l = query_int(v, 1, 100);
      if (!l) return invalid_error("invalid limit '" + v + "': use an integer from 1 to 100");
      sq.limit = *l;
    } else if (k == "nextToken" && !v.empty()) {
      std::optional<int64_t> s = query_int(v, 1, INT64_MAX);
      if (!s) return invalid_error("invalid nextToken '" + v + "'");
      sq.after_seq = *s;
    }
  }
  return sq;
}

}  // namespace sg::api
