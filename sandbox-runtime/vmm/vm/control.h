// Control: the VMM's control socket, one SOCK_SEQPACKET connection from
// sandgate. Each message is one command, each reply one message:
//   "pause" | "resume" | "stats" | "snapshot <dir>" | "snapshot-fds" |
//   "memfd" | "uffd" | "meminfo" | "release-memory" | "stop"
// replies "ok" (stats, meminfo, release-memory: "ok {json}") or
// "error: <message>". "meminfo": the RAM mapping's base address in the
// VMM, size and backing. "release-memory" (paused only): the memory
// offload's release (GuestMemory::release_to_userfaultfd); the first one
// passes the new userfaultfd with SCM_RIGHTS. "memfd" and
// "uffd" attach the fd to the reply with SCM_RIGHTS: the guest-RAM memfd
// (booted machines only; a clone's RAM is a private file mapping), and a
// new userfaultfd with all of guest RAM registered for missing-page faults
// (from then on the receiver must serve those faults: it is for the
// memory engine, wait-engine/memory). "snapshot-fds" (paused only) comes
// with two descriptors (SCM_RIGHTS), files sandgate opened for writing:
// the RAM is written to the first (sparse), the state to the second, so a
// VMM that may open no files can still be snapshotted. EOF on the socket
// stops the machine.
//
// Thread safety: serve() runs on the thread that calls it until EOF or
// stop; it calls Machine's thread-safe methods.
#pragma once

#include <string>
#include <vector>

#include "base/fd.h"

#include "sandbox-runtime/vmm/vm/attach.h"
#include "sandbox-runtime/vmm/vm/machine.h"

namespace sg::vmm {

// Handles one command; fd_out receives an fd to pass back (or -1).
// fds_in: the descriptors that came with the command (or null).
std::string handle_control(Machine& m, const std::string& cmd, int* fd_out, std::vector<UniqueFd>* fds_in = nullptr);
// Serves fd until EOF/error or until the machine stops. With next (the
// VMM outlives its host), EOF is the host going: it serves the socket the
// next host brings instead (attach.h), for the machine's life.
void serve_control(Machine& m, int fd, ControlHandOff* next = nullptr);

}  // namespace sg::vmm
