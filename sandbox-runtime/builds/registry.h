// Pulling images from OCI / Docker registries (distribution spec v2) for
// template builds (docs/templates.md).
//
// The protocol is sandgate's: references, the anonymous, Basic and Bearer
// (token service) authentication dance, manifest lists and OCI indexes
// (linux/amd64 chosen), every manifest and blob checked against its
// sha256 digest and declared size. The transport is curl(1) from Debian
// (HTTP/1.1 and 2, TLS with the system trust store, redirects to blob
// storage, proxies from the environment), run per request with a time
// limit and a size limit; credentials reach it through a 0600 header file,
// never its command line.
//
// Thread safety: pull() holds no state; concurrent pulls of one blob into
// one cache each write their own temporary file.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace sg::builds {

struct ImageRef {
  std::string registry;    // "registry-1.docker.io", "127.0.0.1:5000"
  std::string repository;  // "library/python"
  std::string reference;   // a tag, or a digest "sha256:..."
  std::string text() const { return registry + "/" + repository + (reference.rfind("sha256:", 0) == 0 ? "@" : ":") + reference; }
};

// "python:3.12", "ghcr.io/o/r:tag", "localhost:5000/a/b@sha256:...".
Result<ImageRef> parse_image_ref(const std::string& s);

struct RegistryCredentials {
  std::string username, password;
};

struct ImageConfig {
  std::vector<std::pair<std::string, std::string>> env;
  std::string workdir, user;
};

struct PulledImage {
  std::string manifest_digest;          // "sha256:..."
  std::vector<std::string> layer_files;  // in the blob cache, lowest first
  ImageConfig config;
};

struct RegistryOptions {
  std::string blob_dir;  // verified blobs by digest
  std::chrono::seconds request_timeout{600};
  uint64_t max_blob_bytes = 8ull << 30;
  uint64_t max_manifest_bytes = 4 << 20;
  // Registries spoken to over plain HTTP: localhost and 127.0.0.1 always
  // (as Docker does), and these.
  std::vector<std::string> insecure;
  std::function<void(const std::string&)> log;
};

// "sha256:<hex>" of a file's bytes (blobs, uploads).
Result<std::string> sha256_file(const std::string& path);

// kNotFound for an unknown repository, tag or platform; kUnauthorized when
// the registry refuses (or wants) credentials; kInvalid for a digest
// mismatch or a malformed manifest; kUnavailable when it cannot be reached.
Result<PulledImage> pull_image(const ImageRef& ref, const std::optional<RegistryCredentials>& creds,
                               const RegistryOptions& opt);

}  // namespace sg::builds
