// Tenant service implementation.
#include "tenancy/tenants.h"

#include "base/sys.h"
#include "tenancy/api_key.h"

namespace sg::tenancy {

bool valid_tenant_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
          c == '.'))
      return false;
  return true;
}

Result<storage::TenantRow> make_tenant_row(const std::string& name, const Quota& quota) {
  if (!valid_tenant_name(name))
    return invalid_error("invalid tenant name '" + name + "': use 1-64 characters of A-Z a-z 0-9 _ . -");
  if (quota.max_sandboxes < 0 || quota.max_memory_mb < 0) return invalid_error("quota limits must be >= 0");
  storage::TenantRow t;
  t.id = "tn_" + sys::random_hex(8);
  t.name = name;
  t.created_at = sys::unix_seconds();
  t.max_sandboxes = quota.max_sandboxes;
  t.max_memory_mb = quota.max_memory_mb;
  return t;
}

CreatedKey make_key(const std::string& tenant_id) {
  CreatedKey k;
  k.key = generate_api_key();
  k.row.id = "key_" + sys::random_hex(8);
  k.row.tenant_id = tenant_id;
  k.row.key_hash = hash_api_key(k.key);
  k.row.key_prefix = key_display_prefix(k.key);
  k.row.created_at = sys::unix_seconds();
  return k;
}

static Result<CreatedKey> new_key(storage::Store& store, const std::string& tenant_id) {
  CreatedKey k = make_key(tenant_id);
  if (Status s = store.insert_key(k.row); !s) return s.error();
  return k;
}

Result<CreatedKey> Tenants::create(const std::string& name, const Quota& quota) {
  Result<storage::TenantRow> t = make_tenant_row(name, quota);
  if (!t) return t.error();
  Result<std::optional<storage::TenantRow>> existing = store_.find_tenant_by_name(name);
  if (!existing) return existing.error();
  if (*existing) return conflict_error("tenant '" + name + "' already exists");
  if (Status s = store_.insert_tenant(*t); !s) return s.error();
  return new_key(store_, t->id);
}

Result<CreatedKey> Tenants::add_key(const std::string& tenant_name) {
  Result<storage::TenantRow> t = by_name(tenant_name);
  if (!t) return t.error();
  if (t->disabled) return conflict_error("tenant '" + tenant_name + "' is revoked");
  return new_key(store_, t->id);
}

Result<storage::TenantRow> Tenants::authenticate(std::string_view presented_key) {
  const Error unauthorized(ErrorKind::kUnauthorized, "Invalid API key, please visit the dashboard to get a new one or check the X-API-KEY header");
  if (!is_well_formed_api_key(presented_key)) return unauthorized;
  Result<std::optional<storage::TenantRow>> t = store_.tenant_for_key_hash(hash_api_key(presented_key));
  if (!t) return t.error();
  if (!*t) return unauthorized;
  return **t;
}

Result<storage::TenantRow> Tenants::by_name(const std::string& name) {
  Result<std::optional<storage::TenantRow>> t = store_.find_tenant_by_name(name);
  if (!t) return t.error();
  if (!*t) return not_found_error("tenant '" + name + "' not found");
  return **t;
}

}  // namespace sg::tenancy
