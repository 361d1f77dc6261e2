// Cgroup v1/v2 handling for process sandboxes (see cgroup.h).
#include "sandbox-runtime/host/cgroup.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <ctime>
#include <optional>
#include <set>

#include "base/fd.h"
#include "base/sys.h"

namespace sg::process {

namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(sep, i);
    if (j == std::string_view::npos) j = s.size();
    out.push_back(s.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string unescape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      int v = (s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0');
      out.push_back(static_cast<char>(v));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// Waits a little between two reads of a kernel state that offers no
// notification (v1 freezer.state, cgroup emptiness): 100 us doubling to 5 ms.
void backoff(int& round) {
  long ns = std::min(100000L << std::min(round, 6), 5000000L);
  struct timespec ts = {0, ns};
  ::nanosleep(&ts, nullptr);
  ++round;
}

Result<uint64_t> read_u64(const std::string& path) {
  auto text = sys::read_file(path);
  if (!text) return text.error();
  const std::string& t = *text;
  if (t.rfind("max", 0) == 0) return UINT64_MAX;
  char* end = nullptr;
  unsigned long long v = std::strtoull(t.c_str(), &end, 10);
  if (end == t.c_str()) return internal_error("parse " + path + ": not a number");
  return static_cast<uint64_t>(v);
}

// Value of "key N" in a flat-keyed file (memory.stat, cpu.stat, cgroup.events).
std::optional<uint64_t> keyed(std::string_view text, std::string_view key) {
  for (std::string_view line : split(text, '\n')) {
    if (line.size() > key.size() && line.substr(0, key.size()) == key && line[key.size()] == ' ')
      return std::strtoull(std::string(line.substr(key.size() + 1)).c_str(), nullptr, 10);
  }
  return std::nullopt;
}

bool dir_exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::vector<std::string> subdirs(const std::string& p) {
  std::vector<std::string> out;
  DIR* d = ::opendir(p.c_str());
  if (!d) return out;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    if (dir_exists(p + "/" + n)) out.push_back(n);
  }
  ::closedir(d);
  return out;
}

}  // namespace

Result<CgroupLayout> parse_cgroup_layout(std::string_view mountinfo) {
  CgroupLayout v1;
  v1.version = CgroupVersion::kV1;
  for (std::string_view line : split(mountinfo, '\n')) {
    if (line.empty()) continue;
    size_t dash = line.find(" - ");
    if (dash == std::string_view::npos) continue;
    auto pre = split(line.substr(0, dash), ' ');
    auto post = split(line.substr(dash + 3), ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    std::string mount = unescape(pre[4]);
    std::string_view fstype = post[0];
    if (fstype == "cgroup2" && mount == "/sys/fs/cgroup") {
      CgroupLayout v2;
      v2.version = CgroupVersion::kV2;
      v2.unified = mount;
      return v2;
    }
    if (fstype != "cgroup") continue;
    for (std::string_view opt : split(post[2], ',')) {
      for (const char* c : kV1Controllers)
        if (opt == c && !v1.v1_mounts.count(c)) v1.v1_mounts[c] = mount;
    }
  }
  for (const char* c : kV1Controllers) {
    if (!v1.v1_mounts.count(c))
      return Error(ErrorKind::kUnavailable,
                   std::string("cgroup v1 controller ") + c +
                       " is not mounted (see /proc/self/mountinfo) and /sys/fs/cgroup is not cgroup2: the process "
                       "backend needs memory, cpu, cpuacct, pids and freezer");
  }
  return v1;
}

Result<CgroupLayout> detect_cgroup_layout() {
  auto text = sys::read_file("/proc/self/mountinfo", 4 << 20);
  if (!text) return text.error();
  auto layout = parse_cgroup_layout(*text);
  if (!layout) return layout;
  if (layout->version == CgroupVersion::kV2) {
    auto ctl = sys::read_file(layout->unified + "/cgroup.controllers");
    if (!ctl) return ctl.error();
    for (const char* c : {"memory", "cpu", "pids"}) {
      auto words = split(std::string_view(*ctl).substr(0, ctl->find('\n')), ' ');
      if (std::find(words.begin(), words.end(), std::string_view(c)) == words.end())
        return Error(ErrorKind::kUnavailable, std::string("cgroup v2 controller ") + c + " is not available in " +
                                                  layout->unified + "/cgroup.controllers");
    }
  }
  return layout;
}

const std::string& Cgroup::dir_for(const std::string& controller) const {
  static const std::string kNone;
  auto it = by_controller_.find(controller);
  return it == by_controller_.end() ? kNone : it->second;
}

Cgroup Cgroup::attach(const CgroupLayout& layout, const std::string& parent, const std::string& name,
                      sys::Os& os) {
  Cgroup cg;
  cg.version_ = layout.version;
  cg.os_ = &os;
  if (layout.version == CgroupVersion::kV2) {
    std::string dir = layout.unified + "/" + parent + "/" + name;
    for (const char* c : {"memory", "cpu", "cpuacct", "pids", "freezer"}) cg.by_controller_[c] = dir;
    cg.dirs_.push_back(dir);
  } else {
    for (const auto& [c, mount] : layout.v1_mounts) {
      std::string dir = mount + "/" + parent + "/" + name;
      cg.by_controller_[c] = dir;
      if (std::find(cg.dirs_.begin(), cg.dirs_.end(), dir) == cg.dirs_.end()) cg.dirs_.push_back(dir);
    }
  }
  return cg;
}

Result<Cgroup> Cgroup::create(const CgroupLayout& layout, const std::string& parent, const std::string& name,
                              const CgroupLimits& limits, sys::Os& os) {
  Cgroup cg = attach(layout, parent, name, os);
  std::vector<std::string> made;
  // Undoing uses the host directly: a cleanup that could itself fail would
  // leave the directories it was meant to remove.
  auto fail = [&](Error e) -> Result<Cgroup> {
    for (auto it = made.rbegin(); it != made.rend(); ++it) ::rmdir(it->c_str());
    return e;
  };
  if (layout.version == CgroupVersion::kV2) {
    // Controllers must be enabled on the way down for the leaf to have them.
    // The root is allowed processes and controllers at once; writes that
    // fail because a controller is already enabled are harmless.
    std::string enable = "+cpu +memory +pids";
    (void)sys::write_file(layout.unified + "/cgroup.subtree_control", enable, os);
    std::string pdir = layout.unified + "/" + parent;
    if (Status s = sys::make_dirs(pdir, 0755, os); !s) return s.error();
    if (Status s = sys::write_file(pdir + "/cgroup.subtree_control", enable, os); !s)
      return s.error().with_context("enable cgroup controllers for " + pdir);
  }
  for (const std::string& dir : cg.dirs_) {
    std::string pdir = dir.substr(0, dir.rfind('/'));
    if (Status s = sys::make_dirs(pdir, 0755, os); !s) return fail(s.error());
    if (os.mkdir(dir.c_str(), 0755) != 0) {
      if (errno == EEXIST) return fail(conflict_error("cgroup " + dir + " already exists"));
      return fail(sys::errno_error("mkdir", dir));
    }
    made.push_back(dir);
  }
  auto put = [&](const std::string& path, const std::string& value) -> Status {
    if (Status s = sys::write_file(path, value, os); !s) return s.error().with_context("set cgroup limit " + value);
    return Status::Ok();
  };
  uint32_t cpus = std::max<uint32_t>(limits.cpu_count, 1);
  if (layout.version == CgroupVersion::kV2) {
    const std::string& d = cg.dirs_[0];
    if (limits.memory_bytes) {
      if (Status s = put(d + "/memory.max", std::to_string(limits.memory_bytes)); !s) return fail(s.error());
    }
    if (Status s = put(d + "/cpu.max", std::to_string(cpus * 100000ull) + " 100000"); !s) return fail(s.error());
    if (limits.max_pids) {
      if (Status s = put(d + "/pids.max", std::to_string(limits.max_pids)); !s) return fail(s.error());
    }
  } else {
    if (limits.memory_bytes) {
      if (Status s = put(cg.dir_for("memory") + "/memory.limit_in_bytes", std::to_string(limits.memory_bytes)); !s)
        return fail(s.error());
    }
    auto period = read_u64(cg.dir_for("cpu") + "/cpu.cfs_period_us");
    if (!period) return fail(period.error());
    if (Status s = put(cg.dir_for("cpu") + "/cpu.cfs_quota_us", std::to_string(cpus * *period)); !s)
      return fail(s.error());
    if (limits.max_pids) {
      if (Status s = put(cg.dir_for("pids") + "/pids.max", std::to_string(limits.max_pids)); !s)
        return fail(s.error());
    }
  }
  return cg;
}

Status Cgroup::add_process(int pid) {
  std::string p = std::to_string(pid);
  for (const std::string& dir : dirs_) {
    if (Status s = sys::write_file(dir + "/cgroup.procs", p, *os_); !s)
      return s.error().with_context("move pid " + p + " into cgroup");
  }
  return Status::Ok();
}

Result<bool> Cgroup::frozen() {
  if (version_ == CgroupVersion::kV2) {
    auto ev = sys::read_file(dir_for("freezer") + "/cgroup.events");
    if (!ev) return ev.error();
    return keyed(*ev, "frozen").value_or(0) == 1;
  }
  auto st = sys::read_file(dir_for("freezer") + "/freezer.state");
  if (!st) return st.error();
  return st->rfind("FROZEN", 0) == 0;
}

Status Cgroup::freeze(std::chrono::milliseconds timeout) {
  const std::string& d = dir_for("freezer");
  uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>(timeout.count()) * 1000000ull;
  if (version_ == CgroupVersion::kV2) {
    if (Status s = sys::write_file(d + "/cgroup.freeze", "1", *os_); !s) return s;
    // cgroup.events raises POLLPRI when "frozen" changes.
    UniqueFd ev(::open((d + "/cgroup.events").c_str(), O_RDONLY | O_CLOEXEC));
    if (!ev) return sys::errno_error("open", d + "/cgroup.events");
    for (;;) {
      auto f = frozen();
      if (!f) return f.error();
      if (*f) return Status::Ok();
      uint64_t now = sys::monotonic_ns();
      if (now >= deadline) break;
      char buf[256];
      ::lseek(ev.get(), 0, SEEK_SET);
      (void)!::read(ev.get(), buf, sizeof buf);
      struct pollfd p = {ev.get(), POLLPRI, 0};
      ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000 + 1));
    }
  } else {
    int round = 0;
    for (;;) {
      // Rewriting FROZEN retries tasks that were busy in the kernel.
      if (Status s = sys::write_file(d + "/freezer.state", "FROZEN", *os_); !s) {
        (void)thaw();  // a partly frozen cgroup is not left so
        return s;
      }
      auto f = frozen();
      if (!f) return f.error();
      if (*f) return Status::Ok();
      if (sys::monotonic_ns() >= deadline) break;
      backoff(round);
    }
  }
  (void)thaw();
  return Error(ErrorKind::kTimeout, "freeze cgroup " + d + ": not frozen after " + std::to_string(timeout.count()) +
                                        " ms (a task stuck in the kernel?)");
}

Status Cgroup::thaw() {
  const std::string& d = dir_for("freezer");
  if (version_ == CgroupVersion::kV2) return sys::write_file(d + "/cgroup.freeze", "0", *os_);
  return sys::write_file(d + "/freezer.state", "THAWED", *os_);
}

Result<std::vector<int>> Cgroup::pids() {
  std::set<int> all;
  for (const std::string& dir : dirs_) {
    auto text = sys::read_file(dir + "/cgroup.procs", 16 << 20);
    if (!text) return text.error();
    for (std::string_view l : split(*text, '\n'))
      if (!l.empty()) all.insert(std::atoi(std::string(l).c_str()));
  }
  return std::vector<int>(all.begin(), all.end());
}

Result<CgroupStats> Cgroup::stats() {
  CgroupStats st;
  if (version_ == CgroupVersion::kV2) {
    const std::string& d = dirs_[0];
    auto cpu = sys::read_file(d + "/cpu.stat");
    if (!cpu) return cpu.error();
    st.cpu_usage_ns = keyed(*cpu, "usage_usec").value_or(0) * 1000;
    auto cur = read_u64(d + "/memory.current");
    if (!cur) return cur.error();
    auto ms = sys::read_file(d + "/memory.stat");
    if (!ms) return ms.error();
    st.mem_cache_bytes = keyed(*ms, "file").value_or(0);
    st.mem_used_bytes = *cur > st.mem_cache_bytes ? *cur - st.mem_cache_bytes : 0;
    auto lim = read_u64(d + "/memory.max");
    if (!lim) return lim.error();
    st.mem_limit_bytes = *lim;
    return st;
  }
  auto cpu = read_u64(dir_for("cpuacct") + "/cpuacct.usage");
  if (!cpu) return cpu.error();
  st.cpu_usage_ns = *cpu;
  const std::string& m = dir_for("memory");
  auto usage = read_u64(m + "/memory.usage_in_bytes");
  if (!usage) return usage.error();
  auto ms = sys::read_file(m + "/memory.stat");
  if (!ms) return ms.error();
  st.mem_cache_bytes = keyed(*ms, "total_cache").value_or(0);
  st.mem_used_bytes = *usage > st.mem_cache_bytes ? *usage - st.mem_cache_bytes : 0;
  auto lim = read_u64(m + "/memory.limit_in_bytes");
  if (!lim) return lim.error();
  st.mem_limit_bytes = *lim;
  return st;
}

Result<uint64_t> Cgroup::oom_kills() {
  bool v2 = version_ == CgroupVersion::kV2;
  std::string path = v2 ? dirs_[0] + "/memory.events" : dir_for("memory") + "/memory.oom_control";
  auto text = sys::read_file(path);
  if (!text) return text.error();
  std::optional<uint64_t> n = keyed(*text, "oom_kill");
  if (!n) return Error(ErrorKind::kUnavailable, path + " has no oom_kill count");
  return *n;
}

Status Cgroup::destroy(std::chrono::milliseconds timeout) {
  uint64_t deadline = sys::monotonic_ns() + static_cast<uint64_t>(timeout.count()) * 1000000ull;
  int round = 0;
  for (;;) {
    bool any = false;
    for (const std::string& dir : dirs_) any = any || dir_exists(dir);
    if (!any) return Status::Ok();
    std::vector<int> left;
    if (auto p = pids(); p) left = *p;
    for (int pid : left) os_->kill(pid, SIGKILL);
    // Frozen tasks (v1) only act on SIGKILL once thawed.
    if (dir_exists(dir_for("freezer"))) (void)thaw();
    Error last = internal_error("");
    bool busy = false;
    if (left.empty()) {
      for (const std::string& dir : dirs_) {
        if (os_->rmdir(dir.c_str()) != 0 && errno != ENOENT) {
          busy = true;
          last = sys::errno_error("rmdir", dir);
        }
      }
      if (!busy) return Status::Ok();
    }
    if (sys::monotonic_ns() >= deadline) {
      if (!left.empty())
        return internal_error("remove cgroup " + dirs_[0] + ": " + std::to_string(left.size()) +
                              " tasks still alive after SIGKILL");
      return last;
    }
    backoff(round);
  }
}

Status remove_cgroup_parent(const CgroupLayout& layout, const std::string& parent,
                            std::chrono::milliseconds timeout, sys::Os& os) {
  return remove_cgroups_except(layout, parent, {}, timeout, os);
}

Status remove_cgroups_except(const CgroupLayout& layout, const std::string& parent, const std::set<std::string>& keep,
                             std::chrono::milliseconds timeout, sys::Os& os) {
  std::set<std::string> roots;
  if (layout.version == CgroupVersion::kV2) {
    roots.insert(layout.unified);
  } else {
    for (const auto& [c, mount] : layout.v1_mounts) roots.insert(mount);
  }
  std::set<std::string> names;
  for (const std::string& r : roots)
    for (const std::string& n : subdirs(r + "/" + parent)) names.insert(n);
  Status result;
  for (const std::string& n : names) {
    if (keep.count(n)) continue;
    if (Status s = Cgroup::attach(layout, parent, n, os).destroy(timeout); !s && result) result = s;
  }
  if (!keep.empty()) return result;
  for (const std::string& r : roots) {
    std::string p = r + "/" + parent;
    if (os.rmdir(p.c_str()) != 0 && errno != ENOENT && result) result = sys::errno_error("rmdir", p);
  }
  return result;
}

}  // namespace sg::process
