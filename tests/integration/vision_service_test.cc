// Starts the real vlm-vision binary on loopback with the tiny checkpoint and
// checks the service end to end: readiness, the cache levels (MISS, MEMORY,
// PIXELS, DISK, content_hash lookups), feature shapes, every kind of bad image
// (INVALID_ARGUMENT, the process keeps serving, nothing is cached), the disk
// tier across restarts (a corrupt file is never served), and the bounded
// encode queue (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED without computing).
//
// Test images are made here with libpng / libwebp / libjpeg-turbo; hashes with
// OpenSSL. Environment: VLM_TINY_CHECKPOINT (the tiny_checkpoint fixture).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <openssl/sha.h>
#include <png.h>
#include <signal.h>
#include <sys/wait.h>
#include <turbojpeg.h>
#include <unistd.h>
#include <webp/encode.h>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/integration/service_process.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm {
namespace {

namespace fs = std::filesystem;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

constexpr char kService[] = "vlm.v1.VisionEncoder";
// Tiny checkpoint (spec §9): vision hidden 64, deepstack taps [0, 2],
// preprocessor min/max pixels 4096 / 65536.
constexpr int64_t kHidden = 64;
constexpr int kDeepstack = 2;

std::string TinyCheckpoint() {
  const char* dir = std::getenv("VLM_TINY_CHECKPOINT");
  return dir ? dir : "";
}

// ---------------------------------------------------------------------------
// A vlm-vision process (tests/integration/service_process.h) and its client
// stubs; SIGKILLed on destruction if still running.
// ---------------------------------------------------------------------------
class VisionProcess {
 public:
  explicit VisionProcess(const std::vector<std::string>& flags)
      : process_(VLM_VISION_PATH, WithDefaults(flags), NextLogPrefix()) {}

  // Waits for "vlm: listening grpc=HOST:PORT metrics=HOST:PORT" and connects.
  bool WaitListening(absl::Duration timeout = absl::Seconds(30)) {
    if (!process_.WaitListening(timeout)) return false;
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);  // features of large images exceed the 4 MiB default
    channel_ =
        grpc::CreateCustomChannel(process_.grpc_target(), grpc::InsecureChannelCredentials(), args);
    stub_ = v1::VisionEncoder::NewStub(channel_);
    health_ = grpc::health::v1::Health::NewStub(channel_);
    return true;
  }

  std::string Health() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    HealthCheckRequest request;
    request.set_service(kService);
    HealthCheckResponse response;
    grpc::Status status = health_->Check(&ctx, request, &response);
    if (!status.ok()) return "error: " + status.error_message();
    return HealthCheckResponse::ServingStatus_Name(response.status());
  }

  bool WaitServing(absl::Duration timeout = absl::Seconds(60)) {
    return testing::Eventually([&] { return Health() == "SERVING"; }, timeout);
  }

  // Starts, waits for SERVING; false (with a message and the log's tail) on failure.
  ::testing::AssertionResult Start() {
    if (!WaitListening()) {
      return ::testing::AssertionFailure() << "vlm-vision did not listen\n" << process_.LogTail();
    }
    if (!WaitServing()) {
      return ::testing::AssertionFailure() << "vlm-vision never got SERVING\n"
                                           << process_.LogTail();
    }
    return ::testing::AssertionSuccess();
  }

  grpc::Status Encode(const v1::EncodeRequest& request, v1::EncodeResponse* response,
                      absl::Duration deadline = absl::Seconds(60)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return stub_->Encode(&ctx, request, response);
  }
  grpc::Status GetImageBudget(v1::ImageBudget* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->GetImageBudget(&ctx, v1::ImageBudgetRequest(), response);
  }

  std::string Metrics() {
    httplib::Client client(process_.metrics_host, process_.metrics_port);
    client.set_read_timeout(5, 0);
    auto result = client.Get("/metrics");
    return result && result->status == 200 ? result->body : "";
  }
  double Metric(const std::string& key) {
    return metrics_text::MetricValue(Metrics(), key).value_or(-1);
  }

  std::optional<int> Terminate(absl::Duration timeout = absl::Seconds(30)) {
    return process_.Stop(SIGTERM, timeout);
  }
  std::string LogTail() const { return process_.LogTail(); }
  std::optional<int> WaitExit(absl::Duration timeout) { return process_.WaitExit(timeout); }

 private:
  static std::vector<std::string> WithDefaults(const std::vector<std::string>& flags) {
    std::vector<std::string> args = {"--model_dir=" + TinyCheckpoint(),
                                     "--grpc_address=127.0.0.1:0",
                                     "--metrics_address=127.0.0.1:0", "--replica_name=test-replica",
                                     "--intra_op_threads=1"};
    args.insert(args.end(), flags.begin(), flags.end());
    return args;
  }
  static std::string NextLogPrefix() {
    static int count = 0;
    return testing::TestLogDir("vision_service_test") + "/vision-" + std::to_string(++count);
  }

  testing::ServiceProcess process_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::VisionEncoder::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// ---------------------------------------------------------------------------
// Test images
// ---------------------------------------------------------------------------
std::vector<uint8_t> Pixels(int width, int height, int seed) {
  std::vector<uint8_t> rgb(static_cast<size_t>(width) * height * 3);
  std::mt19937 rng(seed);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
      p[0] = static_cast<uint8_t>(x * 255 / std::max(1, width - 1));
      p[1] = static_cast<uint8_t>(y * 255 / std::max(1, height - 1));
      p[2] = static_cast<uint8_t>((x ^ y) + seed * 37 + (rng() & 7));
    }
  }
  return rgb;
}

std::string Png(const std::vector<uint8_t>& rgb, int width, int height) {
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  image.width = width;
  image.height = height;
  image.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&image, nullptr, &size, 0, rgb.data(), 0, nullptr)) return "";
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&image, out.data(), &size, 0, rgb.data(), 0, nullptr)) return "";
  out.resize(size);
  return out;
}

std::string LosslessWebp(const std::vector<uint8_t>& rgb, int width, int height) {
  uint8_t* data = nullptr;
  const size_t size = WebPEncodeLosslessRGB(rgb.data(), width, height, width * 3, &data);
  std::string out(reinterpret_cast<const char*>(data), size);
  WebPFree(data);
  return out;
}

std::string Jpeg(const std::vector<uint8_t>& rgb, int width, int height) {
  tjhandle handle = tjInitCompress();
  unsigned char* data = nullptr;
  unsigned long size = 0;
  const int rc = tjCompress2(handle, rgb.data(), width, 0, height, TJPF_RGB, &data, &size,
                             TJSAMP_420, 90, 0);
  std::string out = rc == 0 ? std::string(reinterpret_cast<const char*>(data), size) : "";
  tjFree(data);
  tjDestroy(handle);
  return out;
}

// A PNG chunk with its CRC.
std::string PngChunk(const std::string& type, const std::string& data) {
  std::string out;
  const uint32_t n = static_cast<uint32_t>(data.size());
  for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>((n >> shift) & 0xff));
  out += type + data;
  uLong crc = crc32(0, reinterpret_cast<const Bytef*>(type.data()), type.size());
  crc = crc32(crc, reinterpret_cast<const Bytef*>(data.data()), data.size());
  for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>((crc >> shift) & 0xff));
  return out;
}

// A well-formed PNG signature and IHDR (8-bit RGB) followed by `idat`.
std::string PngWithIdat(uint32_t width, uint32_t height, const std::string& idat) {
  std::string ihdr;
  for (uint32_t v : {width, height}) {
    for (int shift : {24, 16, 8, 0}) ihdr.push_back(static_cast<char>((v >> shift) & 0xff));
  }
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // depth 8, RGB, deflate, filter 0, no interlace
  return std::string("\x89PNG\r\n\x1a\n", 8) + PngChunk("IHDR", ihdr) + PngChunk("IDAT", idat) +
         PngChunk("IEND", "");
}

// The JPEG's headers up to and including the start-of-scan segment: what a
// decoder parses before the entropy-coded data.
std::string JpegHeaders(const std::string& jpeg) {
  const size_t sos = jpeg.find("\xff\xda");
  if (sos == std::string::npos || sos + 4 > jpeg.size()) return "";
  const size_t length = (static_cast<uint8_t>(jpeg[sos + 2]) << 8) | static_cast<uint8_t>(jpeg[sos + 3]);
  return jpeg.substr(0, sos + 2 + length);
}

std::string RandomBytes(size_t n, int seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng() & 0xff);
  out[0] = 'z';  // never a magic number by chance
  return out;
}

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : digest) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

v1::EncodeRequest ImageRequest(const std::string& bytes, int64_t max_pixels = 0) {
  v1::EncodeRequest request;
  request.set_image(bytes);
  if (max_pixels > 0) request.mutable_options()->set_max_pixels(max_pixels);
  return request;
}

v1::EncodeRequest HashRequest(const std::string& hash) {
  v1::EncodeRequest request;
  request.set_content_hash(hash);
  return request;
}

// Checks grid and tensor shapes: [t*h*w, hidden] for last_hidden and each tap.
void ExpectFeatureShapes(const v1::EncodeResponse& r, int64_t t, int64_t h, int64_t w,
                         v1::DType dtype = v1::DTYPE_BF16) {
  const v1::VisionFeatures& f = r.features();
  EXPECT_EQ(f.grid().t(), t);
  EXPECT_EQ(f.grid().h(), h);
  EXPECT_EQ(f.grid().w(), w);
  const int64_t rows = t * h * w;
  const size_t element = dtype == v1::DTYPE_F32 ? 4 : 2;
  std::vector<const v1::Tensor*> tensors = {&f.last_hidden()};
  for (const v1::Tensor& tap : f.deepstack()) tensors.push_back(&tap);
  EXPECT_EQ(f.deepstack_size(), kDeepstack);
  for (const v1::Tensor* tensor : tensors) {
    EXPECT_EQ(tensor->dtype(), dtype);
    ASSERT_EQ(tensor->shape_size(), 2);
    EXPECT_EQ(tensor->shape(0), rows);
    EXPECT_EQ(tensor->shape(1), kHidden);
    EXPECT_EQ(tensor->data().size(), static_cast<size_t>(rows * kHidden) * element);
  }
}

bool SameFeatures(const v1::EncodeResponse& a, const v1::EncodeResponse& b) {
  if (a.features().last_hidden().data() != b.features().last_hidden().data()) return false;
  if (a.features().deepstack_size() != b.features().deepstack_size()) return false;
  for (int i = 0; i < a.features().deepstack_size(); ++i) {
    if (a.features().deepstack(i).data() != b.features().deepstack(i).data()) return false;
  }
  return true;
}

float Bf16ToFloat(const std::string& data, size_t index) {
  uint16_t bits;
  std::memcpy(&bits, data.data() + 2 * index, 2);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

float F32At(const std::string& data, size_t index) {
  float value;
  std::memcpy(&value, data.data() + 4 * index, 4);
  return value;
}

// ---------------------------------------------------------------------------
// Readiness
// ---------------------------------------------------------------------------

TEST(VisionServiceTest, HealthIsNotServingUntilWarmupHasRun) {
  ASSERT_FALSE(TinyCheckpoint().empty()) << "VLM_TINY_CHECKPOINT is not set";
  // Many warm-up forwards hold the loading phase open long enough to observe it.
  VisionProcess process({"--warmup_runs=400", "--min_image_side=1"});
  ASSERT_TRUE(process.WaitListening());
  EXPECT_EQ(process.Health(), "NOT_SERVING");
  v1::EncodeResponse response;
  grpc::Status early = process.Encode(ImageRequest(Png(Pixels(64, 64, 1), 64, 64)), &response);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(early.error_message().find("loading weights"), std::string::npos)
      << early.error_message();
  ASSERT_TRUE(process.WaitServing());
  EXPECT_GE(process.Metric("vlm_model_load_seconds{phase=\"vision_warmup\"}"), 0.0);
  grpc::Status later = process.Encode(ImageRequest(Png(Pixels(64, 64, 1), 64, 64)), &response);
  EXPECT_TRUE(later.ok()) << later.error_message();
  // --min_image_side=1 restores HF's behaviour: a 1x1 image is upscaled to the
  // min_pixels area (4096 -> 64x64 -> grid 4x4).
  grpc::Status one = process.Encode(ImageRequest(Png(Pixels(1, 1, 2), 1, 1)), &response);
  ASSERT_TRUE(one.ok()) << one.error_message();
  ExpectFeatureShapes(response, 1, 4, 4);
  EXPECT_EQ(process.Terminate(), std::optional<int>(0));
}

// ---------------------------------------------------------------------------
// One process for the cache levels and bad inputs
// ---------------------------------------------------------------------------

class VisionServiceCacheTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    process_ = new VisionProcess({"--max_decoded_pixels=4000000", "--max_pixels_limit=262144"});
    started_ = process_->Start();
  }
  static void TearDownTestSuite() {
    delete process_;
    process_ = nullptr;
  }
  void SetUp() override {
    ASSERT_FALSE(TinyCheckpoint().empty()) << "VLM_TINY_CHECKPOINT is not set";
    ASSERT_TRUE(started_);
  }

  static VisionProcess* process_;
  static ::testing::AssertionResult started_;
};
VisionProcess* VisionServiceCacheTest::process_ = nullptr;
::testing::AssertionResult VisionServiceCacheTest::started_ = ::testing::AssertionFailure();

TEST_F(VisionServiceCacheTest, EncodeMissThenMemoryPixelsAndContentHashHits) {
  VisionProcess& p = *process_;
  // 150x200: smart_resize (factor 32, min 4096, max 65536) -> 160x192 -> grid 10x12.
  const std::vector<uint8_t> rgb = Pixels(200, 150, 7);
  const std::string png = Png(rgb, 200, 150);
  const std::string webp = LosslessWebp(rgb, 200, 150);
  ASSERT_FALSE(png.empty());
  ASSERT_FALSE(webp.empty());
  const std::string memory_hits = "vlm_vision_cache_hits_total{level=\"memory\"}";
  const std::string pixel_hits = "vlm_vision_cache_hits_total{level=\"pixels\"}";
  const double misses0 = p.Metric("vlm_vision_cache_misses_total");
  const double memory0 = p.Metric(memory_hits);
  const double pixels0 = p.Metric(pixel_hits);

  v1::EncodeResponse first;
  grpc::Status s = p.Encode(ImageRequest(png), &first);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(first.cache(), v1::CACHE_LEVEL_MISS);
  ExpectFeatureShapes(first, 1, 10, 12);
  EXPECT_EQ(first.features().content_hash(), Sha256Hex(png));
  EXPECT_EQ(first.features().model_fingerprint().size(), 64u);
  EXPECT_EQ(first.replica(), "test-replica");
  EXPECT_GT(first.timings().decode_ms(), 0);
  EXPECT_GT(first.timings().preprocess_ms(), 0);
  EXPECT_GT(first.timings().encode_ms(), 0);
  EXPECT_GE(first.timings().total_ms(),
            first.timings().decode_ms() + first.timings().preprocess_ms() +
                first.timings().encode_ms());

  v1::EncodeResponse again;
  s = p.Encode(ImageRequest(png), &again);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(again.cache(), v1::CACHE_LEVEL_MEMORY);
  EXPECT_EQ(again.timings().encode_ms(), 0);
  EXPECT_EQ(again.timings().decode_ms(), 0);
  EXPECT_TRUE(SameFeatures(first, again));

  v1::EncodeResponse as_webp;
  s = p.Encode(ImageRequest(webp), &as_webp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(as_webp.cache(), v1::CACHE_LEVEL_PIXELS);
  EXPECT_EQ(as_webp.features().content_hash(), Sha256Hex(webp));  // the bytes it was sent
  EXPECT_GT(as_webp.timings().decode_ms(), 0);
  EXPECT_EQ(as_webp.timings().encode_ms(), 0);
  ExpectFeatureShapes(as_webp, 1, 10, 12);
  EXPECT_TRUE(SameFeatures(first, as_webp));

  for (const std::string* bytes : {&png, &webp}) {
    v1::EncodeResponse by_hash;
    s = p.Encode(HashRequest(Sha256Hex(*bytes)), &by_hash);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(by_hash.cache(), v1::CACHE_LEVEL_MEMORY);
    EXPECT_EQ(by_hash.features().content_hash(), Sha256Hex(*bytes));
    EXPECT_TRUE(SameFeatures(first, by_hash));
  }

  // The counters behind those levels, as Prometheus sees them.
  EXPECT_EQ(p.Metric("vlm_vision_cache_misses_total"), misses0 + 1);
  EXPECT_EQ(p.Metric(memory_hits), memory0 + 3);
  EXPECT_EQ(p.Metric(pixel_hits), pixels0 + 1);
  EXPECT_GE(p.Metric("vlm_vision_cache_entries{tier=\"memory\"}"), 1);
  EXPECT_GT(p.Metric("vlm_vision_cache_bytes{tier=\"memory\"}"), 0);
  EXPECT_GE(p.Metric("vlm_vision_encode_seconds_count"), 1);
  EXPECT_GE(p.Metric("vlm_vision_decode_seconds_count"), 2);
  EXPECT_EQ(p.Metric("vlm_vision_images_in_flight"), 0);

  // F32 on request: the same numbers, widened.
  v1::EncodeRequest f32 = HashRequest(Sha256Hex(png));
  f32.set_dtype(v1::DTYPE_F32);
  v1::EncodeResponse wide;
  s = p.Encode(f32, &wide);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectFeatureShapes(wide, 1, 10, 12, v1::DTYPE_F32);
  for (size_t i : {size_t{0}, size_t{1}, size_t{777}, size_t{120 * 64 - 1}}) {
    EXPECT_EQ(F32At(wide.features().last_hidden().data(), i),
              Bf16ToFloat(first.features().last_hidden().data(), i));
  }

  // Options are part of the key: a smaller max_pixels is another entry.
  v1::EncodeResponse small;
  s = p.Encode(ImageRequest(png, 16384), &small);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(small.cache(), v1::CACHE_LEVEL_MISS);
  // 150x200 over 16384: beta = sqrt(30000/16384); floor(150/beta/32)*32 = 96, 128.
  ExpectFeatureShapes(small, 1, 6, 8);
  v1::EncodeResponse small_by_hash;
  v1::EncodeRequest hash_small = HashRequest(Sha256Hex(png));
  hash_small.mutable_options()->set_max_pixels(16384);
  s = p.Encode(hash_small, &small_by_hash);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(SameFeatures(small, small_by_hash));
}

TEST_F(VisionServiceCacheTest, UnknownOrMalformedContentHash) {
  v1::EncodeResponse response;
  grpc::Status s = process_->Encode(HashRequest(Sha256Hex("never sent")), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_NE(s.error_message().find("no cached features"), std::string::npos) << s.error_message();
  s = process_->Encode(HashRequest("not-a-hash"), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("content_hash"), std::string::npos) << s.error_message();
  v1::EncodeRequest empty;  // neither image nor content_hash
  s = process_->Encode(empty, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
}

TEST_F(VisionServiceCacheTest, OptionsAboveTheLimitAreCappedAndBadOnesRefused) {
  const std::string png = Png(Pixels(64, 64, 3), 64, 64);
  struct Case {
    int64_t min_pixels, max_pixels;
    const char* names;
  };
  for (const Case& c : {Case{100, 0, "min_pixels_limit"}, Case{-1, 0, "negative"},
                        Case{4096, 2048, "exceeds max_pixels"}}) {
    v1::EncodeRequest request = ImageRequest(png);
    request.mutable_options()->set_min_pixels(c.min_pixels);
    request.mutable_options()->set_max_pixels(c.max_pixels);
    v1::EncodeResponse response;
    grpc::Status s = process_->Encode(request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.min_pixels << " " << c.max_pixels;
    EXPECT_NE(s.error_message().find(c.names), std::string::npos) << s.error_message();
  }
  // Above the server limit (262144): lowered to it, and the budget used is reported.
  for (int64_t max_pixels : {int64_t{262145}, int64_t{1} << 40}) {
    v1::EncodeResponse response;
    grpc::Status s = process_->Encode(ImageRequest(png, max_pixels), &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.options().max_pixels(), 262144);
  }
  // No budget: the server default (--default_max_pixels, capped by the limit).
  v1::EncodeResponse response;
  grpc::Status s = process_->Encode(ImageRequest(png), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.options().max_pixels(), 262144);
  s = process_->Encode(ImageRequest(png, 16384), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.options().max_pixels(), 16384);
  EXPECT_LE(response.options().min_pixels(), 16384);
  // The same budget, as GetImageBudget reports it for the gateway's estimate.
  v1::ImageBudget budget;
  s = process_->GetImageBudget(&budget);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(budget.max_pixels_limit(), 262144);
  EXPECT_EQ(budget.default_max_pixels(), 262144);
  EXPECT_GE(budget.default_min_pixels(), budget.min_pixels_limit());
  EXPECT_LE(budget.default_min_pixels(), budget.default_max_pixels());
  EXPECT_GT(budget.patch_size(), 0);
  EXPECT_GT(budget.merge_size(), 0);
  EXPECT_EQ(budget.max_aspect_ratio(), 200);
}

// The largest budget follows the message limit: the features of any image a
// request may ask for fit one response; an explicit limit that cannot fit is
// a start-up error naming both flags.
TEST(VisionServiceLimitsTest, PixelLimitFollowsTheMessageSize) {
  ASSERT_FALSE(TinyCheckpoint().empty()) << "VLM_TINY_CHECKPOINT is not set";
  {
    // Tiny model: 64 hidden x 3 tensors x 2 bytes = 384 bytes per patch; 1 MiB
    // carries (1 MiB - 64 KiB) / 384 = 2560 patches.
    VisionProcess bad({"--max_message_mb=1", "--max_pixels_limit=1048576"});
    const std::optional<int> exit_code = bad.WaitExit(absl::Seconds(60));
    ASSERT_TRUE(exit_code.has_value()) << "vlm-vision kept running\n" << bad.LogTail();
    EXPECT_NE(*exit_code, 0);
    const std::string log = bad.LogTail();
    EXPECT_NE(log.find("--max_pixels_limit=1048576"), std::string::npos) << log;
    EXPECT_NE(log.find("--max_message_mb=1"), std::string::npos) << log;
  }
  // The largest limit that fits: 2560 patches of 256 pixels; a default above
  // it is capped to it.
  VisionProcess p({"--max_message_mb=1", "--max_pixels_limit=655360", "--default_max_pixels=786432"});
  ASSERT_TRUE(p.Start());
  const std::string big = Png(Pixels(1200, 900, 5), 1200, 900);  // 1.08 MP
  for (int64_t max_pixels : {int64_t{0}, int64_t{1} << 40}) {
    v1::EncodeResponse response;
    grpc::Status s = p.Encode(ImageRequest(big, max_pixels), &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const v1::ImageGrid& g = response.features().grid();
    EXPECT_EQ(g.t(), 1);
    EXPECT_LE(g.h() * g.w(), 2560);
    EXPECT_EQ(response.options().max_pixels(), 655360);  // the default is capped too
  }
  EXPECT_EQ(p.Terminate(), std::optional<int>(0));
}

TEST_F(VisionServiceCacheTest, BadImagesAreInvalidArgumentAndNothingIsCached) {
  VisionProcess& p = *process_;
  const std::vector<uint8_t> rgb = Pixels(96, 80, 11);
  const std::string good = Png(rgb, 96, 80);
  const std::string jpeg = Jpeg(rgb, 96, 80);
  ASSERT_FALSE(jpeg.empty());
  ASSERT_FALSE(JpegHeaders(jpeg).empty());
  // Warm the good image so that each check below is a MEMORY hit.
  v1::EncodeResponse response;
  ASSERT_TRUE(p.Encode(ImageRequest(good), &response).ok());

  std::string noise;
  for (int i = 0; i < 64 * 64 * 3 + 64; ++i) noise.push_back(static_cast<char>((i * 131) & 0xff));
  const std::string gif =
      std::string("GIF89a\x01\x00\x01\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00!\xf9\x04\x01\x00"
                  "\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02" "D\x01\x00;",
                  43);
  struct Bad {
    std::string name;
    std::string bytes;
    std::string message;  // a substring naming the problem
  };
  const std::vector<Bad> bad = {
      {"zero bytes", "", "empty (0 bytes)"},
      {"random bytes", RandomBytes(4096, 5), "unrecognised image format"},
      {"truncated JPEG", jpeg.substr(0, jpeg.size() / 2), "JPEG"},
      {"truncated PNG", good.substr(0, good.size() / 2), "PNG"},
      {"PNG header with garbage data", PngWithIdat(64, 64, noise), "invalid PNG"},
      {"JPEG header with garbage data", JpegHeaders(jpeg) + RandomBytes(3000, 9), "invalid JPEG"},
      {"over the pixel limit", PngWithIdat(30000, 30000, "x"), "max_decoded_pixels"},
      {"1x1 image", Png(Pixels(1, 1, 2), 1, 1), "min_image_side"},
      {"aspect ratio past the limit", Png(Pixels(402, 2, 3), 402, 2), "aspect ratio"},
      {"GIF", gif, "unsupported image format GIF"},
  };

  const double entries0 = p.Metric("vlm_vision_cache_entries{tier=\"memory\"}");
  const double bytes0 = p.Metric("vlm_vision_cache_bytes{tier=\"memory\"}");
  const double misses0 = p.Metric("vlm_vision_cache_misses_total");
  const double invalid0 = p.Metric("vlm_vision_invalid_images_total");
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.name);
    v1::EncodeResponse refused;
    grpc::Status s = p.Encode(ImageRequest(b.bytes), &refused);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(b.message), std::string::npos) << s.error_message();
    std::printf("  %-30s -> %s\n", b.name.c_str(), s.error_message().c_str());
    // The process keeps serving.
    v1::EncodeResponse ok;
    s = p.Encode(ImageRequest(good), &ok);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(ok.cache(), v1::CACHE_LEVEL_MEMORY);
    // And the bad bytes left nothing behind: their hash is unknown.
    if (!b.bytes.empty()) {
      s = p.Encode(HashRequest(Sha256Hex(b.bytes)), &refused);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    }
  }
  EXPECT_EQ(p.Metric("vlm_vision_cache_entries{tier=\"memory\"}"), entries0);
  EXPECT_EQ(p.Metric("vlm_vision_cache_bytes{tier=\"memory\"}"), bytes0);
  EXPECT_EQ(p.Metric("vlm_vision_cache_misses_total"), misses0);
  EXPECT_EQ(p.Metric("vlm_vision_invalid_images_total"), invalid0 + bad.size());
  EXPECT_EQ(p.Health(), "SERVING");
}

// ---------------------------------------------------------------------------
// Disk tier across restarts
// ---------------------------------------------------------------------------

std::set<fs::path> Files(const fs::path& dir) {
  std::set<fs::path> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file()) out.insert(entry.path());
  }
  return out;
}

TEST(VisionServiceDiskTest, RestartServesFromDiskAndNeverServesACorruptFile) {
  ASSERT_FALSE(TinyCheckpoint().empty()) << "VLM_TINY_CHECKPOINT is not set";
  char tmpl[] = "/tmp/vlm-vision-disk-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path dir = tmpl;
  const std::vector<std::string> flags = {"--cache_dir=" + dir.string()};
  const std::string a = Png(Pixels(128, 96, 21), 128, 96);
  const std::string b = Png(Pixels(96, 128, 22), 96, 128);

  v1::EncodeResponse a_first, a_disk, b_first, b_again;
  {
    VisionProcess p(flags);
    ASSERT_TRUE(p.Start());
    grpc::Status s = p.Encode(ImageRequest(a), &a_first);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(a_first.cache(), v1::CACHE_LEVEL_MISS);
    ASSERT_EQ(p.Terminate(), std::optional<int>(0));  // SIGTERM drains and flushes the disk tier
  }
  const std::set<fs::path> after_a = Files(dir);
  ASSERT_FALSE(after_a.empty());
  {
    VisionProcess p(flags);
    ASSERT_TRUE(p.Start());
    grpc::Status s = p.Encode(ImageRequest(a), &a_disk);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(a_disk.cache(), v1::CACHE_LEVEL_DISK);
    EXPECT_TRUE(SameFeatures(a_first, a_disk));
    EXPECT_EQ(p.Metric("vlm_vision_cache_hits_total{level=\"disk\"}"), 1);
    s = p.Encode(ImageRequest(b), &b_first);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(b_first.cache(), v1::CACHE_LEVEL_MISS);
    ASSERT_EQ(p.Terminate(), std::optional<int>(0));
  }
  // Damage every file the second process wrote (b's entry and its pixel alias).
  int damaged = 0;
  for (const fs::path& file : Files(dir)) {
    if (after_a.count(file)) continue;
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = fs::file_size(file);
    ASSERT_GT(size, 100u);
    f.seekp(static_cast<std::streamoff>(size - 5));
    char c = 0;
    f.seekg(static_cast<std::streamoff>(size - 5));
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(size - 5));
    f.write(&c, 1);
    ++damaged;
  }
  ASSERT_GE(damaged, 1);
  {
    VisionProcess p(flags);
    ASSERT_TRUE(p.Start());
    grpc::Status s = p.Encode(ImageRequest(b), &b_again);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(b_again.cache(), v1::CACHE_LEVEL_MISS);  // recomputed, not served from the bad file
    EXPECT_TRUE(SameFeatures(b_first, b_again));
    EXPECT_GE(p.Metric("vlm_vision_cache_disk_corrupt_total"), 1);
    EXPECT_GE(p.Metric("vlm_vision_cache_disk_errors_total"), 1);
    // a is still good on disk.
    v1::EncodeResponse a_third;
    s = p.Encode(ImageRequest(a), &a_third);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(a_third.cache(), v1::CACHE_LEVEL_DISK);
    EXPECT_TRUE(SameFeatures(a_first, a_third));
    ASSERT_EQ(p.Terminate(), std::optional<int>(0));
  }
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------
// The bounded encode queue
// ---------------------------------------------------------------------------

TEST(VisionServiceQueueTest, FullQueueIsRefusedAndExpiredWaitersAreNeverComputed) {
  ASSERT_FALSE(TinyCheckpoint().empty()) << "VLM_TINY_CHECKPOINT is not set";
  // One worker, one waiting slot; large images keep the worker busy.
  constexpr int64_t kBig = 1048576;  // 1024x1024: 4096 patches, ~0.4 s in the tiny ViT
  // 1536x1536: 9216 patches, a few seconds: long enough that a waiter given a
  // deadline of kWaiterDeadline is queued (even on a loaded machine) and expires there.
  constexpr int64_t kHuge = 1536 * 1536;
  const absl::Duration kWaiterDeadline = absl::Milliseconds(500);
  // One intra-op thread: the encode takes as long on a fast idle machine as the
  // test needs.
  VisionProcess p({"--encode_workers=1", "--encode_queue_size=1", "--intra_op_threads=1",
                   "--max_pixels_limit=" + std::to_string(kHuge)});
  ASSERT_TRUE(p.Start());
  const std::string slow1 = Png(Pixels(1536, 1536, 31), 1536, 1536);
  const std::string slow2 = Png(Pixels(1024, 1024, 32), 1024, 1024);
  const std::string small1 = Png(Pixels(64, 64, 33), 64, 64);
  const std::string small2 = Png(Pixels(64, 64, 34), 64, 64);
  auto busy = [&] { return p.Metric("vlm_vision_encode_workers_busy") == 1; };
  auto wait_for = [](const std::function<bool()>& condition) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline && !condition()) absl::SleepFor(absl::Milliseconds(5));
    return condition();
  };
  const double encodes0 = p.Metric("vlm_vision_encode_seconds_count");

  // 1. A waiter whose deadline passes in the queue is answered without computing.
  v1::EncodeResponse slow_response;
  auto first = std::async(std::launch::async, [&] {
    return p.Encode(ImageRequest(slow1, kHuge), &slow_response);
  });
  ASSERT_TRUE(wait_for(busy));
  v1::EncodeResponse response;
  grpc::Status expired = p.Encode(ImageRequest(small1), &response, kWaiterDeadline);
  EXPECT_EQ(expired.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << expired.error_message();
  const grpc::Status first_status = first.get();
  ASSERT_TRUE(first_status.ok()) << first_status.error_message();
  std::printf("slow image: decode %.1f ms, preprocess %.1f ms, encode %.1f ms\n",
              slow_response.timings().decode_ms(), slow_response.timings().preprocess_ms(),
              slow_response.timings().encode_ms());
  EXPECT_TRUE(wait_for([&] {
    return p.Metric("vlm_vision_encode_queue_refused_total{reason=\"deadline\"}") == 1;
  }));
  EXPECT_EQ(p.Metric("vlm_vision_encode_seconds_count"), encodes0 + 1);  // only the big one ran
  grpc::Status s = p.Encode(HashRequest(Sha256Hex(small1)), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();

  // 2. Past the queue bound: RESOURCE_EXHAUSTED at once.
  auto running = std::async(std::launch::async, [&] {
    v1::EncodeResponse r;
    return p.Encode(ImageRequest(slow2, kBig), &r);
  });
  ASSERT_TRUE(wait_for(busy));
  auto queued = std::async(std::launch::async, [&] {
    v1::EncodeResponse r;
    return p.Encode(ImageRequest(small1), &r);
  });
  ASSERT_TRUE(wait_for([&] { return p.Metric("vlm_vision_encode_queue_depth") == 1; }));
  grpc::Status full = p.Encode(ImageRequest(small2), &response);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  EXPECT_NE(full.error_message().find("encode_queue_size"), std::string::npos)
      << full.error_message();
  const grpc::Status running_status = running.get(), queued_status = queued.get();
  EXPECT_TRUE(running_status.ok()) << running_status.error_message();
  EXPECT_TRUE(queued_status.ok()) << queued_status.error_message();
  s = p.Encode(ImageRequest(small2), &response);  // room again
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(p.Metric("vlm_vision_encode_queue_refused_total{reason=\"queue_full\"}"), 1);
  EXPECT_EQ(p.Terminate(), std::optional<int>(0));
}

}  // namespace
}  // namespace vlm
