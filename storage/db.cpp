// SQLite wrapper implementation.
#include "storage/db.h"

#include <fcntl.h>
#include <cerrno>
#include <unistd.h>

#include <memory>

#include "base/sys.h"

namespace sg::storage {

Error sqlite_error(sqlite3* db, std::string_view what) {
  std::string m = "sqlite ";
  m += what;
  m += ": ";
  m += db ? sqlite3_errmsg(db) : "out of memory";
  // A full disk is the environment, not a bug: callers and clients see it
  // as unavailable (503, retry) rather than an internal error.
  if (db && (sqlite3_extended_errcode(db) & 0xff) == SQLITE_FULL)
    return Error(ErrorKind::kUnavailable,
                 "the server's data directory is full (database or disk is full): retry once space is freed");
  return internal_error(std::move(m));
}

Stmt& Stmt::operator=(Stmt&& o) noexcept {
  if (this != &o) {
    if (s_) sqlite3_finalize(s_);
    db_ = o.db_;
    s_ = o.s_;
    o.s_ = nullptr;
  }
  return *this;
}

Stmt::~Stmt() {
  if (s_) sqlite3_finalize(s_);
}

Stmt& Stmt::bind(int i, std::string_view v) {
  sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  return *this;
}
Stmt& Stmt::bind(int i, int64_t v) {
  sqlite3_bind_int64(s_, i, v);
  return *this;
}
Stmt& Stmt::bind(int i, std::nullopt_t) {
  sqlite3_bind_null(s_, i);
  return *this;
}

void Stmt::reset() {
  sqlite3_reset(s_);
  sqlite3_clear_bindings(s_);
}

Result<bool> Stmt::step() {
  int rc = sqlite3_step(s_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  return sqlite_error(db_, std::string("step `") + sqlite3_sql(s_) + "`");
}

Status Stmt::run() {
  for (;;) {
    Result<bool> r = step();
    if (!r) return r.error();
    if (!*r) return Status::Ok();
  }
}

std::string Stmt::text(int col) const {
  const unsigned char* p = sqlite3_column_text(s_, col);
  if (!p) return {};
  return std::string(reinterpret_cast<const char*>(p), static_cast<size_t>(sqlite3_column_bytes(s_, col)));
}
int64_t Stmt::int64(int col) const { return sqlite3_column_int64(s_, col); }
bool Stmt::is_null(int col) const { return sqlite3_column_type(s_, col) == SQLITE_NULL; }

Result<std::unique_ptr<Db>> Db::open(const std::string& path) {
  if (path != ":memory:" && path.rfind("file:", 0) != 0) {
    // Create the file ourselves so it is never world-readable, whatever the
    // umask; EEXIST leaves an existing file's mode alone.
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::close(fd);
    } else if (errno != EEXIST) {
      return sys::errno_error("create database", path);
    }
  }
  sqlite3* raw = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &raw,
                           SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    Error e = sqlite_error(raw, "open " + path);
    sqlite3_close(raw);
    return e;
  }
  std::unique_ptr<Db> db(new Db(raw, path));
  sqlite3_busy_timeout(raw, 5000);
  sqlite3_extended_result_codes(raw, 1);
  {
    Tx t(*db, false);
    if (Status s = t.exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON;"); !s)
      return s.error().with_context("open " + path);
  }
  return db;
}

Db::~Db() { sqlite3_close_v2(db_); }

Db::Tx::Tx(Db& db, bool begin) : db_(db), lock_(db.mu_) {
  if (begin) {
    begin_ = exec("BEGIN IMMEDIATE");
    in_tx_ = begin_.ok();
  }
}

Db::Tx::~Tx() {
  if (in_tx_) sqlite3_exec(db_.db_, "ROLLBACK", nullptr, nullptr, nullptr);
}

Result<Stmt> Db::Tx::prepare(std::string_view sql) {
  if (!begin_.ok()) return begin_.error();
  sqlite3_stmt* s = nullptr;
  int rc = sqlite3_prepare_v2(db_.db_, sql.data(), static_cast<int>(sql.size()), &s, nullptr);
  if (rc != SQLITE_OK) return sqlite_error(db_.db_, "prepare `" + std::string(sql) + "`");
  return Stmt(db_.db_, s);
}

Status Db::Tx::exec(std::string_view sql) {
  std::string q(sql);
  char* err = nullptr;
  int rc = sqlite3_exec(db_.db_, q.c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string m = "sqlite exec `" + q + "`: " + (err ? err : sqlite3_errmsg(db_.db_));
    sqlite3_free(err);
    return internal_error(std::move(m));
  }
  return Status::Ok();
}

Status Db::Tx::commit() {
  if (!in_tx_) return begin_.ok() ? internal_error("commit outside a transaction") : begin_;
  Status s = exec("COMMIT");
  if (s) in_tx_ = false;
  return s;
}

int64_t Db::Tx::changes() const { return sqlite3_changes64(db_.db_); }
int64_t Db::Tx::last_insert_rowid() const { return sqlite3_last_insert_rowid(db_.db_); }

}  // namespace sg::storage
