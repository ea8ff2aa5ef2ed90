#include "services/gateway/admission.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace vlm::gateway {
namespace {

// How often a queued request looks at its caller's cancellation.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(10);

}  // namespace

Admission::Permit& Admission::Permit::operator=(Permit&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = other.owner_;
    other.owner_ = nullptr;
  }
  return *this;
}

void Admission::Permit::Release() {
  if (owner_ != nullptr) {
    owner_->ReleaseOne();
    owner_ = nullptr;
  }
}

Admission::Admission(int max_inflight, int max_queue, Observer observer)
    : max_inflight_(std::max(1, max_inflight)),
      max_queue_(std::max(0, max_queue)),
      observer_(std::move(observer)) {}

int Admission::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int Admission::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiters_.size());
}

void Admission::NotifyLocked() {
  if (observer_) observer_(running_, static_cast<int>(waiters_.size()));
}

void Admission::ReleaseOne() {
  absl::MutexLock lock(&mu_);
  --running_;
  NotifyLocked();
  changed_.SignalAll();
}

absl::StatusOr<Admission::Permit> Admission::Acquire(absl::Time deadline,
                                                     const std::function<bool()>& cancelled) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  if (running_ < max_inflight_ && waiters_.empty()) {
    ++running_;
    NotifyLocked();
    return Permit(this);
  }
  if (static_cast<int>(waiters_.size()) >= max_queue_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gateway is at capacity: ", running_, " requests running (max_inflight=", max_inflight_,
        ") and ", waiters_.size(), " queued (max_queue=", max_queue_, "); retry later"));
  }
  const uint64_t me = next_waiter_++;
  waiters_.push_back(me);
  NotifyLocked();
  auto leave = [&] {
    waiters_.erase(std::find(waiters_.begin(), waiters_.end(), me));
    NotifyLocked();
    changed_.SignalAll();  // the next waiter may now be first
  };
  for (;;) {
    if (waiters_.front() == me && running_ < max_inflight_) {
      waiters_.pop_front();
      ++running_;
      NotifyLocked();
      changed_.SignalAll();
      return Permit(this);
    }
    if (cancelled && cancelled()) {
      leave();
      return absl::CancelledError("request cancelled while queued for admission");
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      leave();
      return absl::DeadlineExceededError(
          absl::StrCat("deadline exceeded after ", absl::ToDoubleMilliseconds(now - start),
                       " ms in the admission queue (", running_, " requests running, max_inflight=",
                       max_inflight_, ")"));
    }
    const absl::Time wake = cancelled ? std::min(deadline, now + kCancelPoll) : deadline;
    changed_.WaitWithDeadline(&mu_, wake);
  }
}

}  // namespace vlm::gateway
