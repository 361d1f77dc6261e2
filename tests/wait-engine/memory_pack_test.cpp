// Pause packing (wait-engine/memory/pause_pack.h): a paused microVM's RAM
// kept as what differs from its base, checked on the way back. Round trips
// byte for byte (holes, pages past either file's end), packs of a resumed
// pause use the first base (no chains), every kind of damage is refused
// with no memory file made, and a failure of any host call in either
// direction loses nothing.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "base/sys.h"
#include "tests/support/faulty_os.h"
#include "tests/support/temp_dir.h"
#include "wait-engine/memory/pause_pack.h"

using namespace sg;
using namespace sg::memory;
using sg::test::TempDir;

namespace {

constexpr size_t kP = 4096;
using Bytes = std::vector<uint8_t>;

// Writes data to path, leaving holes where whole pages are zero (as the VMM does).
void write_sparse(const std::string& path, const Bytes& data) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, static_cast<off_t>(data.size())) == 0);
  static const uint8_t zero[kP] = {};
  for (size_t off = 0; off < data.size(); off += kP)
    if (std::memcmp(data.data() + off, zero, kP) != 0)
      REQUIRE(::pwrite(fd, data.data() + off, kP, static_cast<off_t>(off)) == static_cast<ssize_t>(kP));
  ::close(fd);
}

Bytes read_all(const std::string& path) {
  auto s = sys::read_file(path, 64 << 20);
  REQUIRE(s);
  return Bytes(s->begin(), s->end());
}

void fill_random(uint8_t* p, size_t n, std::mt19937& rng) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

// A base of 300 pages (a third holes) and RAM of 320 pages made from it
// the way a running guest changes memory: most pages untouched, some with
// a few bytes changed, some zeroed, some new, some text-like, and pages
// past the base's end.
struct Memories {
  Bytes base, ram;
};
Memories make_memories(uint32_t seed) {
  std::mt19937 rng(seed);
  Memories m;
  m.base.assign(300 * kP, 0);
  for (size_t p = 0; p < 300; ++p)
    if (p % 3 != 1) fill_random(m.base.data() + p * kP, kP, rng);
  m.ram.assign(320 * kP, 0);
  std::memcpy(m.ram.data(), m.base.data(), m.base.size());
  for (size_t p = 0; p < 320; ++p) {
    uint8_t* page = m.ram.data() + p * kP;
    switch (p % 10) {
      case 2: page[rng() % kP] ^= 0x5a, page[rng() % kP] ^= 0x33; break;  // a few bytes
      case 4: std::memset(page, 0, kP); break;                               // freed and zeroed
      case 6: fill_random(page, kP, rng); break;                             // new data
      case 8:
        for (size_t i = 0; i < kP; ++i) page[i] = "sandgate pause "[i % 15];  // compressible
        break;
      default: break;  // untouched
    }
  }
  return m;
}

// dir with the VMM's files: memory and vm.state; the base beside it.
struct Layer {
  TempDir tmp;
  std::string dir = tmp.sub("pause"), base = tmp.sub("template-memory");
  Memories m;
  explicit Layer(uint32_t seed = 1) : m(make_memories(seed)) {
    REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
    write_sparse(dir + "/memory", m.ram);
    write_sparse(base, m.base);
    REQUIRE(sys::write_file(dir + "/vm.state", "state"));
  }
  std::string file(const char* name) const { return dir + "/" + name; }
};

uint64_t inode(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_ino;
}

void flip_byte(const std::string& path, off_t off) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  uint8_t b = 0;
  REQUIRE(::pread(fd, &b, 1, off) == 1);
  b ^= 0x01;
  REQUIRE(::pwrite(fd, &b, 1, off) == 1);
  ::close(fd);
}

}  // namespace

TEST_CASE("pause pack: only what differs from the base is stored, and it comes back byte for byte") {
  Layer l;
  PausePacker packer;
  auto st = packer.pack_stats(l.dir, l.base);
  REQUIRE_MESSAGE(st, st.error().message());
  CHECK(st->mem_bytes == l.m.ram.size());
  // Pages 0..299 with p % 10 in {0,1,3,5,7,9} are untouched (as are
  // zeroed pages over base holes); the rest, and new data past the base, differ.
  CHECK(st->pages_same + st->pages_stored == 320);
  CHECK(st->pages_same >= 180);
  CHECK(st->stored_bytes < l.m.ram.size() / 4);
  CHECK_FALSE(sys::path_exists(l.file("memory")));
  CHECK(sys::path_exists(l.file("memory.sgm")));
  CHECK_FALSE(sys::path_exists(l.file("memory.sgm.partial")));
  CHECK(inode(l.file("memory.base")) == inode(l.base));  // a link, not a copy
  CHECK(sys::path_exists(l.file("vm.state")));

  REQUIRE(packer.unpack(l.dir));
  CHECK(read_all(l.file("memory")) == l.m.ram);
  CHECK_FALSE(sys::path_exists(l.file("memory.partial")));
  // The unpacked file is sparse where the RAM is zero.
  struct stat s {};
  REQUIRE(::stat(l.file("memory").c_str(), &s) == 0);
  CHECK(static_cast<uint64_t>(s.st_blocks) * 512 < l.m.ram.size());
  // Unpacking what is unpacked changes nothing.
  REQUIRE(packer.unpack(l.dir));
  CHECK(read_all(l.file("memory")) == l.m.ram);
}

TEST_CASE("pause pack: the base may be gone from its own place; the link keeps it") {
  Layer l;
  PausePacker packer;
  REQUIRE(packer.pack(l.dir, l.base));
  REQUIRE(::unlink(l.base.c_str()) == 0);  // the template's snapshot cache evicted it
  REQUIRE(packer.unpack(l.dir));
  CHECK(read_all(l.file("memory")) == l.m.ram);
}

TEST_CASE("pause pack: a pause of a resumed pause is packed against the first base") {
  Layer l;
  PausePacker packer;
  REQUIRE(packer.pack(l.dir, l.base));
  REQUIRE(packer.unpack(l.dir));
  // The resumed sandbox runs from l.dir/memory and is paused again.
  std::string dir2 = l.tmp.sub("pause2");
  REQUIRE(::mkdir(dir2.c_str(), 0700) == 0);
  Bytes ram2 = l.m.ram;
  ram2[5 * kP + 7] ^= 0xff;
  write_sparse(dir2 + "/memory", ram2);
  auto st = packer.pack_stats(dir2, l.file("memory"));
  REQUIRE_MESSAGE(st, st.error().message());
  CHECK(inode(dir2 + "/memory.base") == inode(l.base));
  // The first pause can go (a new pause replaces the old one).
  REQUIRE(sys::remove_tree(l.dir));
  REQUIRE(packer.unpack(dir2));
  CHECK(read_all(dir2 + "/memory") == ram2);
}

TEST_CASE("pause pack: damage is refused with a clear error and no memory file") {
  struct Case {
    const char* name;
    std::function<void(Layer&)> harm;
    const char* says;
  };
  std::vector<Case> cases = {
      {"header byte", [](Layer& l) { flip_byte(l.file("memory.sgm"), 20); }, "header checksum mismatch"},
      {"magic", [](Layer& l) { flip_byte(l.file("memory.sgm"), 0); }, "bad magic"},
      {"body byte",
       [](Layer& l) {
         struct stat s {};
         REQUIRE(::stat(l.file("memory.sgm").c_str(), &s) == 0);
         flip_byte(l.file("memory.sgm"), s.st_size - 100);
       },
       "the paused memory"},
      {"truncated",
       [](Layer& l) {
         struct stat s {};
         REQUIRE(::stat(l.file("memory.sgm").c_str(), &s) == 0);
         REQUIRE(::truncate(l.file("memory.sgm").c_str(), s.st_size - 3) == 0);
       },
       "its header says"},
      {"base changed", [](Layer& l) { flip_byte(l.file("memory.base"), 3 * kP + 9); }, "base"},
      {"base replaced",
       [](Layer& l) {
         REQUIRE(::unlink(l.file("memory.base").c_str()) == 0);
         write_sparse(l.file("memory.base"), Bytes(l.m.base.size(), 7));
       },
       "checksum mismatch"},
      {"base missing", [](Layer& l) { REQUIRE(::unlink(l.file("memory.base").c_str()) == 0); }, "memory.base"},
      {"base shorter",
       [](Layer& l) {
         REQUIRE(::unlink(l.file("memory.base").c_str()) == 0);
         write_sparse(l.file("memory.base"), Bytes(l.m.base.begin(), l.m.base.end() - kP));
       },
       "packed against"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    Layer l;
    PausePacker packer;
    REQUIRE(packer.pack(l.dir, l.base));
    c.harm(l);
    Status s = packer.unpack(l.dir);
    REQUIRE_FALSE(s);
    CHECK(s.error().message().find(c.says) != std::string::npos);
    CAPTURE(s.error().message());
    CHECK_FALSE(sys::path_exists(l.file("memory")));
    CHECK_FALSE(sys::path_exists(l.file("memory.partial")));
  }
}

TEST_CASE("pause pack: a body byte flipped in any record is caught") {
  // Every 97th byte of the body, each on a fresh pack: a page CRC, a
  // record bound or the body CRC refuses it; never a memory file.
  Layer proto;
  PausePacker packer;
  REQUIRE(packer.pack(proto.dir, proto.base));
  struct stat s {};
  REQUIRE(::stat(proto.file("memory.sgm").c_str(), &s) == 0);
  std::string good = *sys::read_file(proto.file("memory.sgm"), 64 << 20);
  int caught = 0;
  for (off_t off = 64; off < s.st_size; off += 97) {
    std::string bad = good;
    bad[static_cast<size_t>(off)] ^= 0x10;
    REQUIRE(::unlink(proto.file("memory.sgm").c_str()) == 0);
    REQUIRE(sys::write_file(proto.file("memory.sgm"), bad));
    Status u = packer.unpack(proto.dir);
    CHECK_FALSE(u);
    CHECK_FALSE(sys::path_exists(proto.file("memory")));
    caught += !u;
  }
  CHECK(caught > 10);
}

TEST_CASE("pause pack: a wrong RAM file is refused and left alone") {
  TempDir tmp;
  std::string dir = tmp.sub("p");
  REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
  REQUIRE(sys::write_file(dir + "/memory", std::string(100, 'x')));  // not whole pages
  REQUIRE(sys::write_file(tmp.sub("base"), std::string(kP, 'y')));
  PausePacker packer;
  auto r = packer.pack(dir, tmp.sub("base"));
  REQUIRE_FALSE(r);
  CHECK(r.error().message().find("not guest RAM") != std::string::npos);
  CHECK(sys::path_exists(dir + "/memory"));
  CHECK_FALSE(sys::path_exists(dir + "/memory.sgm"));
  CHECK_FALSE(sys::path_exists(dir + "/memory.base"));
  // No base: refused, the RAM kept.
  REQUIRE(::unlink((dir + "/memory").c_str()) == 0);
  write_sparse(dir + "/memory", Bytes(4 * kP, 1));
  r = packer.pack(dir, tmp.sub("no-such-base"));
  REQUIRE_FALSE(r);
  CHECK(sys::path_exists(dir + "/memory"));
  CHECK_FALSE(sys::path_exists(dir + "/memory.base"));
}

TEST_CASE("pause pack: a failure of any host call while packing loses nothing") {
  test::FaultyOs os;
  PausePacker packer(os);
  uint64_t calls = 0;
  {
    Layer l;
    os.reset();
    REQUIRE(packer.pack(l.dir, l.base));
    calls = os.calls();
  }
  REQUIRE(calls >= 6);
  for (uint64_t n = 1; n <= calls; ++n) {
    CAPTURE(n);
    Layer l;
    os.reset();
    os.fail_at(n);
    auto r = packer.pack(l.dir, l.base);
    CAPTURE(os.fired());
    REQUIRE_FALSE(r);
    CHECK_FALSE(sys::path_exists(l.file("memory.sgm.partial")));
    if (sys::path_exists(l.file("memory"))) {
      // Not packed (or packed, and the RAM not yet removed): the RAM is whole.
      CHECK(read_all(l.file("memory")) == l.m.ram);
    } else {
      // Packed and the raw file gone: only the last directory sync failed.
      CHECK(os.fired().find(": fsync") != std::string::npos);
    }
    os.fail_at(0);
    REQUIRE(PausePacker().unpack(l.dir));
    CHECK(read_all(l.file("memory")) == l.m.ram);
  }
}

TEST_CASE("pause pack: a failure of any host call while unpacking leaves no memory file") {
  test::FaultyOs os;
  PausePacker packer(os);
  Layer l;
  REQUIRE(PausePacker().pack(l.dir, l.base));
  os.reset();
  REQUIRE(packer.unpack(l.dir));
  const uint64_t calls = os.calls();
  REQUIRE(calls >= 4);
  for (uint64_t n = 1; n <= calls; ++n) {
    CAPTURE(n);
    REQUIRE(::unlink(l.file("memory").c_str()) == 0);
    os.reset();
    os.fail_at(n);
    Status s = packer.unpack(l.dir);
    CAPTURE(os.fired());
    if (s) {
      CHECK(false);  // every call counted must be able to fail the unpack
      continue;
    }
    // The last call is the directory sync after the rename: the file is whole.
    if (sys::path_exists(l.file("memory")))
      CHECK(read_all(l.file("memory")) == l.m.ram);
    CHECK_FALSE(sys::path_exists(l.file("memory.partial")));
    os.fail_at(0);
    REQUIRE(packer.unpack(l.dir));
    CHECK(read_all(l.file("memory")) == l.m.ram);
  }
}
