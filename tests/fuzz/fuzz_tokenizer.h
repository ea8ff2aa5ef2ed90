// The tokenizer the text fuzz targets run on.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "services/language/text/tokenizer.h"

namespace vlm::fuzz {

// The Qwen3 tokenizer scripts/setup.sh fetches: $VLM_TOKENIZER_DIR, else
// $VLM_CACHE_DIR/tokenizer, else $HOME/.cache/vlm/tokenizer. Loaded once per
// process; exits with a message (not a finding) when it cannot be read.
inline const language::Tokenizer& SharedTokenizer() {
  static const language::Tokenizer* tokenizer = [] {
    std::string dir;
    if (const char* d = std::getenv("VLM_TOKENIZER_DIR"); d != nullptr && *d != '\0') {
      dir = d;
    } else if (const char* c = std::getenv("VLM_CACHE_DIR"); c != nullptr && *c != '\0') {
      dir = std::string(c) + "/tokenizer";
    } else {
      const char* home = std::getenv("HOME");
      dir = std::string(home != nullptr ? home : "/root") + "/.cache/vlm/tokenizer";
    }
    auto loaded = language::Tokenizer::Load(dir);
    if (!loaded.ok()) {
      std::fprintf(stderr, "cannot load the tokenizer from %s (run scripts/setup.sh or set "
                   "VLM_TOKENIZER_DIR): %s\n", dir.c_str(), loaded.status().ToString().c_str());
      std::exit(2);
    }
    return loaded->release();
  }();
  return *tokenizer;
}

}  // namespace vlm::fuzz
