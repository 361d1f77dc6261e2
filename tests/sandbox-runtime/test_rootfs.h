// test_rootfs(): a ready template rootfs for tests that start sandboxes.
//
// $SANDGATE_TEST_ROOTFS if it names a ready template; otherwise the one in
// the build tree (SANDGATE_TESTS_ROOTFS_DIR), built on first use with the
// real template builder (debootstrap, about a minute, needs the Debian
// mirror). So the suite always runs for real instead of skipping. Returns
// "" and prints why when no rootfs can be had; callers then fail.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "sandbox-runtime/templates/template_builder.h"

namespace sg::test {

inline std::string test_rootfs() {
  static std::once_flag once;
  static std::string path;
  std::call_once(once, [] {
    const char* env = std::getenv("SANDGATE_TEST_ROOTFS");
    if (env && *env) {
      if (templates::rootfs_ready(env)) {
        path = env;
        return;
      }
      std::fprintf(stderr, "SANDGATE_TEST_ROOTFS=%s is not a ready template; using the build tree's\n", env);
    }
    std::string dir = SANDGATE_TESTS_ROOTFS_DIR;
    if (!templates::rootfs_ready(dir)) {
      std::fprintf(stderr, "building test rootfs in %s (debootstrap, about a minute)...\n", dir.c_str());
      size_t lines = 0;
      Status s = templates::build_base_rootfs(dir, [&](const std::string& line) {
        if (++lines % 50 == 0) std::fprintf(stderr, "  debootstrap: %s\n", line.c_str());
      });
      if (!s) {
        std::fprintf(stderr, "cannot build test rootfs: %s\n", s.error().message().c_str());
        return;
      }
    }
    path = dir;
  });
  return path;
}

}  // namespace sg::test
