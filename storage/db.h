// Db: one SQLite connection in WAL mode, behind RAII statements.
//
// Thread safety: a Db serialises all use of its connection with a mutex, so
// it may be shared by the worker threads; it must never be used on an io
// thread (SQLite may block on fsync or on another writer). Errors come back
// as Status/Result with the SQL error text and the statement's purpose.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"

namespace sg::storage {

class Db;

// A prepared statement. Move-only; finalised on destruction. Bind indexes
// start at 1 as in SQLite. Valid only while the Db lock is held (see Db::Tx).
class Stmt {
 public:
  Stmt() = default;
  Stmt(sqlite3* db, sqlite3_stmt* s) : db_(db), s_(s) {}
  Stmt(Stmt&& o) noexcept : db_(o.db_), s_(o.s_) { o.s_ = nullptr; }
  Stmt& operator=(Stmt&& o) noexcept;
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  ~Stmt();

  Stmt& bind(int i, std::string_view v);
  Stmt& bind(int i, int64_t v);
  Stmt& bind(int i, int v) { return bind(i, static_cast<int64_t>(v)); }
  Stmt& bind(int i, uint64_t v) { return bind(i, static_cast<int64_t>(v)); }
  Stmt& bind(int i, uint32_t v) { return bind(i, static_cast<int64_t>(v)); }
  Stmt& bind(int i, const char* v) { return bind(i, std::string_view(v)); }
  Stmt& bind(int i, const std::string& v) { return bind(i, std::string_view(v)); }
  Stmt& bind(int i, std::nullopt_t);
  template <typename T>
  Stmt& bind(int i, const std::optional<T>& v) {
    return v ? bind(i, *v) : bind(i, std::nullopt);
  }

  // Steps once: true when a row is available, false when done.
  Result<bool> step();
  // Steps to completion, for statements without rows.
  Status run();
  // Rewinds the statement and clears its bindings, to run it again with new
  // values (batched inserts prepare once).
  void reset();

  std::string text(int col) const;
  int64_t int64(int col) const;
  bool is_null(int col) const;

 private:
  sqlite3* db_ = nullptr;
  sqlite3_stmt* s_ = nullptr;
};

class Db {
 public:
  // Opens (creating if needed) the database file, sets WAL, a busy timeout,
  // foreign keys and synchronous=NORMAL. ":memory:" works for tests. A new
  // file is created with mode 0600 (it holds provider keys, docs/schema.md);
  // SQLite gives the -wal and -shm files the same mode.
  static Result<std::unique_ptr<Db>> open(const std::string& path);
  ~Db();
  Db(const Db&) = delete;
  Db& operator=(const Db&) = delete;

  // A locked scope on the connection. Statements are prepared through it.
  // With begin=true it is also a transaction (BEGIN IMMEDIATE), rolled back
  // on destruction unless commit() succeeded.
  class Tx {
   public:
    Tx(Db& db, bool begin);
    ~Tx();
    Tx(const Tx&) = delete;
    Tx& operator=(const Tx&) = delete;
    Status begin_status() const { return begin_; }
    Result<Stmt> prepare(std::string_view sql);
    Status exec(std::string_view sql);  // one or more statements, no rows
    Status commit();
    int64_t changes() const;
    int64_t last_insert_rowid() const;

   private:
    Db& db_;
    std::unique_lock<std::mutex> lock_;
    bool in_tx_ = false;
    Status begin_;
  };

  Tx lock() { return Tx(*this, false); }
  Tx transaction() { return Tx(*this, true); }

  const std::string& path() const { return path_; }

 private:
  Db(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}
  sqlite3* db_;
  std::string path_;
  std::mutex mu_;  // guards db_ and every statement prepared on it
};

Error sqlite_error(sqlite3* db, std::string_view what);

}  // namespace sg::storage
