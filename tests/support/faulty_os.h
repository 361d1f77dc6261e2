// FaultyOs: the real host (base/os.h) with one call made to fail.
//
// fail_at(n) makes the nth call from then on fail with EIO, once, without
// reaching the host (LevelDB's fault-injection Env, Beast's fail_count).
// A fault loop first counts the calls an operation makes (calls() after a
// run with no fault), then runs it again once for each n, and checks after
// each run that the operation failed cleanly and nothing is left on the
// host. Every call is recorded by name and object, so a failure names the
// call that was failed ("call 17 of 41: mkdir /tmp/x/lower").
//
// Thread-safe: a runtime calls it from its own threads too.
#pragma once

#include <fcntl.h>

#include <cerrno>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "base/os.h"

namespace sg::test {

class FaultyOs : public sys::Os {
 public:
  // The nth call from now fails (1: the next one); 0 cancels.
  void fail_at(uint64_t n) {
    std::lock_guard<std::mutex> g(mu_);
    fail_at_ = n ? calls_ + n : 0;
    fired_.clear();
  }
  // Starts counting (and recording) from zero.
  void reset() {
    std::lock_guard<std::mutex> g(mu_);
    calls_ = 0;
    fail_at_ = 0;
    names_.clear();
    fired_.clear();
  }
  uint64_t calls() const {
    std::lock_guard<std::mutex> g(mu_);
    return calls_;
  }
  // The calls since reset(), by name and object.
  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> g(mu_);
    return names_;
  }
  // The call that was failed; "" while none was.
  std::string fired() const {
    std::lock_guard<std::mutex> g(mu_);
    return fired_;
  }

  // A call the code under test makes by another route (an io_uring
  // operation, a callback), counted and failed like the others: true when
  // it is the one to fail (errno EIO).
  bool inject(const char* op, const std::string& object) { return hit(op, object); }

  int open(const char* path, int flags, mode_t mode) override {
    return hit("open", path) ? -1 : Os::open(path, flags, mode);
  }
  int openat(int dfd, const char* path, int flags, mode_t mode) override {
    return hit("openat", path) ? -1 : Os::openat(dfd, path, flags, mode);
  }
  ssize_t write(int fd, const void* buf, size_t n) override {
    return hit("write", "fd " + std::to_string(fd)) ? -1 : Os::write(fd, buf, n);
  }
  ssize_t send(int fd, const void* buf, size_t n, int flags) override {
    return hit("send", "fd " + std::to_string(fd)) ? -1 : Os::send(fd, buf, n, flags);
  }
  int mkdir(const char* path, mode_t mode) override { return hit("mkdir", path) ? -1 : Os::mkdir(path, mode); }
  int rmdir(const char* path) override { return hit("rmdir", path) ? -1 : Os::rmdir(path); }
  int unlinkat(int dfd, const char* path, int flags) override {
    return hit("unlinkat", path) ? -1 : Os::unlinkat(dfd, path, flags);
  }
  int rename(const char* from, const char* to) override { return hit("rename", from) ? -1 : Os::rename(from, to); }
  int link(const char* from, const char* to) override { return hit("link", to) ? -1 : Os::link(from, to); }
  int fsync(int fd) override { return hit("fsync", "fd " + std::to_string(fd)) ? -1 : Os::fsync(fd); }
  int chown(const char* path, uid_t uid, gid_t gid) override {
    return hit("chown", path) ? -1 : Os::chown(path, uid, gid);
  }
  int mknod(const char* path, mode_t mode, dev_t dev) override {
    return hit("mknod", path) ? -1 : Os::mknod(path, mode, dev);
  }
  int ftruncate(int fd, off_t size) override {
    return hit("ftruncate", "fd " + std::to_string(fd)) ? -1 : Os::ftruncate(fd, size);
  }
  int ioctl(int fd, unsigned long request, unsigned long arg) override {
    return hit("ioctl", "fd " + std::to_string(fd)) ? -1 : Os::ioctl(fd, request, arg);
  }
  int socketpair(int domain, int type, int protocol, int sv[2]) override {
    return hit("socketpair", "") ? -1 : Os::socketpair(domain, type, protocol, sv);
  }
  int pipe2(int fds[2], int flags) override { return hit("pipe2", "") ? -1 : Os::pipe2(fds, flags); }
  int dup_high(int fd, int min_fd) override {
    return hit("dup_high", "fd " + std::to_string(fd)) ? -1 : Os::dup_high(fd, min_fd);
  }
  int open_tree(int dfd, const char* path, unsigned flags) override {
    return hit("open_tree", path) ? -1 : Os::open_tree(dfd, path, flags);
  }
  pid_t clone(int (*fn)(void*), void* stack_top, int flags, void* arg, int* pidfd) override {
    return hit("clone", "") ? -1 : Os::clone(fn, stack_top, flags, arg, pidfd);
  }
  int kill(pid_t pid, int sig) override {
    return hit("kill", "pid " + std::to_string(pid)) ? -1 : Os::kill(pid, sig);
  }
  int pidfd_send_signal(int pidfd, int sig) override {
    return hit("pidfd_send_signal", "pidfd " + std::to_string(pidfd)) ? -1 : Os::pidfd_send_signal(pidfd, sig);
  }

 private:
  // Counts the call; true (errno EIO) when it is the one to fail.
  bool hit(const char* op, const std::string& object) {
    std::lock_guard<std::mutex> g(mu_);
    ++calls_;
    std::string name = object.empty() ? std::string(op) : std::string(op) + " " + object;
    names_.push_back(name);
    if (fail_at_ == 0 || calls_ != fail_at_) return false;
    fail_at_ = 0;
    fired_ = "call " + std::to_string(calls_) + ": " + name;
    errno = EIO;
    return true;
  }

  mutable std::mutex mu_;
  uint64_t calls_ = 0;     // GUARDED_BY(mu_)
  uint64_t fail_at_ = 0;   // GUARDED_BY(mu_)
  std::vector<std::string> names_;  // GUARDED_BY(mu_)
  std::string fired_;      // GUARDED_BY(mu_)
};

}  // namespace sg::test
