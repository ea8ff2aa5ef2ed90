// Qwen3's tool calls in a completion's text, for both front ends: the model
// writes each call as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.
// The gateway's pipeline parses them into ChatResponse/ChatChunk.tool_calls
// (gRPC), and the OpenAI front end renders them as message.tool_calls.
//
// Thread-safety: free functions.
#ifndef VLM_SERVICES_GATEWAY_TOOL_CALLS_H_
#define VLM_SERVICES_GATEWAY_TOOL_CALLS_H_

#include <string>
#include <vector>

#include "vlm/v1/common.pb.h"

namespace vlm::gateway {

// A completion's text split into content and tool calls.
struct ParsedToolCalls {
  std::string content;              // text before the first block (trailing whitespace dropped)
  std::vector<v1::ToolCall> calls;  // empty: no (valid) block, all text is content
};

// Blocks must follow one another, separated by whitespace only, each holding
// a JSON object with a string "name" and an object (or string) "arguments";
// otherwise there are no calls and all text is content. Call i gets the id
// id_prefix + i; arguments become JSON text.
ParsedToolCalls ParseToolCallText(const std::string& text, const std::string& id_prefix);

// "call_<request id>_" for choice 0, "call_<request id>_c<choice>_" for the
// others: the ids of both front ends (an HTTP completion's id is
// "chatcmpl-<request id>").
std::string ToolCallIdPrefix(const std::string& request_id, int choice);

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_TOOL_CALLS_H_
