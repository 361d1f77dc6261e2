// The real host behind Os: each method is the libc call or raw syscall.
#include "base/os.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace sg::sys {

int Os::open(const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); }
int Os::openat(int dfd, const char* path, int flags, mode_t mode) { return ::openat(dfd, path, flags, mode); }
ssize_t Os::write(int fd, const void* buf, size_t n) { return ::write(fd, buf, n); }
ssize_t Os::send(int fd, const void* buf, size_t n, int flags) { return ::send(fd, buf, n, flags); }
int Os::mkdir(const char* path, mode_t mode) { return ::mkdir(path, mode); }
int Os::rmdir(const char* path) { return ::rmdir(path); }
int Os::unlinkat(int dfd, const char* path, int flags) { return ::unlinkat(dfd, path, flags); }
int Os::rename(const char* from, const char* to) { return ::rename(from, to); }
int Os::link(const char* from, const char* to) { return ::link(from, to); }
int Os::fsync(int fd) { return ::fsync(fd); }
int Os::chown(const char* path, uid_t uid, gid_t gid) { return ::chown(path, uid, gid); }
int Os::mknod(const char* path, mode_t mode, dev_t dev) { return ::mknod(path, mode, dev); }
int Os::ftruncate(int fd, off_t size) { return ::ftruncate(fd, size); }
int Os::ioctl(int fd, unsigned long request, unsigned long arg) { return ::ioctl(fd, request, arg); }
int Os::socketpair(int domain, int type, int protocol, int sv[2]) { return ::socketpair(domain, type, protocol, sv); }
int Os::pipe2(int fds[2], int flags) { return ::pipe2(fds, flags); }
int Os::dup_high(int fd, int min_fd) { return ::fcntl(fd, F_DUPFD_CLOEXEC, min_fd); }
int Os::open_tree(int dfd, const char* path, unsigned flags) { return ::open_tree(dfd, path, flags); }
pid_t Os::clone(int (*fn)(void*), void* stack_top, int flags, void* arg, int* pidfd) {
  return ::clone(fn, stack_top, flags, arg, pidfd);
}
int Os::kill(pid_t pid, int sig) { return ::kill(pid, sig); }
int Os::pidfd_send_signal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

Os& Os::real() {
  static Os os;
  return os;
}

}  // namespace sg::sys
