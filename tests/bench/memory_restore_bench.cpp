// Restore benchmark (issue 6, docs/memory-pool.md "Prefetch"): replays
// recorded post-resume page traces of sibling processes through a real
// userfaultfd FaultServer, with and without the prefetch predictor, and
// reports the fraction of first touches served by a demand fault and the
// first-touch latency p50/p99.
//
// Traces: N python3 siblings started from one script with address-space
// randomisation off (personality ADDR_NO_RANDOMIZE), so the same template
// state lands at the same addresses in every sibling, as in clones of one
// snapshot. Each builds the same template state, then runs T "tool calls"
// (a burst of heap work with its own seed), blocking on stdin between them
// (the model wait). The kernel here lacks soft-dirty (clear_refs 4 is
// accepted but pagemap bit 55 never sets) and idle page tracking
// (/sys/kernel/mm/page_idle), and pagemap has no accessed bit, so each
// tool call's pages are found by content: before and after it, every
// present page (pagemap bit 63) of the private writable mappings is read
// through /proc/PID/mem and hashed; a trace is the pages whose content
// changed or that became present, in address order (nothing gives the
// order of touches). Pages only read, and writes that left a page's bytes
// as they were, are not seen: traces are write sets. Addresses become
// page indices of one region: the union of the siblings' mappings that
// hold a touched page, laid end to end (offsets within a mapping kept,
// so strides are the real ones).
//
// Replay: a memfd region of that many pages, registered with FaultServer
// (pages are pattern data from the source). Before every resume all pages
// are released (hole punch), the predictor's pages are prefetched, then
// another thread reads the first byte of each recorded page in order,
// timing each first touch; demand faults are counted by the server. With
// stride on, the source hands each demand fault to a helper thread that
// asks Predictor::on_fault and prefetches its answer. After the resume the
// predictor learns the outcome (prefetched vs touched) and the trace.
//
// Usage: memory_restore_bench [out.json] [siblings] [tool_calls]
//        (default docs/bench/memory-restore.json, 6, 8)
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/personality.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tests/bench/bench_util.h"
#include "wait-engine/memory/prefetch.h"
#include "wait-engine/memory/uffd.h"

using json = nlohmann::json;
using namespace sg;
using namespace sg::memory;

namespace {

constexpr uint64_t kPg = 4096;

// argv[1] = sibling seed. Builds the template state (seed 42: identical in
// every sibling), prints "ready", then runs one tool call per stdin line.
const char* kPython = R"py(
import sys, os, random, string, json, re, collections
seed = int(sys.argv[1])
rng = random.Random(42)
vocab = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10))) for _ in range(5000)]
base = {f"key{i}": [i, " ".join(rng.choice(vocab) for _ in range(4)), {"v": i * 1.5}] for i in range(40000)}
docs = [" ".join(rng.choice(vocab) for _ in range(200)) for _ in range(300)]
scratch = []
os.write(1, b"ready\n")
for line in sys.stdin:
    t = int(line)
    r = random.Random(seed * 1000 + t)
    kind = t % 4
    if kind == 0:    # build: a new dict of strings
        scratch.append({r.getrandbits(40): " ".join(r.choice(vocab) for _ in range(5)) for _ in range(6000)})
    elif kind == 1:  # update entries of the shared dict
        for _ in range(8000):
            e = base[f"key{r.randrange(40000)}"]
            e[0] += 1
            e[2]["seen"] = r.random()
    elif kind == 2:  # read and serialise
        out = json.dumps([base[f"key{r.randrange(40000)}"] for _ in range(4000)])
        hits = sum(1 for d in docs[:60] if re.search(r.choice(vocab), d))
    else:            # sort and count
        words = sorted(r.choice(vocab) for _ in range(20000))
        c = collections.Counter(words)
        if len(scratch) > 2:
            scratch.pop(0)
    os.write(1, b"done\n")
)py";

struct Mapping {
  uint64_t lo, hi;
};

std::vector<Mapping> private_writable(int pid) {
  std::vector<Mapping> out;
  std::ifstream f("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream ls(line);
    std::string range, perms, off, dev, inode, name;
    ls >> range >> perms >> off >> dev >> inode;
    std::getline(ls, name);
    if (perms.size() < 4 || perms[0] != 'r' || perms[1] != 'w' || perms[3] != 'p') continue;
    if (name.find("[v") != std::string::npos) continue;  // vvar, vdso, vsyscall
    out.push_back({std::stoull(range.substr(0, range.find('-')), nullptr, 16),
                   std::stoull(range.substr(range.find('-') + 1), nullptr, 16)});
  }
  return out;
}

struct Sibling {
  pid_t pid = 0;
  FILE* to = nullptr;
  FILE* from = nullptr;
  std::vector<Mapping> maps;  // union over the run
};

// Content hash of every present page of pid's private writable mappings
// (pagemap bit 63 for presence, /proc/PID/mem for the bytes).
std::map<uint64_t, uint64_t> snapshot(int pid, std::vector<Mapping>* maps_seen) {
  std::map<uint64_t, uint64_t> out;
  std::string p = "/proc/" + std::to_string(pid);
  int pm = ::open((p + "/pagemap").c_str(), O_RDONLY | O_CLOEXEC);
  int mem = ::open((p + "/mem").c_str(), O_RDONLY | O_CLOEXEC);
  if (pm < 0 || mem < 0) {
    std::fprintf(stderr, "cannot open %s/pagemap or mem: %s (needs root or ptrace access)\n", p.c_str(),
                 std::strerror(errno));
    std::exit(1);
  }
  std::vector<uint64_t> ent;
  std::vector<char> buf(kPg);
  for (const Mapping& m : private_writable(pid)) {
    maps_seen->push_back(m);
    size_t n = (m.hi - m.lo) / kPg;
    ent.resize(n);
    ssize_t got = ::pread(pm, ent.data(), n * 8, static_cast<off_t>(m.lo / kPg * 8));
    for (size_t i = 0; got > 0 && i < static_cast<size_t>(got) / 8; ++i) {
      if (!(ent[i] >> 63 & 1)) continue;
      uint64_t a = m.lo + i * kPg;
      if (::pread(mem, buf.data(), kPg, static_cast<off_t>(a)) != static_cast<ssize_t>(kPg)) continue;
      out[a] = std::hash<std::string_view>{}(std::string_view(buf.data(), kPg));
    }
  }
  ::close(pm);
  ::close(mem);
  return out;
}

struct Result_ {
  std::string name;
  uint64_t touches = 0, demand = 0, prefetched = 0, wasted = 0, stride_prefetched = 0;
  std::vector<double> lat_all, lat_demand, lat_prefetched;
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = argc > 1 ? argv[1] : "docs/bench/memory-restore.json";
  int n = argc > 2 ? std::atoi(argv[2]) : 6;
  int calls = argc > 3 ? std::atoi(argv[3]) : 8;
  if (n < 2 || n > 32 || calls < 2 || calls > 64) {
    std::fprintf(stderr, "siblings 2..32, tool calls 2..64\n");
    return 2;
  }

  // ---- record: traces[s][t] = addresses written by sibling s's tool call t
  std::vector<Sibling> sibs(n);
  for (int s = 0; s < n; ++s) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return 1;
    pid_t pid = fork();
    if (pid == 0) {
      personality(ADDR_NO_RANDOMIZE);
      dup2(in[0], 0);
      dup2(out[1], 1);
      std::string seed = std::to_string(s + 1);
      execlp("python3", "python3", "-c", kPython, seed.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    sibs[s].pid = pid;
    sibs[s].to = fdopen(in[1], "w");
    sibs[s].from = fdopen(out[0], "r");
  }
  char line[64];
  for (auto& sb : sibs)
    if (!std::fgets(line, sizeof line, sb.from) || std::strncmp(line, "ready", 5) != 0) {
      std::fprintf(stderr, "python3 sibling %d did not start\n", sb.pid);
      return 1;
    }
  std::vector<std::vector<std::vector<uint64_t>>> addr_traces(n, std::vector<std::vector<uint64_t>>(calls));
  std::vector<std::map<uint64_t, uint64_t>> before(n);
  for (int s = 0; s < n; ++s) before[s] = snapshot(sibs[s].pid, &sibs[s].maps);
  for (int t = 0; t < calls; ++t)
    for (int s = 0; s < n; ++s) {
      Sibling& sb = sibs[s];
      std::fprintf(sb.to, "%d\n", t);
      std::fflush(sb.to);
      if (!std::fgets(line, sizeof line, sb.from)) return 1;
      auto after = snapshot(sb.pid, &sb.maps);
      for (auto& [a, h] : after) {
        auto it = before[s].find(a);
        if (it == before[s].end() || it->second != h) addr_traces[s][t].push_back(a);
      }
      before[s] = std::move(after);
    }
  for (auto& sb : sibs) {
    std::fclose(sb.to);
    int st = 0;
    waitpid(sb.pid, &st, 0);
    std::fclose(sb.from);
  }

  // ---- addresses -> page indices: merged mappings holding a touched page, end to end
  std::vector<Mapping> all;
  for (auto& sb : sibs) all.insert(all.end(), sb.maps.begin(), sb.maps.end());
  std::sort(all.begin(), all.end(), [](auto& a, auto& b) { return a.lo < b.lo; });
  std::vector<Mapping> merged;
  for (auto& m : all) {
    if (!merged.empty() && m.lo <= merged.back().hi)
      merged.back().hi = std::max(merged.back().hi, m.hi);
    else
      merged.push_back(m);
  }
  std::set<uint64_t> touched_addr;
  for (auto& s : addr_traces)
    for (auto& t : s) touched_addr.insert(t.begin(), t.end());
  std::vector<std::pair<Mapping, uint64_t>> layout;  // mapping, first index
  uint64_t pages = 0;
  for (auto& m : merged) {
    auto it = touched_addr.lower_bound(m.lo);
    if (it == touched_addr.end() || *it >= m.hi) continue;
    layout.push_back({m, pages});
    pages += (m.hi - m.lo) / kPg;
  }
  auto index_of = [&](uint64_t a) {
    auto it = std::upper_bound(layout.begin(), layout.end(), a, [](uint64_t x, auto& e) { return x < e.first.lo; });
    --it;
    return it->second + (a - it->first.lo) / kPg;
  };
  std::vector<std::vector<std::vector<uint64_t>>> traces(n, std::vector<std::vector<uint64_t>>(calls));
  uint64_t trace_pages = 0;
  json per_call = json::array();
  for (int t = 0; t < calls; ++t) {
    json row = json::array();
    for (int s = 0; s < n; ++s) {
      for (uint64_t a : addr_traces[s][t]) traces[s][t].push_back(index_of(a));
      trace_pages += traces[s][t].size();
      row.push_back(traces[s][t].size());
    }
    per_call.push_back(row);
  }
  std::fprintf(stderr, "%d siblings x %d tool calls: %lu touched pages in a %lu-page region\n", n, calls,
               static_cast<unsigned long>(trace_pages), static_cast<unsigned long>(pages));

  // ---- replay
  int memfd = ::memfd_create("restore-bench", MFD_CLOEXEC);
  if (memfd < 0 || ::ftruncate(memfd, static_cast<off_t>(pages * kPg)) != 0) return 1;
  // SAFETY: a fresh shared mapping of the whole memfd; unmapped at exit.
  auto* base = static_cast<uint8_t*>(::mmap(nullptr, pages * kPg, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0));
  if (base == MAP_FAILED) return 1;
  std::vector<uint64_t> every(pages);
  for (uint64_t i = 0; i < pages; ++i) every[i] = i;

  struct Config {
    const char* name;
    bool history, hot, stride, throttle;
    size_t budget;
  };
  const size_t kBudget = 4096;
  std::vector<Config> configs = {{"no_prefetch", false, false, false, false, 0},
                                 {"history_only", true, false, false, true, kBudget},
                                 {"cohort_hot_set_only", false, true, false, true, kBudget},
                                 {"all_with_stride", true, true, true, true, kBudget},
                                 {"all_with_stride_no_throttle", true, true, true, false, kBudget}};
  json results = json::object();
  for (const Config& c : configs) {
    PredictorConfig pc;
    pc.use_history = c.history;
    pc.use_hot_set = c.hot;
    pc.use_stride = c.stride;
    pc.throttle = c.throttle;
    Predictor pred(pc);

    // Demand faults reach the stride helper through this queue; the source
    // runs on the server thread and must not call prefetch() itself.
    std::mutex mu;
    std::condition_variable cv;
    std::deque<uint64_t> faults;  // GUARDED_BY(mu)
    bool stride_on = false;       // GUARDED_BY(mu)
    static thread_local bool in_prefetch = false;
    PageSource source = [&](uint64_t page, uint8_t* out) -> sg::Result<PageFill> {
      std::memcpy(out, &page, sizeof page);
      std::memset(out + 8, static_cast<int>(page & 0xff), kPg - 8);
      if (!in_prefetch && c.stride) {
        std::lock_guard<std::mutex> l(mu);
        if (stride_on) {
          faults.push_back(page);
          cv.notify_one();
        }
      }
      return PageFill::kData;
    };
    FaultServerOptions opt;
    opt.memfd = memfd;
    auto made = FaultServer::register_region(base, pages * kPg, source, opt);
    if (!made.ok()) {
      std::fprintf(stderr, "userfaultfd: %s\n", made.error().message().c_str());
      return 1;
    }
    FaultServer& srv = **made;
    if (!srv.start().ok()) return 1;

    Result_ r;
    r.name = c.name;
    for (int t = 0; t < calls; ++t)
      for (int s = 0; s < n; ++s) {
        std::string sb = "sibling-" + std::to_string(s);
        if (!srv.release(every).ok()) return 1;
        auto want = pred.predict(sb, "cohort", static_cast<uint32_t>(t), c.budget);
        std::vector<uint64_t> prefetched = want;
        in_prefetch = true;
        if (!want.empty() && !srv.prefetch(want).ok()) return 1;
        in_prefetch = false;
        pred.begin_restore(sb);
        uint64_t faults0 = srv.stats().faults;

        std::vector<uint64_t> stride_pages;
        bool stop_stride = false;
        std::thread stride;
        if (c.stride) {
          {
            std::lock_guard<std::mutex> l(mu);
            stride_on = true;
            faults.clear();
          }
          stride = std::thread([&] {
            in_prefetch = true;
            std::unique_lock<std::mutex> l(mu);
            for (;;) {
              cv.wait(l, [&] { return stop_stride || !faults.empty(); });
              if (faults.empty()) return;
              uint64_t p = faults.front();
              faults.pop_front();
              l.unlock();
              auto more = pred.on_fault(sb, p);
              more.erase(std::remove_if(more.begin(), more.end(), [&](uint64_t x) { return x >= pages; }),
                         more.end());
              if (!more.empty()) {
                auto got = srv.prefetch(more);
                if (got.ok() && *got > 0) stride_pages.insert(stride_pages.end(), more.begin(), more.end());
              }
              l.lock();
            }
          });
        }
        const auto& trace = traces[s][t];
        std::thread reader([&] {
          unsigned char vec = 0;
          for (uint64_t p : trace) {
            volatile uint8_t* a = base + p * kPg;
            // SAFETY: a one-page query inside the mapping.
            ::mincore(const_cast<uint8_t*>(a), kPg, &vec);
            bool resident = vec & 1;
            auto t0 = std::chrono::steady_clock::now();
            (void)*a;
            auto t1 = std::chrono::steady_clock::now();
            double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
            r.lat_all.push_back(us);
            (resident ? r.lat_prefetched : r.lat_demand).push_back(us);
          }
        });
        reader.join();
        if (c.stride) {
          {
            std::lock_guard<std::mutex> l(mu);
            stop_stride = true;
            stride_on = false;
            faults.clear();
            cv.notify_one();
          }
          stride.join();
        }
        uint64_t demand = srv.stats().faults - faults0;
        prefetched.insert(prefetched.end(), stride_pages.begin(), stride_pages.end());
        std::set<uint64_t> pf(prefetched.begin(), prefetched.end()), tr(trace.begin(), trace.end());
        uint64_t used = 0;
        for (uint64_t p : pf) used += tr.count(p);
        r.touches += trace.size();
        r.demand += demand;
        r.prefetched += pf.size();
        r.stride_prefetched += stride_pages.size();
        r.wasted += pf.size() - used;
        pred.report_outcome(sb, prefetched, trace);
        pred.record_trace(sb, "cohort", static_cast<uint32_t>(t), trace);
      }
    srv.stop();
    auto mem = pred.memory();
    double scale_sum[kPrefetchSources] = {0, 0, 0};
    for (int s = 0; s < n; ++s)
      for (size_t i = 0; i < kPrefetchSources; ++i)
        scale_sum[i] += pred.scale("sibling-" + std::to_string(s), static_cast<PrefetchSource>(i));
    results[c.name] = {
        {"first_touches", r.touches},
        {"demand_faults", r.demand},
        {"fraction_on_demand", static_cast<double>(r.demand) / static_cast<double>(std::max<uint64_t>(r.touches, 1))},
        {"pages_prefetched", r.prefetched},
        {"stride_pages_prefetched", r.stride_prefetched},
        {"wasted_prefetches", r.wasted},
        {"prefetch_precision",
         r.prefetched ? static_cast<double>(r.prefetched - r.wasted) / static_cast<double>(r.prefetched) : 0.0},
        {"demand_fault_latency_us", {{"p50", bench::percentile(r.lat_demand, 50)}, {"p99", bench::percentile(r.lat_demand, 99)}, {"n", r.lat_demand.size()}}},
        {"first_touch_latency_us", {{"p50", bench::percentile(r.lat_all, 50)}, {"p99", bench::percentile(r.lat_all, 99)}}},
        {"prefetched_touch_latency_us", {{"p50", bench::percentile(r.lat_prefetched, 50)}, {"p99", bench::percentile(r.lat_prefetched, 99)}}},
        {"mean_throttle_scale_at_end",
         {{"history", scale_sum[0] / n}, {"hot_set", scale_sum[1] / n}, {"stride", scale_sum[2] / n}}},
        {"predictor_stored_pages", mem.stored_pages},
    };
    std::fprintf(stderr, "%-28s on demand %.3f  demand p50 %.1f us p99 %.1f us  prefetched %lu wasted %lu\n", c.name,
                 results[c.name]["fraction_on_demand"].get<double>(), bench::percentile(r.lat_demand, 50),
                 bench::percentile(r.lat_demand, 99), static_cast<unsigned long>(r.prefetched),
                 static_cast<unsigned long>(r.wasted));
  }
  ::munmap(base, pages * kPg);
  ::close(memfd);

  json doc = {
      {"benchmark", "memory_restore_bench"},
      {"machine", "2-core Intel Xeon VM, Debian 12 (" + bench::cpu_model() + ")"},
      {"source",
       "recorded traces, not microVMs: " + std::to_string(n) +
           " python3 siblings run one script with ASLR off (personality ADDR_NO_RANDOMIZE), so their identical "
           "template state (5,000-word vocabulary, 40,000-entry dict of lists, 300 documents) sits at the same "
           "addresses; each then runs " + std::to_string(calls) +
           " tool calls (cycling: build a 6,000-entry dict; 8,000 updates of the shared dict; json.dumps of 4,000 "
           "entries plus regex searches; sort and count 20,000 words), with its own seed, blocking on stdin between "
           "them. Capture: this kernel (6.18) has no soft-dirty (clear_refs 4 accepted, pagemap bit 55 never set) "
           "and no /sys/kernel/mm/page_idle, so before and after each tool call every present page (pagemap bit 63) "
           "of the private writable mappings is read through /proc/PID/mem and hashed; a trace is the pages whose "
           "content changed or that became present, in address order (no source gives the touch order). Pages only "
           "read, and writes that restore a page's bytes, are missed: traces are write sets. Page index: the "
           "mappings holding a touched page, laid end to end, offsets kept."},
      {"replay",
       "memfd region of the touched mappings' size, registered with FaultServer (pattern pages from the source). "
       "Per resume, siblings in order within each tool call: release every page (hole punch), prefetch the "
       "predictor's pages (budget " + std::to_string(kBudget) +
           " pages times the throttle scale), then a second thread reads one byte of each recorded page in "
           "order; latency is that read (steady_clock), classed demand if mincore said not resident just before. "
           "Stride: demand faults go from the source to a helper thread that prefetches Predictor::on_fault's "
           "pages. After each resume the predictor gets report_outcome(prefetched, trace) and record_trace; the "
       "throttle is per sandbox and per source (history, hot set, stride). "
           "Wasted = prefetched and not in the trace (pages read but not written count as wasted here)."},
      {"siblings", n},
      {"tool_calls", calls},
      {"region_pages", pages},
      {"trace_pages_total", trace_pages},
      {"trace_pages_per_call", per_call},
      {"results", results},
  };
  std::ofstream(out_path) << doc.dump(2) << "\n";
  std::fprintf(stderr, "wrote %s\n", out_path.c_str());
  return 0;
}
