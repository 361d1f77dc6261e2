// A SQLite store in a test's temp dir with the public "base" template
// registered and ready (id "tpl-base"; its rootfs path is never read by a
// FakeRuntime), for tests of the lifecycle core and what stands on it.
#pragma once

#include <doctest/doctest.h>

#include <memory>

#include "storage/store.h"
#include "tests/support/temp_dir.h"

namespace sg::test {

inline std::unique_ptr<storage::Store> open_store_with_base(const TempDir& dir) {
  auto s = storage::Store::open(dir.sub("sandgate.db"));
  REQUIRE_MESSAGE(s, (s ? "" : s.error().message()));
  storage::TemplateRow t;
  t.id = "tpl-base";
  t.name = "base";
  t.status = "ready";
  t.rootfs_path = dir.sub("rootfs");
  REQUIRE((*s)->upsert_template(t));
  return std::move(*s);
}

}  // namespace sg::test
