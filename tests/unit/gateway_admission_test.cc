// Admission control and request validation of the gateway
// (services/gateway/admission.h, validation.h).
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "services/gateway/admission.h"
#include "services/gateway/validation.h"

namespace vlm::gateway {
namespace {

absl::Time In(absl::Duration d) { return absl::Now() + d; }

TEST(AdmissionTest, RunsUpToMaxInflightThenQueuesThenRefuses) {
  Admission admission(2, 1);
  auto a = admission.Acquire(In(absl::Seconds(5)));
  auto b = admission.Acquire(In(absl::Seconds(5)));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(admission.running(), 2);

  // The third waits in the queue; the fourth finds the queue full.
  std::optional<absl::StatusOr<Admission::Permit>> c;
  std::thread waiter([&] { c.emplace(admission.Acquire(In(absl::Seconds(5)))); });
  while (admission.queued() != 1) absl::SleepFor(absl::Milliseconds(1));
  auto d = admission.Acquire(In(absl::Seconds(5)));
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(d.status().message().find("max_inflight=2"), std::string::npos) << d.status();
  EXPECT_NE(d.status().message().find("max_queue=1"), std::string::npos) << d.status();

  a->Release();  // frees a slot: the queued one gets it
  waiter.join();
  ASSERT_TRUE(c->ok()) << c->status();
  EXPECT_EQ(admission.running(), 2);
  EXPECT_EQ(admission.queued(), 0);
}

TEST(AdmissionTest, PermitReleasesOnDestructionAndMove) {
  Admission admission(1, 0);
  {
    auto a = admission.Acquire(In(absl::Seconds(1)));
    ASSERT_TRUE(a.ok());
    Admission::Permit moved = std::move(*a);
    EXPECT_EQ(admission.running(), 1);
  }
  EXPECT_EQ(admission.running(), 0);
  EXPECT_TRUE(admission.Acquire(In(absl::Seconds(1))).ok());
}

TEST(AdmissionTest, QueuedRequestGivesUpAtItsDeadline) {
  Admission admission(1, 4);
  auto a = admission.Acquire(In(absl::Seconds(5)));
  ASSERT_TRUE(a.ok());
  const absl::Time start = absl::Now();
  auto b = admission.Acquire(In(absl::Milliseconds(50)));
  const absl::Duration waited = absl::Now() - start;
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(waited, absl::Milliseconds(45));
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_EQ(admission.queued(), 0);
}

TEST(AdmissionTest, QueuedRequestLeavesWhenCancelled) {
  Admission admission(1, 4);
  auto a = admission.Acquire(In(absl::Seconds(5)));
  std::atomic<bool> cancelled{false};
  std::optional<absl::StatusOr<Admission::Permit>> b;
  std::thread waiter([&] {
    b.emplace(admission.Acquire(In(absl::Seconds(30)), [&] { return cancelled.load(); }));
  });
  while (admission.queued() != 1) absl::SleepFor(absl::Milliseconds(1));
  cancelled = true;
  waiter.join();
  ASSERT_FALSE(b->ok());
  EXPECT_EQ(b->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(admission.queued(), 0);
}

TEST(AdmissionTest, QueueIsFirstComeFirstServed) {
  Admission admission(1, 8);
  auto held = admission.Acquire(In(absl::Seconds(5)));
  std::vector<int> order;
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      auto p = admission.Acquire(In(absl::Seconds(10)));
      ASSERT_TRUE(p.ok());
      absl::MutexLock lock(&mu);
      order.push_back(i);
    });
    while (admission.queued() != i + 1) absl::SleepFor(absl::Milliseconds(1));
  }
  held->Release();
  for (auto& t : threads) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

TEST(AdmissionTest, ObserverSeesRunningAndQueued) {
  std::vector<std::pair<int, int>> seen;
  Admission admission(1, 1, [&](int running, int queued) { seen.emplace_back(running, queued); });
  {
    auto a = admission.Acquire(In(absl::Seconds(1)));
  }
  EXPECT_EQ(seen, (std::vector<std::pair<int, int>>{{1, 0}, {0, 0}}));
}

// --- validation -------------------------------------------------------------

v1::ChatRequest TextRequest(const std::string& text) {
  v1::ChatRequest r;
  auto* m = r.add_messages();
  m->set_role("user");
  m->add_content()->set_text(text);
  return r;
}

void AddImage(v1::ChatRequest* r, std::string data) {
  r->mutable_messages(r->messages_size() - 1)->add_content()->mutable_image()->set_data(
      std::move(data));
}

std::string Message(const v1::ChatRequest& r, const ValidationLimits& limits = {}) {
  absl::Status s = ValidateChatRequest(r, limits);
  if (s.ok()) return "OK";
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  return std::string(s.message());
}

TEST(ValidationTest, AcceptsAPlainChat) {
  v1::ChatRequest r = TextRequest("hello");
  AddImage(&r, "xyz");
  r.mutable_params()->set_max_tokens(16);
  r.mutable_params()->mutable_sampling()->set_temperature(0.7f);
  r.mutable_params()->mutable_sampling()->set_top_p(1.0f);
  EXPECT_EQ(Message(r), "OK");
}

TEST(ValidationTest, CountsAndSizesNameTheirLimit) {
  ValidationLimits limits;
  limits.max_images_per_request = 2;
  limits.max_image_bytes = 10;
  limits.max_text_bytes = 8;
  limits.max_tokens_limit = 100;

  v1::ChatRequest r = TextRequest("hi");
  for (int i = 0; i < 3; ++i) AddImage(&r, "img");
  EXPECT_EQ(Message(r, limits), "request has 3 images; max_images_per_request is 2");

  r = TextRequest("hi");
  AddImage(&r, "ok");
  AddImage(&r, "01234567890");
  EXPECT_EQ(Message(r, limits), "image 2 is 11 bytes; max_image_bytes is 10");

  r = TextRequest("123456789");
  EXPECT_EQ(Message(r, limits), "text is 9 bytes; max_text_bytes is 8");

  r = TextRequest("hi");
  r.mutable_params()->set_max_tokens(101);
  EXPECT_EQ(Message(r, limits), "params.max_tokens is 101; must be in [1, max_tokens_limit=100]");
  r.mutable_params()->set_max_tokens(0);
  EXPECT_EQ(Message(r, limits), "params.max_tokens is 0; must be in [1, max_tokens_limit=100]");
}

TEST(ValidationTest, SamplingRanges) {
  auto with = [](auto set) {
    v1::ChatRequest r = TextRequest("hi");
    set(r.mutable_params()->mutable_sampling());
    return Message(r);
  };
  EXPECT_EQ(with([](auto* s) { s->set_temperature(-0.5f); }),
            "params.sampling.temperature is -0.5; must be >= 0 (0 means greedy)");
  EXPECT_EQ(with([](auto* s) { s->set_top_p(0.0f); }),
            "params.sampling.top_p is 0; must be in (0, 1]");
  EXPECT_EQ(with([](auto* s) { s->set_top_p(1.5f); }),
            "params.sampling.top_p is 1.5; must be in (0, 1]");
  EXPECT_EQ(with([](auto* s) { s->set_min_p(1.0f); }),
            "params.sampling.min_p is 1; must be in [0, 1)");
  EXPECT_EQ(with([](auto* s) { s->set_top_k(-1); }),
            "params.sampling.top_k is -1; must be >= 0 (0 disables)");
  EXPECT_EQ(with([](auto* s) { s->set_repetition_penalty(0.0f); }),
            "params.sampling.repetition_penalty is 0; must be > 0 (1 disables)");
  EXPECT_EQ(with([](auto* s) { s->set_presence_penalty(2.5f); }),
            "params.sampling.presence_penalty is 2.5; must be in [-2, 2]");
  EXPECT_EQ(with([](auto* s) { s->set_frequency_penalty(-3.0f); }),
            "params.sampling.frequency_penalty is -3; must be in [-2, 2]");
  EXPECT_EQ(with([](auto* s) { s->set_temperature(std::nanf("")); }),
            "params.sampling.temperature is not a finite number");
  EXPECT_EQ(with([](auto* s) { s->set_temperature(0.0f); }), "OK");
}

TEST(ValidationTest, ConversationShape) {
  v1::ChatRequest r;
  EXPECT_EQ(Message(r), "messages is empty; send at least one message");

  r = TextRequest("hi");
  r.mutable_messages(0)->set_role("robot");
  EXPECT_EQ(Message(r), "messages[0].role is \"robot\"; must be \"system\", \"user\", \"assistant\" or \"tool\"");

  r = TextRequest("hi");
  auto* sys = r.add_messages();
  sys->set_role("system");
  EXPECT_EQ(Message(r), "messages[1] is a system message; only the first message may be one");

  r = TextRequest("hi");
  auto* a = r.add_messages();
  a->set_role("assistant");
  a->add_content()->set_text("hello");
  EXPECT_EQ(Message(r), "the last message is an assistant message; end with a user message");

  r.Clear();
  auto* s2 = r.add_messages();
  s2->set_role("system");
  s2->add_content()->mutable_image()->set_data("x");
  r.add_messages()->set_role("user");
  EXPECT_EQ(Message(r), "image 1 is in a system message (messages[0]); images go in user messages");
}

TEST(ValidationTest, ImageSources) {
  v1::ChatRequest r = TextRequest("hi");
  r.mutable_messages(0)->add_content()->mutable_image();
  EXPECT_EQ(Message(r), "image 1 (messages[0].content[1]) has neither data nor content_hash");

  r = TextRequest("hi");
  AddImage(&r, "");
  EXPECT_EQ(Message(r), "image 1 has empty data");

  r = TextRequest("hi");
  r.mutable_messages(0)->add_content()->mutable_image()->set_content_hash("abc");
  EXPECT_EQ(Message(r), "image 1 content_hash \"abc\" is not a hex SHA-256 (64 hex digits)");

  r = TextRequest("hi");
  r.mutable_messages(0)->add_content()->mutable_image()->set_content_hash(std::string(64, 'A'));
  EXPECT_EQ(Message(r), "OK");

  r = TextRequest("hi");
  AddImage(&r, "x");
  auto* options = r.mutable_messages(0)->mutable_content(1)->mutable_image()->mutable_options();
  options->set_min_pixels(1000);
  options->set_max_pixels(10);
  EXPECT_EQ(Message(r), "image 1 options.min_pixels (1000) is larger than max_pixels (10)");
  r.mutable_image_options()->set_max_pixels(-1);
  EXPECT_EQ(Message(r), "image_options.max_pixels is -1; must be >= 0");
}

TEST(ValidationTest, StopStringsAndLogprobs) {
  ValidationLimits limits;
  limits.max_stop_strings = 1;
  v1::ChatRequest r = TextRequest("hi");
  r.mutable_params()->add_stop("a");
  r.mutable_params()->add_stop("b");
  EXPECT_EQ(Message(r, limits), "params.stop has 2 strings; max_stop_strings is 1");
  r = TextRequest("hi");
  r.mutable_params()->add_stop("");
  EXPECT_EQ(Message(r), "params.stop[0] is empty");
  r = TextRequest("hi");
  r.mutable_params()->set_top_logprobs(21);
  EXPECT_EQ(Message(r), "params.top_logprobs is 21; must be in [0, 20]");
}

}  // namespace
}  // namespace vlm::gateway
