// The admin command line in process (run_cli): the `llm` commands against a
// temp data dir, and serve-option checks that fail before anything starts.
// Provider keys must never reach stdout or stderr.
#include <doctest/doctest.h>

#include <sstream>

#include "gateway/cli.h"
#include "storage/store.h"
#include "tests/support/temp_dir.h"
#include "base/sys.h"
#include "tenancy/llm_keys.h"

using namespace sg;

namespace {

struct Run {
  int rc;
  std::string out, err;
};

Run cli(const test::TempDir& dir, std::vector<std::string> args) {
  args.push_back("--data-dir=" + dir.path());
  std::ostringstream out, err;
  int rc = gateway::run_cli(args, out, err);
  return {rc, out.str(), err.str()};
}

constexpr const char* kSecret = "sk-provider-SECRET-0123456789-wxyz";

}  // namespace

TEST_CASE("llm key create, list and revoke") {
  test::TempDir dir;
  REQUIRE(cli(dir, {"tenant", "create", "acme"}).rc == 0);
  Run created = cli(dir, {"llm", "key", "create", "acme", "--name", "ci runner"});
  REQUIRE(created.rc == 0);
  std::string key = created.out.substr(0, created.out.find('\n'));
  CHECK(tenancy::is_well_formed_llm_key(key));
  CHECK(created.err.find("shown only once") != std::string::npos);
  CHECK(created.err.find(key) == std::string::npos);

  auto store = storage::Store::open(dir.sub("sandgate.db"));
  REQUIRE(store.ok());
  auto t = tenancy::LlmKeys(**store).authenticate(key);
  REQUIRE(t.ok());
  CHECK(t->name == "acme");

  Run list = cli(dir, {"llm", "key", "list", "acme"});
  REQUIRE(list.rc == 0);
  CHECK(list.out.rfind("ID\tPREFIX\tNAME\tSTATUS\tCREATED\n", 0) == 0);
  CHECK(list.out.find(tenancy::llm_key_display_prefix(key)) != std::string::npos);
  CHECK(list.out.find("ci runner\tactive") != std::string::npos);
  CHECK(list.out.find(key) == std::string::npos);
  auto rows = *(*store)->list_llm_keys(t->id);
  REQUIRE(rows.size() == 1);

  Run revoked = cli(dir, {"llm", "key", "revoke", rows[0].id});
  CHECK(revoked.rc == 0);
  CHECK(cli(dir, {"llm", "key", "list", "acme"}).out.find("ci runner\trevoked") != std::string::npos);
  CHECK_FALSE(tenancy::LlmKeys(**store).authenticate(key).ok());
  CHECK(cli(dir, {"llm", "key", "revoke", rows[0].id}).rc == 1);

  CHECK(cli(dir, {"llm", "key", "create", "nobody"}).rc == 1);
  CHECK(cli(dir, {"llm", "key", "list", "nobody"}).rc == 1);
  CHECK(cli(dir, {"llm", "key", "create", "acme", "--name", std::string(65, 'x')}).rc == 2);
  CHECK(cli(dir, {"llm", "key"}).rc == 2);
  CHECK(cli(dir, {"llm", "key", "create"}).rc == 2);
}

TEST_CASE("llm upstream set and list store the provider key but never print it") {
  test::TempDir dir;
  REQUIRE(cli(dir, {"tenant", "create", "acme"}).rc == 0);
  REQUIRE(sys::write_file(dir.sub("key"), std::string(kSecret) + "\n").ok());
  Run global = cli(dir, {"llm", "upstream", "set", "openai", "--base-url", "https://API.example.com/v1/",
                         "--key-file", dir.sub("key")});
  REQUIRE(global.rc == 0);
  Run own = cli(dir, {"llm", "upstream", "set", "openai", "--base-url", "http://127.0.0.1:4010", "--key-file",
                      dir.sub("key"), "--tenant", "acme"});
  REQUIRE(own.rc == 0);
  Run list = cli(dir, {"llm", "upstream", "list"});
  REQUIRE(list.rc == 0);
  for (const Run* r : {&global, &own, &list}) {
    CHECK(r->out.find("SECRET") == std::string::npos);
    CHECK(r->err.find("SECRET") == std::string::npos);
  }
  CHECK(list.out.rfind("TENANT\tPROVIDER\tBASE_URL\tKEY\n", 0) == 0);
  CHECK(list.out.find("(global)\topenai\thttps://api.example.com/v1\t...wxyz\n") != std::string::npos);
  CHECK(list.out.find("acme\topenai\thttp://127.0.0.1:4010\t...wxyz\n") != std::string::npos);

  auto store = storage::Store::open(dir.sub("sandgate.db"));
  REQUIRE(store.ok());
  auto acme = *(*store)->find_tenant_by_name("acme");
  auto u = *(*store)->find_upstream(acme->id, "openai");
  REQUIRE(u.has_value());
  CHECK(u->api_key == kSecret);
  CHECK(u->base_url == "http://127.0.0.1:4010");

  CHECK(cli(dir, {"llm", "upstream", "remove", "openai", "--tenant", "acme"}).rc == 0);
  CHECK((*(*store)->find_upstream(acme->id, "openai"))->tenant_id == "");
  CHECK(cli(dir, {"llm", "upstream", "remove", "openai", "--tenant", "acme"}).rc == 1);
  CHECK(cli(dir, {"llm", "upstream", "remove", "azure"}).rc == 2);
  CHECK(cli(dir, {"llm", "upstream", "remove", "openai"}).rc == 0);
  CHECK(cli(dir, {"llm", "upstream", "list"}).out == "TENANT\tPROVIDER\tBASE_URL\tKEY\n");
}

TEST_CASE("llm upstream set refuses bad URLs, providers, tenants and key files") {
  test::TempDir dir;
  REQUIRE(sys::write_file(dir.sub("key"), kSecret).ok());
  REQUIRE(sys::write_file(dir.sub("empty"), "\n").ok());
  REQUIRE(sys::write_file(dir.sub("big"), std::string(5000, 'k')).ok());
  auto set = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"llm", "upstream", "set"};
    args.insert(args.end(), extra.begin(), extra.end());
    return cli(dir, args);
  };
  Run userinfo = set({"openai", "--base-url", "https://user:SECRETPW@example.com", "--key-file", dir.sub("key")});
  CHECK(userinfo.rc == 2);
  CHECK(userinfo.err.find("--base-url") != std::string::npos);
  CHECK(userinfo.err.find("SECRETPW") == std::string::npos);
  CHECK(set({"openai", "--base-url", "ftp://example.com", "--key-file", dir.sub("key")}).rc == 2);
  CHECK(set({"openai", "--base-url", "https://example.com?x=1", "--key-file", dir.sub("key")}).rc == 2);
  CHECK(set({"azure", "--base-url", "https://example.com", "--key-file", dir.sub("key")}).rc == 2);
  Run missing = set({"openai", "--base-url", "https://example.com", "--key-file", dir.sub("missing")});
  CHECK(missing.rc != 0);
  CHECK(missing.err.find(dir.sub("missing")) != std::string::npos);
  Run empty = set({"openai", "--base-url", "https://example.com", "--key-file", dir.sub("empty")});
  CHECK(empty.rc == 2);
  CHECK(empty.err.find("empty") != std::string::npos);
  CHECK(set({"openai", "--base-url", "https://example.com", "--key-file", dir.sub("big")}).rc == 2);
  CHECK(set({"openai", "--base-url", "https://example.com"}).rc == 2);
  CHECK(set({"openai", "--key-file", dir.sub("key")}).rc == 2);
  CHECK(set({"openai", "--base-url", "https://example.com", "--key-file", dir.sub("key"), "--tenant", "nobody"}).rc ==
        1);
  // Nothing was stored by any of them.
  auto store = storage::Store::open(dir.sub("sandgate.db"));
  REQUIRE(store.ok());
  CHECK((*store)->list_upstreams()->empty());
}

TEST_CASE("llm usage prints a tenant's totals, optionally for one sandbox") {
  test::TempDir dir;
  REQUIRE(cli(dir, {"tenant", "create", "acme"}).rc == 0);
  REQUIRE(cli(dir, {"tenant", "create", "other"}).rc == 0);
  {
    auto store = storage::Store::open(dir.sub("sandgate.db"));
    REQUIRE(store.ok());
    std::string a = (*(*store)->find_tenant_by_name("acme"))->id;
    std::string o = (*(*store)->find_tenant_by_name("other"))->id;
    auto row = [](const std::string& t, std::optional<std::string> sb, uint64_t in) {
      storage::LlmUsageRow r;
      r.tenant_id = t;
      r.sandbox_id = std::move(sb);
      r.provider = "openai";
      r.route = "/v1/chat/completions";
      r.model = "m";
      r.outcome = "completed";
      r.input_tokens = in;
      r.output_tokens = 2 * in;
      r.cache_read_tokens = 1;
      r.cache_write_tokens = 0;
      return r;
    };
    REQUIRE((*store)->insert_llm_usage({row(a, "sb1", 10), row(a, std::nullopt, 5), row(o, "sb1", 1000)}).ok());
  }
  const std::string header = "REQUESTS\tINPUT_TOKENS\tOUTPUT_TOKENS\tCACHE_READ_TOKENS\tCACHE_WRITE_TOKENS\n";
  Run all = cli(dir, {"llm", "usage", "acme"});
  REQUIRE(all.rc == 0);
  CHECK(all.out == header + "2\t15\t30\t2\t0\n");
  Run sb = cli(dir, {"llm", "usage", "acme", "--sandbox", "sb1"});
  REQUIRE(sb.rc == 0);
  CHECK(sb.out == header + "1\t10\t20\t1\t0\n");
  CHECK(cli(dir, {"llm", "usage", "nobody"}).rc == 1);
}

TEST_CASE("serve options: bad model-proxy values exit 2 before anything starts") {
  test::TempDir dir;
  Run url = cli(dir, {"serve", "--openai-base-url", "https://k:SECRETPW@api.openai.com"});
  CHECK(url.rc == 2);
  CHECK(url.err.find("--openai-base-url") != std::string::npos);
  CHECK(url.err.find("SECRETPW") == std::string::npos);
  CHECK(cli(dir, {"serve", "--anthropic-base-url", "api.anthropic.com"}).rc == 2);
  CHECK(cli(dir, {"serve", "--llm-grace-ms", "10001"}).rc == 2);
  CHECK(cli(dir, {"serve", "--llm-cooldown-ms", "-1"}).rc == 2);
  CHECK(cli(dir, {"serve", "--llm-cooldown-ms", "600001"}).rc == 2);
  CHECK(cli(dir, {"serve", "--llm-body-limit", "10"}).rc == 2);
  CHECK(cli(dir, {"serve", "--llm-rate", "x"}).rc == 2);
  CHECK(cli(dir, {"serve", "--llm-tokens-per-min", "-5"}).rc == 2);
  Run off = cli(dir, {"serve", "--memory-offload", "sometimes"});
  CHECK(off.rc == 2);
  CHECK(off.err.find("--memory-offload wants auto, always or off") != std::string::npos);
  Run swap = cli(dir, {"serve", "--process-swap", "disk"});
  CHECK(swap.rc == 2);
  CHECK(swap.err.find("--process-swap wants zram, host or off") != std::string::npos);
  CHECK(cli(dir, {"serve", "--zram-mb", "8"}).rc == 2);
  CHECK(cli(dir, {"serve", "--zram-mb", "x"}).rc == 2);
  Run idle = cli(dir, {"serve", "--idle-offload-ms", "-1"});
  CHECK(idle.rc == 2);
  CHECK(idle.err.find("--idle-offload-ms") != std::string::npos);
  CHECK(cli(dir, {"serve", "--idle-offload-ms", "soon"}).rc == 2);
  Run disk = cli(dir, {"serve", "--disk-limit", "maybe"});
  CHECK(disk.rc == 2);
  CHECK(disk.err.find("--disk-limit wants auto, on or off") != std::string::npos);
  Run userns = cli(dir, {"serve", "--user-namespaces", "yes"});
  CHECK(userns.rc == 2);
  CHECK(userns.err.find("--user-namespaces wants auto, on or off") != std::string::npos);
  Run jail = cli(dir, {"serve", "--vmm-jail", "1"});
  CHECK(jail.rc == 2);
  CHECK(jail.err.find("--vmm-jail wants auto, on or off") != std::string::npos);
  Run priv = cli(dir, {"serve", "--network", "off", "--egress-allow-private"});
  CHECK(priv.rc == 2);
  CHECK(priv.err.find("--egress-allow-private needs a way out") != std::string::npos);
  Run net = cli(dir, {"serve", "--network", "bridge"});
  CHECK(net.rc == 2);
  CHECK(net.err.find("--network wants veth, proxy, auto or off") != std::string::npos);
  Run both = cli(dir, {"serve", "--egress", "--network", "veth"});
  CHECK(both.rc == 2);
  CHECK(both.err.find("--egress and --network veth disagree") != std::string::npos);
  Run range = cli(dir, {"serve", "--network", "veth", "--network-range", "10.1.2.3/16"});
  CHECK(range.rc == 2);
  CHECK(range.err.find("--network-range wants an IPv4 network") != std::string::npos);
  CHECK(cli(dir, {"serve", "--network", "proxy", "--network-range", "10.1.0.0/16"}).rc == 2);
  CHECK(cli(dir, {"serve", "--sandbox-uid-base", "0"}).rc == 2);
  CHECK(cli(dir, {"serve", "--sandbox-disk-mb", "15"}).rc == 2);
  CHECK(cli(dir, {"serve", "--sandbox-uid-base", "4294967295"}).rc == 2);
  CHECK(cli(dir, {"serve", "--offload-min-wait-ms", "-1"}).rc == 2);
  CHECK(cli(dir, {"serve", "--memory-pool-mb", "x"}).rc == 2);
  CHECK(cli(dir, {"serve", "--offload-concurrency", "0"}).rc == 2);
  CHECK(cli(dir, {"serve", "--offload-concurrency", "65"}).rc == 2);
  // --no-llm-pause and --no-local-tenant take no value: "version" after them
  // stays the command instead of being swallowed as their value.
  CHECK(cli(dir, {"version", "--no-llm-pause"}).rc == 0);
  CHECK(cli(dir, {"version", "--no-local-tenant"}).rc == 0);
  CHECK(cli(dir, {"version", "--no-llm-pause=false"}).rc == 0);
  CHECK(cli(dir, {"version", "--no-such-option", "1"}).rc == 2);
}
