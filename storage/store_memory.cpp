// The Store's memory-offload table (migration 3, docs/memory-codecs.md):
// cohort dictionaries with reference counts. Every statement filters on the
// tenant, so one tenant can neither use nor release another's dictionary.
#include <string>

#include "storage/store.h"
#include "storage/store_internal.h"

namespace sg::storage {

namespace {

using internal::first;

constexpr const char* kCols = "id, tenant_id, cohort_key, dict_hex, level, created_at, refcount, saved_ppm";

std::string to_hex(const std::string& b) {
  static const char* kDigits = "0123456789abcdef";
  std::string h;
  h.resize(b.size() * 2);
  for (size_t i = 0; i < b.size(); ++i) {
    auto c = static_cast<unsigned char>(b[i]);
    h[2 * i] = kDigits[c >> 4];
    h[2 * i + 1] = kDigits[c & 15];
  }
  return h;
}

int nibble(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// A row whose hex does not decode comes back with empty bytes; the
// registry refuses an empty dictionary.
std::string from_hex(const std::string& h) {
  if (h.size() % 2 != 0) return {};
  std::string b(h.size() / 2, '\0');
  for (size_t i = 0; i < b.size(); ++i) {
    int hi = nibble(h[2 * i]), lo = nibble(h[2 * i + 1]);
    if (hi < 0 || lo < 0) return {};
    b[i] = static_cast<char>(hi << 4 | lo);
  }
  return b;
}

MemoryDictionaryRow dict_from(const Stmt& s) {
  MemoryDictionaryRow r;
  r.id = s.int64(0);
  r.tenant_id = s.text(1);
  r.cohort_key = s.text(2);
  r.bytes = from_hex(s.text(3));
  r.level = s.int64(4);
  r.created_at = s.int64(5);
  r.refcount = s.int64(6);
  r.saved_ppm = s.int64(7);
  return r;
}

}  // namespace

Result<int64_t> Store::insert_memory_dictionary(const MemoryDictionaryRow& row) {
  Db::Tx tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(st, tx,
              "INSERT INTO memory_dictionaries (tenant_id, cohort_key, dict_hex, level, created_at, refcount, "
              "saved_ppm) VALUES (?, ?, ?, ?, ?, ?, ?)");
  st.bind(1, row.tenant_id).bind(2, row.cohort_key).bind(3, to_hex(row.bytes)).bind(4, row.level);
  st.bind(5, row.created_at).bind(6, row.refcount).bind(7, row.saved_ppm);
  SG_TRY(st.run());
  int64_t id = tx.last_insert_rowid();
  SG_TRY(tx.commit());
  return id;
}

Result<std::optional<MemoryDictionaryRow>> Store::acquire_memory_dictionary(const std::string& tenant_id,
                                                                            const std::string& cohort_key) {
  Db::Tx tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(st, tx,
              std::string("SELECT ") + kCols +
                  " FROM memory_dictionaries WHERE tenant_id = ? AND cohort_key = ? ORDER BY id DESC LIMIT 1");
  st.bind(1, tenant_id).bind(2, cohort_key);
  Result<std::optional<MemoryDictionaryRow>> r = first<MemoryDictionaryRow>(st, dict_from);
  if (!r || !*r) return r;
  st.reset();
  SG_TRY_STMT(up, tx, "UPDATE memory_dictionaries SET refcount = refcount + 1 WHERE id = ? AND tenant_id = ?");
  up.bind(1, (*r)->id).bind(2, tenant_id);
  SG_TRY(up.run());
  SG_TRY(tx.commit());
  (*r)->refcount += 1;
  return r;
}

Result<std::optional<MemoryDictionaryRow>> Store::get_memory_dictionary(const std::string& tenant_id, int64_t id) {
  Db::Tx tx = db_->lock();
  SG_TRY_STMT(st, tx, std::string("SELECT ") + kCols + " FROM memory_dictionaries WHERE id = ? AND tenant_id = ?");
  st.bind(1, id).bind(2, tenant_id);
  return first<MemoryDictionaryRow>(st, dict_from);
}

Result<std::optional<int64_t>> Store::release_memory_dictionary(const std::string& tenant_id, int64_t id) {
  Db::Tx tx = db_->transaction();
  SG_TRY(tx.begin_status());
  SG_TRY_STMT(st, tx, "SELECT refcount FROM memory_dictionaries WHERE id = ? AND tenant_id = ?");
  st.bind(1, id).bind(2, tenant_id);
  Result<bool> row = st.step();
  if (!row) return row.error();
  if (!*row) return std::optional<int64_t>();
  int64_t left = st.int64(0) - 1;
  st.reset();
  if (left <= 0) {
    left = 0;
    SG_TRY_STMT(del, tx, "DELETE FROM memory_dictionaries WHERE id = ? AND tenant_id = ?");
    del.bind(1, id).bind(2, tenant_id);
    SG_TRY(del.run());
  } else {
    SG_TRY_STMT(up, tx, "UPDATE memory_dictionaries SET refcount = ? WHERE id = ? AND tenant_id = ?");
    up.bind(1, left).bind(2, id).bind(3, tenant_id);
    SG_TRY(up.run());
  }
  SG_TRY(tx.commit());
  return std::optional<int64_t>(left);
}

}  // namespace sg::storage
