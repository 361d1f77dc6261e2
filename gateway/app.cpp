// The server's wiring and its start-up and shutdown order.
#include "gateway/app.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "api-e2b/control_plane.h"
#include "api-e2b/sandboxes.h"
#include "gateway/http/server.h"
#include "sandbox-runtime/microvm/microvm_runtime.h"
#include "sandbox-runtime/process/process_runtime.h"
#include "sandbox-runtime/templates/template_builder.h"
#include "storage/store.h"
#include "sys/log.h"
#include "sys/sys.h"
#include "tenancy/api_key.h"
#include "tenancy/rate_limiter.h"
#include "tenancy/tenants.h"

namespace sg::gateway {

namespace {

std::string exe_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
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

Status register_template(storage::Store& store, const std::string& name, const std::string& rootfs) {
  Result<std::optional<storage::TemplateRow>> existing = store.find_template("", name);
  if (!existing) return existing.error();
  storage::TemplateRow t;
  if (*existing) {
    t = **existing;
  } else {
    t.id = api::new_sandbox_id();
    t.name = name;
    t.created_at = sys::unix_seconds();
  }
  t.status = "ready";
  t.rootfs_path = rootfs;
  t.cpu_count = 2;
  t.memory_mb = 512;
  t.disk_size_mb = 1024;
  t.updated_at = sys::unix_seconds();
  return store.upsert_template(t);
}

}  // namespace

Result<std::string> ensure_base_template(const std::string& templates_dir) {
  std::string dir = templates_dir + "/base";
  if (templates::rootfs_ready(dir)) return dir;
  if (Status s = sys::make_dirs(templates_dir); !s) return s.error();
  if (sys::path_exists(dir))
    std::cerr << "sandgate: updating the base template in " << dir << "\n";
  else
    std::cerr << "sandgate: building the base template (Debian bookworm rootfs with bash, coreutils, procps, "
                 "python3) into "
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

int serve(const AppConfig& cfg_in) {
  AppConfig cfg = cfg_in;
  if (cfg.templates_dir.empty()) cfg.templates_dir = cfg.data_dir + "/templates";
  if (cfg.agent_path.empty()) cfg.agent_path = exe_dir() + "/sandgate-agent";
  if (cfg.vmm_path.empty()) cfg.vmm_path = exe_dir() + "/sandgate-vmm";
  if (cfg.guest_dir.empty()) cfg.guest_dir = cfg.data_dir + "/guest";

  // Signals are taken synchronously by this thread; block them before any
  // other thread starts so none of those gets them.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  if (Status s = sys::make_dirs(cfg.data_dir, 0700); !s) {
    std::cerr << "sandgate: data directory: " << s.error().message() << "\n";
    return 1;
  }
  if (::access(cfg.agent_path.c_str(), X_OK) != 0) {
    std::cerr << "sandgate: agent binary " << cfg.agent_path
              << " not found or not executable: build it (cmake --build) or pass --agent PATH\n";
    return 1;
  }

  // Backend choice: kvm when /dev/kvm can run our microVMs and the guest
  // image and VMM are there; otherwise the process backend. One line says
  // which and why; --runtime=kvm or =process requires one.
  if (cfg.runtime != "auto" && cfg.runtime != "process" && cfg.runtime != "kvm") {
    std::cerr << "sandgate: unknown --runtime '" << cfg.runtime << "': use auto, process or kvm\n";
    return 1;
  }
  bool use_kvm = false;
  if (cfg.runtime != "process") {
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
    if (cfg.runtime == "kvm" && !ok) {
      std::cerr << "sandgate: --runtime=kvm: " << why << "\n";
      return 1;
    }
    use_kvm = ok;
    if (use_kvm)
      LOG_INFO("using the kvm backend: microVMs on /dev/kvm (guest image " << cfg.guest_dir << ")");
    else
      LOG_INFO("KVM unavailable (" << why << "): using the process backend (namespaces + cgroups); pass --runtime=kvm to require KVM");
  } else {
    LOG_INFO("using the process backend (--runtime=process)");
  }

  Result<std::string> base = ensure_base_template(cfg.templates_dir);
  if (!base) {
    std::cerr << "sandgate: " << base.error().message() << "\n";
    return 1;
  }

  Result<std::unique_ptr<storage::Store>> store = storage::Store::open(cfg.data_dir + "/sandgate.db");
  if (!store) {
    std::cerr << "sandgate: " << store.error().message() << "\n";
    return 1;
  }
  ::chmod((cfg.data_dir + "/sandgate.db").c_str(), 0600);
  if (Status s = register_template(**store, "base", *base); !s) {
    std::cerr << "sandgate: register template base: " << s.error().message() << "\n";
    return 1;
  }

  runtime::RuntimeConfig rcfg;
  rcfg.state_root = cfg.data_dir + "/sandboxes";
  rcfg.agent_path = cfg.agent_path;
  rcfg.cgroup_parent = cfg.cgroup_parent;
  std::unique_ptr<runtime::Runtime> rt;
  if (use_kvm) {
    microvm::MicrovmConfig mcfg;
    mcfg.state_root = cfg.data_dir + "/microvms";
    mcfg.vmm_path = cfg.vmm_path;
    mcfg.agent_path = cfg.agent_path;
    mcfg.guest_dir = cfg.guest_dir;
    rt = microvm::make_microvm_runtime(mcfg);
  } else {
    rt = process::make_process_runtime(rcfg);
  }

  tenancy::Tenants tenants(**store);
  std::string local_key;
  if (cfg.local_tenant) {
    Result<std::string> k = ensure_local_tenant(tenants, **store, cfg);
    if (!k) {
      std::cerr << "sandgate: local tenant: " << k.error().message() << "\n";
      return 1;
    }
    local_key = *k;
  }

  api::SandboxService sandboxes(**store, *rt, api::ServiceConfig{}, [] { return sys::unix_seconds(); });
  if (Status s = sandboxes.recover(); !s) {
    std::cerr << "sandgate: recovery: " << s.error().message() << "\n";
    return 1;
  }

  auto mono = [] { return sys::monotonic_ns(); };
  tenancy::RateLimiter request_limit(cfg.requests_per_s, cfg.requests_per_s * 2, mono);
  tenancy::RateLimiter create_limit(cfg.creates_per_s, cfg.creates_per_s * 2, mono);
  api::ControlPlane control(tenants, sandboxes, request_limit, create_limit, api::ControlPlaneConfig{});

  http::ServerConfig scfg;
  scfg.address = cfg.listen_address;
  scfg.port = cfg.port;
  scfg.worker_threads = cfg.worker_threads;
  scfg.body_limit = cfg.body_limit;
  scfg.read_timeout = std::chrono::milliseconds(cfg.read_timeout_ms);
  scfg.tls_cert_file = cfg.tls_cert_file;
  scfg.tls_key_file = cfg.tls_key_file;
  http::ProxyHooks proxy;
  proxy.route = [domain = cfg.domain](const http::HttpRequest& head) {
    return http::route_to_sandbox(head, domain);
  };
  proxy.connect = [&](const http::ProxyTarget& t) { return sandboxes.open_port(t.sandbox_id, t.port); };
  http::HttpServer server(
      scfg,
      [&](http::HttpRequest& req) -> http::HttpResponse {
        if (api::ControlPlane::owns(req)) return control.handle(req);
        return http::json_error(404, "no route for " + req.method + " " + req.path);
      },
      proxy);
  if (Status s = server.start(); !s) {
    std::cerr << "sandgate: " << s.error().message() << "\n";
    return 1;
  }

  // The sweep re-arms itself after each run, so runs never overlap.
  std::function<void()> sweep;
  sweep = [&] {
    sandboxes.tick();
    server.schedule(std::chrono::milliseconds(cfg.tick_ms), sweep);
  };
  server.schedule(std::chrono::milliseconds(cfg.tick_ms), sweep);

  std::string url = cfg.public_url.empty()
                        ? std::string(cfg.tls_cert_file.empty() ? "http://" : "https://") + cfg.listen_address + ":" + std::to_string(server.port())
                        : cfg.public_url;
  if (!cfg.port_file.empty()) {
    if (Status s = sys::write_file_atomic(cfg.port_file, std::to_string(server.port()) + "\n"); !s)
      LOG_ERROR("port file: " << s.error().message());
  }
  std::cout << "sandgate is listening on " << url << " (" << rt->name() << " backend, data in " << cfg.data_dir << ")\n";
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

  int sig = 0;
  sigwait(&sigs, &sig);
  LOG_INFO("signal " << sig << ": stopping");
  server.stop();
  sandboxes.shutdown();
  // The instance's cgroup parents and state root are empty now: remove them.
  if (Status s = rt->cleanup_stale(); !s) LOG_WARN("cleanup at stop: " << s.error().message());
  LOG_INFO("stopped");
  return 0;
}

}  // namespace sg::gateway
