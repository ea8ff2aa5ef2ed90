// The language routing policy alone (language_router.h): the conversation's
// route key, rendezvous affinity with the load bound, round robin, the
// memory of where conversations were served, and the router's start-up errors.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/gateway/language_router.h"
#include "services/gateway/router.h"

namespace vlm::gateway {
namespace {

v1::ChatRequest FirstTurn(const std::string& system, const std::string& text, int images) {
  v1::ChatRequest r;
  if (!system.empty()) {
    auto* s = r.add_messages();
    s->set_role("system");
    s->add_content()->set_text(system);
  }
  auto* m = r.add_messages();
  m->set_role("user");
  for (int i = 0; i < images; ++i) m->add_content()->mutable_image()->set_data("png bytes");
  m->add_content()->set_text(text);
  return r;
}

void AddTurn(v1::ChatRequest* r, const std::string& answer, const std::string& question) {
  auto* a = r->add_messages();
  a->set_role("assistant");
  a->add_content()->set_text(answer);
  auto* u = r->add_messages();
  u->set_role("user");
  u->add_content()->set_text(question);
}

TEST(ConversationRouteKeyTest, EveryTurnOfAConversationSharesTheKey) {
  v1::ChatRequest r = FirstTurn("Be brief.", "What is in the picture?", 1);
  const std::vector<std::string> one = {"aaaa"};
  const std::string key = ConversationRouteKey(r, one);
  AddTurn(&r, "A cat.", "What colour?");
  EXPECT_EQ(ConversationRouteKey(r, one), key);
  // A later turn's image does not change the key either.
  r.mutable_messages(r.messages_size() - 1)->add_content()->mutable_image()->set_data("x");
  EXPECT_EQ(ConversationRouteKey(r, {"aaaa", "bbbb"}), key);
}

TEST(ConversationRouteKeyTest, SystemPromptFirstUserTextAndImageHashesAllCount) {
  const std::string key = ConversationRouteKey(FirstTurn("Be brief.", "Hi", 1), {"aaaa"});
  EXPECT_NE(ConversationRouteKey(FirstTurn("Be long.", "Hi", 1), {"aaaa"}), key);
  EXPECT_NE(ConversationRouteKey(FirstTurn("", "Hi", 1), {"aaaa"}), key);
  EXPECT_NE(ConversationRouteKey(FirstTurn("Be brief.", "Hello", 1), {"aaaa"}), key);
  EXPECT_NE(ConversationRouteKey(FirstTurn("Be brief.", "Hi", 1), {"cccc"}), key);
  EXPECT_NE(ConversationRouteKey(FirstTurn("Be brief.", "Hi", 0), {}), key);
  // Framing: moving text between the system and the user message changes the key.
  EXPECT_NE(ConversationRouteKey(FirstTurn("ab", "c", 0), {}),
            ConversationRouteKey(FirstTurn("a", "bc", 0), {}));
}

std::vector<ReplicaLoad> Loads(std::map<std::string, int> loads) {
  std::vector<ReplicaLoad> out;
  for (const auto& [name, load] : loads) out.push_back({name, load});
  return out;
}

TEST(LoadBoundTest, NeedsBothTheAbsoluteAndTheRelativeExcess) {
  const LoadBound bound{2, 1.5};
  EXPECT_FALSE(OverLoadBound(2, 0, bound));   // within the slack
  EXPECT_TRUE(OverLoadBound(3, 0, bound));
  EXPECT_FALSE(OverLoadBound(20, 15, bound));  // 5 more, but only 1.33x
  EXPECT_TRUE(OverLoadBound(23, 15, bound));
  EXPECT_FALSE(OverLoadBound(1, 1, LoadBound{0, 1.0}));
  EXPECT_TRUE(OverLoadBound(2, 1, LoadBound{0, 1.0}));
}

TEST(PlanAffinityRouteTest, UnloadedReplicasFollowRendezvousOrder) {
  const std::vector<ReplicaLoad> replicas = Loads({{"a:1", 0}, {"b:1", 0}, {"c:1", 0}});
  for (int i = 0; i < 50; ++i) {
    const std::string key = absl::StrCat("conversation ", i);
    const RoutePlan plan = PlanAffinityRoute(key, replicas, LoadBound{});
    EXPECT_EQ(plan.order, RendezvousOrder(key, {"a:1", "b:1", "c:1"}));
    EXPECT_EQ(plan.route, "affinity");
  }
}

TEST(PlanAffinityRouteTest, HomeOverTheBoundHandsTheRequestToTheNextInHashOrder) {
  const std::string key = "conversation 7";
  const std::vector<std::string> order = RendezvousOrder(key, {"a:1", "b:1", "c:1"});
  // The home is busy, the second in hash order too: the third gets it.
  std::map<std::string, int> load = {{order[0], 6}, {order[1], 5}, {order[2], 1}};
  RoutePlan plan = PlanAffinityRoute(key, Loads(load), LoadBound{2, 1.5});
  EXPECT_EQ(plan.route, "load");
  EXPECT_EQ(plan.order, (std::vector<std::string>{order[2], order[0], order[1]}));
  // Only the home is busy: the second in hash order.
  load = {{order[0], 6}, {order[1], 2}, {order[2], 1}};
  plan = PlanAffinityRoute(key, Loads(load), LoadBound{2, 1.5});
  EXPECT_EQ(plan.route, "load");
  EXPECT_EQ(plan.order, (std::vector<std::string>{order[1], order[0], order[2]}));
  // Busy, but within the bound: it stays home.
  load = {{order[0], 3}, {order[1], 1}, {order[2], 1}};
  plan = PlanAffinityRoute(key, Loads(load), LoadBound{2, 1.5});
  EXPECT_EQ(plan.route, "affinity");
  EXPECT_EQ(plan.order, order);
}

TEST(PlanAffinityRouteTest, WhereTheConversationWasServedComesFirstUnlessOverloaded) {
  const std::string key = "conversation 3";
  const std::vector<std::string> order = RendezvousOrder(key, {"a:1", "b:1", "c:1"});
  RoutePlan plan = PlanAffinityRoute(key, Loads({{"a:1", 0}, {"b:1", 0}, {"c:1", 0}}),
                                     LoadBound{}, order[2]);
  EXPECT_EQ(plan.route, "affinity");
  EXPECT_EQ(plan.order, (std::vector<std::string>{order[2], order[0], order[1]}));
  // A remembered replica that is no longer routable is ignored.
  plan = PlanAffinityRoute(key, Loads({{"a:1", 0}, {"b:1", 0}, {"c:1", 0}}), LoadBound{}, "gone:1");
  EXPECT_EQ(plan.order, order);
  // Remembered but overloaded: the home (next preferred) takes it.
  std::map<std::string, int> load = {{order[0], 0}, {order[1], 0}, {order[2], 9}};
  plan = PlanAffinityRoute(key, Loads(load), LoadBound{}, order[2]);
  EXPECT_EQ(plan.route, "load");
  EXPECT_EQ(plan.order[0], order[0]);
}

// New conversations arriving while none finishes: the bound keeps every
// replica within slack (or factor x) of the least-loaded one, whatever the
// keys hash to.
TEST(PlanAffinityRouteTest, BurstOfNewConversationsSpreadsWithinTheBound) {
  for (const LoadBound bound : {LoadBound{0, 1.0}, LoadBound{1, 1.0}, LoadBound{2, 1.5}}) {
    std::map<std::string, int> load = {{"a:1", 0}, {"b:1", 0}, {"c:1", 0}};
    for (int i = 0; i < 60; ++i) {
      const RoutePlan plan = PlanAffinityRoute(absl::StrCat("burst ", i), Loads(load), bound);
      ++load[plan.order[0]];
      int least = load.begin()->second, most = least;
      for (const auto& [name, l] : load) least = std::min(least, l), most = std::max(most, l);
      EXPECT_LE(most, std::max<double>(least + bound.slack, bound.factor * least) + 1)
          << "after " << i + 1 << " conversations, slack " << bound.slack;
    }
  }
}

TEST(PlanAffinityRouteTest, KeysSpreadEvenlyAndARemovedReplicaMovesOnlyItsOwn) {
  std::map<std::string, int> count;
  std::map<std::string, std::string> home;
  const std::vector<ReplicaLoad> four = Loads({{"a:1", 0}, {"b:1", 0}, {"c:1", 0}, {"d:1", 0}});
  for (int i = 0; i < 2000; ++i) {
    const std::string key = absl::StrCat("k", i);
    home[key] = PlanAffinityRoute(key, four, LoadBound{}).order[0];
    ++count[home[key]];
  }
  for (const auto& [name, n] : count) EXPECT_NEAR(n, 500, 100) << name;
  const std::vector<ReplicaLoad> three = Loads({{"a:1", 0}, {"b:1", 0}, {"c:1", 0}});
  for (const auto& [key, was] : home) {
    const std::string now = PlanAffinityRoute(key, three, LoadBound{}).order[0];
    if (was != "d:1") EXPECT_EQ(now, was) << key;
  }
}

TEST(PlanRoundRobinRouteTest, CyclesOverTheReplicasByName) {
  const std::vector<ReplicaLoad> replicas = Loads({{"b:1", 5}, {"a:1", 0}});
  std::vector<std::string> firsts;
  for (uint64_t i = 0; i < 4; ++i) {
    const RoutePlan plan = PlanRoundRobinRoute(i, replicas);
    EXPECT_EQ(plan.route, "round_robin");
    EXPECT_EQ(plan.order.size(), 2u);
    firsts.push_back(plan.order[0]);
  }
  EXPECT_EQ(firsts, (std::vector<std::string>{"a:1", "b:1", "a:1", "b:1"}));
  EXPECT_TRUE(PlanRoundRobinRoute(0, {}).order.empty());
  EXPECT_TRUE(PlanAffinityRoute("k", {}, LoadBound{}).order.empty());
}

TEST(AffinityMemoryTest, RemembersTheLatestReplicaAndForgetsTheLeastRecentlyUsed) {
  AffinityMemory memory(2);
  memory.Remember("k1", "a:1");
  memory.Remember("k2", "b:1");
  EXPECT_EQ(memory.Recall("k1"), "a:1");  // k1 is now the newest
  memory.Remember("k3", "c:1");           // evicts k2
  EXPECT_EQ(memory.Recall("k2"), "");
  EXPECT_EQ(memory.Recall("k1"), "a:1");
  memory.Remember("k1", "c:1");
  EXPECT_EQ(memory.Recall("k1"), "c:1");
  EXPECT_EQ(memory.size(), 2u);
  AffinityMemory off(0);
  off.Remember("k", "a:1");
  EXPECT_EQ(off.Recall("k"), "");
}

TEST(LanguageRouterTest, EmptyOrUnresolvableReplicaListsAreStartUpErrors) {
  LanguageRouterOptions options;
  absl::StatusOr<std::unique_ptr<LanguageRouter>> r = LanguageRouter::Create(options, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("no language replica"), std::string::npos)
      << r.status().message();

  auto unresolvable = [](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", name));
  };
  options.static_targets = {"127.0.0.1:1", "nosuch.invalid:50053"};
  options.resolver = unresolvable;
  r = LanguageRouter::Create(options, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("\"127.0.0.1:1\" does not resolve"), std::string::npos)
      << r.status().message();

  options.static_targets.clear();
  options.dns_target = "language.invalid:50053";
  r = LanguageRouter::Create(options, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("--language_dns language.invalid:50053"), std::string::npos)
      << r.status().message();

  options.resolver = [](const std::string&) -> absl::StatusOr<std::vector<std::string>> {
    return std::vector<std::string>{};
  };
  EXPECT_EQ(LanguageRouter::Create(options, nullptr).status().code(), absl::StatusCode::kNotFound);

  options.dns_target.clear();
  options.static_targets = {"127.0.0.1:1"};
  options.resolver = ResolveHostPort;
  options.bound.factor = 0.5;
  EXPECT_EQ(LanguageRouter::Create(options, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LanguageRouterTest, ReplicasAreNotRoutedToBeforeTheyAnswer) {
  LanguageRouterOptions options;
  options.static_targets = {"127.0.0.1:1"};  // nothing listens there
  absl::StatusOr<std::unique_ptr<LanguageRouter>> r = LanguageRouter::Create(options, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)->Route("k").order.empty());
  const std::vector<BackendState> states = (*r)->Replicas();
  ASSERT_EQ(states.size(), 1u);
  EXPECT_NE(states[0].status, BackendStatus::kServing);
  EXPECT_NE((*r)->UnavailableReason().find("no language replica is SERVING (127.0.0.1:1 "),
            std::string::npos)
      << (*r)->UnavailableReason();
}

}  // namespace
}  // namespace vlm::gateway
