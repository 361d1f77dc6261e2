// apply_layer (sandbox-runtime/builds/oci_layer.h) on hostile layers made
// here: nothing may land outside the root, whatever names, symlinks and
// hard links say; whiteouts act on earlier layers. Needs root (owners are
// kept); skipped otherwise (exit 77, its own CTest entry).
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <cstring>
#include <string>
#include <vector>

#include "base/sys.h"
#include "sandbox-runtime/builds/oci_layer.h"
#include "sandbox-runtime/builds/registry.h"
#include "tests/support/skip.h"
#include "tests/support/temp_dir.h"

using namespace sg;

namespace {

struct Member {
  std::string name;
  char type = '0';  // '0' file, '5' dir, '2' symlink, '1' hard link
  std::string data;
  std::string link;
  unsigned mode = 0644;
};

std::string tar(const std::vector<Member>& ms) {
  std::string out;
  for (const Member& m : ms) {
    char h[512] = {};
    std::memcpy(h, m.name.data(), std::min<size_t>(m.name.size(), 100));
    std::snprintf(h + 100, 8, "%07o", m.mode);
    std::snprintf(h + 108, 8, "%07o", 0);
    std::snprintf(h + 116, 8, "%07o", 0);
    std::snprintf(h + 124, 12, "%011o", static_cast<unsigned>(m.type == '0' ? m.data.size() : 0));
    std::snprintf(h + 136, 12, "%011o", 1700000000u);
    std::memset(h + 148, ' ', 8);
    h[156] = m.type;
    std::memcpy(h + 157, m.link.data(), std::min<size_t>(m.link.size(), 100));
    std::memcpy(h + 257, "ustar", 6);
    h[263] = '0';
    h[264] = '0';
    unsigned sum = 0;
    for (unsigned char c : h) sum += c;
    std::snprintf(h + 148, 8, "%06o", sum);
    h[155] = ' ';
    out.append(h, 512);
    if (m.type == '0') {
      out += m.data;
      out.append((512 - m.data.size() % 512) % 512, '\0');
    }
  }
  out.append(1024, '\0');
  return out;
}

std::string gzip(const std::string& in) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  std::string out(in.size() + 1024, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string zstd(const std::string& in, int level = 3) {
  std::string out(ZSTD_compressBound(in.size()), '\0');
  size_t n = ZSTD_compress(out.data(), out.size(), in.data(), in.size(), level);
  REQUIRE_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

struct Env {
  test::TempDir dir;
  std::string root = dir.sub("root");
  std::string outside = dir.sub("outside");
  Env() {
    if (::geteuid() != 0) test::skip_case("needs root (layers keep their owners)");
    REQUIRE(sys::make_dirs(root));
    REQUIRE(sys::make_dirs(outside));
  }
  Result<builds::AppliedLayer> apply(const std::vector<Member>& ms, bool gz = true) {
    std::string f = dir.sub("layer-" + sys::random_hex(3));
    REQUIRE(sys::write_file(f, gz ? gzip(tar(ms)) : tar(ms)));
    return builds::apply_layer(root, f);
  }
};

}  // namespace

TEST_CASE("oci layer: files, directories, links and modes; whiteouts and opaque directories act on earlier layers" *
          doctest::test_suite("own-entry")) {
  Env e;
  auto one = e.apply({{"etc/", '5'}, {"etc/conf", '0', "a=1\n"}, {"bin/", '5'}, {"bin/tool", '0', "#!", "", 0755},
                      {"bin/alias", '2', "", "tool"}, {"bin/hard", '1', "", "bin/tool"}, {"d/", '5'},
                      {"d/old1", '0', "x"}, {"d/old2", '0', "y"}, {"gone", '0', "bye"}});
  REQUIRE_MESSAGE(one, (one ? "" : one.error().message()));
  CHECK(one->entries == 10);
  CHECK(*sys::read_file(e.root + "/etc/conf") == "a=1\n");
  struct stat st;
  REQUIRE(::stat((e.root + "/bin/tool").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0755);
  CHECK(st.st_nlink == 2);
  CHECK(st.st_mtime == 1700000000);
  auto two = e.apply({{".wh.gone", '0', ""}, {"d/.wh..wh..opq", '0', ""}, {"d/new", '0', "z"}}, false);
  REQUIRE_MESSAGE(two, (two ? "" : two.error().message()));
  CHECK(two->whiteouts == 2);
  CHECK_FALSE(sys::path_exists(e.root + "/gone"));
  CHECK_FALSE(sys::path_exists(e.root + "/d/old1"));
  CHECK(sys::path_exists(e.root + "/d/new"));
  CHECK_FALSE(sys::path_exists(e.root + "/d/.wh..wh..opq"));
}

TEST_CASE("oci layer: no member reaches outside the root" * doctest::test_suite("own-entry")) {
  Env e;
  // '..' in a name: refused.
  auto up = e.apply({{"../outside/x", '0', "no"}});
  REQUIRE_FALSE(up);
  CHECK(up.error().message().find("climbs out") != std::string::npos);
  // An absolute name lands inside.
  REQUIRE(e.apply({{"/abs/file", '0', "in"}}));
  CHECK(sys::path_exists(e.root + "/abs/file"));
  // A symlink to the host's root, an absolute symlink and a relative one
  // that climbs: what is written through them stays in the root.
  std::string o = e.outside;
  auto links = e.apply({{"to-root", '2', "", "/"}, {"to-outside", '2', "", o}, {"climb", '2', "", "../../../../"},
                        {"to-root" + o + "/a", '0', "1"}, {"to-outside/b", '0', "2"}, {"climb" + o + "/c", '0', "3"}});
  REQUIRE_MESSAGE(links, (links ? "" : links.error().message()));
  for (const char* f : {"/a", "/b", "/c"}) {
    std::string p = o + f;
    CHECK_MESSAGE(!sys::path_exists(p), p);
  }
  CHECK(sys::path_exists(e.root + o + "/a"));
  CHECK(sys::path_exists(e.root + o + "/b"));
  // A hard link to a file outside: refused or resolved inside, never the
  // host's file.
  REQUIRE(sys::write_file(o + "/secret", "host"));
  auto hard = e.apply({{"h", '1', "", "../outside/secret"}});
  REQUIRE_FALSE(hard);
  auto hard2 = e.apply({{"h2", '1', "", "to-outside/secret"}});
  CHECK_FALSE(hard2);  // to-outside resolves inside the root, where there is no secret
  // A whiteout through a symlink removes nothing outside.
  REQUIRE(sys::write_file(o + "/keep", "k"));
  REQUIRE(e.apply({{"to-outside/.wh.keep", '0', ""}}));
  CHECK(sys::path_exists(o + "/keep"));
}

TEST_CASE("oci layer: malformed archives are errors" * doctest::test_suite("own-entry")) {
  Env e;
  std::string t = tar({{"f", '0', std::string(2000, 'x')}});
  std::string f = e.dir.sub("cut");
  REQUIRE(sys::write_file(f, t.substr(0, 1000)));
  auto cut = builds::apply_layer(e.root, f);
  REQUIRE_FALSE(cut);
  CHECK(cut.error().message().find("ends inside") != std::string::npos);
  std::string bad = t;
  bad[148] = '9';  // the checksum
  REQUIRE(sys::write_file(f, bad));
  auto sum = builds::apply_layer(e.root, f);
  REQUIRE_FALSE(sum);
  CHECK(sum.error().message().find("checksum") != std::string::npos);
  builds::LayerLimits lim;
  lim.max_bytes = 100;
  REQUIRE(sys::write_file(f, t));
  auto big = builds::apply_layer(e.root, f, lim);
  REQUIRE_FALSE(big);
}

TEST_CASE("oci layer: zstd layers, in one frame or several, apply as gzip ones do; a cut or corrupt one is an error" *
          doctest::test_suite("own-entry")) {
  Env e;
  std::string big(300000, 'b');  // more than one 64 KiB read of input and of output
  for (size_t i = 0; i < big.size(); i += 7) big[i] = static_cast<char>('a' + i % 23);
  std::string t = tar({{"etc/", '5'}, {"etc/conf", '0', "z=1\n"}, {"data", '0', big}});
  std::string f = e.dir.sub("layer.zst");
  REQUIRE(sys::write_file(f, zstd(t)));
  auto one = builds::apply_layer(e.root, f);
  REQUIRE_MESSAGE(one, (one ? "" : one.error().message()));
  CHECK(one->entries == 3);
  CHECK(*sys::read_file(e.root + "/etc/conf") == "z=1\n");
  CHECK(*sys::read_file(e.root + "/data") == big);
  // Frames one after another (as a parallel compressor writes them).
  std::string t2 = tar({{"two", '0', "second\n"}, {"more", '0', big.substr(0, 70000)}});
  REQUIRE(sys::write_file(f, zstd(t2.substr(0, 5000), 1) + zstd(t2.substr(5000), 19)));
  auto two = builds::apply_layer(e.root, f);
  REQUIRE_MESSAGE(two, (two ? "" : two.error().message()));
  CHECK(*sys::read_file(e.root + "/two") == "second\n");
  CHECK(*sys::read_file(e.root + "/more") == big.substr(0, 70000));
  // Cut inside a frame: said so, not taken as the end.
  std::string z = zstd(tar({{"cut", '0', big}}));
  REQUIRE(sys::write_file(f, z.substr(0, z.size() / 2)));
  auto cut = builds::apply_layer(e.root, f);
  REQUIRE_FALSE(cut);
  CHECK(cut.error().kind() == ErrorKind::kInvalid);
  // Corrupt after the magic.
  std::string bad = z;
  for (size_t i = 8; i < 64 && i < bad.size(); ++i) bad[i] = static_cast<char>(0xff);
  REQUIRE(sys::write_file(f, bad));
  auto corrupt = builds::apply_layer(e.root, f);
  REQUIRE_FALSE(corrupt);
  CHECK(corrupt.error().kind() == ErrorKind::kInvalid);
}

TEST_CASE("image references: registry, repository, tag or digest, Docker Hub's defaults") {
  auto r = builds::parse_image_ref("python:3.12");
  REQUIRE(r);
  CHECK(r->registry == "registry-1.docker.io");
  CHECK(r->repository == "library/python");
  CHECK(r->reference == "3.12");
  r = builds::parse_image_ref("127.0.0.1:5000/team/app");
  REQUIRE(r);
  CHECK(r->registry == "127.0.0.1:5000");
  CHECK(r->repository == "team/app");
  CHECK(r->reference == "latest");
  std::string d = "sha256:" + std::string(64, 'a');
  r = builds::parse_image_ref("ghcr.io/o/r@" + d);
  REQUIRE(r);
  CHECK(r->registry == "ghcr.io");
  CHECK(r->reference == d);
  CHECK(r->text() == "ghcr.io/o/r@" + d);
  r = builds::parse_image_ref("localhost/x:1");
  REQUIRE(r);
  CHECK(r->registry == "localhost");
  for (const char* bad : {"", "UPPER/case", "a b", "x@sha256:12", "x:", "reg.io/", "$(id)"})
    CHECK_MESSAGE(!builds::parse_image_ref(bad), bad);
}
