// vlm-language and its packed-weight file, as an operator runs them on the
// tiny checkpoint: `--pack_only` builds the file and exits 0 (an init
// container), a server then maps it (the log says so) and answers; a
// truncated file is rejected with its reason logged and the server still
// answers; `--pack_only` with no directory fails with exit code 1.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "tests/integration/service_process.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm {
namespace {

namespace fs = std::filesystem;
using testing::ServiceProcess;

std::string TinyCheckpoint() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return std::string(dir ? dir : ".") + "/tiny_checkpoint";
}

class PackedStartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/vlm_packed_start_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::unique_ptr<ServiceProcess> Run(const std::string& name, std::vector<std::string> flags) {
    std::vector<std::string> args = {"--model_dir=" + TinyCheckpoint(),
                                     "--grpc_address=127.0.0.1:0",
                                     "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                     "--weight_dtype=int8"};
    args.insert(args.end(), flags.begin(), flags.end());
    log_ = testing::TestLogDir("packed_start_test") + "/" + name;
    return std::make_unique<ServiceProcess>(VLM_LANGUAGE_PATH, args, log_);
  }
  std::string Log() const { return testing::ReadFile(log_ + ".err") + testing::ReadFile(log_ + ".out"); }

  std::string PackedFile() const {
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() == ".vlmpack") return e.path().string();
    }
    return "";
  }

  // One greedy request of 4 tokens; OK and 4 tokens back.
  void ExpectAnswers(ServiceProcess& server) {
    auto channel = grpc::CreateChannel(server.grpc_target(), grpc::InsecureChannelCredentials());
    auto stub = v1::Language::NewStub(channel);
    v1::GenerateRequest r;
    r.set_add_generation_prompt(true);
    v1::LanguageMessage* m = r.add_messages();
    m->set_role("user");
    m->add_content()->set_text("Name three colours.");
    r.mutable_params()->set_max_tokens(4);
    r.mutable_params()->mutable_sampling()->set_temperature(0.0f);
    r.mutable_params()->set_ignore_eos(true);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub->Generate(&context, r);
    v1::GenerateResponse response;
    int tokens = 0;
    while (reader->Read(&response)) tokens += response.token_ids_size();
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(tokens, 4);
  }

  std::string dir_, log_;
};

TEST_F(PackedStartTest, PackOnlyBuildsTheFileThatTheServerThenMaps) {
  {
    auto pack = Run("pack_only", {"--pack_only", "--packed_cache_dir=" + dir_});
    EXPECT_EQ(pack->WaitExit(absl::Seconds(120)), 0) << Log();
    EXPECT_TRUE(absl::StrContains(Log(), "packed weights built")) << Log();
  }
  ASSERT_FALSE(PackedFile().empty());
  auto server = Run("mapped", {"--packed_cache_dir=" + dir_});
  ASSERT_TRUE(server->WaitListening(absl::Seconds(60))) << Log();
  ASSERT_TRUE(server->WaitServing("vlm.v1.Language", absl::Seconds(120))) << Log();
  EXPECT_TRUE(absl::StrContains(Log(), "packed weights mapped")) << Log();
  EXPECT_FALSE(absl::StrContains(Log(), "packed weights built")) << Log();
  ExpectAnswers(*server);
}

TEST_F(PackedStartTest, TruncatedFileIsRejectedAndTheServerStillAnswers) {
  {
    auto pack = Run("pack_before_truncation", {"--pack_only", "--packed_cache_dir=" + dir_});
    ASSERT_EQ(pack->WaitExit(absl::Seconds(120)), 0) << Log();
  }
  const std::string path = PackedFile();
  ASSERT_FALSE(path.empty());
  fs::resize_file(path, 1000);
  auto server = Run("truncated", {"--packed_cache_dir=" + dir_});
  ASSERT_TRUE(server->WaitListening(absl::Seconds(60))) << Log();
  ASSERT_TRUE(server->WaitServing("vlm.v1.Language", absl::Seconds(120))) << Log();
  const std::string log = Log();
  EXPECT_TRUE(absl::StrContains(log, "packed weights rejected")) << log;
  EXPECT_TRUE(absl::StrContains(log, "reason=truncated")) << log;
  EXPECT_TRUE(absl::StrContains(log, "packed weights built")) << log;  // rewritten
  EXPECT_GT(fs::file_size(path), 1000u);
  ExpectAnswers(*server);
}

TEST_F(PackedStartTest, PackOnlyWithoutADirectoryFails) {
  auto pack = Run("pack_only_no_dir", {"--pack_only", "--packed_cache_dir="});
  EXPECT_EQ(pack->WaitExit(absl::Seconds(120)), 1) << Log();
  EXPECT_TRUE(absl::StrContains(Log(), "needs a --packed_cache_dir")) << Log();
}

}  // namespace
}  // namespace vlm
