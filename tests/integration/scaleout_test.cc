// Scale-out over language replicas with the real processes on loopback
// (vlm-vision, several vlm-language, vlm-gateway on the tiny checkpoint):
//   - picture conversations keep returning to the replica holding their
//     prefix (cached_tokens of every follow-up turn >= 70% of the previous
//     turn's prompt), both replicas get a share, and after one replica is
//     SIGKILLed every conversation still gets its next answer;
//   - a replica whose slots are full sends new conversations to the other;
//   - an empty or unresolvable replica list stops the gateway at start with
//     a message saying so; a replica serving another model is not routed to.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "services/gateway/language_router.h"
#include "services/gateway/router.h"
#include "tests/integration/chat_request.h"
#include "tests/integration/service_process.h"
#include "tests/integration/test_png.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/gateway.grpc.pb.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm {
namespace {

using json = nlohmann::json;
using testing::Eventually;
using testing::ServiceProcess;

std::string BinaryDir() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return dir == nullptr ? std::string() : std::string(dir);
}

// vlm-vision, `languages` vlm-language replicas (checkpoint per replica) and
// a gateway over all of them.
class Stack {
 public:
  Stack(const std::string& name, const std::vector<std::string>& language_models,
        std::vector<std::string> language_flags, std::vector<std::string> gateway_flags)
      : log_dir_(testing::TestLogDir("scaleout_test") + "/" + name) {
    std::system(("mkdir -p " + log_dir_).c_str());
    const std::string model = BinaryDir() + "/tiny_checkpoint";
    vision_ = std::make_unique<ServiceProcess>(
        VLM_VISION_PATH,
        std::vector<std::string>{"--model_dir=" + model, "--grpc_address=127.0.0.1:0",
                                 "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                 "--drain_timeout_s=2"},
        log_dir_ + "/vision");
    for (size_t i = 0; i < language_models.size(); ++i) {
      std::vector<std::string> flags = {"--model_dir=" + BinaryDir() + "/" + language_models[i],
                                        "--grpc_address=127.0.0.1:0",
                                        "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                        "--drain_timeout_s=2"};
      flags.insert(flags.end(), language_flags.begin(), language_flags.end());
      languages_.push_back(std::make_unique<ServiceProcess>(
          VLM_LANGUAGE_PATH, flags, absl::StrCat(log_dir_, "/language-", i)));
    }
    gateway_flags_ = std::move(gateway_flags);
  }

  bool Start() {
    if (!vision_->WaitListening()) return false;
    std::vector<std::string> targets;
    // Every replica SERVING before the gateway starts: the gateway is SERVING
    // with one, and the tests count on all of them from the first request.
    for (auto& l : languages_) {
      if (!l->WaitListening() || !l->WaitServing("vlm.v1.Language", absl::Seconds(90))) return false;
      targets.push_back(l->grpc_target());
    }
    std::vector<std::string> flags = {
        "--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
        "--http_address=127.0.0.1:0", "--model_dir=" + BinaryDir() + "/tiny_checkpoint",
        "--language_targets=" + absl::StrJoin(targets, ","),
        "--vision_targets=" + vision_->grpc_target(), "--backend_reconnect_max_ms=200",
        "--language_info_refresh_ms=100", "--drain_timeout_s=2"};
    flags.insert(flags.end(), gateway_flags_.begin(), gateway_flags_.end());
    gateway_ = std::make_unique<ServiceProcess>(VLM_GATEWAY_PATH, flags, log_dir_ + "/gateway");
    if (!gateway_->WaitListening() || !gateway_->WaitServing("", absl::Seconds(90))) return false;
    http_port_ = testing::GatewayHttpPort(gateway_->Stdout());
    return http_port_ > 0;
  }

  std::string Logs() const {
    std::string out = "--- gateway ---\n" + (gateway_ ? gateway_->LogTail(20) : "");
    for (size_t i = 0; i < languages_.size(); ++i) {
      absl::StrAppend(&out, "--- language ", i, " ---\n", languages_[i]->LogTail(8));
    }
    return out;
  }

  // POST /v1/chat/completions; the status and the parsed body (null if none).
  std::pair<int, json> Post(const json& body) const {
    httplib::Client client("127.0.0.1", http_port_);
    client.set_read_timeout(60, 0);
    httplib::Result res =
        client.Post("/v1/chat/completions", body.dump(), "application/json");
    if (!res) return {0, json()};
    return {res->status, json::parse(res->body, nullptr, false)};
  }

  std::string GatewayMetrics() const {
    httplib::Client client("127.0.0.1", gateway_->metrics_port);
    httplib::Result res = client.Get("/metrics");
    return res && res->status == 200 ? res->body : "";
  }

  ServiceProcess& language(size_t i) { return *languages_[i]; }
  ServiceProcess& gateway() { return *gateway_; }

 private:
  std::string log_dir_;
  std::vector<std::string> gateway_flags_;
  std::unique_ptr<ServiceProcess> vision_;
  std::vector<std::unique_ptr<ServiceProcess>> languages_;
  std::unique_ptr<ServiceProcess> gateway_;
  int http_port_ = 0;
};

std::string DataUrl(const std::string& png) {
  return "data:image/png;base64," + absl::Base64Escape(png);
}

struct Conversation {
  json messages = json::array();
  std::vector<int> prompt_tokens;
  std::vector<int> cached_tokens;
  std::vector<std::string> replicas;
};

json Body(const Conversation& c, int max_tokens) {
  return json{{"model", "tiny_checkpoint"},
              {"messages", c.messages},
              {"max_tokens", max_tokens},
              {"ignore_eos", true},
              {"temperature", 0}};
}

// One turn: posts the conversation so far, records usage and the replica,
// appends the answer and `next_question`. Returns the HTTP status.
int Turn(const Stack& stack, Conversation* c, int max_tokens, const std::string& next_question,
         std::string* error) {
  auto [status, body] = stack.Post(Body(*c, max_tokens));
  if (status != 200 || body.is_discarded() || body.is_null()) {
    *error = absl::StrCat("HTTP ", status, ": ", body.is_discarded() ? "" : body.dump());
    return status;
  }
  c->prompt_tokens.push_back(body["usage"]["prompt_tokens"].get<int>());
  c->cached_tokens.push_back(body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>());
  c->replicas.push_back(body["x_vlm"]["language"]["replica"].get<std::string>());
  c->messages.push_back(
      {{"role", "assistant"}, {"content", body["choices"][0]["message"]["content"]}});
  c->messages.push_back({{"role", "user"}, {"content", next_question}});
  return status;
}

TEST(ScaleoutTest, PictureConversationsReturnToTheirReplicaAndSurviveAKill) {
  constexpr int kConversations = 8;
  Stack stack("conversations", {"tiny_checkpoint", "tiny_checkpoint"}, {}, {});
  ASSERT_TRUE(stack.Start()) << stack.Logs();
  std::vector<Conversation> conversations(kConversations);
  for (int i = 0; i < kConversations; ++i) {
    conversations[i].messages.push_back(
        {{"role", "system"}, {"content", "You describe pictures carefully."}});
    conversations[i].messages.push_back(
        {{"role", "user"},
         {"content",
          json::array({{{"type", "image_url"},
                        {"image_url", {{"url", DataUrl(testing::PatternPng(256, 256, i + 1))}}}},
                       {{"type", "text"}, {"text", absl::StrCat("Describe picture ", i, ".")}}})}});
  }
  // Turn 1: the conversations open at once (the load bound spreads them);
  // turns 2 and 3 interleave the conversations.
  std::vector<std::string> errors(kConversations);
  std::vector<std::thread> openers;
  for (int i = 0; i < kConversations; ++i) {
    openers.emplace_back([&, i] {
      EXPECT_EQ(Turn(stack, &conversations[i], 48, "What colours are in it?", &errors[i]), 200)
          << errors[i];
    });
  }
  for (auto& t : openers) t.join();
  ASSERT_FALSE(HasFailure()) << stack.Logs();
  for (const char* question : {"Is there text in it?", "Summarize it."}) {
    for (int i = 0; i < kConversations; ++i) {
      std::string error;
      ASSERT_EQ(Turn(stack, &conversations[i], 8, question, &error), 200) << error << stack.Logs();
    }
  }
  std::map<std::string, int> per_replica;
  for (int i = 0; i < kConversations; ++i) {
    const Conversation& c = conversations[i];
    ++per_replica[c.replicas[0]];
    for (int turn = 1; turn < 3; ++turn) {
      EXPECT_EQ(c.replicas[turn], c.replicas[0]) << "conversation " << i << " turn " << turn + 1;
      EXPECT_GE(c.cached_tokens[turn], 0.7 * c.prompt_tokens[turn - 1])
          << "conversation " << i << " turn " << turn + 1 << ": cached " << c.cached_tokens[turn]
          << " of the previous prompt's " << c.prompt_tokens[turn - 1] << " tokens";
    }
    std::printf("conversation %d on %s: prompt %d/%d/%d, cached %d/%d/%d\n", i,
                c.replicas[0].c_str(), c.prompt_tokens[0], c.prompt_tokens[1], c.prompt_tokens[2],
                c.cached_tokens[0], c.cached_tokens[1], c.cached_tokens[2]);
  }
  ASSERT_EQ(per_replica.size(), 2u) << "one replica served every conversation";
  for (const auto& [replica, n] : per_replica) {
    EXPECT_GE(n, kConversations / 4) << replica << " served " << n << " conversations";
  }
  const std::string metrics = stack.GatewayMetrics();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(metrics_text::MetricValue(
                  metrics, absl::StrCat("vlm_gateway_backend_serving{backend=\"language\",target=\"",
                                        stack.language(i).grpc_target(), "\"}")),
              std::optional<double>(1))
        << metrics;
  }
  EXPECT_TRUE(absl::StrContains(metrics, "vlm_gateway_language_requests_total{replica=\""));

  // One replica dies; every conversation's 4th turn is still answered.
  ASSERT_EQ(stack.language(0).Stop(SIGKILL), std::optional<int>(-SIGKILL));
  for (int i = 0; i < kConversations; ++i) {
    std::string error;
    EXPECT_EQ(Turn(stack, &conversations[i], 8, "Thanks.", &error), 200)
        << "conversation " << i << ": " << error << stack.Logs();
    if (!error.empty()) continue;
    EXPECT_EQ(conversations[i].replicas[3], stack.language(1).grpc_target());
  }
}

// Generate straight on a language replica (not through the gateway).
class DirectGeneration {
 public:
  DirectGeneration(const std::string& target, int max_tokens) {
    stub_ = v1::Language::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    v1::GenerateRequest request;
    auto* m = request.add_messages();
    m->set_role("user");
    m->add_content()->set_text("Tell me a very long story.");
    request.mutable_params()->set_max_tokens(max_tokens);
    request.mutable_params()->set_ignore_eos(true);
    request.set_add_generation_prompt(true);
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    reader_ = stub_->Generate(&context_, request);
    thread_ = std::thread([this] {
      v1::GenerateResponse r;
      while (reader_->Read(&r)) {
      }
      reader_->Finish().IgnoreError();
    });
  }
  ~DirectGeneration() {
    context_.TryCancel();
    thread_.join();
  }

 private:
  std::unique_ptr<v1::Language::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  std::thread thread_;
};

v1::ReplicaInfoResponse ReplicaInfo(const std::string& target) {
  auto stub = v1::Language::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::ReplicaInfoResponse info;
  stub->ReplicaInfo(&context, v1::ReplicaInfoRequest(), &info).IgnoreError();
  return info;
}

TEST(ScaleoutTest, AReplicaWithItsSlotsFullSendsNewConversationsToTheOther) {
  Stack stack("load", {"tiny_checkpoint", "tiny_checkpoint"}, {"--max_sequences=2", "--max_queue=8"},
              {});
  ASSERT_TRUE(stack.Start()) << stack.Logs();
  const std::string busy = stack.language(0).grpc_target();
  const std::string idle = stack.language(1).grpc_target();
  // Three sequences on `busy` (two slots, one waiting) against 0.
  std::vector<std::unique_ptr<DirectGeneration>> load;
  for (int i = 0; i < 3; ++i) load.push_back(std::make_unique<DirectGeneration>(busy, 8000));
  ASSERT_TRUE(Eventually(
      [&] {
        const v1::ReplicaInfoResponse info = ReplicaInfo(busy);
        // The load the gateway weighs is running + waiting; how the engine
        // splits the three between its slots and its queue at a given poll
        // depends on its step timing.
        return info.running() + info.waiting() == 3;
      },
      absl::Seconds(30)))
      << stack.Logs();
  EXPECT_FALSE(ReplicaInfo(busy).model_fingerprint().empty());
  absl::SleepFor(absl::Milliseconds(500));  // a few of the gateway's ReplicaInfo polls

  auto stub = v1::VisionLanguage::NewStub(
      grpc::CreateChannel(stack.gateway().grpc_target(), grpc::InsecureChannelCredentials()));
  int homed_on_busy = 0;
  for (int i = 0; homed_on_busy < 4 && i < 200; ++i) {
    const v1::ChatRequest request =
        testing::GreedyChat(absl::StrCat("New conversation ", i, "."), {}, 4);
    const std::string key = gateway::ConversationRouteKey(request, {});
    if (gateway::RendezvousOrder(key, {busy, idle})[0] != busy) continue;
    ++homed_on_busy;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::ChatResponse response;
    const grpc::Status s = stub->Chat(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message() << stack.Logs();
    EXPECT_EQ(response.language().replica(), idle) << "conversation " << i;
    EXPECT_EQ(response.language().route(), "load");
  }
  EXPECT_EQ(homed_on_busy, 4);
  load.clear();
  // Unloaded again, a conversation whose home is `busy` goes home.
  ASSERT_TRUE(Eventually(
      [&] {
        const v1::ReplicaInfoResponse info = ReplicaInfo(busy);
        return info.running() == 0 && info.waiting() == 0;
      },
      absl::Seconds(30)));
  absl::SleepFor(absl::Milliseconds(500));
  for (int i = 1000;; ++i) {
    const v1::ChatRequest request = testing::GreedyChat(absl::StrCat("Later ", i, "."), {}, 4);
    if (gateway::RendezvousOrder(gateway::ConversationRouteKey(request, {}), {busy, idle})[0] !=
        busy) {
      continue;
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::ChatResponse response;
    ASSERT_TRUE(stub->Chat(&context, request, &response).ok());
    EXPECT_EQ(response.language().replica(), busy);
    EXPECT_EQ(response.language().route(), "affinity");
    break;
  }
}

TEST(ScaleoutTest, EmptyOrUnresolvableReplicaListsStopTheGatewayAtStart) {
  const std::string dir = testing::TestLogDir("scaleout_test");
  struct Case {
    std::string flag;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"--language_targets=,", "no language replica"},
      {"--language_target=", "no language replica"},
      {"--language_targets=nosuch-replica.invalid:50053", "does not resolve"},
      {"--language_dns=nosuch-replicas.invalid:50053", "lists no language replica"},
      {"--language_targets=127.0.0.1:0", "not host:port with a non-zero port"},
      {"--language_routing=random", "expected affinity or round_robin"},
  };
  int n = 0;
  for (const Case& c : cases) {
    ServiceProcess gateway(VLM_GATEWAY_PATH,
                           {"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                            "--http_address=", c.flag},
                           absl::StrCat(dir, "/bad-", n++));
    EXPECT_EQ(gateway.WaitExit(absl::Seconds(20)), std::optional<int>(2)) << c.flag;
    EXPECT_TRUE(absl::StrContains(gateway.LogTail(), c.message)) << c.flag << ": "
                                                                 << gateway.LogTail();
  }
}

TEST(ScaleoutTest, AReplicaServingAnotherModelIsNotRoutedTo) {
  Stack stack("fingerprint", {"tiny_checkpoint", "tiny_checkpoint", "tiny_checkpoint_pe16"}, {}, {});
  ASSERT_TRUE(stack.Start()) << stack.Logs();
  const std::string other = stack.language(2).grpc_target();
  EXPECT_NE(ReplicaInfo(other).model_fingerprint(),
            ReplicaInfo(stack.language(0).grpc_target()).model_fingerprint());
  ASSERT_TRUE(Eventually(
      [&] {
        // Once every replica is known, the odd one out is `other` (before that,
        // a replica that answered first may briefly be the majority alone).
        for (absl::string_view line : absl::StrSplit(stack.gateway().LogTail(200), '\n')) {
          if (absl::StrContains(line, "serves another model") &&
              absl::StrContains(line, absl::StrCat("replica=", other))) {
            return true;
          }
        }
        return false;
      },
      absl::Seconds(10)))
      << stack.Logs();
  EXPECT_EQ(metrics_text::MetricValue(
                stack.GatewayMetrics(),
                absl::StrCat("vlm_gateway_backend_serving{backend=\"language\",target=\"", other, "\"}")),
            std::optional<double>(0));
  for (int i = 0; i < 8; ++i) {
    json body = {{"model", "tiny_checkpoint"},
                 {"messages", json::array({{{"role", "user"}, {"content", absl::StrCat("Hello ", i)}}})},
                 {"max_tokens", 3}};
    auto [status, response] = stack.Post(body);
    ASSERT_EQ(status, 200) << response.dump();
    EXPECT_NE(response["x_vlm"]["language"]["replica"].get<std::string>(), other);
  }
}

}  // namespace
}  // namespace vlm
