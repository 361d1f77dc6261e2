// Template finalisation on a fake rootfs (no debootstrap): account files,
// caches, marker, idempotence. build_base_rootfs itself runs for real in
// process_runtime_test through test_rootfs().
#include <doctest/doctest.h>

#include <sys/stat.h>

#include "base/sys.h"
#include "sandbox-runtime/templates/template_builder.h"

using namespace sg;

namespace {

struct FakeRootfs {
  std::string dir = "/tmp/sgtest-rootfs-" + sys::random_hex(6);
  FakeRootfs() {
    REQUIRE(sys::make_dirs(dir + "/etc/skel"));
    REQUIRE(sys::make_dirs(dir + "/var/cache/apt/archives/partial"));
    REQUIRE(sys::make_dirs(dir + "/var/lib/apt/lists/partial"));
    REQUIRE(sys::write_file(dir + "/etc/passwd", "root:x:0:0:root:/root:/bin/bash\n"));
    REQUIRE(sys::write_file(dir + "/etc/group", "root:x:0:\n"));
    REQUIRE(sys::write_file(dir + "/etc/shadow", "root:*:19000:0:99999:7:::\n"));
    ::chmod((dir + "/etc/shadow").c_str(), 0640);
    REQUIRE(sys::write_file(dir + "/etc/skel/.bashrc", "# bashrc\n"));
    REQUIRE(sys::write_file(dir + "/var/cache/apt/archives/bash_5.2.deb", "deb"));
    REQUIRE(sys::write_file(dir + "/var/lib/apt/lists/deb.debian.org_dists_bookworm_InRelease", "x"));
  }
  ~FakeRootfs() { (void)sys::remove_tree(dir); }
};

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("templates: finalize_rootfs adds user, cleans caches, writes the marker") {
  FakeRootfs fs;
  CHECK_FALSE(templates::rootfs_ready(fs.dir));
  REQUIRE(templates::finalize_rootfs(fs.dir));
  CHECK(templates::rootfs_ready(fs.dir));
  CHECK(*sys::read_file(fs.dir + "/etc/passwd") ==
        "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n");
  CHECK(count(*sys::read_file(fs.dir + "/etc/group"), "user:x:1000:") == 1);
  CHECK(sys::read_file(fs.dir + "/etc/shadow")->find("\nuser:*:") != std::string::npos);
  struct stat st;
  REQUIRE(::stat((fs.dir + "/etc/shadow").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0640);
  REQUIRE(::stat((fs.dir + "/home/user").c_str(), &st) == 0);
  CHECK(st.st_uid == 1000);
  CHECK(sys::path_exists(fs.dir + "/home/user/.bashrc"));
  CHECK(sys::path_exists(fs.dir + "/.sandgate"));
  CHECK_FALSE(sys::path_exists(fs.dir + "/var/cache/apt/archives/bash_5.2.deb"));
  CHECK_FALSE(sys::path_exists(fs.dir + "/var/lib/apt/lists/deb.debian.org_dists_bookworm_InRelease"));
  CHECK(sys::path_exists(fs.dir + "/var/lib/apt/lists/partial"));

  // Idempotent: a second run adds no second user.
  REQUIRE(templates::finalize_rootfs(fs.dir));
  CHECK(count(*sys::read_file(fs.dir + "/etc/passwd"), "\nuser:") == 1);
}

TEST_CASE("templates: rootfs_ready rejects a wrong marker format") {
  FakeRootfs fs;
  REQUIRE(sys::write_file(fs.dir + "/.sandgate-template", R"({"format":999})"));
  CHECK_FALSE(templates::rootfs_ready(fs.dir));
  REQUIRE(sys::write_file(fs.dir + "/.sandgate-template", "garbage"));
  CHECK_FALSE(templates::rootfs_ready(fs.dir));
}

TEST_CASE("templates: finalize_rootfs fails clearly without etc/passwd") {
  std::string dir = "/tmp/sgtest-empty-" + sys::random_hex(6);
  REQUIRE(sys::make_dirs(dir));
  Status s = templates::finalize_rootfs(dir);
  REQUIRE_FALSE(s);
  CHECK(s.error().message().find("etc/passwd") != std::string::npos);
  CHECK_FALSE(templates::rootfs_ready(dir));
  REQUIRE(sys::remove_tree(dir));
}

TEST_CASE("templates: build_base_rootfs refuses a dest that exists but is not a template") {
  std::string dir = "/tmp/sgtest-notatemplate-" + sys::random_hex(6);
  REQUIRE(sys::make_dirs(dir));
  Status s = templates::build_base_rootfs(dir, nullptr);
  REQUIRE_FALSE(s);
  CHECK(s.error().message().find("not a complete template") != std::string::npos);
  REQUIRE(sys::remove_tree(dir));
}

TEST_CASE("templates: what an existing template's format means") {
  using templates::Upgrade;
  // Formats 1 and 2 lack curl and git: rebuilt (debootstrap, not run here).
  CHECK(templates::upgrade_for_format(1) == Upgrade::kRebuild);
  CHECK(templates::upgrade_for_format(2) == Upgrade::kRebuild);
  CHECK(templates::upgrade_for_format(templates::kTemplateFormat) == Upgrade::kNone);
  CHECK(templates::upgrade_for_format(templates::kTemplateFormat + 1) == Upgrade::kNone);
  CHECK(templates::upgrade_for_format(0) == Upgrade::kNotATemplate);
  CHECK(templates::upgrade_for_format(-3) == Upgrade::kNotATemplate);
}

TEST_CASE("templates: finalize makes /etc/profile ask $EUID and writes the current marker") {
  FakeRootfs r;
  REQUIRE(sys::write_file(r.dir + "/etc/profile",
                          "if [ \"$(id -u)\" -eq 0 ]; then\n  PATH=/sbin\nfi\nif [ \"$(id -u)\" -eq 0 ]; then PS1='# '; fi\n"));
  REQUIRE(sys::write_file(r.dir + "/.sandgate-template", "{\"format\":1}\n"));
  CHECK_FALSE(templates::rootfs_ready(r.dir));
  REQUIRE(templates::finalize_rootfs(r.dir));
  CHECK(templates::rootfs_ready(r.dir));
  auto profile = sys::read_file(r.dir + "/etc/profile");
  REQUIRE(profile.ok());
  CHECK(profile->find("\"$(id -u)\"") == std::string::npos);
  CHECK(profile->find("\"${EUID:-$(id -u)}\" -eq 0 ]; then\n  PATH") != std::string::npos);
  // Idempotent: a second finalize changes nothing.
  REQUIRE(templates::finalize_rootfs(r.dir));
  CHECK(*sys::read_file(r.dir + "/etc/profile") == *profile);
}
