// The compressed-page pool (pool.h; format in docs/memory-pool.md).
#include "wait-engine/memory/pool.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <map>

#include "base/log.h"
#include "base/sys.h"

namespace sg::memory {

namespace {

// What one malloc'd block costs beyond its bytes (glibc: 8-byte size word,
// 16-byte granularity; 16 is the usual average).
constexpr uint64_t kMallocOverhead = 16;
// Memory-tier records are written to disk at most this many bytes per
// write SQE and spilled at most this many records per batch.
constexpr size_t kMaxWriteChunk = 256 << 10;
constexpr size_t kSpillBatch = 512;

std::string hex_encode(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

bool hex_decode(std::string_view s, std::string* out) {
  if (s.size() % 2) return false;
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < s.size(); i += 2) {
    int a = nib(s[i]), b = nib(s[i + 1]);
    if (a < 0 || b < 0) return false;
    out->push_back(static_cast<char>(a << 4 | b));
  }
  return true;
}

std::string file_header() {
  std::string h(kPoolFileMagic, sizeof kPoolFileMagic);
  for (int i = 0; i < 4; ++i) h.push_back(static_cast<char>(kPoolFileVersion >> (8 * i)));
  uint32_t crc = crc32c(h);
  for (int i = 0; i < 4; ++i) h.push_back(static_cast<char>(crc >> (8 * i)));
  return h;
}

}  // namespace

std::string pool_file_name(const std::string& sandbox) { return hex_encode(sandbox) + ".pool"; }

// One read or write of a batch. done counts bytes moved; err is an errno.
struct IoOp {
  bool write = false;
  int fd = -1;
  uint64_t offset = 0;
  char* buf = nullptr;
  uint32_t len = 0;
  uint32_t done = 0;
  int err = 0;
  bool eof = false;
  bool finished() const { return done == len || err != 0 || eof; }
};

// The file tier's I/O: an io_uring, or pread/pwrite where none could be
// set up. Both run a batch of ops to completion (short transfers resumed,
// EINTR/EAGAIN retried); each op reports its own outcome.
class Pool::FileIo {
 public:
  explicit FileIo(const PoolConfig& c) : inject_(c.inject_io_error) {
    if (!c.use_io_uring) {
      LOG_INFO("memory pool " << c.dir << ": io_uring disabled by configuration, using pread/pwrite");
      return;
    }
    int rc = io_uring_queue_init(c.ring_entries, &ring_, 0);
    if (rc < 0) {
      LOG_WARN("memory pool " << c.dir << ": io_uring_queue_init: " << std::strerror(-rc)
                              << "; the file tier falls back to pread/pwrite");
      return;
    }
    entries_ = c.ring_entries;
    uring_ = true;
  }
  ~FileIo() {
    if (uring_) io_uring_queue_exit(&ring_);
  }
  bool uring() const { return uring_; }

  void run(std::vector<IoOp>& ops) {
    if (inject_)
      for (auto& op : ops)
        if (int e = inject_(op.write, op.offset, op.len)) op.err = e;
    if (uring_) {
      run_uring(ops);
    } else {
      for (auto& op : ops) run_sync(op);
    }
  }

 private:
  static void account(IoOp& op, int64_t res) {
    if (res > 0) {
      op.done += static_cast<uint32_t>(res);
    } else if (res == 0) {
      op.eof = true;  // reads past the end; writes never return 0 for len > 0
    } else if (res != -EINTR && res != -EAGAIN) {
      op.err = static_cast<int>(-res);
    }
  }
  static void run_sync(IoOp& op) {
    while (!op.finished()) {
      ssize_t n = op.write ? ::pwrite(op.fd, op.buf + op.done, op.len - op.done, op.offset + op.done)
                           : ::pread(op.fd, op.buf + op.done, op.len - op.done, op.offset + op.done);
      account(op, n < 0 ? -errno : n);
    }
  }
  void run_uring(std::vector<IoOp>& ops) {
    for (;;) {
      unsigned queued = 0;
      for (size_t i = 0; i < ops.size() && queued < entries_; ++i) {
        IoOp& op = ops[i];
        if (op.finished()) continue;
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (!sqe) break;
        if (op.write)
          io_uring_prep_write(sqe, op.fd, op.buf + op.done, op.len - op.done, op.offset + op.done);
        else
          io_uring_prep_read(sqe, op.fd, op.buf + op.done, op.len - op.done, op.offset + op.done);
        io_uring_sqe_set_data64(sqe, i);
        ++queued;
      }
      if (queued == 0) return;
      int rc = io_uring_submit_and_wait(&ring_, queued);
      if (rc < 0 && rc != -EINTR) {
        // The ring itself failed: finish this batch synchronously. Ops
        // already queued may still complete; their CQEs are reaped below.
        LOG_WARN("memory pool: io_uring_submit_and_wait: " << std::strerror(-rc) << "; batch done with pread/pwrite");
      }
      unsigned reaped = 0;
      while (reaped < queued) {
        io_uring_cqe* cqe = nullptr;
        int w = io_uring_wait_cqe(&ring_, &cqe);
        if (w == -EINTR) continue;
        if (w < 0) break;
        account(ops[io_uring_cqe_get_data64(cqe)], cqe->res);
        io_uring_cqe_seen(&ring_, cqe);
        ++reaped;
      }
      if (reaped < queued) {
        for (auto& op : ops) run_sync(op);
        return;
      }
    }
  }

  std::function<int(bool, uint64_t, uint32_t)> inject_;
  io_uring ring_{};
  unsigned entries_ = 0;
  bool uring_ = false;
};

struct MemEntry {
  std::string bytes;  // header + payload
  std::list<Pool::LruItem>::iterator lru;
};
struct FileLoc {
  uint64_t offset;
  uint32_t length;  // header + payload
};

struct Pool::Sandbox {
  std::string id;
  std::string path;
  UniqueFd fd;
  uint64_t end = 0;  // append offset = file size we own
  uint64_t dead_bytes = 0;
  uint64_t payload_bytes = 0;
  uint64_t mem_record_bytes = 0;
  uint64_t meta_bytes = 0;
  std::unordered_map<uint64_t, MemEntry> mem;
  std::unordered_map<uint64_t, FileLoc> file;
};

// Node of unordered_map<uint64_t, V>: next pointer + pair; one bucket
// pointer per element at load factor 1; one malloc.
uint64_t Pool::memory_entry_overhead() {
  return sizeof(void*) + sizeof(std::pair<const uint64_t, MemEntry>) + sizeof(void*) + kMallocOverhead +
         2 * sizeof(void*) + sizeof(LruItem) + kMallocOverhead  // the LRU list node
         + kMallocOverhead;                                     // the record's heap block
}
uint64_t Pool::file_entry_overhead() {
  return sizeof(void*) + sizeof(std::pair<const uint64_t, FileLoc>) + sizeof(void*) + kMallocOverhead;
}
uint64_t Pool::sandbox_overhead() {
  return sizeof(Sandbox) + kMallocOverhead + sizeof(void*) +
         sizeof(std::pair<const std::string, std::unique_ptr<Sandbox>>) + sizeof(void*) + kMallocOverhead;
}

Pool::Pool(PoolConfig config) : config_(std::move(config)) {}

Pool::~Pool() = default;

Result<std::unique_ptr<Pool>> Pool::open(PoolConfig config) {
  if (config.dir.empty()) return invalid_error("memory pool: PoolConfig::dir is empty");
  if (config.ring_entries == 0) config.ring_entries = 64;
  if (auto s = sys::make_dirs(config.dir, 0700); !s) return s.error().with_context("memory pool");
  std::unique_ptr<Pool> p(new Pool(std::move(config)));
  p->io_ = std::make_unique<FileIo>(p->config_);
  std::lock_guard lk(p->mu_);
  if (auto s = p->recover_dir(); !s) return s.error();
  return p;
}

// Recovery rule (docs/memory-pool.md): records are read in file order; the
// first one that is torn or fails a check ends the file, which is cut back
// to the end of the last good record. A later record for a page replaces
// an earlier one.
Status Pool::recover_dir() {
  DIR* d = ::opendir(config_.dir.c_str());
  if (!d) return sys::errno_error("opendir", config_.dir);
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 5 && n.ends_with(".pool")) names.push_back(n);
  }
  ::closedir(d);
  for (const auto& n : names) {
    std::string path = config_.dir + "/" + n;
    std::string id;
    if (!config_.recover || !hex_decode(std::string_view(n).substr(0, n.size() - 5), &id)) {
      if (::unlink(path.c_str()) != 0) LOG_WARN("memory pool: unlink " << path << ": " << std::strerror(errno));
      continue;
    }
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return sys::errno_error("open", path);
    UniqueFd f(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0) return sys::errno_error("fstat", path);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    // Reads one piece at a time (a header, then its payload), so recovering
    // a large file needs no more than one record of RAM.
    auto read_at = [&](uint64_t off, size_t len, std::string* out) -> Status {
      out->assign(len, '\0');
      std::vector<IoOp> ops(1);
      ops[0] = IoOp{false, fd, off, out->data(), static_cast<uint32_t>(len)};
      io_->run(ops);
      if (ops[0].err) return sys::errno_error("read", path + " offset " + std::to_string(off), ops[0].err);
      out->resize(ops[0].done);
      return Status::Ok();
    };
    std::string head;
    if (auto st2 = read_at(0, kPoolFileHeaderSize, &head); !st2) return st2;
    if (head != file_header()) {
      LOG_WARN("memory pool: " << path << ": bad file header, removing it");
      ::unlink(path.c_str());
      continue;
    }
    Sandbox& s = get_or_create(id);
    s.path = path;
    s.fd = std::move(f);
    uint64_t off = kPoolFileHeaderSize;
    std::string why, hdr, rec;
    while (off < size) {
      std::string what = path + " offset " + std::to_string(off);
      if (auto st2 = read_at(off, kRecordHeaderSize, &hdr); !st2) return st2;
      auto h = parse_record_header(hdr, what);
      if (!h) {
        why = h.error().message();
        break;
      }
      size_t len = record_size(h->payload_len);
      if (auto st2 = read_at(off, len, &rec); !st2) return st2;
      auto r = decode_record(rec, h->page_index, what);
      if (!r) {
        why = r.error().message();
        break;
      }
      erase_file(s, h->page_index);
      s.file[h->page_index] = FileLoc{off, static_cast<uint32_t>(len)};
      s.payload_bytes += h->payload_len;
      s.meta_bytes += file_entry_overhead();
      memory_bytes_ += file_entry_overhead();
      off += len;
    }
    if (off < size) {
      LOG_WARN("memory pool: ignoring " << size - off << " bytes at the end of " << path << " (" << why << ")");
      if (::ftruncate(s.fd.get(), static_cast<off_t>(off)) != 0) return sys::errno_error("ftruncate", path);
    }
    s.end = off;
  }
  return Status::Ok();
}

Pool::Sandbox* Pool::find(const std::string& id) const {
  auto it = sandboxes_.find(id);
  return it == sandboxes_.end() ? nullptr : it->second.get();
}

Pool::Sandbox& Pool::get_or_create(const std::string& id) {
  auto& slot = sandboxes_[id];
  if (!slot) {
    slot = std::make_unique<Sandbox>();
    slot->id = id;
    slot->meta_bytes = sandbox_overhead() + id.capacity();
    memory_bytes_ += slot->meta_bytes;
  }
  return *slot;
}

Status Pool::open_file(Sandbox& s) {
  if (s.fd) return Status::Ok();
  s.path = config_.dir + "/" + pool_file_name(s.id);
  int fd = os().open(s.path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return sys::errno_error("open", s.path);
  UniqueFd f(fd);
  std::string h = file_header();
  std::vector<IoOp> ops(1);
  ops[0] = IoOp{true, fd, 0, h.data(), static_cast<uint32_t>(h.size())};
  io_->run(ops);
  if (ops[0].err || ops[0].done != h.size()) {
    ::unlink(s.path.c_str());
    return sys::errno_error("write header", s.path, ops[0].err ? ops[0].err : EIO);
  }
  s.fd = std::move(f);
  s.end = kPoolFileHeaderSize;
  return Status::Ok();
}

void Pool::erase_memory(Sandbox& s, uint64_t page) {
  auto it = s.mem.find(page);
  if (it == s.mem.end()) return;
  uint64_t heap = it->second.bytes.capacity() + 1;
  s.payload_bytes -= it->second.bytes.size() - kRecordHeaderSize;
  s.mem_record_bytes -= heap;
  s.meta_bytes -= memory_entry_overhead();
  memory_bytes_ -= heap + memory_entry_overhead();
  lru_.erase(it->second.lru);
  s.mem.erase(it);
}

void Pool::erase_file(Sandbox& s, uint64_t page) {
  auto it = s.file.find(page);
  if (it == s.file.end()) return;
  s.payload_bytes -= it->second.length - kRecordHeaderSize;
  s.dead_bytes += it->second.length;
  s.meta_bytes -= file_entry_overhead();
  memory_bytes_ -= file_entry_overhead();
  s.file.erase(it);
}

Status Pool::put(const std::string& sandbox, uint64_t page_index, uint8_t kind, std::string_view payload) {
  if (payload.size() > kMaxRecordPayload)
    return invalid_error("memory pool put " + sandbox + " page " + std::to_string(page_index) + ": payload of " +
                         std::to_string(payload.size()) + " bytes over the " + std::to_string(kMaxRecordPayload) +
                         "-byte limit");
  std::lock_guard lk(mu_);
  Sandbox& s = get_or_create(sandbox);
  erase_memory(s, page_index);
  erase_file(s, page_index);
  std::string bytes;
  bytes.reserve(record_size(payload.size()));
  append_record(&bytes, page_index, kind, payload);
  uint64_t heap = bytes.capacity() + 1;
  lru_.push_back(LruItem{&s, page_index});
  s.mem.emplace(page_index, MemEntry{std::move(bytes), std::prev(lru_.end())});
  s.payload_bytes += payload.size();
  s.mem_record_bytes += heap;
  s.meta_bytes += memory_entry_overhead();
  memory_bytes_ += heap + memory_entry_overhead();
  if (memory_bytes_ <= config_.memory_budget) return Status::Ok();
  // Spill down to 7/8 of the budget so a full pool writes batches, not
  // one record per put.
  Status st = spill_until(config_.memory_budget - config_.memory_budget / 8);
  if (st || !s.mem.count(page_index) || memory_bytes_ <= config_.memory_budget) return Status::Ok();
  erase_memory(s, page_index);
  return Error(ErrorKind::kUnavailable, "memory pool put " + sandbox + " page " + std::to_string(page_index) +
                                            ": over the memory budget and the spill failed (" + st.error().message() +
                                            "); keep the page resident");
}

Status Pool::spill_until(uint64_t target) {
  Status last;
  while (memory_bytes_ > target && !lru_.empty()) {
    // One batch, oldest first, grouped by sandbox (one file each).
    std::map<Sandbox*, std::vector<uint64_t>> groups;
    uint64_t projected = memory_bytes_;
    size_t n = 0;
    for (auto it = lru_.begin(); it != lru_.end() && projected > target && n < kSpillBatch; ++it, ++n) {
      groups[it->sandbox].push_back(it->page);
      auto& e = it->sandbox->mem.at(it->page);
      projected -= e.bytes.capacity() + 1 + memory_entry_overhead() - file_entry_overhead();
    }
    bool progress = false;
    for (auto& [s, pages] : groups) {
      Status st = spill_pages(*s, std::move(pages));
      if (st) progress = true;
      else last = st;
    }
    if (!progress) break;
  }
  return last;
}

Status Pool::spill_pages(Sandbox& s, std::vector<uint64_t> pages) {
  if (auto st = open_file(s); !st) {
    ++spill_errors_;
    LOG_WARN("memory pool spill " << s.id << ": " << st.error().message());
    return st;
  }
  std::string buf;
  std::vector<std::pair<uint64_t, FileLoc>> locs;
  for (uint64_t p : pages) {
    const auto& e = s.mem.at(p);
    locs.emplace_back(p, FileLoc{s.end + buf.size(), static_cast<uint32_t>(e.bytes.size())});
    buf += e.bytes;
  }
  std::vector<IoOp> ops;
  for (size_t off = 0; off < buf.size(); off += kMaxWriteChunk) {
    uint32_t len = static_cast<uint32_t>(std::min(kMaxWriteChunk, buf.size() - off));
    ops.push_back(IoOp{true, s.fd.get(), s.end + off, buf.data() + off, len});
  }
  io_->run(ops);
  for (const auto& op : ops) {
    if (op.err || op.done != op.len) {
      ++spill_errors_;
      Error e = sys::errno_error("write", s.path + " offset " + std::to_string(op.offset), op.err ? op.err : EIO);
      LOG_WARN("memory pool spill " << s.id << ": " << e.message());
      // Cut whatever part of the batch did land: records past s.end would
      // otherwise be read by a recovery as newer than the ones written
      // there later. The batch stays in the memory tier.
      if (os().ftruncate(s.fd.get(), static_cast<off_t>(s.end)) != 0)
        LOG_WARN("memory pool spill " << s.id << ": ftruncate " << s.path << ": " << std::strerror(errno));
      return e;
    }
  }
  s.end += buf.size();
  for (auto& [p, loc] : locs) {
    erase_memory(s, p);
    s.file.emplace(p, loc);
    s.payload_bytes += loc.length - kRecordHeaderSize;
    s.meta_bytes += file_entry_overhead();
    memory_bytes_ += file_entry_overhead();
  }
  ++spills_;
  spilled_records_ += locs.size();
  return Status::Ok();
}

Status Pool::spill_all(const std::string& sandbox) {
  std::lock_guard lk(mu_);
  Sandbox* s = find(sandbox);
  if (!s || s->mem.empty()) return Status::Ok();
  std::vector<uint64_t> pages;
  for (auto& [p, e] : s->mem) pages.push_back(p);
  std::sort(pages.begin(), pages.end());
  return spill_pages(*s, std::move(pages));
}

Result<Record> Pool::get(const std::string& sandbox, uint64_t page_index) {
  auto v = get_batch(sandbox, std::span<const uint64_t>(&page_index, 1));
  return std::move(v[0]);
}

std::vector<Result<Record>> Pool::get_batch(const std::string& sandbox, std::span<const uint64_t> pages) {
  std::lock_guard lk(mu_);
  std::vector<Result<Record>> out;
  out.reserve(pages.size());
  Sandbox* s = find(sandbox);
  std::vector<IoOp> ops;
  std::vector<size_t> op_slot;
  std::vector<std::string> bufs;
  bufs.reserve(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    uint64_t p = pages[i];
    std::string what = sandbox + " page " + std::to_string(p);
    if (s) {
      if (auto it = s->mem.find(p); it != s->mem.end()) {
        lru_.splice(lru_.end(), lru_, it->second.lru);
        auto r = decode_record(it->second.bytes, p, what + " (memory tier)");
        if (!r) ++read_errors_;
        out.push_back(std::move(r));
        continue;
      }
      if (auto it = s->file.find(p); it != s->file.end()) {
        bufs.emplace_back(it->second.length, '\0');
        ops.push_back(IoOp{false, s->fd.get(), it->second.offset, bufs.back().data(), it->second.length});
        op_slot.push_back(i);
        out.push_back(internal_error("pending"));
        continue;
      }
    }
    out.push_back(not_found_error("memory pool: no record for sandbox " + what));
  }
  if (!ops.empty()) io_->run(ops);
  for (size_t k = 0; k < ops.size(); ++k) {
    const IoOp& op = ops[k];
    uint64_t p = pages[op_slot[k]];
    std::string what = s->path + " offset " + std::to_string(op.offset) + " (sandbox " + sandbox + " page " +
                       std::to_string(p) + ")";
    if (op.err) {
      out[op_slot[k]] = sys::errno_error("read pool record", what, op.err);
    } else {
      out[op_slot[k]] = decode_record(std::string_view(bufs[k]).substr(0, op.done), p, what);
    }
    if (!out[op_slot[k]]) ++read_errors_;
  }
  return out;
}

bool Pool::contains(const std::string& sandbox, uint64_t page_index) const {
  std::lock_guard lk(mu_);
  Sandbox* s = find(sandbox);
  return s && (s->mem.count(page_index) || s->file.count(page_index));
}

void Pool::erase(const std::string& sandbox, uint64_t page_index) {
  std::lock_guard lk(mu_);
  if (Sandbox* s = find(sandbox)) {
    erase_memory(*s, page_index);
    erase_file(*s, page_index);
  }
}

void Pool::drop(const std::string& sandbox) {
  std::lock_guard lk(mu_);
  auto it = sandboxes_.find(sandbox);
  if (it == sandboxes_.end()) return;
  Sandbox& s = *it->second;
  for (auto& [p, e] : s.mem) lru_.erase(e.lru);
  memory_bytes_ -= s.mem_record_bytes + s.meta_bytes;
  if (s.fd) {
    s.fd.reset();
    if (os().unlinkat(AT_FDCWD, s.path.c_str(), 0) != 0 && errno != ENOENT)
      LOG_WARN("memory pool drop " << sandbox << ": unlink " << s.path << ": " << std::strerror(errno));
  }
  sandboxes_.erase(it);
}

namespace {
void add_stats(PoolStats* t, const PoolStats& s) {
  t->records += s.records;
  t->memory_records += s.memory_records;
  t->file_records += s.file_records;
  t->payload_bytes += s.payload_bytes;
  t->memory_record_bytes += s.memory_record_bytes;
  t->metadata_bytes += s.metadata_bytes;
  t->file_bytes += s.file_bytes;
  t->dead_file_bytes += s.dead_file_bytes;
}
}  // namespace

PoolStats Pool::stats_locked(const Sandbox& s) const {
  PoolStats st;
  st.memory_records = s.mem.size();
  st.file_records = s.file.size();
  st.records = st.memory_records + st.file_records;
  st.payload_bytes = s.payload_bytes;
  st.memory_record_bytes = s.mem_record_bytes;
  st.metadata_bytes = s.meta_bytes;
  st.file_bytes = s.fd ? s.end : 0;
  st.dead_file_bytes = s.dead_bytes;
  return st;
}

PoolStats Pool::stats(const std::string& sandbox) const {
  std::lock_guard lk(mu_);
  Sandbox* s = find(sandbox);
  return s ? stats_locked(*s) : PoolStats{};
}

PoolTotals Pool::totals() const {
  std::lock_guard lk(mu_);
  PoolTotals t;
  for (auto& [id, s] : sandboxes_) add_stats(&t.bytes, stats_locked(*s));
  t.sandboxes = sandboxes_.size();
  t.spills = spills_;
  t.spilled_records = spilled_records_;
  t.spill_errors = spill_errors_;
  t.read_errors = read_errors_;
  t.io_uring = io_->uring();
  return t;
}

}  // namespace sg::memory
