// Implementation of the tenant and key records in etcd (cluster_tenants.h).
#include "gateway/cluster_tenants.h"

#include <nlohmann/json.hpp>

#include "base/sys.h"
#include "tenancy/api_key.h"
#include "tenancy/llm_keys.h"

namespace sg::gateway::cluster_tenants {

using nlohmann::json;

namespace {
std::string tenant_key(const std::string& prefix, const std::string& name) { return prefix + "tenants/" + name; }
std::string api_key_key(const std::string& prefix, const std::string& id) { return prefix + "keys/" + id; }

int64_t int_of(const json& j, const char* k) {
  auto it = j.find(k);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
}
std::string str_of(const json& j, const char* k) {
  auto it = j.find(k);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}
}  // namespace

std::string tenant_json(const storage::TenantRow& t) {
  return json{{"id", t.id},
              {"name", t.name},
              {"createdAt", t.created_at},
              {"maxSandboxes", t.max_sandboxes},
              {"maxMemoryMB", t.max_memory_mb},
              {"disabled", t.disabled}}
      .dump();
}

Result<storage::TenantRow> parse_tenant(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return invalid_error("malformed tenant record");
  storage::TenantRow t;
  t.id = str_of(j, "id");
  t.name = str_of(j, "name");
  if (t.id.empty() || !tenancy::valid_tenant_name(t.name)) return invalid_error("malformed tenant record");
  t.created_at = int_of(j, "createdAt");
  t.max_sandboxes = int_of(j, "maxSandboxes");
  t.max_memory_mb = int_of(j, "maxMemoryMB");
  t.disabled = j.value("disabled", false);
  return t;
}

std::string key_json(const storage::ApiKeyRow& k) {
  json j{{"id", k.id}, {"tenantId", k.tenant_id}, {"hash", k.key_hash}, {"prefix", k.key_prefix}, {"createdAt", k.created_at}};
  if (k.revoked_at) j["revokedAt"] = *k.revoked_at;
  return j.dump();
}

Result<storage::ApiKeyRow> parse_key(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return invalid_error("malformed key record");
  storage::ApiKeyRow k;
  k.id = str_of(j, "id");
  k.tenant_id = str_of(j, "tenantId");
  k.key_hash = str_of(j, "hash");
  k.key_prefix = str_of(j, "prefix");
  k.created_at = int_of(j, "createdAt");
  if (j.contains("revokedAt")) k.revoked_at = int_of(j, "revokedAt");
  if (k.id.empty() || k.tenant_id.empty() || k.key_hash.size() != 64) return invalid_error("malformed key record");
  return k;
}

Result<tenancy::CreatedKey> create_tenant(etcd::Client& etcd, const std::string& prefix, const std::string& name,
                                          const tenancy::Quota& quota) {
  Result<storage::TenantRow> t = tenancy::make_tenant_row(name, quota);
  if (!t) return t.error();
  tenancy::CreatedKey k = tenancy::make_key(t->id);
  std::string tk = tenant_key(prefix, name);
  Result<etcd::TxnResult> r = etcd.txn({etcd::Compare{tk, "VERSION", "EQUAL", 0, {}}},
                                       {etcd::Op::put(tk, tenant_json(*t)), etcd::Op::put(api_key_key(prefix, k.row.id), key_json(k.row))});
  if (!r) return r.error();
  if (!r->succeeded) return conflict_error("tenant '" + name + "' already exists in the cluster");
  return k;
}

Result<storage::TenantRow> find(etcd::Client& etcd, const std::string& prefix, const std::string& name) {
  Result<etcd::RangeResult> r = etcd.get(tenant_key(prefix, name));
  if (!r) return r.error();
  if (r->kvs.empty()) return not_found_error("no tenant '" + name + "' in the cluster");
  return parse_tenant(r->kvs[0].value);
}

Result<tenancy::CreatedKey> add_key(etcd::Client& etcd, const std::string& prefix, const std::string& name) {
  std::string tk = tenant_key(prefix, name);
  Result<etcd::RangeResult> cur = etcd.get(tk);
  if (!cur) return cur.error();
  if (cur->kvs.empty()) return not_found_error("no tenant '" + name + "' in the cluster");
  Result<storage::TenantRow> t = parse_tenant(cur->kvs[0].value);
  if (!t) return t.error();
  if (t->disabled) return conflict_error("tenant '" + name + "' is revoked");
  tenancy::CreatedKey k = tenancy::make_key(t->id);
  // Only while the tenant is as read (not revoked meanwhile).
  Result<etcd::TxnResult> r = etcd.txn({etcd::Compare{tk, "MOD", "EQUAL", cur->kvs[0].mod_revision, {}}},
                                       {etcd::Op::put(api_key_key(prefix, k.row.id), key_json(k.row))});
  if (!r) return r.error();
  if (!r->succeeded) return conflict_error("tenant '" + name + "' changed while adding a key; retry");
  return k;
}

Result<std::vector<storage::TenantRow>> list(etcd::Client& etcd, const std::string& prefix) {
  Result<etcd::RangeResult> r = etcd.get_prefix(prefix + "tenants/");
  if (!r) return r.error();
  std::vector<storage::TenantRow> out;
  for (const etcd::KeyValue& kv : r->kvs)
    if (Result<storage::TenantRow> t = parse_tenant(kv.value); t) out.push_back(*t);
  return out;
}

Status set_quota(etcd::Client& etcd, const std::string& prefix, const std::string& name, const tenancy::Quota& quota) {
  if (quota.max_sandboxes < 0 || quota.max_memory_mb < 0) return invalid_error("quota limits must be >= 0");
  Result<etcd::RangeResult> cur = etcd.get(tenant_key(prefix, name));
  if (!cur) return cur.error();
  if (cur->kvs.empty()) return not_found_error("no tenant '" + name + "' in the cluster");
  Result<storage::TenantRow> t = parse_tenant(cur->kvs[0].value);
  if (!t) return t.error();
  t->max_sandboxes = quota.max_sandboxes;
  t->max_memory_mb = quota.max_memory_mb;
  std::string tk = tenant_key(prefix, name);
  Result<etcd::TxnResult> r =
      etcd.txn({etcd::Compare{tk, "MOD", "EQUAL", cur->kvs[0].mod_revision, {}}}, {etcd::Op::put(tk, tenant_json(*t))});
  if (!r) return r.error();
  if (!r->succeeded) return conflict_error("tenant '" + name + "' changed meanwhile; retry");
  return Status();
}

Result<int64_t> revoke(etcd::Client& etcd, const std::string& prefix, const std::string& name) {
  Result<storage::TenantRow> t = find(etcd, prefix, name);
  if (!t) return t.error();
  // Disabled first: from then no key of it authenticates anywhere.
  t->disabled = true;
  if (Result<int64_t> p = etcd.put(tenant_key(prefix, name), tenant_json(*t)); !p) return p.error();
  Result<etcd::RangeResult> keys = etcd.get_prefix(prefix + "keys/");
  if (!keys) return keys.error();
  int64_t n = 0;
  for (const etcd::KeyValue& kv : keys->kvs) {
    Result<storage::ApiKeyRow> k = parse_key(kv.value);
    if (!k || k->tenant_id != t->id || k->revoked_at) continue;
    k->revoked_at = sys::unix_seconds();
    if (Result<int64_t> p = etcd.put(kv.key, key_json(*k)); !p) return p.error();
    ++n;
  }
  // Its model-proxy keys too, as on one host.
  Result<etcd::RangeResult> llm = etcd.get_prefix(prefix + "llmkeys/");
  if (!llm) return llm.error();
  for (const etcd::KeyValue& kv : llm->kvs) {
    Result<storage::LlmKeyRow> k = parse_llm_key(kv.value);
    if (!k || k->tenant_id != t->id || k->revoked_at) continue;
    k->revoked_at = sys::unix_seconds();
    if (Result<int64_t> p = etcd.put(kv.key, llm_key_json(*k)); !p) return p.error();
    ++n;
  }
  return n;
}

Result<std::vector<storage::ApiKeyRow>> list_keys(etcd::Client& etcd, const std::string& prefix,
                                                  const std::string& name) {
  Result<storage::TenantRow> t = find(etcd, prefix, name);
  if (!t) return t.error();
  Result<etcd::RangeResult> keys = etcd.get_prefix(prefix + "keys/");
  if (!keys) return keys.error();
  std::vector<storage::ApiKeyRow> out;
  for (const etcd::KeyValue& kv : keys->kvs)
    if (Result<storage::ApiKeyRow> k = parse_key(kv.value); k && k->tenant_id == t->id) out.push_back(*k);
  return out;
}

Result<bool> revoke_key(etcd::Client& etcd, const std::string& prefix, const std::string& key_id) {
  std::string kk = api_key_key(prefix, key_id);
  Result<etcd::RangeResult> cur = etcd.get(kk);
  if (!cur) return cur.error();
  if (cur->kvs.empty()) return false;
  Result<storage::ApiKeyRow> k = parse_key(cur->kvs[0].value);
  if (!k) return k.error();
  if (k->revoked_at) return false;
  k->revoked_at = sys::unix_seconds();
  if (Result<int64_t> p = etcd.put(kk, key_json(*k)); !p) return p.error();
  return true;
}

std::string llm_key_json(const storage::LlmKeyRow& k) {
  json j{{"id", k.id}, {"tenantId", k.tenant_id}, {"hash", k.key_hash}, {"prefix", k.key_prefix},
         {"name", k.name}, {"createdAt", k.created_at}};
  if (k.revoked_at) j["revokedAt"] = *k.revoked_at;
  return j.dump();
}

Result<storage::LlmKeyRow> parse_llm_key(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return invalid_error("malformed model-proxy key record");
  storage::LlmKeyRow k;
  k.id = str_of(j, "id");
  k.tenant_id = str_of(j, "tenantId");
  k.key_hash = str_of(j, "hash");
  k.key_prefix = str_of(j, "prefix");
  k.name = str_of(j, "name");
  k.created_at = int_of(j, "createdAt");
  if (j.contains("revokedAt")) k.revoked_at = int_of(j, "revokedAt");
  if (k.id.empty() || k.tenant_id.empty() || k.key_hash.size() != 64) return invalid_error("malformed model-proxy key record");
  return k;
}

Result<tenancy::CreatedLlmKey> create_llm_key(etcd::Client& etcd, const std::string& prefix, const std::string& tenant,
                                              const std::string& label) {
  std::string tk = tenant_key(prefix, tenant);
  Result<etcd::RangeResult> cur = etcd.get(tk);
  if (!cur) return cur.error();
  if (cur->kvs.empty()) return not_found_error("no tenant '" + tenant + "' in the cluster");
  Result<storage::TenantRow> t = parse_tenant(cur->kvs[0].value);
  if (!t) return t.error();
  if (t->disabled) return conflict_error("tenant '" + tenant + "' is revoked");
  Result<tenancy::CreatedLlmKey> k = tenancy::make_llm_key(t->id, label);
  if (!k) return k.error();
  Result<etcd::TxnResult> r = etcd.txn({etcd::Compare{tk, "MOD", "EQUAL", cur->kvs[0].mod_revision, {}}},
                                       {etcd::Op::put(prefix + "llmkeys/" + k->row.id, llm_key_json(k->row))});
  if (!r) return r.error();
  if (!r->succeeded) return conflict_error("tenant '" + tenant + "' changed while adding a key; retry");
  return k;
}

Result<std::vector<storage::LlmKeyRow>> list_llm_keys(etcd::Client& etcd, const std::string& prefix,
                                                      const std::string& tenant) {
  Result<storage::TenantRow> t = find(etcd, prefix, tenant);
  if (!t) return t.error();
  Result<etcd::RangeResult> keys = etcd.get_prefix(prefix + "llmkeys/");
  if (!keys) return keys.error();
  std::vector<storage::LlmKeyRow> out;
  for (const etcd::KeyValue& kv : keys->kvs)
    if (Result<storage::LlmKeyRow> k = parse_llm_key(kv.value); k && k->tenant_id == t->id) out.push_back(*k);
  return out;
}

Result<bool> revoke_llm_key(etcd::Client& etcd, const std::string& prefix, const std::string& key_id) {
  std::string kk = prefix + "llmkeys/" + key_id;
  Result<etcd::RangeResult> cur = etcd.get(kk);
  if (!cur) return cur.error();
  if (cur->kvs.empty()) return false;
  Result<storage::LlmKeyRow> k = parse_llm_key(cur->kvs[0].value);
  if (!k) return k.error();
  if (k->revoked_at) return false;
  k->revoked_at = sys::unix_seconds();
  if (Result<int64_t> p = etcd.put(kk, llm_key_json(*k)); !p) return p.error();
  return true;
}

}  // namespace sg::gateway::cluster_tenants
