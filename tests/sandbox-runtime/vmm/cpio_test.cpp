// CpioWriter: the archive is parsed back with an independent newc reader
// (the kernel's buffer-format.rst): names, modes, sizes, data, 4-byte
// alignment of every header and body, and the TRAILER!!! entry.
#include <doctest/doctest.h>

#include <cctype>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "sandbox-runtime/vmm/boot/cpio.h"

using namespace sg::vmm::boot;

namespace {

struct Entry {
  std::string name;
  uint32_t ino, mode, nlink, size;
  std::string data;
  size_t offset;  // of the header in the archive
};

uint32_t hex8(const std::string& s, size_t at) {
  std::string f = s.substr(at, 8);
  for (char c : f) REQUIRE(std::isxdigit(static_cast<unsigned char>(c)));
  return static_cast<uint32_t>(std::strtoul(f.c_str(), nullptr, 16));
}

size_t align4(size_t v) { return (v + 3) & ~size_t{3}; }

std::vector<Entry> parse(const std::string& a) {
  std::vector<Entry> out;
  size_t pos = 0;
  for (;;) {
    REQUIRE(pos % 4 == 0);
    REQUIRE(pos + 110 <= a.size());
    REQUIRE(a.substr(pos, 6) == "070701");
    Entry e{};
    e.offset = pos;
    e.ino = hex8(a, pos + 6);
    e.mode = hex8(a, pos + 14);
    e.nlink = hex8(a, pos + 38);
    e.size = hex8(a, pos + 54);
    uint32_t namesize = hex8(a, pos + 94);
    CHECK(hex8(a, pos + 102) == 0);  // check field: 0 for newc
    REQUIRE(namesize >= 1);
    REQUIRE(pos + 110 + namesize <= a.size());
    CHECK(a[pos + 110 + namesize - 1] == '\0');
    e.name = a.substr(pos + 110, namesize - 1);
    size_t data = align4(pos + 110 + namesize);
    for (size_t i = pos + 110 + namesize; i < data; ++i) CHECK(a[i] == '\0');
    REQUIRE(data + e.size <= a.size());
    e.data = a.substr(data, e.size);
    pos = align4(data + e.size);
    for (size_t i = data + e.size; i < pos; ++i) CHECK(a[i] == '\0');
    out.push_back(e);
    if (e.name == "TRAILER!!!") break;
  }
  CHECK(pos == a.size());  // nothing after the trailer
  return out;
}

}  // namespace

TEST_CASE("cpio: the archive parses back with names, modes, sizes and data") {
  CpioWriter w;
  w.add_dir("sbin", 0755);
  w.add_file("sbin/sandgate-agent", 0755, std::string("\x7f" "ELF\0\1\2", 7));
  w.add_file("etc/hostname", 0644, "sandbox\n");
  w.add_file("empty", 0600, "");
  w.add_file("a", 04755 | 0170000, "xyz");  // type bits in the mode are replaced
  std::string a = w.finish();
  CHECK(a.size() % 4 == 0);
  std::vector<Entry> e = parse(a);
  REQUIRE(e.size() == 6);
  CHECK(e[0].name == "sbin");
  CHECK(e[0].mode == 040755);
  CHECK(e[0].size == 0);
  CHECK(e[1].name == "sbin/sandgate-agent");
  CHECK(e[1].mode == 0100755);
  CHECK(e[1].size == 7);
  CHECK(e[1].data == std::string("\x7f" "ELF\0\1\2", 7));
  CHECK(e[2].name == "etc/hostname");
  CHECK(e[2].mode == 0100644);
  CHECK(e[2].data == "sandbox\n");
  CHECK(e[3].size == 0);
  CHECK(e[3].mode == 0100600);
  CHECK(e[4].mode == 0104755);
  CHECK(e[4].data == "xyz");
  CHECK(e[5].name == "TRAILER!!!");
  CHECK(e[5].size == 0);
  CHECK(e[5].mode == 0);
  std::set<uint32_t> inos;
  for (const Entry& x : e) {
    CHECK(x.nlink == 1);
    inos.insert(x.ino);
  }
  CHECK(inos.size() == e.size());  // distinct inode numbers: no hard-link merging
}

TEST_CASE("cpio: every name and data length pads to 4 bytes") {
  for (size_t name_len = 1; name_len <= 8; ++name_len) {
    for (size_t data_len = 0; data_len <= 8; ++data_len) {
      CpioWriter w;
      std::string name(name_len, 'n');
      std::string data(data_len, 'd');
      w.add_file(name, 0644, data);
      std::string a = w.finish();
      CAPTURE(name_len);
      CAPTURE(data_len);
      std::vector<Entry> e = parse(a);
      REQUIRE(e.size() == 2);
      CHECK(e[0].name == name);
      CHECK(e[0].data == data);
      CHECK(e[1].offset % 4 == 0);
    }
  }
}

TEST_CASE("cpio: an empty archive is just the trailer") {
  CpioWriter w;
  std::vector<Entry> e = parse(w.finish());
  REQUIRE(e.size() == 1);
  CHECK(e[0].name == "TRAILER!!!");
}
