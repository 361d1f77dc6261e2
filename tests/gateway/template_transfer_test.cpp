// The tree transfer between cluster nodes (gateway/template_transfer.h):
// a real tar at both ends; streams kept in files so that each can be cut,
// changed or extended before it is received.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <openssl/sha.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <string>

#include "base/fd.h"
#include "base/hex.h"
#include "base/sys.h"
#include "gateway/template_transfer.h"
#include "tests/support/temp_dir.h"

using namespace sg;
using namespace sg::gateway;

namespace {

constexpr std::chrono::milliseconds kIdle{5000};

void write_file(const std::string& path, const std::string& body, mode_t mode) {
  REQUIRE(sys::write_file(path, body).ok());
  REQUIRE(::chmod(path.c_str(), mode) == 0);
}

// A template-like tree: a file with a mode, a nested directory, a symlink
// and an overlay whiteout (a 0/0 character device).
void make_tree(const std::string& dir) {
  REQUIRE(sys::make_dirs(dir + "/etc/app", 0755).ok());
  write_file(dir + "/etc/app/conf", std::string(100000, 'x') + "end", 0640);
  write_file(dir + "/run.sh", "#!/bin/sh\necho hi\n", 0751);
  REQUIRE(::symlink("../run.sh", (dir + "/etc/link").c_str()) == 0);
  REQUIRE(::mknod((dir + "/gone").c_str(), S_IFCHR | 0000, makedev(0, 0)) == 0);
}

// The stream send_tree writes for dir.
std::string stream_of(const test::TempDir& tmp, const std::string& dir) {
  std::string path = tmp.sub("stream");
  UniqueFd out(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  REQUIRE(out.get() >= 0);
  CHECK(transfer::send_tree(dir, out.get(), tmp.sub("send.log")));
  out.reset();
  auto body = sys::read_file(path);
  REQUIRE(body.ok());
  return *body;
}

// receive_tree of `stream` into a fresh directory `name`.
Result<uint64_t> receive(const test::TempDir& tmp, const std::string& stream, const std::string& name) {
  std::string path = tmp.sub(name + ".in");
  REQUIRE(sys::write_file(path, stream).ok());
  REQUIRE(sys::make_dirs(tmp.sub(name), 0755).ok());
  UniqueFd in(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  REQUIRE(in.get() >= 0);
  return transfer::receive_tree(in.get(), tmp.sub(name), tmp.sub(name + ".log"), kIdle);
}

std::string sha256_hex(const std::string& s) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d);
  return hex_lower(d, sizeof d);
}

void check_refused(const Result<uint64_t>& r, const std::string& why) {
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().kind() == ErrorKind::kUnavailable);
  INFO(r.error().message());
  CHECK(r.error().message().find(why) != std::string::npos);
}

}  // namespace

TEST_CASE("template transfer: a tree arrives whole, with modes, links and whiteouts") {
  ::signal(SIGPIPE, SIG_IGN);
  test::TempDir tmp;
  make_tree(tmp.sub("src"));
  std::string stream = stream_of(tmp, tmp.sub("src"));
  auto got = receive(tmp, stream, "dst");
  REQUIRE(got.ok());
  CHECK(*got == stream.size());
  CHECK(sys::read_file(tmp.sub("dst/etc/app/conf")).value() == std::string(100000, 'x') + "end");
  struct stat st;
  REQUIRE(::stat(tmp.sub("dst/run.sh").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0751);
  REQUIRE(::stat(tmp.sub("dst/etc/app/conf").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0640);
  char target[64] = {};
  REQUIRE(::readlink(tmp.sub("dst/etc/link").c_str(), target, sizeof target - 1) > 0);
  CHECK(std::string(target) == "../run.sh");
  REQUIRE(::lstat(tmp.sub("dst/gone").c_str(), &st) == 0);
  CHECK(S_ISCHR(st.st_mode));
  CHECK(st.st_rdev == makedev(0, 0));
}

TEST_CASE("template transfer: a stream cut, changed, extended or stalled is refused") {
  ::signal(SIGPIPE, SIG_IGN);
  test::TempDir tmp;
  make_tree(tmp.sub("src"));
  std::string stream = stream_of(tmp, tmp.sub("src"));
  REQUIRE(stream.size() > 20480 + 82);
  std::string tar = stream.substr(0, stream.size() - 82);

  // Cut at a tar block boundary: tar alone would take it; the trailer is missing.
  check_refused(receive(tmp, stream.substr(0, 10240), "cut"), "without its trailer");
  // The whole tar, no trailer (a sender that died before writing it).
  check_refused(receive(tmp, tar, "bare"), "without its trailer");
  check_refused(receive(tmp, "", "empty"), "without its trailer");
  // One byte of a file's content changed on the way.
  std::string changed = stream;
  size_t at = changed.find(std::string(1000, 'x'));
  REQUIRE(at != std::string::npos);
  changed[at + 500] = 'y';
  check_refused(receive(tmp, changed, "changed"), "does not match");
  // Bytes after the trailer: the trailer read is not the last 82 bytes.
  check_refused(receive(tmp, stream + "more", "extended"), "without its trailer");
  // A matching trailer over what is no tar stream: tar's own error.
  std::string junk(3000, 'j');
  check_refused(receive(tmp, junk + "\nsandgate-sha256 " + sha256_hex(junk) + "\n", "junk"), "tar: ");
  // And the intact stream still goes through (the cases above changed nothing shared).
  CHECK(receive(tmp, stream, "intact").ok());

  // A sender that goes quiet: the idle limit ends it.
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  UniqueFd rd(p[0]), wr(p[1]);
  REQUIRE(sys::make_dirs(tmp.sub("quiet"), 0755).ok());
  REQUIRE(::write(wr.get(), stream.data(), 512) == 512);
  check_refused(transfer::receive_tree(rd.get(), tmp.sub("quiet"), tmp.sub("quiet.log"), std::chrono::milliseconds(50)),
                "no data for 50 ms");
}

TEST_CASE("template transfer: a tree tar cannot read is sent without a trailer") {
  ::signal(SIGPIPE, SIG_IGN);
  test::TempDir tmp;
  std::string path = tmp.sub("stream");
  UniqueFd out(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  REQUIRE(out.get() >= 0);
  CHECK_FALSE(transfer::send_tree(tmp.sub("missing"), out.get(), tmp.sub("send.log")));
  out.reset();
  std::string stream = sys::read_file(path).value();
  CHECK(stream.find("sandgate-sha256") == std::string::npos);
  check_refused(receive(tmp, stream, "dst"), "without its trailer");
}
