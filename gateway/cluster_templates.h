// Templates between cluster nodes (docs/cluster.md, "Templates between
// nodes").
//
// A template lives on the node that built it (its origin). That node
// publishes it in etcd as templates/<id>: its row, its owner and each
// tag's build, the build's files named portably: a layer or image root as
// its path under the data directory ("layers/<key>", "images/<digest>":
// names the build derives from its recipe and inputs, so one name is one
// content), the base as the server template it stands on ("base"). The
// origin rewrites the record when the template changes (a new build, a
// tag moved, made public) and deletes it when the template is deleted.
//
// A node asked to create a sandbox of a template it lacks (or holds an
// older copy of) copies it first (ensure): it pulls each file it does not
// have from the origin over the node port, one tar stream per directory
// ("CONNECT template-files:1" with the cluster key and the path), unpacks
// it beside its final place and renames it in, records it as a template
// file of the owner, and installs the copy (row, builds, tags) in its
// SQLite in one transaction. A copy refuses changes (it names its origin);
// a copy whose record changed is replaced at the next create, one whose
// record is gone is dropped (sync), and the collector removes its files
// once no sandbox runs them.
//
// Thread-safe: ensure and serve run on the server's workers, sync on the
// thread start() makes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "base/fd.h"
#include "base/status.h"
#include "gateway/cluster.h"
#include "sandbox-runtime/runtime.h"
#include "storage/store.h"

namespace sg::gateway {

struct ClusterTemplatesConfig {
  std::string data_dir;  // where layers/ and images/ are
  // Readies a copied build for the node's backend (the kvm backend's
  // image and snapshot, as a build does); unset: nothing to do.
  std::function<Status(const runtime::SandboxSpec&)> prepare;
  std::chrono::seconds ready_timeout{60};  // a start command's, for prepare
  // How often the published records and the copies are brought in line.
  std::chrono::milliseconds sync_every{1000};
  // A transfer that moves no byte for this long fails.
  std::chrono::seconds transfer_idle{60};
  // Transfers served at once (each a tar process); more: 503.
  int max_serving = 8;
  std::function<int64_t()> clock;  // unix seconds
  std::function<void()> collect;   // asks the build service for a collection
};

class ClusterTemplates {
 public:
  ClusterTemplates(Cluster& cluster, storage::Store& store, ClusterTemplatesConfig cfg);
  ~ClusterTemplates();  // stop()
  ClusterTemplates(const ClusterTemplates&) = delete;
  ClusterTemplates& operator=(const ClusterTemplates&) = delete;

  void start();
  void stop();

  // Before a create resolves `ref` for the tenant: when the cluster's
  // current record of that template is another node's and this node holds
  // no copy of that revision, the copy is made (files pulled, rows
  // installed). Ok when there is nothing to do (no such record: the local
  // answer stands). kUnavailable when the origin cannot be reached.
  Status ensure(const std::string& tenant_id, const std::string& ref);

  // A peer's transfer of the template file at `path` (under the data
  // directory): the read end of a tar stream. kNotFound for a path that
  // is no template file here.
  Result<UniqueFd> serve(const std::string& path);

  // Publishes this node's templates and drops copies without a record.
  void sync();
  // Asks the thread for a sync now (a build ended, a template changed).
  void sync_soon();

  // Prometheus text.
  std::string metrics() const;

 private:
  Status pull(const NodeInfo& origin, const std::string& rel);

  Cluster& cluster_;
  storage::Store& store_;
  const ClusterTemplatesConfig cfg_;
  // One copy made at a time (and sync's drops not meanwhile).
  std::mutex copy_mu_;
  std::atomic<uint64_t> copies_made_{0}, files_pulled_{0}, bytes_pulled_{0};
  // Shared with the transfers' threads, which may outlive this object.
  struct Served {
    std::atomic<int> serving{0};
    std::atomic<uint64_t> files{0};
  };
  std::shared_ptr<Served> served_ = std::make_shared<Served>();

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // GUARDED_BY(mu_)
  bool wanted_ = false;  // GUARDED_BY(mu_)
  std::map<std::string, std::string> unpublishable_;  // sync thread's: id -> why, logged once
  std::thread thread_;
};

}  // namespace sg::gateway
