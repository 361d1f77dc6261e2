// The kvm backend's host-side checks that need no KVM: the template's ext4
// image (built once, rebuilt when the template changes) and the guest
// image's presence.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <utime.h>

#include <cstdio>
#include <string>

#include "sandbox-runtime/microvm/microvm_runtime.h"
#include "tests/support/temp_dir.h"
#include "base/sys.h"

using namespace sg;

TEST_CASE("ensure_rootfs_image builds <rootfs>.ext4 once and again when the template's marker is newer") {
  test::TempDir dir;
  std::string root = dir.path() + "/base";
  REQUIRE(sys::make_dirs(root + "/etc"));
  REQUIRE(sys::write_file(root + "/etc/hostname", "sandbox\n"));
  // No marker: not a complete template.
  auto none = microvm::ensure_rootfs_image(root);
  CHECK_FALSE(none);
  CHECK_FALSE(sys::path_exists(root + ".ext4"));

  REQUIRE(sys::write_file(root + "/.sandgate-template", "{\"format\":2}"));
  struct utimbuf old_time = {1000000000, 1000000000};  // 2001: older than any image
  REQUIRE(::utime((root + "/.sandgate-template").c_str(), &old_time) == 0);
  auto img = microvm::ensure_rootfs_image(root);
  REQUIRE_MESSAGE(img, (img ? "" : img.error().message()));
  CHECK(*img == root + ".ext4");
  struct stat a {};
  REQUIRE(::stat(img->c_str(), &a) == 0);
  CHECK(a.st_size > 0);
  CHECK_FALSE(sys::path_exists(root + ".ext4.partial"));

  // Current: the same file, untouched.
  REQUIRE(microvm::ensure_rootfs_image(root));
  struct stat b {};
  REQUIRE(::stat(img->c_str(), &b) == 0);
  CHECK(b.st_ino == a.st_ino);

  // The template changed after the image was built: a new image.
  struct utimbuf future = {4000000000, 4000000000};
  REQUIRE(::utime((root + "/.sandgate-template").c_str(), &future) == 0);
  REQUIRE(microvm::ensure_rootfs_image(root));
  struct stat c {};
  REQUIRE(::stat(img->c_str(), &c) == 0);
  CHECK(c.st_ino != a.st_ino);
}

namespace {

// What debugfs says of a path in an ext4 image: the file's bytes for
// "cat", or its error ("File not found by ext2_lookup").
std::string debugfs(const std::string& image, const std::string& request) {
  std::string cmd = "debugfs -R '" + request + "' '" + image + "' 2>&1";
  std::string out;
  if (FILE* f = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    ::pclose(f);
  }
  // The first line is debugfs's banner.
  size_t nl = out.find('\n');
  return nl == std::string::npos ? out : out.substr(nl + 1);
}

}  // namespace

TEST_CASE("ensure_template_image merges a built template's layers over its base, whiteouts and opaque dirs included") {
  test::TempDir dir;
  std::string base = dir.path() + "/base", l1 = dir.path() + "/layers/one", l2 = dir.path() + "/layers/two";
  REQUIRE(sys::make_dirs(base + "/etc"));
  REQUIRE(sys::make_dirs(base + "/opt/dir"));
  REQUIRE(sys::write_file(base + "/etc/hostname", "sandbox\n"));
  REQUIRE(sys::write_file(base + "/etc/removed", "base\n"));
  REQUIRE(sys::write_file(base + "/opt/dir/a", "a\n"));
  REQUIRE(sys::write_file(base + "/.sandgate-template", "{\"format\":4}"));
  struct utimbuf old_time = {1000000000, 1000000000};
  REQUIRE(::utime((base + "/.sandgate-template").c_str(), &old_time) == 0);
  // Layer 1 (as export_layer leaves a step's writable layer): a new file,
  // a changed one, a deleted one (an overlay whiteout, a 0:0 char device).
  REQUIRE(sys::make_dirs(l1 + "/etc"));
  REQUIRE(sys::write_file(l1 + "/etc/added", "one\n"));
  REQUIRE(sys::write_file(l1 + "/etc/hostname", "built\n"));
  REQUIRE(::mknod((l1 + "/etc/removed").c_str(), S_IFCHR | 0000, makedev(0, 0)) == 0);
  // Layer 2: the file changed again, a directory replaced (opaque).
  REQUIRE(sys::make_dirs(l2 + "/etc"));
  REQUIRE(sys::make_dirs(l2 + "/opt/dir"));
  REQUIRE(sys::write_file(l2 + "/etc/added", "two\n"));
  REQUIRE(sys::write_file(l2 + "/opt/dir/b", "b\n"));
  REQUIRE(::setxattr((l2 + "/opt/dir").c_str(), "trusted.overlay.opaque", "y", 1, 0) == 0);

  auto img = microvm::ensure_template_image(base, {l1, l2});
  REQUIRE_MESSAGE(img, (img ? "" : img.error().message()));
  CHECK(*img == l2 + ".ext4");
  CHECK(debugfs(*img, "cat /etc/hostname") == "built\n");
  CHECK(debugfs(*img, "cat /etc/added") == "two\n");
  CHECK(debugfs(*img, "cat /opt/dir/b") == "b\n");
  CHECK(debugfs(*img, "stat /etc/removed").find("File not found") != std::string::npos);
  CHECK(debugfs(*img, "stat /opt/dir/a").find("File not found") != std::string::npos);
  CHECK(debugfs(*img, "cat /.sandgate-template") == "{\"format\":4}");
  // Nothing of the merge is left: no mount, no work directory.
  CHECK_FALSE(sys::path_exists(l2 + ".merge"));
  CHECK_FALSE(sys::path_exists(l2 + ".ext4.partial"));
  struct stat a {};
  REQUIRE(::stat(img->c_str(), &a) == 0);

  // Built once; the base rebuilt in place makes it again.
  REQUIRE(microvm::ensure_template_image(base, {l1, l2}));
  struct stat b {};
  REQUIRE(::stat(img->c_str(), &b) == 0);
  CHECK(b.st_ino == a.st_ino);
  struct utimbuf future = {4000000000, 4000000000};
  REQUIRE(::utime((base + "/.sandgate-template").c_str(), &future) == 0);
  REQUIRE(microvm::ensure_template_image(base, {l1, l2}));
  REQUIRE(::stat(img->c_str(), &b) == 0);
  CHECK(b.st_ino != a.st_ino);

  // A missing layer is an error that names it, and leaves no image.
  auto gone = microvm::ensure_template_image(base, {l1, dir.path() + "/layers/missing"});
  REQUIRE_FALSE(gone);
  CHECK(gone.error().message().find("layers/missing") != std::string::npos);
  CHECK_FALSE(sys::path_exists(dir.path() + "/layers/missing.ext4"));

  // Without layers: a template directory is ensure_rootfs_image's; an
  // image's unpacked root (no marker) becomes <root>.ext4.
  auto plain = microvm::ensure_template_image(base, {});
  REQUIRE(plain);
  CHECK(*plain == base + ".ext4");
  std::string oci = dir.path() + "/images/root";
  REQUIRE(sys::make_dirs(oci + "/bin"));
  REQUIRE(sys::write_file(oci + "/bin/hello", "#!/bin/sh\n"));
  auto from_image = microvm::ensure_template_image(oci, {});
  REQUIRE_MESSAGE(from_image, (from_image ? "" : from_image.error().message()));
  CHECK(debugfs(*from_image, "cat /bin/hello") == "#!/bin/sh\n");
}

TEST_CASE("check_guest_dir names the missing file and the command that builds it") {
  test::TempDir dir;
  auto s = microvm::check_guest_dir(dir.path());
  REQUIRE_FALSE(s);
  CHECK(s.error().kind() == ErrorKind::kNotFound);
  CHECK(s.error().message().find("vmlinuz") != std::string::npos);
  CHECK(s.error().message().find("scripts/guest-image.sh") != std::string::npos);
  REQUIRE(sys::write_file(dir.path() + "/vmlinuz", "x"));
  s = microvm::check_guest_dir(dir.path());
  REQUIRE_FALSE(s);
  CHECK(s.error().message().find("initramfs.cpio") != std::string::npos);
  REQUIRE(sys::write_file(dir.path() + "/initramfs.cpio", "x"));
  CHECK(microvm::check_guest_dir(dir.path()));
}

// The collector's hook (Runtime::drop_template): a template's image and the
// snapshots made of it go; another template's, and snapshots being built,
// stay.
TEST_CASE("drop_template removes a template's image and its snapshots, nothing else") {
  test::TempDir dir;
  microvm::MicrovmConfig cfg;
  cfg.state_root = dir.sub("state");
  std::unique_ptr<runtime::Runtime> rt = microvm::make_microvm_runtime(cfg);
  std::string layer = dir.sub("layers/aa"), other = dir.sub("layers/bb");
  REQUIRE(sys::make_dirs(dir.sub("layers"), 0755));
  std::string snaps = cfg.state_root + "/snapshots";
  auto snapshot = [&](const std::string& name, const std::string& image) {
    REQUIRE(sys::make_dirs(snaps + "/" + name, 0700));
    REQUIRE(sys::write_file(snaps + "/" + name + "/memory", std::string(64 << 10, 'm')));
    if (!image.empty()) REQUIRE(sys::write_file(snaps + "/" + name + "/image", image));
  };
  REQUIRE(sys::write_file(layer + ".ext4", std::string(128 << 10, 'i')));
  REQUIRE(sys::write_file(other + ".ext4", "other"));
  snapshot("111-512m2c", layer + ".ext4");
  snapshot("222-1024m1c", layer + ".ext4");
  snapshot("333-512m2c", other + ".ext4");
  snapshot("444-512m2c", "");  // made before snapshots named their image
  snapshot("555-512m2c.partial", layer + ".ext4");

  uint64_t freed = rt->drop_template(layer);
  CHECK(freed >= (128u << 10) + 2 * (64u << 10));
  CHECK_FALSE(sys::path_exists(layer + ".ext4"));
  CHECK_FALSE(sys::path_exists(snaps + "/111-512m2c"));
  CHECK_FALSE(sys::path_exists(snaps + "/222-1024m1c"));
  CHECK(sys::path_exists(snaps + "/333-512m2c/memory"));
  CHECK(sys::path_exists(snaps + "/444-512m2c/memory"));
  CHECK(sys::path_exists(snaps + "/555-512m2c.partial/memory"));
  CHECK(sys::path_exists(other + ".ext4"));
  CHECK(rt->drop_template(layer) == 0);  // again: nothing left to remove
}
