// microVM benchmark (issue 4): boot to agent-ready, clone-from-snapshot
// create latency over N creates, host memory per idle microVM; and (issue
// 23) networking: creates with a network of their own (virtio-net on a
// TAP), TCP connect latency and a download from a server on the host at
// the sandbox's gateway, timed inside the guest. Runs where
// /dev/kvm is usable, or inside the KVM test harness (scripts/bench-kvm.sh),
// whose numbers are labelled emulated: there the "host" is a TCG guest.
// Prints one line "BENCH-RESULT {json}" and writes the JSON to argv[1] if given.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "tests/kvm/kvm_env.h"
#include "tests/kvm/kvm_guest.h"
#include "base/sys.h"

using namespace sg;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

double ms_since(uint64_t t0) { return static_cast<double>(sys::monotonic_ns() - t0) / 1e6; }

double pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

runtime::SandboxSpec spec(int i, uint64_t mem_mb) {
  runtime::SandboxSpec s;
  char id[32];
  std::snprintf(id, sizeof id, "bench%015d", i);
  s.id = id;
  s.rootfs = testing::kvm_test_rootfs();
  s.cpu_count = 1;
  s.memory_mb = mem_mb;
  s.envd_access_token = "t";
  s.ready_timeout = 120s;
  return s;
}

// KiB sums from /proc/PID/smaps for the guest-RAM mapping (the one whose
// size is the RAM size) and for everything else.
struct Mem {
  uint64_t rss_kib = 0, pss_kib = 0;
  uint64_t guest_private_kib = 0, guest_shared_kib = 0;  // guest RAM pages, COW-copied vs page cache
  uint64_t vmm_private_kib = 0;                          // everything but guest RAM: the VMM's own cost
};

Mem smaps(int pid, uint64_t ram_kib) {
  Mem m;
  std::ifstream f("/proc/" + std::to_string(pid) + "/smaps");
  std::string line;
  bool guest = false;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    size_t dash = line.find('-');
    if (dash != std::string::npos && dash < 17 && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find(' ') > dash) {
      uint64_t lo = std::stoull(line.substr(0, dash), nullptr, 16);
      uint64_t hi = std::stoull(line.substr(dash + 1, line.find(' ') - dash - 1), nullptr, 16);
      guest = (hi - lo) / 1024 == ram_kib;
      continue;
    }
    auto val = [&](const char* k) -> int64_t {
      size_t n = std::strlen(k);
      if (line.compare(0, n, k) != 0) return -1;
      return std::atoll(line.c_str() + n);
    };
    int64_t v;
    if ((v = val("Rss:")) >= 0) m.rss_kib += static_cast<uint64_t>(v);
    if ((v = val("Pss:")) >= 0) m.pss_kib += static_cast<uint64_t>(v);
    int64_t pc = val("Private_Clean:"), pd = val("Private_Dirty:");
    int64_t sc = val("Shared_Clean:"), sd = val("Shared_Dirty:");
    for (int64_t x : {pc, pd})
      if (x >= 0) (guest ? m.guest_private_kib : m.vmm_private_kib) += static_cast<uint64_t>(x);
    for (int64_t x : {sc, sd})
      if (x >= 0 && guest) m.guest_shared_kib += static_cast<uint64_t>(x);
  }
  return m;
}

// Three servers on the host, every address, each on a thread: "connect"
// accepts and closes, "download" sends kDownload bytes and closes,
// "results" reads what the guest reports.
class HostServers {
 public:
  static constexpr size_t kDownload = 64u << 20;
  HostServers() {
    for (int i = 0; i < 3; ++i) {
      fds_[i].reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      sockaddr_in a{};
      a.sin_family = AF_INET;
      socklen_t l = sizeof a;
      if (::bind(fds_[i].get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fds_[i].get(), 64) != 0 ||
          ::getsockname(fds_[i].get(), reinterpret_cast<sockaddr*>(&a), &l) != 0)
        std::abort();
      ports[i] = ntohs(a.sin_port);
      threads_[i] = std::thread([this, i] { serve(i); });
    }
  }
  ~HostServers() {
    for (auto& f : fds_) ::shutdown(f.get(), SHUT_RDWR);
    for (auto& t : threads_) t.join();
  }
  std::string results() {
    std::lock_guard lock(mu_);
    return results_;
  }
  uint16_t ports[3] = {};

 private:
  void serve(int i) {
    std::vector<char> zeros(1 << 16);
    for (;;) {
      int c = ::accept4(fds_[i].get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      if (i == 1)
        for (size_t sent = 0; sent < kDownload;) {
          ssize_t n = ::write(c, zeros.data(), std::min(zeros.size(), kDownload - sent));
          if (n <= 0) break;
          sent += static_cast<size_t>(n);
        }
      if (i == 2) {
        char b[4096];
        std::string r;
        for (ssize_t n; (n = ::read(c, b, sizeof b)) > 0;) r.append(b, static_cast<size_t>(n));
        std::lock_guard lock(mu_);
        results_ = r;
      }
      ::close(c);
    }
  }
  UniqueFd fds_[3];
  std::thread threads_[3];
  std::mutex mu_;
  std::string results_;
};

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (!microvm::kvm_usable(&why)) {
    std::fprintf(stderr, "microvm_bench: KVM not usable here (%s)\n", why.c_str());
    return 77;
  }
  int creates = argc > 2 ? std::atoi(argv[2]) : 50;
  int idle = argc > 3 ? std::atoi(argv[3]) : 10;
  const uint64_t mem_mb = 256;
  json out;
  struct utsname u {};
  ::uname(&u);
  out["kernel"] = u.release;
  out["emulated"] = std::getenv("SANDGATE_BENCH_EMULATED") != nullptr;
  out["guest"] = {{"memory_mb", mem_mb}, {"vcpus", 1}};

  // SANDGATE_BENCH_NETWORK_ONLY: part 4 alone (scripts/bench-kvm.sh
  // writes it to a file of its own).
  const bool network_only = std::getenv("SANDGATE_BENCH_NETWORK_ONLY") != nullptr;
  if (!network_only) {
    // 1. Boot to agent-ready (no snapshot), 3 runs.
    {
      auto rt = microvm::make_microvm_runtime(testing::kvm_test_config("bench-boot", false));
      (void)rt->cleanup_stale();
      std::vector<double> boots;
      for (int i = 0; i < 3; ++i) {
        uint64_t t0 = sys::monotonic_ns();
        auto sb = rt->create(spec(900 + i, mem_mb));
        if (!sb) {
          std::fprintf(stderr, "boot: %s\n", sb.error().message().c_str());
          return 1;
        }
        boots.push_back(ms_since(t0));
        (void)(*sb)->kill();
      }
      out["boot_to_ready_ms"] = {{"runs", boots}, {"median", pct(boots, 50)}};
    }

    // 2. Clone-from-snapshot creates: the first builds the template snapshot.
    auto rt = microvm::make_microvm_runtime(testing::kvm_test_config("bench-clone", true));
    (void)rt->cleanup_stale();
    std::vector<std::unique_ptr<runtime::Sandbox>> kept;
    std::vector<double> lat;
    double first = 0;
    for (int i = 0; i <= creates; ++i) {
      uint64_t t0 = sys::monotonic_ns();
      auto sb = rt->create(spec(i, mem_mb));
      if (!sb) {
        std::fprintf(stderr, "create %d: %s\n", i, sb.error().message().c_str());
        return 1;
      }
      double ms = ms_since(t0);
      if (i == 0) first = ms;
      else lat.push_back(ms);
      if (i > creates - idle) kept.push_back(std::move(*sb));
      else (void)(*sb)->kill();
    }
    out["first_create_with_snapshot_build_ms"] = first;
    out["clone_create_ms"] = {{"n", lat.size()}, {"p50", pct(lat, 50)}, {"p90", pct(lat, 90)}, {"p99", pct(lat, 99)},
                              {"max", *std::max_element(lat.begin(), lat.end())}};

    // 3. Memory of idle clones, after they settle (a benchmark may sleep).
    std::this_thread::sleep_for(5s);
    std::vector<double> rss, pss, gpriv, gshared, vmm;
    for (auto& sb : kept) {
      Mem m = smaps(sb->init_pid(), mem_mb * 1024);
      rss.push_back(static_cast<double>(m.rss_kib) / 1024);
      pss.push_back(static_cast<double>(m.pss_kib) / 1024);
      gpriv.push_back(static_cast<double>(m.guest_private_kib) / 1024);
      gshared.push_back(static_cast<double>(m.guest_shared_kib) / 1024);
      vmm.push_back(static_cast<double>(m.vmm_private_kib) / 1024);
    }
    out["idle_microvm_mib"] = {{"n", kept.size()},
                               {"rss_median", pct(rss, 50)},
                               {"pss_median", pct(pss, 50)},
                               {"guest_private_median", pct(gpriv, 50)},
                               {"guest_shared_page_cache_median", pct(gshared, 50)},
                               {"vmm_overhead_private_median", pct(vmm, 50)}};
    for (auto& sb : kept) (void)sb->kill();
  }

  // 4. Networking: clone creates without and with a TAP and virtio-net
  // each (the test's TAPs, no nftables: HostNetwork's rules are the veth
  // path's), then from one sandbox 200 TCP connects and a 64 MiB download
  // from the host at its gateway, timed in the guest and reported back
  // over the same network.
  if (::access("/dev/net/tun", R_OK | W_OK) == 0) {
    testing::TestTaps taps;
    std::unique_ptr<runtime::Sandbox> probe;
    const int ncreates = std::min(creates, 20);
    for (bool with_net : {false, true}) {
      auto ncfg = testing::kvm_test_config(with_net ? "bench-net" : "bench-nonet", true);
      if (with_net) ncfg.networks = &taps;
      auto nrt = microvm::make_microvm_runtime(ncfg);
      (void)nrt->cleanup_stale();
      std::vector<double> nlat;
      for (int i = 0; i <= ncreates; ++i) {
        uint64_t t0 = sys::monotonic_ns();
        auto sb = nrt->create(spec(1000 + i, mem_mb));
        if (!sb) {
          std::fprintf(stderr, "network create %d: %s\n", i, sb.error().message().c_str());
          return 1;
        }
        double ms = ms_since(t0);
        if (i > 0) nlat.push_back(ms);  // the first builds the template snapshot
        if (with_net && i == ncreates) probe = std::move(*sb);
        else (void)(*sb)->kill();
      }
      out[with_net ? "clone_create_ms_with_network" : "clone_create_ms_without_network"] = {
          {"n", nlat.size()}, {"p50", pct(nlat, 50)}, {"p90", pct(nlat, 90)}, {"p99", pct(nlat, 99)}};
      if (with_net) {
        HostServers servers;
        std::string gw = testing::TestTaps::address(static_cast<uint32_t>(ncreates % 64), 1);
        std::string script =
            "python3 - <<'EOF'\nimport json, socket, time\ngw = '" + gw + "'\nlat = []\nfor i in range(200):\n"
            "    t = time.perf_counter(); s = socket.create_connection((gw, " + std::to_string(servers.ports[0]) + "), 10)\n"
            "    lat.append((time.perf_counter() - t) * 1000); s.close()\nlat.sort()\n"
            "t = time.perf_counter(); s = socket.create_connection((gw, " + std::to_string(servers.ports[1]) + "), 10); n = 0\n"
            "while True:\n    b = s.recv(1 << 16)\n    if not b: break\n    n += len(b)\n"
            "dt = time.perf_counter() - t\n"
            "r = socket.create_connection((gw, " + std::to_string(servers.ports[2]) + "), 10)\n"
            "r.sendall(json.dumps({'connect_ms': {'p50': lat[99], 'p99': lat[197]}, 'download_bytes': n, "
            "'download_mib_s': n / dt / 1048576}).encode()); r.close()\nEOF\n";
        std::string resp = testing::envd_run(*probe, script, true, 600000, "t");
        json got = json::parse(servers.results(), nullptr, false);
        if (!testing::exited_with(resp, 0) || !got.is_object() || got.value("download_bytes", uint64_t{0}) != HostServers::kDownload) {
          std::fprintf(stderr, "network probe failed: %s\n", resp.substr(0, 800).c_str());
          return 1;
        }
        out["virtio_net_sandbox_to_host"] = {{"connect_ms", got["connect_ms"]},
                                             {"download_64mib_mib_s", got["download_mib_s"]},
                                             {"measured_in", "the guest (python3, 200 connects)"}};
        (void)probe->kill();
      }
    }
  } else {
    out["virtio_net_sandbox_to_host"] = "not measured: no /dev/net/tun";
  }
  std::printf("BENCH-RESULT %s\n", out.dump().c_str());
  if (argc > 1 && std::string(argv[1]) != "-") {
    std::ofstream f(argv[1]);
    f << out.dump(2) << "\n";
  }
  return 0;
}
