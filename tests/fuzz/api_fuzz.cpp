// libFuzzer target: what a client controls in a control-plane or proxied
// request: the target (path and query), Host and routing headers, the
// content type and the JSON body, through every route's parser
// (api-e2b/requests.h), the egress proxy's request heads and policies
// (api-e2b/egress_policy.h) and the gateway's sandbox routing
// (base/http/routing.h). Beyond "no crash, no sanitizer report" it
// checks the contracts: a parse either succeeds with values inside their
// documented bounds or fails as kInvalid with a message.
//
// Input: byte 0 picks the route; the rest is split on '\n' into target,
// Host, E2B-Sandbox-Id, E2B-Sandbox-Port, Content-Type, and the body (all
// that is left). Route 8 is the egress proxy's request head (the body) and
// an egress policy (allowOut and denyOut one entry each from the fourth
// and fifth fields) decided for the second and third (name, address).
// Route 4 with bit 0x10 is PUT .../network (the SDK's updateNetwork).
// Route 5 with bit 0x10 is a template build request (POST /v3/templates,
// with 0x20 the build start), with 0x40 a tags request (and the target
// as a template name); route 6 with 0x20 the build status query, with
// 0x40 the build logs query.
// Route 7 with bit 0x40 is the request framing check (http::framing_error):
// Transfer-Encoding and Content-Length from the second and third fields.
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "api-e2b/requests.h"
#include "base/http/routing.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

template <typename R>
void check_error(const R& r) {
  if (r) return;
  require(r.error().kind() == sg::ErrorKind::kInvalid);
  require(!r.error().message().empty());
}

bool id_chars(const std::string& id) {
  for (char c : id)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return false;
  return !id.empty();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t route = data[0];
  std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  std::string fields[5];
  for (std::string& f : fields) {
    size_t nl = rest.find('\n');
    if (nl == std::string_view::npos) break;
    f = std::string(rest.substr(0, nl));
    rest.remove_prefix(nl + 1);
  }
  sg::http::HttpRequest req;
  req.method = "POST";
  req.target = fields[0];
  size_t q = req.target.find('?');
  req.path = req.target.substr(0, q);
  req.query = q == std::string::npos ? "" : req.target.substr(q + 1);
  if (!fields[1].empty()) req.headers["host"] = fields[1];
  if (!fields[2].empty()) req.headers["e2b-sandbox-id"] = fields[2];
  if (!fields[3].empty()) req.headers["e2b-sandbox-port"] = fields[3];
  if (!fields[4].empty()) req.headers["content-type"] = fields[4];
  req.body = std::string(rest);

  (void)sg::api::path_segments(req.path);
  switch (route % 9) {
    case 0:
    case 1: {
      auto r = sg::api::parse_create_request(req, route % 9 == 1);
      check_error(r);
      if (r) {
        require(!r->template_ref.empty() && r->template_ref.size() <= 256);
        require(r->timeout_s >= 0 && r->timeout_s <= sg::api::kMaxTimeoutS);
        require(r->metadata.size() <= 64 && r->env_vars.size() <= 256);
        for (const auto& [k, v] : r->env_vars) require(!k.empty() && k.find('=') == std::string::npos);
      }
      break;
    }
    case 2:
    case 3: {
      auto r = route % 9 == 2 ? sg::api::parse_connect_request(req) : sg::api::parse_resume_request(req);
      check_error(r);
      if (r && *r) require(**r >= 0 && **r <= sg::api::kMaxTimeoutS);
      break;
    }
    case 4: {
      if (route & 0x10) {  // PUT .../network
        auto r = sg::api::parse_network_update(req);
        check_error(r);
        if (r) {
          require(r->allow_out.size() <= 64 && r->deny_out.size() <= 64);
          require(r->asks_egress == !r->allow_out.empty());
          require(r->egress.internet == r->allow_internet.value_or(true));
        }
        break;
      }
      sg::Result<bool> s = sg::api::parse_pause_request(req);
      if (!s) require(s.error().kind() == sg::ErrorKind::kInvalid);
      break;
    }
    case 5: {
      if (route & 0x20) {  // POST /v2/templates/{id}/builds/{build}
        auto r = sg::api::parse_build_request(req);
        check_error(r);
        if (r) {
          require(r->steps.size() <= 256);
          for (const auto& st : r->steps) require(st.type.size() <= 16 && st.files_hash.size() <= 128);
        }
        break;
      }
      if (route & 0x40) {  // POST (0x10: DELETE) /templates/tags; a template name as clients write it
        auto r = sg::api::parse_tags_request(req, (route & 0x10) == 0);
        check_error(r);
        if (r) {
          require(!r->target.empty() && !r->tags.empty() && r->tags.size() <= sg::storage::kMaxTags);
          for (const std::string& t : r->tags) require(sg::storage::valid_tag(t));
        }
        auto ref = sg::storage::parse_template_ref(req.target);
        check_error(ref);
        if (ref) {
          require(!ref->name.empty() && ref->name.find_first_of("/:") == std::string::npos);
          require(sg::storage::valid_tag(ref->tag) && ref->team.find('/') == std::string::npos);
        }
        break;
      }
      if (route & 0x10) {  // POST /v3/templates
        auto r = sg::api::parse_template_request(req);
        check_error(r);
        if (r) {
          require(r->tags.size() <= sg::storage::kMaxTags);
          for (const std::string& t : r->tags) require(sg::storage::valid_tag(t));
          require(!r->name.empty() && r->name.find(':') == std::string::npos);
          require(r->cpu_count >= 1 && r->cpu_count <= 64 && r->memory_mb >= 128 && r->memory_mb <= 65536);
        }
        break;
      }
      auto r = sg::api::parse_timeout_request(req);
      check_error(r);
      if (r) require(*r >= 0 && *r <= sg::api::kMaxTimeoutS);
      break;
    }
    case 6: {
      auto r = sg::api::parse_list_query(req.query, (route & 0x10) != 0);
      check_error(r);
      if (r) require(r->limit >= 1 && r->limit <= 100 && r->after_seq >= 0);
      auto m = sg::api::parse_metrics_query(req.query);
      check_error(m);
      if (m) require((!m->start || *m->start >= 0) && (!m->end || *m->end >= 0));
      (void)sg::api::parse_rfc3339(req.body);
      if (route & 0x20) {
        auto b = sg::api::parse_build_status_query(req.query);
        check_error(b);
        if (b) require(b->logs_offset >= 0 && b->limit >= 1 && b->limit <= 1000);
      }
      if (route & 0x40) {
        auto l = sg::api::parse_build_logs_query(req.query);
        check_error(l);
        if (l) require(l->limit >= 1 && l->limit <= 1000 && l->min_level >= 0 && l->min_level <= 3);
      }
      break;
    }
    case 8: {
      // The egress proxy's request head (a sandbox's): the body is the head.
      auto r = sg::network::parse_egress_request(req.body);
      check_error(r);
      if (r) {
        require(!r->host.empty() && r->host.size() <= 253 && r->port >= 1);
        require(r->tunnel == r->origin_head.empty());
        if (!r->tunnel) require(r->origin_head.size() >= 4 && r->origin_head.substr(r->origin_head.size() - 4) == "\r\n\r\n");
      }
      std::string host = fields[1].empty() ? "example.com" : fields[1];
      if (auto a = sg::network::parse_ip(fields[2].empty() ? "1.2.3.4" : fields[2])) {
        auto pol = sg::network::parse_egress_policy({fields[3]}, {fields[4]}, (route & 0x10) != 0);
        check_error(pol);
        if (pol) {
          sg::network::EgressDecision d = sg::network::decide_egress(*pol, host, *a, (route & 0x20) != 0);
          require(d.allowed == d.why.empty());
        }
      }
      break;
    }
    case 7:
      if (route & 0x40) {
        // Request framing (RFC 9112 6): Transfer-Encoding from the Host
        // field, Content-Length from the E2B-Sandbox-Id field; bit 0x10
        // makes it an HTTP/1.0 request.
        sg::http::HttpRequest f;
        if (!fields[1].empty()) f.headers["transfer-encoding"] = fields[1];
        if (!fields[2].empty()) f.headers["content-length"] = fields[2];
        bool http10 = (route & 0x10) != 0;
        std::string why = sg::http::framing_error(f, http10 ? 10 : 11);
        if (why.empty() && !fields[1].empty()) {
          // Accepted with a Transfer-Encoding: HTTP/1.1, no Content-Length,
          // and the last coding is chunked.
          require(!http10 && fields[2].empty());
          std::string te = fields[1];
          while (!te.empty() && (te.back() == ' ' || te.back() == '\t' || te.back() == ',')) te.pop_back();
          require(te.size() >= 7);
          std::string tail = te.substr(te.size() - 7);
          for (char& c : tail) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
          require(tail == "chunked");
        } else if (why.empty() && !fields[2].empty()) {
          for (char c : fields[2]) require((c >= '0' && c <= '9') || c == ',' || c == ' ' || c == '\t');
        }
        break;
      }
      [[fallthrough]];
    default: {
      auto t = sg::http::route_to_sandbox(req, (route & 0x10) ? "sandgate.test" : "");
      check_error(t);
      if (t && *t) require(id_chars((*t)->sandbox_id) && (*t)->port >= 1);
      break;
    }
  }
  return 0;
}
