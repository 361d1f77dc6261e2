// TempDir: a fresh directory under $TMPDIR, removed with everything in it.
#pragma once

#include <stdlib.h>

#include <string>

#include "base/sys.h"

namespace sg::test {

class TempDir {
 public:
  TempDir() {
    const char* base = getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/sandgate-test-XXXXXX";
    char* p = mkdtemp(tmpl.data());
    path_ = p ? p : "";
  }
  ~TempDir() {
    if (!path_.empty()) (void)sys::remove_tree(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace sg::test
