// sandgate-vmm: one microVM per process. Boots a Linux kernel (or restores
// a snapshot), runs it until the guest stops, the channel closes or the
// control socket says so. See docs/vmm.md.
#include <signal.h>
#include <sys/prctl.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/log.h"
#include "base/sys.h"
#include "sandbox-runtime/vmm/vm/attach.h"
#include "sandbox-runtime/vmm/vm/confine.h"
#include "sandbox-runtime/vmm/vm/control.h"
#include "sandbox-runtime/vmm/vm/machine.h"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: sandgate-vmm --kernel BZIMAGE [--initrd CPIO] [--initrd-file GUEST=HOST]... --disk IMG [--disk-rw]\n"
               "                    [--cmdline STR] [--mem-mib N] [--cpus N] --channel-fd N [--control-fd N]\n"
               "                    [--tap-fd N] [--mac AA:BB:CC:DD:EE:FF]\n"
               "                    [--serial-log PATH] [--die-with-parent | --outlive] [--cgroup-procs FILE]... [--snapshot-dir DIR]\n"
               "                    [--jail EMPTY_DIR --jail-uid N --jail-gid N [--jail-snapshot-dir DIR]]\n"
               "       sandgate-vmm --jail-probe --jail EMPTY_DIR --jail-uid N --jail-gid N\n"
               "                    [--log-level debug|info|warn|error]\n"
               "       sandgate-vmm --restore SNAPSHOT_DIR --channel-fd N [--control-fd N] [--serial-log PATH] ...\n");
}

bool parse_uint(const char* s, unsigned long long max, unsigned long long* out) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(s, &end, 10);
  if (errno || !end || *end || end == s || v > max) return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  sg::vmm::BootConfig boot;
  sg::vmm::IoConfig io;
  std::string restore_dir, serial_log;
  std::string snapshot_dir;  // unjailed: the one directory it may write a snapshot to
  int control_fd = -1;
  bool die_with_parent = false;
  bool outlive = false;  // runs on when its host goes; a new host attaches (vm/attach.h)
  std::vector<std::string> cgroup_procs;  // cgroup.procs files to join before anything else
  sg::vmm::Jail jail;
  bool jail_probe = false;  // enter the jail and exit: whether it works here
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "sandgate-vmm: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    unsigned long long v = 0;
    if (a == "--kernel") boot.kernel = next();
    else if (a == "--initrd") boot.initrd = next();
    else if (a == "--initrd-file") {
      std::string s = next();
      size_t eq = s.find('=');
      if (eq == std::string::npos || eq == 0) {
        std::fprintf(stderr, "sandgate-vmm: --initrd-file wants GUEST=HOST\n");
        return 2;
      }
      boot.initrd_files.emplace_back(s.substr(0, eq), s.substr(eq + 1));
    } else if (a == "--disk") boot.disk = next();
    else if (a == "--disk-rw") boot.disk_read_only = false;
    else if (a == "--cmdline") boot.cmdline = next();
    else if (a == "--mem-mib" && parse_uint(next(), 1 << 20, &v) && v >= 64) boot.mem_bytes = v << 20;
    else if (a == "--cpus" && parse_uint(next(), 32, &v) && v >= 1) boot.cpus = static_cast<uint32_t>(v);
    else if (a == "--channel-fd" && parse_uint(next(), 1 << 20, &v)) io.channel_fd = static_cast<int>(v);
    else if (a == "--control-fd" && parse_uint(next(), 1 << 20, &v)) control_fd = static_cast<int>(v);
    else if (a == "--tap-fd" && parse_uint(next(), 1 << 20, &v)) io.tap_fd = static_cast<int>(v);
    else if (a == "--mac" && sg::vmm::VirtioNet::parse_mac(next(), &io.mac)) continue;
    else if (a == "--serial-log") serial_log = next();
    else if (a == "--restore") restore_dir = next();
    else if (a == "--die-with-parent") die_with_parent = true;
    else if (a == "--outlive") outlive = true;
    else if (a == "--cgroup-procs") cgroup_procs.emplace_back(next());
    else if (a == "--jail") jail.root = next();
    else if (a == "--jail-probe") jail_probe = true;
    else if (a == "--jail-uid" && parse_uint(next(), 0xfffffffeull, &v) && v > 0) jail.uid = static_cast<uint32_t>(v);
    else if (a == "--jail-gid" && parse_uint(next(), 0xfffffffeull, &v) && v > 0) jail.gid = static_cast<uint32_t>(v);
    else if (a == "--jail-snapshot-dir") jail.snapshot_dir = next();
    else if (a == "--snapshot-dir") snapshot_dir = next();
    else if (a == "--log-level") {
      std::string l = next();
      sg::log::set_level(l == "debug" ? sg::log::Level::kDebug : l == "warn" ? sg::log::Level::kWarn
                         : l == "error" ? sg::log::Level::kError : sg::log::Level::kInfo);
    } else {
      std::fprintf(stderr, "sandgate-vmm: bad argument %s\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (die_with_parent && outlive) {
    std::fprintf(stderr, "sandgate-vmm: --die-with-parent and --outlive exclude each other\n");
    return 2;
  }
  if (die_with_parent) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() == 1) return 1;  // the parent is already gone
  }
  sg::UniqueFd attach;
  if (outlive) {
    // First, before anything else opens a descriptor: its number is fixed.
    sg::Result<sg::UniqueFd> p = sg::vmm::make_attach_pair();
    if (!p) {
      std::fprintf(stderr, "sandgate-vmm: %s\n", p.error().message().c_str());
      return 1;
    }
    attach = std::move(*p);
    io.outlive = true;
  }
  ::signal(SIGPIPE, SIG_IGN);
  // Into its cgroups before guest memory exists, so all of it is charged
  // there.
  for (const std::string& f : cgroup_procs) {
    if (sg::Status s = sg::sys::write_file(f, std::to_string(::getpid())); !s) {
      std::fprintf(stderr, "sandgate-vmm: join cgroup: %s\n", s.error().message().c_str());
      return 1;
    }
  }
  bool jailed = !jail.root.empty();
  if (jailed != (jail.uid > 0) || jailed != (jail.gid > 0) || (!jailed && (!jail.snapshot_dir.empty() || jail_probe)) ||
      (jailed && !snapshot_dir.empty()) || (!snapshot_dir.empty() && snapshot_dir[0] != '/')) {
    std::fprintf(stderr, "sandgate-vmm: --jail needs --jail-uid and --jail-gid (both > 0); --jail-snapshot-dir and --jail-probe need --jail; "
                         "--snapshot-dir (absolute) is for an unjailed VMM\n");
    return 2;
  }
  if (jail_probe) {
    if (sg::Status s = sg::vmm::confine_vmm(&jail); !s) {
      std::fprintf(stderr, "sandgate-vmm: confine: %s\n", s.error().message().c_str());
      return 1;
    }
    std::fprintf(stderr, "sandgate-vmm: jailed as uid %u\n", ::geteuid());
    return 0;
  }
  if (io.channel_fd < 0 || (restore_dir.empty() && (boot.kernel.empty() || boot.disk.empty()))) {
    usage();
    return 2;
  }
  int serial = -1;
  if (!serial_log.empty()) {
    serial = ::open(serial_log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (serial < 0) {
      std::fprintf(stderr, "sandgate-vmm: open %s: %s\n", serial_log.c_str(), std::strerror(errno));
      return 1;
    }
  }
  io.serial_fd = serial;
  auto m = restore_dir.empty() ? sg::vmm::Machine::boot(boot, io) : sg::vmm::Machine::restore(restore_dir, io);
  if (!m) {
    std::fprintf(stderr, "sandgate-vmm: %s\n", m.error().message().c_str());
    return 1;
  }
  sg::vmm::Machine& machine = **m;
  // Everything is open and no thread runs yet: confined (jailed too, if
  // asked) before the guest's first instruction; every thread made from
  // here on inherits the filter and the credentials.
  // Only a VMM that is to write a snapshot may open files once it runs.
  const bool snapshot_files = jailed ? !jail.snapshot_dir.empty() : !snapshot_dir.empty();
  if (sg::Status s = sg::vmm::confine_vmm(jailed ? &jail : nullptr, snapshot_files); !s) {
    std::fprintf(stderr, "sandgate-vmm: confine: %s\n", s.error().message().c_str());
    return 1;
  }
  if (jailed) {
    // A credential change clears the parent-death signal: set it again.
    if (die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() == 1) return 1;
    }
    if (!jail.snapshot_dir.empty()) machine.set_snapshot_alias(jail.snapshot_dir, sg::vmm::kJailSnapshotDir);
  } else if (!snapshot_dir.empty()) {
    machine.set_snapshot_alias(snapshot_dir, snapshot_dir);
  }
  // Each vCPU thread narrows its own list further (vm/confine.h).
  machine.set_vcpu_thread_init(sg::vmm::confine_vcpu_thread);
  if (sg::Status s = machine.start(); !s) {
    std::fprintf(stderr, "sandgate-vmm: %s\n", s.error().message().c_str());
    return 1;
  }
  static sg::vmm::ControlHandOff control_handoff;  // lives as long as the detached threads
  sg::vmm::ControlHandOff* next = outlive ? &control_handoff : nullptr;
  if (control_fd >= 0)
    std::thread([&machine, control_fd, next] { sg::vmm::serve_control(machine, control_fd, next); }).detach();
  if (attach)
    std::thread([&machine, fd = attach.get()] { sg::vmm::serve_attach(machine, fd, control_handoff); }).detach();
  std::string why = machine.wait();
  bool clean = why.find("reset") != std::string::npos || why.find("shut down") != std::string::npos ||
               why.find("closed") != std::string::npos || why.find("stop requested") != std::string::npos;
  std::fprintf(stderr, "sandgate-vmm: stopped: %s\n", why.c_str());
  // Exit without tearing down: the control thread may still be blocked on
  // its socket, and the kernel frees the VM with the process.
  std::fflush(stderr);
  ::_exit(clean ? 0 : 1);
}
