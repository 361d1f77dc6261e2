// FakeRuntime: a runtime::Runtime whose sandboxes are records in memory.
//
// No fork, no root, no rootfs: the lifecycle core (api-e2b/sandboxes.h) and
// whatever is built on it can be driven by tests in milliseconds. Every call
// a sandbox receives is counted per operation, and a fault plan makes the
// Nth call of an operation fail (Beast's fail_count, LevelDB's fault
// injection env): fail_at(Op::kPause, 1) fails the next pause. A test then
// checks that nothing leaked: leaked() names every sandbox this runtime
// started that is neither killed nor still held by the code under test.
//
// Thread-safe: one mutex over all records (tests are not benchmarks).
#pragma once

#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdio>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "base/fd.h"
#include "base/status.h"
#include "sandbox-runtime/runtime.h"

namespace sg::test {

class FakeRuntime : public runtime::Runtime {
 public:
  enum class Op { kCreate, kPause, kResume, kKill, kUsage, kOpenPort, kControl, kExport, kCount };

  struct Record {
    runtime::SandboxSpec spec;
    int pid = 0;
    bool paused = false;
    bool killed = false;
    bool dead = false;  // its PID 1 exited (set_dead)
    int pauses = 0, resumes = 0, kills = 0, recovers = 0;
    std::vector<std::string> configures;  // "configure" control messages, in order
  };

  explicit FakeRuntime(std::string name = "process") : shared_(std::make_shared<Shared>()), name_(std::move(name)) {}

  std::string name() const override { return name_; }
  bool outlive_ = false;

  Result<std::unique_ptr<runtime::Sandbox>> create(const runtime::SandboxSpec& spec) override {
    std::lock_guard<std::mutex> g(shared_->mu);
    if (Status s = shared_->call(Op::kCreate, spec.id); !s) return s.error();  // nothing started
    // A new record, also for an id used before (a sandbox started again
    // from its files after a filesystem-only pause).
    Record& r = shared_->records[spec.id];
    r = Record{};
    r.spec = spec;
    r.pid = 1000 + ++shared_->started;
    return std::unique_ptr<runtime::Sandbox>(new FakeSandbox(shared_, spec.id));
  }

  Status cleanup_stale() override { return cleanup_stale_except({}); }
  // As the process backend with --keep-sandboxes on: sandboxes whose
  // handles are gone (a stopped service) can be taken back by recover()
  // while their record is neither killed nor dead.
  bool sandboxes_outlive_host() const override { return outlive_; }
  bool exports_layers() const override { return true; }
  void set_outlive(bool v) { outlive_ = v; }
  // As the kvm runtime: a layer it exports keeps the memory, so every
  // pause goes to disk.
  // Its layers are then microVM snapshots (vm.state and a memory file of
  // vm_memory() bytes), and a sandbox's guest_memory() names
  // set_template_memory()'s file as the memory it was restored from.
  bool snapshots_memory() const override { return snapshots_memory_; }
  void set_snapshots_memory(bool v) {
    snapshots_memory_ = v;
    std::lock_guard<std::mutex> g(shared_->mu);
    shared_->snapshots_memory = v;
  }
  bool snapshots_memory_ = false;
  void set_template_memory(std::string path) {
    std::lock_guard<std::mutex> g(shared_->mu);
    shared_->template_memory = std::move(path);
  }
  // What a sandbox's snapshot writes as its memory: 8 pages, the first 6
  // zero, the last 2 its id over and over.
  static std::string vm_memory(const std::string& id) {
    std::string m(8 * 4096, '\0');
    for (size_t i = 6 * 4096; i < m.size(); ++i) m[i] = id[i % id.size()];
    return m;
  }
  Result<std::unique_ptr<runtime::Sandbox>> recover(const std::string& id) override {
    if (!outlive_) return runtime::Runtime::recover(id);
    std::lock_guard<std::mutex> g(shared_->mu);
    auto it = shared_->records.find(id);
    if (it == shared_->records.end() || it->second.killed) return not_found_error("sandbox " + id + ": no record of it");
    if (shared_->handles.count(id)) return conflict_error("sandbox " + id + " is held by a handle");
    if (it->second.dead) {
      it->second.killed = true;  // what is left of it goes
      return not_found_error("its processes are gone");
    }
    ++it->second.recovers;
    return std::unique_ptr<runtime::Sandbox>(new FakeSandbox(shared_, id));
  }
  // Kills every record not named in keep (and not held by a handle).
  Status cleanup_stale_except(const std::set<std::string>& keep) override {
    std::lock_guard<std::mutex> g(shared_->mu);
    for (auto& [id, r] : shared_->records)
      if (!keep.count(id) && !shared_->handles.count(id)) r.killed = true;
    return Status::Ok();
  }
  // As the kvm runtime with snapshots: create() leaves a template's start
  // command running (so the service does not run it over envd, which
  // these sandboxes do not have).
  bool runs_start_command() const override { return runs_start_command_; }
  void set_runs_start_command(bool v) { runs_start_command_ = v; }

  // The Nth call of op from now fails (1: the next), once.
  void fail_at(Op op, int n) {
    std::lock_guard<std::mutex> g(shared_->mu);
    shared_->fail_at[static_cast<int>(op)] = shared_->calls[static_cast<int>(op)] + n;
  }
  // The next k calls of op fail.
  void fail_next(Op op, int k) {
    std::lock_guard<std::mutex> g(shared_->mu);
    shared_->fail_left[static_cast<int>(op)] = k;
  }
  void clear_faults() {
    std::lock_guard<std::mutex> g(shared_->mu);
    for (auto& f : shared_->fail_at) f = 0;
    for (auto& f : shared_->fail_left) f = 0;
  }
  int calls(Op op) {
    std::lock_guard<std::mutex> g(shared_->mu);
    return shared_->calls[static_cast<int>(op)];
  }
  int faults_fired() {
    std::lock_guard<std::mutex> g(shared_->mu);
    return shared_->fired;
  }
  // A copy of the record of sandbox id (a default Record if none).
  Record record(const std::string& id) {
    std::lock_guard<std::mutex> g(shared_->mu);
    auto it = shared_->records.find(id);
    return it == shared_->records.end() ? Record{} : it->second;
  }
  bool exists(const std::string& id) {
    std::lock_guard<std::mutex> g(shared_->mu);
    return shared_->records.count(id) != 0;
  }
  // Its PID 1 exits: alive() turns false.
  void set_dead(const std::string& id) {
    std::lock_guard<std::mutex> g(shared_->mu);
    shared_->records[id].dead = true;
  }
  // Sandboxes started and not killed whose handles the code under test no
  // longer holds: a leak. (A live handle is not a leak.)
  std::vector<std::string> leaked() {
    std::lock_guard<std::mutex> g(shared_->mu);
    std::vector<std::string> out;
    for (auto& [id, r] : shared_->records)
      if (!r.killed && !shared_->handles.count(id)) out.push_back(id);
    return out;
  }
  // Started, not killed (held or not).
  std::vector<std::string> unkilled() {
    std::lock_guard<std::mutex> g(shared_->mu);
    std::vector<std::string> out;
    for (auto& [id, r] : shared_->records)
      if (!r.killed) out.push_back(id);
    return out;
  }

 private:
  struct Shared {
    std::mutex mu;
    std::map<std::string, Record> records;  // GUARDED_BY(mu)
    std::multiset<std::string> handles;     // GUARDED_BY(mu): FakeSandbox objects alive
    int calls[static_cast<int>(Op::kCount)] = {};
    int fail_at[static_cast<int>(Op::kCount)] = {};
    int fail_left[static_cast<int>(Op::kCount)] = {};
    int fired = 0;
    int started = 0;
    bool snapshots_memory = false;  // GUARDED_BY(mu)
    std::string template_memory;    // GUARDED_BY(mu)
    // REQUIRES(mu)
    Status call(Op op, const std::string& id) {
      int i = static_cast<int>(op);
      ++calls[i];
      bool now = fail_at[i] != 0 && calls[i] == fail_at[i];
      if (now) fail_at[i] = 0;
      if (!now && fail_left[i] > 0) {
        --fail_left[i];
        now = true;
      }
      if (now) {
        ++fired;
        return Error(ErrorKind::kInternal, "injected fault: call " + std::to_string(calls[i]) + " of op " +
                                               std::to_string(i) + " (sandbox " + id + ")");
      }
      return Status::Ok();
    }
  };

  class FakeSandbox : public runtime::Sandbox {
   public:
    FakeSandbox(std::shared_ptr<Shared> s, std::string id) : s_(std::move(s)), id_(std::move(id)) {
      s_->handles.insert(id_);  // called with s_->mu held (create)
    }
    ~FakeSandbox() override {
      std::lock_guard<std::mutex> g(s_->mu);
      s_->handles.erase(s_->handles.find(id_));
    }
    const std::string& id() const override { return id_; }
    int init_pid() const override {
      std::lock_guard<std::mutex> g(s_->mu);
      return s_->records[id_].pid;
    }
    int channel_fd() const override { return -1; }
    Status pause() override { return set_paused(Op::kPause, true); }
    Status resume() override { return set_paused(Op::kResume, false); }
    Status kill() override {
      std::lock_guard<std::mutex> g(s_->mu);
      Record& r = s_->records[id_];
      ++r.kills;
      if (r.killed) return Status::Ok();
      if (Status s = s_->call(Op::kKill, id_); !s) return s;
      r.killed = true;
      return Status::Ok();
    }
    bool alive() override {
      std::lock_guard<std::mutex> g(s_->mu);
      Record& r = s_->records[id_];
      return !r.killed && !r.dead;
    }
    Result<runtime::Usage> usage() override {
      std::lock_guard<std::mutex> g(s_->mu);
      if (Status s = s_->call(Op::kUsage, id_); !s) return s.error();
      runtime::Usage u;
      u.cpu_usage_ns = 1000000;
      u.mem_used_bytes = 64ull << 20;
      u.mem_limit_bytes = s_->records[id_].spec.memory_mb << 20;
      return u;
    }
    Result<UniqueFd> open_port(uint16_t port) override {
      std::lock_guard<std::mutex> g(s_->mu);
      if (Status s = s_->call(Op::kOpenPort, id_); !s) return s.error();
      Record& r = s_->records[id_];
      if (r.killed || r.dead) return Error(ErrorKind::kUnavailable, "channel closed");
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return Error(ErrorKind::kInternal, "socketpair failed");
      ::close(sv[1]);  // nothing listens: the caller sees EOF
      return UniqueFd(sv[0]);
    }
    Result<std::string> control(std::string request, std::chrono::milliseconds) override {
      std::lock_guard<std::mutex> g(s_->mu);
      if (Status s = s_->call(Op::kControl, id_); !s) return s.error();
      if (request.find("\"status\"") != std::string::npos) return std::string(R"({"type":"status","runnable":0})");
      if (request.find("\"configure\"") != std::string::npos) {
        s_->records[id_].configures.push_back(request);
        return std::string(R"({"type":"configured"})");
      }
      return std::string(R"({"type":"pong"})");
    }

    // A layer of one file (its content the sandbox id); a fault leaves a
    // partial one behind, as a copy that ran out of disk would.
    Status export_layer(const std::string& dest) override {
      std::lock_guard<std::mutex> g(s_->mu);
      if (s_->records[id_].killed) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + " is killed");
      if (::mkdir(dest.c_str(), 0755) != 0) return Error(ErrorKind::kInternal, "mkdir " + dest);
      Status s = s_->call(Op::kExport, id_);
      std::string file = dest + (s ? "/layer" : "/partial");
      if (FILE* f = std::fopen(file.c_str(), "w")) {
        std::fputs(id_.c_str(), f);
        std::fclose(f);
      }
      if (!s) return Error(ErrorKind::kUnavailable, "copy the layer: No space left on device");
      if (s_->snapshots_memory) {
        for (const auto& [name, data] : {std::pair<std::string, std::string>{"/memory", vm_memory(id_)},
                                         std::pair<std::string, std::string>{"/vm.state", "state of " + id_}})
          if (FILE* f = std::fopen((dest + name).c_str(), "w")) {
            std::fwrite(data.data(), 1, data.size(), f);
            std::fclose(f);
          }
      }
      return Status::Ok();
    }

    // Guest RAM as a microVM's would be reported (nothing is mapped: the
    // memory store under test is a fake too).
    Result<runtime::GuestMemoryInfo> guest_memory() override {
      std::lock_guard<std::mutex> g(s_->mu);
      runtime::GuestMemoryInfo m;
      m.pid = s_->records[id_].pid;
      m.size = s_->records[id_].spec.memory_mb << 20;
      m.backing = "memfd";
      m.template_memory = s_->template_memory;
      return m;
    }

   private:
    Status set_paused(Op op, bool paused) {
      std::lock_guard<std::mutex> g(s_->mu);
      if (Status s = s_->call(op, id_); !s) return s;
      Record& r = s_->records[id_];
      if (r.killed) return Error(ErrorKind::kUnavailable, "sandbox " + id_ + " is killed");
      r.paused = paused;
      ++(paused ? r.pauses : r.resumes);
      return Status::Ok();
    }
    std::shared_ptr<Shared> s_;
    std::string id_;
  };

  std::shared_ptr<Shared> shared_;
  std::atomic<bool> runs_start_command_{false};
  std::string name_;
};

}  // namespace sg::test
