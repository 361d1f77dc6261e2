// A test case that cannot run on this host (a kernel feature, root) ends
// its process with exit code 77, which CTest reports as skipped, never as
// passed. Such a case is tagged test_suite("own-entry"): the binary's main
// CTest entry excludes the suite (-tse=own-entry) and each tagged case has
// a CTest entry of its own (-tc=...) with SKIP_RETURN_CODE 77
// (sg_own_entry in tests/CMakeLists.txt), so a skip hides no other case.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace sg::test {

[[noreturn]] inline void skip_case(const std::string& why) {
  std::fprintf(stderr, "SKIPPED: %s\n", why.c_str());
  std::fflush(nullptr);
  std::_Exit(77);
}

}  // namespace sg::test
