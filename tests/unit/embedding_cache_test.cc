// The vision encoder's embedding cache: keys, memory LRU + TTL, single flight,
// pixel-key aliases, the disk tier and its integrity checks, and a bounded
// concurrency stress (also run under -fsanitize=thread by hand).
#include "services/vision/embedding_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/sha256.h"
#include "gtest/gtest.h"

namespace vlm::vision {
namespace {

namespace fs = std::filesystem;

const CacheKeyContext kContext{3136, 12845056, "fp-test"};

// A value whose every byte depends on `seed`, of about `bytes` bytes.
std::shared_ptr<CachedFeatures> MakeFeatures(int seed, int64_t patches = 4, int64_t hidden = 8) {
  auto f = std::make_shared<CachedFeatures>();
  f->grid_t = 1;
  f->grid_h = 2;
  f->grid_w = patches / 2;
  auto tensor = [&](int tap) {
    FeatureTensor t;
    t.dtype = FeatureDType::kBF16;
    t.shape = {patches, hidden};
    t.data.resize(static_cast<size_t>(patches * hidden * 2));
    for (size_t i = 0; i < t.data.size(); ++i) {
      t.data[i] = static_cast<char>((seed * 131 + tap * 17 + static_cast<int>(i) * 7) & 0xff);
    }
    return t;
  };
  f->last_hidden = tensor(0);
  for (int tap = 1; tap <= 3; ++tap) f->deepstack.push_back(tensor(tap));
  f->content_hash = Sha256Hex(absl::StrCat("image-", seed));
  return f;
}

// Patches such that one value holds about `kib` KiB of tensor data.
int64_t PatchesForKiB(int kib) { return kib * 1024 / (4 * 8 * 2); }

void ExpectSameFeatures(const CachedFeatures& a, const CachedFeatures& b) {
  EXPECT_EQ(a.grid_t, b.grid_t);
  EXPECT_EQ(a.grid_h, b.grid_h);
  EXPECT_EQ(a.grid_w, b.grid_w);
  EXPECT_EQ(a.content_hash, b.content_hash);
  ASSERT_EQ(a.deepstack.size(), b.deepstack.size());
  auto same = [](const FeatureTensor& x, const FeatureTensor& y) {
    EXPECT_EQ(x.dtype, y.dtype);
    EXPECT_EQ(x.shape, y.shape);
    EXPECT_TRUE(x.data == y.data);
  };
  same(a.last_hidden, b.last_hidden);
  for (size_t i = 0; i < a.deepstack.size(); ++i) same(a.deepstack[i], b.deepstack[i]);
}

CacheKey BytesKey(int i) { return KeyForImageBytes(absl::StrCat("encoded image ", i), kContext); }
CacheKey PixelsKey(int i) {
  return KeyForPixels(absl::StrCat("decoded pixels ", i), 1, 1, kContext);
}

// A compute callable that counts runs and returns `value`.
ComputeFn Returning(FeaturesPtr value, std::atomic<int>* calls) {
  return [value, calls](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
    ++*calls;
    return value;
  };
}

// What the vision service does: probe the pixel key, encode only on a miss.
ComputeFn ProbingThenEncoding(const CacheKey& pixel_key, FeaturesPtr value,
                              std::atomic<int>* encodes) {
  return [pixel_key, value, encodes](PixelKeyProbe& probe) -> absl::StatusOr<FeaturesPtr> {
    absl::StatusOr<FeaturesPtr> hit = probe.Find(pixel_key);
    if (!hit.ok()) return hit.status();
    if (*hit) return *hit;
    ++*encodes;
    return value;
  };
}

ComputeFn MustNotRun() {
  return [](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
    ADD_FAILURE() << "compute ran although the value is cached";
    return absl::InternalError("should not run");
  };
}

class FakeClock {
 public:
  absl::Time Now() const {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    std::lock_guard<std::mutex> lock(mu_);
    now_ += d;
  }
  std::function<absl::Time()> AsFunction() {
    return [this] { return Now(); };
  }

 private:
  mutable std::mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
};

class TempDir {
 public:
  // `in_memory`: on tmpfs if there is one (the stress test makes thousands of
  // files; on a disk shared with busy builds that takes tens of seconds).
  explicit TempDir(bool in_memory = false) {
    const char* env = std::getenv("TEST_TMPDIR");
    std::string base = env ? env : "/tmp";
    if (in_memory && ::access("/dev/shm", W_OK | X_OK) == 0) base = "/dev/shm";
    std::string pattern = base + "/embedding_cache_test.XXXXXX";
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string FileFor(const CacheKey& key) const { return path_ + "/" + key.Hex() + ".emb"; }

 private:
  std::string path_;
};

std::unique_ptr<EmbeddingCache> MakeCache(EmbeddingCacheOptions options) {
  absl::StatusOr<std::unique_ptr<EmbeddingCache>> cache = EmbeddingCache::Create(std::move(options));
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? *std::move(cache) : nullptr;
}

// Polls a condition that another thread will make true (no timing guesses).
template <typename Pred>
void WaitUntil(Pred pred) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!pred()) {
    ASSERT_LT(absl::Now(), give_up) << "condition never became true";
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// A gate a compute callable blocks on until the test opens it.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void WriteFileBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// ---------------------------------------------------------------------------
// Keys

TEST(EmbeddingCacheKeys, MatchTheDocumentedLayout) {
  // Independent reference: Python hashlib over the layout documented in
  // cache_key.h (tests/reference/cache_keys_ref.py prints both values), e.g.
  //   sha256(b"vlm.embedding_cache.bytes.v1\0" + sha256(b"hello").digest()
  //          + le64(3136) + le64(12845056) + le64(7) + b"fp-test")
  // Changing these invalidates every disk tier in the field: bump the domain.
  EXPECT_EQ(KeyForImageBytes("hello", kContext).Hex(),
            "e12fda5f43c5838cf2a6b8d0540ac4f6425c0e7c905b571230e65b9e9f750c74");
  std::string rgb;
  for (int i = 0; i < 12; ++i) rgb.push_back(static_cast<char>(i));
  EXPECT_EQ(KeyForPixels(rgb, 2, 2, kContext).Hex(),
            "923515d93e5dcacedb35d27ff832c8cad3cbb0040649aa03d1186b5aafaf1154");
}

TEST(EmbeddingCacheKeys, DependOnEveryInput) {
  const CacheKey base = KeyForImageBytes("img", kContext);
  EXPECT_EQ(base, KeyForContentHash(Sha256("img"), kContext));
  EXPECT_NE(base, KeyForImageBytes("img2", kContext));
  CacheKeyContext other = kContext;
  other.min_pixels += 1;
  EXPECT_NE(base, KeyForImageBytes("img", other));
  other = kContext;
  other.max_pixels += 1;
  EXPECT_NE(base, KeyForImageBytes("img", other));
  other = kContext;
  other.model_fingerprint = "fp-other";
  EXPECT_NE(base, KeyForImageBytes("img", other));

  const std::string rgb(2 * 3 * 3, 'x');
  EXPECT_NE(KeyForPixels(rgb, 2, 3, kContext), KeyForPixels(rgb, 3, 2, kContext));
  EXPECT_NE(KeyForPixels(rgb, 2, 3, kContext), KeyForPixels(rgb, 2, 3, other));
  // Same bytes as image and as pixels: different domains, different keys.
  EXPECT_NE(KeyForImageBytes(rgb, kContext), KeyForPixels(rgb, 2, 3, kContext));
}

TEST(EmbeddingCacheKeys, ParseContentHash) {
  const std::string hex = Sha256Hex("img");
  absl::StatusOr<Sha256Digest> lower = ParseContentHash(hex);
  ASSERT_TRUE(lower.ok());
  EXPECT_EQ(*lower, Sha256("img"));
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  ASSERT_TRUE(ParseContentHash(upper).ok());
  EXPECT_EQ(*ParseContentHash(upper), Sha256("img"));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseContentHash(hex.substr(1)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseContentHash("").status()));
  std::string bad = hex;
  bad[10] = 'g';
  EXPECT_TRUE(absl::IsInvalidArgument(ParseContentHash(bad).status()));
}

TEST(CachedFeatures, ValidateRejectsInconsistentTensors) {
  EXPECT_TRUE(MakeFeatures(1)->Validate().ok());
  auto f = MakeFeatures(1);
  f->last_hidden.data.pop_back();
  EXPECT_FALSE(f->Validate().ok());
  f = MakeFeatures(1);
  f->deepstack[2].shape = {4, 9};
  EXPECT_FALSE(f->Validate().ok());
  f = MakeFeatures(1);
  f->deepstack[0].dtype = static_cast<FeatureDType>(9);
  EXPECT_FALSE(f->Validate().ok());
  f = MakeFeatures(1);
  f->grid_h = 0;
  EXPECT_FALSE(f->Validate().ok());
  f = MakeFeatures(1);
  f->last_hidden.dtype = FeatureDType::kF32;  // twice the bytes per element
  EXPECT_FALSE(f->Validate().ok());
}

// ---------------------------------------------------------------------------
// Memory tier

TEST(EmbeddingCache, ComputesOnMissThenHitsMemory) {
  auto cache = MakeCache({});
  auto value = MakeFeatures(1);
  std::atomic<int> calls{0};
  absl::StatusOr<CacheResult> first = cache->GetOrCompute(BytesKey(1), Returning(value, &calls));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->level, CacheLevel::kMiss);
  EXPECT_FALSE(first->coalesced);
  EXPECT_EQ(first->features, value);

  absl::StatusOr<CacheResult> second = cache->GetOrCompute(BytesKey(1), MustNotRun());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->level, CacheLevel::kMemory);
  EXPECT_EQ(second->features, value);  // shared, not copied
  EXPECT_EQ(calls.load(), 1);

  // A different key is a different entry.
  absl::StatusOr<CacheResult> other =
      cache->GetOrCompute(BytesKey(2), Returning(MakeFeatures(2), &calls));
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->level, CacheLevel::kMiss);
  EXPECT_EQ(calls.load(), 2);

  const EmbeddingCacheStats stats = cache->Stats();
  EXPECT_EQ(stats.misses, 2u);
  EXPECT_EQ(stats.memory_hits, 1u);
  EXPECT_EQ(stats.memory_entries, 2u);
  EXPECT_GE(stats.memory_bytes, value->ByteSize() * 2);
  EXPECT_EQ(stats.inflight, 0u);
}

TEST(EmbeddingCache, SamePixelsFromOtherBytesHitByPixelKey) {
  auto cache = MakeCache({});
  auto value = MakeFeatures(1);
  std::atomic<int> encodes{0};
  // The JPEG and the PNG of one picture: different bytes, same pixels.
  const CacheKey jpeg = BytesKey(1), png = BytesKey(2), pixels = PixelsKey(1);
  absl::StatusOr<CacheResult> a = cache->GetOrCompute(jpeg, ProbingThenEncoding(pixels, value, &encodes));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->level, CacheLevel::kMiss);

  absl::StatusOr<CacheResult> b =
      cache->GetOrCompute(png, ProbingThenEncoding(pixels, MakeFeatures(99), &encodes));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->level, CacheLevel::kPixels);
  EXPECT_EQ(b->features, value);
  EXPECT_EQ(encodes.load(), 1);

  // The PNG's bytes key now points at the same entry: no decode next time.
  absl::StatusOr<CacheResult> again = cache->GetOrCompute(png, MustNotRun());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->level, CacheLevel::kMemory);
  EXPECT_EQ(again->features, value);

  const EmbeddingCacheStats stats = cache->Stats();
  EXPECT_EQ(stats.misses, 1u);
  EXPECT_EQ(stats.pixel_hits, 1u);
  EXPECT_EQ(stats.memory_hits, 1u);
  EXPECT_EQ(stats.memory_entries, 1u);
}

TEST(EmbeddingCache, ContentHashLookup) {
  auto cache = MakeCache({});
  const std::string image = "the bytes of an image";
  auto value = MakeFeatures(3);
  std::atomic<int> calls{0};
  ASSERT_TRUE(cache->GetOrCompute(KeyForImageBytes(image, kContext), Returning(value, &calls)).ok());

  // A later request carries only the hex hash the client computed.
  absl::StatusOr<Sha256Digest> hash = ParseContentHash(Sha256Hex(image));
  ASSERT_TRUE(hash.ok());
  absl::StatusOr<CacheResult> found = cache->Lookup(KeyForContentHash(*hash, kContext));
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->level, CacheLevel::kMemory);
  EXPECT_EQ(found->features, value);

  // Other options or an unknown hash: NOT_FOUND, nothing computed.
  CacheKeyContext other = kContext;
  other.max_pixels = 1 << 20;
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(KeyForContentHash(*hash, other)).status()));
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(KeyForContentHash(Sha256("never sent"), kContext)).status()));
  EXPECT_EQ(cache->Stats().not_found, 2u);
  EXPECT_EQ(calls.load(), 1);
}

TEST(EmbeddingCache, LruEvictsLeastRecentlyUsedByBytes) {
  // Room for two 64 KiB values, not three.
  EmbeddingCacheOptions options;
  options.max_bytes = 160 * 1024;
  auto cache = MakeCache(options);
  const int64_t patches = PatchesForKiB(64);
  std::atomic<int> calls{0};
  for (int i = 1; i <= 2; ++i) {
    ASSERT_TRUE(cache->GetOrCompute(BytesKey(i), Returning(MakeFeatures(i, patches), &calls)).ok());
  }
  ASSERT_TRUE(cache->GetOrCompute(BytesKey(1), MustNotRun()).ok());  // 1 is now the newest
  ASSERT_TRUE(cache->GetOrCompute(BytesKey(3), Returning(MakeFeatures(3, patches), &calls)).ok());

  EmbeddingCacheStats stats = cache->Stats();
  EXPECT_EQ(stats.evictions, 1u);
  EXPECT_EQ(stats.memory_entries, 2u);
  EXPECT_LE(stats.memory_bytes, options.max_bytes);
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(BytesKey(2)).status()));  // evicted
  EXPECT_TRUE(cache->Lookup(BytesKey(1)).ok());
  EXPECT_TRUE(cache->Lookup(BytesKey(3)).ok());

  // A value larger than the whole tier is returned but not kept.
  absl::StatusOr<CacheResult> huge =
      cache->GetOrCompute(BytesKey(4), Returning(MakeFeatures(4, PatchesForKiB(256)), &calls));
  ASSERT_TRUE(huge.ok());
  EXPECT_EQ(huge->level, CacheLevel::kMiss);
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(BytesKey(4)).status()));
  stats = cache->Stats();
  EXPECT_EQ(stats.memory_entries, 2u);  // nothing evicted for it
  EXPECT_EQ(stats.evictions, 1u);
}

TEST(EmbeddingCache, LruEvictsLeastRecentlyUsedByCount) {
  EmbeddingCacheOptions options;
  options.max_entries = 3;
  auto cache = MakeCache(options);
  std::atomic<int> calls{0};
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(cache->GetOrCompute(BytesKey(i), Returning(MakeFeatures(i), &calls)).ok());
  }
  ASSERT_TRUE(cache->Lookup(BytesKey(1)).ok());  // touch: 2 is now the oldest
  ASSERT_TRUE(cache->GetOrCompute(BytesKey(4), Returning(MakeFeatures(4), &calls)).ok());
  EXPECT_EQ(cache->Stats().memory_entries, 3u);
  EXPECT_EQ(cache->Stats().evictions, 1u);
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(BytesKey(2)).status()));
  for (int i : {1, 3, 4}) EXPECT_TRUE(cache->Lookup(BytesKey(i)).ok()) << i;

  // An evicted entry takes its pixel alias with it.
  options.max_entries = 1;
  cache = MakeCache(options);
  std::atomic<int> encodes{0};
  ASSERT_TRUE(cache->GetOrCompute(BytesKey(1), ProbingThenEncoding(PixelsKey(1), MakeFeatures(1), &encodes)).ok());
  ASSERT_TRUE(cache->GetOrCompute(BytesKey(2), ProbingThenEncoding(PixelsKey(2), MakeFeatures(2), &encodes)).ok());
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(PixelsKey(1)).status()));
  EXPECT_TRUE(cache->Lookup(PixelsKey(2)).ok());
}

TEST(EmbeddingCache, ExpiredEntryIsAMissAndIsRemoved) {
  FakeClock clock;
  EmbeddingCacheOptions options;
  options.ttl = absl::Seconds(10);
  options.clock = clock.AsFunction();
  auto cache = MakeCache(options);
  std::atomic<int> calls{0};
  ASSERT_TRUE(cache->GetOrCompute(BytesKey(1), Returning(MakeFeatures(1), &calls)).ok());
  clock.Advance(absl::Seconds(9));
  absl::StatusOr<CacheResult> fresh = cache->GetOrCompute(BytesKey(1), MustNotRun());
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->level, CacheLevel::kMemory);

  clock.Advance(absl::Seconds(1));  // 10 s since it was computed: the TTL counts from then
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(BytesKey(1)).status()));
  EXPECT_EQ(cache->Stats().expirations, 1u);
  EXPECT_EQ(cache->Stats().memory_entries, 0u);
  EXPECT_EQ(cache->Stats().memory_bytes, 0u);

  absl::StatusOr<CacheResult> recomputed =
      cache->GetOrCompute(BytesKey(1), Returning(MakeFeatures(1), &calls));
  ASSERT_TRUE(recomputed.ok());
  EXPECT_EQ(recomputed->level, CacheLevel::kMiss);
  EXPECT_EQ(calls.load(), 2);

  EmbeddingCacheOptions zero_ttl;
  zero_ttl.ttl = absl::ZeroDuration();
  EXPECT_FALSE(EmbeddingCache::Create(zero_ttl).ok());
}

// ---------------------------------------------------------------------------
// Single flight

TEST(EmbeddingCacheSingleFlight, ConcurrentMissesComputeOnce) {
  auto cache = MakeCache({});
  constexpr int kThreads = 8;
  auto value = MakeFeatures(7);
  Gate gate;
  std::atomic<int> calls{0};
  ComputeFn compute = [&](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
    ++calls;
    gate.Wait();
    return value;
  };
  std::vector<absl::StatusOr<CacheResult>> results(kThreads, absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] { results[i] = cache->GetOrCompute(BytesKey(1), compute); });
  }
  // Every other thread is parked on the flight before the computation ends.
  WaitUntil([&] { return cache->Stats().waiting == kThreads - 1; });
  EXPECT_EQ(cache->Stats().inflight, 1u);
  gate.Open();
  for (std::thread& t : threads) t.join();

  EXPECT_EQ(calls.load(), 1);
  int coalesced = 0;
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->features, value);
    EXPECT_EQ(r->level, CacheLevel::kMiss);
    coalesced += r->coalesced;
  }
  EXPECT_EQ(coalesced, kThreads - 1);
  const EmbeddingCacheStats stats = cache->Stats();
  EXPECT_EQ(stats.misses, 1u);
  EXPECT_EQ(stats.coalesced, static_cast<uint64_t>(kThreads - 1));
  EXPECT_EQ(stats.waiting, 0u);
  EXPECT_EQ(stats.inflight, 0u);
}

TEST(EmbeddingCacheSingleFlight, FailureReachesAllWaitersAndIsNotCached) {
  auto cache = MakeCache({});
  constexpr int kThreads = 4;
  Gate gate;
  std::atomic<int> calls{0};
  ComputeFn failing = [&](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
    ++calls;
    gate.Wait();
    return absl::InvalidArgumentError("not an image: unknown format");
  };
  std::vector<absl::Status> statuses(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] { statuses[i] = cache->GetOrCompute(BytesKey(1), failing).status(); });
  }
  WaitUntil([&] { return cache->Stats().waiting == kThreads - 1; });
  gate.Open();
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(calls.load(), 1);
  for (const absl::Status& s : statuses) {
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_EQ(s.message(), "not an image: unknown format");
  }
  EXPECT_EQ(cache->Stats().compute_failures, 1u);
  EXPECT_EQ(cache->Stats().memory_entries, 0u);

  // Not cached: the next request computes again (and may succeed).
  absl::StatusOr<CacheResult> later = cache->GetOrCompute(BytesKey(1), Returning(MakeFeatures(1), &calls));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->level, CacheLevel::kMiss);
  EXPECT_EQ(calls.load(), 2);
}

TEST(EmbeddingCacheSingleFlight, WaitersRetryWhenTheComputingCallerIsCancelled) {
  auto cache = MakeCache({});
  constexpr int kThreads = 4;
  auto value = MakeFeatures(5);
  Gate gate;
  std::atomic<int> calls{0};
  // The first caller's own request is cancelled mid-encode; that says nothing
  // about the image, so one of the waiters computes instead.
  ComputeFn compute = [&](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
    if (calls.fetch_add(1) == 0) {
      gate.Wait();
      return absl::CancelledError("client cancelled");
    }
    return value;
  };
  std::vector<absl::StatusOr<CacheResult>> results(kThreads, absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  threads.emplace_back([&] { results[0] = cache->GetOrCompute(BytesKey(1), compute); });
  WaitUntil([&] { return calls.load() == 1; });
  for (int i = 1; i < kThreads; ++i) {
    threads.emplace_back([&, i] { results[i] = cache->GetOrCompute(BytesKey(1), compute); });
  }
  WaitUntil([&] { return cache->Stats().waiting == kThreads - 1; });
  gate.Open();
  for (std::thread& t : threads) t.join();

  EXPECT_TRUE(absl::IsCancelled(results[0].status())) << results[0].status();
  for (int i = 1; i < kThreads; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(results[i]->features, value);
  }
  EXPECT_EQ(calls.load(), 2);
}

TEST(EmbeddingCacheSingleFlight, WaiterGivesUpAtItsDeadlineOrCancellation) {
  auto cache = MakeCache({});
  Gate gate;
  std::atomic<int> calls{0};
  auto value = MakeFeatures(1);
  ComputeFn slow = [&](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
    ++calls;
    gate.Wait();
    return value;
  };
  absl::StatusOr<CacheResult> leader = absl::UnknownError("unset");
  std::thread computing([&] { leader = cache->GetOrCompute(BytesKey(1), slow); });
  WaitUntil([&] { return calls.load() == 1; });

  WaitOptions deadline;
  deadline.deadline = absl::Now() + absl::Milliseconds(30);
  absl::StatusOr<CacheResult> late = cache->GetOrCompute(BytesKey(1), slow, deadline);
  EXPECT_TRUE(absl::IsDeadlineExceeded(late.status())) << late.status();
  EXPECT_TRUE(absl::IsDeadlineExceeded(cache->Lookup(BytesKey(1), deadline).status()));

  std::atomic<bool> cancelled{false};
  WaitOptions cancellable;
  cancellable.is_cancelled = [&] { return cancelled.load(); };
  absl::StatusOr<CacheResult> gone = absl::UnknownError("unset");
  std::thread waiter([&] { gone = cache->GetOrCompute(BytesKey(1), slow, cancellable); });
  WaitUntil([&] { return cache->Stats().waiting == 1; });
  cancelled = true;
  waiter.join();
  EXPECT_TRUE(absl::IsCancelled(gone.status())) << gone.status();

  gate.Open();
  computing.join();
  ASSERT_TRUE(leader.ok()) << leader.status();
  EXPECT_EQ(leader->features, value);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(cache->Stats().wait_aborts, 3u);
}

TEST(EmbeddingCacheSingleFlight, SamePixelsInFlightAreComputedOnce) {
  auto cache = MakeCache({});
  Gate gate;
  std::atomic<int> encodes{0};
  auto value = MakeFeatures(1);
  const CacheKey pixels = PixelsKey(1);
  // The JPEG's request is encoding; the PNG's request decodes the same pixels
  // and waits for it instead of encoding again.
  ComputeFn jpeg = [&](PixelKeyProbe& probe) -> absl::StatusOr<FeaturesPtr> {
    absl::StatusOr<FeaturesPtr> hit = probe.Find(pixels);
    if (!hit.ok() || *hit) return absl::InternalError("expected a miss");
    ++encodes;
    gate.Wait();
    return value;
  };
  absl::StatusOr<CacheResult> a = absl::UnknownError("unset");
  std::thread first([&] { a = cache->GetOrCompute(BytesKey(1), jpeg); });
  WaitUntil([&] { return encodes.load() == 1; });
  absl::StatusOr<CacheResult> b = absl::UnknownError("unset");
  std::thread second([&] {
    b = cache->GetOrCompute(BytesKey(2), ProbingThenEncoding(pixels, MakeFeatures(2), &encodes));
  });
  WaitUntil([&] { return cache->Stats().waiting == 1; });
  gate.Open();
  first.join();
  second.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->level, CacheLevel::kMiss);
  EXPECT_EQ(b->level, CacheLevel::kPixels);
  EXPECT_EQ(b->features, value);
  EXPECT_EQ(encodes.load(), 1);
}

TEST(EmbeddingCache, BadComputeResultsAreErrorsAndNotCached) {
  auto cache = MakeCache({});
  auto broken = MakeFeatures(1);
  broken->deepstack[1].data.resize(3);
  std::atomic<int> calls{0};
  absl::Status s = cache->GetOrCompute(BytesKey(1), Returning(broken, &calls)).status();
  EXPECT_TRUE(absl::IsInternal(s)) << s;
  s = cache->GetOrCompute(BytesKey(1), Returning(nullptr, &calls)).status();
  EXPECT_TRUE(absl::IsInternal(s)) << s;
  ComputeFn throwing = [](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
    throw std::runtime_error("boom");
  };
  s = cache->GetOrCompute(BytesKey(1), throwing).status();
  EXPECT_TRUE(absl::IsInternal(s)) << s;
  ComputeFn twice = [](PixelKeyProbe& probe) -> absl::StatusOr<FeaturesPtr> {
    if (!probe.Find(PixelsKey(1)).ok()) return absl::InternalError("first Find failed");
    return probe.Find(PixelsKey(2)).status();
  };
  s = cache->GetOrCompute(BytesKey(1), twice).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(cache->Stats().memory_entries, 0u);
  EXPECT_EQ(cache->Stats().inflight, 0u);
  EXPECT_EQ(cache->Stats().compute_failures, 4u);
  // Nothing left registered under the pixel key either.
  EXPECT_TRUE(absl::IsNotFound(cache->Lookup(PixelsKey(1)).status()));
}

// ---------------------------------------------------------------------------
// Disk tier

EmbeddingCacheOptions DiskOptions(const TempDir& dir) {
  EmbeddingCacheOptions options;
  options.disk_dir = dir.path();
  return options;
}

TEST(EmbeddingCacheDisk, SurvivesANewCacheInstance) {
  TempDir dir;
  auto value = MakeFeatures(11, PatchesForKiB(32));
  std::atomic<int> encodes{0};
  {
    auto cache = MakeCache(DiskOptions(dir));
    ASSERT_TRUE(cache->GetOrCompute(BytesKey(1), ProbingThenEncoding(PixelsKey(1), value, &encodes)).ok());
    cache->FlushDiskWrites();
    const EmbeddingCacheStats stats = cache->Stats();
    EXPECT_EQ(stats.disk_writes, 2u);  // the entry and its pixel alias
    EXPECT_EQ(stats.disk_files, 2u);
    EXPECT_EQ(stats.disk_errors, 0u);
  }
  {
    // Restart: the bytes key is read from disk, then served from memory.
    auto cache = MakeCache(DiskOptions(dir));
    EXPECT_EQ(cache->Stats().disk_files, 2u);
    absl::StatusOr<CacheResult> r = cache->GetOrCompute(BytesKey(1), MustNotRun());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->level, CacheLevel::kDisk);
    ExpectSameFeatures(*r->features, *value);
    absl::StatusOr<CacheResult> again = cache->GetOrCompute(BytesKey(1), MustNotRun());
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->level, CacheLevel::kMemory);
    EXPECT_EQ(again->features, r->features);
    // Promoted with its pixel key too.
    EXPECT_EQ(cache->Lookup(PixelsKey(1))->level, CacheLevel::kMemory);
    EXPECT_EQ(cache->Stats().disk_hits, 1u);
  }
  {
    // Restart, then the same picture in another container: pixel key on disk.
    auto cache = MakeCache(DiskOptions(dir));
    absl::StatusOr<CacheResult> r =
        cache->GetOrCompute(BytesKey(2), ProbingThenEncoding(PixelsKey(1), MakeFeatures(2), &encodes));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->level, CacheLevel::kDisk);
    ExpectSameFeatures(*r->features, *value);
    EXPECT_EQ(cache->GetOrCompute(BytesKey(2), MustNotRun())->level, CacheLevel::kMemory);
    cache->FlushDiskWrites();  // writes the alias for the second container's bytes
  }
  {
    // Restart: a content-hash request for the second container's bytes.
    auto cache = MakeCache(DiskOptions(dir));
    absl::StatusOr<CacheResult> r = cache->Lookup(BytesKey(2));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->level, CacheLevel::kDisk);
    ExpectSameFeatures(*r->features, *value);
    EXPECT_EQ(cache->Stats().disk_errors, 0u);
  }
  EXPECT_EQ(encodes.load(), 1);
}

TEST(EmbeddingCacheDisk, FileFormatIsTheDocumentedOne) {
  TempDir dir;
  std::atomic<int> calls{0};
  {
    auto cache = MakeCache(DiskOptions(dir));
    ASSERT_TRUE(cache->GetOrCompute(BytesKey(1), Returning(MakeFeatures(1), &calls)).ok());
  }  // the destructor finishes queued writes
  const std::string file = ReadFileBytes(dir.FileFor(BytesKey(1)));
  ASSERT_GT(file.size(), 88u);
  EXPECT_EQ(file.substr(0, 8), std::string("VLMEMBC\n"));
  EXPECT_EQ(file.substr(8, 8), std::string("\x01\0\0\0\x01\0\0\0", 8));  // version 1, entry
  const CacheKey key = BytesKey(1);
  EXPECT_EQ(file.substr(16, 32), std::string(reinterpret_cast<const char*>(key.digest.data()), 32));
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t{static_cast<uint8_t>(file[48 + i])} << (8 * i);
  EXPECT_EQ(length, file.size() - 88);
  const Sha256Digest sum = Sha256(std::string_view(file).substr(88));
  EXPECT_EQ(file.substr(56, 32), std::string(reinterpret_cast<const char*>(sum.data()), 32));
  // No temporary files left behind.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().rfind("tmp-", 0), std::string::npos);
    ++entries;
  }
  EXPECT_EQ(entries, 1);
}

struct Corruption {
  const char* name;
  std::function<std::string(std::string)> apply;
};

void PrintTo(const Corruption& c, std::ostream* os) { *os << c.name; }

class EmbeddingCacheCorruptDisk : public testing::TestWithParam<Corruption> {};

TEST_P(EmbeddingCacheCorruptDisk, EntryIsIgnoredDeletedCountedAndRecomputed) {
  TempDir dir;
  auto value = MakeFeatures(4, PatchesForKiB(8));
  std::atomic<int> calls{0};
  {
    auto cache = MakeCache(DiskOptions(dir));
    ASSERT_TRUE(cache->GetOrCompute(BytesKey(1), Returning(value, &calls)).ok());
  }
  const std::string path = dir.FileFor(BytesKey(1));
  WriteFileBytes(path, GetParam().apply(ReadFileBytes(path)));
  {
    auto cache = MakeCache(DiskOptions(dir));
    EXPECT_TRUE(absl::IsNotFound(cache->Lookup(BytesKey(1)).status()));  // never served
    EmbeddingCacheStats stats = cache->Stats();
    EXPECT_EQ(stats.disk_corrupt, 1u);
    EXPECT_EQ(stats.disk_errors, 1u);
    EXPECT_EQ(stats.disk_files, 0u);
    EXPECT_FALSE(fs::exists(path)) << "corrupt file not deleted";

    absl::StatusOr<CacheResult> r = cache->GetOrCompute(BytesKey(1), Returning(value, &calls));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->level, CacheLevel::kMiss);
    EXPECT_EQ(calls.load(), 2);
  }
  {
    auto cache = MakeCache(DiskOptions(dir));  // the recomputed value was written back
    absl::StatusOr<CacheResult> r = cache->Lookup(BytesKey(1));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->level, CacheLevel::kDisk);
    ExpectSameFeatures(*r->features, *value);
  }
}

std::string FlipByte(std::string s, size_t at) {
  s[at] = static_cast<char>(s[at] ^ 0x20);
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Corruptions, EmbeddingCacheCorruptDisk,
    testing::Values(
        Corruption{"FlippedPayloadByte", [](std::string s) { return FlipByte(s, s.size() / 2 + 50); }},
        Corruption{"FlippedLastByte", [](std::string s) { return FlipByte(s, s.size() - 1); }},
        Corruption{"FlippedChecksum", [](std::string s) { return FlipByte(s, 60); }},
        Corruption{"FlippedKey", [](std::string s) { return FlipByte(s, 20); }},
        Corruption{"WrongMagic", [](std::string s) { return FlipByte(s, 0); }},
        Corruption{"WrongVersion", [](std::string s) { return FlipByte(s, 8); }},
        Corruption{"WrongLength", [](std::string s) { return FlipByte(s, 48); }},
        Corruption{"Truncated", [](std::string s) { return s.substr(0, s.size() - 7); }},
        Corruption{"TruncatedHeader", [](std::string s) { return s.substr(0, 40); }},
        Corruption{"Empty", [](std::string) { return std::string(); }},
        Corruption{"TrailingGarbage", [](std::string s) { return s + "junk"; }}),
    [](const testing::TestParamInfo<Corruption>& info) { return info.param.name; });

TEST(EmbeddingCacheDisk, BoundedByBytesEvictingLeastRecentlyUsed) {
  TempDir dir;
  EmbeddingCacheOptions options = DiskOptions(dir);
  options.disk_max_bytes = 160 * 1024;  // two 64 KiB entries
  options.max_entries = 1;              // keep the memory tier out of the way
  const int64_t patches = PatchesForKiB(64);
  std::atomic<int> calls{0};
  {
    auto cache = MakeCache(options);
    for (int i = 1; i <= 2; ++i) {
      ASSERT_TRUE(cache->GetOrCompute(BytesKey(i), Returning(MakeFeatures(i, patches), &calls)).ok());
    }
    cache->FlushDiskWrites();
    // Entry 2 is in memory, so reading 1 comes from disk and makes it recent.
    ASSERT_EQ(cache->Lookup(BytesKey(1))->level, CacheLevel::kDisk);
    ASSERT_TRUE(cache->GetOrCompute(BytesKey(3), Returning(MakeFeatures(3, patches), &calls)).ok());
    cache->FlushDiskWrites();
    const EmbeddingCacheStats stats = cache->Stats();
    EXPECT_EQ(stats.disk_evictions, 1u);
    EXPECT_EQ(stats.disk_files, 2u);
    EXPECT_LE(stats.disk_bytes, options.disk_max_bytes);
    EXPECT_FALSE(fs::exists(dir.FileFor(BytesKey(2))));
    EXPECT_TRUE(fs::exists(dir.FileFor(BytesKey(1))));
    EXPECT_TRUE(fs::exists(dir.FileFor(BytesKey(3))));
  }
  {
    // A smaller bound at restart evicts down to it, oldest mtime first.
    // (mtime resolution: make entry 1 clearly the oldest.)
    const auto old = fs::file_time_type::clock::now() - std::chrono::hours(1);
    fs::last_write_time(dir.FileFor(BytesKey(1)), old);
    options.disk_max_bytes = 100 * 1024;
    auto cache = MakeCache(options);
    const EmbeddingCacheStats stats = cache->Stats();
    EXPECT_EQ(stats.disk_files, 1u);
    EXPECT_EQ(stats.disk_bytes, fs::file_size(dir.FileFor(BytesKey(3))));
    EXPECT_FALSE(fs::exists(dir.FileFor(BytesKey(1))));
    EXPECT_EQ(cache->Lookup(BytesKey(3))->level, CacheLevel::kDisk);
  }
}

TEST(EmbeddingCacheDisk, StartupRemovesTemporaryFilesAndKeepsForeignOnes) {
  TempDir dir;
  WriteFileBytes(dir.path() + "/tmp-abc-1-0", "half written");
  WriteFileBytes(dir.path() + "/README", "operator notes");
  auto cache = MakeCache(DiskOptions(dir));
  EXPECT_FALSE(fs::exists(dir.path() + "/tmp-abc-1-0"));
  EXPECT_TRUE(fs::exists(dir.path() + "/README"));
  EXPECT_EQ(cache->Stats().disk_files, 0u);
}

TEST(EmbeddingCacheDisk, ExpiredDiskEntryIsAMissAndIsDeleted) {
  TempDir dir;
  FakeClock clock;
  EmbeddingCacheOptions options = DiskOptions(dir);
  options.ttl = absl::Hours(1);
  options.clock = clock.AsFunction();
  std::atomic<int> calls{0};
  {
    auto cache = MakeCache(options);
    ASSERT_TRUE(cache->GetOrCompute(BytesKey(1), Returning(MakeFeatures(1), &calls)).ok());
  }
  clock.Advance(absl::Minutes(59));
  {
    auto cache = MakeCache(options);
    EXPECT_EQ(cache->Lookup(BytesKey(1))->level, CacheLevel::kDisk);  // TTL survives restarts
  }
  clock.Advance(absl::Minutes(2));
  {
    auto cache = MakeCache(options);
    EXPECT_TRUE(absl::IsNotFound(cache->Lookup(BytesKey(1)).status()));
    EXPECT_EQ(cache->Stats().expirations, 1u);
    EXPECT_EQ(cache->Stats().disk_errors, 0u);
    EXPECT_FALSE(fs::exists(dir.FileFor(BytesKey(1))));
  }
}

TEST(EmbeddingCacheDisk, UnwritableDirectoryFailsCreateButIoErrorsLaterAreOnlyCounted) {
  TempDir dir;
  WriteFileBytes(dir.path() + "/file", "x");
  EmbeddingCacheOptions options;
  options.disk_dir = dir.path() + "/file/sub";  // a path through a regular file
  EXPECT_FALSE(EmbeddingCache::Create(options).ok());

  // The directory vanishes under a running cache: requests still succeed.
  const std::string sub = dir.path() + "/sub";
  options.disk_dir = sub;
  auto cache = MakeCache(options);
  fs::remove_all(sub);
  std::atomic<int> calls{0};
  absl::StatusOr<CacheResult> r = cache->GetOrCompute(BytesKey(1), Returning(MakeFeatures(1), &calls));
  ASSERT_TRUE(r.ok()) << r.status();
  cache->FlushDiskWrites();
  EXPECT_EQ(cache->Stats().disk_errors, 1u);
  EXPECT_EQ(cache->Stats().disk_writes, 0u);
  EXPECT_EQ(cache->GetOrCompute(BytesKey(1), MustNotRun())->level, CacheLevel::kMemory);
}

// ---------------------------------------------------------------------------
// Stress: many threads, few keys, tight bounds, TTL, disk; every answer must be
// the value of the key asked for. Run under TSan by hand (see the report).

TEST(EmbeddingCacheStress, ConcurrentMixedOperations) {
  TempDir dir(/*in_memory=*/true);
  FakeClock clock;
  EmbeddingCacheOptions options = DiskOptions(dir);
  options.max_entries = 12;
  options.max_bytes = 64 * 1024;
  options.ttl = absl::Seconds(30);
  options.disk_max_bytes = 48 * 1024;  // about half of all entries + aliases
  options.clock = clock.AsFunction();
  auto cache = MakeCache(options);

  constexpr int kThreads = 8;
  constexpr int kOps = 2000;
  constexpr int kImages = 48;  // image i has bytes keys 2i and 2i+1 (two containers)
  std::vector<std::shared_ptr<CachedFeatures>> values;
  for (int i = 0; i < kImages; ++i) values.push_back(MakeFeatures(i, 8, 16));
  std::atomic<int> wrong{0}, errors{0}, encodes{0};

  auto worker = [&](int thread) {
    std::mt19937 rng(1234 + thread);
    for (int op = 0; op < kOps; ++op) {
      const int image = static_cast<int>(rng() % kImages);
      const CacheKey bytes = BytesKey(2 * image + static_cast<int>(rng() % 2));
      const int kind = static_cast<int>(rng() % 10);
      absl::StatusOr<CacheResult> r = absl::UnknownError("unset");
      if (kind == 0) {
        r = cache->Lookup(bytes);
        if (absl::IsNotFound(r.status())) continue;
      } else if (kind == 1) {
        // A request that fails for its image: never cached.
        r = cache->GetOrCompute(BytesKey(100000 + image), [](PixelKeyProbe&) -> absl::StatusOr<FeaturesPtr> {
          return absl::InvalidArgumentError("bad");
        });
        if (!absl::IsInvalidArgument(r.status())) ++wrong;
        continue;
      } else if (kind == 2 && thread == 0) {
        clock.Advance(absl::Seconds(1));
        // Let the disk writer catch up, or it lags the whole run (8 threads
        // of in-memory work on 2 cores) and disk reads never happen.
        cache->FlushDiskWrites();
        continue;
      } else {
        r = cache->GetOrCompute(bytes, [&, image](PixelKeyProbe& probe) -> absl::StatusOr<FeaturesPtr> {
          absl::StatusOr<FeaturesPtr> hit = probe.Find(PixelsKey(image));
          if (!hit.ok()) return hit.status();
          if (*hit) return *hit;
          ++encodes;
          return values[image];
        });
      }
      if (!r.ok()) {
        ++errors;
        continue;
      }
      // Values from disk are copies: compare content, cheaply.
      if (r->features->content_hash != values[image]->content_hash ||
          r->features->last_hidden.data != values[image]->last_hidden.data) {
        ++wrong;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& t : threads) t.join();
  cache->FlushDiskWrites();

  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(errors.load(), 0);
  const EmbeddingCacheStats stats = cache->Stats();
  EXPECT_LE(stats.memory_entries, options.max_entries);
  EXPECT_LE(stats.memory_bytes, options.max_bytes);
  EXPECT_LE(stats.disk_bytes, options.disk_max_bytes);
  EXPECT_EQ(stats.inflight, 0u);
  EXPECT_EQ(stats.waiting, 0u);
  EXPECT_EQ(stats.disk_errors, 0u);
  EXPECT_GT(stats.evictions, 0u);
  EXPECT_GT(stats.pixel_hits, 0u);
  EXPECT_GT(stats.disk_hits, 0u);
  EXPECT_GT(stats.disk_evictions, 0u);
  EXPECT_EQ(stats.misses, static_cast<uint64_t>(encodes.load()));
  // The disk index matches the directory.
  uint64_t files = 0, bytes = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    ++files;
    bytes += e.file_size();
  }
  EXPECT_EQ(stats.disk_files, files);
  EXPECT_EQ(stats.disk_bytes, bytes);
}

}  // namespace
}  // namespace vlm::vision
