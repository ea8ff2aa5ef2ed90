#include "common/readiness.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

TEST(ReadinessTest, NothingRegisteredIsNotReady) {
  Readiness readiness;
  EXPECT_FALSE(readiness.IsServing());
  EXPECT_EQ(readiness.Check().code(), absl::StatusCode::kUnavailable);
}

TEST(ReadinessTest, WholeServerServesWhenEveryServiceDoes) {
  Readiness readiness;
  readiness.SetNotServing("vlm.v1.Language", "projector warming up");
  readiness.SetNotServing("vlm.v1.Other", "loading");
  EXPECT_FALSE(readiness.IsServing(""));
  absl::Status status = readiness.Check("vlm.v1.Language");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(status.message(), "vlm.v1.Language is not serving: projector warming up");
  EXPECT_EQ(readiness.Check("").message(),
            "vlm.v1.Language is not serving: projector warming up; "
            "vlm.v1.Other is not serving: loading");

  readiness.SetServing("vlm.v1.Language");
  EXPECT_TRUE(readiness.IsServing("vlm.v1.Language"));
  EXPECT_FALSE(readiness.IsServing(""));
  readiness.SetServing("vlm.v1.Other");
  EXPECT_TRUE(readiness.IsServing(""));
  EXPECT_TRUE(readiness.Check("").ok());

  readiness.SetNotServing("vlm.v1.Other", "backend down");
  EXPECT_FALSE(readiness.IsServing(""));
  EXPECT_EQ(readiness.Check("vlm.v1.Unknown").code(), absl::StatusCode::kUnavailable);

  const auto snapshot = readiness.Snapshot();
  ASSERT_EQ(snapshot.size(), 2u);
  EXPECT_EQ(snapshot[0].service, "vlm.v1.Language");
  EXPECT_TRUE(snapshot[0].serving);
  EXPECT_EQ(snapshot[1].reason, "backend down");
}

TEST(ReadinessTest, CheckGrpcIsUnavailableWithTheReason) {
  Readiness readiness;
  readiness.SetNotServing("svc", "warming up");
  grpc::Status status = readiness.CheckGrpc("svc");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(), "svc is not serving: warming up");
  readiness.SetServing("svc");
  EXPECT_TRUE(readiness.CheckGrpc("svc").ok());
}

TEST(ReadinessTest, DrainingIsFinal) {
  Readiness readiness;
  readiness.SetServing("svc");
  readiness.StartDraining();
  EXPECT_TRUE(readiness.draining());
  EXPECT_EQ(readiness.Check("svc").message(), "server is draining");
  readiness.SetServing("svc");
  EXPECT_FALSE(readiness.IsServing("svc"));
  EXPECT_EQ(readiness.CheckGrpc("").error_message(), "server is draining");
}

TEST(ReadinessTest, EmptyNameCannotBeSetDirectly) {
  Readiness readiness;
  readiness.SetServing("");
  EXPECT_TRUE(readiness.Snapshot().empty());
  EXPECT_FALSE(readiness.IsServing(""));
}

// The gRPC health service of a real server follows the readiness object.
TEST(ReadinessTest, HealthServiceMirrorsReadiness) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  vlm::v1::VisionEncoder::Service some_service;  // a server needs one service
  builder.RegisterService(&some_service);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  Readiness readiness;
  readiness.SetNotServing("svc", "warming up");
  readiness.AttachHealthService(server->GetHealthCheckService());

  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  auto check = [&](const std::string& service) {
    grpc::ClientContext ctx;
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status status = stub->Check(&ctx, request, &response);
    if (!status.ok()) return std::string("rpc error ") + std::to_string(status.error_code());
    return HealthCheckResponse::ServingStatus_Name(response.status());
  };
  EXPECT_EQ(check("svc"), "NOT_SERVING");
  EXPECT_EQ(check(""), "NOT_SERVING");
  EXPECT_EQ(check("other"), "rpc error 5");  // NOT_FOUND

  readiness.SetServing("svc");
  EXPECT_EQ(check("svc"), "SERVING");
  EXPECT_EQ(check(""), "SERVING");

  readiness.SetNotServing("late", "loading");  // registered after attaching
  EXPECT_EQ(check("late"), "NOT_SERVING");
  EXPECT_EQ(check(""), "NOT_SERVING");
  readiness.SetServing("late");
  EXPECT_EQ(check(""), "SERVING");

  readiness.StartDraining();
  EXPECT_EQ(check("svc"), "NOT_SERVING");
  EXPECT_EQ(check(""), "NOT_SERVING");
  readiness.SetServing("svc");
  EXPECT_EQ(check("svc"), "NOT_SERVING");

  readiness.AttachHealthService(nullptr);
  server->Shutdown();
}

TEST(GrpcStatusTest, EveryCodeMapsToTheSameCanonicalCodeAndKeepsTheMessage) {
  // Canonical numbers from grpc/doc/statuscodes.md, independent of both enums.
  const std::pair<absl::Status, int> cases[] = {
      {absl::CancelledError("c"), 1},          {absl::UnknownError("u"), 2},
      {absl::InvalidArgumentError("i"), 3},    {absl::DeadlineExceededError("d"), 4},
      {absl::NotFoundError("n"), 5},           {absl::AlreadyExistsError("a"), 6},
      {absl::PermissionDeniedError("p"), 7},   {absl::ResourceExhaustedError("r"), 8},
      {absl::FailedPreconditionError("f"), 9}, {absl::AbortedError("ab"), 10},
      {absl::OutOfRangeError("o"), 11},        {absl::UnimplementedError("un"), 12},
      {absl::InternalError("in"), 13},         {absl::UnavailableError("ua"), 14},
      {absl::DataLossError("dl"), 15},         {absl::UnauthenticatedError("ue"), 16},
  };
  for (const auto& [status, code] : cases) {
    grpc::Status g = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(g.error_code()), code) << status;
    EXPECT_EQ(g.error_message(), std::string(status.message()));
    EXPECT_EQ(FromGrpcStatus(g), status);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  EXPECT_EQ(ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(99), "odd")).error_code(),
            grpc::StatusCode::UNKNOWN);
}

}  // namespace
}  // namespace vlm
