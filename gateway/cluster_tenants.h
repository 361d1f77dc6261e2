// Tenants and API keys in etcd (cluster mode, docs/cluster.md "Tenants").
//
// In a cluster, tenants and their keys are global: their records live in
// etcd (tenants/<name>, keys/<id>; a key as its SHA-256 only, as in
// SQLite) and every node mirrors them into its own SQLite (Cluster's
// watch), where authentication stays a local read. These functions are
// the writers: the admin CLI with --cluster, and a node making the
// "local" tenant. A tenant and its first key go in one transaction that
// fails if the name exists, so two writers never make two tenants of one
// name. Thread-safe (etcd::Client is).
#pragma once

#include <string>
#include <vector>

#include "storage/etcd.h"
#include "storage/store.h"
#include "tenancy/llm_keys.h"
#include "tenancy/tenants.h"

namespace sg::gateway::cluster_tenants {

std::string tenant_json(const storage::TenantRow& t);
Result<storage::TenantRow> parse_tenant(const std::string& json);
std::string key_json(const storage::ApiKeyRow& k);
Result<storage::ApiKeyRow> parse_key(const std::string& json);

// kConflict when the name is taken, kInvalid for a bad name or quota.
Result<tenancy::CreatedKey> create_tenant(etcd::Client& etcd, const std::string& prefix, const std::string& name,
                                          const tenancy::Quota& quota);
// kNotFound for no such tenant, kConflict for a revoked one.
Result<tenancy::CreatedKey> add_key(etcd::Client& etcd, const std::string& prefix, const std::string& name);
Result<storage::TenantRow> find(etcd::Client& etcd, const std::string& prefix, const std::string& name);
Result<std::vector<storage::TenantRow>> list(etcd::Client& etcd, const std::string& prefix);
Status set_quota(etcd::Client& etcd, const std::string& prefix, const std::string& name, const tenancy::Quota& quota);
// Disables the tenant and revokes its keys; returns how many keys.
Result<int64_t> revoke(etcd::Client& etcd, const std::string& prefix, const std::string& name);
Result<std::vector<storage::ApiKeyRow>> list_keys(etcd::Client& etcd, const std::string& prefix,
                                                  const std::string& name);
// False when no unrevoked key has that id.
Result<bool> revoke_key(etcd::Client& etcd, const std::string& prefix, const std::string& key_id);

// Model-proxy keys (sk-sg-..., tenancy/llm_keys.h) in etcd: llmkeys/<id>,
// the SHA-256 only; mirrored like API keys, so a sandbox's in-sandbox
// model proxy accepts its tenant's keys on whichever node it runs.
std::string llm_key_json(const storage::LlmKeyRow& k);
Result<storage::LlmKeyRow> parse_llm_key(const std::string& json);
Result<tenancy::CreatedLlmKey> create_llm_key(etcd::Client& etcd, const std::string& prefix, const std::string& tenant,
                                              const std::string& label);
Result<std::vector<storage::LlmKeyRow>> list_llm_keys(etcd::Client& etcd, const std::string& prefix,
                                                      const std::string& tenant);
Result<bool> revoke_llm_key(etcd::Client& etcd, const std::string& prefix, const std::string& key_id);

}  // namespace sg::gateway::cluster_tenants
