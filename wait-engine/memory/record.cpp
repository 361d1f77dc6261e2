// Pool records and CRC32C (record.h; format in docs/memory-pool.md).
#include "wait-engine/memory/record.h"

#include <array>
#include <cassert>
#include <cstdio>
#include <cstring>

namespace sg::memory {

namespace {

// Slicing-by-8 tables, computed at compile time (no mutable global state).
struct Crc32cTables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
constexpr Crc32cTables kTables;

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint32_t load_le32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
void store_le(uint8_t* p, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // x86 is little-endian, as the CRC's byte order wants
    c = __builtin_ia32_crc32di(c, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return ~c32;
}
bool have_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");  // immutable once set
  return has;
}
#endif

}  // namespace

namespace detail {

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  const auto& t = kTables.t;
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo = c ^ load_le32(p);
    uint32_t hi = load_le32(p + 4);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

bool crc32c_hardware(uint32_t crc, const void* data, size_t n, uint32_t* out) {
#if defined(__x86_64__)
  if (!have_sse42()) return false;
  *out = crc32c_sse42(crc, static_cast<const uint8_t*>(data), n);
  return true;
#else
  return false;
#endif
}

}  // namespace detail

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  uint32_t v;
  if (detail::crc32c_hardware(crc, data, n, &v)) return v;
  return detail::crc32c_portable(crc, data, n);
}

void append_record(std::string* out, uint64_t page_index, uint8_t kind, std::string_view payload) {
  assert(payload.size() <= kMaxRecordPayload);
  uint8_t h[kRecordHeaderSize] = {};
  store_le(h + 0, kRecordMagic, 4);
  store_le(h + 4, kRecordVersion, 2);
  h[6] = kind;
  h[7] = 0;
  store_le(h + 8, page_index, 8);
  store_le(h + 16, payload.size(), 4);
  uint32_t crc = crc32c_extend(0, h, 20);
  crc = crc32c_extend(crc, payload.data(), payload.size());
  store_le(h + 20, crc, 4);
  out->append(reinterpret_cast<const char*>(h), sizeof h);
  out->append(payload);
}

Result<RecordHeader> parse_record_header(std::string_view bytes, std::string_view what) {
  auto fail = [&](const std::string& why) {
    return Error(ErrorKind::kInternal, "pool record " + std::string(what) + ": " + why);
  };
  if (bytes.size() < kRecordHeaderSize) return fail("truncated header (" + std::to_string(bytes.size()) + " bytes)");
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (load_le32(p) != kRecordMagic) return fail("bad magic");
  uint16_t version = static_cast<uint16_t>(p[4] | p[5] << 8);
  if (version != kRecordVersion) return fail("unsupported version " + std::to_string(version));
  RecordHeader h;
  h.kind = p[6];
  h.flags = p[7];
  if (h.flags != 0) return fail("unknown flags " + std::to_string(h.flags));
  h.page_index = load_le64(p + 8);
  h.payload_len = load_le32(p + 16);
  h.crc = load_le32(p + 20);
  if (h.payload_len > kMaxRecordPayload)
    return fail("payload length " + std::to_string(h.payload_len) + " over limit " + std::to_string(kMaxRecordPayload));
  return h;
}

Result<Record> decode_record(std::string_view bytes, uint64_t expected_page, std::string_view what) {
  auto h = parse_record_header(bytes, what);
  if (!h) return h.error();
  auto fail = [&](const std::string& why) {
    return Error(ErrorKind::kInternal, "pool record " + std::string(what) + ": " + why);
  };
  if (bytes.size() < record_size(h->payload_len))
    return fail("truncated (" + std::to_string(bytes.size()) + " of " + std::to_string(record_size(h->payload_len)) +
                " bytes)");
  if (bytes.size() > record_size(h->payload_len)) return fail("trailing bytes after payload");
  std::string_view payload = bytes.substr(kRecordHeaderSize);
  uint32_t crc = crc32c_extend(0, bytes.data(), 20);
  crc = crc32c_extend(crc, payload.data(), payload.size());
  if (crc != h->crc) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "checksum mismatch (stored %08x, computed %08x)", h->crc, crc);
    return fail(buf);
  }
  if (h->page_index != expected_page)
    return fail("page index " + std::to_string(h->page_index) + ", expected " + std::to_string(expected_page));
  return Record{h->page_index, h->kind, std::string(payload)};
}

}  // namespace sg::memory
