// Template root filesystems: building the base Debian rootfs that process
// sandboxes use as their read-only overlay lower layer.
//
// A rootfs is built in <dest>.partial and renamed to <dest> only when
// complete, with a marker file (<dest>/.sandgate-template, JSON with a format
// version) written last before the rename, so a directory that has the marker
// is a whole template and an interrupted build never looks like one.
//
// Thread safety: functions are independent; two builds of the same dest at
// once are not supported (the caller serialises them).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace sg::templates {

// Bumped whenever finalize_rootfs changes what a template contains.
// 1: debootstrap + user + marker. 2: /etc/profile asks bash's $EUID before
// forking id(1) (a login shell starts ~2 ms faster). Older formats are
// upgraded in place by build_base_rootfs (only while no sandbox uses them).
// 3: curl and git in the package set (E2B's base has both); a template of
// an older format with another package set is rebuilt. 4: Node.js, npm,
// pip, venv, sudo (passwordless for user) and iproute2, as E2B's base.
inline constexpr int kTemplateFormat = 4;
inline constexpr const char* kMarkerFile = ".sandgate-template";
inline constexpr const char* kDefaultMirror = "http://deb.debian.org/debian";

// What build_base_rootfs does with an existing template of marker format
// `format`: nothing (current), finalize it in place (same package set, newer
// finalize steps), or rebuild it (another package set). format <= 0: not a
// template (build_base_rootfs refuses to touch it).
enum class Upgrade { kNone, kFinalize, kRebuild, kNotATemplate };
Upgrade upgrade_for_format(int format);

// Runs debootstrap (minbase bookworm with bash, coreutils, procps, python3,
// ca-certificates, curl, git; mirror from $SANDGATE_DEBIAN_MIRROR or kDefaultMirror)
// into <dest>.partial, then apt inside it for nodejs, npm, python3-pip,
// python3-venv, sudo and iproute2 (E2B's base), streaming each output line
// to progress, then finalize_rootfs() and an atomic rename to dest. A
// leftover <dest>.partial is removed first. Returns Ok at once if dest is
// already a ready template; fails if dest exists but is not one. Needs root
// and network access; takes about three minutes and ~650 MB.
Status build_base_rootfs(const std::string& dest_dir, const std::function<void(const std::string& line)>& progress);

// The post-debootstrap steps, on a rootfs directory: adds user "user"
// (uid/gid 1000, /home/user, /bin/bash) by editing etc/passwd, etc/group,
// etc/shadow (and etc/gshadow if present) directly, creates /.sandgate,
// removes apt caches, writes the marker. Idempotent.
Status finalize_rootfs(const std::string& dir);

// True when dir holds a complete template of the current format.
bool rootfs_ready(const std::string& dir);

// The code interpreter template (code-interpreter-v1, docs/code-interpreter.md)
// is two layers over the base template at base_dir, in dest_dir:
//  - packages/: what apt adds inside an overlay of the base (Jupyter's
//    Python kernel with numpy, pandas, matplotlib and more; TypeScript),
//    with packages.json naming the base it was made on (rebuilt when the
//    base is);
//  - server-<hash>/: sandgate's interpreter server in
//    /opt/sandgate/code-interpreter (code_interpreter_files(), hashed), so a
//    newer server is a new small layer, not a new apt run.
// Builds what is missing (each in a .partial directory renamed when whole)
// and returns the layers, lowest first. Needs root and the Debian mirror
// for packages/: a few minutes and ~400 MB the first time.
Result<std::vector<std::string>> ensure_code_interpreter_layers(
    const std::string& base_dir, const std::string& dest_dir, const std::function<void(const std::string& line)>& progress);

// The layers if both are ready for the base as it is now; empty if not.
std::vector<std::string> code_interpreter_layers(const std::string& base_dir, const std::string& dest_dir);

// The interpreter server's files (relative name, content), embedded at
// build time from sandbox-runtime/templates/code_interpreter/.
const std::vector<std::pair<std::string, std::string>>& code_interpreter_files();

// Where the template runs the server, and how its readiness is checked.
inline constexpr const char* kCodeInterpreterDir = "/opt/sandgate/code-interpreter";
inline constexpr const char* kCodeInterpreterStart = "exec python3 /opt/sandgate/code-interpreter/server.py";
inline constexpr const char* kCodeInterpreterReady = "curl -sf http://127.0.0.1:49999/health";

}  // namespace sg::templates
