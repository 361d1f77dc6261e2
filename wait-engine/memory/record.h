// Pool records: the byte format of one offloaded guest page, in memory and
// on disk (docs/memory-pool.md), and the CRC32C that guards it.
//
// A record is a 24-byte little-endian header followed by the payload (the
// page codec's output, opaque here). The same bytes live in the memory tier
// and in the file tier, so a spill is a plain write and every read, from
// either tier, goes through decode_record(), which checks magic, version,
// bounds, the expected page index and the checksum before any payload byte
// is handed out. A record that fails any check is an error, never data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace sg::memory {

inline constexpr uint32_t kRecordMagic = 0x52504753;  // "SGPR" read as bytes
inline constexpr uint16_t kRecordVersion = 1;
inline constexpr size_t kRecordHeaderSize = 24;
inline constexpr size_t kPageSize = 4096;
// A codec may add a little framing to a page that does not compress; more
// than this is a corrupt length, not a page.
inline constexpr size_t kMaxRecordPayload = kPageSize + 256;

// Header fields, decoded. Offsets in docs/memory-pool.md.
struct RecordHeader {
  uint64_t page_index = 0;
  uint8_t kind = 0;
  uint8_t flags = 0;
  uint32_t payload_len = 0;
  uint32_t crc = 0;
};

// A verified record: the payload is a copy, owned by the caller.
struct Record {
  uint64_t page_index = 0;
  uint8_t kind = 0;
  std::string payload;
};

// Appends header + payload to out. payload.size() must be at most
// kMaxRecordPayload (asserted: callers check with a Status first).
void append_record(std::string* out, uint64_t page_index, uint8_t kind, std::string_view payload);
inline size_t record_size(size_t payload_len) { return kRecordHeaderSize + payload_len; }

// Checks the header alone (magic, version, flags, length bound); the CRC
// needs the payload. what names the record in the error ("pool file X
// offset 4096").
Result<RecordHeader> parse_record_header(std::string_view bytes, std::string_view what);

// Checks a whole record: bytes must be exactly header + payload. The error
// names what failed: "bad magic", "unsupported version", "payload length
// N over limit", "truncated", "checksum mismatch", "page index N, expected
// M".
Result<Record> decode_record(std::string_view bytes, uint64_t expected_page, std::string_view what);

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the iSCSI/ext4
// checksum. crc32c_extend continues a running value (pass 0 to start).
// Uses the SSE4.2 crc32 instruction when the CPU has it, slicing-by-8
// otherwise; both give the same values (tested).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(std::string_view s) { return crc32c_extend(0, s.data(), s.size()); }

namespace detail {
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);
// Returns false (and leaves *out alone) where the CPU lacks SSE4.2.
bool crc32c_hardware(uint32_t crc, const void* data, size_t n, uint32_t* out);
}  // namespace detail

}  // namespace sg::memory
