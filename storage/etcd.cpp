// Implementation of the etcd v3 JSON-gateway client (etcd.h). The gateway
// encodes int64 fields as JSON strings and bytes fields as base64, and
// leaves out fields that hold their zero value (a false "succeeded", a
// missing "kvs").
#include "storage/etcd.h"

#include <charconv>

#include <nlohmann/json.hpp>

#include "base/base64.h"

namespace sg::etcd {

using nlohmann::json;

namespace {

int64_t num(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    int64_t v = 0;
    std::from_chars(s.data(), s.data() + s.size(), v);
    return v;
  }
  return 0;
}

std::string bytes(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_string()) return {};
  std::optional<std::string> d = base64_decode(it->get_ref<const std::string&>());
  return d ? *d : std::string();
}

std::string b64(std::string_view s) { return base64_encode(s); }

KeyValue parse_kv(const json& j) {
  KeyValue kv;
  kv.key = bytes(j, "key");
  kv.value = bytes(j, "value");
  kv.create_revision = num(j, "create_revision");
  kv.mod_revision = num(j, "mod_revision");
  kv.version = num(j, "version");
  kv.lease = num(j, "lease");
  return kv;
}

int64_t header_revision(const json& j) {
  auto it = j.find("header");
  return it == j.end() || !it->is_object() ? 0 : num(*it, "revision");
}

json op_json(const Op& op) {
  if (op.kind == Op::Kind::kDelete) return json{{"requestDeleteRange", {{"key", b64(op.key)}}}};
  json put{{"key", b64(op.key)}, {"value", b64(op.value)}};
  if (op.lease != 0) put["lease"] = std::to_string(op.lease);
  return json{{"requestPut", put}};
}

}  // namespace

std::string prefix_end(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Result<std::vector<net::Endpoint>> parse_endpoints(std::string_view url) {
  for (std::string_view scheme : {"etcd://", "http://"})
    if (url.substr(0, scheme.size()) == scheme) url.remove_prefix(scheme.size());
  if (url.substr(0, 8) == "https://")
    return invalid_error("etcd over TLS is not supported yet: give its plain http:// client URLs (docs/cluster.md)");
  std::vector<net::Endpoint> out;
  while (!url.empty()) {
    size_t comma = url.find(',');
    std::string_view one = url.substr(0, comma);
    while (!one.empty() && one.back() == '/') one.remove_suffix(1);
    Result<net::Endpoint> ep = net::parse_endpoint(one);
    if (!ep) return ep.error().with_context("etcd endpoint");
    out.push_back(*ep);
    if (comma == std::string_view::npos) break;
    url.remove_prefix(comma + 1);
  }
  if (out.empty()) return invalid_error("no etcd endpoint: want etcd://host:port[,host:port...]");
  return out;
}

Client::Client(std::vector<net::Endpoint> endpoints, std::chrono::milliseconds timeout)
    : endpoints_(std::move(endpoints)), timeout_(timeout) {}

Result<std::string> Client::call(const std::string& path, const std::string& body) {
  net::Request req;
  req.method = "POST";
  req.target = path;
  req.headers = {{"Content-Type", "application/json"}};
  req.body = body;
  size_t n = endpoints_.size();
  size_t first = preferred_.load();
  Error last = Error(ErrorKind::kUnavailable, "etcd: no endpoint");
  for (size_t i = 0; i < n; ++i) {
    size_t at = (first + i) % n;
    const net::Endpoint& ep = endpoints_[at];
    Result<net::Response> r = net::request(ep, req, timeout_, 64 << 20);
    if (!r) {
      last = Error(ErrorKind::kUnavailable, "etcd " + ep.str() + " " + path + ": " + r.error().message());
      continue;
    }
    if (r->status / 100 == 5) {
      last = Error(ErrorKind::kUnavailable,
                   "etcd " + ep.str() + " " + path + " answered " + std::to_string(r->status) + ": " + r->body.substr(0, 300));
      continue;
    }
    preferred_.store(at);
    if (r->status / 100 != 2) {
      std::string msg = r->body.substr(0, 300);
      json j = json::parse(r->body, nullptr, false);
      if (j.is_object() && j.contains("message") && j["message"].is_string()) msg = j["message"].get<std::string>();
      ErrorKind kind = r->status == 404 ? ErrorKind::kNotFound : ErrorKind::kInvalid;
      return Error(kind, "etcd " + path + ": " + msg);
    }
    return std::move(r->body);
  }
  return last;
}

Result<int64_t> Client::grant(int64_t ttl_s) {
  Result<std::string> body = call("/v3/lease/grant", json{{"TTL", std::to_string(ttl_s)}}.dump());
  if (!body) return body.error();
  json j = json::parse(*body, nullptr, false);
  if (!j.is_object() || num(j, "ID") == 0) return internal_error("etcd lease grant: malformed answer");
  return num(j, "ID");
}

Result<int64_t> Client::keep_alive(int64_t lease) {
  Result<std::string> body = call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
  if (!body) return body.error();
  // A stream of one result for one request.
  json j = json::parse(body->substr(0, body->find('\n')), nullptr, false);
  if (!j.is_object() || !j.contains("result")) return internal_error("etcd lease keepalive: malformed answer");
  int64_t ttl = num(j["result"], "TTL");
  if (ttl <= 0) return not_found_error("etcd lease " + std::to_string(lease) + " has expired");
  return ttl;
}

Status Client::revoke(int64_t lease) {
  Result<std::string> body = call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  if (!body && body.error().kind() != ErrorKind::kNotFound) return body.error();
  return Status();
}

Result<int64_t> Client::put(const std::string& key, const std::string& value, int64_t lease) {
  json req{{"key", b64(key)}, {"value", b64(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  Result<std::string> body = call("/v3/kv/put", req.dump());
  if (!body) return body.error();
  return header_revision(json::parse(*body, nullptr, false));
}

namespace {
Result<RangeResult> parse_range(const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (!j.is_object()) return internal_error("etcd range: malformed answer");
  RangeResult r;
  r.revision = header_revision(j);
  if (auto it = j.find("kvs"); it != j.end() && it->is_array())
    for (const json& kv : *it) r.kvs.push_back(parse_kv(kv));
  return r;
}
}  // namespace

Result<RangeResult> Client::get(const std::string& key) {
  Result<std::string> body = call("/v3/kv/range", json{{"key", b64(key)}}.dump());
  if (!body) return body.error();
  return parse_range(*body);
}

Result<RangeResult> Client::get_prefix(const std::string& prefix, int64_t limit) {
  json req{{"key", b64(prefix)}, {"range_end", b64(prefix_end(prefix))}};
  if (limit > 0) req["limit"] = std::to_string(limit);
  Result<std::string> body = call("/v3/kv/range", req.dump());
  if (!body) return body.error();
  return parse_range(*body);
}

Result<int64_t> Client::remove(const std::string& key) {
  Result<std::string> body = call("/v3/kv/deleterange", json{{"key", b64(key)}}.dump());
  if (!body) return body.error();
  return num(json::parse(*body, nullptr, false), "deleted");
}

Result<TxnResult> Client::txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                              const std::vector<Op>& failure) {
  json req{{"compare", json::array()}, {"success", json::array()}, {"failure", json::array()}};
  for (const Compare& c : compares) {
    json cj{{"key", b64(c.key)}, {"target", c.target}, {"result", c.result}};
    if (c.target == "VALUE") cj["value"] = b64(c.value);
    else if (c.target == "VERSION") cj["version"] = std::to_string(c.number);
    else if (c.target == "CREATE") cj["create_revision"] = std::to_string(c.number);
    else if (c.target == "MOD") cj["mod_revision"] = std::to_string(c.number);
    else if (c.target == "LEASE") cj["lease"] = std::to_string(c.number);
    else return invalid_error("etcd txn: unknown compare target " + c.target);
    req["compare"].push_back(cj);
  }
  for (const Op& op : success) req["success"].push_back(op_json(op));
  for (const Op& op : failure) req["failure"].push_back(op_json(op));
  Result<std::string> body = call("/v3/kv/txn", req.dump());
  if (!body) return body.error();
  json j = json::parse(*body, nullptr, false);
  if (!j.is_object()) return internal_error("etcd txn: malformed answer");
  TxnResult r;
  r.succeeded = j.value("succeeded", false);
  r.revision = header_revision(j);
  return r;
}

Status Client::watch_prefix(const std::string& prefix, int64_t start_revision,
                            const std::function<bool(const std::vector<Event>&, int64_t)>& on_events,
                            const std::atomic<bool>& stop) {
  json create{{"key", b64(prefix)}, {"range_end", b64(prefix_end(prefix))}};
  if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
  net::Request req;
  req.method = "POST";
  req.target = "/v3/watch";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = json{{"create_request", create}}.dump();
  const net::Endpoint& ep = endpoints_[preferred_.load() % endpoints_.size()];
  std::string pending;  // a partial line
  Status verdict;
  bool done = false;
  Status s = net::stream(
      ep, req, timeout_,
      [&](std::string_view data) {
        pending.append(data);
        if (pending.size() > (64u << 20)) {
          verdict = internal_error("etcd watch: one event batch larger than 64 MiB");
          return false;
        }
        size_t eol;
        while ((eol = pending.find('\n')) != std::string::npos) {
          json j = json::parse(pending.substr(0, eol), nullptr, false);
          pending.erase(0, eol + 1);
          if (!j.is_object() || !j.contains("result")) {
            verdict = Error(ErrorKind::kUnavailable, "etcd watch: malformed event");
            return false;
          }
          const json& r = j["result"];
          if (r.value("canceled", false)) {
            if (num(r, "compact_revision") > 0)
              verdict = conflict_error("etcd watch: revision " + std::to_string(start_revision) + " was compacted");
            else
              verdict = Error(ErrorKind::kUnavailable, "etcd watch canceled: " + r.value("cancel_reason", std::string()));
            return false;
          }
          std::vector<Event> events;
          if (auto it = r.find("events"); it != r.end() && it->is_array()) {
            for (const json& e : *it) {
              Event ev;
              ev.type = e.value("type", std::string()) == "DELETE" ? Event::Type::kDelete : Event::Type::kPut;
              if (auto kv = e.find("kv"); kv != e.end()) ev.kv = parse_kv(*kv);
              events.push_back(std::move(ev));
            }
          }
          if (!events.empty() && !on_events(events, header_revision(r))) {
            done = true;
            return false;
          }
        }
        return true;
      },
      stop);
  if (!verdict) return verdict;
  if (done || stop.load()) return Status();
  if (!s) return s.error().with_context("etcd watch on " + ep.str());
  return Error(ErrorKind::kUnavailable, "etcd watch on " + ep.str() + ": the stream ended");
}

}  // namespace sg::etcd
