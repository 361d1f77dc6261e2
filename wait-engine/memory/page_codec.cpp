// Page codecs (docs/memory-codecs.md). The chooser tries the cheap exact
// kinds first (zero, template-same, runs), then the template delta, then
// one full-page zstd (with the cohort dictionary when there is one), and
// keeps the smallest. zstd frames use the magicless format without content
// size, checksum or dictionary id: the record prefix already carries the
// kind, the page CRC and the dictionary id, and every byte counts at 4 KiB.
#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_c_format / ZSTD_d_format (magicless frames)
#include "wait-engine/memory/page_codec.h"

#include <zstd.h>

#include <bit>
#include <cstring>
#include <utility>

#include "wait-engine/memory/dictionary.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace sg::memory {

namespace {

constexpr size_t kPage = kCodecPageSize;
constexpr size_t kBlocks = kPage / kCodecBlockSize;
static_assert(kBlocks == 64, "the delta bitmap is one u64");

// ---- CRC32C (Castagnoli). The pool's record layer has its own over the
// stored bytes; this one covers the decoded page, end to end.
struct CrcTable {
  uint32_t t[256];
  constexpr CrcTable() : t() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
  }
};
constexpr CrcTable kCrcTable;

uint32_t crc_portable(const uint8_t* p, size_t n) {
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) c = kCrcTable.t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc_sse42(const uint8_t* p, size_t n) {
  // One stream of 8-byte steps: about 8 bytes per 3 cycles, well under the
  // cost of any zstd pass over the same page.
  uint64_t c = 0xffffffffu;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    c = _mm_crc32_u64(c, w);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; i < n; ++i) c32 = _mm_crc32_u8(c32, p[i]);
  return ~c32;
}
// Immutable once set; __builtin_cpu_init makes the check safe during static
// initialisation, whatever the order of constructors.
const bool kHaveSse42 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") != 0;
}();
#endif

// ---- little-endian helpers
void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

bool is_zero(const uint8_t* p) {
  uint64_t acc = 0;
  for (size_t i = 0; i < kPage; i += 64) {
    uint64_t w[8];
    std::memcpy(w, p + i, 64);
    acc |= w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7];
    if (acc) return false;
  }
  return true;
}

uint64_t diff_bitmap(const uint8_t* page, const uint8_t* tmpl) {
  uint64_t bm = 0;
  for (size_t b = 0; b < kBlocks; ++b)
    if (std::memcmp(page + b * kCodecBlockSize, tmpl + b * kCodecBlockSize, kCodecBlockSize) != 0)
      bm |= uint64_t{1} << b;
  return bm;
}

// Runs payload: (value u8, length u16) per run, lengths >= 1 summing to a
// page. Returns the payload size, or 0 when the page has more than kMaxRuns
// runs (scanning stops there, so a typical page costs a few bytes of scan).
size_t encode_runs(const uint8_t* p, uint8_t* out) {
  size_t runs = 0, o = 0, i = 0;
  while (i < kPage) {
    if (runs == kMaxRuns) return 0;
    uint8_t v = p[i];
    size_t j = i + 1;
    while (j < kPage && p[j] == v) ++j;
    size_t len = j - i;
    out[o++] = v;
    out[o++] = static_cast<uint8_t>(len);
    out[o++] = static_cast<uint8_t>(len >> 8);
    ++runs;
    i = j;
  }
  return o;
}

Error bad(const std::string& what) { return invalid_error("page record: " + what); }

}  // namespace

uint32_t page_crc32c(const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  if (kHaveSse42) return crc_sse42(p, n);
#endif
  return crc_portable(p, n);
}

const char* page_kind_name(PageKind k) {
  switch (k) {
    case PageKind::kTemplateSame: return "template_same";
    case PageKind::kZero: return "zero";
    case PageKind::kRuns: return "runs";
    case PageKind::kDelta: return "delta";
    case PageKind::kDeltaZstd: return "delta_zstd";
    case PageKind::kZstdDict: return "zstd_dict";
    case PageKind::kZstd: return "zstd";
    case PageKind::kRaw: return "raw";
  }
  return "unknown";
}

uint8_t record_kind(std::string_view rec) {
  if (rec.empty()) return 0;
  uint8_t k = static_cast<uint8_t>(rec[0]);
  return k >= 1 && k < kPageKindCount ? k : 0;
}

// The private parts of CodecContext for the functions of this file.
struct CodecAccess {
  // Points cc's compression context at dict (nullptr: plain at level).
  // Parameters persist across frames, so they are set only on a change.
  static bool setup_cctx(CodecContext& cc, const Dictionary* dict, int level) {
    ZSTD_CCtx* c = cc.cctx_;
    const bool dict_mode = dict != nullptr;
    if (cc.cctx_level_ == CodecContext::kUnset || cc.cctx_dict_mode_ != dict_mode ||
        (!dict_mode && cc.cctx_level_ != level)) {
      ZSTD_CCtx_reset(c, ZSTD_reset_session_and_parameters);
      bool ok = !ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_format, ZSTD_f_zstd1_magicless)) &&
                !ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 0)) &&
                !ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 0)) &&
                !ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_dictIDFlag, 0)) &&
                (dict_mode || !ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level)));
      if (!ok) {
        cc.cctx_level_ = CodecContext::kUnset;
        return false;
      }
      cc.cctx_dict_mode_ = dict_mode;
      cc.cctx_level_ = dict_mode ? 0 : level;
    }
    // Referencing is a pointer store; doing it per page means a Dictionary
    // freed between two pages can never be used by a stale reference.
    if (dict_mode && ZSTD_isError(ZSTD_CCtx_refCDict(c, dict->cdict()))) {
      cc.cctx_level_ = CodecContext::kUnset;
      return false;
    }
    return true;
  }

  // Compresses n bytes into dst (capacity cap); 0 when it failed or did not fit.
  static size_t compress(CodecContext& cc, const Dictionary* dict, int level, const uint8_t* src, size_t n,
                         uint8_t* dst, size_t cap) {
    if (!setup_cctx(cc, dict, level)) return 0;
    size_t r = ZSTD_compress2(cc.cctx_, dst, cap, src, n);
    return ZSTD_isError(r) ? 0 : r;
  }

  // Decompresses into dst, which must come out exactly want bytes.
  static Status decompress(CodecContext& cc, const Dictionary* dict, const uint8_t* src, size_t n, uint8_t* dst,
                           size_t want) {
    ZSTD_DCtx* d = cc.dctx_;
    ZSTD_DCtx_reset(d, ZSTD_reset_session_and_parameters);
    if (ZSTD_isError(ZSTD_DCtx_setParameter(d, ZSTD_d_format, ZSTD_f_zstd1_magicless)))
      return internal_error("page record: zstd decoder setup failed");
    if (dict && ZSTD_isError(ZSTD_DCtx_refDDict(d, dict->ddict())))
      return internal_error("page record: zstd dictionary setup failed");
    size_t r = ZSTD_decompressDCtx(d, dst, want, src, n);
    if (ZSTD_isError(r)) return bad(std::string("zstd: ") + ZSTD_getErrorName(r));
    if (r != want) return bad("zstd payload decodes to " + std::to_string(r) + " bytes, expected " + std::to_string(want));
    return Status::Ok();
  }

  static uint8_t* scratch(CodecContext& cc) { return cc.scratch_; }
};

CodecContext::CodecContext() : cctx_(ZSTD_createCCtx()), dctx_(ZSTD_createDCtx()) {}

void CodecContext::reset() {
  if (cctx_) ZSTD_freeCCtx(cctx_);
  if (dctx_) ZSTD_freeDCtx(dctx_);
  cctx_ = nullptr;
  dctx_ = nullptr;
}

CodecContext::~CodecContext() { reset(); }

CodecContext::CodecContext(CodecContext&& o) noexcept
    : cctx_(std::exchange(o.cctx_, nullptr)),
      dctx_(std::exchange(o.dctx_, nullptr)),
      cctx_level_(o.cctx_level_),
      cctx_dict_mode_(o.cctx_dict_mode_) {}

CodecContext& CodecContext::operator=(CodecContext&& o) noexcept {
  if (this != &o) {
    reset();
    cctx_ = std::exchange(o.cctx_, nullptr);
    dctx_ = std::exchange(o.dctx_, nullptr);
    cctx_level_ = o.cctx_level_;
    cctx_dict_mode_ = o.cctx_dict_mode_;
  }
  return *this;
}

EncodeResult encode_page(CodecContext& cc, const uint8_t* page, const EncodeOptions& opt, std::string& out) {
  const uint32_t crc = page_crc32c(page, kPage);
  uint8_t prefix[kRecordPrefixSize];
  put_u32(prefix + 1, crc);
  auto emit = [&](PageKind k, const uint8_t* payload, size_t n) {
    prefix[0] = static_cast<uint8_t>(k);
    // SAFETY: char and uint8_t may alias each other; the lengths are those of the buffers.
    out.append(reinterpret_cast<const char*>(prefix), kRecordPrefixSize);
    if (n) out.append(reinterpret_cast<const char*>(payload), n);
    return EncodeResult{k, kRecordPrefixSize + n};
  };

  uint64_t bitmap = 0;
  if (opt.template_page) {
    bitmap = diff_bitmap(page, opt.template_page);
    if (bitmap == 0) return emit(PageKind::kTemplateSame, nullptr, 0);
  }
  if (is_zero(page)) return emit(PageKind::kZero, nullptr, 0);

  // scratch: [0, kPage + 8) the best payload so far, [kPage + 256, ...) work space.
  uint8_t* best = CodecAccess::scratch(cc);
  uint8_t* work = best + kPage + 256;
  PageKind best_kind = PageKind::kRaw;
  size_t best_n = kPage;
  bool best_is_page = true;  // the raw payload is the page itself: no copy

  if (size_t n = encode_runs(page, work); n != 0 && n < best_n) {
    std::memcpy(best, work, n);
    best_kind = PageKind::kRuns, best_n = n, best_is_page = false;
  }

  if (opt.template_page && cc.ok()) {
    const int k = std::popcount(bitmap);
    const size_t delta_n = 8 + static_cast<size_t>(k) * kCodecBlockSize;
    if (delta_n < best_n) {
      put_u64(best, bitmap);
      uint8_t* o = best + 8;
      for (uint64_t m = bitmap; m; m &= m - 1) {
        size_t b = static_cast<size_t>(std::countr_zero(m));
        std::memcpy(o, page + b * kCodecBlockSize, kCodecBlockSize);
        o += kCodecBlockSize;
      }
      best_kind = PageKind::kDelta, best_n = delta_n, best_is_page = false;
    }
    // XOR against the template leaves zeros where bytes did not change, so
    // blocks with a few changed bytes shrink to almost nothing.
    if (k >= 1 && best_n > 16) {
      uint8_t* x = work;
      for (uint64_t m = bitmap; m; m &= m - 1) {
        size_t b = static_cast<size_t>(std::countr_zero(m));
        const uint8_t* p = page + b * kCodecBlockSize;
        const uint8_t* t = opt.template_page + b * kCodecBlockSize;
        for (size_t i = 0; i < kCodecBlockSize; ++i) x[i] = p[i] ^ t[i];
        x += kCodecBlockSize;
      }
      const size_t xn = static_cast<size_t>(k) * kCodecBlockSize;
      uint8_t* z = work + kPage;
      if (best_n > 8) {
        size_t zn = CodecAccess::compress(cc, nullptr, opt.level, work, xn, z, best_n - 8);
        if (zn != 0 && 8 + zn < best_n) {
          put_u64(best, bitmap);
          std::memcpy(best + 8, z, zn);
          best_kind = PageKind::kDeltaZstd, best_n = 8 + zn, best_is_page = false;
        }
      }
    }
  }

  // One full-page compression: with the dictionary when the cohort has one.
  // A delta already under 1/16 of a page is not worth the zstd pass.
  if (cc.ok() && best_n > kPage / 16) {
    const bool with_dict = opt.dict != nullptr;
    const size_t head = with_dict ? 4 : 0;
    if (best_n > head + 1) {
      size_t zn = CodecAccess::compress(cc, opt.dict, opt.level, page, kPage, work + head, best_n - head - 1);
      if (zn != 0 && head + zn < best_n) {
        if (with_dict) put_u32(work, opt.dict->id());
        std::memcpy(best, work, head + zn);
        best_kind = with_dict ? PageKind::kZstdDict : PageKind::kZstd;
        best_n = head + zn, best_is_page = false;
      }
    }
  }
  return emit(best_kind, best_is_page ? page : best, best_n);
}

Status decode_page(CodecContext& cc, std::string_view rec, const uint8_t* template_page, const Dictionary* dict,
                   uint8_t* out) {
  if (rec.size() < kRecordPrefixSize)
    return bad("truncated: " + std::to_string(rec.size()) + " bytes, shorter than the 5-byte prefix");
  // SAFETY: viewing chars as bytes; every read below is bounded by rec.size().
  const auto* r = reinterpret_cast<const uint8_t*>(rec.data());
  const uint8_t kind = r[0];
  const uint32_t crc = get_u32(r + 1);
  const uint8_t* p = r + kRecordPrefixSize;
  const size_t n = rec.size() - kRecordPrefixSize;
  auto size_is = [&](size_t want) -> Status {
    if (n != want)
      return bad(std::string(page_kind_name(static_cast<PageKind>(kind))) + " payload is " + std::to_string(n) +
                 " bytes, expected " + std::to_string(want));
    return Status::Ok();
  };
  if (kind < 1 || kind >= kPageKindCount) return bad("unknown kind " + std::to_string(kind));
  const PageKind k = static_cast<PageKind>(kind);
  const bool needs_template = k == PageKind::kTemplateSame || k == PageKind::kDelta || k == PageKind::kDeltaZstd;
  if (needs_template && !template_page) return bad(std::string(page_kind_name(k)) + " record without a template page");
  if ((needs_template || k == PageKind::kZstdDict || k == PageKind::kZstd) && !cc.ok())
    return internal_error("page record: codec context has no zstd state");

  switch (k) {
    case PageKind::kTemplateSame:
      if (Status s = size_is(0); !s) return s;
      std::memcpy(out, template_page, kPage);
      break;
    case PageKind::kZero:
      if (Status s = size_is(0); !s) return s;
      std::memset(out, 0, kPage);
      break;
    case PageKind::kRuns: {
      if (n == 0 || n % 3 != 0 || n / 3 > kMaxRuns) return bad("runs payload of " + std::to_string(n) + " bytes");
      size_t o = 0;
      for (size_t i = 0; i < n; i += 3) {
        size_t len = static_cast<size_t>(p[i + 1]) | static_cast<size_t>(p[i + 2]) << 8;
        if (len == 0 || len > kPage - o) return bad("runs lengths do not sum to a page");
        std::memset(out + o, p[i], len);
        o += len;
      }
      if (o != kPage) return bad("runs lengths sum to " + std::to_string(o) + ", expected 4096");
      break;
    }
    case PageKind::kDelta:
    case PageKind::kDeltaZstd: {
      if (n < 8) return bad("delta payload of " + std::to_string(n) + " bytes has no bitmap");
      const uint64_t bm = get_u64(p);
      if (bm == 0) return bad("delta with an empty bitmap");
      const size_t blocks_n = static_cast<size_t>(std::popcount(bm)) * kCodecBlockSize;
      const uint8_t* blocks = p + 8;
      uint8_t* tmp = CodecAccess::scratch(cc);
      if (k == PageKind::kDelta) {
        if (Status s = size_is(8 + blocks_n); !s) return s;
      } else {
        if (Status s = CodecAccess::decompress(cc, nullptr, p + 8, n - 8, tmp, blocks_n); !s) return s;
        blocks = tmp;
      }
      std::memcpy(out, template_page, kPage);
      const uint8_t* b = blocks;
      for (uint64_t m = bm; m; m &= m - 1) {
        uint8_t* o = out + static_cast<size_t>(std::countr_zero(m)) * kCodecBlockSize;
        if (k == PageKind::kDelta) {
          std::memcpy(o, b, kCodecBlockSize);
        } else {
          for (size_t i = 0; i < kCodecBlockSize; ++i) o[i] ^= b[i];
        }
        b += kCodecBlockSize;
      }
      break;
    }
    case PageKind::kZstdDict: {
      if (n < 4) return bad("zstd_dict payload of " + std::to_string(n) + " bytes has no dictionary id");
      const uint32_t id = get_u32(p);
      if (!dict) return bad("zstd_dict record for dictionary " + std::to_string(id) + " without a dictionary");
      if (dict->id() != id)
        return bad("zstd_dict record for dictionary " + std::to_string(id) + ", given dictionary " +
                   std::to_string(dict->id()));
      if (Status s = CodecAccess::decompress(cc, dict, p + 4, n - 4, out, kPage); !s) return s;
      break;
    }
    case PageKind::kZstd:
      if (Status s = CodecAccess::decompress(cc, nullptr, p, n, out, kPage); !s) return s;
      break;
    case PageKind::kRaw:
      if (Status s = size_is(kPage); !s) return s;
      std::memcpy(out, p, kPage);
      break;
  }
  if (page_crc32c(out, kPage) != crc) return bad(std::string(page_kind_name(k)) + ": page checksum mismatch");
  return Status::Ok();
}

}  // namespace sg::memory
