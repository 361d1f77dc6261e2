// Pause packing (pause_pack.h). Both directions walk the RAM and the base
// in 1 MiB chunks, in page order, so neither holds more than a chunk of
// either file; holes (SEEK_DATA) are not read. The packed file is written
// beside the snapshot and renamed in whole; memory goes only after that.
#include "wait-engine/memory/pause_pack.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/sys.h"
#include "base/fd.h"
#include "wait-engine/memory/page_codec.h"
#include "wait-engine/memory/record.h"

namespace sg::memory {

namespace {

constexpr char kMagic[8] = {'S', 'G', 'P', 'M', 'E', 'M', '0', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kPage = kCodecPageSize;
constexpr size_t kChunk = 256 * kPage;
constexpr size_t kEntryHead = 10;  // u64 page index + u16 record length
constexpr size_t kWriteBuffer = 1 << 20;

void put_le(uint8_t* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

bool all_zero(const uint8_t* p, size_t n) {
  static const uint8_t zero[kPage] = {};
  for (size_t i = 0; i < n; i += kPage)
    if (std::memcmp(p + i, zero, std::min(kPage, n - i)) != 0) return false;
  return true;
}

// n bytes of fd at off into buf; what lies past size, or in a hole, reads
// as zero bytes (a hole is not read at all).
Status read_chunk(int fd, uint64_t size, uint64_t off, uint8_t* buf, size_t n, const std::string& what) {
  std::memset(buf, 0, n);
  if (off >= size) return {};
  size_t want = static_cast<size_t>(std::min<uint64_t>(n, size - off));
  off_t data = ::lseek(fd, static_cast<off_t>(off), SEEK_DATA);
  if (data < 0 && errno == ENXIO) return {};  // only a hole from here
  if (data >= 0 && static_cast<uint64_t>(data) >= off + want) return {};
  size_t got = 0;
  while (got < want) {
    ssize_t r = ::pread(fd, buf + got, want - got, static_cast<off_t>(off + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return sys::errno_error("read", what);
    if (r == 0) return internal_error(what + " ended early (it changed while it was read)");
    got += static_cast<size_t>(r);
  }
  return {};
}

Status write_all(sys::Os& os, int fd, const uint8_t* p, size_t n, const std::string& what) {
  while (n > 0) {
    ssize_t w = os.write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return sys::errno_error("write", what);
    p += w, n -= static_cast<size_t>(w);
  }
  return {};
}

Status fsync_dir(sys::Os& os, const std::string& dir) {
  UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!d || os.fsync(d.get()) != 0) return sys::errno_error("fsync", dir);
  return {};
}

Result<uint64_t> file_size(int fd, const std::string& what) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return sys::errno_error("fstat", what);
  return static_cast<uint64_t>(st.st_size);
}

// The base a pack of a sandbox restored from base is made against: a
// resumed pause runs from its unpacked memory, whose own base is the one
// to use (packs never chain).
std::string resolve_base(const std::string& base) {
  size_t slash = base.rfind('/');
  std::string folder = slash == std::string::npos ? "." : base.substr(0, slash);
  std::string name = slash == std::string::npos ? base : base.substr(slash + 1);
  std::string linked = folder + "/" + kPackBaseFile;
  if (name == "memory" && sys::path_exists(folder + "/" + kPackedMemoryFile) && sys::path_exists(linked)) return linked;
  return base;
}

std::string mib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  return buf;
}

}  // namespace

Result<std::string> PausePacker::pack(const std::string& dir, const std::string& base) {
  Result<PackStats> s = pack_stats(dir, base);
  if (!s) return s.error();
  return "memory " + mib(s->mem_bytes) + " packed into " + mib(s->stored_bytes) + " (" +
         std::to_string(s->pages_stored) + " pages differ from its base, " + std::to_string(s->pages_same) +
         " the same) in " + std::to_string(s->ms) + " ms";
}

Result<PackStats> PausePacker::pack_stats(const std::string& dir, const std::string& base_in) {
  const uint64_t t0 = sys::monotonic_ns();
  const std::string raw = dir + "/memory", link = dir + "/" + kPackBaseFile;
  const std::string packed = dir + "/" + kPackedMemoryFile, partial = packed + ".partial";
  const std::string base = resolve_base(base_in);
  UniqueFd rfd(::open(raw.c_str(), O_RDONLY | O_CLOEXEC));
  if (!rfd) return sys::errno_error("open", raw);
  Result<uint64_t> mem_bytes = file_size(rfd.get(), raw);
  if (!mem_bytes) return mem_bytes.error();
  if (*mem_bytes == 0 || *mem_bytes % kPage || *mem_bytes > kMaxPackedMemory)
    return invalid_error(raw + " is " + std::to_string(*mem_bytes) + " bytes: not guest RAM");
  // The base is linked in first (a whole memory.sgm always has its base)
  // and read through the link, so what is checked is what is kept.
  if (os_.unlinkat(AT_FDCWD, link.c_str(), 0) != 0 && errno != ENOENT) return sys::errno_error("unlink", link);
  if (os_.link(base.c_str(), link.c_str()) != 0) return sys::errno_error("link", base + " to " + link);
  bool done = false;
  struct Cleanup {
    const std::string &partial, &link;
    bool& done;
    ~Cleanup() {
      if (done) return;
      ::unlink(partial.c_str());
      ::unlink(link.c_str());
    }
  } cleanup{partial, link, done};
  UniqueFd bfd(::open(link.c_str(), O_RDONLY | O_CLOEXEC));
  if (!bfd) return sys::errno_error("open", link);
  Result<uint64_t> base_bytes = file_size(bfd.get(), link);
  if (!base_bytes) return base_bytes.error();
  if (*base_bytes > kMaxPackedMemory) return invalid_error(base + " is too large to be guest RAM");
  UniqueFd out(os_.open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!out) return sys::errno_error("open", partial);

  CodecContext cc;
  if (!cc.ok()) return internal_error("zstd could not allocate its contexts");
  EncodeOptions opt;
  opt.level = level_;
  std::vector<uint8_t> rbuf(kChunk), bbuf(kChunk);
  std::string body(kPackHeaderSize, '\0'), rec;  // the header's place, written last
  body.reserve(kWriteBuffer + kMaxPageRecord + kEntryHead);
  PackStats st;
  st.mem_bytes = *mem_bytes;
  uint32_t base_crc = 0, body_crc = 0;
  uint64_t body_bytes = 0, records = 0;
  size_t flushed_header = kPackHeaderSize;  // the header's place in body is not body
  auto flush = [&]() -> Status {
    body_crc = crc32c_extend(body_crc, body.data() + flushed_header, body.size() - flushed_header);
    body_bytes += body.size() - flushed_header;
    Status w = write_all(os_, out.get(), reinterpret_cast<const uint8_t*>(body.data()), body.size(), partial);
    body.clear();
    flushed_header = 0;
    return w;
  };
  const uint64_t end = std::max(*mem_bytes, *base_bytes);
  for (uint64_t off = 0; off < end; off += kChunk) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, end - off));
    if (Status r = read_chunk(bfd.get(), *base_bytes, off, bbuf.data(), n, link); !r) return r.error();
    if (off < *base_bytes)
      base_crc = crc32c_extend(base_crc, bbuf.data(), static_cast<size_t>(std::min<uint64_t>(n, *base_bytes - off)));
    if (off >= *mem_bytes) continue;
    if (Status r = read_chunk(rfd.get(), *mem_bytes, off, rbuf.data(), n, raw); !r) return r.error();
    size_t in_ram = static_cast<size_t>(std::min<uint64_t>(n, *mem_bytes - off));
    for (size_t p = 0; p < in_ram; p += kPage) {
      if (std::memcmp(rbuf.data() + p, bbuf.data() + p, kPage) == 0) {
        ++st.pages_same;
        continue;
      }
      rec.clear();
      opt.template_page = bbuf.data() + p;
      encode_page(cc, rbuf.data() + p, opt, rec);
      uint8_t head[kEntryHead];
      put_le(head, (off + p) / kPage, 8);
      put_le(head + 8, rec.size(), 2);
      body.append(reinterpret_cast<const char*>(head), kEntryHead);
      body += rec;
      ++records;
      if (body.size() >= kWriteBuffer)
        if (Status w = flush(); !w) return w.error();
    }
  }
  if (Status w = flush(); !w) return w.error();
  uint8_t h[kPackHeaderSize] = {};
  std::memcpy(h, kMagic, 8);
  put_le(h + 8, kVersion, 4);
  put_le(h + 12, kPage, 4);
  put_le(h + 16, *mem_bytes, 8);
  put_le(h + 24, *base_bytes, 8);
  put_le(h + 32, base_crc, 4);
  put_le(h + 40, records, 8);
  put_le(h + 48, body_bytes, 8);
  put_le(h + 56, body_crc, 4);
  put_le(h + 60, crc32c_extend(0, h, 60), 4);
  if (::lseek(out.get(), 0, SEEK_SET) != 0) return sys::errno_error("lseek", partial);
  if (Status w = write_all(os_, out.get(), h, sizeof h, partial); !w) return w.error();
  if (os_.fsync(out.get()) != 0) return sys::errno_error("fsync", partial);
  out.reset();
  if (os_.rename(partial.c_str(), packed.c_str()) != 0) return sys::errno_error("rename", partial);
  if (Status d = fsync_dir(os_, dir); !d) {
    ::unlink(packed.c_str());
    return d.error();
  }
  done = true;
  // Whole and durable: the raw RAM can go. A failure here leaves both,
  // which unpack() reads as "not packed" (memory wins).
  if (os_.unlinkat(AT_FDCWD, raw.c_str(), 0) != 0) return sys::errno_error("unlink", raw);
  if (Status d = fsync_dir(os_, dir); !d) return d.error();
  st.pages_stored = records;
  st.stored_bytes = kPackHeaderSize + body_bytes;
  st.ms = (sys::monotonic_ns() - t0) / 1000000;
  return st;
}

namespace {

// The packed body, read forward through a buffer; every byte read goes
// into the body CRC and no read passes the body's end.
class BodyReader {
 public:
  BodyReader(int fd, uint64_t body_bytes, const std::string& what) : fd_(fd), left_(body_bytes), what_(what) {}
  Status read(uint8_t* dst, size_t n) {
    if (n > left_ + (end_ - pos_)) return internal_error(what_ + " is truncated (a record runs past its end)");
    while (n > 0) {
      if (pos_ == end_) {
        size_t want = static_cast<size_t>(std::min<uint64_t>(buf_.size(), left_));
        ssize_t r;
        do r = ::pread(fd_, buf_.data(), want, static_cast<off_t>(file_off_));
        while (r < 0 && errno == EINTR);
        if (r < 0) return sys::errno_error("read", what_);
        if (r == 0) return internal_error(what_ + " is shorter than its header says");
        crc_ = crc32c_extend(crc_, buf_.data(), static_cast<size_t>(r));
        file_off_ += static_cast<uint64_t>(r);
        left_ -= static_cast<uint64_t>(r);
        pos_ = 0, end_ = static_cast<size_t>(r);
      }
      size_t k = std::min(n, end_ - pos_);
      std::memcpy(dst, buf_.data() + pos_, k);
      dst += k, n -= k, pos_ += k;
    }
    return {};
  }
  // Everything read, and the CRC over it.
  bool at_end() const { return left_ == 0 && pos_ == end_; }
  uint32_t crc() const { return crc_; }

 private:
  int fd_;
  uint64_t left_;  // not yet read from the file
  uint64_t file_off_ = kPackHeaderSize;
  const std::string& what_;
  std::vector<uint8_t> buf_ = std::vector<uint8_t>(kWriteBuffer);
  size_t pos_ = 0, end_ = 0;
  uint32_t crc_ = 0;
};

}  // namespace

Status PausePacker::unpack(const std::string& dir) {
  const std::string mem = dir + "/memory", partial = mem + ".partial";
  const std::string packed = dir + "/" + kPackedMemoryFile, link = dir + "/" + kPackBaseFile;
  if (sys::path_exists(mem)) return {};
  const std::string what = "the paused memory " + packed;
  UniqueFd pfd(::open(packed.c_str(), O_RDONLY | O_CLOEXEC));
  if (!pfd) return sys::errno_error("open", packed);
  Result<uint64_t> psize = file_size(pfd.get(), packed);
  if (!psize) return psize.error();
  uint8_t h[kPackHeaderSize];
  if (*psize < kPackHeaderSize || ::pread(pfd.get(), h, sizeof h, 0) != static_cast<ssize_t>(sizeof h))
    return internal_error(what + " is truncated (no whole header)");
  if (std::memcmp(h, kMagic, 8) != 0) return internal_error(what + " is not a packed memory file (bad magic)");
  if (get_le(h + 60, 4) != crc32c_extend(0, h, 60)) return internal_error(what + ": header checksum mismatch");
  if (get_le(h + 8, 4) != kVersion) return internal_error(what + ": unsupported version " + std::to_string(get_le(h + 8, 4)));
  const uint64_t mem_bytes = get_le(h + 16, 8), base_bytes = get_le(h + 24, 8), records = get_le(h + 40, 8),
                 body_bytes = get_le(h + 48, 8);
  const uint32_t base_crc_want = static_cast<uint32_t>(get_le(h + 32, 4)),
                 body_crc_want = static_cast<uint32_t>(get_le(h + 56, 4));
  if (get_le(h + 12, 4) != kPage || mem_bytes == 0 || mem_bytes % kPage || mem_bytes > kMaxPackedMemory ||
      base_bytes > kMaxPackedMemory || records > mem_bytes / kPage)
    return internal_error(what + ": header sizes out of range");
  if (body_bytes != *psize - kPackHeaderSize)
    return internal_error(what + " is " + std::to_string(*psize) + " bytes, its header says " +
                          std::to_string(body_bytes + kPackHeaderSize));
  UniqueFd bfd(::open(link.c_str(), O_RDONLY | O_CLOEXEC));
  if (!bfd) return sys::errno_error("open", link).with_context("the base of " + what);
  Result<uint64_t> bsize = file_size(bfd.get(), link);
  if (!bsize) return bsize.error();
  if (*bsize != base_bytes)
    return internal_error("the base of " + what + " is " + std::to_string(*bsize) + " bytes, it was packed against " +
                          std::to_string(base_bytes));

  UniqueFd out(os_.open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!out) return sys::errno_error("open", partial);
  bool done = false;
  struct Cleanup {
    const std::string& partial;
    bool& done;
    ~Cleanup() {
      if (!done) ::unlink(partial.c_str());
    }
  } cleanup{partial, done};
  if (os_.ftruncate(out.get(), static_cast<off_t>(mem_bytes)) != 0) return sys::errno_error("ftruncate", partial);

  CodecContext cc;
  if (!cc.ok()) return internal_error("zstd could not allocate its contexts");
  BodyReader body(pfd.get(), body_bytes, what);
  std::vector<uint8_t> bbuf(kChunk), obuf(kChunk), rec(kMaxPageRecord);
  uint64_t read_records = 0, next_page = 0, min_page = 0;
  size_t rec_len = 0;
  bool have = false;
  auto next = [&]() -> Status {
    have = false;
    if (read_records == records) return {};
    uint8_t head[kEntryHead];
    if (Status r = body.read(head, sizeof head); !r) return r;
    next_page = get_le(head, 8);
    rec_len = static_cast<size_t>(get_le(head + 8, 2));
    if (next_page < min_page || next_page >= mem_bytes / kPage)
      return internal_error(what + ": record " + std::to_string(read_records) + " names page " +
                            std::to_string(next_page) + " (out of order or past the RAM)");
    if (rec_len == 0 || rec_len > kMaxPageRecord)
      return internal_error(what + ": record " + std::to_string(read_records) + " has length " + std::to_string(rec_len));
    if (Status r = body.read(rec.data(), rec_len); !r) return r;
    min_page = next_page + 1;
    ++read_records;
    have = true;
    return {};
  };
  if (Status r = next(); !r) return r.error();
  uint32_t base_crc = 0;
  const uint64_t end = std::max(mem_bytes, base_bytes);
  for (uint64_t off = 0; off < end; off += kChunk) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, end - off));
    if (Status r = read_chunk(bfd.get(), base_bytes, off, bbuf.data(), n, link); !r) return r.error();
    if (off < base_bytes)
      base_crc = crc32c_extend(base_crc, bbuf.data(), static_cast<size_t>(std::min<uint64_t>(n, base_bytes - off)));
    if (off >= mem_bytes) continue;
    size_t in_ram = static_cast<size_t>(std::min<uint64_t>(n, mem_bytes - off));
    std::memcpy(obuf.data(), bbuf.data(), in_ram);
    const uint64_t first = off / kPage, last = (off + in_ram) / kPage;
    while (have && next_page < last) {
      size_t at = static_cast<size_t>(next_page - first) * kPage;
      Status d = decode_page(cc, std::string_view(reinterpret_cast<const char*>(rec.data()), rec_len), bbuf.data() + at,
                             nullptr, obuf.data() + at);
      if (!d) return internal_error(what + ": page " + std::to_string(next_page) + ": " + d.error().message());
      if (Status r = next(); !r) return r.error();
    }
    // Runs of non-zero pages only: the file stays sparse as the VMM wrote it.
    for (size_t p = 0; p < in_ram;) {
      if (all_zero(obuf.data() + p, kPage)) {
        p += kPage;
        continue;
      }
      size_t q = p + kPage;
      while (q < in_ram && !all_zero(obuf.data() + q, kPage)) q += kPage;
      if (::lseek(out.get(), static_cast<off_t>(off + p), SEEK_SET) < 0) return sys::errno_error("lseek", partial);
      if (Status w = write_all(os_, out.get(), obuf.data() + p, q - p, partial); !w) return w.error();
      p = q;
    }
  }
  if (have || read_records != records || !body.at_end())
    return internal_error(what + ": its records do not end where its header says");
  if (body.crc() != body_crc_want) return internal_error(what + ": checksum mismatch");
  if (base_crc != base_crc_want)
    return internal_error("the base of " + what + " is not the memory it was packed against (checksum mismatch)");
  if (os_.fsync(out.get()) != 0) return sys::errno_error("fsync", partial);
  out.reset();
  if (os_.rename(partial.c_str(), mem.c_str()) != 0) return sys::errno_error("rename", partial);
  done = true;
  return fsync_dir(os_, dir);
}

}  // namespace sg::memory
