// Template builds: see build_service.h and docs/templates.md.
#include "sandbox-runtime/builds/build_service.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "base/hex.h"
#include "base/http/message.h"
#include "base/log.h"
#include "base/sys.h"
#include "sandbox-runtime/builds/oci_layer.h"
#include "sandbox-runtime/builds/registry.h"
#include "sandbox-runtime/host/envd_client.h"
#include "sandbox-runtime/templates/template_builder.h"

namespace sg::builds {

namespace {

using json = nlohmann::json;

constexpr size_t kMaxLogLine = 4096;
constexpr int64_t kMaxLogLines = 20000;
constexpr size_t kMaxSteps = 256;
constexpr size_t kMaxArg = 64 << 10;

std::string sha256_hex(std::string_view s) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d);
  return hex_lower(d, sizeof d);
}

bool is_hash(std::string_view h) {
  return h.size() == 64 && std::all_of(h.begin(), h.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// 'it''s' quoting for /bin/sh.
std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string uuid4() {
  std::string r = sys::random_hex(16);
  r[12] = '4';
  r[16] = "89ab"[r[16] % 4];
  return r.substr(0, 8) + "-" + r.substr(8, 4) + "-" + r.substr(12, 4) + "-" + r.substr(16, 4) + "-" + r.substr(20);
}

bool valid_name(const std::string& n) {
  if (n.empty() || n.size() > 128) return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

bool valid_user(const std::string& u) {
  if (u.empty() || u.size() > 32) return false;
  for (char c : u)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.'))
      return false;
  return true;
}

// What a build knows at a step: the layers so far and the context the
// next steps run in.
struct Context {
  std::string rootfs;
  std::vector<std::string> layers;
  std::map<std::string, std::string> env;
  std::string user = "user";
  std::string workdir = "/home/user";
  std::string key;  // the cache key of the layers so far

  std::string describe() const {
    json e = json::object();
    for (const auto& [k, v] : env) e[k] = v;
    return json{{"user", user}, {"workdir", workdir}, {"env", e}}.dump();
  }
};

}  // namespace

// One build's run: its context, its log, its sandboxes.
class BuildService::Run {
 public:
  Run(BuildService& svc, const Job& job) : svc_(svc), job_(job) {
    deadline_ = sys::monotonic_ns() + static_cast<uint64_t>(svc.cfg_.build_timeout.count()) * 1000000000ull;
  }

  // The build; an error names its step (set in step_).
  Status go() {
    if (Status s = base(); !s) return s;
    const auto& steps = job_.spec.steps;
    for (size_t i = 0; i < steps.size(); ++i) {
      step_ = std::to_string(i + 1);
      if (Status s = step(steps[i]); !s) return s;
    }
    step_ = "finalize";
    if (!job_.spec.start_cmd.empty()) {
      if (Status s = check_start(); !s) return s;
    }
    return Status::Ok();
  }

  const std::string& step_name() const { return step_; }
  const Context& context() const { return ctx_; }

  void log(const std::string& level, std::string message) {
    if (lines_ >= kMaxLogLines) return;
    if (message.size() > kMaxLogLine) message = message.substr(0, kMaxLogLine) + "...";
    storage::BuildLogRow r;
    r.at_ms = static_cast<int64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                       std::chrono::system_clock::now().time_since_epoch())
                                       .count());
    r.level = level;
    r.step = step_;
    r.message = ++lines_ == kMaxLogLines ? "(the log is cut here: " + std::to_string(kMaxLogLines) + " lines)" : message;
    Result<int64_t> n = svc_.store_.append_build_logs(job_.build_id, {r});
    if (!n) LOG_WARN("build " << job_.build_id << ": log: " << n.error().message());
  }

 private:
  // The base: a ready template of the tenant's, a public one, or base for
  // E2B's base image.
  Status base() {
    step_ = "base";
    const BuildSpec& s = job_.spec;
    std::string ref = s.from_template;
    if (!s.from_image.empty()) {
      std::string image = s.from_image;
      if (image == svc_.cfg_.base_image || image == svc_.cfg_.base_image + ":latest") {
        ref = svc_.cfg_.base_template;
        log("info", "FROM " + image + ": this server's base template");
      } else {
        return from_image(image);
      }
    }
    if (svc_.cfg_.ensure_template)
      if (Status s = svc_.cfg_.ensure_template(job_.tenant_id, ref); !s)
        return Error(s.error().kind(), "fromTemplate '" + ref + "': " + s.error().message());
    Result<std::optional<storage::TemplateRow>> t = svc_.store_.resolve_template(job_.tenant_id, ref);
    if (!t) return invalid_error("fromTemplate '" + ref + "': " + t.error().message());
    if (!*t) return invalid_error("fromTemplate '" + ref + "': no such template");
    if ((*t)->status != "ready") return invalid_error("fromTemplate '" + ref + "' is " + (*t)->status + ", not ready");
    if ((*t)->id == job_.template_id) return invalid_error("a template cannot be built from itself");
    ctx_.rootfs = (*t)->rootfs_path;
    json layers = json::parse((*t)->layers, nullptr, false);
    if (layers.is_array())
      for (const json& l : layers)
        if (l.is_string()) ctx_.layers.push_back(l.get<std::string>());
    json config = json::parse((*t)->config, nullptr, false);
    if (config.is_object()) {
      if (auto e = config.find("env"); e != config.end() && e->is_object())
        for (auto it = e->begin(); it != e->end(); ++it)
          if (it->is_string()) ctx_.env[it.key()] = it->get<std::string>();
      ctx_.user = config.value("user", ctx_.user);
      ctx_.workdir = config.value("workdir", ctx_.workdir);
    }
    ctx_.key = sha256_hex("tenant " + job_.tenant_id + "\nbase " + (*t)->id + " " + (*t)->build_id.value_or("") + " " +
                          ctx_.rootfs + " " + (*t)->layers);
    log("info", "FROM template " + (*t)->name + " (" + std::to_string(ctx_.layers.size()) + " layers)");
    return Status::Ok();
  }

  // A registry image as the base: pulled (blobs cached by digest), its
  // layers applied into a root of its own (cached by manifest digest),
  // given the user and the directories sandboxes need.
  Status from_image(const std::string& image) {
    const BuildSpec& s = job_.spec;
    Result<ImageRef> ref = parse_image_ref(image);
    if (!ref) return ref.error();
    std::optional<RegistryCredentials> creds;
    if (s.registry_auth) {
      if (s.registry_type != "registry")
        return invalid_error("fromImageRegistry type '" + s.registry_type +
                             "': only 'registry' (username and password) is supported by this server");
      creds = RegistryCredentials{s.registry_username, s.registry_password};
    }
    log("info", "FROM " + ref->text() + ": pulling");
    RegistryOptions opt;
    opt.blob_dir = svc_.cfg_.data_dir + "/images/blobs";
    opt.insecure = svc_.cfg_.insecure_registries;
    opt.log = [this](const std::string& m) { log("info", m); };
    Result<PulledImage> img = pull_image(*ref, creds, opt);
    if (!img) return img.error();
    std::string root = svc_.cfg_.data_dir + "/images/" + img->manifest_digest.substr(7);
    if (!sys::path_exists(root + "/" + templates::kMarkerFile)) {
      std::string tmp = root + ".partial-" + sys::random_hex(4);
      if (Status st = sys::make_dirs(tmp, 0755); !st) return st;
      struct Drop {
        std::string dir;
        ~Drop() { (void)sys::remove_tree(dir); }
      } drop{tmp};
      for (size_t i = 0; i < img->layer_files.size(); ++i) {
        Result<AppliedLayer> a = apply_layer(tmp, img->layer_files[i]);
        if (!a) return a.error().with_context("image layer " + std::to_string(i + 1));
      }
      if (Status st = make_sandbox_ready(tmp); !st) return st;
      (void)sys::remove_tree(root);
      if (::rename(tmp.c_str(), root.c_str()) != 0) return sys::errno_error("rename", tmp);
      drop.dir.clear();
      if (Status st = keep(root, storage::kFileImage); !st) return st;
    } else {
      log("info", "image " + img->manifest_digest.substr(0, 19) + ": unpacked already");
      (void)svc_.store_.touch_template_file(root, svc_.cfg_.clock());
    }
    ctx_.rootfs = root;
    for (const auto& [k, v] : img->config.env) ctx_.env[k] = v;
    // The image's WorkingDir is not taken: steps and sandboxes run as "user",
    // whom an image's directory (often /root) may shut out.
    ctx_.key = sha256_hex("tenant " + job_.tenant_id + "\nimage " + img->manifest_digest);
    log("info", "FROM " + ref->text() + " (" + img->manifest_digest.substr(0, 19) + ", " +
                    std::to_string(img->layer_files.size()) + " layers)");
    return Status::Ok();
  }

  // What every template's root needs: the user "user" (uid 1000, home
  // /home/user) and /.sandgate. The paths finalize_rootfs writes are
  // checked first to be plain (no symlink on the way): the image is
  // hostile, and this runs as root on the host.
  Status make_sandbox_ready(const std::string& root) {
    for (const char* rel : {"etc", "etc/passwd", "etc/group", "etc/shadow", "etc/gshadow", "etc/profile", "etc/skel",
                            "etc/skel/.bashrc", "etc/skel/.profile", "etc/skel/.bash_logout", "home", "home/user",
                            ".sandgate", "var", "var/cache", "var/cache/apt", "var/cache/apt/archives", "var/lib",
                            "var/lib/apt", "var/lib/apt/lists"}) {
      struct stat st;
      std::string p = root + "/" + rel;
      if (::lstat(p.c_str(), &st) != 0) continue;
      if (S_ISLNK(st.st_mode))
        return invalid_error(std::string("the image's /") + rel + " is a symbolic link: not supported as a template base");
    }
    for (const char* f : {"etc/passwd", "etc/group", "etc/shadow"}) {
      std::string p = root + "/" + f;
      if (!sys::path_exists(p)) {
        if (Status st = sys::make_dirs(root + "/etc", 0755); !st) return st;
        std::string init = std::string(f) == "etc/passwd" ? "root:x:0:0:root:/root:/bin/sh\n"
                           : std::string(f) == "etc/group" ? "root:x:0:\n"
                                                           : "root:*:19000:0:99999:7:::\n";
        if (Status st = sys::write_file(p, init); !st) return st;
        ::chmod(p.c_str(), std::string(f) == "etc/shadow" ? 0640 : 0644);
      }
    }
    return templates::finalize_rootfs(root);
  }

  Status step(const Step& st) {
    if (svc_.stop_flag_.load()) return Error(ErrorKind::kUnavailable, "the server stopped during the build");
    if (sys::monotonic_ns() >= deadline_)
      return Error(ErrorKind::kTimeout, "the build ran past its time limit of " +
                                            std::to_string(svc_.cfg_.build_timeout.count()) + " s");
    if (st.type == "ENV") {
      for (size_t i = 0; i + 1 < st.args.size(); i += 2) ctx_.env[st.args[i]] = st.args[i + 1];
      log("info", "ENV " + json(st.args).dump());
      ctx_.key = sha256_hex(ctx_.key + "\nENV " + json(st.args).dump());
      return Status::Ok();
    }
    if (st.type == "USER") {
      ctx_.user = st.args[0];
      log("info", "USER " + ctx_.user);
      ctx_.key = sha256_hex(ctx_.key + "\nUSER " + ctx_.user);
      return Status::Ok();
    }
    std::string script, user = ctx_.user, what;
    std::string upload;
    if (st.type == "RUN") {
      script = st.args[0];
      if (st.args.size() > 1 && !st.args[1].empty()) user = st.args[1];
      what = "RUN " + st.args[0];
    } else if (st.type == "WORKDIR") {
      std::string dir = absolute(st.args[0]);
      ctx_.workdir = dir;
      script = "mkdir -p " + quote(dir) + " && chown " + quote(ctx_.user) + ": " + quote(dir);
      user = "root";
      what = "WORKDIR " + dir;
    } else {  // COPY
      upload = svc_.upload_path(job_.tenant_id, st.files_hash);
      if (!sys::path_exists(upload))
        return invalid_error("COPY " + st.args[0] + ": its files (hash " + st.files_hash + ") were never uploaded");
      Result<std::string> content = sha256_file(upload);
      if (!content) return content.error();
      content->erase(0, 7);  // "sha256:"
      script = copy_script(st);
      user = "root";
      what = "COPY " + st.args[0] + " " + st.args[1] + " (upload " + content->substr(0, 12) + ")";
      ctx_.key = sha256_hex(ctx_.key + "\nUPLOAD " + *content);
    }
    // A sandbox holds at most kMaxTemplateLayers lower layers (a COPY's
    // step one more, its upload).
    if (ctx_.layers.size() + (upload.empty() ? 1 : 2) > runtime::kMaxTemplateLayers)
      return invalid_error("a template holds at most " + std::to_string(runtime::kMaxTemplateLayers) +
                           " layers, and this step would make more: join RUN steps with &&");
    std::string key = sha256_hex(ctx_.key + "\n" + st.type + " " + json(st.args).dump() + "\nas " + user + " in " +
                                 ctx_.describe());
    std::string dir = svc_.cfg_.data_dir + "/layers/" + key;
    bool force = job_.spec.force || st.force;
    if (!force && sys::path_exists(dir)) {
      log("info", "CACHED " + what);
      (void)svc_.store_.touch_template_file(dir, svc_.cfg_.clock());
      ctx_.layers.push_back(dir);
      ctx_.key = key;
      return Status::Ok();
    }
    log("info", what);
    if (force && sys::path_exists(dir)) {
      // Rebuilt under the same key: a new directory, so sandboxes still
      // on the old one keep it.
      dir += "-" + sys::random_hex(4);
    }
    if (!upload.empty()) (void)svc_.store_.touch_template_file(upload, svc_.cfg_.clock());
    if (Status s = run_step(script, user, upload, st.files_hash, dir); !s) return s;
    if (Status s = keep(dir, storage::kFileLayer); !s) return s;
    ctx_.layers.push_back(dir);
    ctx_.key = key;
    return Status::Ok();
  }

  // Records a file tree this build made, against the tenant's quota: past
  // it, the tree is removed and the build fails.
  Status keep(const std::string& path, const char* kind) {
    int64_t now = svc_.cfg_.clock();
    storage::TemplateFileRow f{path, job_.tenant_id, kind, job_.template_id,
                               static_cast<int64_t>(sys::disk_usage(path)), now, now};
    if (Status s = svc_.store_.add_template_file(f); !s) return s;
    Result<int64_t> bytes = svc_.store_.template_bytes(job_.tenant_id);
    if (!bytes) return bytes.error();
    if (*bytes <= svc_.cfg_.tenant_max_bytes) return Status::Ok();
    (void)sys::remove_tree(path);
    (void)svc_.store_.drop_template_file(path);
    return Error(ErrorKind::kQuota, "quota exceeded: this step's " + std::to_string(f.bytes >> 20) +
                                        " MiB would take this team's templates to " + std::to_string(*bytes >> 20) +
                                        " MiB, the limit is " + std::to_string(svc_.cfg_.tenant_max_bytes >> 20) +
                                        " MiB; delete templates to free space");
  }

  std::string absolute(const std::string& p) const {
    if (!p.empty() && p[0] == '/') return p;
    return ctx_.workdir + "/" + p;
  }

  // Unpacks the upload (a tar, gzipped or not, of paths relative to the
  // client's context directory) in a scratch directory, then copies the
  // source (a path or a glob) to the destination as Docker's COPY does.
  std::string copy_script(const Step& st) const {
    std::string src = st.args[0], dest = absolute(st.args[1]);
    bool dest_dir = !st.args[1].empty() && st.args[1].back() == '/';
    std::string user = st.args.size() > 2 && !st.args[2].empty() ? st.args[2] : ctx_.user;
    std::string mode = st.args.size() > 3 ? st.args[3] : "";
    std::string s = "set -e\nstage=$(mktemp -d /tmp/.sandgate-copy.XXXXXX)\n"
                    "tar -xf /.sandgate-build/" + st.files_hash + " -C \"$stage\" --no-same-owner\n"
                    "cd \"$stage\"\n"
                    "dest=" + quote(dest) + "\n"
                    "set -- " + src + "\n"  // unquoted: a glob expands here
                    "[ -e \"$1\" ] || [ -L \"$1\" ] || { echo " + quote("COPY: " + src + " is not in the upload") +
                    " >&2; exit 1; }\n";
    s += std::string("if [ $# -gt 1 ]") + (dest_dir ? " || true" : "") + "; then mkdir -p \"$dest\"; fi\n";
    s += "for f in \"$@\"; do\n"
         "  if [ -d \"$f\" ] && [ ! -L \"$f\" ]; then mkdir -p \"$dest\"; cp -a \"$f\"/. \"$dest\"/; t=\"$dest\"\n"
         "  elif [ -d \"$dest\" ]; then cp -a \"$f\" \"$dest\"/; t=\"$dest/$(basename \"$f\")\"\n"
         "  else mkdir -p \"$(dirname \"$dest\")\"; cp -a \"$f\" \"$dest\"; t=\"$dest\"; fi\n"
         "  chown -R " + quote(user) + ": \"$t\"\n";
    if (!mode.empty()) s += "  chmod -R " + quote(mode) + " \"$t\"\n";
    s += "done\ncd /\nrm -rf \"$stage\"\n";
    return s;
  }

  runtime::SandboxSpec spec() const {
    runtime::SandboxSpec sp;
    sp.id = "b" + sys::random_hex(10).substr(1);
    sp.rootfs = ctx_.rootfs;
    sp.layers = ctx_.layers;
    sp.cpu_count = static_cast<uint32_t>(build_.cpu_count);
    sp.memory_mb = static_cast<uint64_t>(build_.memory_mb);
    sp.max_pids = 4096;
    // Each step's writes are bounded as a sandbox's are: a step that fills
    // its layer fails with ENOSPC, not the host's disk.
    sp.disk_mb = static_cast<uint64_t>(svc_.cfg_.sandbox_disk_mb);
    for (const auto& [k, v] : ctx_.env) sp.env.emplace_back(k, v);
    for (const auto& kv : svc_.cfg_.sandbox_env) sp.env.push_back(kv);
    sp.envd_access_token = sys::random_hex(16);
    sp.ready_timeout = std::chrono::milliseconds(30000);
    return sp;
  }

  // A build sandbox, killed (and forgotten) when the guard goes.
  struct Box {
    Box(BuildService& s, runtime::SandboxSpec sp) : svc(s), spec(std::move(sp)) {}
    Box(const Box&) = delete;
    Box& operator=(const Box&) = delete;
    BuildService& svc;
    std::unique_ptr<runtime::Sandbox> sb;
    runtime::SandboxSpec spec;
    ~Box() {
      {
        // Off the list stop() kills from, before the sandbox goes.
        std::lock_guard<std::mutex> g(svc.mu_);
        if (sb) svc.running_.erase(sb.get());
      }
      if (sb) {
        if (Status s = sb->kill(); !s) LOG_ERROR("build sandbox " << spec.id << ": kill: " << s.error().message());
      }
      if (svc.cfg_.egress_policies) svc.cfg_.egress_policies->erase(spec.id);
    }
  };

  Result<std::unique_ptr<Box>> open_box(const std::string& staging) {
    auto box = std::make_unique<Box>(svc_, spec());
    if (!staging.empty()) box->spec.layers.push_back(staging);
    // Builds download: any destination (the host's internal networks
    // stay closed unless the server opens them).
    if (svc_.cfg_.egress_policies) svc_.cfg_.egress_policies->set(box->spec.id, network::EgressPolicy{});
    Result<std::unique_ptr<runtime::Sandbox>> sb = svc_.runtime_.create(box->spec);
    if (!sb) return sb.error().with_context("start the build sandbox");
    box->sb = std::move(*sb);
    std::lock_guard<std::mutex> g(svc_.mu_);
    if (svc_.stopping_) return Error(ErrorKind::kUnavailable, "the server stopped during the build");
    svc_.running_.insert(box->sb.get());
    return box;
  }

  std::chrono::milliseconds time_left() const {
    uint64_t now = sys::monotonic_ns();
    uint64_t left_ms = now >= deadline_ ? 1 : (deadline_ - now) / 1000000;
    return std::chrono::milliseconds(std::min<uint64_t>(left_ms, static_cast<uint64_t>(svc_.cfg_.step_timeout.count()) * 1000));
  }

  // One command in a fresh sandbox over the layers so far, its output
  // into the log by line, its writable layer exported to dir.
  Status run_step(const std::string& script, const std::string& user, const std::string& upload,
                  const std::string& hash, const std::string& dir) {
    std::string staging;
    if (!upload.empty()) {
      // The upload, visible at /.sandgate-build/<hash> through one more
      // layer, for this step only.
      staging = svc_.cfg_.data_dir + "/build-staging/" + job_.build_id + "-" + sys::random_hex(4);
      if (Status s = sys::make_dirs(staging + "/.sandgate-build", 0755); !s) return s;
      std::string target = staging + "/.sandgate-build/" + hash;
      if (::link(upload.c_str(), target.c_str()) != 0) return sys::errno_error("link", target);
    }
    struct Cleanup {
      std::string dir;
      ~Cleanup() {
        if (!dir.empty()) (void)sys::remove_tree(dir);
      }
    } cleanup{staging};
    Result<std::unique_ptr<Box>> box = open_box(staging);
    if (!box) return box.error();
    host::Command c;
    c.script = script;
    c.user = user;
    c.cwd = user == "root" ? "/" : ctx_.workdir;
    for (const auto& [k, v] : ctx_.env) c.env.emplace_back(k, v);
    c.timeout = time_left();
    std::string pending[3];
    auto flush_lines = [&](int stream, bool all) {
      std::string& p = pending[stream];
      size_t nl;
      while ((nl = p.find('\n')) != std::string::npos || (all && !p.empty()) || p.size() > kMaxLogLine) {
        size_t cut = nl == std::string::npos ? std::min(p.size(), kMaxLogLine) : nl;
        log(stream == 2 ? "warn" : "info", p.substr(0, cut));
        p.erase(0, nl == std::string::npos ? cut : cut + 1);
      }
    };
    Result<host::CommandResult> r = host::run_command(*(*box)->sb, (*box)->spec.envd_access_token, c,
                                                      [&](int stream, std::string_view d) {
                                                        pending[stream == 2 ? 2 : 1].append(d);
                                                        flush_lines(stream == 2 ? 2 : 1, false);
                                                      });
    flush_lines(1, true);
    flush_lines(2, true);
    if (!r && svc_.stop_flag_.load()) return Error(ErrorKind::kUnavailable, "the server stopped during the build");
    if (!r && r.error().kind() == ErrorKind::kTimeout && sys::monotonic_ns() >= deadline_)
      return Error(ErrorKind::kTimeout, "the build ran past its time limit of " +
                                            std::to_string(svc_.cfg_.build_timeout.count()) + " s");
    if (!r) return r.error();
    if (r->exit_code != 0) return invalid_error("the command failed: " + r->status);
    if (Status s = sys::make_dirs(svc_.cfg_.data_dir + "/layers", 0700); !s) return s;
    if (Status s = (*box)->sb->export_layer(dir); !s) return s;
    return Status::Ok();
  }

  // The start command once, at the end, and its ready command until it
  // succeeds: a template whose server never gets ready fails here rather
  // than in every create.
  Status check_start() {
    const BuildSpec& s = job_.spec;
    log("info", "Start command: " + s.start_cmd);
    Result<std::unique_ptr<Box>> box = open_box("");
    if (!box) return box.error();
    host::Command start;
    start.script = s.start_cmd;
    start.user = ctx_.user;
    start.cwd = ctx_.workdir;
    for (const auto& [k, v] : ctx_.env) start.env.emplace_back(k, v);
    start.background = true;
    Result<host::CommandResult> started = host::run_command(*(*box)->sb, (*box)->spec.envd_access_token, start, {});
    if (!started) return started.error().with_context("start command");
    std::string ready = s.ready_cmd.empty() ? "sleep 0" : s.ready_cmd;
    uint64_t until = sys::monotonic_ns() + static_cast<uint64_t>(svc_.cfg_.ready_timeout.count()) * 1000000000ull;
    for (int attempt = 0;; ++attempt) {
      host::Command check = start;
      check.script = ready;
      check.background = false;
      check.timeout = std::chrono::milliseconds(10000);
      Result<host::CommandResult> r = host::run_command(*(*box)->sb, (*box)->spec.envd_access_token, check, {});
      if (r && r->exit_code == 0) {
        log("info", "Ready command succeeded: " + ready);
        return Status::Ok();
      }
      if (sys::monotonic_ns() >= until || svc_.stop_flag_.load())
        return Error(ErrorKind::kTimeout, "the ready command '" + ready + "' did not succeed within " +
                                              std::to_string(svc_.cfg_.ready_timeout.count()) + " s of the start command");
      std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 10 ? 100 : 500));
    }
  }

 public:
  storage::BuildRow build_;

 private:
  BuildService& svc_;
  const Job& job_;
  Context ctx_;
  std::string step_ = "base";
  uint64_t deadline_ = 0;
  int64_t lines_ = 0;
};

BuildService::BuildService(storage::Store& store, runtime::Runtime& runtime, BuildConfig cfg)
    : store_(store), runtime_(runtime), cfg_(std::move(cfg)), secret_(sys::random_hex(32)) {
  for (size_t i = 0; i < cfg_.workers; ++i) workers_.emplace_back([this] { work(); });
}

BuildService::~BuildService() { stop(); }

void BuildService::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
  }
  stop_flag_.store(true);
  cv_.notify_all();
  {
    // A step in flight ends now: its sandbox goes, its command's stream
    // with it (each Box takes itself off this list before it is freed).
    std::lock_guard<std::mutex> g(mu_);
    for (runtime::Sandbox* sb : running_) (void)sb->kill();
  }
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  // Builds queued but never run.
  std::lock_guard<std::mutex> g(mu_);
  for (const Job& j : queue_) (void)store_.fail_build(j.build_id, "the server stopped before the build ran", "base", cfg_.clock());
  queue_.clear();
}

Result<storage::TemplateRow> BuildService::own_template(const std::string& tenant_id, const std::string& template_id) {
  Result<std::optional<storage::TemplateRow>> t = store_.find_template(tenant_id, template_id);
  if (!t) return t.error();
  if (!*t || (*t)->tenant_id != tenant_id) return not_found_error("template '" + template_id + "' not found");
  return **t;
}

Result<BuildService::Requested> BuildService::request(const std::string& tenant_id, const std::string& name,
                                                     const std::vector<std::string>& tags, int64_t cpu_count,
                                                     int64_t memory_mb) {
  if (!valid_name(name))
    return invalid_error("template name '" + name + "': 1 to 128 of a-z, 0-9, '-', '_' and '.'");
  if (cpu_count < 1 || cpu_count > 64) return invalid_error("cpuCount " + std::to_string(cpu_count) + ": 1 to 64");
  if (memory_mb < 128 || memory_mb > 65536) return invalid_error("memoryMB " + std::to_string(memory_mb) + ": 128 to 65536");
  if (tags.size() > storage::kMaxTags) return invalid_error("more than " + std::to_string(storage::kMaxTags) + " tags");
  for (const std::string& tag : tags)
    if (!storage::valid_tag(tag)) return invalid_error("tag '" + tag + "' must be 1 to 128 of letters, digits, '.', '_' and '-'");
  int64_t now = cfg_.clock();
  storage::TemplateRow fresh;
  fresh.id = sys::random_hex(10);
  fresh.status = "building";
  fresh.cpu_count = cpu_count;
  fresh.memory_mb = memory_mb;
  fresh.disk_size_mb = cfg_.sandbox_disk_mb;
  fresh.created_at = fresh.updated_at = now;
  storage::BuildRow b;
  b.id = uuid4();
  b.cpu_count = cpu_count;
  b.memory_mb = memory_mb;
  b.created_at = now;
  b.tags = tags;
  Result<storage::TemplateRow> t = store_.request_build(tenant_id, name, fresh, b);
  if (!t) return t.error();
  return Requested{*t, b.id};
}

namespace {

Status validate(const BuildSpec& s) {
  if (s.from_template.empty() == s.from_image.empty())
    return invalid_error("a build needs exactly one of fromTemplate and fromImage");
  if (s.registry_auth && s.from_image.empty()) return invalid_error("fromImageRegistry needs fromImage");
  if (s.steps.size() > kMaxSteps) return invalid_error("more than " + std::to_string(kMaxSteps) + " steps");
  for (size_t i = 0; i < s.steps.size(); ++i) {
    const Step& st = s.steps[i];
    std::string where = "steps[" + std::to_string(i) + "] (" + st.type + ")";
    for (const std::string& a : st.args)
      if (a.size() > kMaxArg || a.find('\0') != std::string::npos) return invalid_error(where + ": an argument over 64 KiB or with NUL");
    auto need = [&](size_t lo, size_t hi) -> Status {
      if (st.args.size() < lo || st.args.size() > hi)
        return invalid_error(where + ": " + std::to_string(st.args.size()) + " arguments, want " + std::to_string(lo) +
                             (hi == lo ? "" : " to " + std::to_string(hi)));
      return Status::Ok();
    };
    if (st.type == "RUN") {
      if (Status r = need(1, 2); !r) return r;
      if (st.args[0].empty()) return invalid_error(where + ": an empty command");
      if (st.args.size() > 1 && !st.args[1].empty() && !valid_user(st.args[1])) return invalid_error(where + ": user '" + st.args[1] + "'");
    } else if (st.type == "COPY") {
      if (Status r = need(2, 4); !r) return r;
      if (!is_hash(st.files_hash)) return invalid_error(where + ": filesHash must be 64 hex digits");
      const std::string& src = st.args[0];
      if (src.empty() || src[0] == '/' || src.find("..") != std::string::npos)
        return invalid_error(where + ": source '" + src + "' must be a relative path inside the context");
      for (char c : src)
        if (c == '\'' || c == '"' || c == '`' || c == '$' || c == ';' || c == '&' || c == '|' || c == '\\' || c == '\n' || c == '(' || c == ')' || c == '<' || c == '>' || c == ' ')
          return invalid_error(where + ": source '" + src + "' has a character this server does not copy");
      if (st.args[1].empty()) return invalid_error(where + ": an empty destination");
      if (st.args.size() > 2 && !st.args[2].empty() && !valid_user(st.args[2])) return invalid_error(where + ": user '" + st.args[2] + "'");
      if (st.args.size() > 3 && !st.args[3].empty() &&
          (st.args[3].size() > 4 || st.args[3].find_first_not_of("01234567") != std::string::npos))
        return invalid_error(where + ": mode '" + st.args[3] + "' must be octal");
    } else if (st.type == "ENV") {
      if (st.args.empty() || st.args.size() % 2) return invalid_error(where + ": want key, value pairs");
      for (size_t k = 0; k < st.args.size(); k += 2)
        if (st.args[k].empty() || st.args[k].find('=') != std::string::npos) return invalid_error(where + ": name '" + st.args[k] + "'");
    } else if (st.type == "WORKDIR") {
      if (Status r = need(1, 1); !r) return r;
      if (st.args[0].empty()) return invalid_error(where + ": an empty path");
    } else if (st.type == "USER") {
      if (Status r = need(1, 1); !r) return r;
      if (!valid_user(st.args[0])) return invalid_error(where + ": user '" + st.args[0] + "'");
    } else {
      return invalid_error(where + ": unknown step type (RUN, COPY, ENV, WORKDIR and USER are built)");
    }
  }
  // Each RUN and COPY makes a layer: more than a sandbox holds is refused
  // now, not after the first 64 have been built (layers of a fromTemplate
  // base are checked as the steps run).
  size_t layers = static_cast<size_t>(
      std::count_if(s.steps.begin(), s.steps.end(), [](const Step& st) { return st.type == "RUN" || st.type == "COPY"; }));
  if (layers > runtime::kMaxTemplateLayers)
    return invalid_error("the steps would make " + std::to_string(layers) + " layers (each RUN and COPY makes one); " +
                         "a template holds at most " + std::to_string(runtime::kMaxTemplateLayers) +
                         ": join RUN steps with &&");
  return Status::Ok();
}

}  // namespace

Error BuildService::storage_full(int64_t bytes) const {
  return Error(ErrorKind::kQuota, "quota exceeded: this team's templates keep " + std::to_string(bytes >> 20) +
                                      " MiB, the limit is " + std::to_string(cfg_.tenant_max_bytes >> 20) +
                                      " MiB; delete templates to free space");
}

Status BuildService::start(const std::string& tenant_id, const std::string& template_id, const std::string& build_id,
                           BuildSpec spec) {
  Result<storage::TemplateRow> t = own_template(tenant_id, template_id);
  if (!t) {
    // A template still building its first build is not found by
    // find_template's readers only if deleted; building ones are found.
    return t.error();
  }
  Result<std::optional<storage::BuildRow>> b = store_.find_build(t->id, build_id);
  if (!b) return b.error();
  if (!*b) return not_found_error("build '" + build_id + "' of template '" + template_id + "' not found");
  if ((*b)->status != storage::kBuildWaiting)
    return conflict_error("build '" + build_id + "' is " + (*b)->status + "; request a new build");
  if (Status s = validate(spec); !s) return s;
  Result<int64_t> bytes = store_.template_bytes(tenant_id);
  if (!bytes) return bytes.error();
  if (*bytes >= cfg_.tenant_max_bytes)
    return storage_full(*bytes);
  std::lock_guard<std::mutex> g(mu_);
  if (stopping_) return Error(ErrorKind::kUnavailable, "the server is stopping");
  size_t mine = building_.count(tenant_id) ? building_[tenant_id] : 0;
  for (const Job& j : queue_) mine += j.tenant_id == tenant_id;
  if (mine >= cfg_.tenant_max_builds)
    return Error(ErrorKind::kQuota, "quota exceeded: this team has " + std::to_string(mine) +
                                        " builds queued or running, the limit is " +
                                        std::to_string(cfg_.tenant_max_builds) + "; wait for one to end");
  if (Status s = store_.start_build(build_id, cfg_.clock()); !s) return s;
  queue_.push_back(Job{tenant_id, t->id, build_id, std::move(spec)});
  cv_.notify_one();
  return Status::Ok();
}

void BuildService::work() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] {
        return stopping_ || (!collecting_ && (!queue_.empty() || (collect_wanted_ && running_jobs_ == 0)));
      });
      if (stopping_) return;
      if (queue_.empty()) {
        collect_wanted_ = false;
        collecting_ = true;
      } else {
        job = std::move(queue_.front());
        queue_.pop_front();
        ++running_jobs_;
        ++building_[job.tenant_id];
      }
    }
    if (job.build_id.empty()) {
      Result<uint64_t> freed = collect_garbage();
      if (!freed) LOG_WARN("template files: collection: " << freed.error().message());
      std::lock_guard<std::mutex> g(mu_);
      collecting_ = false;
      cv_.notify_all();
      continue;
    }
    run(job);
    std::lock_guard<std::mutex> g(mu_);
    --running_jobs_;
    if (--building_[job.tenant_id] == 0) building_.erase(job.tenant_id);
    collect_wanted_ = true;
    cv_.notify_all();
  }
}

void BuildService::collect_soon() {
  std::lock_guard<std::mutex> g(mu_);
  collect_wanted_ = true;
  cv_.notify_all();
}

Result<uint64_t> BuildService::collect_garbage() {
  Result<std::vector<std::pair<std::string, std::string>>> roots = store_.template_roots_in_use();
  if (!roots) return roots.error();
  std::set<std::string> used;
  for (const auto& [rootfs, layers] : *roots) {
    used.insert(rootfs);
    json l = json::parse(layers, nullptr, false);
    if (l.is_array())
      for (const json& d : l)
        if (d.is_string()) used.insert(d.get<std::string>());
  }
  Result<std::vector<storage::TemplateFileRow>> files = store_.template_files();
  if (!files) return files.error();
  int64_t now = cfg_.clock(), keep = cfg_.keep_unused.count();
  uint64_t freed = 0;
  for (const storage::TemplateFileRow& f : *files) {
    bool stale = now - f.used_at >= keep;
    if (f.kind == storage::kFileUpload ? !stale : used.count(f.path) || (f.template_live && !stale)) continue;
    if (Status s = sys::remove_tree(f.path); !s) {
      LOG_WARN("template files: remove " << f.path << ": " << s.error().message());
      continue;
    }
    // What the kvm backend made of it (its image and snapshots), if any.
    if (cfg_.drop_prepared) freed += cfg_.drop_prepared(f.path);
    if (Status s = store_.drop_template_file(f.path); !s) return s.error();
    freed += static_cast<uint64_t>(f.bytes);
  }
  // Image blobs are a download cache: the unpacked roots are what
  // templates use.
  std::string blobs = cfg_.data_dir + "/images/blobs";
  if (DIR* d = ::opendir(blobs.c_str())) {
    while (struct dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::string p = blobs + "/" + e->d_name;
      struct stat st;
      if (::lstat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || now - st.st_mtime < keep) continue;
      if (::unlink(p.c_str()) == 0) freed += static_cast<uint64_t>(st.st_blocks) * 512;
    }
    ::closedir(d);
  }
  if (freed) LOG_INFO("template files: collected " << (freed >> 10) << " KiB");
  return freed;
}

void BuildService::run(const Job& job) {
  uint64_t t0 = sys::monotonic_ns();
  Run r(*this, job);
  Result<std::optional<storage::BuildRow>> b = store_.find_build(job.template_id, job.build_id);
  if (!b || !*b) {
    LOG_ERROR("build " << job.build_id << ": its row is gone");
    return;
  }
  r.build_ = **b;
  r.log("info", "Building template " + job.template_id + ", build " + job.build_id);
  Status s = r.go();
  int64_t now = cfg_.clock();
  if (!s) {
    // An internal error names host paths: the client gets a reference.
    std::string why = http::client_message(s.error());
    r.log("error", "Build failed at step " + r.step_name() + ": " + why);
    if (Status f = store_.fail_build(job.build_id, why, r.step_name(), now); !f)
      LOG_ERROR("build " << job.build_id << ": " << f.error().message());
    LOG_INFO("template build " << job.build_id << " failed at step " << r.step_name() << ": " << s.error().message());
    return;
  }
  const Context& c = r.context();
  json config = {{"user", c.user}, {"workdir", c.workdir}, {"env", c.env}};
  if (!job.spec.start_cmd.empty()) {
    config["startCmd"] = job.spec.start_cmd;
    config["readyCmd"] = job.spec.ready_cmd;
  }
  if (cfg_.prepare_template) {
    r.log("info", "Preparing the template for microVMs: its root filesystem image and boot snapshot");
    runtime::SandboxSpec spec;
    spec.id = "template";
    spec.rootfs = c.rootfs;
    spec.layers = c.layers;
    spec.cpu_count = static_cast<uint32_t>(r.build_.cpu_count);
    spec.memory_mb = static_cast<uint64_t>(r.build_.memory_mb);
    // As a create will read it back from the template's config.
    spec.start = host::start_command_of(config.dump(), cfg_.ready_timeout);
    if (Status p = cfg_.prepare_template(spec); !p) {
      std::string why = http::client_message(p.error());
      r.log("error", "Build failed preparing the template: " + why);
      if (Status f = store_.fail_build(job.build_id, why, "prepare", cfg_.clock()); !f)
        LOG_ERROR("build " << job.build_id << ": " << f.error().message());
      LOG_INFO("template build " << job.build_id << " failed preparing it: " << p.error().message());
      return;
    }
  }
  double secs = static_cast<double>(sys::monotonic_ns() - t0) / 1e9;
  r.log("info", "Build finished in " + std::to_string(secs).substr(0, std::to_string(secs).find('.') + 2) + " s: " +
                    std::to_string(c.layers.size()) + " layers");
  if (Status f = store_.finish_build(job.build_id, c.rootfs, json(c.layers).dump(), config.dump(), now); !f) {
    LOG_ERROR("build " << job.build_id << ": " << f.error().message());
    (void)store_.fail_build(job.build_id, f.error().message(), "finalize", now);
  } else if (cfg_.on_ready) {
    cfg_.on_ready();
  }
}

Result<BuildService::Status_> BuildService::status(const std::string& tenant_id, const std::string& template_id,
                                                  const std::string& build_id, int64_t logs_offset, int64_t limit) {
  Result<storage::TemplateRow> t = own_template(tenant_id, template_id);
  if (!t) return t.error();
  Result<std::optional<storage::BuildRow>> b = store_.find_build(t->id, build_id);
  if (!b) return b.error();
  if (!*b) return not_found_error("build '" + build_id + "' of template '" + template_id + "' not found");
  Status_ out;
  out.build = **b;
  Result<std::vector<storage::BuildLogRow>> logs = store_.build_logs(build_id, std::max<int64_t>(0, logs_offset), limit);
  if (!logs) return logs.error();
  out.logs = std::move(*logs);
  if (out.build.status == storage::kBuildError) {
    Result<std::vector<storage::BuildLogRow>> all = store_.build_logs(build_id, 0, kMaxLogLines + 1);
    if (all) {
      size_t from = all->size() > 20 ? all->size() - 20 : 0;
      out.reason_logs.assign(all->begin() + static_cast<long>(from), all->end());
    }
  }
  return out;
}

Result<std::vector<storage::BuildLogRow>> BuildService::logs(const std::string& tenant_id,
                                                             const std::string& template_id,
                                                             const std::string& build_id,
                                                             const storage::BuildLogQuery& q) {
  Result<storage::TemplateRow> t = own_template(tenant_id, template_id);
  if (!t) return t.error();
  Result<std::optional<storage::BuildRow>> b = store_.find_build(t->id, build_id);
  if (!b) return b.error();
  if (!*b) return not_found_error("build '" + build_id + "' of template '" + template_id + "' not found");
  return store_.build_logs(build_id, q);
}

std::string BuildService::upload_path(const std::string& tenant_id, const std::string& hash) const {
  return cfg_.data_dir + "/template-files/" + tenant_id + "/" + hash;
}

std::string BuildService::sign(const std::string& template_id, const std::string& hash, int64_t expires) const {
  std::string msg = template_id + "\n" + hash + "\n" + std::to_string(expires);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  HMAC(EVP_sha256(), secret_.data(), static_cast<int>(secret_.size()), reinterpret_cast<const unsigned char*>(msg.data()),
       msg.size(), mac, &len);
  return hex_lower(mac, len);
}

bool BuildService::is_upload_path(std::string_view path) { return path.rfind("/templates/uploads/", 0) == 0; }

Result<BuildService::FileLink> BuildService::file_link(const std::string& tenant_id, const std::string& template_id,
                                                       const std::string& hash) {
  if (!is_hash(hash)) return invalid_error("files hash '" + hash + "': want 64 hex digits");
  Result<storage::TemplateRow> t = own_template(tenant_id, template_id);
  if (!t) return t.error();
  FileLink link;
  link.present = sys::path_exists(upload_path(tenant_id, hash));
  int64_t expires = cfg_.clock() + cfg_.upload_link_ttl.count();
  link.target = "/templates/uploads/" + t->id + "/" + hash + "?expires=" + std::to_string(expires) +
                "&signature=" + sign(t->id, hash, expires);
  return link;
}

Status BuildService::upload(const std::string& template_id, const std::string& hash, const std::string& query,
                            std::string_view body) {
  if (!is_hash(hash)) return invalid_error("files hash '" + hash + "': want 64 hex digits");
  std::string expires, signature;
  for (size_t at = 0; at <= query.size();) {
    size_t amp = query.find('&', at);
    if (amp == std::string::npos) amp = query.size();
    std::string kv = query.substr(at, amp - at);
    if (kv.rfind("expires=", 0) == 0) expires = kv.substr(8);
    if (kv.rfind("signature=", 0) == 0) signature = kv.substr(10);
    at = amp + 1;
  }
  char* end = nullptr;
  long long exp = std::strtoll(expires.c_str(), &end, 10);
  std::string want = expires.empty() || *end ? "" : sign(template_id, hash, exp);
  if (want.empty() || signature.size() != want.size() || CRYPTO_memcmp(want.data(), signature.data(), want.size()) != 0)
    return Error(ErrorKind::kUnauthorized, "upload link: bad signature (ask GET /templates/{id}/files/{hash} for a new one)");
  if (exp < cfg_.clock()) return Error(ErrorKind::kUnauthorized, "upload link: expired; ask for a new one");
  if (body.size() > cfg_.max_upload_bytes)
    return invalid_error("upload of " + std::to_string(body.size()) + " bytes: the limit is " +
                         std::to_string(cfg_.max_upload_bytes));
  // The owner: the template's tenant (the link was signed for it).
  Result<std::vector<storage::BuildRow>> builds = store_.list_builds(template_id);
  if (!builds || builds->empty()) return not_found_error("template '" + template_id + "' has no build");
  const std::string& tenant = builds->front().tenant_id;
  Result<int64_t> bytes = store_.template_bytes(tenant);
  if (!bytes) return bytes.error();
  if (*bytes + static_cast<int64_t>(body.size()) > cfg_.tenant_max_bytes)
    return storage_full(*bytes);
  std::string dir = cfg_.data_dir + "/template-files/" + tenant;
  if (Status s = sys::make_dirs(dir, 0700); !s) return s;
  std::string path = dir + "/" + hash;
  if (Status s = sys::write_file_atomic(path, body); !s) return s;
  int64_t now = cfg_.clock();
  return store_.add_template_file(storage::TemplateFileRow{path, tenant, storage::kFileUpload, template_id,
                                                           static_cast<int64_t>(sys::disk_usage(path)), now, now});
}

}  // namespace sg::builds
