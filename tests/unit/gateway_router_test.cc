// Rendezvous hashing, target lists, DNS resolution and backend error mapping
// of the gateway (services/gateway/router.h, backend_call.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "services/gateway/backend_call.h"
#include "services/gateway/backend_health.h"
#include "services/gateway/router.h"

namespace vlm::gateway {
namespace {

std::vector<std::string> Replicas(int n) {
  std::vector<std::string> r;
  for (int i = 0; i < n; ++i) r.push_back(absl::StrCat("10.0.0.", i + 1, ":50052"));
  return r;
}

std::string Key(int i) { return Sha256Hex(absl::StrCat("image-", i)); }

TEST(RendezvousTest, WeightIsTheFirstEightBytesOfSha256OfReplicaNewlineKey) {
  // Independent of the implementation: the digest from the one-shot function.
  const Sha256Digest d = Sha256("10.0.0.1:50052\nabc");
  uint64_t expected = 0;
  for (int i = 0; i < 8; ++i) expected = (expected << 8) | d[i];
  EXPECT_EQ(RendezvousWeight("10.0.0.1:50052", "abc"), expected);
}

TEST(RendezvousTest, OrderIsAPermutationByDecreasingWeight) {
  const std::vector<std::string> replicas = Replicas(5);
  const std::vector<std::string> order = RendezvousOrder(Key(7), replicas);
  ASSERT_EQ(order.size(), replicas.size());
  EXPECT_EQ(std::set<std::string>(order.begin(), order.end()),
            std::set<std::string>(replicas.begin(), replicas.end()));
  for (size_t i = 1; i < order.size(); ++i) {
    EXPECT_GE(RendezvousWeight(order[i - 1], Key(7)), RendezvousWeight(order[i], Key(7)));
  }
}

TEST(RendezvousTest, SameKeySameOrderWhateverTheInputOrder) {
  std::vector<std::string> replicas = Replicas(4);
  const std::vector<std::string> a = RendezvousOrder(Key(1), replicas);
  std::reverse(replicas.begin(), replicas.end());
  EXPECT_EQ(RendezvousOrder(Key(1), replicas), a);
}

TEST(RendezvousTest, KeysSpreadOverReplicas) {
  const std::vector<std::string> replicas = Replicas(4);
  std::map<std::string, int> first;
  const int keys = 4000;
  for (int i = 0; i < keys; ++i) ++first[RendezvousOrder(Key(i), replicas)[0]];
  ASSERT_EQ(first.size(), 4u);
  for (const auto& [replica, n] : first) {
    // Expected 1000 each; a fair hash stays well within +-15%.
    EXPECT_GT(n, 850) << replica;
    EXPECT_LT(n, 1150) << replica;
  }
}

TEST(RendezvousTest, RemovingAReplicaMovesOnlyItsKeysToTheirSecondChoice) {
  const std::vector<std::string> replicas = Replicas(4);
  std::vector<std::string> without = replicas;
  without.erase(without.begin() + 2);  // 10.0.0.3 goes away
  for (int i = 0; i < 1000; ++i) {
    const std::vector<std::string> before = RendezvousOrder(Key(i), replicas);
    const std::string after = RendezvousOrder(Key(i), without)[0];
    if (before[0] == replicas[2]) {
      EXPECT_EQ(after, before[1]) << "key " << i;
    } else {
      EXPECT_EQ(after, before[0]) << "key " << i;
    }
  }
}

TEST(RendezvousTest, AddingAReplicaMovesAboutAFairShare) {
  const std::vector<std::string> replicas = Replicas(3);
  std::vector<std::string> more = replicas;
  more.push_back("10.0.0.99:50052");
  int moved = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::string before = RendezvousOrder(Key(i), replicas)[0];
    const std::string after = RendezvousOrder(Key(i), more)[0];
    if (before != after) {
      ++moved;
      EXPECT_EQ(after, "10.0.0.99:50052") << "a key moved between old replicas";
    }
  }
  EXPECT_GT(moved, 600);  // about 3000/4 = 750
  EXPECT_LT(moved, 900);
}

TEST(TargetListTest, ParsesTrimsAndDeduplicates) {
  absl::StatusOr<std::vector<std::string>> t =
      ParseTargetList(" 127.0.0.1:50052, vision-1:7000,,127.0.0.1:50052 ,[::1]:9 ");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, (std::vector<std::string>{"127.0.0.1:50052", "vision-1:7000", "[::1]:9"}));
}

TEST(TargetListTest, RefusesEntriesWithoutAPort) {
  for (const char* bad : {"localhost", "localhost:0", ":50052", "host:port"}) {
    absl::StatusOr<std::vector<std::string>> t = ParseTargetList(bad);
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("host:port"), std::string::npos) << t.status();
  }
}

TEST(ResolveTest, ResolvesLiteralsAndLocalhost) {
  absl::StatusOr<std::vector<std::string>> v4 = ResolveHostPort("127.0.0.1:50052");
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(*v4, std::vector<std::string>{"127.0.0.1:50052"});
  absl::StatusOr<std::vector<std::string>> v6 = ResolveHostPort("[::1]:7");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(*v6, std::vector<std::string>{"[::1]:7"});
  absl::StatusOr<std::vector<std::string>> local = ResolveHostPort("localhost:80");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_FALSE(local->empty());
  for (const std::string& a : *local) EXPECT_TRUE(a == "127.0.0.1:80" || a == "[::1]:80") << a;
}

TEST(ResolveTest, UnknownNameIsUnavailable) {
  absl::StatusOr<std::vector<std::string>> r = ResolveHostPort("no-such-host.invalid:50052");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("no-such-host.invalid"), std::string::npos);
}

TEST(ReadinessRuleTest, NeedsOneLanguageAndOneVisionReplicaServing) {
  const BackendState lang_ok{"l:1", BackendStatus::kServing, ""};
  const BackendState lang_warm{"l:1", BackendStatus::kNotServing, ""};
  const BackendState lang_other{"l:2", BackendStatus::kNotServing, "serves another model"};
  const BackendState v_ok{"v:1", BackendStatus::kServing, ""};
  const BackendState v_down{"v:2", BackendStatus::kUnreachable, "connection refused"};
  EXPECT_TRUE(EvaluateReadiness({lang_ok}, {v_down, v_ok}).ok());
  EXPECT_TRUE(EvaluateReadiness({lang_warm, lang_ok}, {v_ok}).ok());
  absl::Status s = EvaluateReadiness({lang_warm}, {v_ok});
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "language service l:1 is NOT_SERVING");
  s = EvaluateReadiness({lang_warm, lang_other}, {v_ok});
  EXPECT_EQ(s.message(),
            "no language replica is SERVING: l:1 NOT_SERVING; l:2 NOT_SERVING (serves another model)");
  s = EvaluateReadiness({lang_ok}, {v_down});
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "no vision replica is SERVING: v:2 unreachable (connection refused)");
  EXPECT_FALSE(EvaluateReadiness({lang_ok}, {}).ok());
  EXPECT_EQ(EvaluateReadiness({}, {v_ok}).message(), "no language replica is known");
}

TEST(ErrorMappingTest, VisionErrorsNameTheImageAndKeepMeaningfulCodes) {
  grpc::Status s = MapVisionError(2, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                                  "image is 9000x9000 pixels; max is 4096x4096"),
                                  "v:1", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "image 2: image is 9000x9000 pixels; max is 4096x4096");

  s = MapVisionError(1, grpc::Status(grpc::StatusCode::UNAVAILABLE, "Connection refused"), "v:2", 3);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(s.error_message(),
            "image 1: vision service unavailable after 3 attempts (last replica v:2): "
            "Connection refused");

  s = MapVisionError(3, grpc::Status(grpc::StatusCode::UNKNOWN, "boom"), "v:1", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(s.error_message(), "image 3: vision service failed (UNKNOWN): boom");
}

TEST(ErrorMappingTest, LanguageErrorsSayItWasTheLanguageService) {
  grpc::Status s = MapLanguageError(grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed"), 7);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(s.error_message(), "language service unavailable: Socket closed (after 7 streamed chunks)");
  s = MapLanguageError(grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed"), 0,
                       "vlm-language:50051");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(s.error_message(), "language service unavailable (vlm-language:50051): Socket closed");
  s = MapLanguageError(grpc::Status(grpc::StatusCode::UNKNOWN, ""), 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL);
  s = MapLanguageError(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "2 sequences running"), 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "language service is at capacity: 2 sequences running");
  s = MapLanguageError(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded"), 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

}  // namespace
}  // namespace vlm::gateway
