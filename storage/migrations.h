// Versioned schema migrations. docs/schema.md documents the resulting schema.
//
// Each migration runs once, in its own transaction, and bumps
// PRAGMA user_version to its number. A database whose user_version is newer
// than this binary knows is refused (never downgraded in place).
#pragma once

#include <string>
#include <vector>

#include "storage/db.h"

namespace sg::storage {

struct Migration {
  int version;
  const char* name;
  const char* sql;
};

// All migrations, in order; versions are 1..N without gaps.
const std::vector<Migration>& migrations();

// Applies the pending ones. Returns the resulting schema version.
Result<int> migrate(Db& db, const std::vector<Migration>& list = migrations());

Result<int> schema_version(Db& db);

}  // namespace sg::storage
