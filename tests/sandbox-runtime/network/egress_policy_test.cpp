// Egress policies (api-e2b/egress_policy.h): parsing and decisions.
#include "sandbox-runtime/network/egress_policy.h"

#include <doctest/doctest.h>

using namespace sg::network;

namespace {

std::array<uint8_t, 16> ip(const char* s) { return *parse_ip(s); }

EgressPolicy policy(std::vector<std::string> allow, std::vector<std::string> deny, std::optional<bool> internet) {
  auto p = parse_egress_policy(allow, deny, internet);
  REQUIRE_MESSAGE(p, (p ? "" : p.error().message()));
  return *p;
}

bool allowed(const EgressPolicy& p, const char* host, const char* addr, bool internal = false) {
  return decide_egress(p, host, ip(addr), internal).allowed;
}

}  // namespace

TEST_CASE("egress: addresses and CIDRs, IPv4 and IPv6") {
  auto n = parse_ip_net("10.1.2.3/8");
  REQUIRE(n);
  CHECK(n->contains(ip("10.200.0.1")));
  CHECK_FALSE(n->contains(ip("11.0.0.1")));
  CHECK_FALSE(n->contains(ip("::a01:203")));  // an IPv6 address is not in an IPv4 net
  auto host = parse_ip_net("8.8.8.8");
  REQUIRE(host);
  CHECK(host->contains(ip("8.8.8.8")));
  CHECK_FALSE(host->contains(ip("8.8.8.9")));
  auto v6 = parse_ip_net("2001:db8::/32");
  REQUIRE(v6);
  CHECK(v6->contains(ip("2001:db8:1::5")));
  CHECK_FALSE(v6->contains(ip("2001:db9::5")));
  // ALL_TRAFFIC covers both families.
  auto all = parse_ip_net("0.0.0.0/0");
  REQUIRE(all);
  CHECK(all->contains(ip("1.2.3.4")));
  CHECK(all->contains(ip("2001:db8::1")));
  for (const char* bad : {"10.0.0.0/33", "::/129", "1.2.3", "1.2.3.4/", "1.2.3.4/x", "example.com", ""})
    CHECK_MESSAGE(!parse_ip_net(bad), bad);
}

TEST_CASE("egress: the host's internal networks") {
  for (const char* a : {"127.0.0.1", "10.0.0.1", "172.16.5.5", "192.168.1.1", "169.254.169.254", "100.64.0.1",
                        "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fd00::1", "ff02::1"})
    CHECK_MESSAGE(is_internal(ip(a)), a);
  for (const char* a : {"8.8.8.8", "1.1.1.1", "172.32.0.1", "2606:4700::1111"}) CHECK_MESSAGE(!is_internal(ip(a)), a);
}

TEST_CASE("egress: decisions follow E2B's rules; internal addresses only when the server opens them") {
  EgressPolicy open = policy({}, {}, std::nullopt);  // the default: internet access
  CHECK(allowed(open, "1.1.1.1", "1.1.1.1"));
  CHECK_FALSE(allowed(open, "metadata", "169.254.169.254"));
  CHECK(decide_egress(open, "metadata", ip("169.254.169.254"), false).why.find("internal") != std::string::npos);
  CHECK(allowed(open, "localhost", "127.0.0.1", /*internal=*/true));

  EgressPolicy none = policy({}, {}, false);
  CHECK_FALSE(allowed(none, "1.1.1.1", "1.1.1.1"));
  CHECK(decide_egress(none, "1.1.1.1", ip("1.1.1.1"), false).why.find("no internet access") != std::string::npos);

  // allowOut wins over denyOut and over no internet access.
  EgressPolicy some = policy({"1.1.1.0/24", "example.com", "*.pypi.org"}, {"0.0.0.0/0"}, std::nullopt);
  CHECK(allowed(some, "1.1.1.1", "1.1.1.1"));
  CHECK_FALSE(allowed(some, "8.8.8.8", "8.8.8.8"));
  CHECK(decide_egress(some, "8.8.8.8", ip("8.8.8.8"), false).why.find("denyOut") != std::string::npos);
  CHECK(allowed(some, "Example.COM", "93.184.216.34"));
  CHECK_FALSE(allowed(some, "www.example.com", "93.184.216.34"));
  CHECK(allowed(some, "files.pypi.org", "151.101.0.223"));
  CHECK_FALSE(allowed(some, "pypi.org", "151.101.0.223"));
  CHECK_FALSE(allowed(some, "evilpypi.org", "151.101.0.223"));
  // A name in allowOut does not open an internal address it resolves to.
  EgressPolicy name = policy({"intranet.example"}, {}, false);
  CHECK_FALSE(allowed(name, "intranet.example", "10.0.0.5"));
  CHECK(allowed(name, "intranet.example", "10.0.0.5", true));
  // denyOut only where the destination is not also allowed.
  EgressPolicy deny = policy({}, {"8.8.8.8"}, true);
  CHECK_FALSE(allowed(deny, "8.8.8.8", "8.8.8.8"));
  CHECK(allowed(deny, "8.8.4.4", "8.8.4.4"));
}

TEST_CASE("egress: bad entries are refused with the entry named") {
  auto bad = parse_egress_policy({"not a host!"}, {}, std::nullopt);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().message().find("'not a host!'") != std::string::npos);
  auto deny_name = parse_egress_policy({}, {"example.com"}, std::nullopt);
  REQUIRE_FALSE(deny_name);
  CHECK(deny_name.error().message().find("denyOut") != std::string::npos);
  std::vector<std::string> many(65, "1.1.1.1");
  CHECK_FALSE(parse_egress_policy(many, {}, std::nullopt));
  const std::vector<std::string> names = {"-a.com", "a-.com", "a..com", ".com", std::string(64, 'a') + ".com"};
  for (const std::string& n : names) CHECK_MESSAGE(!parse_egress_policy({n}, {}, std::nullopt), n);
}

TEST_CASE("egress: proxy request heads") {
  auto c = parse_egress_request("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n");
  REQUIRE(c);
  CHECK(c->tunnel);
  CHECK(c->host == "example.com");
  CHECK(c->port == 443);
  auto v6 = parse_egress_request("CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n");
  REQUIRE(v6);
  CHECK(v6->host == "2001:db8::1");
  CHECK(v6->port == 8443);
  auto g = parse_egress_request(
      "GET http://example.com/a?b=1 HTTP/1.1\r\nHost: example.com\r\nProxy-Authorization: x\r\nConnection: keep-alive\r\n"
      "Accept: */*\r\n\r\n");
  REQUIRE(g);
  CHECK_FALSE(g->tunnel);
  CHECK(g->port == 80);
  CHECK(g->origin_head == "GET /a?b=1 HTTP/1.1\r\nHost: example.com\r\nAccept: */*\r\nConnection: close\r\n\r\n");
  auto root = parse_egress_request("GET http://example.com:8080 HTTP/1.0\r\n\r\n");
  REQUIRE(root);
  CHECK(root->port == 8080);
  CHECK(root->origin_head.rfind("GET / HTTP/1.1\r\n", 0) == 0);
  for (const char* bad : {"GET /relative HTTP/1.1\r\n\r\n", "CONNECT example.com HTTP/1.1\r\n\r\n",
                          "CONNECT example.com:0 HTTP/1.1\r\n\r\n", "CONNECT example.com:65536 HTTP/1.1\r\n\r\n",
                          "connect example.com:443 HTTP/1.1\r\n\r\n", "CONNECT example.com:443 HTTP/2.0\r\n\r\n",
                          "CONNECT ex ample.com:443 HTTP/1.1\r\n\r\n", "CONNECT [::1:443 HTTP/1.1\r\n\r\n",
                          "GET https://example.com/ HTTP/1.1\r\n\r\n", "CONNECT a:1 HTTP/1.1\r\n\r\n\r\n",
                          // a header without a colon, or a bare LF inside one: no smuggling past the rewrite
                          "GET http://a/ HTTP/1.1\r\nnocolon\r\n\r\n",
                          "GET http://a/ HTTP/1.1\r\nX: 1\nGET http://b/ HTTP/1.1\r\n\r\n", "", "\r\n\r\n"}) {
    auto r = parse_egress_request(bad);
    CHECK_MESSAGE(!r, bad);
    if (!r) CHECK(r.error().kind() == sg::ErrorKind::kInvalid);
  }
  CHECK_FALSE(parse_egress_request(std::string(kMaxEgressHead + 1, 'A')));
}
