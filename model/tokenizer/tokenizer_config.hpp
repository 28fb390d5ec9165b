// tokenizer_config.json: what transformers adds around tokenizer.json (the
// BOS/EOS strings, whether BOS is prepended, the chat template).
#pragma once

#include <string>

namespace troupe::tokenizer {

struct TokenizerConfig {
  std::string bos_token;  // empty: none
  std::string eos_token;  // empty: none
  bool add_bos_token = false;
  bool add_eos_token = false;
  std::string chat_template;  // Jinja source; empty: none

  // Throws troupe::Error(not_found / invalid_file) naming the path.
  static TokenizerConfig from_file(const std::string& path);
};

}  // namespace troupe::tokenizer
