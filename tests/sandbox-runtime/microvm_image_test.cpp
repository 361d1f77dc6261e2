// The kvm backend's host-side checks that need no KVM: the template's ext4
// image (built once, rebuilt when the template changes) and the guest
// image's presence.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <utime.h>

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
