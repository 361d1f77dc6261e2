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

namespace sg::llm {

// The model proxy's settings (sandgate serve's --openai-*, --anthropic-*,
// --llm-* and --memory-offload flags).
struct ModelGatewayConfig {
  // Global upstreams; a tenant's own (sandgate llm upstream set) win over
  // these. Key files hold the provider key (read once, never logged).
  std::string openai_base_url;  // empty: none
  std::string openai_key_file;
  std::string anthropic_base_url;
  std::string anthropic_key_file;
  size_t body_limit = 32 << 20;       // model request bodies
  double requests_per_s = 50;         // per tenant
  double tokens_per_min = 2'000'000;  // per tenant (input + output)
  // Wait pauses: a sandbox that waits on a model is paused after grace,
  // never sooner than cooldown after a resume.
  bool pause = true;
  int64_t grace_ms = 30;
  int64_t cooldown_ms = 250;
  // Offload of wait-paused microVMs: "auto" (under host memory pressure),
  // "always", "off"; only waits expected to last offload_min_wait_ms.
  std::string memory_offload = "auto";
  int64_t offload_min_wait_ms = 2000;
};

class ModelGateway {
 public:
  // Reads the serve flags' key files (errors name the file, never the key).
  // memory: the offload engine (kvm runtime), or null; it outlives this.
  static Result<std::unique_ptr<ModelGateway>> create(const ModelGatewayConfig& cfg, storage::Store& store,
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

}  // namespace sg::llm
