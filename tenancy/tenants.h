// Tenants: creation with a first key, authentication, key management.
//
// Tenants is a thin service over storage::Store; every method blocks on
// SQLite and runs on worker threads. Thread-safe (the Store serialises).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "storage/store.h"

namespace sg::tenancy {

struct Quota {
  int64_t max_sandboxes = 20;
  int64_t max_memory_mb = 16384;
};

struct CreatedKey {
  storage::ApiKeyRow row;
  std::string key;  // the secret, returned once
};

class Tenants {
 public:
  explicit Tenants(storage::Store& store) : store_(store) {}

  // Creates a tenant and its first API key. kConflict when the name is taken,
  // kInvalid for a bad name ([A-Za-z0-9_.-]{1,64}).
  Result<CreatedKey> create(const std::string& name, const Quota& quota);
  Result<CreatedKey> add_key(const std::string& tenant_name);
  // The tenant for a presented key; kUnauthorized when missing, malformed,
  // unknown or revoked (one message for all, so keys cannot be probed).
  Result<storage::TenantRow> authenticate(std::string_view presented_key);
  Result<storage::TenantRow> by_name(const std::string& name);

 private:
  storage::Store& store_;
};

bool valid_tenant_name(std::string_view name);

// A new tenant's row (fresh id, now), not stored; kInvalid for a bad name
// or negative limits. Shared with the cluster's tenants in etcd.
Result<storage::TenantRow> make_tenant_row(const std::string& name, const Quota& quota);
// A fresh key for a tenant and its row (hash only), not stored.
CreatedKey make_key(const std::string& tenant_id);

}  // namespace sg::tenancy
