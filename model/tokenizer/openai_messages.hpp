// OpenAI chat-completions "messages" JSON -> troupe::tokenizer::Message, for
// the HTTP gateway. What the conversion decides (documented so clients know):
//  - content may be a string, null, or a list of {"type":"text","text":...}
//    parts (joined with "\n"); other part types are refused.
//  - role "developer" (OpenAI's newer name for system) becomes "system".
//  - an assistant message with tool_calls and content "" counts as having no
//    content: clients send that, and the template would otherwise drop the calls.
//  - tool_calls[i].function.arguments must be a string (JSON text), as OpenAI sends it.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <vector>

#include "model/tokenizer/chat_template.hpp"

namespace troupe::tokenizer {

// Throws troupe::Error(invalid_argument / unsupported) naming the field, e.g.
// "messages[2].tool_calls[0].function.arguments must be a string".
std::vector<Message> messages_from_json(const nlohmann::json& messages);

}  // namespace troupe::tokenizer
