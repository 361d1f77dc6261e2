// Cgroup layout detection from mountinfo text (pure; no cgroups touched).
#include <doctest/doctest.h>

#include "sandbox-runtime/host/cgroup.h"

using namespace sg::process;

TEST_CASE("cgroup layout: v1 with cpu and cpuacct in separate hierarchies") {
  const char* mi =
      "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
      "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
      "33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct\n"
      "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
      "37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer\n"
      "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
      "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
  auto l = parse_cgroup_layout(mi);
  REQUIRE(l);
  CHECK(l->version == CgroupVersion::kV1);
  CHECK(l->v1_mounts.at("cpu") == "/sys/fs/cgroup/cpu");
  CHECK(l->v1_mounts.at("cpuacct") == "/sys/fs/cgroup/cpuacct");
  CHECK(l->v1_mounts.at("freezer") == "/sys/fs/cgroup/freezer");

  Cgroup cg = Cgroup::attach(*l, "sg", "box");
  CHECK(cg.dirs().size() == 5);
  CHECK(cg.dir_for("memory") == "/sys/fs/cgroup/memory/sg/box");
}

TEST_CASE("cgroup layout: v1 with co-mounted cpu,cpuacct shares one directory") {
  const char* mi =
      "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
      "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
      "37 31 0:34 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer\n"
      "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n";
  auto l = parse_cgroup_layout(mi);
  REQUIRE(l);
  Cgroup cg = Cgroup::attach(*l, "sg", "box");
  CHECK(cg.dirs().size() == 4);
  CHECK(cg.dir_for("cpu") == cg.dir_for("cpuacct"));
}

TEST_CASE("cgroup layout: v2 when /sys/fs/cgroup is cgroup2") {
  const char* mi = "25 23 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
  auto l = parse_cgroup_layout(mi);
  REQUIRE(l);
  CHECK(l->version == CgroupVersion::kV2);
  Cgroup cg = Cgroup::attach(*l, "sg", "box");
  CHECK(cg.dirs() == std::vector<std::string>{"/sys/fs/cgroup/sg/box"});
  CHECK(cg.dir_for("freezer") == "/sys/fs/cgroup/sg/box");
}

TEST_CASE("cgroup layout: a missing v1 controller is a clear error") {
  const char* mi = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
  auto l = parse_cgroup_layout(mi);
  REQUIRE_FALSE(l);
  CHECK(l.error().message().find("controller cpu") != std::string::npos);
}

TEST_CASE("cgroup layout: escaped mount points are decoded") {
  const char* mi =
      "32 31 0:29 / /cg\\040x/cpu rw - cgroup cgroup rw,cpu\n"
      "33 31 0:30 / /cg\\040x/cpuacct rw - cgroup cgroup rw,cpuacct\n"
      "35 31 0:32 / /cg\\040x/memory rw - cgroup cgroup rw,memory\n"
      "37 31 0:34 / /cg\\040x/freezer rw - cgroup cgroup rw,freezer\n"
      "39 31 0:36 / /cg\\040x/pids rw - cgroup cgroup rw,pids\n";
  auto l = parse_cgroup_layout(mi);
  REQUIRE(l);
  CHECK(l->v1_mounts.at("cpu") == "/cg x/cpu");
}
