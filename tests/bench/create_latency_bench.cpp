// create_latency_bench: POST /v2/sandboxes to agent-ready latency on the
// process backend, over real HTTP against the real binary.
//
// The create call answers only after the sandbox's agent has reported ready
// on its channel, so the HTTP round trip is the create-to-ready latency.
// One warm-up create (template and page cache warm), then N creates kept
// alive (so later ones pay for the earlier ones' presence), then all killed.
// Writes a JSON report (p50, p90, p99, max, mean) to the path in argv[1];
// argv[2] is N (default 50), any further arguments go to sandgate serve
// (e.g. --disk-limit off, to see what a feature costs).
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/support/sandgate_process.h"
#include "tests/bench/bench_util.h"
#include "base/sys.h"

using namespace sg;
using json = nlohmann::json;
using bench::cpu_model;
using bench::percentile;

namespace {

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = argc > 1 ? argv[1] : "create-latency.json";
  int n = argc > 2 ? std::atoi(argv[2]) : 50;
  test::TempDir dir;
  // Rate limits off: the benchmark measures creation, not the limiter.
  std::vector<std::string> args = {"--log-level", "warn", "--create-rate", "0", "--rate", "0"};
  std::vector<std::string> extra(argv + std::min(argc, 3), argv + argc);
  args.insert(args.end(), extra.begin(), extra.end());
  test::SandgateProcess s(dir.sub("data"), args);
  if (!s.started()) {
    std::fprintf(stderr, "sandgate did not start\n%s\n", s.log().c_str());
    return 1;
  }
  test::HttpClient c = s.client();
  std::map<std::string, std::string> h = {{"X-API-KEY", s.key()}};
  auto create = [&](std::string& id) {
    uint64_t t0 = sys::monotonic_ns();
    test::Response r = c.request("POST", "/v2/sandboxes", R"({"templateID":"base"})", h);
    double ms = static_cast<double>(sys::monotonic_ns() - t0) / 1e6;
    if (r.status != 201) {
      std::fprintf(stderr, "create failed: %d %s\n", r.status, r.body.c_str());
      return -1.0;
    }
    id = json::parse(r.body)["sandboxID"];
    return ms;
  };
  std::string warm;
  if (create(warm) < 0) return 1;
  c.request("DELETE", "/sandboxes/" + warm, "", h);

  std::vector<double> ms;
  std::vector<std::string> ids;
  for (int i = 0; i < n; ++i) {
    std::string id;
    double t = create(id);
    if (t < 0) return 1;
    ms.push_back(t);
    ids.push_back(id);
    std::fprintf(stderr, "\rcreate %d/%d: %.1f ms   ", i + 1, n, t);
  }
  std::fprintf(stderr, "\n");
  std::vector<double> kill_ms;
  for (const std::string& id : ids) {
    uint64_t t0 = sys::monotonic_ns();
    c.request("DELETE", "/sandboxes/" + id, "", h);
    kill_ms.push_back(static_cast<double>(sys::monotonic_ns() - t0) / 1e6);
  }
  double sum = 0;
  for (double x : ms) sum += x;
  struct utsname u;
  uname(&u);
  json report = {
      {"benchmark", "POST /v2/sandboxes to agent-ready, process backend, template cached"},
      {"creates", n},
      {"kept_alive", true},
      {"sandgate_args", extra},
      {"isolation", extra.empty() ? "defaults: user namespace, seccomp filter, size-limited writable layer (loop ext4)"
                                  : "defaults changed by sandgate_args"},
      {"p50_ms", percentile(ms, 50)},
      {"p90_ms", percentile(ms, 90)},
      {"p99_ms", percentile(ms, 99)},
      {"max_ms", *std::max_element(ms.begin(), ms.end())},
      {"mean_ms", sum / n},
      {"kill_p50_ms", percentile(kill_ms, 50)},
      {"kill_p99_ms", percentile(kill_ms, 99)},
      {"samples_ms", ms},
      {"machine", {{"cpu", cpu_model()}, {"cores", sysconf(_SC_NPROCESSORS_ONLN)}, {"kernel", u.release}}},
      {"date_unix", sys::unix_seconds()},
  };
  std::ofstream(out_path) << report.dump(2) << "\n";
  std::printf("create-to-ready over %d creates: p50 %.1f ms, p90 %.1f ms, p99 %.1f ms (kill p50 %.1f ms); report: %s\n",
              n, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), percentile(kill_ms, 50),
              out_path.c_str());
  return 0;
}
