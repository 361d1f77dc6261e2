// Implementation of the tenant and key records in etcd (cluster_tenants.h).
// API keys and model-proxy keys are one kind of record (the same fields;
// a model-proxy key adds its name), so their encoding, listing and
// revocation are written once, over KeyKind.
#include "gateway/cluster_tenants.h"

#include <functional>

#include <nlohmann/json.hpp>

#include "base/sys.h"
#include "tenancy/api_key.h"
#include "tenancy/llm_keys.h"

namespace sg::gateway::cluster_tenants {

using nlohmann::json;

namespace {
std::string tenant_key(const std::string& prefix, const std::string& name) { return prefix + "tenants/" + name; }

int64_t int_of(const json& j, const char* k) {
  auto it = j.find(k);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
}
std::string str_of(const json& j, const char* k) {
  auto it = j.find(k);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// Where each kind of key lives, and what its errors call it.
template <class Row>
struct KeyKind;
template <>
struct KeyKind<storage::ApiKeyRow> {
  static constexpr const char* dir = "keys/";
  static constexpr const char* what = "key";
};
template <>
struct KeyKind<storage::LlmKeyRow> {
  static constexpr const char* dir = "llmkeys/";
  static constexpr const char* what = "model-proxy key";
};

template <class Row>
std::string key_path(const std::string& prefix, const std::string& id) {
  return prefix + KeyKind<Row>::dir + id;
}

// The fields every key record has.
template <class Row>
json key_record(const Row& k) {
  json j{{"id", k.id}, {"tenantId", k.tenant_id}, {"hash", k.key_hash}, {"prefix", k.key_prefix}, {"createdAt", k.created_at}};
  if (k.revoked_at) j["revokedAt"] = *k.revoked_at;
  return j;
}

std::string to_json(const storage::ApiKeyRow& k) { return key_record(k).dump(); }
std::string to_json(const storage::LlmKeyRow& k) {
  json j = key_record(k);
  j["name"] = k.name;
  return j.dump();
}

template <class Row>
Result<Row> read_key_record(const std::string& text, json* rest = nullptr) {
  json j = json::parse(text, nullptr, false);
  std::string malformed = std::string("malformed ") + KeyKind<Row>::what + " record";
  if (!j.is_object()) return invalid_error(malformed);
  Row k;
  k.id = str_of(j, "id");
  k.tenant_id = str_of(j, "tenantId");
  k.key_hash = str_of(j, "hash");
  k.key_prefix = str_of(j, "prefix");
  k.created_at = int_of(j, "createdAt");
  if (j.contains("revokedAt")) k.revoked_at = int_of(j, "revokedAt");
  if (k.id.empty() || k.tenant_id.empty() || k.key_hash.size() != 64) return invalid_error(malformed);
  if (rest) *rest = std::move(j);
  return k;
}

// A tenant as it is in etcd now, with the revision a change must compare.
struct Current {
  storage::TenantRow tenant;
  int64_t mod_revision = 0;
};

Result<Current> current(etcd::Client& etcd, const std::string& prefix, const std::string& name) {
  Result<etcd::RangeResult> r = etcd.get(tenant_key(prefix, name));
  if (!r) return r.error();
  if (r->kvs.empty()) return not_found_error("no tenant '" + name + "' in the cluster");
  Result<storage::TenantRow> t = parse_tenant(r->kvs[0].value);
  if (!t) return t.error();
  return Current{std::move(*t), r->kvs[0].mod_revision};
}

// Puts a new key of a tenant that is not revoked, only while the tenant
// is as read (not revoked meanwhile).
template <class Created>
Result<Created> put_new_key(etcd::Client& etcd, const std::string& prefix, const std::string& name,
                            const std::function<Result<Created>(const std::string& tenant_id)>& make) {
  Result<Current> cur = current(etcd, prefix, name);
  if (!cur) return cur.error();
  if (cur->tenant.disabled) return conflict_error("tenant '" + name + "' is revoked");
  Result<Created> k = make(cur->tenant.id);
  if (!k) return k.error();
  using Row = decltype(k->row);
  std::string tk = tenant_key(prefix, name);
  Result<etcd::TxnResult> r = etcd.txn({etcd::Compare{tk, "MOD", "EQUAL", cur->mod_revision, {}}},
                                       {etcd::Op::put(key_path<Row>(prefix, k->row.id), to_json(k->row))});
  if (!r) return r.error();
  if (!r->succeeded) return conflict_error("tenant '" + name + "' changed while adding a key; retry");
  return k;
}

template <class Row>
Result<Row> parse_any(const std::string& text);
template <>
Result<storage::ApiKeyRow> parse_any(const std::string& text) {
  return parse_key(text);
}
template <>
Result<storage::LlmKeyRow> parse_any(const std::string& text) {
  return parse_llm_key(text);
}

template <class Row>
Result<std::vector<Row>> keys_of(etcd::Client& etcd, const std::string& prefix, const std::string& name) {
  Result<storage::TenantRow> t = find(etcd, prefix, name);
  if (!t) return t.error();
  Result<etcd::RangeResult> keys = etcd.get_prefix(prefix + KeyKind<Row>::dir);
  if (!keys) return keys.error();
  std::vector<Row> out;
  for (const etcd::KeyValue& kv : keys->kvs)
    if (Result<Row> k = parse_any<Row>(kv.value); k && k->tenant_id == t->id) out.push_back(*k);
  return out;
}

template <class Row>
Result<bool> revoke_one(etcd::Client& etcd, const std::string& prefix, const std::string& key_id) {
  std::string kk = key_path<Row>(prefix, key_id);
  Result<etcd::RangeResult> cur = etcd.get(kk);
  if (!cur) return cur.error();
  if (cur->kvs.empty()) return false;
  Result<Row> k = parse_any<Row>(cur->kvs[0].value);
  if (!k) return k.error();
  if (k->revoked_at) return false;
  k->revoked_at = sys::unix_seconds();
  if (Result<int64_t> p = etcd.put(kk, to_json(*k)); !p) return p.error();
  return true;
}

// Revokes every unrevoked key of a tenant id; returns how many.
template <class Row>
Result<int64_t> revoke_all(etcd::Client& etcd, const std::string& prefix, const std::string& tenant_id) {
  Result<etcd::RangeResult> keys = etcd.get_prefix(prefix + KeyKind<Row>::dir);
  if (!keys) return keys.error();
  int64_t n = 0;
  for (const etcd::KeyValue& kv : keys->kvs) {
    Result<Row> k = parse_any<Row>(kv.value);
    if (!k || k->tenant_id != tenant_id || k->revoked_at) continue;
    k->revoked_at = sys::unix_seconds();
    if (Result<int64_t> p = etcd.put(kv.key, to_json(*k)); !p) return p.error();
    ++n;
  }
  return n;
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

std::string key_json(const storage::ApiKeyRow& k) { return to_json(k); }

Result<storage::ApiKeyRow> parse_key(const std::string& text) { return read_key_record<storage::ApiKeyRow>(text); }

std::string llm_key_json(const storage::LlmKeyRow& k) { return to_json(k); }

Result<storage::LlmKeyRow> parse_llm_key(const std::string& text) {
  json j;
  Result<storage::LlmKeyRow> k = read_key_record<storage::LlmKeyRow>(text, &j);
  if (k) k->name = str_of(j, "name");
  return k;
}

Result<tenancy::CreatedKey> create_tenant(etcd::Client& etcd, const std::string& prefix, const std::string& name,
                                          const tenancy::Quota& quota) {
  Result<storage::TenantRow> t = tenancy::make_tenant_row(name, quota);
  if (!t) return t.error();
  tenancy::CreatedKey k = tenancy::make_key(t->id);
  std::string tk = tenant_key(prefix, name);
  Result<etcd::TxnResult> r =
      etcd.txn({etcd::Compare{tk, "VERSION", "EQUAL", 0, {}}},
               {etcd::Op::put(tk, tenant_json(*t)), etcd::Op::put(key_path<storage::ApiKeyRow>(prefix, k.row.id), key_json(k.row))});
  if (!r) return r.error();
  if (!r->succeeded) return conflict_error("tenant '" + name + "' already exists in the cluster");
  return k;
}

Result<storage::TenantRow> find(etcd::Client& etcd, const std::string& prefix, const std::string& name) {
  Result<Current> cur = current(etcd, prefix, name);
  if (!cur) return cur.error();
  return std::move(cur->tenant);
}

Result<tenancy::CreatedKey> add_key(etcd::Client& etcd, const std::string& prefix, const std::string& name) {
  return put_new_key<tenancy::CreatedKey>(etcd, prefix, name, [](const std::string& tenant_id) -> Result<tenancy::CreatedKey> {
    return tenancy::make_key(tenant_id);
  });
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
  Result<Current> cur = current(etcd, prefix, name);
  if (!cur) return cur.error();
  cur->tenant.max_sandboxes = quota.max_sandboxes;
  cur->tenant.max_memory_mb = quota.max_memory_mb;
  std::string tk = tenant_key(prefix, name);
  Result<etcd::TxnResult> r = etcd.txn({etcd::Compare{tk, "MOD", "EQUAL", cur->mod_revision, {}}},
                                       {etcd::Op::put(tk, tenant_json(cur->tenant))});
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
  Result<int64_t> keys = revoke_all<storage::ApiKeyRow>(etcd, prefix, t->id);
  if (!keys) return keys.error();
  // Its model-proxy keys too, as on one host.
  Result<int64_t> llm = revoke_all<storage::LlmKeyRow>(etcd, prefix, t->id);
  if (!llm) return llm.error();
  return *keys + *llm;
}

Result<std::vector<storage::ApiKeyRow>> list_keys(etcd::Client& etcd, const std::string& prefix,
                                                  const std::string& name) {
  return keys_of<storage::ApiKeyRow>(etcd, prefix, name);
}

Result<bool> revoke_key(etcd::Client& etcd, const std::string& prefix, const std::string& key_id) {
  return revoke_one<storage::ApiKeyRow>(etcd, prefix, key_id);
}

Result<tenancy::CreatedLlmKey> create_llm_key(etcd::Client& etcd, const std::string& prefix, const std::string& tenant,
                                              const std::string& label) {
  return put_new_key<tenancy::CreatedLlmKey>(
      etcd, prefix, tenant, [&](const std::string& tenant_id) { return tenancy::make_llm_key(tenant_id, label); });
}

Result<std::vector<storage::LlmKeyRow>> list_llm_keys(etcd::Client& etcd, const std::string& prefix,
                                                      const std::string& tenant) {
  return keys_of<storage::LlmKeyRow>(etcd, prefix, tenant);
}

Result<bool> revoke_llm_key(etcd::Client& etcd, const std::string& prefix, const std::string& key_id) {
  return revoke_one<storage::LlmKeyRow>(etcd, prefix, key_id);
}

}  // namespace sg::gateway::cluster_tenants
