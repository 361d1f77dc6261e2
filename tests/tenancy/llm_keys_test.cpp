// Model-proxy keys (format, authentication, separation from E2B keys) and
// the upstream checks: parse_base_url against good and hostile URLs, key
// files.
#include <doctest/doctest.h>

#include <regex>

#include "tests/support/temp_dir.h"
#include "base/sys.h"
#include "tenancy/api_key.h"
#include "tenancy/llm_keys.h"
#include "tenancy/tenants.h"

using namespace sg;
using namespace sg::tenancy;

TEST_CASE("llm keys are sk-sg- plus 48 lowercase hex and distinct") {
  std::string a = generate_llm_key(), b = generate_llm_key();
  CHECK(std::regex_match(a, std::regex("sk-sg-[0-9a-f]{48}")));
  CHECK(a != b);
  CHECK(is_well_formed_llm_key(a));
  CHECK_FALSE(is_well_formed_llm_key("sk-sg-" + std::string(48, 'A')));
  CHECK_FALSE(is_well_formed_llm_key("sk-sg-" + std::string(47, 'a')));
  CHECK_FALSE(is_well_formed_llm_key("sk-sg-" + std::string(49, 'a')));
  CHECK_FALSE(is_well_formed_llm_key("sk-xx-" + std::string(48, 'a')));
  CHECK_FALSE(is_well_formed_llm_key(""));
  CHECK_FALSE(is_well_formed_llm_key(generate_api_key()));
  CHECK_FALSE(is_well_formed_api_key(a));
  CHECK(llm_key_display_prefix(a) == a.substr(0, 12) + "...");
}

TEST_CASE("llm keys: create, authenticate, revoke; malformed, unknown and E2B keys refused alike") {
  test::TempDir dir;
  auto store = storage::Store::open(dir.sub("t.db"));
  REQUIRE(store.ok());
  Tenants tenants(**store);
  auto e2b = tenants.create("acme", Quota{});
  REQUIRE(e2b.ok());
  LlmKeys keys(**store);
  auto k = keys.create("acme", "ci runner");
  REQUIRE(k.ok());
  CHECK(is_well_formed_llm_key(k->key));
  CHECK(k->row.name == "ci runner");
  CHECK(k->row.id.rfind("lk_", 0) == 0);
  CHECK(k->row.key_hash == hash_api_key(k->key));
  CHECK(k->row.key_prefix == llm_key_display_prefix(k->key));
  auto t = keys.authenticate(k->key);
  REQUIRE(t.ok());
  CHECK(t->name == "acme");

  // The stored row holds no part of the secret beyond the display prefix.
  auto rows = *(*store)->list_llm_keys(t->id);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].key_hash.find(k->key.substr(12)) == std::string::npos);
  CHECK(rows[0].key_prefix.find(k->key.substr(12)) == std::string::npos);

  auto expect_unauthorized = [&](std::string_view presented) {
    auto r = keys.authenticate(presented);
    REQUIRE(!r.ok());
    CHECK(r.error().kind() == ErrorKind::kUnauthorized);
    return r.error().message();
  };
  std::string m_missing = expect_unauthorized("");
  std::string m_malformed = expect_unauthorized("sk-sg-nothex");
  std::string m_unknown = expect_unauthorized(generate_llm_key());
  // An E2B key of the same tenant does not open the proxy, nor the reverse.
  std::string m_e2b = expect_unauthorized(e2b->key);
  CHECK_FALSE(tenants.authenticate(k->key).ok());
  CHECK(m_missing == m_malformed);
  CHECK(m_malformed == m_unknown);
  CHECK(m_unknown == m_e2b);

  auto k2 = keys.create("acme", "");
  REQUIRE(k2.ok());
  REQUIRE(*(*store)->revoke_llm_key(k->row.id, 5));
  CHECK(expect_unauthorized(k->key) == m_unknown);
  CHECK(keys.authenticate(k2->key).ok());

  // A revoked tenant: its remaining key stops working, and no new one is made.
  REQUIRE((*store)->revoke_tenant(t->id, 6).ok());
  CHECK(expect_unauthorized(k2->key) == m_unknown);
  auto after = keys.create("acme", "x");
  REQUIRE(!after.ok());
  CHECK(after.error().kind() == ErrorKind::kConflict);
}

TEST_CASE("llm keys: a disabled tenant's key is refused even if not revoked") {
  test::TempDir dir;
  auto store = storage::Store::open(dir.sub("d.db"));
  REQUIRE(store.ok());
  REQUIRE(Tenants(**store).create("acme", Quota{}).ok());
  LlmKeys keys(**store);
  auto k = keys.create("acme", "");
  REQUIRE(k.ok());
  {
    auto tx = (*store)->db().lock();
    REQUIRE(tx.exec("UPDATE tenants SET disabled = 1").ok());
  }
  auto r = keys.authenticate(k->key);
  REQUIRE(!r.ok());
  CHECK(r.error().kind() == ErrorKind::kUnauthorized);
}

TEST_CASE("llm keys: unknown tenant and bad labels") {
  test::TempDir dir;
  auto store = storage::Store::open(dir.sub("l.db"));
  REQUIRE(store.ok());
  REQUIRE(Tenants(**store).create("acme", Quota{}).ok());
  LlmKeys keys(**store);
  auto nobody = keys.create("nobody", "");
  REQUIRE(!nobody.ok());
  CHECK(nobody.error().kind() == ErrorKind::kNotFound);
  for (std::string bad : {std::string(65, 'a'), std::string("tab\there"), std::string("new\nline"),
                          std::string("caf\xc3\xa9")}) {
    auto r = keys.create("acme", bad);
    REQUIRE(!r.ok());
    CHECK(r.error().kind() == ErrorKind::kInvalid);
  }
  CHECK(keys.create("acme", std::string(64, 'a')).ok());
  CHECK((*store)->list_llm_keys((*store)->find_tenant_by_name("acme")->value().id)->size() == 1);
}

TEST_CASE("parse_base_url: accepted forms and their parse") {
  struct Case {
    const char* in;
    bool tls;
    const char* host;
    uint16_t port;
    const char* prefix;
    const char* normalised;
  };
  const Case cases[] = {
      {"https://api.openai.com", true, "api.openai.com", 443, "", "https://api.openai.com"},
      {"https://api.openai.com/", true, "api.openai.com", 443, "", "https://api.openai.com"},
      {"http://127.0.0.1:8080", false, "127.0.0.1", 8080, "", "http://127.0.0.1:8080"},
      {"https://example.com/openai", true, "example.com", 443, "/openai", "https://example.com/openai"},
      {"https://example.com/openai/v1///", true, "example.com", 443, "/openai/v1", "https://example.com/openai/v1"},
      {"HTTPS://Example.COM:443/Path", true, "example.com", 443, "/Path", "https://example.com/Path"},
      {"http://localhost:80", false, "localhost", 80, "", "http://localhost"},
      {"http://[::1]:9000/x", false, "::1", 9000, "/x", "http://[::1]:9000/x"},
      {"https://[2001:DB8::1]", true, "2001:db8::1", 443, "", "https://[2001:db8::1]"},
      {"http://my_host-1.internal:65535", false, "my_host-1.internal", 65535, "", "http://my_host-1.internal:65535"},
      {"http://h:1", false, "h", 1, "", "http://h:1"},
      {"https://gw.example/a-b_c.d~e/v1:x", true, "gw.example", 443, "/a-b_c.d~e/v1:x",
       "https://gw.example/a-b_c.d~e/v1:x"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.in);
    auto u = parse_base_url(c.in);
    REQUIRE(u.ok());
    CHECK(u->tls == c.tls);
    CHECK(u->host == c.host);
    CHECK(u->port == c.port);
    CHECK(u->path_prefix == c.prefix);
    CHECK(format_base_url(*u) == c.normalised);
    // The normalised form parses to the same thing.
    auto again = parse_base_url(format_base_url(*u));
    REQUIRE(again.ok());
    CHECK(format_base_url(*again) == c.normalised);
  }
  CHECK(host_header(*parse_base_url("http://[::1]:9000")) == "[::1]:9000");
  CHECK(host_header(*parse_base_url("https://example.com:443/x")) == "example.com");
  CHECK(host_header(*parse_base_url("https://example.com:8443")) == "example.com:8443");
}

TEST_CASE("parse_base_url: hostile and malformed URLs are refused without echoing credentials") {
  const char* bad[] = {
      "",
      "example.com",
      "ftp://example.com",
      "file:///etc/passwd",
      "https:/example.com",
      "https//example.com",
      "https://",
      "https:///path",
      "https://:443",
      "https://user:secretpw@example.com",
      "https://secretpw@example.com/v1",
      "https://example.com@evil.com",
      "https://example.com?key=secretpw",
      "https://example.com/v1?x",
      "https://example.com/#frag",
      "https://example.com:0",
      "https://example.com:65536",
      "https://example.com:99999999999999999999",
      "https://example.com:",
      "https://example.com:80a",
      "https://example.com:-1",
      "https://example.com:+80",
      "https://exa mple.com",
      " https://example.com",
      "https://example.com ",
      "https://example.com\r\nHost: evil",
      "https://example.com/v1\n",
      "https://example.com/\t",
      "https://ex\x01.com",
      "https://exam\xc3\xa9ple.com",
      "https://example.com/%2e%2e/admin",
      "https://example.com/a%20b",
      "https://example.com/../admin",
      "https://example.com/a/./b",
      "https://example.com/a//b",
      "https://example.com/a\\b",
      "https://example.com\\@evil.com",
      "https://exa%6dple.com",
      "https://example..com",
      "https://.example.com",
      "https://-example.com",
      "https://example-.com",
      "https://ex*ample.com",
      "https://example.com/a\"b",
      "https://example.com/a<b>",
      "https://[::1",
      "https://[]",
      "https://[::1]x",
      "https://[::1]:",
      "https://[::1]:70000",
      "https://[not:v6]",
      "https://[fe80::1%25eth0]",
      "https://[127.0.0.1]",
      "https://::1",
      "https://example.com:80:80",
  };
  for (const char* in : bad) {
    CAPTURE(in);
    auto u = parse_base_url(in);
    REQUIRE(!u.ok());
    CHECK(u.error().kind() == ErrorKind::kInvalid);
    CHECK(u.error().message().find("secretpw") == std::string::npos);
  }
  CHECK_FALSE(parse_base_url("https://" + std::string(2100, 'a')).ok());
  CHECK_FALSE(parse_base_url("https://" + std::string(64, 'a') + ".com").ok());
  CHECK(parse_base_url("https://" + std::string(63, 'a') + ".com").ok());
  CHECK_FALSE(parse_base_url("https://example.com/" + std::string(2048, 'a')).ok());
}

TEST_CASE("check_upstream: provider names and URL normalisation") {
  auto ok = check_upstream("openai", "https://api.openai.com/");
  REQUIRE(ok.ok());
  CHECK(*ok == "https://api.openai.com");
  auto ant = check_upstream("anthropic", "http://127.0.0.1:4010/anthropic/");
  REQUIRE(ant.ok());
  CHECK(*ant == "http://127.0.0.1:4010/anthropic");
  for (const char* p : {"", "OpenAI", "azure", "openai "}) {
    CAPTURE(p);
    auto r = check_upstream(p, "https://api.openai.com");
    REQUIRE(!r.ok());
    CHECK(r.error().kind() == ErrorKind::kInvalid);
  }
  CHECK_FALSE(check_upstream("openai", "https://api.openai.com?x=1").ok());
}

TEST_CASE("read_upstream_key_file: trims, refuses empty, oversized and multi-line keys") {
  test::TempDir dir;
  auto write = [&](const std::string& name, const std::string& data) {
    REQUIRE(sys::write_file(dir.sub(name), data).ok());
    return dir.sub(name);
  };
  auto k = read_upstream_key_file(write("k", "  sk-proj-abcdef0123456789\n"));
  REQUIRE(k.ok());
  CHECK(*k == "sk-proj-abcdef0123456789");
  CHECK(*read_upstream_key_file(write("k2", "sk-ant-x\r\n\r\n")) == "sk-ant-x");
  CHECK(read_upstream_key_file(write("max", std::string(kMaxUpstreamKeyBytes, 'k') + "\n"))->size() ==
        kMaxUpstreamKeyBytes);

  struct Bad {
    const char* name;
    std::string data;
  };
  const Bad bad[] = {{"empty", ""},
                     {"blank", " \n\t\n"},
                     {"long", std::string(kMaxUpstreamKeyBytes + 1, 'k')},
                     {"huge", std::string(1 << 20, 'k')},
                     {"two-lines", "secretpw-line-one\nsecretpw-line-two\n"},
                     {"space", "secretpw one"},
                     {"nul", std::string("secretpw\0x", 10)},
                     {"utf8", "secretpw\xc3\xa9"}};
  for (const Bad& b : bad) {
    CAPTURE(b.name);
    auto r = read_upstream_key_file(write(b.name, b.data));
    REQUIRE(!r.ok());
    CHECK(r.error().kind() == ErrorKind::kInvalid);
    CHECK(r.error().message().find(dir.sub(b.name)) != std::string::npos);
    CHECK(r.error().message().find("secretpw") == std::string::npos);
  }
  auto missing = read_upstream_key_file(dir.sub("missing"));
  REQUIRE(!missing.ok());
  CHECK(missing.error().message().find(dir.sub("missing")) != std::string::npos);
}

TEST_CASE("upstream_key_hint shows at most the last 4 characters") {
  CHECK(upstream_key_hint("") == "");
  CHECK(upstream_key_hint("short-key") == "(set)");
  CHECK(upstream_key_hint("sk-proj-0123456789abcd") == "...abcd");
}
