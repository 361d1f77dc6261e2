// ModelGateway: the model API proxy and the wait coordinator, wired to the
// store, the tenancy services and the sandbox service (docs/llm-gateway.md).
//
// Owns: the WaitCoordinator (its hooks freeze / thaw through
// SandboxService::wait_pause/wait_resume and ask the agent for idle
// evidence), the ModelProxy (its deps authenticate virtual keys and channel
// bindings, find upstreams: the tenant's, the global one in SQLite, then the
// serve flags), per-tenant request and token budgets, and one writer
// thread that batches usage rows and wait transitions into SQLite.
//
// Threads: the writer thread; the coordinator's threads; everything else is
// called from the HTTP server (io threads for the proxy, workers for the
// rest).
#pragma once

#include <memory>
#include <string>

#include "gateway/app.h"
#include "base/http/stream_handler.h"
#include "base/fd.h"
#include "base/status.h"

namespace sg::storage {
class Store;
}
namespace sg::lifecycle {
class SandboxService;
}

namespace sg::memory {
class MemoryEngine;
}

namespace sg::gateway {

class ModelGateway {
 public:
  // Reads the serve flags' key files (errors name the file, never the key).
  // memory: the offload engine (kvm runtime), or null; it outlives this.
  static Result<std::unique_ptr<ModelGateway>> create(const AppConfig& cfg, storage::Store& store,
                                                      lifecycle::SandboxService& sandboxes,
                                                      memory::MemoryEngine* memory = nullptr);
  ~ModelGateway();  // flushes the writer

  http::StreamHooks hooks();
  // After the HttpServer stopped (its io_context still exists) and the
  // sandboxes are gone: closes upstream connections and stops the
  // coordinator. The ModelGateway itself must be destroyed after the
  // HttpServer.
  void shutdown();
  // Prometheus text format (the /metrics body).
  std::string metrics();

 private:
  struct Impl;
  explicit ModelGateway(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::gateway
