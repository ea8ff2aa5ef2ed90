// vlm-bench-tokenizer: encoding throughput of the BPE tokenizer, one thread.
//
//   vlm-bench-tokenizer [--model DIR] [--mb 4] [--repeat 3]
//
// Generates a few MB of English prose, Chinese prose and source code from a
// fixed seed (plus a mix of the three), cuts it into documents of about 4 KB
// (the size of a prompt) and prints MB/s for: a cold word cache (emptied
// before the pass), a warm one (a second pass over the same text), and no
// cache at all. Best of --repeat runs.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "services/language/text/tokenizer.h"

namespace {

using vlm::language::Tokenizer;

std::string DefaultModelDir() {
  if (const char* cache = std::getenv("VLM_CACHE_DIR"); cache && *cache) {
    return std::string(cache) + "/tokenizer";
  }
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/root") + "/.cache/vlm/tokenizer";
}

template <typename T>
const T& Pick(std::mt19937& rng, const std::vector<T>& xs) {
  return xs[rng() % xs.size()];
}

std::string English(std::mt19937& rng, size_t bytes) {
  const std::vector<std::string> words = {
      "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
      "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
      "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has",
      "there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "model",
      "language", "vision", "image", "tokenizer", "inference", "server", "latency", "memory",
      "performance", "requests", "throughput", "don't", "it's", "we'll", "I'm", "London",
      "Tuesday", "September", "government", "development", "understanding", "information",
      "experimental", "significantly", "approximately", "2024", "3.5%", "$120", "e.g."};
  std::string s;
  while (s.size() < bytes) {
    const int sentence = 6 + rng() % 18;
    for (int k = 0; k < sentence; ++k) {
      std::string w = Pick(rng, words);
      if (k == 0) w[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(w[0])));
      // Invented words keep the vocabulary from being tiny.
      if (rng() % 12 == 0) {
        w.clear();
        const int n = 3 + rng() % 9;
        for (int c = 0; c < n; ++c) w.push_back(static_cast<char>('a' + rng() % 26));
      }
      absl::StrAppend(&s, w, k + 1 < sentence ? (rng() % 10 == 0 ? ", " : " ") : "");
    }
    s += rng() % 6 == 0 ? ".\n\n" : ". ";
  }
  return s;
}

std::string Chinese(std::mt19937& rng, size_t bytes) {
  // Frequent characters (UTF-8, 3 bytes each).
  const std::string chars =
      "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对"
      "可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公"
      "同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正"
      "名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并"
      "内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表";
  std::vector<std::string> cs;
  for (size_t i = 0; i + 3 <= chars.size(); i += 3) cs.push_back(chars.substr(i, 3));
  const std::vector<std::string> punct = {"，", "，", "。", "、", "；", "：", "！", "？"};
  std::string s;
  while (s.size() < bytes) {
    const int clause = 4 + rng() % 14;
    for (int k = 0; k < clause; ++k) s += Pick(rng, cs);
    s += Pick(rng, punct);
    if (rng() % 15 == 0) s += "\n";
  }
  return s;
}

std::string Code(std::mt19937& rng, size_t bytes) {
  const std::vector<std::string> names = {"i", "n", "x", "buffer", "count", "result", "tokens",
                                          "request", "config", "index", "value", "offset",
                                          "num_layers", "hidden_size", "kv_cache", "logits"};
  const std::vector<std::string> types = {"int", "size_t", "float", "auto", "std::string",
                                          "std::vector<int32_t>"};
  std::string s;
  while (s.size() < bytes) {
    const std::string a = Pick(rng, names), b = Pick(rng, names), t = Pick(rng, types);
    switch (rng() % 6) {
      case 0:
        absl::StrAppend(&s, "for (", t, " ", a, " = 0; ", a, " < ", b, ".size(); ++", a,
                        ") {\n    ", b, "[", a, "] += ", rng() % 1000, ";\n}\n");
        break;
      case 1:
        absl::StrAppend(&s, "def ", a, "_", b, "(self, ", a, ", ", b, "=None):\n    return self.",
                        a, "(", b, ") * ", rng() % 100, "\n\n");
        break;
      case 2:
        absl::StrAppend(&s, "  if (", a, " != nullptr && ", b, " >= ", rng() % 64, ") return ",
                        a, "->", b, "();  // ", Pick(rng, names), "\n");
        break;
      case 3:
        absl::StrAppend(&s, "const ", t, " ", a, "_", rng() % 10, " = ", b, "[", rng() % 16,
                        "];\n");
        break;
      case 4:
        absl::StrAppend(&s, "{\"", a, "\": ", rng() % 100000, ", \"", b, "\": [", rng() % 10,
                        ", ", rng() % 10, "]},\n");
        break;
      default:
        absl::StrAppend(&s, "\t", a, " = ", b, " << ", rng() % 8, " | 0x", rng() % 0xFFFF,
                        ";\n");
        break;
    }
  }
  return s;
}

// Cuts `text` into documents of about 4 KB at newlines.
std::vector<std::string> Documents(const std::string& text) {
  std::vector<std::string> docs;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = std::min(text.size(), start + 4096);
    const size_t nl = text.find('\n', end);
    end = nl == std::string::npos ? text.size() : nl + 1;
    docs.push_back(text.substr(start, end - start));
    start = end;
  }
  return docs;
}

struct Pass {
  double seconds = 0;  // CPU time of this thread
  double wall = 0;
  size_t tokens = 0;
};

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

Pass EncodeAll(const Tokenizer& tokenizer, const std::vector<std::string>& docs) {
  std::vector<int32_t> ids;
  Pass pass;
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = ThreadCpuSeconds();
  for (const std::string& d : docs) {
    ids.clear();
    if (!tokenizer.EncodeTo(d, &ids).ok()) std::abort();
    pass.tokens += ids.size();
  }
  pass.seconds = ThreadCpuSeconds() - c0;
  pass.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return pass;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = DefaultModelDir();
  double mb = 4;
  int repeat = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--model" && i + 1 < argc) {
      model_dir = argv[++i];
    } else if (arg == "--mb" && i + 1 < argc && absl::SimpleAtod(argv[i + 1], &mb)) {
      ++i;
    } else if (arg == "--repeat" && i + 1 < argc && absl::SimpleAtoi(argv[i + 1], &repeat)) {
      ++i;
    } else {
      std::fprintf(stderr, "usage: vlm-bench-tokenizer [--model DIR] [--mb 4] [--repeat 3]\n");
      return 2;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Load(model_dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "vlm-bench-tokenizer: %s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::mt19937 rng(42);
  const size_t part = static_cast<size_t>(mb * 1e6 / 3);
  const std::string en = English(rng, part), zh = Chinese(rng, part), code = Code(rng, part);
  std::string mixed;
  {
    // Interleave 4 KB documents of the three kinds.
    const auto a = Documents(en), b = Documents(zh), c = Documents(code);
    for (size_t i = 0; i < std::max({a.size(), b.size(), c.size()}); ++i) {
      if (i < a.size()) mixed += a[i];
      if (i < b.size()) mixed += b[i];
      if (i < c.size()) mixed += c[i];
    }
  }
  std::printf("tokenizer %s loaded in %.2f s (wall)\n", model_dir.c_str(), load_s);
  std::printf("one thread, ~4 KB documents, best of %d; MB/s per CPU-second of the thread,\n"
              "and warm MB/s per wall-clock second (lower when other processes share the cores)\n\n",
              repeat);
  std::printf("| text    |    MB |    tokens | bytes/token | cold MB/s | warm MB/s | no cache MB/s | warm wall MB/s |\n");
  std::printf("|---------|------:|----------:|------------:|----------:|----------:|--------------:|---------------:|\n");
  const std::pair<const char*, const std::string*> corpora[] = {
      {"english", &en}, {"chinese", &zh}, {"code", &code}, {"mixed", &mixed}};
  for (const auto& [name, text] : corpora) {
    const std::vector<std::string> docs = Documents(*text);
    const double megabytes = text->size() / 1e6;
    double cold = 1e30, warm = 1e30, none = 1e30, warm_wall = 1e30;
    size_t tokens = 0;
    for (int r = 0; r < repeat; ++r) {
      (*tokenizer)->SetCacheEnabled(true);
      (*tokenizer)->ClearCache();
      const Pass c = EncodeAll(**tokenizer, docs);
      const Pass w = EncodeAll(**tokenizer, docs);
      (*tokenizer)->SetCacheEnabled(false);
      const Pass n = EncodeAll(**tokenizer, docs);
      cold = std::min(cold, c.seconds);
      warm = std::min(warm, w.seconds);
      warm_wall = std::min(warm_wall, w.wall);
      none = std::min(none, n.seconds);
      tokens = c.tokens;
      if (c.tokens != w.tokens || c.tokens != n.tokens) {
        std::fprintf(stderr, "token counts differ between passes\n");
        return 1;
      }
    }
    std::printf("| %-7s | %5.2f | %9zu | %11.2f | %9.1f | %9.1f | %13.1f | %14.1f |\n", name,
                megabytes, tokens, static_cast<double>(text->size()) / tokens, megabytes / cold,
                megabytes / warm, megabytes / none, megabytes / warm_wall);
  }
  return 0;
}
