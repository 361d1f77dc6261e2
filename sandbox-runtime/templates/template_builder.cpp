// Base template rootfs builder (template_builder.h): debootstrap in a child
// process whose output is streamed line by line, then direct edits of the
// account files (no chroot tools, so it works with any host), then an
// atomic rename.
#include "sandbox-runtime/templates/template_builder.h"

#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/fd.h"
#include "base/log.h"
#include "base/sys.h"

extern char** environ;

namespace sg::templates {

namespace {

// Runs argv with stdout+stderr on a pipe; each line goes to progress. The
// last lines are kept for the error message.
Status run_streaming(const std::vector<std::string>& args, const std::function<void(const std::string&)>& progress) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return sys::errno_error("pipe2", args[0]);
  UniqueFd rd(p[0]), wr(p[1]);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, wr.get(), 1);
  posix_spawn_file_actions_adddup2(&fa, wr.get(), 2);

  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e)
    if (std::strncmp(*e, "PATH=", 5) != 0) env.emplace_back(*e);
  env.emplace_back("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
  std::vector<char*> envp, argv;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> a = args;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);

  // Look the program up in the PATH we pass, not the caller's.
  std::string prog = args[0];
  if (prog.find('/') == std::string::npos) {
    for (const char* d : {"/usr/sbin/", "/usr/bin/", "/sbin/", "/bin/", "/usr/local/sbin/", "/usr/local/bin/"}) {
      if (::access((std::string(d) + prog).c_str(), X_OK) == 0) {
        prog = std::string(d) + prog;
        break;
      }
    }
  }
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, prog.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return sys::errno_error("spawn", args[0] + " (is it installed?)", rc);
  wr.reset();

  std::deque<std::string> last;
  std::string line;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(rd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) {
      if (buf[i] != '\n') {
        if (line.size() < 4096) line.push_back(buf[i]);
        continue;
      }
      if (progress) progress(line);
      last.push_back(std::move(line));
      if (last.size() > 5) last.pop_front();
      line.clear();
    }
  }
  if (!line.empty()) {
    if (progress) progress(line);
    last.push_back(line);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return sys::errno_error("waitpid", args[0]);
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Status::Ok();
  std::string why = WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                      : "killed by signal " + std::to_string(WTERMSIG(status));
  std::string tail;
  for (const auto& l : last) tail += (tail.empty() ? "" : " | ") + l;
  return internal_error(args[0] + " failed (" + why + "): " + tail);
}

// Appends line to file unless a line starting with "<name>:" exists.
Status add_account_line(const std::string& file, const std::string& name, const std::string& line, bool required) {
  if (!sys::path_exists(file)) {
    if (required) return internal_error("rootfs is missing " + file);
    return Status::Ok();
  }
  auto text = sys::read_file(file, 16 << 20);
  if (!text) return text.error();
  std::string t = *text;
  std::string key = name + ":";
  if (t.rfind(key, 0) == 0 || t.find("\n" + key) != std::string::npos) return Status::Ok();
  if (!t.empty() && t.back() != '\n') t += '\n';
  t += line + "\n";
  struct stat st;
  if (::stat(file.c_str(), &st) != 0) return sys::errno_error("stat", file);
  if (Status s = sys::write_file_atomic(file, t); !s) return s;
  // write_file_atomic creates 0600 root files: keep the original owner/mode
  // (shadow must stay unreadable, passwd readable).
  if (::chmod(file.c_str(), st.st_mode & 07777) != 0) return sys::errno_error("chmod", file);
  if (::chown(file.c_str(), st.st_uid, st.st_gid) != 0) return sys::errno_error("chown", file);
  return Status::Ok();
}

// Removes the regular files in dir whose name ends with suffix ("" = all).
Status remove_files(const std::string& dir, const std::string& suffix) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return Status::Ok();
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    if (n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0)
      names.push_back(n);
  }
  ::closedir(d);
  for (const std::string& n : names) {
    std::string p = dir + "/" + n;
    struct stat st;
    if (::lstat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::unlink(p.c_str()) != 0)
      return sys::errno_error("unlink", p);
  }
  return Status::Ok();
}

Status copy_file(const std::string& from, const std::string& to, uid_t uid, gid_t gid) {
  auto text = sys::read_file(from, 16 << 20);
  if (!text) return text.error();
  if (Status s = sys::write_file(to, *text); !s) return s;
  if (::chown(to.c_str(), uid, gid) != 0) return sys::errno_error("chown", to);
  return Status::Ok();
}

}  // namespace

Status finalize_rootfs(const std::string& dir) {
  const std::string etc = dir + "/etc";
  int64_t days = sys::unix_seconds() / 86400;
  if (Status s = add_account_line(etc + "/passwd", "user", "user:x:1000:1000::/home/user:/bin/bash", true); !s) return s;
  if (Status s = add_account_line(etc + "/group", "user", "user:x:1000:", true); !s) return s;
  // "*": no password can log in; processes are started as user by the agent.
  if (Status s = add_account_line(etc + "/shadow", "user", "user:*:" + std::to_string(days) + ":0:99999:7:::", true); !s)
    return s;
  if (Status s = add_account_line(etc + "/gshadow", "user", "user:!::", false); !s) return s;

  const std::string home = dir + "/home/user";
  if (Status s = sys::make_dirs(home, 0755); !s) return s;
  if (::chown(home.c_str(), 1000, 1000) != 0) return sys::errno_error("chown", home);
  for (const char* f : {".bashrc", ".profile", ".bash_logout"}) {
    std::string src = etc + "/skel/" + f, dst = home + "/" + f;
    if (sys::path_exists(src) && !sys::path_exists(dst)) {
      if (Status s = copy_file(src, dst, 1000, 1000); !s) return s;
    }
  }
  // Every command runs as `bash -l -c`: /etc/profile's `$(id -u)` costs a
  // fork and exec of id(1) per command. bash knows its EUID already.
  if (auto profile = sys::read_file(etc + "/profile"); profile.ok()) {
    std::string text = *profile;
    const std::string from = "\"$(id -u)\"", to = "\"${EUID:-$(id -u)}\"";
    for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
      text.replace(at, from.size(), to);
    if (text != *profile) {
      if (Status s = sys::write_file_atomic(etc + "/profile", text); !s) return s;
      ::chmod((etc + "/profile").c_str(), 0644);
    }
  }
  if (Status s = sys::make_dirs(dir + "/.sandgate", 0755); !s) return s;
  if (Status s = remove_files(dir + "/var/cache/apt/archives", ".deb"); !s) return s;
  if (Status s = remove_files(dir + "/var/cache/apt", ".bin"); !s) return s;
  if (Status s = remove_files(dir + "/var/lib/apt/lists", ""); !s) return s;

  nlohmann::json marker{{"format", kTemplateFormat}, {"base", "debian-bookworm-minbase"},
                        {"created", sys::unix_seconds()}};
  return sys::write_file_atomic(dir + "/" + kMarkerFile, marker.dump() + "\n");
}

bool rootfs_ready(const std::string& dir) {
  auto text = sys::read_file(dir + "/" + kMarkerFile, 64 * 1024);
  if (!text) return false;
  auto j = nlohmann::json::parse(*text, nullptr, false);
  return j.is_object() && j.value("format", 0) == kTemplateFormat;
}

// The first template format with today's package list.
constexpr int kFirstFormatOfThisPackageSet = 4;

namespace {
// What E2B's base has beyond debootstrap's set: Node.js and npm, pip and
// venv, sudo (passwordless for "user"), iproute2 (ss: the SDKs'
// waitForPort). Installed by apt inside the new root from the same mirror:
// debootstrap's own resolver cannot install npm's dependency tree.
Status add_e2b_packages(const std::string& root, const std::function<void(const std::string&)>& progress) {
  if (progress) progress("I: installing nodejs, npm, python3-pip, python3-venv, sudo and iproute2 (apt)...");
  if (Status s = run_streaming({"chroot", root, "apt-get", "update", "-q"}, progress); !s) return s;
  if (Status s = run_streaming({"chroot", root, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y",
                                "-q", "-o", "Dpkg::Use-Pty=0", "--no-install-recommends", "nodejs", "npm", "python3-pip", "python3-venv", "sudo",
                                "iproute2"},
                               progress);
      !s)
    return s;
  // `pip install` works as in E2B's base (a python image): Debian marks
  // its Python externally managed (PEP 668), which refuses it.
  if (::unlink((root + "/usr/lib/python3.11/EXTERNALLY-MANAGED").c_str()) != 0 && errno != ENOENT)
    return sys::errno_error("unlink", "EXTERNALLY-MANAGED");
  if (Status s = sys::make_dirs(root + "/etc/sudoers.d", 0750); !s) return s;
  std::string rule = root + "/etc/sudoers.d/user";
  if (Status s = sys::write_file(rule, "user ALL=(ALL:ALL) NOPASSWD: ALL\n"); !s) return s;
  if (::chmod(rule.c_str(), 0440) != 0) return sys::errno_error("chmod", rule);
  return Status::Ok();
}
}  // namespace

Upgrade upgrade_for_format(int format) {
  if (format <= 0) return Upgrade::kNotATemplate;
  if (format >= kTemplateFormat) return Upgrade::kNone;
  return format >= kFirstFormatOfThisPackageSet ? Upgrade::kFinalize : Upgrade::kRebuild;
}

Status build_base_rootfs(const std::string& dest_dir, const std::function<void(const std::string& line)>& progress) {
  if (dest_dir.empty() || dest_dir.back() == '/') return invalid_error("template dir must be a path without a trailing '/'");
  if (rootfs_ready(dest_dir)) return Status::Ok();
  // A template of an older format is brought up to date in place.
  if (auto text = sys::read_file(dest_dir + "/" + kMarkerFile, 64 * 1024); text.ok()) {
    auto j = nlohmann::json::parse(*text, nullptr, false);
    int format = j.is_object() ? j.value("format", 0) : 0;
    if (upgrade_for_format(format) == Upgrade::kFinalize) {
      if (progress) progress("I: upgrading template " + dest_dir + " from format " + std::to_string(format));
      return finalize_rootfs(dest_dir);
    }
    if (upgrade_for_format(format) == Upgrade::kRebuild) {
      // Other packages: build anew, then drop the old tree. (Nothing runs
      // on it: templates are built before sandboxes start.)
      if (progress)
        progress("I: rebuilding template " + dest_dir + " (format " + std::to_string(format) +
                 " has an older package set)");
      std::string old = dest_dir + ".old";
      if (Status r = sys::remove_tree(old); !r) return r.error().with_context("remove " + old);
      if (::rename(dest_dir.c_str(), old.c_str()) != 0) return sys::errno_error("rename", dest_dir + " to " + old);
      Status b = build_base_rootfs(dest_dir, progress);
      if (b) {
        if (Status r = sys::remove_tree(old); !r) LOG_WARN("remove the old template " << old << ": " << r.error().message());
      }
      return b;
    }
  }
  if (sys::path_exists(dest_dir))
    return conflict_error("template dir " + dest_dir + " exists but is not a complete template: remove it to rebuild");
  std::string partial = dest_dir + ".partial";
  if (Status s = sys::remove_tree(partial); !s)
    return s.error().with_context("remove the leftover " + partial + " (a mount inside it? unmount it first)");
  size_t slash = dest_dir.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    if (Status s = sys::make_dirs(dest_dir.substr(0, slash)); !s) return s;
  }
  const char* m = std::getenv("SANDGATE_DEBIAN_MIRROR");
  std::string mirror = m && *m ? m : kDefaultMirror;
  Status s = run_streaming({"debootstrap", "--variant=minbase", "--include=bash,coreutils,procps,python3,ca-certificates,curl,git",
                            "bookworm", partial, mirror},
                           progress);
  if (!s) return s.error().with_context("build template " + dest_dir);
  if (Status e = add_e2b_packages(partial, progress); !e) return e.error().with_context("build template " + dest_dir);
  if (Status f = finalize_rootfs(partial); !f) return f.error().with_context("build template " + dest_dir);
  if (::rename(partial.c_str(), dest_dir.c_str()) != 0) return sys::errno_error("rename", partial + " to " + dest_dir);
  return Status::Ok();
}

namespace {

// The packages the code interpreter adds to base: E2B's code-interpreter
// image offers these where Debian packages them (its pip-only ones are not
// here; `pip install` works in a sandbox).
const std::vector<std::string> kInterpreterPackages = {
    "python3-ipykernel", "python3-jupyter-client", "python3-matplotlib-inline", "python3-numpy", "python3-pandas",
    "python3-matplotlib", "python3-scipy", "python3-seaborn", "python3-requests", "python3-bs4", "python3-openpyxl",
    "python3-sympy", "python3-pil", "python3-yaml", "python3-tabulate", "node-typescript"};

// The base template's identity: its marker's creation time.
std::string base_identity(const std::string& base_dir) {
  auto text = sys::read_file(base_dir + "/" + kMarkerFile, 64 * 1024);
  if (!text) return "";
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (!j.is_object()) return "";
  return std::to_string(j.value("format", 0)) + ":" + std::to_string(j.value("created", int64_t{0}));
}

std::string files_hash() {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (const auto& [name, content] : code_interpreter_files())
    for (const std::string* part : {&name, &content}) {
      for (unsigned char c : *part) h = (h ^ c) * 1099511628211ull;
      h = (h ^ 0xff) * 1099511628211ull;
    }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return std::string(hex, 12);
}

// The layer of this build's interpreter files.
std::string server_layer_dir(const std::string& dest_dir) { return dest_dir + "/server-" + files_hash(); }

bool packages_ready(const std::string& base_dir, const std::string& dest_dir) {
  auto text = sys::read_file(dest_dir + "/packages.json", 64 * 1024);
  if (!text || !sys::path_exists(dest_dir + "/packages")) return false;
  auto j = nlohmann::json::parse(*text, nullptr, false);
  std::string base = base_identity(base_dir);
  return j.is_object() && !base.empty() && j.value("base", "") == base;
}

// apt inside an overlay of the base: what it writes lands in the overlay's
// upper directory, which becomes the layer (whiteouts and opaque
// directories as the process runtime and ensure_template_image read them).
Status build_packages(const std::string& base_dir, const std::string& dest_dir,
                      const std::function<void(const std::string&)>& progress) {
  std::string partial = dest_dir + "/packages.partial";
  (void)::umount2((partial + "/merged").c_str(), MNT_DETACH);  // a build that was stopped
  if (Status s = sys::remove_tree(partial); !s)
    return s.error().with_context("remove the leftover " + partial + " (a mount inside it? unmount it first)");
  std::string upper = partial + "/upper", work = partial + "/work", merged = partial + "/merged";
  for (const std::string& d : {upper, work, merged})
    if (Status s = sys::make_dirs(d, 0755); !s) return s;
  std::string opts = "lowerdir=" + base_dir + ",upperdir=" + upper + ",workdir=" + work + ",redirect_dir=off,index=off";
  if (::mount("overlay", merged.c_str(), "overlay", 0, opts.c_str()) != 0)
    return sys::errno_error("mount an overlay of the base", merged);
  struct Unmount {
    std::string dir;
    ~Unmount() { (void)::umount2(dir.c_str(), MNT_DETACH); }
  } unmount{merged};
  if (progress) progress("I: installing the code interpreter's packages (apt): Jupyter's Python kernel, numpy, pandas, matplotlib, ...");
  if (Status s = run_streaming({"chroot", merged, "apt-get", "update", "-q"}, progress); !s) return s;
  std::vector<std::string> install = {"chroot", merged, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install",
                                      "-y", "-q", "-o", "Dpkg::Use-Pty=0", "--no-install-recommends"};
  install.insert(install.end(), kInterpreterPackages.begin(), kInterpreterPackages.end());
  if (Status s = run_streaming(install, progress); !s) return s;
  // matplotlib's font cache, made once here for user rather than at each
  // sandbox's first plot.
  (void)run_streaming({"chroot", "--userspec=1000:1000", merged, "env", "HOME=/home/user", "python3", "-c",
                       "import matplotlib.pyplot"},
                      nullptr);
  if (Status s = remove_files(merged + "/var/cache/apt/archives", ".deb"); !s) return s;
  if (Status s = remove_files(merged + "/var/cache/apt", ".bin"); !s) return s;
  if (Status s = remove_files(merged + "/var/lib/apt/lists", ""); !s) return s;
  if (::umount2(merged.c_str(), 0) != 0) return sys::errno_error("umount", merged);
  unmount.dir.clear();
  std::string layer = dest_dir + "/packages";
  if (Status s = sys::remove_tree(layer); !s) return s;
  if (::rename(upper.c_str(), layer.c_str()) != 0) return sys::errno_error("rename", upper + " to " + layer);
  if (Status s = sys::remove_tree(partial); !s) return s;
  nlohmann::json marker{{"base", base_identity(base_dir)}, {"created", sys::unix_seconds()}};
  return sys::write_file_atomic(dest_dir + "/packages.json", marker.dump() + "\n");
}

// The server's files as a layer of their own.
Status build_server_layer(const std::string& layer) {
  std::string partial = layer + ".partial";
  if (Status s = sys::remove_tree(partial); !s) return s;
  std::string dir = partial + kCodeInterpreterDir;
  if (Status s = sys::make_dirs(dir, 0755); !s) return s;
  for (const auto& [name, content] : code_interpreter_files()) {
    std::string path = dir + "/" + name;
    if (Status s = sys::write_file(path, content); !s) return s;
    ::chmod(path.c_str(), name.size() > 3 && name.compare(name.size() - 3, 3, ".py") == 0 ? 0755 : 0644);
  }
  for (std::string d = dir; d.size() > partial.size(); d = d.substr(0, d.rfind('/'))) ::chmod(d.c_str(), 0755);
  if (::rename(partial.c_str(), layer.c_str()) != 0) return sys::errno_error("rename", partial + " to " + layer);
  return Status::Ok();
}

}  // namespace

std::vector<std::string> code_interpreter_layers(const std::string& base_dir, const std::string& dest_dir) {
  std::string server = server_layer_dir(dest_dir);
  if (!packages_ready(base_dir, dest_dir) || !sys::path_exists(server)) return {};
  return {dest_dir + "/packages", server};
}

Result<std::vector<std::string>> ensure_code_interpreter_layers(
    const std::string& base_dir, const std::string& dest_dir, const std::function<void(const std::string& line)>& progress) {
  if (!rootfs_ready(base_dir)) return Error(ErrorKind::kUnavailable, "the base template " + base_dir + " is not built");
  if (Status s = sys::make_dirs(dest_dir, 0755); !s) return s.error();
  if (!packages_ready(base_dir, dest_dir))
    if (Status s = build_packages(base_dir, dest_dir, progress); !s)
      return s.error().with_context("build the code interpreter template in " + dest_dir);
  std::string server = server_layer_dir(dest_dir);
  if (!sys::path_exists(server))
    if (Status s = build_server_layer(server); !s)
      return s.error().with_context("build the code interpreter template in " + dest_dir);
  return std::vector<std::string>{dest_dir + "/packages", server};
}

}  // namespace sg::templates
