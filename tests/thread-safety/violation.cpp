// Not built into anything: thread_safety_catches compiles it with the flags
// of thread_safety_check and expects clang to refuse it, so a check that
// stopped analysing (a lost flag, a macro that expands to nothing under
// clang) fails the suite.
#include "base/thread_annotations.h"

namespace {

class Counter {
 public:
  void bump() { ++n_; }  // no lock held: clang must say so
  int read() {
    sg::MutexLock g(mu_);
    return n_;
  }

 private:
  sg::Mutex mu_;
  int n_ GUARDED_BY(mu_) = 0;
};

}  // namespace

int use_counter() {
  Counter c;
  c.bump();
  return c.read();
}
