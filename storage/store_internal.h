// Helpers shared by the Store's implementation files (store.cpp,
// store_llm.cpp): statement macros and row mapping. Not part of the Store's
// interface; include only from storage/*.cpp.
#pragma once

#include <optional>
#include <vector>

#include "storage/db.h"
#include "storage/store.h"

#define SG_TRY_STMT(var, tx, sql)           \
  Result<Stmt> var##_r = (tx).prepare(sql); \
  if (!var##_r) return var##_r.error();     \
  Stmt& var = *var##_r

#define SG_TRY(expr)                                             \
  do {                                                           \
    if (Status sg_s_ = (expr); !sg_s_) return sg_s_.error();     \
  } while (0)

namespace sg::storage::internal {

// Points tag at build_id (a ready build of template_id); "default" moves
// the template's row to the build's files and configuration
// (store_builds.cpp).
Status set_tag(Db::Tx& tx, const std::string& template_id, const std::string& tag, const std::string& build_id,
               int64_t now);

inline constexpr const char* kTenantCols = "id, name, created_at, max_sandboxes, max_memory_mb, disabled";

// A tenant from kTenantCols starting at column o (joins select "t." + them).
inline TenantRow tenant_from(const Stmt& s, int o = 0) {
  TenantRow t;
  t.id = s.text(o + 0);
  t.name = s.text(o + 1);
  t.created_at = s.int64(o + 2);
  t.max_sandboxes = s.int64(o + 3);
  t.max_memory_mb = s.int64(o + 4);
  t.disabled = s.int64(o + 5) != 0;
  return t;
}

inline constexpr const char* kTemplateCols =
    "id, name, tenant_id, status, rootfs_path, cpu_count, memory_mb, disk_size_mb, created_at, updated_at, public, "
    "layers, config, build_id, origin_node, origin_revision";

inline TemplateRow template_from(const Stmt& s) {
  TemplateRow t;
  t.id = s.text(0);
  t.name = s.text(1);
  if (!s.is_null(2)) t.tenant_id = s.text(2);
  t.status = s.text(3);
  t.rootfs_path = s.text(4);
  t.cpu_count = s.int64(5);
  t.memory_mb = s.int64(6);
  t.disk_size_mb = s.int64(7);
  t.created_at = s.int64(8);
  t.updated_at = s.int64(9);
  t.is_public = s.int64(10) != 0 || !t.tenant_id;
  t.layers = s.text(11);
  t.config = s.text(12);
  if (!s.is_null(13)) t.build_id = s.text(13);
  if (!s.is_null(14)) t.origin_node = s.text(14);
  t.origin_revision = s.int64(15);
  return t;
}

template <typename T, typename F>
Result<std::vector<T>> collect(Stmt& st, F from) {
  std::vector<T> out;
  for (;;) {
    Result<bool> row = st.step();
    if (!row) return row.error();
    if (!*row) return out;
    out.push_back(from(st));
  }
}

// A change asked of a cluster node's copy of another node's template.
inline Error copy_error(const std::string& name, const std::string& origin) {
  return conflict_error("template '" + name + "' was built on cluster node " + origin +
                        " and is a copy here: change it through that node");
}

template <typename T, typename F>
Result<std::optional<T>> first(Stmt& st, F from) {
  Result<bool> row = st.step();
  if (!row) return row.error();
  if (!*row) return std::optional<T>();
  return std::optional<T>(from(st));
}

}  // namespace sg::storage::internal
