// Clang thread-safety annotations and a mutex that carries them.
//
// Shared state says which lock guards it (GUARDED_BY), and functions say
// which locks they need (REQUIRES) or take (ACQUIRE). Clang checks this at
// compile time with -Wthread-safety (the CTest entry thread_safety_check
// compiles the annotated sources so); other compilers see nothing.
// std::mutex carries no annotations in libstdc++, hence sg::Mutex.
#pragma once

#include <mutex>

#if defined(__clang__)
#define SG_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define SG_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) SG_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY SG_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) SG_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) SG_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) SG_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) SG_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) SG_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) SG_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) SG_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS SG_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace sg {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope. The adopting form takes one the caller
// already locked (a successful try_lock()).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  MutexLock(Mutex& mu, std::adopt_lock_t) REQUIRES(mu) : mu_(mu) {}
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

}  // namespace sg
