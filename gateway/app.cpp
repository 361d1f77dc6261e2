// The server's wiring and its start-up and shutdown order.
#include "gateway/app.h"

#include <signal.h>
#include <arpa/inet.h>
#include <sys/resource.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include <nlohmann/json.hpp>

#include "api-e2b/control_plane.h"
#include "sandbox-runtime/builds/build_service.h"
#include "sandbox-runtime/lifecycle/sandbox_service.h"
#include "gateway/cluster.h"
#include "gateway/cluster_routes.h"
#include "gateway/cluster_templates.h"
#include "gateway/cluster_tenants.h"
#include "gateway/egress_proxy.h"
#include "gateway/http/server.h"
#include "wait-engine/llm/model_gateway.h"
#include "wait-engine/memory/offload.h"
#include "wait-engine/memory/pause_pack.h"
#include "wait-engine/memory/pressure.h"
#include "sandbox-runtime/microvm/microvm_runtime.h"
#include "sandbox-runtime/process/process_runtime.h"
#include "sandbox-runtime/process/userns.h"
#include "sandbox-runtime/network/host_network.h"
#include "sandbox-runtime/process/swap.h"
#include "wait-engine/memory/swap_audit.h"
#include "wait-engine/metrics/histogram.h"
#include "sandbox-runtime/templates/template_builder.h"
#include "storage/batch_writer.h"
#include "storage/store.h"
#include "base/fd.h"
#include "base/log.h"
#include "base/sys.h"
#include "tenancy/api_key.h"
#include "tenancy/llm_keys.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/tenants.h"

extern char** environ;

namespace sg::gateway {

namespace {

std::string exe_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

// No token configured: open. Otherwise the bearer token must match
// (compared in constant time).
bool metrics_authorized(const http::HttpRequest& req, const std::string& token) {
  if (token.empty()) return true;
  std::string auth = req.header("authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (auth.size() <= kBearer.size() || auth.compare(0, kBearer.size(), kBearer) != 0) return false;
  return tenancy::secrets_equal(std::string_view(auth).substr(kBearer.size()), token);
}

// The local tenant's key lives in a 0600 file beside the database: the
// database holds only its hash, and the run command must print it each time.
Result<std::string> ensure_local_tenant(tenancy::Tenants& tenants, storage::Store& store, const AppConfig& cfg) {
  std::string key_file = cfg.data_dir + "/local-api-key";
  Result<std::optional<storage::TenantRow>> t = store.find_tenant_by_name("local");
  if (!t) return t.error();
  if (*t) {
    Result<std::string> saved = sys::read_file(key_file, 4096);
    if (saved) {
      std::string key = *saved;
      while (!key.empty() && (key.back() == '\n' || key.back() == ' ')) key.pop_back();
      Result<storage::TenantRow> who = tenants.authenticate(key);
      if (who && who->name == "local") return key;
    }
    Result<tenancy::CreatedKey> k = tenants.add_key("local");
    if (!k) return k.error();
    if (Status s = sys::write_file_atomic(key_file, k->key + "\n"); !s) return s.error();
    return k->key;
  }
  Result<tenancy::CreatedKey> k =
      tenants.create("local", tenancy::Quota{cfg.local_max_sandboxes, cfg.local_max_memory_mb});
  if (!k) return k.error();
  if (Status s = sys::write_file_atomic(key_file, k->key + "\n"); !s) return s.error();
  return k->key;
}

// In a cluster the "local" tenant is one for all nodes (in etcd, mirrored
// here); each node adds a key of its own to it, kept in its key file, so
// the key any node prints works on every node.
Result<std::string> ensure_cluster_local_tenant(tenancy::Tenants& tenants, storage::Store& store, const AppConfig& cfg,
                                                Cluster& cluster) {
  std::string key_file = cfg.data_dir + "/local-api-key";
  if (Result<std::string> saved = sys::read_file(key_file, 4096); saved) {
    std::string key = *saved;
    while (!key.empty() && (key.back() == '\n' || key.back() == ' ')) key.pop_back();
    Result<storage::TenantRow> who = tenants.authenticate(key);
    if (who && who->name == "local") return key;
  }
  Result<tenancy::CreatedKey> k = cluster_tenants::create_tenant(
      cluster.etcd(), cluster.prefix(), "local", tenancy::Quota{cfg.local_max_sandboxes, cfg.local_max_memory_mb});
  if (!k && k.error().kind() == ErrorKind::kConflict) k = cluster_tenants::add_key(cluster.etcd(), cluster.prefix(), "local");
  if (!k) return k.error();
  // Into this node's mirror at once (its watch brings the same rows).
  Result<storage::TenantRow> t = cluster_tenants::find(cluster.etcd(), cluster.prefix(), "local");
  if (!t) return t.error();
  if (Status s = store.upsert_tenant(*t); !s)
    return Error(s.error().kind(), "this data directory has a tenant \"local\" of its own, not the cluster's (" +
                                       s.error().message() + "): start the node on a fresh data directory");
  if (Status s = store.upsert_key(k->row); !s) return s.error();
  if (Status s = sys::write_file_atomic(key_file, k->key + "\n"); !s) return s.error();
  return k->key;
}

// The server's own templates (no owner: public). A built one has layers
// over its rootfs and a configuration (its start command); status is
// "ready", or "building"/"failed" while it has none yet.
struct ServerTemplate {
  std::string name, rootfs;
  int64_t disk_mb = 1024;
  int64_t memory_mb = 512;
  std::string status = "ready";
  std::string layers = "[]";
  std::string config = "{}";
};

Status register_template(storage::Store& store, const ServerTemplate& st) {
  Result<std::optional<storage::TemplateRow>> existing = store.find_template("", st.name);
  if (!existing) return existing.error();
  storage::TemplateRow t;
  if (*existing) {
    t = **existing;
  } else {
    t.id = lifecycle::new_sandbox_id();
    t.name = st.name;
    t.created_at = sys::unix_seconds();
  }
  t.status = st.status;
  t.rootfs_path = st.rootfs;
  t.cpu_count = 2;
  t.memory_mb = st.memory_mb;
  t.disk_size_mb = st.disk_mb;
  t.layers = st.layers;
  t.config = st.config;
  t.updated_at = sys::unix_seconds();
  return store.upsert_template(t);
}

// sandgate's own read-only routes next to the E2B API, authenticated with
// the tenant's E2B key (X-API-KEY) and scoped to it:
//   GET /sandboxes/{id}/events   the sandbox's recorded events (lifecycle
//                                and wait transitions), oldest first
//   GET /llm/usage[?sandboxID=]  the tenant's model usage rows and totals
bool is_extension(const http::HttpRequest& req, bool* events) {
  *events = req.path.rfind("/sandboxes/", 0) == 0 && req.path.size() > 18 &&
            req.path.compare(req.path.size() - 7, 7, "/events") == 0;
  return *events || req.path == "/llm/usage";
}

// sandgate's own routes for an authenticated tenant (a request from a
// client, or one another cluster node forwarded).
std::optional<http::HttpResponse> extension_for(const http::HttpRequest& req, const storage::TenantRow& tenant,
                                                storage::Store& store) {
  bool events = false;
  if (!is_extension(req, &events)) return std::nullopt;
  if (req.method != "GET") return http::json_error(405, "method " + req.method + " not allowed on " + req.path);
  const storage::TenantRow* who = &tenant;
  if (events) {
    std::string id = req.path.substr(11, req.path.size() - 11 - 7);
    if (id.empty() || id.find('/') != std::string::npos) return http::json_error(404, "no route for GET " + req.path);
    Result<std::optional<storage::SandboxRow>> row = store.get_sandbox(who->id, id);
    if (!row) return api::error_response(row.error());
    if (!*row) return http::json_error(404, "sandbox \"" + id + "\" not found");
    Result<std::vector<storage::EventRow>> evs = store.events_for_sandbox(id);
    if (!evs) return api::error_response(evs.error());
    nlohmann::json out = nlohmann::json::array();
    for (const auto& e : *evs) {
      if (e.tenant_id && *e.tenant_id != who->id) continue;
      nlohmann::json detail = nlohmann::json::parse(e.detail, nullptr, false);
      out.push_back({{"seq", e.seq}, {"at", e.at}, {"kind", e.kind}, {"detail", detail.is_discarded() ? nlohmann::json(e.detail) : detail}});
    }
    return http::json_body(200, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  std::vector<std::pair<std::string, std::string>> q;
  if (!http::parse_query(req.query, q)) return http::json_error(400, "malformed query string");
  storage::LlmUsageQuery uq;
  uq.tenant_id = who->id;
  for (auto& [k, v] : q)
    if (k == "sandboxID") uq.sandbox_id = v;
  uq.limit = storage::kMaxLlmUsagePage;
  Result<std::vector<storage::LlmUsageRow>> rows = store.list_llm_usage(uq);
  if (!rows) return api::error_response(rows.error());
  Result<storage::LlmUsageTotals> tot = store.llm_usage_totals(who->id, uq.sandbox_id);
  if (!tot) return api::error_response(tot.error());
  nlohmann::json list = nlohmann::json::array();
  for (const auto& r : *rows)
    list.push_back({{"at_ms", r.at_ms}, {"sandboxID", r.sandbox_id ? nlohmann::json(*r.sandbox_id) : nlohmann::json()},
                    {"provider", r.provider}, {"route", r.route}, {"model", r.model}, {"stream", r.stream},
                    {"status", r.status}, {"outcome", r.outcome}, {"input_tokens", r.input_tokens},
                    {"output_tokens", r.output_tokens}, {"cache_read_tokens", r.cache_read_tokens},
                    {"cache_write_tokens", r.cache_write_tokens}, {"usage_found", r.usage_found},
                    {"duration_ms", r.duration_ms}});
  nlohmann::json out = {{"requests", list},
                        {"totals",
                         {{"requests", tot->requests}, {"input_tokens", tot->input_tokens},
                          {"output_tokens", tot->output_tokens}, {"cache_read_tokens", tot->cache_read_tokens},
                          {"cache_write_tokens", tot->cache_write_tokens}}}};
  return http::json_body(200, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

std::optional<http::HttpResponse> sandgate_extensions(const http::HttpRequest& req, tenancy::Tenants& tenants,
                                                      storage::Store& store, tenancy::RateLimiter& request_limit) {
  bool events = false;
  if (!is_extension(req, &events)) return std::nullopt;
  if (req.method != "GET") return http::json_error(405, "method " + req.method + " not allowed on " + req.path);
  Result<storage::TenantRow> who = tenants.authenticate(req.header("x-api-key"));
  if (!who) return http::json_error(401, who.error().message());
  // The tenant's request budget, as on the E2B routes.
  if (int64_t wait = request_limit.acquire(who->id); wait > 0)
    return http::json_error(429, "rate limit exceeded: too many requests for this team; retry later")
        .header("Retry-After", std::to_string(wait));
  return extension_for(req, *who, store);
}

// Every sandbox's envd holds one inotify instance while it has directory
// watchers, and its watches, all charged to host root (who creates the
// sandboxes' user namespaces): the host's per-user quotas bound how many
// sandboxes can watch at once. Raised where they are below what a host of
// sandboxes needs; where /proc/sys cannot be written (a container), said
// once with the numbers.
void ensure_inotify_quota() {
  struct Knob {
    const char* path;
    long want;
    const char* what;
  };
  for (const Knob& k : {Knob{"/proc/sys/fs/inotify/max_user_instances", 8192, "sandboxes watching directories at once"},
                        Knob{"/proc/sys/fs/inotify/max_user_watches", 1048576, "watched directories in all"}}) {
    Result<std::string> cur = sys::read_file(k.path, 64);
    if (!cur) continue;
    long have = std::strtol(cur->c_str(), nullptr, 10);
    if (have >= k.want) continue;
    if (Status w = sys::write_file(k.path, std::to_string(k.want)); w)
      LOG_INFO(k.path << " raised from " << have << " to " << k.want);
    else
      LOG_WARN(k.path << " is " << have << " and cannot be raised (" << w.error().message() << "): at most about "
                      << have << " " << k.what << "; raise it on the host (sysctl)");
  }
}

}  // namespace

std::string cgroup_lock_name(const std::string& parent) {
  std::string out;
  for (char c : parent) {
    if (c == '/' || c == '%' || c == '.') {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", static_cast<unsigned char>(c));
      out += hex;
    } else {
      out += c;
    }
  }
  return out.empty() ? "%" : out;
}

Result<std::string> ensure_base_template(const std::string& templates_dir) {
  std::string dir = templates_dir + "/base";
  if (templates::rootfs_ready(dir)) return dir;
  if (Status s = sys::make_dirs(templates_dir); !s) return s.error();
  if (sys::path_exists(dir))
    std::cerr << "sandgate: updating the base template in " << dir << "\n";
  else
    std::cerr << "sandgate: building the base template (Debian bookworm rootfs with bash, coreutils, procps, "
                 "python3, curl, git) into "
              << dir << "; this runs once and takes about a minute or two\n";
  uint64_t t0 = sys::monotonic_ns();
  size_t lines = 0;
  Status s = templates::build_base_rootfs(dir, [&](const std::string& line) {
    ++lines;
    // debootstrap's I: lines name each phase; show them, keep the rest quiet.
    if (line.rfind("I: ", 0) == 0 || line.rfind("E: ", 0) == 0 || line.rfind("W: ", 0) == 0)
      std::cerr << "  [base] " << line << "\n";
  });
  if (!s) return s.error().with_context("build base template");
  std::cerr << "sandgate: base template ready in " << (sys::monotonic_ns() - t0) / 1000000000ull << " s\n";
  return dir;
}

namespace {
// Layers are stored in template rows: absolute, whatever the cwd.
std::string absolute_dir(const std::string& dir) {
  char buf[PATH_MAX];
  return ::realpath(dir.c_str(), buf) ? std::string(buf) : dir;
}
}  // namespace

Result<std::vector<std::string>> ensure_code_interpreter_template(const std::string& templates_dir_in) {
  if (Status s = sys::make_dirs(templates_dir_in); !s) return s.error();
  std::string templates_dir = absolute_dir(templates_dir_in);
  std::string base = templates_dir + "/base", dir = templates_dir + "/" + kCodeInterpreterTemplate;
  if (std::vector<std::string> l = templates::code_interpreter_layers(base, dir); !l.empty()) return l;
  std::string lock_path = dir + ".lock";
  UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!lock) return sys::errno_error("open", lock_path);
  if (::flock(lock.get(), LOCK_EX) != 0) return sys::errno_error("flock", lock_path);
  // Another builder may have finished while this one waited.
  if (std::vector<std::string> l = templates::code_interpreter_layers(base, dir); !l.empty()) return l;
  std::cerr << "sandgate: building the code interpreter template (" << kCodeInterpreterTemplate
            << ": Jupyter's Python kernel, numpy, pandas, matplotlib, TypeScript; apt) into " << dir
            << "; this runs once and takes a few minutes\n";
  uint64_t t0 = sys::monotonic_ns();
  Result<std::vector<std::string>> layers =
      templates::ensure_code_interpreter_layers(base, dir, [&](const std::string& line) {
        if (line.rfind("I: ", 0) == 0 || line.rfind("E: ", 0) == 0 || line.rfind("W: ", 0) == 0 ||
            line.rfind("Need to get", 0) == 0)
          std::cerr << "  [" << kCodeInterpreterTemplate << "] " << line << "\n";
      });
  if (!layers) return layers.error();
  std::cerr << "sandgate: " << kCodeInterpreterTemplate << " ready in " << (sys::monotonic_ns() - t0) / 1000000000ull
            << " s\n";
  return layers;
}

namespace {

// The code interpreter template's row: the base with its layers, the
// interpreter server as its start command (ready when its default Python
// kernel is), 2 vCPUs and 1 GiB as E2B's.
Status register_code_interpreter(storage::Store& store, const std::string& base, const std::vector<std::string>& layers,
                                 const std::string& status, int64_t disk_mb) {
  ServerTemplate t;
  t.name = kCodeInterpreterTemplate;
  t.rootfs = base;
  t.disk_mb = disk_mb;
  t.memory_mb = 1024;
  t.status = status;
  t.layers = nlohmann::json(layers).dump();
  t.config = nlohmann::json{{"user", "user"},
                            {"workdir", "/home/user"},
                            {"env", nlohmann::json::object()},
                            {"startCmd", templates::kCodeInterpreterStart},
                            {"readyCmd", templates::kCodeInterpreterReady}}
                 .dump();
  return register_template(store, t);
}

// The code interpreter template at start: registered if built; otherwise
// (--code-interpreter auto) built by a child sandgate (`template build
// code-interpreter-v1`, its progress on this server's stderr) while the
// template answers 503 "building"; poll() registers it when the child ends.
// Destruction stops a build still running (its process group).
class CodeInterpreterTemplate {
 public:
  CodeInterpreterTemplate(const AppConfig& cfg, storage::Store& store)
      : cfg_(cfg), store_(store), templates_dir_(absolute_dir(cfg.templates_dir)) {}
  CodeInterpreterTemplate(const CodeInterpreterTemplate&) = delete;
  CodeInterpreterTemplate& operator=(const CodeInterpreterTemplate&) = delete;
  ~CodeInterpreterTemplate() {
    if (pid_ <= 0) return;
    ::kill(-pid_, SIGTERM);
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
  }

  Status start() {
    if (cfg_.code_interpreter == "off") return Status::Ok();
    std::string base = templates_dir_ + "/base";
    std::vector<std::string> layers =
        templates::code_interpreter_layers(base, templates_dir_ + "/" + kCodeInterpreterTemplate);
    if (!layers.empty()) return register_code_interpreter(store_, base, layers, "ready", cfg_.sandbox_disk_mb);
    if (Status s = register_code_interpreter(store_, base, {}, "building", cfg_.sandbox_disk_mb); !s) return s;
    std::string exe = exe_dir() + "/sandgate";
    std::vector<std::string> args = {exe, "template", "build", kCodeInterpreterTemplate, "--templates-dir",
                                      templates_dir_};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    int rc = ::posix_spawn(&pid_, exe.c_str(), &fa, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
      pid_ = 0;
      return Error(ErrorKind::kInternal, "start the code interpreter template's build: " + std::string(std::strerror(rc)));
    }
    LOG_INFO("template " << kCodeInterpreterTemplate << ": building it in the background (pid " << pid_
                          << "); its creates answer 503 until it is ready");
    return Status::Ok();
  }

  // From the sweep: registers the template once its build has ended.
  void poll() {
    if (pid_ <= 0) return;
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == 0 || (r < 0 && errno == EINTR)) return;
    pid_ = 0;
    std::string base = templates_dir_ + "/base";
    std::vector<std::string> layers =
        templates::code_interpreter_layers(base, templates_dir_ + "/" + kCodeInterpreterTemplate);
    if (r < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0 || layers.empty()) {
      LOG_ERROR("template " << kCodeInterpreterTemplate << ": its build failed (see the lines above); "
                            "`sandgate template build code-interpreter-v1` retries it");
      (void)register_code_interpreter(store_, base, {}, "failed", cfg_.sandbox_disk_mb);
      return;
    }
    if (Status s = register_code_interpreter(store_, base, layers, "ready", cfg_.sandbox_disk_mb); !s)
      LOG_ERROR("template " << kCodeInterpreterTemplate << ": " << s.error().message());
    else
      LOG_INFO("template " << kCodeInterpreterTemplate << " is ready");
  }

 private:
  const AppConfig& cfg_;
  storage::Store& store_;
  const std::string templates_dir_;
  pid_t pid_ = 0;
};

// The start-up steps of serve(), in its order. Each returns what serve()
// prints (after "sandgate: ") before it exits 1.

AppConfig with_defaults(const AppConfig& in) {
  AppConfig cfg = in;
  if (cfg.templates_dir.empty()) cfg.templates_dir = cfg.data_dir + "/templates";
  if (cfg.agent_path.empty()) cfg.agent_path = exe_dir() + "/sandgate-agent";
  if (cfg.vmm_path.empty()) cfg.vmm_path = exe_dir() + "/sandgate-vmm";
  if (cfg.guest_dir.empty()) cfg.guest_dir = cfg.data_dir + "/guest";
  return cfg;
}

Result<std::string> read_metrics_token(const AppConfig& cfg) {
  if (!cfg.metrics_token_file.empty()) {
    Result<std::string> t = tenancy::read_secret_file(cfg.metrics_token_file, "the metrics token");
    if (!t) return Error(t.error().kind(), "--metrics-token-file: " + t.error().message());
    return t;
  }
  if (!cfg.local_tenant)
    LOG_WARN("/metrics is open to anyone who reaches this port; a hosted deployment sets --metrics-token-file");
  return std::string();
}

// Process-wide settings, before any thread starts: the open-file limit
// (every client connection, sandbox channel and VMM descriptor counts
// against it: take all the hard limit allows), the inotify quotas, and
// SIGINT/SIGTERM blocked so that only sigwait() in serve() takes them.
void prepare_process(sigset_t& sigs) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0)
      LOG_WARN("raise the open-file limit from " << was << ": " << std::strerror(errno));
  }
  ensure_inotify_quota();
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

// One sandgate per data directory and per cgroup parent, decided before
// anything in either is touched: a second instance would otherwise mark
// the first one's sandboxes lost and clear its cgroups. The locks are held
// until this process ends (the kernel drops them on any exit).
struct InstanceLocks {
  UniqueFd data, cgroup;
};
Result<InstanceLocks> lock_instance(const AppConfig& cfg) {
  if (Status s = sys::make_dirs(cfg.data_dir, 0700); !s)
    return Error(s.error().kind(), "data directory: " + s.error().message());
  InstanceLocks locks;
  Result<UniqueFd> l = sys::lock_file(cfg.data_dir + "/sandgate.lock");
  if (!l)
    return Error(l.error().kind(), "data directory " + cfg.data_dir + " is in use by another sandgate (" +
                                       l.error().message() + "): stop that one first, or pass another --data-dir");
  locks.data = std::move(*l);
  std::string dir = "/run/sandgate/cgroup-parents";
  if (Status d = sys::make_dirs(dir, 0700); !d)
    return Error(d.error().kind(), "cannot lock the cgroup parent: " + d.error().message());
  l = sys::lock_file(dir + "/" + cgroup_lock_name(cfg.cgroup_parent) + ".lock");
  if (!l)
    return Error(l.error().kind(), "cgroup parent '" + cfg.cgroup_parent + "' is in use by another sandgate (" +
                                       l.error().message() + "): stop that one first, or pass another --cgroup-parent");
  locks.cgroup = std::move(*l);
  return locks;
}

// Backend choice: kvm when /dev/kvm can run our microVMs and the guest
// image and VMM are there; otherwise the process backend. One line says
// which and why; --runtime=kvm or =process requires one. True: kvm.
Result<bool> choose_backend(const AppConfig& cfg) {
  if (::access(cfg.agent_path.c_str(), X_OK) != 0)
    return invalid_error("agent binary " + cfg.agent_path +
                         " not found or not executable: build it (cmake --build) or pass --agent PATH");
  if (cfg.runtime != "auto" && cfg.runtime != "process" && cfg.runtime != "kvm")
    return invalid_error("unknown --runtime '" + cfg.runtime + "': use auto, process or kvm");
  if (cfg.runtime == "process") {
    LOG_INFO("using the process backend (--runtime=process)");
    return false;
  }
  std::string why;
  bool ok = microvm::kvm_usable(&why);
  if (ok) {
    if (Status g = microvm::check_guest_dir(cfg.guest_dir); !g) {
      ok = false;
      why = g.error().message();
    } else if (::access(cfg.vmm_path.c_str(), X_OK) != 0) {
      ok = false;
      why = "VMM binary " + cfg.vmm_path + " not found or not executable (build it, or pass --vmm PATH)";
    }
  }
  if (cfg.runtime == "kvm" && !ok) return invalid_error("--runtime=kvm: " + why);
  if (ok)
    LOG_INFO("using the kvm backend: microVMs on /dev/kvm (guest image " << cfg.guest_dir << ")");
  else
    LOG_INFO("KVM unavailable (" << why << "): using the process backend (namespaces + cgroups); pass --runtime=kvm to require KVM");
  return ok;
}

// The database, refusing an empty one in a data directory that was used
// before (truncated by a full disk, a bad copy: opening it would start a
// fresh install and forget every tenant and key), with the base template.
Result<std::unique_ptr<storage::Store>> open_store(const AppConfig& cfg) {
  Result<std::string> base = ensure_base_template(cfg.templates_dir);
  if (!base) return base.error();
  std::string db = cfg.data_dir + "/sandgate.db";
  struct stat st;
  bool used = sys::path_exists(cfg.data_dir + "/local-api-key") || sys::path_exists(cfg.data_dir + "/sandboxes") ||
              sys::path_exists(cfg.data_dir + "/microvms");
  if (::stat(db.c_str(), &st) == 0 && st.st_size == 0 && used)
    return invalid_error("the database " + db +
                         " is empty, but this data directory was used before (it has sandbox state or a local key): "
                         "refusing to start a fresh install over it. Restore the database from a backup, or move the "
                         "data directory away to start anew");
  Result<std::unique_ptr<storage::Store>> store = storage::Store::open(db);
  if (!store) return store.error();
  ::chmod(db.c_str(), 0600);
  ServerTemplate base_template;
  base_template.name = "base";
  base_template.rootfs = *base;
  base_template.disk_mb = cfg.sandbox_disk_mb;
  if (Status s = register_template(**store, base_template); !s)
    return Error(s.error().kind(), "register template base: " + s.error().message());
  return store;
}

std::unique_ptr<runtime::Runtime> make_runtime(const AppConfig& cfg, bool use_kvm,
                                               const runtime::ServiceOpener& open_service, bool swap_offload = false,
                                               runtime::SwapObserver* swap_observer = nullptr,
                                               runtime::SandboxNetworks* networks = nullptr) {
  if (use_kvm) {
    microvm::MicrovmConfig mcfg;
    mcfg.state_root = cfg.data_dir + "/microvms";
    mcfg.vmm_path = cfg.vmm_path;
    mcfg.agent_path = cfg.agent_path;
    mcfg.guest_dir = cfg.guest_dir;
    mcfg.open_service = open_service;
    mcfg.cgroup_parent = cfg.cgroup_parent;
    mcfg.jail = cfg.vmm_jail == "on"    ? microvm::MicrovmConfig::Jail::kOn
                : cfg.vmm_jail == "off" ? microvm::MicrovmConfig::Jail::kOff
                                        : microvm::MicrovmConfig::Jail::kAuto;
    // The 65536 uids below the process backend's ranges, never uid 0.
    mcfg.first_vmm_uid = std::max<uint32_t>(1, cfg.first_sandbox_uid - std::min<uint32_t>(cfg.first_sandbox_uid, 65536));
    mcfg.vmm_uids = cfg.first_sandbox_uid - mcfg.first_vmm_uid;
    mcfg.sandboxes_outlive_host = cfg.keep_sandboxes == "on";
    mcfg.networks = networks;
    return microvm::make_microvm_runtime(mcfg);
  }
  runtime::RuntimeConfig rcfg;
  rcfg.swap_offload = swap_offload;
  rcfg.swap_observer = swap_observer;
  rcfg.open_service = open_service;
  rcfg.state_root = cfg.data_dir + "/sandboxes";
  rcfg.agent_path = cfg.agent_path;
  rcfg.cgroup_parent = cfg.cgroup_parent;
  rcfg.disk_limits = cfg.disk_limit == "on"    ? runtime::DiskLimits::kOn
                     : cfg.disk_limit == "off" ? runtime::DiskLimits::kOff
                                               : runtime::DiskLimits::kAuto;
  rcfg.user_namespaces = cfg.user_namespaces == "on"    ? runtime::UserNamespaces::kOn
                         : cfg.user_namespaces == "off" ? runtime::UserNamespaces::kOff
                                                        : runtime::UserNamespaces::kAuto;
  rcfg.first_sandbox_uid = cfg.first_sandbox_uid;
  rcfg.sandboxes_outlive_host = cfg.keep_sandboxes == "on";
  rcfg.networks = networks;
  rcfg.sandbox_uid_slots = static_cast<uint32_t>(
      std::min<uint64_t>(16384, (0xFFFFFFFEull - cfg.first_sandbox_uid) / process::kUidsPerSandbox));
  return process::make_process_runtime(rcfg);
}

// The swap process sandboxes offload into (process backend, with memory
// offload on); null, said once, where there is none: wait pauses stay
// freezes.
std::unique_ptr<process::SwapDevice> open_process_swap(const AppConfig& cfg, bool use_kvm) {
  if (use_kvm || cfg.memory_offload == "off" || cfg.process_swap == "off") return nullptr;
  process::SwapConfig scfg;
  scfg.mode = cfg.process_swap;
  scfg.zram_bytes = static_cast<uint64_t>(cfg.zram_mb) << 20;
  scfg.record = cfg.data_dir + "/swap-device";
  Result<std::unique_ptr<process::SwapDevice>> d = process::SwapDevice::open(scfg);
  if (!d) {
    LOG_WARN("memory offload of process sandboxes is off: " << d.error().message()
                                                            << "; a wait pause stays a freeze");
    return nullptr;
  }
  LOG_INFO("memory offload: process sandboxes into " << (*d)->describe() << " (" << cfg.memory_offload << ")");
  return std::move(*d);
}

// The codec audit of the pages offloaded into d (--swap-codec-audit; null
// without it or without a swap).
std::unique_ptr<memory::SwapCodecAudit> open_swap_audit(const AppConfig& cfg, const process::SwapDevice* d) {
  if (!cfg.swap_codec_audit) return nullptr;
  if (!d) {
    LOG_WARN("--swap-codec-audit: no process sandbox offloads into swap here; nothing to audit");
    return nullptr;
  }
  memory::SwapAuditConfig acfg;
  acfg.device_bytes = [d]() -> std::optional<std::pair<uint64_t, uint64_t>> {
    Result<process::SwapStats> st = d->stats();
    if (!st) return std::nullopt;
    return std::make_pair(st->used_bytes, st->stored_bytes);
  };
  LOG_INFO("swap codec audit on: every page-out is read and encoded with the engine's codecs too");
  return std::make_unique<memory::SwapCodecAudit>(std::move(acfg));
}

// The device's lines for /metrics (and the audit's, when on).
std::function<void(std::string&)> swap_device_metrics(const process::SwapDevice* d,
                                                      const memory::SwapCodecAudit* audit) {
  if (!d) return {};
  return [d, audit](std::string& out) {
    if (audit) audit->render_metrics(out);
    Result<process::SwapStats> st = d->stats();
    if (!st) return;
    metrics::render_count(out, "sandgate_swap_used_bytes", "gauge",
                          "Data in the offload swap, uncompressed (every user of the device).", st->used_bytes);
    metrics::render_count(out, "sandgate_swap_stored_bytes", "gauge", "What that data takes stored (zram: compressed).",
                          st->stored_bytes);
    metrics::render_count(out, "sandgate_swap_memory_bytes", "gauge", "RAM the zram device takes now (0 for host swap).",
                          st->memory_bytes);
    metrics::render_count(out, "sandgate_swap_compacted_bytes_total", "counter",
                          "RAM the zram device's compactions freed (its own count, since it was made).",
                          st->compacted_pages * 4096);
  };
}

// The memory offload engine (microVMs only; null otherwise).
Result<std::unique_ptr<memory::MemoryEngine>> open_memory_engine(const AppConfig& cfg, bool use_kvm,
                                                                 memory::DictionaryRegistry& dictionaries) {
  if (!use_kvm || cfg.memory_offload == "off") return std::unique_ptr<memory::MemoryEngine>();
  memory::MemoryEngineConfig ecfg;
  ecfg.dictionaries = &dictionaries;
  ecfg.pool.dir = cfg.data_dir + "/memory-pool";
  ecfg.pool.memory_budget = static_cast<uint64_t>(cfg.memory_pool_mb) << 20;
  Result<std::unique_ptr<memory::MemoryEngine>> e = memory::MemoryEngine::open(ecfg);
  if (!e)
    return Error(e.error().kind(),
                 "memory offload: " + e.error().message() + " (use --memory-offload off to run without it)");
  LOG_INFO("memory offload: " << cfg.memory_offload << ", pool " << cfg.memory_pool_mb << " MiB in RAM, then "
                              << ecfg.pool.dir);
  return e;
}

llm::ModelGatewayConfig model_gateway_config(const AppConfig& cfg) {
  llm::ModelGatewayConfig m;
  m.openai_base_url = cfg.openai_base_url;
  m.openai_key_file = cfg.openai_key_file;
  m.anthropic_base_url = cfg.anthropic_base_url;
  m.anthropic_key_file = cfg.anthropic_key_file;
  m.body_limit = cfg.llm_body_limit;
  m.requests_per_s = cfg.llm_requests_per_s;
  m.tokens_per_min = cfg.llm_tokens_per_min;
  return m;
}

// Model-wait pauses in the lifecycle core: pause after the grace, never
// sooner than the cooldown after a resume; offload the paused microVM's
// RAM when the wait is expected to last (and, in auto mode, only under
// host memory pressure: on under 20% MemAvailable, off over 30%).
lifecycle::ServiceConfig::Waits wait_config(const AppConfig& cfg, bool can_offload, memory::PressureGate& pressure) {
  lifecycle::ServiceConfig::Waits w;
  w.enabled = cfg.llm_pause;
  w.coordinator.wait.grace_ns = static_cast<uint64_t>(cfg.llm_grace_ms) * 1000000ull;
  w.coordinator.wait.cooldown_ns = static_cast<uint64_t>(cfg.llm_cooldown_ms) * 1000000ull;
  if (can_offload && cfg.memory_offload != "off") {
    w.coordinator.wait.offload_enabled = true;
    w.coordinator.wait.offload_min_remaining_ns = static_cast<uint64_t>(cfg.offload_min_wait_ms) * 1000000ull;
    if (cfg.memory_offload == "auto")
      w.offload_wanted = [&pressure] {
        Result<memory::HostMemory> h = memory::read_host_memory();
        return h ? pressure.update(h->available, h->total) : pressure.on();
      };
  }
  return w;
}

http::ServerConfig server_config(const AppConfig& cfg) {
  http::ServerConfig scfg;
  scfg.address = cfg.listen_address;
  scfg.port = cfg.port;
  scfg.worker_threads = cfg.worker_threads;
  scfg.body_limit = cfg.body_limit;
  scfg.max_connections = cfg.max_connections;
  scfg.max_connections_per_address = cfg.max_connections_per_address;
  scfg.read_timeout = std::chrono::milliseconds(cfg.read_timeout_ms);
  scfg.tls_cert_file = cfg.tls_cert_file;
  scfg.tls_key_file = cfg.tls_key_file;
  // Template file uploads (builds::BuildService, max_upload_bytes).
  scfg.body_limit_for = [](const http::HttpRequest& head) -> size_t {
    return head.method == "PUT" && builds::BuildService::is_upload_path(head.path) ? 256u << 20 : 0;
  };
  return scfg;
}

lifecycle::ServiceConfig service_config(const AppConfig& cfg, bool use_kvm, network::EgressPolicies& egress_policies,
                                        bool memory_offload, memory::PressureGate& pressure,
                                        storage::BatchWriter& rows, lifecycle::PauseMemoryPacker* pause_packer,
                                        const process::SwapDevice* swap, const memory::SwapCodecAudit* audit) {
  lifecycle::ServiceConfig c;
  c.egress = cfg.egress;
  c.egress_policies = &egress_policies;
  c.offload_concurrency = static_cast<size_t>(std::max<int64_t>(1, cfg.offload_concurrency));
  c.waits = wait_config(cfg, memory_offload || swap != nullptr, pressure);
  c.swap_offload = swap != nullptr;
  if (swap && cfg.idle_offload_ms > 0) c.idle_offload_after = std::chrono::milliseconds(cfg.idle_offload_ms);
  c.swap_device_metrics = swap_device_metrics(swap, audit);
  if (swap)
    c.swap_after_offload = [swap] {
      if (Result<bool> r = swap->compact(); !r) LOG_WARN("swap compaction: " << r.error().message());
    };
  c.record_event = [&rows](storage::EventRow e) { rows.add_event(std::move(e)); };
  c.start_ready_timeout = std::chrono::seconds(cfg.template_ready_timeout_s);
  c.warm_pool.per_key = static_cast<size_t>(cfg.warm_pool >= 0 ? cfg.warm_pool : use_kvm ? 0 : 2);
  // Snapshots are layers beside the builds' (the process backend's
  // writable layer; microVMs refuse them in export_layer).
  c.snapshot_dir = cfg.data_dir + "/layers";
  c.template_max_bytes = cfg.template_storage_mb << 20;
  // microVMs pause to disk with their RAM packed against their base.
  if (use_kvm) c.pause_packer = pause_packer;
  return c;
}

api::ControlPlaneConfig control_plane_config(const AppConfig& cfg) {
  api::ControlPlaneConfig c;
  if (!cfg.domain.empty()) c.domain = cfg.domain;  // create and connect hand it to the SDKs
  c.public_url = cfg.public_url;  // upload links
  c.scheme = cfg.tls_cert_file.empty() ? "http" : "https";
  return c;
}

// The sandboxes' way out, decided once at start (docs/networking.md):
// "veth" (microVMs: "tap") with the host network that makes their links,
// "proxy", or "off".
struct NetworkPath {
  std::string path;
  std::unique_ptr<network::HostNetwork> host;
};

// Four hex digits for this server's nftables table and link names: from
// its data directory, so a restart finds what a crash left, and two
// servers on one host (their own data directories) differ.
std::string network_instance(const std::string& data_dir) {
  char real[PATH_MAX];
  std::string key = ::realpath(data_dir.c_str(), real) ? real : data_dir;
  char b[8];
  std::snprintf(b, sizeof b, "%04x", static_cast<unsigned>(std::hash<std::string>{}(key) & 0xffff));
  return b;
}

Result<NetworkPath> open_network(const AppConfig& cfg, bool use_kvm, network::EgressPolicies& policies) {
  NetworkPath n;
  n.path = cfg.network;
  if (n.path == "auto") n.path = "veth";
  if (n.path != "veth") return n;
  network::NetworkConfig nc;
  nc.instance = network_instance(cfg.data_dir);
  if (!cfg.network_range.empty()) nc.range = network::parse_ipv4_net(cfg.network_range);
  nc.allow_internal = cfg.egress_allow_private;
  nc.rate_bytes_per_s = static_cast<uint64_t>(cfg.sandbox_bandwidth_mbit) * 1000 * 1000 / 8;
  nc.max_connections = static_cast<uint32_t>(cfg.sandbox_connections);
  nc.policies = &policies;
  nc.keep_links = cfg.keep_sandboxes == "on";  // sandboxes (and their links) outlive the server
  nc.tap = use_kvm;  // microVMs: a TAP device each, their VMM's virtio-net the other end
  if (!cfg.dns_upstream.empty()) {
    struct in_addr ia {};
    ::inet_pton(AF_INET, cfg.dns_upstream.c_str(), &ia);  // checked by the CLI
    nc.dns_upstream = ntohl(ia.s_addr);
  }
  Result<std::unique_ptr<network::HostNetwork>> h = network::HostNetwork::start(nc);
  if (!h) {
    if (cfg.network == "auto" && h.error().kind() == ErrorKind::kUnavailable) {
      LOG_WARN("network: sandboxes cannot have networks of their own here (" << h.error().message()
                                                                             << "); they get out through the egress proxy");
      n.path = "proxy";
      return n;
    }
    return Error(h.error().kind(), "--network veth: " + h.error().message());
  }
  n.host = std::move(*h);
  if (use_kvm) n.path = "tap";
  return n;
}

// HostNetwork as the runtime's SandboxNetworks.
class RuntimeNetworks final : public runtime::SandboxNetworks {
 public:
  explicit RuntimeNetworks(network::HostNetwork& h) : h_(h) {}
  Result<Link> reserve(const std::string& id) override {
    Result<network::SandboxLink> l = h_.reserve(id);
    if (!l) return l.error();
    return Link{network::ipv4_text(l->address), network::ipv4_text(l->gateway)};
  }
  Status attach(const std::string& id, int netns_fd) override { return h_.attach(id, netns_fd); }
  Result<UniqueFd> attach_tap(const std::string& id) override { return h_.attach_tap(id); }
  Status adopt(const std::string& id, int netns_fd) override { return h_.adopt(id, netns_fd); }
  Status adopt_tap(const std::string& id, const std::string& address) override {
    std::optional<network::Ipv4Net> a = network::parse_ipv4_net(address + "/32");
    if (!a) return invalid_error("sandbox " + id + ": bad address " + address);
    return h_.adopt_tap(id, a->addr);
  }
  void release(const std::string& id) override { h_.release(id); }

 private:
  network::HostNetwork& h_;
};

// The egress proxy (--network proxy), reading and listening to the policy
// table; null on the other paths.
std::unique_ptr<EgressProxy> make_egress(const AppConfig& cfg, const NetworkPath& net,
                                         network::EgressPolicies& policies) {
  if (net.path != "proxy") return nullptr;
  EgressConfig ec;
  ec.allow_internal = cfg.egress_allow_private;
  LOG_INFO("egress: on, through the egress proxy, by each sandbox's network policy"
           << (cfg.egress_allow_private ? "; the host's internal networks are reachable" : ""));
  return std::make_unique<EgressProxy>(ec, policies);
}

// Template builds: layers and uploads under the data directory, the
// egress proxy's environment for steps that download. Steps run in process
// sandboxes (a layer is their writable directory); on the kvm backend they
// get a process runtime of their own (cgroup parent <parent>-builds, state
// under data/sandboxes as on the process backend), and a finished build is readied for
// microVMs (its image and boot snapshot) before it is ready.
struct TemplateBuilds {
  std::unique_ptr<runtime::Runtime> steps_runtime;  // kvm backend only; outlives the service
  std::unique_ptr<builds::BuildService> service;
  void stop() {
    if (service) service->stop();  // running builds fail, their sandboxes go
    if (steps_runtime)
      if (Status s = steps_runtime->cleanup_stale(); !s) LOG_WARN("build sandboxes' cleanup: " << s.error().message());
  }
};

TemplateBuilds make_builds(const AppConfig& cfg, bool use_kvm, storage::Store& store, runtime::Runtime& rt,
                           const runtime::ServiceOpener& open_service, network::EgressPolicies* egress_policies,
                           bool proxy_env, std::function<Status(const std::string&, const std::string&)> ensure_template,
                           std::function<void()> on_ready) {
  TemplateBuilds b;
  runtime::Runtime* steps = &rt;
  builds::BuildConfig bc;
  if (use_kvm) {
    AppConfig pc = cfg;
    pc.cgroup_parent = cfg.cgroup_parent + "-builds";
    pc.keep_sandboxes = "off";  // a build does not outlive sandgate
    b.steps_runtime = make_runtime(pc, false, open_service);  // state in data/sandboxes, unused by microVMs
    if (Status s = b.steps_runtime->cleanup_stale(); !s) LOG_WARN("build sandboxes' cleanup: " << s.error().message());
    steps = b.steps_runtime.get();
    bc.prepare_template = [&rt](const runtime::SandboxSpec& spec) { return rt.prepare_template(spec); };
    bc.drop_prepared = [&rt](const std::string& root) { return rt.drop_template(root); };
    LOG_INFO("template builds: steps run in process sandboxes (cgroup parent " << pc.cgroup_parent
                                                                             << "), templates boot as microVMs");
  }
  bc.data_dir = cfg.data_dir;
  bc.clock = [] { return sys::unix_seconds(); };
  if (egress_policies && proxy_env) bc.sandbox_env = lifecycle::egress_proxy_env();
  bc.egress_policies = egress_policies;
  bc.tenant_max_builds = cfg.template_builds;
  bc.sandbox_disk_mb = cfg.sandbox_disk_mb;
  bc.tenant_max_bytes = cfg.template_storage_mb << 20;
  bc.build_timeout = std::chrono::seconds(cfg.template_build_timeout_s);
  bc.ready_timeout = std::chrono::seconds(cfg.template_ready_timeout_s);
  bc.ensure_template = std::move(ensure_template);
  bc.on_ready = std::move(on_ready);
  b.service = std::make_unique<builds::BuildService>(store, *steps, std::move(bc));
  return b;
}

// The one-shot requests: /metrics, sandgate's own routes, the E2B control
// plane.
struct Routes {
  const std::string& metrics_token;
  llm::ModelGateway& models;
  tenancy::Tenants& tenants;
  storage::Store& store;
  tenancy::RateLimiter& request_limit;
  api::ControlPlane& control;
  // Cluster mode: routing across nodes; null on one host.
  ClusterRoutes* cluster = nullptr;
  Cluster* membership = nullptr;
  ClusterTemplates* shared_templates = nullptr;
  // How sandboxes get out: "veth", "tap", "proxy" or "off"; with veth or
  // tap, their networks.
  std::string network_path;
  const network::HostNetwork* host_network = nullptr;

  http::HttpResponse operator()(http::HttpRequest& req) const {
    if (cluster)
      if (std::optional<http::HttpResponse> r = cluster->handle(req)) return std::move(*r);
    if (req.path == "/metrics") {
      if (req.method != "GET") return http::json_error(405, "method " + req.method + " not allowed on /metrics");
      if (!metrics_authorized(req, metrics_token))
        return http::json_error(401, "/metrics needs Authorization: Bearer with the metrics token")
            .header("WWW-Authenticate", "Bearer realm=\"sandgate metrics\"");
      http::HttpResponse r;
      r.content_type = "text/plain; version=0.0.4; charset=utf-8";
      r.body = models.metrics();
      if (membership) r.body += membership->metrics();
      if (shared_templates) r.body += shared_templates->metrics();
      metrics::render_header(r.body, "sandgate_network_path", "gauge",
                             "How this server's sandboxes get out (docs/networking.md): 1 for its path.");
      r.body += "sandgate_network_path{path=\"" + network_path + "\"} 1\n";
      if (host_network) host_network->render_metrics(r.body);
      return r;
    }
    if (std::optional<http::HttpResponse> r = sandgate_extensions(req, tenants, store, request_limit))
      return std::move(*r);
    if (api::ControlPlane::owns(req)) {
      http::HttpResponse r = control.handle(req);
      // A template changed (tags, public, deleted, a snapshot made): the
      // cluster's record of it follows now, not at the next sync.
      if (shared_templates && req.method != "GET" && r.status < 300 &&
          (req.path.find("/templates") != std::string::npos || req.path.find("/snapshots") != std::string::npos))
        shared_templates->sync_soon();
      return r;
    }
    return http::json_error(404, "no route for " + req.method + " " + req.path);
  }
};

// The cluster port (--cluster-listen): node-to-node traffic only. A
// request without the cluster key is refused before anything else looks
// at it; CONNECT tunnels check the key in their hook.
struct ClusterPortRoutes {
  ClusterRoutes& cluster;
  http::HttpResponse operator()(http::HttpRequest& req) const {
    if (!req.headers.count(cluster_wire::kSecretHeader))
      return http::json_error(403, "this is sandgate's cluster port: it serves the other nodes only");
    if (std::optional<http::HttpResponse> r = cluster.handle(req)) return std::move(*r);
    return http::json_error(404, "no route for " + req.method + " " + req.path);
  }
};

void print_banner(const AppConfig& cfg, uint16_t port, const std::string& backend, const std::string& local_key) {
  std::string url = cfg.public_url.empty() ? std::string(cfg.tls_cert_file.empty() ? "http://" : "https://") +
                                                 cfg.listen_address + ":" + std::to_string(port)
                                           : cfg.public_url;
  if (!cfg.port_file.empty()) {
    if (Status s = sys::write_file_atomic(cfg.port_file, std::to_string(port) + "\n"); !s)
      LOG_ERROR("port file: " << s.error().message());
  }
  std::cout << "sandgate is listening on " << url << " (" << backend << " backend, data in " << cfg.data_dir << ")\n";
  if (!local_key.empty()) {
    std::cout << "API key (tenant \"local\"): " << local_key << "\n\n"
              << "Point an E2B SDK client at it with:\n"
              << "  export E2B_API_URL=" << url << "\n"
              << "  export E2B_SANDBOX_URL=" << url << "\n"
              << "  export E2B_API_KEY=" << local_key << "\n\n"
              << "Try it with curl:\n"
              << "  curl -s -X POST " << url << "/v2/sandboxes -H 'X-API-KEY: " << local_key
              << "' -H 'Content-Type: application/json' -d '{\"templateID\":\"base\"}'\n";
  }
  std::cout.flush();
}

int fail(const Error& e) {
  std::cerr << "sandgate: " << e.message() << "\n";
  return 1;
}

std::string cluster_server_host(const AppConfig& cfg) { return net::parse_endpoint(cfg.cluster_listen)->host; }

// Cluster mode's settings from the command line; the address is set once
// the server is bound.
Result<ClusterConfig> cluster_config(const AppConfig& cfg, bool use_kvm) {
  ClusterConfig c;
  Result<std::vector<net::Endpoint>> etcd = etcd::parse_endpoints(cfg.cluster);
  if (!etcd) return etcd.error().with_context("--cluster");
  c.etcd = *etcd;
  if (!cfg.tls_cert_file.empty() && cfg.cluster_listen.empty())
    return invalid_error("--cluster with --tls-cert needs --cluster-listen ADDR:PORT: the nodes forward to each other "
                         "over plain HTTP on a port of their own (docs/cluster.md)");
  if (!cfg.cluster_listen.empty())
    if (Result<net::Endpoint> ep = net::parse_endpoint(cfg.cluster_listen); !ep) return ep.error().with_context("--cluster-listen");
  if (cfg.cluster_secret_file.empty())
    return invalid_error("--cluster needs --cluster-secret-file: a file holding the secret every node of the cluster shares");
  Result<std::string> secret = tenancy::read_secret_file(cfg.cluster_secret_file, "the cluster secret");
  if (!secret) return Error(secret.error().kind(), "--cluster-secret-file: " + secret.error().message());
  if (secret->size() < 16) return invalid_error("--cluster-secret-file: the secret is shorter than 16 characters");
  c.secret = *secret;
  c.self.id = cfg.node_id;
  if (c.self.id.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) != 0) return sys::errno_error("gethostname", "");
    c.self.id = host;
  }
  if (c.self.id.size() > 64 || c.self.id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != std::string::npos)
    return invalid_error("--node-id \"" + c.self.id + "\": use 1 to 64 letters, digits, '.', '_' or '-'");
  std::string node_listen = cfg.cluster_listen.empty() ? cfg.listen_address : net::parse_endpoint(cfg.cluster_listen)->host;
  if (cfg.advertise.empty() && (node_listen == "0.0.0.0" || node_listen == "::"))
    return invalid_error("--cluster listening on " + node_listen + " needs --advertise HOST:PORT (where the other nodes reach this one)");
  if (!cfg.advertise.empty())
    if (Result<net::Endpoint> ep = net::parse_endpoint(cfg.advertise); !ep) return ep.error().with_context("--advertise");
  c.self.backend = use_kvm ? "kvm" : "process";
  c.self.cpus = std::max<long>(1, ::sysconf(_SC_NPROCESSORS_ONLN));
  c.self.memory_mb = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE) / (1 << 20);
  if (struct statvfs v{}; ::statvfs(cfg.data_dir.c_str(), &v) == 0)
    c.self.disk_mb = static_cast<int64_t>(v.f_blocks * v.f_frsize / (1 << 20));
  c.lease_ttl_s = std::max<int64_t>(2, cfg.cluster_lease_ttl_s);
  c.lost_grace = std::chrono::seconds(std::max<int64_t>(0, cfg.cluster_lost_grace_s));
  return c;
}

// Gateway services for sandbox processes: the model proxy at
// 127.0.0.1:49982 inside (each agent-opened stream becomes one HTTP
// connection the server adopts, bound to its sandbox) and, where the
// server has egress, the egress proxy at 127.0.0.1:49984 (one proxy
// connection each). The egress proxy exists before the runtime; the server
// cannot (its routes reach the sandboxes, which the runtime makes), so it
// is the one link bound late: attached once built (no sandbox exists
// before it does) and detached first at stop.
class GatewayServices {
 public:
  explicit GatewayServices(EgressProxy* egress) : egress_(egress) {}
  void attach(http::HttpServer* server) { server_.store(server); }
  runtime::ServiceOpener opener() {
    return [this](const std::string& sandbox_id, const std::string& service) -> Result<UniqueFd> {
      http::HttpServer* srv = server_.load();
      EgressProxy* egress = egress_;
      bool known = (service == "llm" && srv) || (service == "egress" && egress);
      if (!known) return not_found_error("no gateway service \"" + service + "\" on this host");
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return sys::errno_error("socketpair", "gateway service " + service);
      UniqueFd mine(sv[0]), theirs(sv[1]);
      if (service == "egress") {
        egress->adopt(std::move(theirs), sandbox_id);
        return mine;
      }
      if (Status s = srv->adopt(std::move(theirs), sandbox_id); !s) return s.error();
      return mine;
    };
  }

 private:
  std::atomic<http::HttpServer*> server_{nullptr};
  EgressProxy* const egress_;
};

// The stop, in order: no new connections or service streams, then the
// sandboxes, then what served them.
void stop_all(GatewayServices& services, http::HttpServer& server, lifecycle::SandboxService& sandboxes,
              TemplateBuilds& builds, std::unique_ptr<EgressProxy>& egress, llm::ModelGateway& models,
              runtime::Runtime& rt) {
  services.attach(nullptr);
  server.stop();
  builds.stop();
  sandboxes.shutdown();
  egress.reset();  // its connections' sandboxes are gone: their threads end
  // The model gateway outlives the server object (whose destruction drops
  // suspended request coroutines that refer to it) but lets go of the
  // server's sockets now; then the waits end (pending deliveries are
  // released, posted to the stopped io_context).
  models.shutdown();
  sandboxes.stop_waits();
  // The instance's cgroup parents and state root are empty now, unless its
  // sandboxes were left running for the next start: remove them.
  if (!rt.sandboxes_outlive_host())
    if (Status s = rt.cleanup_stale(); !s) LOG_WARN("cleanup at stop: " << s.error().message());
}

}  // namespace

// The objects are built in dependency order. One link closes a loop and is
// bound late (docs/design.md, "Wiring"): the runtime opens the model
// proxy's streams on the server, which exists only later (its routes reach
// the sandboxes); no sandbox exists before it does. The stop is
// stop_all()'s order, then destruction in reverse.
int serve(const AppConfig& cfg_in) {
  AppConfig cfg = with_defaults(cfg_in);
  Result<std::string> metrics_token = read_metrics_token(cfg);
  if (!metrics_token) return fail(metrics_token.error());
  sigset_t sigs;
  prepare_process(sigs);
  Result<InstanceLocks> locks = lock_instance(cfg);
  if (!locks) return fail(locks.error());
  Result<bool> use_kvm = choose_backend(cfg);
  if (!use_kvm) return fail(use_kvm.error());
  // Cluster flags checked before anything is made (store, runtime, swap).
  std::optional<ClusterConfig> cluster_cfg;
  if (!cfg.cluster.empty()) {
    Result<ClusterConfig> cc = cluster_config(cfg, *use_kvm);
    if (!cc) return fail(cc.error());
    cluster_cfg = std::move(*cc);
  }
  Result<std::unique_ptr<storage::Store>> store = open_store(cfg);
  if (!store) return fail(store.error());
  CodeInterpreterTemplate code_interpreter(cfg, **store);
  if (Status s = code_interpreter.start(); !s) return fail(s.error());

  // Each sandbox's egress policy, written by the lifecycle core and the
  // builds, read by the egress proxy (which listens for changes).
  network::EgressPolicies egress_policies;
  Result<NetworkPath> net = open_network(cfg, *use_kvm, egress_policies);
  if (!net) return fail(net.error());
  if (net->host)
    LOG_INFO("network: each sandbox has a network of its own in " << net->host->describe()
                                                                  << ", by its network policy"
                                                                  << (cfg.egress_allow_private ? "; the host's internal networks are reachable" : ""));
  else if (net->path == "off")
    LOG_INFO("network: sandboxes have loopback only (--network off)");
  std::optional<RuntimeNetworks> runtime_networks;
  if (net->host) runtime_networks.emplace(*net->host);
  std::unique_ptr<EgressProxy> egress = make_egress(cfg, *net, egress_policies);
  GatewayServices services(egress.get());
  // Before the runtime: its sandboxes' swapped pages come back (swapoff)
  // only once they are gone or left for the next start.
  std::unique_ptr<process::SwapDevice> swap = open_process_swap(cfg, *use_kvm);
  std::unique_ptr<memory::SwapCodecAudit> swap_audit = open_swap_audit(cfg, swap.get());
  std::unique_ptr<runtime::Runtime> rt =
      make_runtime(cfg, *use_kvm, services.opener(), swap != nullptr, swap_audit.get(),
                   runtime_networks ? &*runtime_networks : nullptr);

  tenancy::Tenants tenants(**store);
  std::string local_key;
  // In a cluster the local tenant is the cluster's (made once joined).
  if (cfg.local_tenant && cfg.cluster.empty()) {
    Result<std::string> k = ensure_local_tenant(tenants, **store, cfg);
    if (!k) return fail(Error(k.error().kind(), "local tenant: " + k.error().message()));
    local_key = *k;
  }
  // Declared before the service it serves, so it goes after every sandbox
  // (and VMM) is gone.
  memory::DictionaryRegistry dictionaries(**store);  // cohort dictionaries, in SQLite
  storage::BatchWriter rows(**store);  // model usage and wait events; outlives all that writes them
  memory::PressureGate pressure{0.2, 0.3};
  Result<std::unique_ptr<memory::MemoryEngine>> memory_engine = open_memory_engine(cfg, *use_kvm, dictionaries);
  if (!memory_engine) return fail(memory_engine.error());
  memory::PausePacker pause_packer;

  lifecycle::ServiceConfig service_cfg = service_config(cfg, *use_kvm, egress_policies, *memory_engine != nullptr,
                                                        pressure, rows, &pause_packer, swap.get(), swap_audit.get());
  service_cfg.egress_proxy_env = net->path == "proxy";
  // Cluster mode: quotas hold across the nodes (set once joined; no create
  // comes before).
  std::atomic<Cluster*> quota_cluster{nullptr};
  if (!cfg.cluster.empty())
    service_cfg.reserve = [&quota_cluster](const storage::TenantRow& t, const storage::SandboxRow& row) -> Status {
      Cluster* c = quota_cluster.load();
      if (!c) return Error(ErrorKind::kUnavailable, "this node has not joined its cluster yet; retry");
      return c->reserve(t, row.id, row.memory_mb);
    };
  // ... and templates built on one node are copied to the others.
  std::atomic<ClusterTemplates*> shared_templates{nullptr};
  std::function<Status(const std::string&, const std::string&)> ensure_template;
  if (!cfg.cluster.empty()) {
    ensure_template = [&shared_templates](const std::string& tenant_id, const std::string& ref) -> Status {
      ClusterTemplates* c = shared_templates.load();
      return c ? c->ensure(tenant_id, ref) : Status::Ok();
    };
    service_cfg.ensure_template = [ensure_template](const storage::TenantRow& t, const std::string& ref) {
      return ensure_template(t.id, ref);
    };
  }
  lifecycle::SandboxService sandboxes(**store, *rt, std::move(service_cfg), [] { return sys::unix_seconds(); },
                                      memory_engine->get());
  TemplateBuilds template_builds =
      make_builds(cfg, *use_kvm, **store, *rt, services.opener(), cfg.egress ? &egress_policies : nullptr,
                  net->path == "proxy", ensure_template,
                  [&shared_templates] {
                    if (ClusterTemplates* c = shared_templates.load()) c->sync_soon();
                  });
  if (Status s = sandboxes.recover(); !s) return fail(Error(s.error().kind(), "recovery: " + s.error().message()));
  if (net->host) net->host->sweep();  // the previous run's links no sandbox took back

  Result<std::unique_ptr<llm::ModelGateway>> models =
      llm::ModelGateway::create(model_gateway_config(cfg), **store, sandboxes, rows, memory_engine->get(), &pressure);
  if (!models) return fail(Error(models.error().kind(), "model proxy: " + models.error().message()));
  auto mono = [] { return sys::monotonic_ns(); };
  tenancy::RateLimiter request_limit(cfg.requests_per_s, cfg.requests_per_s * 2, mono);
  tenancy::RateLimiter create_limit(cfg.creates_per_s, cfg.creates_per_s * 2, mono);
  api::ControlPlane control(tenants, **store, sandboxes, template_builds.service.get(), request_limit, create_limit,
                            control_plane_config(cfg));

  // Cluster mode: membership and routing across nodes (joined once the
  // server is bound and its address known).
  std::unique_ptr<Cluster> cluster;
  std::unique_ptr<ClusterRoutes> cluster_routes;
  std::unique_ptr<ClusterTemplates> cluster_templates;
  if (cluster_cfg) {
    storage::Store& st = **store;
    cluster = std::make_unique<Cluster>(std::move(*cluster_cfg), [&st, &sandboxes] {
      NodeLoad l;
      if (Result<std::vector<storage::SandboxRow>> rows = st.list_live(); rows)
        for (const storage::SandboxRow& r : *rows) l.sandbox_ids.push_back(r.id);
      l.sandboxes = static_cast<int64_t>(l.sandbox_ids.size());
      l.memory_used_mb = static_cast<int64_t>(sandboxes.memory_in_use() >> 20);
      return l;
    }, &st);
    cluster_routes = std::make_unique<ClusterRoutes>(
        *cluster, control, tenants, **store, sandboxes, request_limit,
        [&st](const http::HttpRequest& req, const storage::TenantRow& t) { return extension_for(req, t, st); });
    ClusterTemplatesConfig tc;
    tc.data_dir = cfg.data_dir;
    tc.clock = [] { return sys::unix_seconds(); };
    tc.ready_timeout = std::chrono::seconds(cfg.template_ready_timeout_s);
    if (*use_kvm) tc.prepare = [&rt](const runtime::SandboxSpec& spec) { return (*rt).prepare_template(spec); };
    tc.collect = [&template_builds] {
      if (template_builds.service) template_builds.service->collect_soon();
    };
    cluster_templates = std::make_unique<ClusterTemplates>(*cluster, st, std::move(tc));
    cluster_routes->set_template_files([&cluster_templates](const std::string& path) { return cluster_templates->serve(path); });
  }

  http::ProxyHooks proxy;
  proxy.route = [domain = cfg.domain](const http::HttpRequest& head) { return http::route_to_sandbox(head, domain); };
  proxy.connect = [&](const http::ProxyTarget& t, const http::HttpRequest& head) {
    if (cluster_routes) return cluster_routes->connect(t, head);
    return sandboxes.open_port(t.sandbox_id, t.port, head);
  };
  if (cluster_routes) proxy.tunnel = [&](const http::HttpRequest& head) { return cluster_routes->tunnel(head); };
  http::HttpServer server(server_config(cfg),
                          Routes{*metrics_token, **models, tenants, **store, request_limit, control,
                                 cluster_routes.get(), cluster.get(), cluster_templates.get(), net->path, net->host.get()},
                          proxy, (*models)->hooks());
  if (Status s = server.start(); !s) return fail(s.error());
  services.attach(&server);
  // The node-to-node port, when it is not the client port.
  std::unique_ptr<http::HttpServer> cluster_server;
  if (cluster && !cfg.cluster_listen.empty()) {
    net::Endpoint ep = *net::parse_endpoint(cfg.cluster_listen);
    http::ServerConfig ccfg = server_config(cfg);
    ccfg.address = ep.host;
    ccfg.port = ep.port;
    ccfg.tls_cert_file.clear();
    ccfg.tls_key_file.clear();
    ccfg.body_limit_for = nullptr;
    ccfg.worker_threads = std::max(2, cfg.worker_threads / 2);
    http::ProxyHooks node_hooks;
    node_hooks.tunnel = [&](const http::HttpRequest& head) { return cluster_routes->tunnel(head); };
    cluster_server = std::make_unique<http::HttpServer>(ccfg, ClusterPortRoutes{*cluster_routes}, node_hooks);
    if (Status s = cluster_server->start(); !s) {
      stop_all(services, server, sandboxes, template_builds, egress, **models, *rt);
      return fail(s.error().with_context("--cluster-listen"));
    }
  }
  if (cluster) {
    std::string node_addr = cluster_server ? net::Endpoint{cluster_server_host(cfg), cluster_server->port()}.str()
                                           : net::Endpoint{cfg.listen_address, server.port()}.str();
    cluster->set_address(cfg.advertise.empty() ? node_addr : cfg.advertise);
    Status joined = cluster->join();
    if (joined && cfg.local_tenant) {
      Result<std::string> k = ensure_cluster_local_tenant(tenants, **store, cfg, *cluster);
      if (k) local_key = *k;
      else joined = Error(k.error().kind(), "local tenant: " + k.error().message());
    }
    if (!joined) {
      cluster->leave();
      if (cluster_server) cluster_server->stop();
      stop_all(services, server, sandboxes, template_builds, egress, **models, *rt);
      return fail(joined.error());
    }
    quota_cluster.store(cluster.get());
    cluster_templates->start();
    shared_templates.store(cluster_templates.get());
  }

  // The sweep re-arms itself after each run, so runs never overlap.
  std::function<void()> sweep;
  // Template files nothing uses any more are also collected every 10
  // minutes: a fork's snapshot goes once its last fork has ended.
  const int64_t collect_every = std::max<int64_t>(1, 600000 / std::max<int64_t>(1, cfg.tick_ms));
  int64_t sweeps = 0;
  sweep = [&] {
    sandboxes.tick();
    code_interpreter.poll();
    if (template_builds.service && ++sweeps % collect_every == 0) template_builds.service->collect_soon();
    server.schedule(std::chrono::milliseconds(cfg.tick_ms), sweep);
  };
  server.schedule(std::chrono::milliseconds(cfg.tick_ms), sweep);
  print_banner(cfg, server.port(), rt->name(), local_key);

  int sig = 0;
  sigwait(&sigs, &sig);
  LOG_INFO("signal " << sig << ": stopping");
  // Out of the cluster first: the others stop sending work here. The
  // catalog keeps this node's sandboxes (they come back with it).
  shared_templates.store(nullptr);  // creates and builds from now on: the local answer
  if (cluster_templates) cluster_templates->stop();
  if (cluster) cluster->leave();
  if (cluster_server) cluster_server->stop();
  // No new connections; what is in progress finishes (an upgrade's stop).
  if (!server.drain(std::chrono::milliseconds(cfg.drain_timeout_ms)))
    LOG_WARN("requests still in progress after " << cfg.drain_timeout_ms << " ms; stopping anyway");
  stop_all(services, server, sandboxes, template_builds, egress, **models, *rt);
  LOG_INFO("stopped");
  return 0;
}

}  // namespace sg::gateway
