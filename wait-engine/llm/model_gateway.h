// ModelGateway: the model API proxy wired to the store, the tenancy
// services and the lifecycle core (docs/llm-gateway.md).
//
// Owns the ModelProxy (its deps authenticate virtual keys and channel
// bindings, find upstreams: the tenant's, the global one in SQLite, then the
// serve flags) and per-tenant request and token budgets. Usage rows go to
// a BatchWriter (storage/batch_writer.h); a request's wait tickets go to
// the lifecycle core's wait coordinator (SandboxService::waits()), which
// pauses and resumes the bound sandboxes.
//
// Threads: none of its own; it is called from the HTTP server (io threads
// for the proxy, workers for the rest).
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
class PressureGate;
}
namespace sg::storage {
class BatchWriter;
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
};

class ModelGateway {
 public:
  // Reads the serve flags' key files (errors name the file, never the key).
  // rows outlives this. memory: the offload engine (kvm runtime), or null,
  // and pressure its gate in auto mode, or null (for /metrics); both
  // outlive this.
  static Result<std::unique_ptr<ModelGateway>> create(const ModelGatewayConfig& cfg, storage::Store& store,
                                                      lifecycle::SandboxService& sandboxes,
                                                      storage::BatchWriter& rows,
                                                      memory::MemoryEngine* memory = nullptr,
                                                      const memory::PressureGate* pressure = nullptr);
  ~ModelGateway();

  http::StreamHooks hooks();
  // After the HttpServer stopped (its io_context still exists) and the
  // sandboxes are gone: closes upstream connections (then the lifecycle
  // core's stop_waits()). The ModelGateway itself must be destroyed after
  // the HttpServer.
  void shutdown();
  // Prometheus text format (the /metrics body).
  std::string metrics();

 private:
  struct Impl;
  explicit ModelGateway(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sg::llm
