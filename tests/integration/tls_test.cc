// TLS and mutual TLS with certificates made by `openssl` at test time
// (tests/integration/pki.h), against real processes on loopback:
//   - vlm-test-server (the server bootstrap every service uses) with
//     --tls_cert/--tls_key/--tls_client_ca: plaintext refused, a client
//     without a certificate or with one from another CA refused, a server from
//     an untrusted CA or with the wrong name refused, mTLS works, replaced
//     certificate files are served without a restart, bad files fail the start;
//   - the whole system with mTLS on every hop: vision and language require
//     client certificates, the gateway presents one (--backend_tls_*), and
//     vlm-client and vlm-health-probe reach TLS ports with their --tls flags.
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_context.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/integration/pki.h"
#include "tests/integration/service_process.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm {
namespace {

namespace fs = std::filesystem;
using testing::Eventually;
using testing::Pki;
using testing::ServiceProcess;

constexpr char kBackendName[] = "vlm-backend";  // the name in the servers' certificates

// The outcome of one health Check over `credentials`: the status, and the
// server certificate's common name as the client saw it.
struct CheckResult {
  grpc::Status status;
  std::string serving;      // "SERVING", ... when status is OK
  std::string peer_name;    // x509_common_name of the server
};

CheckResult Check(const std::string& target, const TlsChannelFiles& tls,
                  const std::string& service = "") {
  CheckResult result;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(tls);
  if (!credentials.ok()) {
    result.status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 std::string(credentials.status().message()));
    return result;
  }
  grpc::ChannelArguments args;
  ApplyTlsChannelArgs(tls, &args);
  // A fresh connection per check (no subchannel shared with an earlier one).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateCustomChannel(target, *credentials, args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  result.status = stub->Check(&ctx, request, &response);
  if (result.status.ok()) {
    result.serving = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (auth != nullptr) {
      for (const grpc::string_ref& name : auth->FindPropertyValues("x509_common_name")) {
        result.peer_name.assign(name.data(), name.size());
      }
    }
  }
  return result;
}

std::string LogDir() { return testing::TestLogDir("tls_test"); }

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = std::make_unique<Pki>(LogDir() + "/pki");
    ASSERT_TRUE(pki_->MakeCa("ca") && pki_->MakeCa("other-ca")) << "openssl failed";
    ASSERT_TRUE(pki_->MakeLeaf("server", kBackendName,
                               "DNS:vlm-backend,DNS:localhost,IP:127.0.0.1", "ca"));
    ASSERT_TRUE(pki_->MakeLeaf("server-rotated", "vlm-backend-rotated",
                               "DNS:vlm-backend,DNS:localhost,IP:127.0.0.1", "ca"));
    ASSERT_TRUE(pki_->MakeLeaf("client", "vlm-gateway", "DNS:vlm-gateway", "ca"));
    ASSERT_TRUE(pki_->MakeLeaf("rogue-client", "vlm-gateway", "DNS:vlm-gateway", "other-ca"));
    ASSERT_TRUE(pki_->MakeLeaf("rogue-server", kBackendName,
                               "DNS:vlm-backend,DNS:localhost,IP:127.0.0.1", "other-ca"));
    server_ = std::make_unique<ServiceProcess>(
        VLM_TEST_SERVER_PATH,
        std::vector<std::string>{"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                                 "--tls_cert=" + pki_->cert("server"),
                                 "--tls_key=" + pki_->key("server"),
                                 "--tls_client_ca=" + pki_->cert("ca")},
        LogDir() + "/mtls-server");
    ASSERT_TRUE(server_->WaitListening()) << server_->LogTail();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(SIGTERM), std::optional<int>(0));
    }
    server_.reset();
    pki_.reset();
  }

  // A client that trusts `ca` and presents `client` ("" = no certificate).
  static TlsChannelFiles Client(const std::string& ca, const std::string& client) {
    TlsChannelFiles tls;
    tls.ca = pki_->cert(ca);
    if (!client.empty()) {
      tls.cert = pki_->cert(client);
      tls.key = pki_->key(client);
    }
    tls.server_name = kBackendName;
    return tls;
  }

  static inline std::unique_ptr<Pki> pki_;
  static inline std::unique_ptr<ServiceProcess> server_;
};

TEST_F(TlsTest, MutualTlsServesHealthAndRpcsAndShowsTheServerCertificate) {
  const CheckResult health = Check(server_->grpc_target(), Client("ca", "client"));
  ASSERT_TRUE(health.status.ok()) << health.status.error_message();
  EXPECT_EQ(health.serving, "SERVING");
  EXPECT_EQ(health.peer_name, kBackendName);

  // An ordinary RPC over the same kind of channel.
  TlsChannelFiles tls = Client("ca", "client");
  grpc::ChannelArguments args;
  ApplyTlsChannelArgs(tls, &args);
  auto stub = v1::VisionEncoder::NewStub(
      grpc::CreateCustomChannel(server_->grpc_target(), *MakeChannelCredentials(tls), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::EncodeRequest request;
  request.set_content_hash("over-mtls");
  v1::EncodeResponse response;
  const grpc::Status status = stub->Encode(&ctx, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.features().content_hash(), "over-mtls");
}

TEST_F(TlsTest, PlaintextClientIsRefused) {
  const CheckResult plain = Check(server_->grpc_target(), TlsChannelFiles{});
  EXPECT_EQ(plain.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << plain.status.error_message();
}

TEST_F(TlsTest, ClientWithoutACertificateIsRefused) {
  const CheckResult anonymous = Check(server_->grpc_target(), Client("ca", ""));
  EXPECT_EQ(anonymous.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << anonymous.status.error_message();
}

TEST_F(TlsTest, ClientCertificateFromAnotherCaIsRefused) {
  const CheckResult rogue = Check(server_->grpc_target(), Client("ca", "rogue-client"));
  EXPECT_EQ(rogue.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << rogue.status.error_message();
}

TEST_F(TlsTest, ServerFromAnUntrustedCaIsRefused) {
  // The client trusts only other-ca; the server's certificate comes from ca.
  const CheckResult wrong_ca = Check(server_->grpc_target(), Client("other-ca", "client"));
  EXPECT_FALSE(wrong_ca.status.ok());
  EXPECT_TRUE(absl::StrContains(wrong_ca.status.error_message(), "certificate verify failed"))
      << wrong_ca.status.error_message();
}

TEST_F(TlsTest, ServerNameMustMatchTheCertificate) {
  TlsChannelFiles tls = Client("ca", "client");
  tls.server_name = "someone-else";
  const CheckResult mismatch = Check(server_->grpc_target(), tls);
  EXPECT_FALSE(mismatch.status.ok());
  EXPECT_TRUE(absl::StrContains(mismatch.status.error_message(), "Hostname Verification"))
      << mismatch.status.error_message();
  // Without an override the target's host (127.0.0.1, in the certificate's SANs) is checked.
  tls.server_name = "";
  EXPECT_TRUE(Check(server_->grpc_target(), tls).status.ok());
}

TEST_F(TlsTest, ServerWithoutClientCaAcceptsClientsWithoutCertificates) {
  ServiceProcess one_way(VLM_TEST_SERVER_PATH,
                         {"--grpc_address=127.0.0.1:0", "--metrics_address=",
                          "--tls_cert=" + pki_->cert("server"), "--tls_key=" + pki_->key("server")},
                         LogDir() + "/one-way-server");
  ASSERT_TRUE(one_way.WaitListening()) << one_way.LogTail();
  EXPECT_TRUE(Check(one_way.grpc_target(), Client("ca", "")).status.ok());
  EXPECT_EQ(Check(one_way.grpc_target(), TlsChannelFiles{}).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ReplacedCertificateFilesAreServedWithoutARestart) {
  // The server reads copies that the test replaces, as cert-manager rewrites a Secret.
  const std::string dir = LogDir() + "/rotation";
  fs::create_directories(dir);
  const std::string cert = dir + "/tls.crt";
  const std::string key = dir + "/tls.key";
  fs::copy_file(pki_->cert("server"), cert, fs::copy_options::overwrite_existing);
  fs::copy_file(pki_->key("server"), key, fs::copy_options::overwrite_existing);
  ServiceProcess server(VLM_TEST_SERVER_PATH,
                        {"--grpc_address=127.0.0.1:0", "--metrics_address=", "--tls_cert=" + cert,
                         "--tls_key=" + key, "--tls_client_ca=" + pki_->cert("ca"),
                         "--tls_refresh_s=1"},
                        LogDir() + "/rotating-server");
  ASSERT_TRUE(server.WaitListening()) << server.LogTail();
  CheckResult before = Check(server.grpc_target(), Client("ca", "client"));
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  EXPECT_EQ(before.peer_name, kBackendName);

  // Replace both files, each by an atomic rename.
  fs::copy_file(pki_->cert("server-rotated"), cert + ".new", fs::copy_options::overwrite_existing);
  fs::copy_file(pki_->key("server-rotated"), key + ".new", fs::copy_options::overwrite_existing);
  fs::rename(key + ".new", key);
  fs::rename(cert + ".new", cert);
  std::string seen;
  EXPECT_TRUE(Eventually(
      [&] {
        const CheckResult now = Check(server.grpc_target(), Client("ca", "client"));
        seen = now.status.ok() ? now.peer_name : now.status.error_message();
        return seen == "vlm-backend-rotated";
      },
      absl::Seconds(15)))
      << "last seen: " << seen << "\n"
      << server.LogTail();
  EXPECT_FALSE(server.Exited());
}

TEST_F(TlsTest, BadTlsFilesFailTheStartWithAMessageNamingTheFile) {
  struct Case {
    std::vector<std::string> flags;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--tls_cert=" + pki_->cert("server"), "--tls_key=" + pki_->key("client")},
       "does not belong to the certificate"},
      {{"--tls_cert=" + pki_->dir() + "/missing.crt", "--tls_key=" + pki_->key("server")},
       "cannot read certificate " + pki_->dir() + "/missing.crt"},
      {{"--tls_cert=" + pki_->cert("server")}, "needs both --tls_cert and --tls_key"},
      {{"--tls_client_ca=" + pki_->cert("ca")}, "needs both --tls_cert and --tls_key"},
      {{"--tls_cert=" + pki_->cert("server"), "--tls_key=" + pki_->key("server"),
        "--tls_client_ca=" + pki_->key("ca")},
       "holds no PEM certificate"},
  };
  int n = 0;
  for (const Case& c : cases) {
    std::vector<std::string> flags = {"--grpc_address=127.0.0.1:0", "--metrics_address="};
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    ServiceProcess bad(VLM_TEST_SERVER_PATH, flags, LogDir() + "/bad-" + std::to_string(++n));
    EXPECT_FALSE(bad.WaitListening(absl::Seconds(20))) << c.message;
    EXPECT_EQ(bad.WaitExit(absl::Seconds(10)), std::optional<int>(1)) << c.message;
    EXPECT_TRUE(absl::StrContains(bad.LogTail(), c.message)) << bad.LogTail();
  }
}

// --- the whole system over mTLS ------------------------------------------------

std::string TinyCheckpoint() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return dir != nullptr ? std::string(dir) + "/tiny_checkpoint" : "";
}

// Runs a command-line tool to its exit; returns {exit code, stdout}.
std::pair<std::optional<int>, std::string> RunTool(const std::string& binary,
                                                   const std::vector<std::string>& args,
                                                   const std::string& name) {
  ServiceProcess tool(binary, args, LogDir() + "/" + name);
  std::optional<int> code = tool.WaitExit(absl::Seconds(60));
  return {code, tool.Stdout() + tool.LogTail(5)};
}

TEST(TlsStackTest, EveryHopUsesMutualTlsAndClientsConnectWithTheirTlsFlags) {
  Pki pki(LogDir() + "/stack-pki");
  ASSERT_TRUE(pki.MakeCa("ca"));
  // One certificate per service, as cert-manager issues them. The gateway
  // reaches vision replicas by address, so both backends also carry the name
  // it checks (--backend_tls_server_name).
  ASSERT_TRUE(pki.MakeLeaf("vision", "vlm-vision", "DNS:vlm-vision,DNS:vlm-backend", "ca"));
  ASSERT_TRUE(pki.MakeLeaf("language", "vlm-language", "DNS:vlm-language,DNS:vlm-backend", "ca"));
  ASSERT_TRUE(pki.MakeLeaf("gateway", "vlm-gateway", "DNS:vlm-gateway,IP:127.0.0.1", "ca"));
  ASSERT_TRUE(pki.MakeLeaf("user", "user", "DNS:user", "ca"));
  auto server_tls = [&](const std::string& name) {
    return std::vector<std::string>{"--tls_cert=" + pki.cert(name), "--tls_key=" + pki.key(name),
                                    "--tls_client_ca=" + pki.cert("ca")};
  };
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<std::string> common = {"--grpc_address=127.0.0.1:0",
                                           "--metrics_address=127.0.0.1:0", "--drain_timeout_s=2"};
  ServiceProcess vision(VLM_VISION_PATH,
                        with(with(common, server_tls("vision")),
                             {"--model_dir=" + TinyCheckpoint(), "--intra_op_threads=1"}),
                        LogDir() + "/stack-vision");
  ServiceProcess language(VLM_LANGUAGE_PATH,
                          with(with(common, server_tls("language")),
                               {"--model_dir=" + TinyCheckpoint(), "--intra_op_threads=1"}),
                          LogDir() + "/stack-language");
  ASSERT_TRUE(vision.WaitListening()) << vision.LogTail();
  ASSERT_TRUE(language.WaitListening()) << language.LogTail();
  const std::vector<std::string> backends = {"--http_address=127.0.0.1:0",
                                             "--language_target=" + language.grpc_target(),
                                             "--vision_targets=" + vision.grpc_target(),
                                             "--backend_reconnect_max_ms=200"};
  ServiceProcess gateway(
      VLM_GATEWAY_PATH,
      with(with(with(common, server_tls("gateway")), backends),
           {"--backend_tls_ca=" + pki.cert("ca"), "--backend_tls_cert=" + pki.cert("gateway"),
            "--backend_tls_key=" + pki.key("gateway"), "--backend_tls_server_name=vlm-backend"}),
      LogDir() + "/stack-gateway");
  // The same backends seen by a gateway that speaks plaintext to them.
  ServiceProcess plaintext_gateway(VLM_GATEWAY_PATH, with(common, backends),
                                   LogDir() + "/stack-plaintext-gateway");
  ASSERT_TRUE(gateway.WaitListening()) << gateway.LogTail();
  ASSERT_TRUE(plaintext_gateway.WaitListening()) << plaintext_gateway.LogTail();

  // vlm-client: connection options before the subcommand.
  const std::vector<std::string> user_tls = {"--target", gateway.grpc_target(),
                                             "--tls-ca", pki.cert("ca"),
                                             "--tls-cert", pki.cert("user"),
                                             "--tls-key", pki.key("user")};
  auto [health_code, health_out] =
      RunTool(VLM_CLIENT_PATH, with(user_tls, {"health", "--wait", "60"}), "client-health");
  EXPECT_EQ(health_code, std::optional<int>(0)) << health_out << gateway.LogTail();
  EXPECT_TRUE(absl::StartsWith(health_out, "SERVING")) << health_out;

  auto [chat_code, chat_out] = RunTool(
      VLM_CLIENT_PATH, with(user_tls, {"--max-tokens", "4", "--temperature", "0", "Hello"}),
      "client-chat");
  EXPECT_EQ(chat_code, std::optional<int>(0)) << chat_out << gateway.LogTail();

  // Without a client certificate the gateway refuses the client.
  auto [anonymous_code, anonymous_out] = RunTool(
      VLM_CLIENT_PATH, {"--target", gateway.grpc_target(), "--tls-ca", pki.cert("ca"), "health"},
      "client-anonymous");
  EXPECT_EQ(anonymous_code, std::optional<int>(1)) << anonymous_out;
  EXPECT_TRUE(absl::StrContains(anonymous_out, "error: UNAVAILABLE")) << anonymous_out;

  // The probe used by containers reaches a TLS backend with its flags, not without.
  auto [probe_code, probe_out] = RunTool(
      VLM_HEALTH_PROBE_PATH,
      {"--addr=" + language.grpc_target(), "--service=vlm.v1.Language", "--tls_ca=" + pki.cert("ca"),
       "--tls_cert=" + pki.cert("user"), "--tls_key=" + pki.key("user"),
       "--tls_server_name=vlm-language"},
      "probe-tls");
  EXPECT_EQ(probe_code, std::optional<int>(0)) << probe_out;
  EXPECT_TRUE(absl::StrContains(probe_out, ": SERVING")) << probe_out;
  auto [plain_probe_code, plain_probe_out] = RunTool(
      VLM_HEALTH_PROBE_PATH, {"--addr=" + language.grpc_target(), "--service=vlm.v1.Language"},
      "probe-plaintext");
  EXPECT_EQ(plain_probe_code, std::optional<int>(2)) << plain_probe_out;

  // The plaintext gateway never sees its backends: it stays NOT_SERVING, saying why.
  auto [plain_code, plain_out] =
      RunTool(VLM_CLIENT_PATH,
              {"--target", plaintext_gateway.grpc_target(), "health", "--wait", "2"},
              "client-plaintext-gateway");
  EXPECT_EQ(plain_code, std::optional<int>(1)) << plain_out;
  EXPECT_TRUE(absl::StartsWith(plain_out, "NOT_SERVING")) << plain_out;

  for (ServiceProcess* p : {&plaintext_gateway, &gateway, &vision, &language}) {
    EXPECT_EQ(p->Stop(SIGTERM, absl::Seconds(20)), std::optional<int>(0)) << p->LogTail();
  }
}

}  // namespace
}  // namespace vlm
