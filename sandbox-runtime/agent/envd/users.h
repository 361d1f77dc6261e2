// Users and groups from passwd/group files. The agent is linked -static, where
// getpwnam and friends (NSS) do not work, so envd parses the files itself.
// Files are re-read on every lookup: they are small and the sandbox may add
// users at any time.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

namespace sg::envd {

struct User {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
  std::string home;
  std::string shell;
  std::vector<gid_t> groups;  // supplementary groups, primary gid included
};

class UserDb {
 public:
  UserDb(std::string passwd_path, std::string group_path)
      : passwd_path_(std::move(passwd_path)), group_path_(std::move(group_path)) {}
  std::optional<User> find(const std::string& name) const;
  // Names for EntryInfo.owner/group; the decimal id when unknown.
  std::string user_name(uid_t uid) const;
  std::string group_name(gid_t gid) const;

 private:
  std::string passwd_path_, group_path_;
};

// One line of a colon-separated file; exposed for tests.
std::vector<std::string> split_colon_line(const std::string& line);

}  // namespace sg::envd
