// Offload to swap for process sandboxes (swap.h).
#include "sandbox-runtime/process/swap.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/swap.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <sstream>

#include "base/fd.h"
#include "base/log.h"
#include "base/sys.h"

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

namespace sg::process {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kPresent = 1ull << 63;
constexpr uint64_t kSwapped = 1ull << 62;
// Advice goes in pieces of at most this much, so a cancel is seen soon.
constexpr uint64_t kAdvisePages = (64ull << 20) / kPage;
// pagemap is read in pieces of this many entries.
constexpr uint64_t kPagemapChunk = 32768;
// A process's mappings file is bounded (a hostile sandbox can make many).
constexpr size_t kMapsLimit = 64u << 20;
// So is the address space one page-out scans (a sandbox can map terabytes
// of writable memory it never touches): 128 GiB.
constexpr uint64_t kScanLimitPages = (128ull << 30) / kPage;

std::string zram_dir(int n) { return "/sys/block/zram" + std::to_string(n); }

Result<std::string> read_trimmed(const std::string& path) {
  Result<std::string> s = sys::read_file(path, 1 << 16);
  if (!s) return s;
  while (!s->empty() && (s->back() == '\n' || s->back() == ' ')) s->pop_back();
  return s;
}

Result<uint64_t> mem_total_bytes() {
  Result<std::string> m = sys::read_file("/proc/meminfo");
  if (!m) return m.error();
  std::istringstream in(*m);
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemTotal:") return kb * 1024;
  return Error(ErrorKind::kInternal, "/proc/meminfo has no MemTotal");
}

// The compressor offered that stores least: zstd, then the kernel's
// default lzo-rle, then what else there is.
std::string best_compressor(const std::string& offered) {
  std::vector<std::string> names;
  std::istringstream in(offered);
  for (std::string w; in >> w;) {
    if (w.size() > 2 && w.front() == '[' && w.back() == ']') w = w.substr(1, w.size() - 2);
    names.push_back(w);
  }
  for (const char* want : {"zstd", "lzo-rle", "lz4hc", "lzo", "lz4"})
    if (std::find(names.begin(), names.end(), want) != names.end()) return want;
  return names.empty() ? std::string() : names.front();
}

// The swap header mkswap writes (version 1, no bad pages) for a device of
// `pages` pages: the kernel reads it at swapon.
std::string swap_header(uint64_t pages) {
  std::string h(kPage, '\0');
  uint32_t version = 1, last_page = static_cast<uint32_t>(pages - 1);
  std::memcpy(&h[1024], &version, 4);
  std::memcpy(&h[1028], &last_page, 4);
  std::string uuid = sys::random_hex(8);  // 16 bytes of label-free id
  std::memcpy(&h[1036], uuid.data(), 16);
  std::memcpy(&h[kPage - 10], "SWAPSPACE2", 10);
  return h;
}

// Removes a zram device this instance made before (the record names it).
void remove_zram(int n, const std::string& node) {
  if (!node.empty() && ::swapoff(node.c_str()) != 0 && errno != EINVAL)
    LOG_WARN("swapoff " << node << ": " << std::strerror(errno));
  if (Status s = sys::write_file(zram_dir(n) + "/reset", "1"); !s) LOG_WARN("zram" << n << " reset: " << s.error().message());
  if (Status s = sys::write_file("/sys/class/zram-control/hot_remove", std::to_string(n)); !s)
    LOG_WARN("zram" << n << " remove: " << s.error().message());
}

void remove_recorded(const std::string& record) {
  Result<std::string> r = read_trimmed(record);
  if (!r) return;
  int n = -1;
  try {
    n = std::stoi(*r);
  } catch (...) {
  }
  if (n >= 0 && sys::path_exists(zram_dir(n))) {
    LOG_INFO("removing zram" << n << ", left by a previous run");
    remove_zram(n, "/dev/zram" + std::to_string(n));
  }
  ::unlink(record.c_str());
}

// The block device node for zram n: /dev/zramN (devtmpfs), else one made
// beside the record.
Result<std::string> zram_node(int n, const std::string& record) {
  std::string dev = "/dev/zram" + std::to_string(n);
  struct stat st{};
  if (::stat(dev.c_str(), &st) == 0 && S_ISBLK(st.st_mode)) return dev;
  Result<std::string> mm = read_trimmed(zram_dir(n) + "/dev");
  if (!mm) return mm.error();
  unsigned ma = 0, mi = 0;
  if (std::sscanf(mm->c_str(), "%u:%u", &ma, &mi) != 2) return Error(ErrorKind::kInternal, "zram" + std::to_string(n) + "/dev: " + *mm);
  std::string node = record + ".dev";
  ::unlink(node.c_str());
  if (::mknod(node.c_str(), S_IFBLK | 0600, makedev(ma, mi)) != 0) return sys::errno_error("mknod", node);
  return node;
}

int pidfd_open(int pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

ssize_t process_madvise(int pidfd, const iovec* iov, size_t n, int advice) {
  return ::syscall(SYS_process_madvise, pidfd, iov, n, advice, 0u);
}

struct Mapping {
  uint64_t start = 0, end = 0;
  std::string name;    // as /proc/PID/maps names it ("" for an anonymous mapping)
  uint32_t index = 0;  // mappings of that name before this one
};

// The private, writable, anonymous mappings of pid (heap, stacks, anonymous
// mmaps): where a sandbox's own data lives. File pages are left to the
// page cache.
Result<std::vector<Mapping>> anonymous_mappings(int pid) {
  std::string path = "/proc/" + std::to_string(pid) + "/maps";
  Result<std::string> maps = sys::read_file(path, kMapsLimit);
  if (!maps) return maps.error();
  std::vector<Mapping> out;
  std::map<std::string, uint32_t> seen;
  std::istringstream in(*maps);
  for (std::string line; std::getline(in, line);) {
    unsigned long long a = 0, b = 0, inode = 0;
    char perms[8] = {};
    int consumed = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx %7s %*s %*s %llu %n", &a, &b, perms, &inode, &consumed) < 4) continue;
    if (perms[1] != 'w' || perms[3] != 'p' || inode != 0) continue;
    std::string name = line.substr(std::min<size_t>(static_cast<size_t>(consumed), line.size()));
    if (name == "[vvar]" || name == "[vdso]" || name == "[vsyscall]" || name == "[vvar_vclock]") continue;
    if (b <= a || a % kPage || b % kPage) continue;
    uint32_t& index = seen[name];
    out.push_back({a, b, name, index++});
  }
  return out;
}

// Present and swapped pages of [start, end) in pid's pagemap; runs of
// present pages appended to hot.
struct PageCount {
  uint64_t present = 0, swapped = 0;
};
Result<PageCount> count_pages(int pagemap, const Mapping& m, std::vector<PageRange>* hot,
                              const std::atomic<bool>& cancel, uint64_t& budget) {
  PageCount c;
  uint64_t span = (m.end - m.start) / kPage;
  if (span > budget)
    return Error(ErrorKind::kQuota, "the sandbox maps more writable memory than an offload scans (128 GiB)");
  budget -= span;
  std::vector<uint64_t> buf(kPagemapChunk);
  uint64_t first = m.start / kPage, last = m.end / kPage;
  PageRange run;
  for (uint64_t at = first; at < last;) {
    if (cancel.load()) return Error(ErrorKind::kConflict, "cancelled");
    uint64_t n = std::min<uint64_t>(kPagemapChunk, last - at);
    ssize_t r = ::pread(pagemap, buf.data(), n * 8, static_cast<off_t>(at * 8));
    if (r < 0) {
      if (errno == EINTR) continue;
      return sys::errno_error("read", "pagemap");
    }
    if (r == 0) break;  // the process is gone
    uint64_t got = static_cast<uint64_t>(r) / 8;
    for (uint64_t i = 0; i < got; ++i) {
      uint64_t e = buf[i];
      if (e & kPresent) {
        ++c.present;
        if (hot) {
          if (run.pages && run.start + run.pages * kPage == (at + i) * kPage) {
            ++run.pages;
          } else {
            if (run.pages) hot->push_back(run);
            run = {(at + i) * kPage, 1};
          }
        }
      } else if (e & kSwapped) {
        ++c.swapped;
      }
    }
    at += got;
  }
  if (hot && run.pages) hot->push_back(run);
  return c;
}

// The pages of r now in swap (not present, swapped), one bit each.
Result<std::vector<bool>> in_swap(int pagemap, const PageRange& r) {
  std::vector<bool> bits(r.pages);
  std::vector<uint64_t> buf(std::min<uint64_t>(kPagemapChunk, r.pages));
  uint64_t first = r.start / kPage;
  for (uint64_t at = 0; at < r.pages;) {
    uint64_t n = std::min<uint64_t>(kPagemapChunk, r.pages - at);
    ssize_t got = ::pread(pagemap, buf.data(), n * 8, static_cast<off_t>((first + at) * 8));
    if (got < 0) {
      if (errno == EINTR) continue;
      return sys::errno_error("read", "pagemap");
    }
    if (got == 0) break;  // the process is gone
    uint64_t m = static_cast<uint64_t>(got) / 8;
    for (uint64_t i = 0; i < m; ++i) bits[at + i] = !(buf[i] & kPresent) && (buf[i] & kSwapped);
    at += m;
  }
  return bits;
}

// The runs of the pages of ranges that are in swap and not mapped (of a
// read-back: not touched since it).
Result<std::vector<PageRange>> swapped_runs(int pagemap, const std::vector<PageRange>& ranges) {
  std::vector<PageRange> out;
  for (const PageRange& r : ranges) {
    Result<std::vector<bool>> bits = in_swap(pagemap, r);
    if (!bits) return bits.error();
    for (uint64_t i = 0; i < bits->size(); ++i) {
      if (!(*bits)[i]) continue;
      uint64_t at = r.start + i * kPage;
      if (!out.empty() && out.back().start + out.back().pages * kPage == at)
        ++out.back().pages;
      else
        out.push_back({at, 1});
    }
  }
  return out;
}

// Reads runs of pid's memory (and drops what it read), so that each page
// is mapped again: a page in the swap cache by a minor fault, one only in
// swap by reading it back. A run unmapped since is skipped.
Status map_again(int pid, const std::vector<PageRange>& runs, const std::atomic<bool>& cancel) {
  constexpr uint64_t kBatch = 64;  // pages per call
  std::vector<char> buf(kBatch * kPage);
  for (const PageRange& r : runs) {
    for (uint64_t done = 0; done < r.pages;) {
      if (cancel.load()) return Error(ErrorKind::kConflict, "cancelled");
      uint64_t n = std::min(kBatch, r.pages - done);
      iovec local{buf.data(), n * kPage};
      iovec remote{reinterpret_cast<void*>(r.start + done * kPage), n * kPage};
      ssize_t got = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EFAULT || errno == ENOMEM) break;  // unmapped since: the rest of the run too
        if (errno == ESRCH) return Status::Ok();        // gone
        return sys::errno_error("process_vm_readv", std::to_string(pid));
      }
      if (got == 0) break;
      done += (static_cast<uint64_t>(got) + kPage - 1) / kPage;
    }
  }
  return Status::Ok();
}

// The name of pid (its comm), for the observer's process key.
std::string comm_of(int pid) {
  Result<std::string> c = read_trimmed("/proc/" + std::to_string(pid) + "/comm");
  return c ? *c : std::string("?");
}

// process_madvise over [start, start + pages) in pieces; ESRCH: gone.
Status advise(int pidfd, uint64_t start, uint64_t pages, int advice, const std::atomic<bool>* cancel) {
  for (uint64_t done = 0; done < pages;) {
    if (cancel && cancel->load()) return Error(ErrorKind::kConflict, "cancelled");
    uint64_t n = std::min<uint64_t>(kAdvisePages, pages - done);
    iovec v{reinterpret_cast<void*>(start + done * kPage), n * kPage};
    if (process_madvise(pidfd, &v, 1, advice) < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      // A range unmapped since the maps were read: skip it.
      if (errno == ENOMEM || errno == EFAULT) return Status::Ok();
      return sys::errno_error("process_madvise", advice == MADV_PAGEOUT ? "MADV_PAGEOUT" : "MADV_WILLNEED");
    }
    done += n;
  }
  return Status::Ok();
}

// MADV_PAGEOUT over runs of one process; a process gone meanwhile is done.
Status advise_out(int pidfd, int pid, const std::vector<PageRange>& runs, const std::atomic<bool>& cancel) {
  for (const PageRange& r : runs) {
    if (Status s = advise(pidfd, r.start, r.pages, MADV_PAGEOUT, &cancel); !s) {
      if (s.error().kind() == ErrorKind::kConflict) return s.error();
      if (::syscall(SYS_pidfd_send_signal, pidfd, 0, nullptr, 0) != 0) return Status::Ok();  // gone
      return s.error().with_context("page out process " + std::to_string(pid));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<SwapDevice>> SwapDevice::open(const SwapConfig& cfg) {
  std::unique_ptr<SwapDevice> d(new SwapDevice());
  if (cfg.mode == "host") {
    Result<std::string> swaps = sys::read_file(cfg.proc_swaps);
    if (!swaps) return swaps.error();
    std::istringstream in(*swaps);
    std::string line, names;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream l(line);
      std::string name;
      if (l >> name) names += (names.empty() ? "" : ", ") + name;
    }
    if (names.empty()) return Error(ErrorKind::kUnavailable, "the host has no active swap (" + cfg.proc_swaps + " is empty)");
    d->describe_ = "host swap (" + names + ")";
    d->proc_swaps_ = cfg.proc_swaps;
    return d;
  }
  if (cfg.mode != "zram") return Error(ErrorKind::kInvalid, "swap mode " + cfg.mode + ": want zram or host");
  if (cfg.record.empty()) return Error(ErrorKind::kInvalid, "zram swap needs a record file");
  remove_recorded(cfg.record);
  if (!sys::path_exists("/sys/class/zram-control/hot_add"))
    return Error(ErrorKind::kUnavailable, "this kernel has no zram (no /sys/class/zram-control; load the zram module)");
  // Reading hot_add makes a device even where sysfs is read-only (a
  // container's, unless it is privileged), and then nothing could set it up
  // or remove it again: each start would leave a device on the host.
  if (::access("/sys/class/zram-control/hot_remove", W_OK) != 0)
    return Error(ErrorKind::kUnavailable, std::string("cannot make a zram device: /sys/class/zram-control is not writable here (") +
                                              std::strerror(errno) +
                                              "; a container's /sys is read-only unless it is privileged); "
                                              "--process-swap host uses the host's swap");
  uint64_t bytes = cfg.zram_bytes;
  if (bytes == 0) {
    Result<uint64_t> total = mem_total_bytes();
    if (!total) return total.error();
    bytes = *total / 2;
  }
  bytes = bytes / kPage * kPage;
  if (bytes < 16 * kPage) return Error(ErrorKind::kInvalid, "zram size too small");
  Result<std::string> added = read_trimmed("/sys/class/zram-control/hot_add");
  if (!added) return Error(ErrorKind::kUnavailable, "zram hot_add: " + added.error().message());
  int n = -1;
  try {
    n = std::stoi(*added);
  } catch (...) {
    return Error(ErrorKind::kInternal, "zram hot_add answered " + *added);
  }
  // From here on, a failure removes the device again.
  struct Undo {
    int n;
    std::string node;
    std::string record;
    bool armed = true;
    ~Undo() {
      if (!armed) return;
      remove_zram(n, node);
      ::unlink(record.c_str());
    }
  } undo{n, "", cfg.record};
  if (Status s = sys::write_file_atomic(cfg.record, std::to_string(n) + "\n"); !s) return s.error();
  Result<std::string> offered = read_trimmed(zram_dir(n) + "/comp_algorithm");
  if (!offered) return offered.error();
  std::string comp = best_compressor(*offered);
  if (!comp.empty())
    if (Status s = sys::write_file(zram_dir(n) + "/comp_algorithm", comp); !s) return s.error();
  if (Status s = sys::write_file(zram_dir(n) + "/disksize", std::to_string(bytes)); !s) return s.error();
  Result<std::string> node = zram_node(n, cfg.record);
  if (!node) return node.error();
  {
    UniqueFd fd(::open(node->c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd) return sys::errno_error("open", *node);
    std::string h = swap_header(bytes / kPage);
    if (::pwrite(fd.get(), h.data(), h.size(), 0) != static_cast<ssize_t>(h.size())) return sys::errno_error("write the swap header", *node);
    if (::fsync(fd.get()) != 0) return sys::errno_error("fsync", *node);
  }
  int prio = std::clamp(cfg.priority, 0, 32767);
  if (::swapon(node->c_str(), SWAP_FLAG_PREFER | ((prio << SWAP_FLAG_PRIO_SHIFT) & SWAP_FLAG_PRIO_MASK)) != 0) {
    int e = errno;
    return Error(e == EPERM ? ErrorKind::kUnavailable : ErrorKind::kInternal,
                 "swapon " + *node + ": " + std::strerror(e));
  }
  undo.node = *node;
  undo.armed = false;
  d->zram_ = n;
  d->node_ = *node;
  d->record_ = cfg.record;
  d->describe_ = "zram" + std::to_string(n) + " (" + (comp.empty() ? "default compressor" : comp) + ", " +
                 std::to_string(bytes >> 20) + " MiB, priority " + std::to_string(prio) + ")";
  return d;
}

SwapDevice::~SwapDevice() {
  if (zram_ < 0) return;
  remove_zram(zram_, node_);
  if (node_ != "/dev/zram" + std::to_string(zram_)) ::unlink(node_.c_str());
  ::unlink(record_.c_str());
}

Result<SwapStats> SwapDevice::stats() const {
  SwapStats s;
  if (zram_ >= 0) {
    // mm_stat: orig_data_size compr_data_size mem_used_total ...
    Result<std::string> mm = read_trimmed(zram_dir(zram_) + "/mm_stat");
    if (!mm) return mm.error();
    std::istringstream in(*mm);
    // ... mem_limit mem_used_max same_pages pages_compacted ...
    uint64_t limit = 0, max_used = 0, same = 0;
    in >> s.used_bytes >> s.stored_bytes >> s.memory_bytes >> limit >> max_used >> same >> s.compacted_pages;
    return s;
  }
  Result<std::string> swaps = sys::read_file(proc_swaps_);
  if (!swaps) return swaps.error();
  std::istringstream in(*swaps);
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::istringstream l(line);
    std::string name, type;
    uint64_t size = 0, used = 0;
    if (l >> name >> type >> size >> used) s.used_bytes += used * 1024;
  }
  s.stored_bytes = s.used_bytes;
  return s;
}

Result<bool> SwapDevice::compact(uint64_t min_waste) const {
  if (zram_ < 0) return false;
  if (compacting_.exchange(true)) return false;
  struct Done {
    std::atomic<bool>& f;
    ~Done() { f.store(false); }
  } done{compacting_};
  Result<SwapStats> st = stats();
  if (!st) return st.error();
  uint64_t waste = st->memory_bytes > st->stored_bytes ? st->memory_bytes - st->stored_bytes : 0;
  if (waste < min_waste || waste < st->memory_bytes / 8) return false;
  if (Status s = sys::write_file(zram_dir(zram_) + "/compact", "1"); !s) return s.error();
  return true;
}

Result<PageOutResult> page_out(const std::vector<int>& pids, const std::atomic<bool>& cancel,
                               runtime::SwapObserver* observer, const std::vector<ProcessPages>* read_back) {
  PageOutResult out;
  uint64_t budget = kScanLimitPages;
  std::map<std::string, uint32_t> names;  // the observer's process ordinals
  for (int pid : pids) {
    if (cancel.load()) return Error(ErrorKind::kConflict, "cancelled");
    UniqueFd pidfd(pidfd_open(pid));
    if (!pidfd) {
      if (errno == ESRCH) continue;
      return sys::errno_error("pidfd_open", std::to_string(pid));
    }
    Result<std::vector<Mapping>> maps = anonymous_mappings(pid);
    if (!maps) {
      if (!sys::path_exists("/proc/" + std::to_string(pid))) continue;  // gone
      return maps.error();
    }
    std::string pm_path = "/proc/" + std::to_string(pid) + "/pagemap";
    UniqueFd pagemap(::open(pm_path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!pagemap) {
      if (errno == ENOENT || errno == ESRCH) continue;
      return sys::errno_error("open", pm_path);
    }
    ProcessPages hot{pid, {}};
    std::vector<runtime::SwapRun> runs;
    for (const Mapping& m : *maps) {
      size_t first_run = hot.ranges.size();
      Result<PageCount> c = count_pages(pagemap.get(), m, &hot.ranges, cancel, budget);
      if (!c) return c.error();
      out.resident_pages += c->present;
      if (observer)
        for (size_t i = first_run; i < hot.ranges.size(); ++i)
          runs.push_back({hot.ranges[i].start, hot.ranges[i].pages, m.name, m.index, hot.ranges[i].start - m.start});
    }
    if (observer) {
      std::string name = comm_of(pid);
      observer->before(pid, name + "#" + std::to_string(names[name]++), runs);
    }
    // What the last read-back brought into the swap cache and the sandbox
    // did not touch: found before the hot runs go out (then they are in
    // swap too), and mapped again so that the advice reaches it.
    std::vector<PageRange> unused;
    if (read_back) {
      auto rb = std::find_if(read_back->begin(), read_back->end(), [&](const ProcessPages& p) { return p.pid == pid; });
      if (rb != read_back->end()) {
        Result<std::vector<PageRange>> runs = swapped_runs(pagemap.get(), rb->ranges);
        if (!runs) return runs.error();
        unused = std::move(*runs);
        for (const PageRange& r : unused) out.unused_pages += r.pages;
        if (Status s = map_again(pid, unused, cancel); !s) return s.error();
      }
    }
    // Only what is resident needs advice (the hot runs, and those).
    if (Status st = advise_out(pidfd.get(), pid, unused, cancel); !st) return st.error();
    if (Status st = advise_out(pidfd.get(), pid, hot.ranges, cancel); !st) return st.error();
    // What went out: the hot runs now in swap.
    std::vector<std::vector<bool>> gone;
    for (const PageRange& r : hot.ranges) {
      Result<std::vector<bool>> bits = in_swap(pagemap.get(), r);
      if (!bits) return bits.error();
      out.out_pages += static_cast<uint64_t>(std::count(bits->begin(), bits->end(), true));
      if (observer) gone.push_back(std::move(*bits));
    }
    if (observer) observer->after(pid, gone);
    if (!hot.ranges.empty()) out.hot.push_back(std::move(hot));
  }
  return out;
}

std::vector<ProcessPages> overlap(const std::vector<ProcessPages>& a, const std::vector<ProcessPages>& b) {
  std::vector<ProcessPages> out;
  for (const ProcessPages& pa : a) {
    auto pb = std::find_if(b.begin(), b.end(), [&](const ProcessPages& x) { return x.pid == pa.pid; });
    if (pb == b.end()) continue;
    ProcessPages both{pa.pid, {}};
    size_t i = 0, j = 0;
    while (i < pa.ranges.size() && j < pb->ranges.size()) {
      const PageRange& x = pa.ranges[i];
      const PageRange& y = pb->ranges[j];
      uint64_t x_end = x.start + x.pages * kPage, y_end = y.start + y.pages * kPage;
      uint64_t lo = std::max(x.start, y.start), hi = std::min(x_end, y_end);
      if (lo < hi) both.ranges.push_back({lo, (hi - lo) / kPage});
      if (x_end <= y_end) ++i;
      if (y_end <= x_end) ++j;
    }
    if (!both.ranges.empty()) out.push_back(std::move(both));
  }
  return out;
}

uint64_t page_count(const std::vector<ProcessPages>& p) {
  uint64_t n = 0;
  for (const ProcessPages& x : p)
    for (const PageRange& r : x.ranges) n += r.pages;
  return n;
}

Result<uint64_t> page_in(const std::vector<ProcessPages>& hot) {
  uint64_t asked = 0;
  for (const ProcessPages& p : hot) {
    UniqueFd pidfd(pidfd_open(p.pid));
    if (!pidfd) {
      if (errno == ESRCH) continue;
      return sys::errno_error("pidfd_open", std::to_string(p.pid));
    }
    for (const PageRange& r : p.ranges) {
      if (Status s = advise(pidfd.get(), r.start, r.pages, MADV_WILLNEED, nullptr); !s) {
        if (::syscall(SYS_pidfd_send_signal, pidfd.get(), 0, nullptr, 0) != 0) break;
        return s.error().with_context("page in process " + std::to_string(p.pid));
      }
      asked += r.pages;
    }
  }
  return asked;
}

}  // namespace sg::process
