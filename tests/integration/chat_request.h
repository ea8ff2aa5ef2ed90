// Chat requests the integration tests send through the gateway.
#ifndef VLM_TESTS_INTEGRATION_CHAT_REQUEST_H_
#define VLM_TESTS_INTEGRATION_CHAT_REQUEST_H_

#include <string>
#include <vector>

#include "vlm/v1/gateway.pb.h"

namespace vlm::testing {

// One user message: the images (encoded bytes) first, then the text; greedy.
inline v1::ChatRequest GreedyChat(const std::string& text, const std::vector<std::string>& images,
                                  int max_tokens) {
  v1::ChatRequest r;
  auto* m = r.add_messages();
  m->set_role("user");
  for (const std::string& image : images) m->add_content()->mutable_image()->set_data(image);
  m->add_content()->set_text(text);
  r.mutable_params()->set_max_tokens(max_tokens);
  r.mutable_params()->mutable_sampling()->set_temperature(0);
  return r;
}

// A generation that runs for seconds on the tiny model unless stopped
// (ignore_eos: it cannot end early on its own).
inline v1::ChatRequest EndlessChat(int max_tokens = 4000) {
  v1::ChatRequest r = GreedyChat("Tell me a very long story.", {}, max_tokens);
  r.mutable_params()->set_ignore_eos(true);
  return r;
}

}  // namespace vlm::testing

#endif  // VLM_TESTS_INTEGRATION_CHAT_REQUEST_H_
