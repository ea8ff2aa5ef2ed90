// Admission control: at most `max_inflight` requests run at once, up to
// `max_queue` more wait for a slot in arrival order, and anything beyond is
// refused at once with RESOURCE_EXHAUSTED (naming both limits). A waiter
// leaves the queue when its deadline passes (DEADLINE_EXCEEDED) or its caller
// cancels (CANCELLED). Thread-safe.
#ifndef VLM_SERVICES_GATEWAY_ADMISSION_H_
#define VLM_SERVICES_GATEWAY_ADMISSION_H_

#include <cstdint>
#include <deque>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace vlm::gateway {

class Admission {
 public:
  // A running slot, released on destruction. Move-only.
  class Permit {
   public:
    Permit() = default;
    Permit(Permit&& other) noexcept : owner_(other.owner_) { other.owner_ = nullptr; }
    Permit& operator=(Permit&& other) noexcept;
    Permit(const Permit&) = delete;
    Permit& operator=(const Permit&) = delete;
    ~Permit() { Release(); }
    void Release();

   private:
    friend class Admission;
    explicit Permit(Admission* owner) : owner_(owner) {}
    Admission* owner_ = nullptr;
  };

  // Called with (running, queued) under the lock after every change (e.g. to
  // set gauges); must be cheap and must not call back into Admission.
  using Observer = std::function<void(int running, int queued)>;

  Admission(int max_inflight, int max_queue, Observer observer = nullptr);
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Takes a slot, waiting in the queue if needed until `deadline`. `cancelled`
  // (may be empty) is polled while waiting.
  absl::StatusOr<Permit> Acquire(absl::Time deadline, const std::function<bool()>& cancelled = {});

  int running() const;
  int queued() const;
  int max_inflight() const { return max_inflight_; }
  int max_queue() const { return max_queue_; }

 private:
  void ReleaseOne();
  void NotifyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_inflight_;
  const int max_queue_;
  const Observer observer_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<uint64_t> waiters_ ABSL_GUARDED_BY(mu_);  // arrival order
  uint64_t next_waiter_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_ADMISSION_H_
