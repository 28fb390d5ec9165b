// Where the DeepSeek-V4 tokenizer that ships with troupe lives, so the
// embedded default model speaks real DeepSeek tokens on a fresh machine.
#pragma once

#include <string>

namespace troupe::tokenizer {

// The directory holding the shipped tokenizer.json and tokenizer_config.json.
// Looked for, in order:
//  1. $TROUPE_TOKENIZER_DIR, when set (must hold a tokenizer.json);
//  2. next to the running executable: <exe>/../share/troupe/tokenizer/deepseek-v4
//     (an installed tree) and <exe>/tokenizer/deepseek-v4;
//  3. the source tree troupe was built from (compiled in).
// Throws troupe::Error(not_found) listing every place it looked.
std::string default_tokenizer_dir();

// The tokenizer of the model in `model_dir`: its own tokenizer.json, else the shipped one.
std::string tokenizer_dir_for(const std::string& model_dir);

}  // namespace troupe::tokenizer
