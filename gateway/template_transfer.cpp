// Implementation of the tree transfer (template_transfer.h).
#include "gateway/template_transfer.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "base/fd.h"
#include "base/hex.h"
#include "base/sys.h"

extern char** environ;

namespace sg::gateway::transfer {

namespace {

constexpr const char* kTrailerTag = "\nsandgate-sha256 ";
constexpr size_t kTrailerTagSize = 17;
constexpr size_t kTrailer = kTrailerTagSize + 64 + 1;  // the tag, the hex digest, "\n"

// The flags both ends give tar: what a template's tree needs kept.
const std::vector<std::string> kTarFlags = {"--xattrs", "--xattrs-include=*", "--numeric-owner"};

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const char* p, size_t n) { EVP_DigestUpdate(ctx_, p, n); }
  std::string hex() {
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    EVP_DigestFinal_ex(ctx_, d, &len);
    return hex_lower(d, len);
  }

 private:
  EVP_MD_CTX* ctx_;
};

// tar with stdin/stdout as given (-1: /dev/null) and stderr to err_path.
Result<pid_t> spawn_tar(const std::vector<std::string>& args, int in, int out, const std::string& err_path) {
  std::vector<char*> argv;
  std::string tar = "tar";
  argv.push_back(tar.data());
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (in >= 0) posix_spawn_file_actions_adddup2(&fa, in, 0);
  else posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  if (out >= 0) posix_spawn_file_actions_adddup2(&fa, out, 1);
  else posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, "tar", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return sys::errno_error("spawn", "tar", rc);
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool write_fully(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

std::vector<std::string> tar_args(std::vector<std::string> rest) {
  std::vector<std::string> args = kTarFlags;
  args.insert(args.end(), rest.begin(), rest.end());
  return args;
}

}  // namespace

bool send_tree(const std::string& dir, int out, const std::string& err_path) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return false;
  UniqueFd rd(pipefd[0]), wr(pipefd[1]);
  Result<pid_t> pid = spawn_tar(tar_args({"-C", dir, "-cf", "-", "."}), -1, wr.get(), err_path);
  if (!pid) return false;
  wr.reset();
  Sha256 sha;
  std::vector<char> buf(1 << 16);
  bool sent = true;
  for (;;) {
    ssize_t n = ::read(rd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    sha.update(buf.data(), static_cast<size_t>(n));
    if (!write_fully(out, buf.data(), static_cast<size_t>(n))) {
      sent = false;
      break;
    }
  }
  if (!sent) ::kill(*pid, SIGKILL);
  rd.reset();
  int rc = wait_exit(*pid);
  if (!sent || rc != 0) return false;
  std::string trailer = std::string(kTrailerTag) + sha.hex() + "\n";
  return write_fully(out, trailer.data(), trailer.size());
}

Result<uint64_t> receive_tree(int in, const std::string& dir, const std::string& err_path,
                              std::chrono::milliseconds idle) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return sys::errno_error("pipe", dir);
  UniqueFd rd(pipefd[0]), wr(pipefd[1]);
  Result<pid_t> pid = spawn_tar(tar_args({"-C", dir, "-xpf", "-"}), rd.get(), -1, err_path);
  if (!pid) return pid.error();
  rd.reset();
  // The stream to tar, all but its last kTrailer bytes hashed as they go.
  Sha256 sha;
  std::string held;  // the last kTrailer bytes seen
  std::vector<char> buf(1 << 16);
  uint64_t total = 0;
  std::string failure;
  for (;;) {
    pollfd p{in, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(idle.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      failure = std::string("poll: ") + std::strerror(errno);
      break;
    }
    if (r == 0) {
      failure = "no data for " + std::to_string(idle.count()) + " ms";
      break;
    }
    ssize_t n = ::read(in, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      failure = std::string("read: ") + std::strerror(errno);
      break;
    }
    if (n == 0) break;
    total += static_cast<uint64_t>(n);
    held.append(buf.data(), static_cast<size_t>(n));
    if (held.size() > kTrailer) {
      size_t out = held.size() - kTrailer;
      sha.update(held.data(), out);
      if (!write_fully(wr.get(), held.data(), out)) {
        failure = "tar stopped reading: " + sys::read_tail(err_path, 400);
        break;
      }
      held.erase(0, out);
    }
  }
  wr.reset();  // tar sees the end
  if (!failure.empty()) ::kill(*pid, SIGKILL);
  int rc = wait_exit(*pid);
  if (failure.empty() &&
      (held.size() != kTrailer || held.compare(0, kTrailerTagSize, kTrailerTag) != 0 || held.back() != '\n'))
    failure = "the stream ended without its trailer (" + std::to_string(total) + " bytes): the sender stopped mid-way";
  if (failure.empty() && held.compare(kTrailerTagSize, 64, sha.hex()) != 0)
    failure = "the stream's SHA-256 does not match its trailer";
  if (failure.empty() && rc != 0) failure = "tar: " + sys::read_tail(err_path, 400);
  if (!failure.empty()) return Error(ErrorKind::kUnavailable, failure);
  return total;
}

}  // namespace sg::gateway::transfer
