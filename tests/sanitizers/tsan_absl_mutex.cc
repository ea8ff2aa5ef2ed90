// ThreadSanitizer support for Debian's abseil (linked into test binaries of a
// -DVLM_SANITIZE=thread build only, by vlm_add_test in the top CMakeLists.txt).
//
// Debian's libabsl_synchronization is not built with TSan, so TSan never sees
// absl::Mutex lock or unlock (the fast path is an uninstrumented atomic, the
// slow path a futex) and reports every access to data that a Mutex guards as
// a race. The linker's --wrap sends our code's calls to the Mutex and CondVar
// entry points through these functions, which call the real one and tell TSan
// about the happens-before edge: release before unlocking (or waiting, which
// unlocks), acquire after locking. Readers are modelled like writers (a
// slight over-synchronisation: a race between two readers' writes would be
// missed; readers must not write). Deadlock detection is not modelled, and
// accesses made by Condition functions are not checked (see IgnoreAccesses).
//
// The symbol names are those of bookworm's abseil 20220623 (inline namespace
// "debian3"); with another abseil the wraps match nothing and TSan reports
// the Mutex-guarded accesses again, which shows at once.
#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin();
void __tsan_ignore_thread_end();
}

namespace {
// absl evaluates a Condition while the mutex is held, but inside its own
// (invisible) lock and unlock paths, sometimes on another waiter's thread.
// The accesses of a call that may evaluate conditions are therefore not
// checked: conditions only read state the mutex guards.
struct IgnoreAccesses {
  IgnoreAccesses() { __tsan_ignore_thread_begin(); }
  ~IgnoreAccesses() { __tsan_ignore_thread_end(); }
};
}  // namespace

#define VLM_REAL(sym) __real_##sym
#define VLM_WRAP(sym) __wrap_##sym

extern "C" {

// Locks: acquire after the real lock returns.
void VLM_REAL(_ZN4absl7debian35Mutex4LockEv)(absl::Mutex* mu);
void VLM_WRAP(_ZN4absl7debian35Mutex4LockEv)(absl::Mutex* mu) {
  VLM_REAL(_ZN4absl7debian35Mutex4LockEv)(mu);
  __tsan_acquire(mu);
}
void VLM_REAL(_ZN4absl7debian35Mutex10ReaderLockEv)(absl::Mutex* mu);
void VLM_WRAP(_ZN4absl7debian35Mutex10ReaderLockEv)(absl::Mutex* mu) {
  VLM_REAL(_ZN4absl7debian35Mutex10ReaderLockEv)(mu);
  __tsan_acquire(mu);
}
void VLM_REAL(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE)(absl::Mutex* mu,
                                                                 const absl::Condition& c);
void VLM_WRAP(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE)(absl::Mutex* mu,
                                                                 const absl::Condition& c) {
  {
    IgnoreAccesses ignore;
    VLM_REAL(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE)(mu, c);
  }
  __tsan_acquire(mu);
}
void VLM_REAL(_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE)(absl::Mutex* mu,
                                                                        const absl::Condition& c);
void VLM_WRAP(_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE)(absl::Mutex* mu,
                                                                        const absl::Condition& c) {
  {
    IgnoreAccesses ignore;
    VLM_REAL(_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE)(mu, c);
  }
  __tsan_acquire(mu);
}

// Locks that may fail or time out: acquire only when the lock is held. The
// *WithTimeout/*WithDeadline forms hold the lock on return whatever they return.
bool VLM_REAL(_ZN4absl7debian35Mutex7TryLockEv)(absl::Mutex* mu);
bool VLM_WRAP(_ZN4absl7debian35Mutex7TryLockEv)(absl::Mutex* mu) {
  const bool locked = VLM_REAL(_ZN4absl7debian35Mutex7TryLockEv)(mu);
  if (locked) __tsan_acquire(mu);
  return locked;
}
bool VLM_REAL(_ZN4absl7debian35Mutex13ReaderTryLockEv)(absl::Mutex* mu);
bool VLM_WRAP(_ZN4absl7debian35Mutex13ReaderTryLockEv)(absl::Mutex* mu) {
  const bool locked = VLM_REAL(_ZN4absl7debian35Mutex13ReaderTryLockEv)(mu);
  if (locked) __tsan_acquire(mu);
  return locked;
}
bool VLM_REAL(_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Duration d);
bool VLM_WRAP(_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Duration d) {
  bool r;
  {
    IgnoreAccesses ignore;
    r = VLM_REAL(_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE)(mu, c, d);
  }
  __tsan_acquire(mu);
  return r;
}
bool VLM_REAL(_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Time t);
bool VLM_WRAP(_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Time t) {
  bool r;
  {
    IgnoreAccesses ignore;
    r = VLM_REAL(_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE)(mu, c, t);
  }
  __tsan_acquire(mu);
  return r;
}

// Unlocks: release before the real unlock.
void VLM_REAL(_ZN4absl7debian35Mutex6UnlockEv)(absl::Mutex* mu);
void VLM_WRAP(_ZN4absl7debian35Mutex6UnlockEv)(absl::Mutex* mu) {
  __tsan_release(mu);
  {
    IgnoreAccesses ignore;
    VLM_REAL(_ZN4absl7debian35Mutex6UnlockEv)(mu);
  }
}
void VLM_REAL(_ZN4absl7debian35Mutex12ReaderUnlockEv)(absl::Mutex* mu);
void VLM_WRAP(_ZN4absl7debian35Mutex12ReaderUnlockEv)(absl::Mutex* mu) {
  __tsan_release(mu);
  {
    IgnoreAccesses ignore;
    VLM_REAL(_ZN4absl7debian35Mutex12ReaderUnlockEv)(mu);
  }
}

// Waits release the mutex while blocked and hold it again on return.
void VLM_REAL(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE)(absl::Mutex* mu,
                                                              const absl::Condition& c);
void VLM_WRAP(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE)(absl::Mutex* mu,
                                                              const absl::Condition& c) {
  __tsan_release(mu);
  {
    IgnoreAccesses ignore;
    VLM_REAL(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE)(mu, c);
  }
  __tsan_acquire(mu);
}
bool VLM_REAL(_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Duration d);
bool VLM_WRAP(_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Duration d) {
  __tsan_release(mu);
  bool r;
  {
    IgnoreAccesses ignore;
    r = VLM_REAL(_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE)(mu, c, d);
  }
  __tsan_acquire(mu);
  return r;
}
bool VLM_REAL(_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Time t);
bool VLM_WRAP(_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    absl::Mutex* mu, const absl::Condition& c, absl::Time t) {
  __tsan_release(mu);
  bool r;
  {
    IgnoreAccesses ignore;
    r = VLM_REAL(_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE)(mu, c, t);
  }
  __tsan_acquire(mu);
  return r;
}
void VLM_REAL(_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE)(absl::CondVar* cv, absl::Mutex* mu);
void VLM_WRAP(_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE)(absl::CondVar* cv, absl::Mutex* mu) {
  __tsan_release(mu);
  {
    IgnoreAccesses ignore;
    VLM_REAL(_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE)(cv, mu);
  }
  __tsan_acquire(mu);
}
bool VLM_REAL(_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE)(
    absl::CondVar* cv, absl::Mutex* mu, absl::Duration d);
bool VLM_WRAP(_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE)(
    absl::CondVar* cv, absl::Mutex* mu, absl::Duration d) {
  __tsan_release(mu);
  bool r;
  {
    IgnoreAccesses ignore;
    r = VLM_REAL(_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE)(cv, mu, d);
  }
  __tsan_acquire(mu);
  return r;
}
bool VLM_REAL(_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE)(
    absl::CondVar* cv, absl::Mutex* mu, absl::Time t);
bool VLM_WRAP(_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE)(
    absl::CondVar* cv, absl::Mutex* mu, absl::Time t) {
  __tsan_release(mu);
  bool r;
  {
    IgnoreAccesses ignore;
    r = VLM_REAL(_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE)(cv, mu, t);
  }
  __tsan_acquire(mu);
  return r;
}

}  // extern "C"
