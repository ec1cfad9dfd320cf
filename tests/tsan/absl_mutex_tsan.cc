// Tells ThreadSanitizer what absl::Mutex does, for the `tsan` preset's test binary only.
//
// TSan sees synchronisation through instrumented code and the libc/pthread calls it intercepts.
// Debian's Abseil is built without TSan, so absl::Mutex's locking (atomics and futexes inside
// libabsl_synchronization.so) is invisible to it, and every access an absl::Mutex guards would be
// reported as a race: the reports would all be false, and a suppression broad enough to silence
// them would silence real races too. So instead of suppressing, this file interposes the Mutex
// and CondVar entry points: each definition below replaces the library's (the executable is
// linked with -rdynamic, so calls from inside the library land here too), calls the real one
// (dlsym RTLD_NEXT), and tells TSan what happened: __tsan_acquire after the mutex is taken,
// __tsan_release before it is let go (and around every wait that lets it go). TSan then orders
// what one thread wrote under the mutex before what the next holder reads, exactly as the
// mutex does. Readers are treated like writers (a reader's release orders nothing a correct
// reader wrote), which can only hide a race between two readers that write, never invent one.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"

namespace {

#define NQ_STRINGIFY_INNER(x) #x
#define NQ_STRINGIFY(x) NQ_STRINGIFY_INNER(x)

// "_ZN4absl<len><inline namespace>" (e.g. _ZN4absl7debian3): the mangled prefix of every absl
// symbol of this build of Abseil.
std::string Prefix() {
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const std::string ns = NQ_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return "_ZN4absl" + std::to_string(ns.size()) + ns;
#else
  return "_ZN4absl";
#endif
}

// The library's definition of `mangled_suffix` (after the prefix); aborts when it is missing, as
// running on without it would deadlock or race for real.
template <typename Fn>
Fn Real(const char* mangled_suffix) {
  const std::string name = Prefix() + mangled_suffix;
  void* fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "absl_mutex_tsan: %s not found in Abseil: %s\n", name.c_str(), dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

// A Condition that runs `cond` as if it held the mutex: absl evaluates a waiter's condition while
// the real mutex is held, on the waiter's thread or on the thread unlocking, at moments no entry
// point above sees; the acquire and release around it order its reads with the holders' writes.
struct Guarded {
  const absl::Condition* cond;
  absl::Mutex* mu;
  static bool Eval(Guarded* g) {
    __tsan_acquire(g->mu);
    const bool met = g->cond->Eval();
    __tsan_release(g->mu);
    return met;
  }
};

// Abseil's deadlock detector (on in Debian's build) records every mutex in one global graph
// guarded by a spinlock inside the library, which TSan cannot see either: the graph's updates
// from two threads would be reported as a race inside libabsl_graphcycles_internal, whatever our
// code does. It is switched off in this binary only; it judges lock order, not data races, and
// the services keep it.
const bool kAbslDeadlockDetectionOff = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  real(this);
  __tsan_acquire(this);
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  __tsan_release(this);
  real(this);
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  real(this);
  __tsan_acquire(this);
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  __tsan_release(this);
  real(this);
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  Guarded guarded{&cond, this};
  real(this, absl::Condition(&Guarded::Eval, &guarded));
  __tsan_acquire(this);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Guarded guarded{&cond, this};
  real(this, absl::Condition(&Guarded::Eval, &guarded));
  __tsan_acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, absl::Duration)>("5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Guarded guarded{&cond, this};
  const bool met = real(this, absl::Condition(&Guarded::Eval, &guarded), timeout);
  __tsan_acquire(this);  // held on return either way
  return met;
}

// Await and the CondVar waits let the mutex go while they sleep and take it again before they
// return: a release before, an acquire after.
void Mutex::Await(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  Guarded guarded{&cond, this};
  __tsan_release(this);
  real(this, absl::Condition(&Guarded::Eval, &guarded));
  __tsan_acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, absl::Duration)>("5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  Guarded guarded{&cond, this};
  __tsan_release(this);
  const bool met = real(this, absl::Condition(&Guarded::Eval, &guarded), timeout);
  __tsan_acquire(this);
  return met;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real =
      Real<bool (*)(Mutex*, const Condition&, absl::Time)>("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  Guarded guarded{&cond, this};
  __tsan_release(this);
  const bool met = real(this, absl::Condition(&Guarded::Eval, &guarded), deadline);
  __tsan_acquire(this);
  return met;
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  real(this, mu);
  __tsan_acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static const auto real =
      Real<bool (*)(CondVar*, Mutex*, absl::Duration)>("7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool timed_out = real(this, mu, timeout);
  __tsan_acquire(mu);
  return timed_out;
}

ABSL_NAMESPACE_END
}  // namespace absl
