// LayerStore: lazy materialization, LRU bound, pinning, background prefetch,
// in-place views vs converted copies, and the resident memory it implies
// (measured as this process's RSS on a checkpoint with 8 MB layers).
#include "services/language/model/layer_store.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <prometheus/gauge.h>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"

namespace vlm::language {
namespace {

constexpr char kPrefix[] = "model.language_model.";

TextConfig Config(int layers) {
  TextConfig c;
  c.vocab_size = 16;
  c.hidden_size = 512;
  c.intermediate_size = 2048;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.rms_norm_eps = 1e-6;
  return c;
}

// Value of element i of a layer tensor: distinct per (layer, field), exact in bf16.
float Pattern(int layer, int field, int64_t i) {
  return static_cast<float>((layer * 11 + field) % 64) + static_cast<float>(i % 4) * 0.25f;
}

// Writes a bf16 checkpoint with the layers of `c` (~7.9 MB each at these sizes).
std::string WriteCheckpoint(const TextConfig& c, const std::string& name) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim, in = c.intermediate_size;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> fields = {
      {"input_layernorm.weight", {h}},       {"self_attn.q_proj.weight", {q, h}},
      {"self_attn.k_proj.weight", {kv, h}},  {"self_attn.v_proj.weight", {kv, h}},
      {"self_attn.o_proj.weight", {h, q}},   {"self_attn.q_norm.weight", {c.head_dim}},
      {"self_attn.k_norm.weight", {c.head_dim}}, {"post_attention_layernorm.weight", {h}},
      {"mlp.gate_proj.weight", {in, h}},     {"mlp.up_proj.weight", {in, h}},
      {"mlp.down_proj.weight", {h, in}}};
  SafetensorsWriter w;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    for (size_t f = 0; f < fields.size(); ++f) {
      int64_t numel = 1;
      for (int64_t d : fields[f].second) numel *= d;
      EXPECT_TRUE(w.AddLazy(absl::StrCat(kPrefix, "layers.", l, ".", fields[f].first),
                            StDType::kBF16, fields[f].second,
                            [l, f, numel](uint8_t* dst) {
                              for (int64_t i = 0; i < numel; ++i) {
                                const float v = Pattern(l, static_cast<int>(f), i);
                                uint32_t bits;
                                std::memcpy(&bits, &v, 4);
                                const uint16_t b = static_cast<uint16_t>(bits >> 16);
                                std::memcpy(dst + 2 * i, &b, 2);
                              }
                            })
                      .ok());
    }
  }
  const std::string dir = ::testing::TempDir() + "/layer_store_" + name;
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  EXPECT_TRUE(w.Write(path).ok());
  return path;
}

std::shared_ptr<const SafetensorsCheckpoint> Open(const std::string& path) {
  auto ckpt = SafetensorsCheckpoint::Open(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  return std::shared_ptr<const SafetensorsCheckpoint>(*std::move(ckpt));
}

std::unique_ptr<LayerStore> Make(std::shared_ptr<const SafetensorsCheckpoint> ckpt,
                                 const TextConfig& c, at::ScalarType dtype,
                                 LayerStoreOptions o) {
  auto store = LayerStore::Create(std::move(ckpt), c, kPrefix, dtype, o);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

int64_t Rss() { return ReadProcessMemory().value().resident_bytes; }

// Checks a handle's weights carry the values of `layer`.
void ExpectLayerValues(const LayerStore::Handle& h, int layer) {
  EXPECT_FLOAT_EQ(h->q_proj.flatten()[5].item<float>(), Pattern(layer, 1, 5));
  EXPECT_FLOAT_EQ(h->down_proj.flatten()[7].item<float>(), Pattern(layer, 10, 7));
}

class LayerStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = new std::string(WriteCheckpoint(Config(4), "four"));
  }
  static void TearDownTestSuite() { delete path_; }
  static std::string* path_;
};
std::string* LayerStoreTest::path_ = nullptr;

TEST_F(LayerStoreTest, LazyStartTouchesNoLayerPages) {
  auto ckpt = Open(*path_);
  // Drop whatever an earlier open left mapped, then measure.
  const int64_t before = Rss();
  LayerStoreOptions o;
  o.prefetch_layers = 0;
  auto store = Make(ckpt, Config(4), at::kBFloat16, o);
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->in_place());
  const int64_t after_create = Rss();
  EXPECT_LT(after_create - before, 2 << 20) << "Create must only read headers";
  EXPECT_EQ(store->resident_layers(), 0);
  {
    auto h = store->Acquire(0);
    ASSERT_TRUE(h.ok()) << h.status();
    ExpectLayerValues(*h, 0);
  }
  const uint64_t layer = store->layer_bytes(0);
  EXPECT_GT(layer, 7u << 20);
  const int64_t after_one = Rss();
  EXPECT_GT(after_one - after_create, static_cast<int64_t>(layer * 9 / 10))
      << "materializing a layer maps its pages";
  EXPECT_EQ(store->resident_layers(), 1);
  EXPECT_EQ(store->resident_bytes(), layer);
}

TEST_F(LayerStoreTest, BoundDropsPagesOfLeastRecentlyUsedLayer) {
  auto ckpt = Open(*path_);
  LayerStoreOptions o;
  o.prefetch_layers = 0;
  o.resident_layers = 1;
  auto store = Make(ckpt, Config(4), at::kBFloat16, o);
  ASSERT_NE(store, nullptr);
  const int64_t start = Rss();
  for (int round = 0; round < 2; ++round) {
    for (int l = 0; l < 4; ++l) {
      auto h = store->Acquire(l);
      ASSERT_TRUE(h.ok());
      ExpectLayerValues(*h, l);
    }
  }
  const uint64_t layer = store->layer_bytes(0);
  EXPECT_EQ(store->resident_layers(), 1);
  EXPECT_TRUE(store->IsResident(3));
  EXPECT_EQ(store->evictions(), 7);
  EXPECT_EQ(store->materializations(), 8);
  // One layer resident (plus page slack), not four.
  EXPECT_LT(Rss() - start, static_cast<int64_t>(layer * 2)) << "dropped pages must leave the RSS";
}

TEST_F(LayerStoreTest, LruOrderAndPinning) {
  auto ckpt = Open(*path_);
  LayerStoreOptions o;
  o.prefetch_layers = 0;
  o.resident_layers = 2;
  auto store = Make(ckpt, Config(4), at::kBFloat16, o);
  ASSERT_NE(store, nullptr);
  for (int l : {0, 1, 0, 2}) ASSERT_TRUE(store->Acquire(l).ok());
  // 1 was least recently used when 2 came in.
  EXPECT_TRUE(store->IsResident(0));
  EXPECT_FALSE(store->IsResident(1));
  EXPECT_TRUE(store->IsResident(2));
  {
    // Pinned layers stay, even beyond the bound ...
    auto a = store->Acquire(1);
    auto b = store->Acquire(3);
    auto c = store->Acquire(0);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_EQ(store->resident_layers(), 3);
    ExpectLayerValues(*a, 1);
    ExpectLayerValues(*b, 3);
    ExpectLayerValues(*c, 0);
  }
  // ... and the bound holds again once they are released.
  EXPECT_EQ(store->resident_layers(), 2);
  EXPECT_FALSE(store->Acquire(4).ok());
}

TEST_F(LayerStoreTest, InPlaceWeightsAreViewsOfTheMapping) {
  auto ckpt = Open(*path_);
  auto store = Make(ckpt, Config(4), at::kBFloat16, {});
  ASSERT_NE(store, nullptr);
  auto h = store->Acquire(2);
  ASSERT_TRUE(h.ok());
  auto bytes = ckpt->Bytes(absl::StrCat(kPrefix, "layers.2.mlp.up_proj.weight"));
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ((*h)->up_proj.data_ptr(), static_cast<const void*>(bytes->data()));
  EXPECT_EQ((*h)->up_proj.scalar_type(), at::kBFloat16);
}

TEST_F(LayerStoreTest, ConvertedWeightsAreFreedAndRebuiltIdentically) {
  auto ckpt = Open(*path_);
  LayerStoreOptions o;
  o.prefetch_layers = 0;
  o.resident_layers = 1;
  auto store = Make(ckpt, Config(4), at::kFloat, o);
  ASSERT_NE(store, nullptr);
  EXPECT_FALSE(store->in_place());
  at::Tensor first;
  {
    auto h = store->Acquire(1);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ((*h)->gate_proj.scalar_type(), at::kFloat);
    first = (*h)->gate_proj.clone();
  }
  ASSERT_TRUE(store->Acquire(2).ok());
  EXPECT_FALSE(store->IsResident(1));
  auto again = store->Acquire(1);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(at::equal((*again)->gate_proj, first));
}

TEST_F(LayerStoreTest, BackgroundThreadPrefetchesTheNextLayersCyclically) {
  auto ckpt = Open(*path_);
  LayerStoreOptions o;
  o.prefetch_layers = 2;
  auto store = Make(ckpt, Config(4), at::kBFloat16, o);
  ASSERT_NE(store, nullptr);
  auto wait_resident = [&](int layer) {
    for (int i = 0; i < 500 && !store->IsResident(layer); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return store->IsResident(layer);
  };
  ASSERT_TRUE(store->Acquire(3).ok());
  EXPECT_TRUE(wait_resident(0));  // after the last layer: the next token's first
  EXPECT_TRUE(wait_resident(1));
  EXPECT_FALSE(store->IsResident(2));
}

TEST_F(LayerStoreTest, EagerLoadMaterializesAtCreate) {
  auto ckpt = Open(*path_);
  LayerStoreOptions o;
  o.eager_load = true;
  o.prefetch_layers = 0;
  auto store = Make(ckpt, Config(4), at::kBFloat16, o);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->resident_layers(), 4);
  o.resident_layers = 2;
  auto bounded = Make(ckpt, Config(4), at::kBFloat16, o);
  ASSERT_NE(bounded, nullptr);
  EXPECT_EQ(bounded->resident_layers(), 2);
}

TEST_F(LayerStoreTest, ConcurrentAcquiresUnderABoundSeeCorrectWeights) {
  auto ckpt = Open(*path_);
  LayerStoreOptions o;
  o.prefetch_layers = 1;
  o.resident_layers = 2;
  auto store = Make(ckpt, Config(4), at::kBFloat16, o);
  ASSERT_NE(store, nullptr);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 60; ++i) {
        const int l = static_cast<int>(rng() % 4);
        auto h = store->Acquire(l);
        if (!h.ok() || (*h)->q_proj.flatten()[5].item<float>() != Pattern(l, 1, 5)) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_LE(store->resident_layers(), 2);
}

TEST_F(LayerStoreTest, MetricsFollowResidency) {
  auto ckpt = Open(*path_);
  prometheus::Gauge& bytes = WeightBytesResidentGauge("layers");
  const double before = bytes.Value();
  {
    LayerStoreOptions o;
    o.prefetch_layers = 0;
    auto store = Make(ckpt, Config(4), at::kBFloat16, o);
    ASSERT_TRUE(store->Acquire(0).ok());
    ASSERT_TRUE(store->Acquire(1).ok());
    EXPECT_DOUBLE_EQ(bytes.Value() - before, static_cast<double>(2 * store->layer_bytes(0)));
    const std::string text = RenderMetrics();
    EXPECT_NE(text.find("vlm_language_layers_resident"), std::string::npos);
    EXPECT_NE(text.find("vlm_language_weight_bytes_resident{part=\"layers\"}"), std::string::npos);
    EXPECT_NE(text.find("vlm_language_layer_materialization_seconds_count"), std::string::npos);
  }
  EXPECT_DOUBLE_EQ(bytes.Value(), before);  // a destroyed store gives its bytes back
}

TEST_F(LayerStoreTest, CreateRejectsMissingOrMisshapenTensors) {
  auto ckpt = Open(*path_);
  // Config asks for 5 layers: layers.4.* are missing.
  auto missing = LayerStore::Create(ckpt, Config(5), kPrefix, at::kBFloat16, {});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("layers.4."), std::string::npos) << missing.status();
  TextConfig wide = Config(4);
  wide.intermediate_size = 1024;
  auto misshapen = LayerStore::Create(ckpt, wide, kPrefix, at::kBFloat16, {});
  ASSERT_FALSE(misshapen.ok());
  EXPECT_EQ(misshapen.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(misshapen.status().message().find("gate_proj"), std::string::npos) << misshapen.status();
}

}  // namespace
}  // namespace vlm::language
