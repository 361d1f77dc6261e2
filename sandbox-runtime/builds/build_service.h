// Template builds (issue 19; docs/templates.md): E2B's build API on the
// process backend.
//
// A build runs its steps one sandbox at a time over the layers made so far
// (a template's layers over its base's rootfs, runtime::SandboxSpec::layers):
// RUN runs a command through the sandbox's envd, COPY unpacks an uploaded
// tar into it; the sandbox's writable layer is then exported as the step's
// layer (runtime::Sandbox::export_layer) and the sandbox killed. ENV, USER
// and WORKDIR change the build's context (WORKDIR also makes the
// directory). Each layer is kept under a key of (tenant, parent, step,
// context, uploaded bytes), so an unchanged step of a later build is
// taken from the cache (unless force). A start command is started once at
// the end and its ready command awaited, which fails the build when it
// never succeeds; sandboxes of the template run it at each create. The
// template takes the new layers and configuration in one transaction
// when the build ends ready, so sandboxes made meanwhile keep the last
// good build.
//
// Builds run on worker threads (BuildConfig::workers), one build per
// template at a time. Logs go to SQLite as they are produced (the status
// route reads them from an offset).
//
// Not built here: images from registries (fromImage other than E2B's base
// image, which maps to base, is a build error that says so), the microVM
// backend (its create refuses layered templates), tags.
//
// Thread safety: every public method may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "base/status.h"
#include "sandbox-runtime/network/egress_policies.h"
#include "sandbox-runtime/runtime.h"
#include "storage/store.h"

namespace sg::builds {

struct Step {
  std::string type;  // RUN, COPY, ENV, WORKDIR, USER
  std::vector<std::string> args;
  std::string files_hash;  // COPY: the upload's hash ([0-9a-f]{64})
  bool force = false;
};

struct BuildSpec {
  std::string from_template;  // a template name or id; or
  std::string from_image;     // an image reference
  bool registry_auth = false;  // fromImageRegistry was given
  std::string registry_type;  // its type: "registry" (username, password) is built
  std::string registry_username, registry_password;
  std::vector<Step> steps;
  std::string start_cmd, ready_cmd;
  bool force = false;
};

struct BuildConfig {
  std::string data_dir;  // layers in data_dir/layers, uploads in data_dir/template-files
  size_t workers = 1;  // 0: none (builds queue and never run; tests of the bookkeeping)
  // A built template's diskSizeMB: its sandboxes' writable layer limit, as
  // base's; each build step's writable layer has the same limit.
  int64_t sandbox_disk_mb = 1024;
  std::chrono::seconds step_timeout{600};
  std::chrono::seconds build_timeout{1800};
  std::chrono::seconds ready_timeout{60};  // a start command's ready command
  uint64_t max_upload_bytes = 256ull << 20;
  std::chrono::seconds upload_link_ttl{3600};
  // The fromImage E2B's SDKs default to; built from the base template.
  std::string base_image = "e2bdev/base";
  std::string base_template = "base";
  // Registries spoken to over plain HTTP besides localhost (registry.h).
  std::vector<std::string> insecure_registries;
  // Environment every build sandbox gets (the egress proxy's, with
  // --egress, so that steps can download), and where their policy (any
  // destination) goes; null: build sandboxes have no way out.
  std::vector<std::pair<std::string, std::string>> sandbox_env;
  network::EgressPolicies* egress_policies = nullptr;
  std::function<int64_t()> clock;  // unix seconds
  // Per tenant: builds queued or running at once, and the bytes of the
  // template files its builds keep (layers, uploads, image roots it was
  // the first to pull).
  size_t tenant_max_builds = 4;
  int64_t tenant_max_bytes = 50ll << 30;
  // Files nothing needs are kept this long after their last use as a
  // cache (a failed build's steps, a superseded build), unless their
  // template is deleted; uploads and image blobs likewise.
  std::chrono::seconds keep_unused{86400};
  // Readies a finished build for the gateway's backend before the build
  // is ready (Runtime::prepare_template: the kvm backend's image and
  // snapshot); unset where the steps' runtime is the sandboxes' own.
  std::function<Status(const runtime::SandboxSpec&)> prepare_template;
  // Removes what prepare_template made of a template file the collector
  // removes (Runtime::drop_template): bytes freed. Unset: nothing to do.
  std::function<uint64_t(const std::string&)> drop_prepared;
  // Cluster mode: before a build resolves its fromTemplate, makes this
  // node's copy of a template another node built current.
  std::function<Status(const std::string& tenant_id, const std::string& ref)> ensure_template;
  // Called when a build has ended ready (cluster mode: publish it now).
  std::function<void()> on_ready;
};

class BuildService {
 public:
  BuildService(storage::Store& store, runtime::Runtime& runtime, BuildConfig cfg);
  ~BuildService();  // stop()
  BuildService(const BuildService&) = delete;
  BuildService& operator=(const BuildService&) = delete;

  struct Requested {
    storage::TemplateRow tpl;
    std::string build_id;
  };
  // POST /v3/templates: the tenant's template of that name (new, or its
  // own) and a new build, waiting for start(), that takes the tags (none:
  // "default") when it ends ready.
  Result<Requested> request(const std::string& tenant_id, const std::string& name,
                            const std::vector<std::string>& tags, int64_t cpu_count, int64_t memory_mb);
  // POST /v2/templates/{id}/builds/{build}: validates the spec (kInvalid
  // naming the step) and queues the build.
  Status start(const std::string& tenant_id, const std::string& template_id, const std::string& build_id,
               BuildSpec spec);

  struct Status_ {
    storage::BuildRow build;
    std::vector<storage::BuildLogRow> logs;  // from the offset asked
    std::vector<storage::BuildLogRow> reason_logs;  // an error's last lines
  };
  Result<Status_> status(const std::string& tenant_id, const std::string& template_id, const std::string& build_id,
                         int64_t logs_offset, int64_t limit);
  // GET .../builds/{build}/logs.
  Result<std::vector<storage::BuildLogRow>> logs(const std::string& tenant_id, const std::string& template_id,
                                                 const std::string& build_id, const storage::BuildLogQuery& q);

  // GET /templates/{id}/files/{hash}: whether the upload is here, and if
  // not, the path and query of a signed, expiring upload URL (no API key).
  struct FileLink {
    bool present = false;
    std::string target;  // "/templates/uploads/{id}/{hash}?expires=..&signature=.."
  };
  Result<FileLink> file_link(const std::string& tenant_id, const std::string& template_id, const std::string& hash);
  // PUT of a FileLink's target. kUnauthorized for a bad or expired
  // signature, kInvalid for a body over max_upload_bytes.
  Status upload(const std::string& template_id, const std::string& hash, const std::string& query,
                std::string_view body);
  static bool is_upload_path(std::string_view path);

  // Asks for a collection (after a template is deleted or a tag moved);
  // it runs on a worker when no build is running. Also asked at start and
  // after each build.
  void collect_soon();
  // The collection: removes the layers and image roots that no template,
  // tag or sandbox (creating, running or paused) uses, either of a deleted
  // template or unused for keep_unused; uploads and image blobs unused for
  // keep_unused. Returns the bytes freed. Never while a build runs (the
  // workers call it between builds; a test calls it with none queued).
  Result<uint64_t> collect_garbage();

  // Ends the workers; builds running fail ("the server stopped").
  void stop();

 private:
  struct Job {
    std::string tenant_id, template_id, build_id;
    BuildSpec spec;
  };
  class Run;

  void work();
  void run(const Job& job);
  std::string sign(const std::string& template_id, const std::string& hash, int64_t expires) const;
  std::string upload_path(const std::string& tenant_id, const std::string& hash) const;
  Result<storage::TemplateRow> own_template(const std::string& tenant_id, const std::string& template_id);
  Error storage_full(int64_t bytes) const;  // kQuota: the tenant's files at `bytes`

  storage::Store& store_;
  runtime::Runtime& runtime_;
  const BuildConfig cfg_;
  std::string secret_;  // signs upload links; new at each start

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;            // GUARDED_BY(mu_)
  std::map<std::string, size_t> building_;  // GUARDED_BY(mu_): builds running, by tenant
  size_t running_jobs_ = 0;          // GUARDED_BY(mu_)
  bool collect_wanted_ = true;       // GUARDED_BY(mu_): a collection at start
  bool collecting_ = false;          // GUARDED_BY(mu_)
  std::set<runtime::Sandbox*> running_;  // GUARDED_BY(mu_): build sandboxes in use
  bool stopping_ = false;            // GUARDED_BY(mu_)
  std::atomic<bool> stop_flag_{false};
  std::vector<std::thread> workers_;
};

}  // namespace sg::builds
