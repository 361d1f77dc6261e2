// Os: the seam between sandgate and the host's syscalls, in the manner of
// LevelDB's Env and Envoy's OsSysCalls. The code that changes the host on
// a sandbox's behalf (state directories, cgroups, layers, descriptors,
// clone, signals, teardown) calls these instead of libc, so a test can
// hand it an Os that fails the Nth call (tests/support/faulty_os.h) and
// check that every failure leaves nothing behind.
//
// Each method is the syscall of the same name: same arguments, same
// return value, errno set on failure. Reads that change nothing (stat,
// read, readdir, poll) stay direct calls: their failures take the same
// error paths as the calls here.
//
// Thread safety: Os::real() is stateless and may be used from any thread.
// An implementation used by a runtime must be safe to call from every
// thread that runtime uses.
#pragma once

#include <sys/types.h>

#include <cstddef>

namespace sg::sys {

class Os {
 public:
  virtual ~Os() = default;

  virtual int open(const char* path, int flags, mode_t mode);
  virtual int openat(int dfd, const char* path, int flags, mode_t mode);
  virtual ssize_t write(int fd, const void* buf, size_t n);
  virtual ssize_t send(int fd, const void* buf, size_t n, int flags);
  virtual int mkdir(const char* path, mode_t mode);
  virtual int rmdir(const char* path);
  virtual int unlinkat(int dfd, const char* path, int flags);
  virtual int rename(const char* from, const char* to);
  virtual int link(const char* from, const char* to);
  virtual int fsync(int fd);
  virtual int chown(const char* path, uid_t uid, gid_t gid);
  virtual int mknod(const char* path, mode_t mode, dev_t dev);
  virtual int ftruncate(int fd, off_t size);
  virtual int ioctl(int fd, unsigned long request, unsigned long arg);
  virtual int socketpair(int domain, int type, int protocol, int sv[2]);
  virtual int pipe2(int fds[2], int flags);
  virtual int dup_high(int fd, int min_fd);  // fcntl(fd, F_DUPFD_CLOEXEC, min_fd)
  virtual int open_tree(int dfd, const char* path, unsigned flags);
  // clone(2) through glibc's wrapper with CLONE_PIDFD: *pidfd receives the
  // child's pidfd.
  virtual pid_t clone(int (*fn)(void*), void* stack_top, int flags, void* arg, int* pidfd);
  virtual int kill(pid_t pid, int sig);
  virtual int pidfd_send_signal(int pidfd, int sig);

  // The host itself.
  static Os& real();
};

}  // namespace sg::sys
