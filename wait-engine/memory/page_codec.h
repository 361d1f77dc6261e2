// Page codecs: the smallest representation of one 4 KiB guest page, chosen
// per page, for the memory offload engine (issue 6, docs/memory-codecs.md).
//
// Sibling sandboxes cloned from one template share most of their memory, so
// the codec looks at the template page at the same guest address first
// (unchanged: nothing stored; a few 64-byte blocks changed: only those) and
// only then at generic compression: zstd with the cohort's dictionary, plain
// zstd, raw. Every record carries the CRC32C of the decoded page, so a
// corrupt record, a wrong template page or a wrong dictionary is refused at
// decode instead of installing garbage into a guest.
//
// Record format (byte 0 is the kind; all integers little-endian):
//   [kind u8][page crc32c u32][payload]
// payloads per kind are in docs/memory-codecs.md. Records are not
// self-delimiting: the caller (the pool) stores each record's length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

struct ZSTD_CCtx_s;
struct ZSTD_DCtx_s;

namespace sg::memory {

class Dictionary;

inline constexpr size_t kCodecPageSize = 4096;
inline constexpr size_t kCodecBlockSize = 64;  // the delta's granularity: 64 blocks, one bit each
inline constexpr size_t kRecordPrefixSize = 5;  // kind + page crc
// The most a record can take (a raw page plus the prefix).
inline constexpr size_t kMaxPageRecord = kRecordPrefixSize + kCodecPageSize;
// A run-length page with more runs than this is left to the other codecs.
inline constexpr size_t kMaxRuns = 16;

// On-wire values: never renumber, only add.
enum class PageKind : uint8_t {
  kTemplateSame = 1,  // equals the template page at the same address
  kZero = 2,          // all zero bytes
  kRuns = 3,          // at most kMaxRuns runs of one byte value
  kDelta = 4,         // bitmap of changed 64-byte blocks + those blocks
  kDeltaZstd = 5,     // bitmap + zstd(changed blocks XOR template blocks)
  kZstdDict = 6,      // dictionary id + zstd frame using the cohort dictionary
  kZstd = 7,          // zstd frame
  kRaw = 8,           // the page as is
};
const char* page_kind_name(PageKind k);
inline constexpr int kPageKindCount = 9;  // valid values are 1..8

// Per-thread zstd state and scratch space. Move-only; not thread-safe (one
// per encoding or decoding thread). Encoding and decoding through it
// allocate nothing per page once created (out's capacity aside).
class CodecContext {
 public:
  CodecContext();
  ~CodecContext();
  CodecContext(const CodecContext&) = delete;
  CodecContext& operator=(const CodecContext&) = delete;
  CodecContext(CodecContext&& o) noexcept;
  CodecContext& operator=(CodecContext&& o) noexcept;

  // False when zstd could not allocate its contexts; every call then fails.
  bool ok() const { return cctx_ && dctx_; }

 private:
  friend struct CodecAccess;
  void reset();
  ZSTD_CCtx_s* cctx_ = nullptr;
  ZSTD_DCtx_s* dctx_ = nullptr;
  // What cctx_'s parameters are set up for: plain zstd at cctx_level_, or
  // dictionary mode (the CDict itself is referenced anew for every page).
  int cctx_level_ = kUnset;
  bool cctx_dict_mode_ = false;
  static constexpr int kUnset = -1000000;
  uint8_t scratch_[3 * kCodecPageSize + 512];
};

struct EncodeOptions {
  const uint8_t* template_page = nullptr;  // the template's page at the same guest address, or nullptr
  const Dictionary* dict = nullptr;        // the cohort's dictionary, or nullptr
  int level = 3;                           // zstd level for kinds without a dictionary
};

struct EncodeResult {
  PageKind kind = PageKind::kRaw;
  size_t bytes = 0;  // record size appended to out
};

// Appends the smallest record for page (kCodecPageSize bytes) to out. Never
// fails: a page that nothing shrinks is stored raw; a zstd error (only on
// allocation failure) falls back to raw as well.
EncodeResult encode_page(CodecContext& cc, const uint8_t* page, const EncodeOptions& opt, std::string& out);

// Decodes one whole record into out (kCodecPageSize bytes). Every length is
// checked and the decoded page must match the record's CRC. Errors
// (kInvalid, naming what failed): empty or truncated record, unknown kind,
// a template kind without a template, a dictionary kind with no or another
// dictionary, a payload of the wrong size, zstd errors, a decoded size other
// than kCodecPageSize, "page checksum mismatch". On error out's contents
// are unspecified and must not be used.
Status decode_page(CodecContext& cc, std::string_view rec, const uint8_t* template_page, const Dictionary* dict,
                   uint8_t* out);

// The kind byte of a record (for accounting), 0 when rec is empty or the
// kind is unknown. Does not validate the record.
uint8_t record_kind(std::string_view rec);

// CRC32C of n bytes (the page checksum in every record).
uint32_t page_crc32c(const uint8_t* p, size_t n);

}  // namespace sg::memory
