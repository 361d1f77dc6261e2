// The cost of the VMM's seccomp allow list (vm/confine.h) per syscall:
// the same calls timed in a child without a filter, in one under the
// VMM's filter, and in one under both the VMM's and a vCPU thread's own
// (vcpu_thread_policy, stacked: what a vCPU thread pays): ioctls (checked by request; KVM_RUN's rule comes first),
// calls allowed whatever their arguments (decided by the kernel's
// per-syscall cache without running the filter, Linux 5.11+) and the other
// calls checked by an argument. The calls fail at once (a closed fd, a bad
// argument) or do nothing (signal 0), so the time is the syscall's entry
// and exit plus the filter.
//
//   vmm_seccomp_bench OUT.json [iterations per call and round (1000000)]
#include <linux/kvm.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/bench/bench_util.h"
#include "base/seccomp.h"
#include "sandbox-runtime/vmm/vm/confine.h"

namespace {

struct Call {
  const char* name;
  long nr;
  long a0, a1;
};

// Nanoseconds per call over n calls.
double ns_per_call(const Call& c, long n) {
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) (void)::syscall(c.nr, c.a0, c.a1, 0);
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: vmm_seccomp_bench OUT.json [iterations]\n");
    return 2;
  }
  const long n = argc > 2 ? std::atol(argv[2]) : 1000000;
  const int bad_fd = 1 << 20;  // not open: every call fails with EBADF
  // In the measuring process (tgkill's signal 0 to itself only checks).
  auto make_calls = [bad_fd] {
    return std::vector<Call>{
        {"ioctl KVM_RUN (first rule)", SYS_ioctl, bad_fd, static_cast<long>(KVM_RUN)},
        {"ioctl KVM_GET_REGS", SYS_ioctl, bad_fd, static_cast<long>(KVM_GET_REGS)},
        {"write", SYS_write, bad_fd, 0},
        {"futex", SYS_futex, 0, 0},  // FUTEX_WAIT on a null address: EFAULT
        {"mmap (PROT_EXEC checked)", SYS_mmap, 0, 0},  // length 0: EINVAL
        {"tgkill (own pid checked)", SYS_tgkill, ::getpid(), ::syscall(SYS_gettid)},
    };
  };
  const std::vector<Call> names = make_calls();
  const size_t k = names.size();
  // Each side in a child of its own: the filter is irrevocable. The
  // results come back over a pipe.
  // filters: 0 none, 1 the process's, 2 the process's and a vCPU thread's.
  auto measure = [&](int filters, std::vector<double>* out) -> bool {
    int p[2];
    if (::pipe(p) != 0) return false;
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      if (filters >= 1) {
        auto program = sg::sys::seccomp::compile(sg::vmm::vmm_syscall_policy(::getpid(), false));
        if (!program || ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || !sg::sys::seccomp::install(*program, false))
          ::_exit(1);
      }
      if (filters >= 2 && !sg::vmm::confine_vcpu_thread()) ::_exit(1);
      std::vector<double> r;
      for (const Call& c : make_calls()) r.push_back(ns_per_call(c, n));
      ssize_t w = ::write(p[1], r.data(), r.size() * sizeof(double));
      ::_exit(w == static_cast<ssize_t>(r.size() * sizeof(double)) ? 0 : 1);
    }
    ::close(p[1]);
    out->resize(k);
    ssize_t got = ::read(p[0], out->data(), k * sizeof(double));
    ::close(p[0]);
    int st = 0;
    ::waitpid(pid, &st, 0);
    return got == static_cast<ssize_t>(k * sizeof(double)) && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  };
  // Rounds alternate between the two, so that drift in the machine's
  // speed falls on both; each figure is the median over the rounds.
  constexpr int kRounds = 9;
  std::vector<std::vector<double>> bare_r(k), filtered_r(k), vcpu_r(k);
  for (int r = 0; r < kRounds; ++r) {
    std::vector<double> b, f, v;
    if (!measure(0, &b) || !measure(1, &f) || !measure(2, &v)) {
      std::fprintf(stderr, "vmm_seccomp_bench: a measuring child failed\n");
      return 1;
    }
    for (size_t i = 0; i < k; ++i) {
      bare_r[i].push_back(b[i]);
      filtered_r[i].push_back(f[i]);
      vcpu_r[i].push_back(v[i]);
    }
  }
  std::vector<double> bare(k), filtered(k), vcpu(k);
  for (size_t i = 0; i < k; ++i) {
    bare[i] = sg::bench::percentile(bare_r[i], 50);
    filtered[i] = sg::bench::percentile(filtered_r[i], 50);
    vcpu[i] = sg::bench::percentile(vcpu_r[i], 50);
  }
  auto program = sg::sys::seccomp::compile(sg::vmm::vmm_syscall_policy(::getpid(), false));
  auto vcpu_program = sg::sys::seccomp::compile(sg::vmm::vcpu_thread_policy());
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < k; ++i)
    rows.push_back({{"call", names[i].name}, {"ns_without_filter", bare[i]}, {"ns_with_filter", filtered[i]},
                    {"filter_ns", filtered[i] - bare[i]}, {"ns_on_vcpu_thread", vcpu[i]},
                    {"vcpu_filter_ns", vcpu[i] - filtered[i]}});
  nlohmann::json out = {
      {"machine", {{"cpu", sg::bench::cpu_model()}, {"cores", std::thread::hardware_concurrency()}}},
      {"iterations", n},
      {"filter_instructions", program ? program->size() : 0},
      {"vcpu_filter_instructions", vcpu_program ? vcpu_program->size() : 0},
      {"calls", rows},
      {"rounds", kRounds},
      {"note", "each call fails at once (bad fd or argument) or does nothing; median over rounds that alternate "
               "unfiltered, filtered and vCPU-thread (both filters) children; the kernel JIT-compiles the filter where net.core.bpf_jit_enable "
               "is set"}};
  std::ofstream(argv[1]) << out.dump(2) << "\n";
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
