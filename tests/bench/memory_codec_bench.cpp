// Codec benchmark (issue 6, docs/memory-codecs.md): stored bytes as a
// fraction of raw for per-page LZ4 (zswap-like), per-page zstd, exact
// cross-sibling dedup (KSM-like) and this engine's codecs, over the page
// images of sibling processes forked from one template, plus encode and
// decode throughput per core.
//
// There is no usable KVM here, so the siblings are processes, not microVMs:
// one python3 process imports modules and builds data structures (the
// template), then forks N children that each do a little different work
// (their own seed) and block on stdin. Each child's private writable
// mappings (heap, anonymous, stack, rw file mappings) are read through
// /proc/PID/mem, resident pages only (/proc/PID/pagemap); the template
// page at the same address is the parent's. The output JSON says so in
// "source".
//
// Usage: memory_codec_bench [out.json] [siblings]   (default docs/bench/memory-codecs.json, 8)
#include <fcntl.h>
#include <lz4.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "wait-engine/memory/dictionary.h"
#include "wait-engine/memory/page_codec.h"

using json = nlohmann::json;
using namespace sg;
using namespace sg::memory;

namespace {

constexpr size_t kP = kCodecPageSize;

// The template workload. argv[1] = number of siblings. Prints
// "template PID" then one "sibling PID" per child, and every process then
// waits for EOF on stdin.
const char* kPython = R"py(
import os, sys, json, re, random, string, collections, decimal, fractions, datetime, textwrap
import email.parser, http.client, urllib.parse, xml.etree.ElementTree as ET, sqlite3, csv, io
import hashlib, base64, zlib, pickle, difflib, logging, dataclasses, typing, functools, itertools, argparse
n = int(sys.argv[1])
rng = random.Random(42)
vocab = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10))) for _ in range(5000)]
base = {f"key{i}": [i, " ".join(rng.choice(vocab) for _ in range(4)), {"v": i * 1.5, "tag": rng.choice(vocab)}]
        for i in range(60000)}
docs = [textwrap.fill(" ".join(rng.choice(vocab) for _ in range(200)), 80) for _ in range(300)]
patterns = [re.compile(r"\b%s\w*" % w) for w in vocab[:200]]
db = sqlite3.connect(":memory:")
db.execute("create table t (k text, v text)")
db.executemany("insert into t values (?, ?)", ((k, v[1]) for k, v in list(base.items())[:20000]))
tree = ET.fromstring("<r>" + "".join(f"<i n='{i}'>{vocab[i]}</i>" for i in range(3000)) + "</r>")
os.write(1, b"template %d\n" % os.getpid())
kids = []
for s in range(n):
    pid = os.fork()
    if pid == 0:
        r = random.Random(1000 + s)
        mine = {r.getrandbits(48): " ".join(r.choice(vocab) for _ in range(6)) for _ in range(15000)}
        for _ in range(20000):
            e = base[f"key{r.randrange(60000)}"]
            e[0] += 1
            e[2]["seen"] = r.random()
        out = json.dumps([base[f"key{r.randrange(60000)}"] for _ in range(3000)])
        hits = sum(1 for p in patterns[:50] for d in docs[:40] if p.search(d))
        rows = db.execute("select count(*) from t where v like ?", (r.choice(vocab)[:2] + "%",)).fetchall()
        words = sorted(r.sample(vocab, 2000))
        os.write(1, b"sibling %d\n" % os.getpid())  # one write: atomic on the pipe
        sys.stdin.read()
        os._exit(0)
    kids.append(pid)
sys.stdin.read()
for k in kids:
    os.waitpid(k, 0)
)py";

struct Mapping {
  uint64_t lo, hi;
  std::string perms, name;
};

std::vector<Mapping> read_maps(int pid) {
  std::vector<Mapping> out;
  std::ifstream f("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream ls(line);
    std::string range, perms, off, dev, inode, name;
    ls >> range >> perms >> off >> dev >> inode;
    std::getline(ls, name);
    name.erase(0, name.find_first_not_of(' '));
    Mapping m;
    m.lo = std::stoull(range.substr(0, range.find('-')), nullptr, 16);
    m.hi = std::stoull(range.substr(range.find('-') + 1), nullptr, 16);
    m.perms = perms;
    m.name = name;
    out.push_back(m);
  }
  return out;
}

// A process's resident private writable pages: address -> page.
struct Image {
  int pid = 0;
  std::vector<uint64_t> addr;
  std::string bytes;  // addr.size() pages
  std::unordered_map<uint64_t, size_t> index;
  const uint8_t* page(size_t i) const { return reinterpret_cast<const uint8_t*>(bytes.data()) + i * kP; }
  const uint8_t* at(uint64_t a) const {
    auto it = index.find(a);
    return it == index.end() ? nullptr : page(it->second);
  }
};

Image read_image(int pid, std::map<std::string, size_t>* by_mapping) {
  Image img;
  img.pid = pid;
  std::string p = "/proc/" + std::to_string(pid);
  int mem = ::open((p + "/mem").c_str(), O_RDONLY | O_CLOEXEC);
  int pm = ::open((p + "/pagemap").c_str(), O_RDONLY | O_CLOEXEC);
  if (mem < 0 || pm < 0) {
    std::fprintf(stderr, "cannot open %s/mem or pagemap: %s\n", p.c_str(), std::strerror(errno));
    std::exit(1);
  }
  for (const Mapping& m : read_maps(pid)) {
    // Private writable mappings: what a clone gets its own copy of.
    if (m.perms.size() < 4 || m.perms[0] != 'r' || m.perms[1] != 'w' || m.perms[3] != 'p') continue;
    if (m.name == "[vvar]" || m.name == "[vsyscall]" || m.name == "[vdso]") continue;
    std::string kind = m.name.empty() ? "anonymous" : m.name[0] == '[' ? m.name : "rw file mapping";
    for (uint64_t a = m.lo; a < m.hi; a += kP) {
      uint64_t ent = 0;
      if (::pread(pm, &ent, 8, static_cast<off_t>((a / kP) * 8)) != 8) continue;
      if (!(ent >> 63 & 1)) continue;  // not resident
      size_t at = img.bytes.size();
      img.bytes.resize(at + kP);
      if (::pread(mem, img.bytes.data() + at, kP, static_cast<off_t>(a)) != static_cast<ssize_t>(kP)) {
        img.bytes.resize(at);
        continue;
      }
      img.index[a] = img.addr.size();
      img.addr.push_back(a);
      if (by_mapping) (*by_mapping)[kind]++;
    }
  }
  ::close(mem);
  ::close(pm);
  return img;
}

double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct PageRef {
  const Image* img;
  size_t i;
  const uint8_t* data() const { return img->page(i); }
  const uint8_t* tmpl(const Image& t) const { return t.at(img->addr[i]); }
};

std::string read_first_line(const char* path, const char* key) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) {
      auto c = line.find_first_of(":=");
      std::string v = line.substr(c + 1);
      v.erase(0, v.find_first_not_of(" \""));
      while (!v.empty() && (v.back() == '"' || v.back() == ' ')) v.pop_back();
      return v;
    }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = argc > 1 ? argv[1] : "docs/bench/memory-codecs.json";
  int n = argc > 2 ? std::atoi(argv[2]) : 8;
  if (n < 3 || n > 64) {
    std::fprintf(stderr, "siblings must be 3..64\n");
    return 2;
  }

  // ---- the template and its siblings
  int in_pipe[2], out_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0 || pipe2(out_pipe, O_CLOEXEC) != 0) return 1;
  pid_t py = fork();
  if (py == 0) {
    dup2(in_pipe[0], 0);
    dup2(out_pipe[1], 1);
    std::string ns = std::to_string(n);
    execlp("python3", "python3", "-c", kPython, ns.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  FILE* from = fdopen(out_pipe[0], "r");
  int template_pid = 0;
  std::vector<int> sib_pids;
  char line[128];
  auto t0 = std::chrono::steady_clock::now();
  while (static_cast<int>(sib_pids.size()) < n && std::fgets(line, sizeof line, from)) {
    int pid = 0;
    if (std::sscanf(line, "template %d", &pid) == 1) template_pid = pid;
    if (std::sscanf(line, "sibling %d", &pid) == 1) sib_pids.push_back(pid);
  }
  double warm_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!template_pid || static_cast<int>(sib_pids.size()) != n) {
    std::fprintf(stderr, "the python template did not start its siblings\n");
    kill(py, SIGKILL);
    return 1;
  }
  std::sort(sib_pids.begin(), sib_pids.end());
  std::fprintf(stderr, "template pid %d, %d siblings ready after %.1f s; reading page images...\n", template_pid, n,
               warm_s);

  std::map<std::string, size_t> by_mapping;
  Image tmpl = read_image(template_pid, nullptr);
  std::vector<Image> sibs;
  for (int pid : sib_pids) sibs.push_back(read_image(pid, &by_mapping));
  ::close(in_pipe[1]);  // EOF: every process of the workload exits
  int st = 0;
  waitpid(py, &st, 0);
  fclose(from);

  std::vector<PageRef> pages;
  for (const Image& s : sibs)
    for (size_t i = 0; i < s.addr.size(); ++i) pages.push_back({&s, i});
  const uint64_t raw = pages.size() * kP;
  std::fprintf(stderr, "%zu sibling pages (%.1f MiB), template %zu pages\n", pages.size(), raw / 1048576.0,
               tmpl.addr.size());

  json methods = json::object();
  auto method = [&](const char* name, uint64_t stored, const char* what, json extra = json::object()) {
    extra["stored_bytes"] = stored;
    extra["fraction_of_raw"] = static_cast<double>(stored) / static_cast<double>(raw);
    extra["what"] = what;
    methods[name] = extra;
  };
  json throughput = json::object();
  auto tput = [&](const char* name, double enc_s, double dec_s) {
    throughput[name] = {{"encode_mb_s", raw / 1e6 / enc_s}, {"decode_mb_s", raw / 1e6 / dec_s}};
  };

  // ---- LZ4 per page (zswap with lz4: a page that does not shrink is stored whole)
  {
    std::vector<char> buf(LZ4_compressBound(kP));
    std::vector<std::string> recs(pages.size());
    uint64_t stored = 0;
    double c0 = cpu_now();
    for (size_t i = 0; i < pages.size(); ++i) {
      int r = LZ4_compress_default(reinterpret_cast<const char*>(pages[i].data()), buf.data(), kP,
                                   static_cast<int>(buf.size()));
      recs[i].assign(buf.data(), static_cast<size_t>(r));
      stored += std::min<uint64_t>(static_cast<uint64_t>(r), kP);
    }
    double c1 = cpu_now();
    std::vector<char> page(kP);
    for (auto& r : recs)
      if (LZ4_decompress_safe(r.data(), page.data(), static_cast<int>(r.size()), kP) != static_cast<int>(kP)) return 1;
    double c2 = cpu_now();
    method("lz4_per_page", stored, "LZ4_compress_default on every page, incompressible pages stored as 4096 bytes");
    tput("lz4_per_page", c1 - c0, c2 - c1);
  }
  // ---- zstd per page
  for (int level : {1, 3}) {
    ZSTD_CCtx* c = ZSTD_createCCtx();
    ZSTD_DCtx* d = ZSTD_createDCtx();
    std::vector<char> buf(ZSTD_compressBound(kP));
    std::vector<std::string> recs(pages.size());
    uint64_t stored = 0;
    double c0 = cpu_now();
    for (size_t i = 0; i < pages.size(); ++i) {
      size_t r = ZSTD_compressCCtx(c, buf.data(), buf.size(), pages[i].data(), kP, level);
      recs[i].assign(buf.data(), r);
      stored += std::min<uint64_t>(r, kP);
    }
    double c1 = cpu_now();
    std::vector<char> page(kP);
    for (auto& r : recs)
      if (ZSTD_decompressDCtx(d, page.data(), kP, r.data(), r.size()) != kP) return 1;
    double c2 = cpu_now();
    std::string name = "zstd" + std::to_string(level) + "_per_page";
    method(name.c_str(), stored, "ZSTD_compressCCtx (standard frame) on every page, incompressible pages as 4096");
    tput(name.c_str(), c1 - c0, c2 - c1);
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
  // ---- exact dedup (KSM-like): identical pages stored once, uncompressed;
  // a page identical to any template page costs nothing (KSM merges with
  // the template's resident copy).
  {
    std::unordered_set<std::string_view> seen;
    for (size_t i = 0; i < tmpl.addr.size(); ++i)
      seen.insert(std::string_view(reinterpret_cast<const char*>(tmpl.page(i)), kP));
    uint64_t stored = 0, unique = 0;
    std::unordered_set<std::string_view> sib_seen;
    uint64_t sib_unique = 0;
    for (const PageRef& p : pages) {
      std::string_view v(reinterpret_cast<const char*>(p.data()), kP);
      if (seen.insert(v).second) stored += kP, ++unique;
      if (sib_seen.insert(v).second) ++sib_unique;
    }
    method("ksm_like_dedup", stored,
           "exact page dedup across the siblings and the template's resident pages, pages stored uncompressed",
           {{"unique_pages", unique}, {"unique_across_siblings_only", sib_unique},
            {"fraction_siblings_only", static_cast<double>(sib_unique * kP) / static_cast<double>(raw)}});
  }

  // ---- this engine: template page at the same address, cohort dictionary
  // trained on siblings 0 and 1 (held-out split inside), all siblings encoded.
  TrainOptions topt;
  topt.level = 3;
  topt.max_samples = 2000;
  std::vector<const uint8_t*> train_pages;
  {
    CodecContext cc;
    std::string rec;
    for (const PageRef& p : pages) {
      if (p.img != &sibs[0] && p.img != &sibs[1]) continue;
      rec.clear();
      EncodeResult r = encode_page(cc, p.data(), EncodeOptions{p.tmpl(tmpl), nullptr, 3}, rec);
      // The pages a dictionary can help: those the template does not cover
      // (neither template-same nor zero, and no delta beats full-page zstd).
      if (r.kind == PageKind::kZstd || r.kind == PageKind::kRaw) train_pages.push_back(p.data());
    }
  }
  TrainReport rep;
  double tr0 = cpu_now();
  Result<std::optional<Dictionary>> trained = train_dictionary(train_pages, "bench", topt, &rep);
  double train_s = cpu_now() - tr0;
  if (!trained) {
    std::fprintf(stderr, "training: %s\n", trained.error().message().c_str());
    return 1;
  }
  // The same training with the publishing bar removed, to show what the
  // dictionary would have done had it been published.
  TrainOptions forced_opt = topt;
  forced_opt.min_saving = -1e9;
  TrainReport forced_rep;
  Result<std::optional<Dictionary>> forced_t = train_dictionary(train_pages, "bench", forced_opt, &forced_rep);
  std::optional<Dictionary> forced;
  if (forced_t && *forced_t) {
    Result<Dictionary> d = Dictionary::prepare(2, "bench", (**forced_t).bytes(), topt.level);
    if (d) forced = *d;
  }
  std::optional<Dictionary> dict;
  if (*trained) {
    Result<Dictionary> d = Dictionary::prepare(1, "bench", (**trained).bytes(), topt.level);
    if (d) dict = *d;
  }
  json dict_json = {{"trained_on", "siblings 0 and 1: pages the template does not cover (chosen kind without a dictionary is zstd or raw)"},
                    {"candidate_pages", train_pages.size()},
                    {"train_pages", rep.train_pages},
                    {"held_out_pages", rep.eval_pages},
                    {"held_out_saved_vs_plain_zstd", rep.saved},
                    {"published", rep.published},
                    {"reason", rep.reason},
                    {"bytes", dict ? dict->bytes().size() : 0},
                    {"train_cpu_s", train_s}};

  struct EngineRun {
    uint64_t stored = 0, stored_heldout = 0, raw_heldout = 0;
    std::map<std::string, uint64_t> kinds, kind_bytes;
    double enc_s = 0, dec_s = 0;
  };
  auto run_engine = [&](bool use_template, bool use_dict, bool time_it, const std::optional<Dictionary>* which = nullptr) {
    EngineRun er;
    CodecContext cc;
    std::vector<std::string> recs(pages.size());
    const std::optional<Dictionary>& dsel = which ? *which : dict;
    const Dictionary* dp = use_dict && dsel ? &*dsel : nullptr;
    double c0 = cpu_now();
    for (size_t i = 0; i < pages.size(); ++i) {
      recs[i].reserve(64);
      encode_page(cc, pages[i].data(), EncodeOptions{use_template ? pages[i].tmpl(tmpl) : nullptr, dp, 3}, recs[i]);
    }
    double c1 = cpu_now();
    std::vector<uint8_t> page(kP);
    for (size_t i = 0; i < pages.size(); ++i) {
      Status s = decode_page(cc, recs[i], use_template ? pages[i].tmpl(tmpl) : nullptr, dp, page.data());
      if (!s.ok()) {
        std::fprintf(stderr, "decode: %s\n", s.error().message().c_str());
        std::exit(1);
      }
    }
    double c2 = cpu_now();
    for (size_t i = 0; i < pages.size(); ++i) {
      std::vector<uint8_t> check(kP);
      (void)decode_page(cc, recs[i], use_template ? pages[i].tmpl(tmpl) : nullptr, dp, check.data());
      if (std::memcmp(check.data(), pages[i].data(), kP) != 0) {
        std::fprintf(stderr, "page %zu did not round-trip\n", i);
        std::exit(1);
      }
      const std::string k = page_kind_name(static_cast<PageKind>(record_kind(recs[i])));
      er.kinds[k]++;
      er.kind_bytes[k] += recs[i].size();
      er.stored += recs[i].size();
      if (pages[i].img != &sibs[0] && pages[i].img != &sibs[1]) {
        er.stored_heldout += recs[i].size();
        er.raw_heldout += kP;
      }
    }
    if (dp) {
      er.stored += dp->bytes().size();  // the cohort's dictionary, once
      er.stored_heldout += dp->bytes().size();
    }
    if (time_it) er.enc_s = c1 - c0, er.dec_s = c2 - c1;
    return er;
  };
  EngineRun full = run_engine(true, true, true);
  EngineRun tmpl_only = run_engine(true, false, false);
  EngineRun dict_only = run_engine(false, true, false);
  json kinds = json::object();
  for (auto& [k, c] : full.kinds) kinds[k] = {{"pages", c}, {"bytes", full.kind_bytes[k]}};
  method("engine", full.stored,
         "this engine: template-same, zero, runs, template delta, zstd-3 with the cohort dictionary, zstd-3, raw; "
         "smallest per page; dictionary bytes counted once",
         {{"kinds", kinds},
          {"dictionary", dict_json},
          {"held_out_siblings_fraction",
           static_cast<double>(full.stored_heldout) / static_cast<double>(full.raw_heldout)}});
  method("engine_template_only", tmpl_only.stored, "this engine without a dictionary");
  if (forced) {
    EngineRun f = run_engine(true, true, false, &forced);
    method("engine_forced_dictionary", f.stored,
           "this engine with the dictionary published regardless of the held-out check (dictionary bytes counted)",
           {{"held_out_saved_vs_plain_zstd", forced_rep.saved}, {"dictionary_bytes", forced->bytes().size()},
            {"zstd_dict_pages", f.kinds["zstd_dict"]}});
  }
  method("engine_dictionary_only", dict_only.stored, "this engine without the template (the dictionary if published, zstd, zero, runs, raw)");
  tput("engine", full.enc_s, full.dec_s);

  double lz4_frac = methods["lz4_per_page"]["fraction_of_raw"];
  double eng_frac = methods["engine"]["fraction_of_raw"];
  json out = {
      {"benchmark", "memory page codecs (issue 6)"},
      {"source",
       "sibling processes, not microVMs (no usable KVM on this host): one python3 template process (imports ~30 "
       "stdlib modules, builds a 60k-entry dict, text, regexes, sqlite and XML) forks " +
           std::to_string(n) +
           " siblings that each do different work (own seed) and block on stdin; each sibling's resident pages of "
           "its private writable mappings (heap, anonymous, stack, rw file mappings) read through /proc/PID/mem, "
           "the template page being the parent's page at the same address"},
      {"machine", {{"cpu", read_first_line("/proc/cpuinfo", "model name")},
                   {"cores", sysconf(_SC_NPROCESSORS_ONLN)},
                   {"os", read_first_line("/etc/os-release", "PRETTY_NAME")}}},
      {"siblings", n},
      {"pages", pages.size()},
      {"raw_bytes", raw},
      {"template_pages", tmpl.addr.size()},
      {"pages_by_mapping", by_mapping},
      {"methods", methods},
      {"throughput_per_core", throughput},
      {"throughput_note", "single thread, CPU time (CLOCK_THREAD_CPUTIME_ID), MB = 1e6 bytes of raw pages; engine "
                          "decode includes the page CRC check"},
      {"aim", {{"engine_vs_lz4", eng_frac / lz4_frac}, {"target", "<= 1/3"}, {"met", eng_frac * 3 <= lz4_frac}}},
  };
  std::ofstream(out_path) << out.dump(2) << "\n";

  std::printf("%zu pages of %d sibling processes (%.1f MiB raw), template %zu pages\n", pages.size(), n,
              raw / 1048576.0, tmpl.addr.size());
  std::printf("%-24s %12s %10s\n", "method", "stored", "of raw");
  for (auto& [k, v] : methods.items())
    std::printf("%-24s %12llu %9.2f%%\n", k.c_str(), static_cast<unsigned long long>(v["stored_bytes"].get<uint64_t>()),
                100 * v["fraction_of_raw"].get<double>());
  std::printf("%-24s %12s %12s\n", "throughput (1 core)", "encode MB/s", "decode MB/s");
  for (auto& [k, v] : throughput.items())
    std::printf("%-24s %12.0f %12.0f\n", k.c_str(), v["encode_mb_s"].get<double>(), v["decode_mb_s"].get<double>());
  std::printf("engine kinds:");
  for (auto& [k, c] : full.kinds) std::printf(" %s=%llu", k.c_str(), static_cast<unsigned long long>(c));
  std::printf("\ndictionary: %s (held-out saving %.1f%%, %zu bytes)\n", rep.published ? "published" : "not published",
              rep.saved * 100, dict ? dict->bytes().size() : 0);
  std::printf("engine / lz4 = %.3f (aim <= 0.333): %s\nwrote %s\n", eng_frac / lz4_frac,
              eng_frac * 3 <= lz4_frac ? "met" : "NOT met", out_path.c_str());
  return 0;
}
