// vlm-bench-frontends: what each of the gateway's two front ends adds to a
// request, against a running gateway (e.g. scripts/serve.sh on the tiny
// checkpoint). Per case, the median end-to-end time through gRPC (Chat /
// ChatStream) and through the OpenAI-compatible HTTP API, next to the bound
// measured in the same run: the pipeline's own time as the gateway reports it
// (ChatTimings.total_ms / x_vlm.timings_ms.total), which no front end can beat.
// Both front ends run the same pipeline, so the gap to the bound is the front
// end (parsing, base64, JSON, SSE framing) plus the loopback round trip.
//
//   vlm-bench-frontends --grpc=127.0.0.1:50051 --http=127.0.0.1:8080 --model=tiny
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "vlm/v1/gateway.grpc.pb.h"

ABSL_FLAG(std::string, grpc, "127.0.0.1:50051", "the gateway's gRPC address");
ABSL_FLAG(std::string, http, "127.0.0.1:8080", "the gateway's HTTP address");
ABSL_FLAG(std::string, model, "tiny", "the served model id (GET /v1/models)");
ABSL_FLAG(std::string, image, "", "a JPEG/PNG/WebP file for the image cases (skipped if empty)");
ABSL_FLAG(int, runs, 30, "requests per case and front end (medians are reported)");

namespace {

using json = nlohmann::json;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Sample {
  double e2e_ms = 0;       // client-side: request sent -> answer (or first delta) read
  double pipeline_ms = 0;  // the gateway's own total for the request
};

struct Case {
  std::string name;
  std::string image;  // bytes, or empty
  bool stream = false;
};

vlm::v1::ChatRequest GrpcRequest(const Case& c) {
  vlm::v1::ChatRequest r;
  auto* m = r.add_messages();
  m->set_role("user");
  if (!c.image.empty()) m->add_content()->mutable_image()->set_data(c.image);
  m->add_content()->set_text("Describe it in one word.");
  r.mutable_params()->set_max_tokens(c.stream ? 4 : 1);
  r.mutable_params()->mutable_sampling()->set_temperature(0);
  return r;
}

std::string HttpBody(const Case& c, const std::string& model) {
  json content = json::array();
  if (!c.image.empty()) {
    content.push_back({{"type", "image_url"},
                       {"image_url", {{"url", "data:image/png;base64," + absl::Base64Escape(c.image)}}}});
  }
  content.push_back({{"type", "text"}, {"text", "Describe it in one word."}});
  json body = {{"model", model},
               {"messages", json::array({{{"role", "user"}, {"content", content}}})},
               {"max_tokens", c.stream ? 4 : 1},
               {"temperature", 0}};
  if (c.stream) body["stream"] = true;
  return body.dump();
}

double Ms(absl::Time from) { return absl::ToDoubleMilliseconds(absl::Now() - from); }

// One request through gRPC; stream: e2e = time to the first delta.
bool GrpcOnce(vlm::v1::VisionLanguage::Stub* stub, const Case& c, Sample* s) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const vlm::v1::ChatRequest request = GrpcRequest(c);
  const absl::Time start = absl::Now();
  if (!c.stream) {
    vlm::v1::ChatResponse response;
    if (!stub->Chat(&ctx, request, &response).ok()) return false;
    s->e2e_ms = Ms(start);
    s->pipeline_ms = response.timings().total_ms();
    return true;
  }
  auto reader = stub->ChatStream(&ctx, request);
  vlm::v1::ChatChunk chunk;
  bool first = true;
  while (reader->Read(&chunk)) {
    if (first) {
      s->e2e_ms = Ms(start);
      first = false;
    }
    if (chunk.has_timings()) s->pipeline_ms = chunk.timings().first_token_ms();
  }
  return reader->Finish().ok() && !first;
}

bool HttpOnce(httplib::Client* client, const Case& c, const std::string& model, Sample* s) {
  const std::string body = HttpBody(c, model);
  const absl::Time start = absl::Now();
  if (!c.stream) {
    auto res = client->Post("/v1/chat/completions", body, "application/json");
    if (!res || res->status != 200) return false;
    s->e2e_ms = Ms(start);
    s->pipeline_ms = json::parse(res->body)["x_vlm"]["timings_ms"]["total"].get<double>();
    return true;
  }
  std::string buffer;
  bool first = true;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    // The first content delta follows the role chunk: the second event.
    if (first && absl::StrContains(buffer, "\"content\":\"") &&
        buffer.find("\n\n") != buffer.rfind("\n\n")) {
      s->e2e_ms = Ms(start);
      first = false;
    }
    return true;
  };
  auto res = client->send(req);
  if (!res || res->status != 200 || first) return false;
  for (absl::string_view event : absl::StrSplit(buffer, "\n\n", absl::SkipEmpty())) {
    if (!absl::StartsWith(event, "data: {")) continue;
    json chunk = json::parse(event.substr(6));
    if (chunk.contains("x_vlm")) {
      s->pipeline_ms = chunk["x_vlm"]["timings_ms"]["first_token"].get<double>();
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  const std::string model = absl::GetFlag(FLAGS_model);
  auto stub = vlm::v1::VisionLanguage::NewStub(
      grpc::CreateChannel(absl::GetFlag(FLAGS_grpc), grpc::InsecureChannelCredentials()));
  const std::vector<std::string> host_port = absl::StrSplit(absl::GetFlag(FLAGS_http), ':');
  if (host_port.size() != 2) {
    std::fprintf(stderr, "--http must be HOST:PORT\n");
    return 2;
  }
  httplib::Client client(host_port[0], std::stoi(host_port[1]));
  client.set_read_timeout(60, 0);
  client.set_keep_alive(true);
  client.set_tcp_nodelay(true);  // as curl, browsers and node's fetch do

  std::vector<Case> cases = {{"text, 1 token", "", false}, {"text, first delta (stream)", "", true}};
  if (const std::string path = absl::GetFlag(FLAGS_image); !path.empty()) {
    std::string bytes;
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      char buf[65536];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) bytes.append(buf, n);
      std::fclose(f);
    }
    if (bytes.empty()) {
      std::fprintf(stderr, "cannot read --image %s\n", path.c_str());
      return 2;
    }
    cases.push_back({absl::StrCat("image ", bytes.size() / 1024, " KiB (cached), 1 token"), bytes,
                     false});
  }

  std::printf("front-end cost per request: medians of %d runs each (ms; bound = the gateway's own "
              "pipeline time, same run)\n\n", runs);
  std::printf("| case | gRPC e2e | HTTP e2e | bound via gRPC | bound via HTTP | HTTP - gRPC |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    std::vector<double> grpc_e2e, grpc_bound, http_e2e, http_bound;
    Sample warm;
    GrpcOnce(stub.get(), c, &warm);  // warms caches (image features, prefix) for both
    for (int i = 0; i < runs; ++i) {  // interleaved: both see the same machine load
      Sample g, h;
      if (!GrpcOnce(stub.get(), c, &g) || !HttpOnce(&client, c, model, &h)) {
        std::fprintf(stderr, "a request of case \"%s\" failed; is the gateway up and SERVING?\n",
                     c.name.c_str());
        return 1;
      }
      grpc_e2e.push_back(g.e2e_ms);
      grpc_bound.push_back(g.pipeline_ms);
      http_e2e.push_back(h.e2e_ms);
      http_bound.push_back(h.pipeline_ms);
    }
    const double g = Median(grpc_e2e), h = Median(http_e2e);
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %+.2f |\n", c.name.c_str(), g, h,
                Median(grpc_bound), Median(http_bound), h - g);
  }
  return 0;
}
