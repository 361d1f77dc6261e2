// Applying an OCI / Docker image layer (a tar: plain, gzip or zstd) onto a root
// directory, as a container engine's layer store does, for templates
// built from registry images (docs/templates.md).
//
// The layer is hostile: every path is resolved inside the root by the
// kernel (openat2 RESOLVE_IN_ROOT), so no member, symlink or hard link can
// reach outside it whatever the layers before it left there; members
// named with ".." components are refused; sizes, names and entry counts
// are bounded. Whiteouts apply to what earlier layers made: ".wh.NAME"
// removes NAME, ".wh..wh..opq" empties its directory. Owners, modes and
// modification times are kept (the caller runs as root); devices other
// than whiteouts and sockets are skipped.
//
// Thread safety: none needed (no shared state).
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace sg::builds {

struct LayerLimits {
  uint64_t max_entries = 2'000'000;
  uint64_t max_bytes = 16ull << 30;  // uncompressed, regular files' sizes
};

struct AppliedLayer {
  uint64_t entries = 0;
  uint64_t bytes = 0;
  uint64_t whiteouts = 0;
};

// layer: the blob's file (gzip or zstd detected from its magic). kInvalid for a
// malformed or hostile layer (the message names the member).
Result<AppliedLayer> apply_layer(const std::string& root, const std::string& layer, const LayerLimits& limits = {});

}  // namespace sg::builds
