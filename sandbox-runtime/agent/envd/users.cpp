// Parsing of passwd(5) and group(5) files.
#include "sandbox-runtime/agent/envd/users.h"

#include <charconv>
#include <sstream>

#include "base/sys.h"

namespace sg::envd {
namespace {

constexpr size_t kMaxDbFile = 4 << 20;

template <typename F>
void for_each_record(const std::string& path, F&& f) {
  auto text = sys::read_file(path, kMaxDbFile);
  if (!text) return;
  std::istringstream in(*text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (!f(split_colon_line(line))) return;
  }
}

bool parse_id(const std::string& s, unsigned& out) {
  auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size() && !s.empty();
}

}  // namespace

std::vector<std::string> split_colon_line(const std::string& line) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t p = line.find(':', start);
    out.push_back(line.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  return out;
}

std::optional<User> UserDb::find(const std::string& name) const {
  if (name.empty()) return std::nullopt;
  std::optional<User> u;
  for_each_record(passwd_path_, [&](const std::vector<std::string>& f) {
    unsigned uid, gid;
    if (f.size() < 7 || f[0] != name || !parse_id(f[2], uid) || !parse_id(f[3], gid)) return true;
    u = User{f[0], uid, gid, f[5].empty() ? "/" : f[5], f[6], {static_cast<gid_t>(gid)}};
    return false;
  });
  if (!u) return u;
  for_each_record(group_path_, [&](const std::vector<std::string>& f) {
    unsigned gid;
    if (f.size() < 4 || !parse_id(f[2], gid)) return true;
    std::string members = f[3];
    size_t start = 0;
    while (start <= members.size()) {
      size_t p = members.find(',', start);
      std::string m = members.substr(start, p == std::string::npos ? std::string::npos : p - start);
      if (m == name && gid != u->gid) u->groups.push_back(gid);
      if (p == std::string::npos) break;
      start = p + 1;
    }
    return true;
  });
  return u;
}

std::string UserDb::user_name(uid_t uid) const {
  std::string out;
  for_each_record(passwd_path_, [&](const std::vector<std::string>& f) {
    unsigned id;
    if (f.size() >= 3 && parse_id(f[2], id) && id == uid) {
      out = f[0];
      return false;
    }
    return true;
  });
  return out.empty() ? std::to_string(uid) : out;
}

std::string UserDb::group_name(gid_t gid) const {
  std::string out;
  for_each_record(group_path_, [&](const std::vector<std::string>& f) {
    unsigned id;
    if (f.size() >= 3 && parse_id(f[2], id) && id == gid) {
      out = f[0];
      return false;
    }
    return true;
  });
  return out.empty() ? std::to_string(gid) : out;
}

}  // namespace sg::envd
