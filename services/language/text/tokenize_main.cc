// vlm-tokenize: look at what the model sees.
//
//   vlm-tokenize [--model DIR] "text"            ids as a JSON array
//   vlm-tokenize [--model DIR] --chat FILE|-     rendered prompt, then its ids
//   vlm-tokenize [--model DIR] --decode 1,2,3    text of the ids
//
// --model is a directory with tokenizer.json (a checkpoint); default
// $VLM_CACHE_DIR/tokenizer, else ~/.cache/vlm/tokenizer. --skip-special drops
// special tokens when decoding. A --chat file holds a conversation in the
// public API's shape (proto3 JSON of vlm.v1.ChatMessage, images given by grid):
//
//   {"messages": [
//      {"role": "system", "content": "You are terse."},
//      {"role": "user", "content": [{"image": {"grid": {"t": 1, "h": 16, "w": 16}}},
//                                   {"text": "Describe this image."}]}],
//    "add_generation_prompt": true, "add_vision_id": false, "merge_size": 2}
//
// "content" is a list of parts ({"text": ...} or {"image": {"grid": ...}};
// a grid may also be written [t, h, w]) or, for short, a plain string.
// --chat prints the rendered text (before image expansion), a line "---",
// the expanded ids as a JSON array, and a summary line on stderr. Errors go
// to stderr with the status (INVALID_ARGUMENT ...) and exit code 1.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "services/language/text/chat_template.h"
#include "services/language/text/tokenizer.h"

namespace {

using json = nlohmann::json;
using vlm::language::ChatMessage;
using vlm::language::ChatPart;
using vlm::language::ImageGrid;

constexpr char kUsage[] =
    "usage: vlm-tokenize [--model DIR] [--skip-special] (TEXT | --chat FILE | --decode IDS)\n"
    "  TEXT          print the ids of TEXT as a JSON array\n"
    "  --chat FILE   render a conversation (JSON, '-' for stdin); print text, ---, ids\n"
    "  --decode IDS  print the text of comma-separated ids (e.g. 9707,1879)\n";

std::string DefaultModelDir() {
  if (const char* cache = std::getenv("VLM_CACHE_DIR"); cache && *cache) {
    return std::string(cache) + "/tokenizer";
  }
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/root") + "/.cache/vlm/tokenizer";
}

absl::StatusOr<ImageGrid> ParseGrid(const json& g) {
  ImageGrid grid;
  if (g.is_array() && g.size() == 3 && g[0].is_number_integer() && g[1].is_number_integer() &&
      g[2].is_number_integer()) {
    grid = {g[0].get<int64_t>(), g[1].get<int64_t>(), g[2].get<int64_t>()};
  } else if (g.is_object()) {
    grid = {g.value("t", int64_t{1}), g.value("h", int64_t{0}), g.value("w", int64_t{0})};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("bad grid ", g.dump()));
  }
  return grid;
}

absl::StatusOr<std::vector<ChatMessage>> ParseMessages(const json& doc) {
  if (!doc.is_object() || !doc.contains("messages") || !doc["messages"].is_array()) {
    return absl::InvalidArgumentError("expected an object with a \"messages\" array");
  }
  std::vector<ChatMessage> messages;
  for (const json& m : doc["messages"]) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("message without a role: ", m.dump()));
    }
    ChatMessage message;
    message.role = m["role"].get<std::string>();
    const json& content = m.value("content", json::array());
    if (content.is_string()) {
      message.content.push_back(ChatPart::Text(content.get<std::string>()));
    } else if (content.is_array()) {
      for (const json& part : content) {
        if (part.is_object() && part.contains("text") && part["text"].is_string()) {
          message.content.push_back(ChatPart::Text(part["text"].get<std::string>()));
        } else if (part.is_object() && part.contains("image")) {
          const json& image = part["image"];
          absl::StatusOr<ImageGrid> grid =
              ParseGrid(image.is_object() && image.contains("grid") ? image["grid"] : image);
          if (!grid.ok()) return grid.status();
          message.content.push_back(ChatPart::Image(*grid));
        } else {
          return absl::InvalidArgumentError(absl::StrCat("unknown content part ", part.dump()));
        }
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("bad content ", content.dump()));
    }
    messages.push_back(std::move(message));
  }
  return messages;
}

int Fail(const absl::Status& status) {
  std::cerr << "vlm-tokenize: " << status << "\n";
  return 1;
}

int RunChat(const vlm::language::Tokenizer& tokenizer, const std::string& path) {
  std::stringstream buffer;
  if (path == "-") {
    buffer << std::cin.rdbuf();
  } else {
    std::ifstream in(path);
    if (!in) return Fail(absl::NotFoundError(absl::StrCat("cannot open ", path)));
    buffer << in.rdbuf();
  }
  json doc = json::parse(buffer.str(), nullptr, false);
  if (doc.is_discarded()) return Fail(absl::InvalidArgumentError(path + " is not valid JSON"));
  absl::StatusOr<std::vector<ChatMessage>> messages = ParseMessages(doc);
  if (!messages.ok()) return Fail(messages.status());
  vlm::language::ChatTemplateOptions options;
  options.add_generation_prompt = doc.value("add_generation_prompt", true);
  options.add_vision_id = doc.value("add_vision_id", false);
  absl::StatusOr<vlm::language::Prompt> prompt = vlm::language::BuildPrompt(
      tokenizer, *messages, options, doc.value("merge_size", int64_t{2}));
  if (!prompt.ok()) return Fail(prompt.status());
  // The rendered text normally ends with a newline; "---" goes on its own line.
  const bool newline = !prompt->text.empty() && prompt->text.back() == '\n';
  std::cout << prompt->text << (newline ? "" : "\n") << "---\n["
            << absl::StrJoin(prompt->ids, ",") << "]\n";
  std::cerr << prompt->ids.size() << " tokens";
  for (size_t i = 0; i < prompt->images.size(); ++i) {
    std::cerr << "; image " << i + 1 << ": " << prompt->images[i].length << " tokens at "
              << prompt->images[i].offset;
  }
  std::cerr << "\n";
  return 0;
}

int RunDecode(const vlm::language::Tokenizer& tokenizer, const std::string& list,
              bool skip_special) {
  std::vector<int32_t> ids;
  for (absl::string_view field : absl::StrSplit(list, absl::ByAnyChar(", []"), absl::SkipEmpty())) {
    int32_t id;
    if (!absl::SimpleAtoi(field, &id)) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("not an id: ", field)));
    }
    ids.push_back(id);
  }
  absl::StatusOr<std::string> text = tokenizer.Decode(ids, skip_special);
  if (!text.ok()) return Fail(text.status());
  std::cout << *text << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = DefaultModelDir();
  std::string chat_path, decode_list, text;
  bool have_text = false, have_chat = false, have_decode = false, skip_special = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    if (arg == "--model") {
      if (!value(&model_dir)) return std::cerr << kUsage, 2;
    } else if (arg == "--chat") {
      if (!value(&chat_path)) return std::cerr << kUsage, 2;
      have_chat = true;
    } else if (arg == "--decode") {
      if (!value(&decode_list)) return std::cerr << kUsage, 2;
      have_decode = true;
    } else if (arg == "--skip-special") {
      skip_special = true;
    } else if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (!have_text && (arg.empty() || arg[0] != '-' || arg == "--")) {
      if (arg == "--") {
        if (i + 1 >= argc) return std::cerr << kUsage, 2;
        text = argv[++i];
      } else {
        text = arg;
      }
      have_text = true;
    } else {
      std::cerr << "vlm-tokenize: unexpected argument " << arg << "\n" << kUsage;
      return 2;
    }
  }
  if (have_text + have_chat + have_decode != 1) return std::cerr << kUsage, 2;

  absl::StatusOr<std::unique_ptr<vlm::language::Tokenizer>> tokenizer =
      vlm::language::Tokenizer::Load(model_dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  if (have_chat) return RunChat(**tokenizer, chat_path);
  if (have_decode) return RunDecode(**tokenizer, decode_list, skip_special);
  absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Encode(text);
  if (!ids.ok()) return Fail(ids.status());
  std::cout << "[" << absl::StrJoin(*ids, ",") << "]\n";
  return 0;
}
