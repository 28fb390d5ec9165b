// A byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (and the
// tokenizer_config.json beside it), producing the same ids as the `tokenizers`
// library. Immutable after load and safe to share between threads.
//
// Input policy: encode() takes UTF-8 and refuses anything else with
// troupe::Error(invalid_argument) naming the first bad byte and its offset;
// it never guesses a replacement. decode() turns bytes that are not UTF-8 (a
// model can emit half a character) into U+FFFD per maximal ill-formed
// subpart, as Hugging Face does.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/tokenizer/chat_template.hpp"
#include "model/tokenizer/tokenizer_config.hpp"

namespace troupe::tokenizer {

class AddedVocabulary;
class Bpe;
class PreTokenizer;

struct EncodeOptions {
  // Whether added tokens written in the text ("<｜User｜>",
  // "<｜end▁of▁sentence｜>", ...) become their single ids. Off by default: text
  // a user wrote is encoded as the characters it contains, so it cannot forge
  // a turn. On, encode() matches Hugging Face's encode(text, add_special_tokens=False).
  bool parse_special = false;
  bool add_bos = false;  // prepend the BOS id (tokenizer_config's add_bos_token says what HF does)
};

struct DecodeOptions {
  bool skip_special = false;  // drop ids of added tokens marked special (not <｜User｜>: it is not)
};

class Tokenizer {
 public:
  // `path`: a tokenizer.json, or a directory holding one. A
  // tokenizer_config.json in the same directory is read when present. Throws
  // troupe::Error (not_found, invalid_file, unsupported) naming the file.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options = {}) const;

  // Throws troupe::Error(invalid_argument) for an id that is not in the vocabulary.
  std::string decode(std::span<const int32_t> ids, const DecodeOptions& options = {}) const;

  // The chat prompt for `messages`, as transformers' apply_chat_template renders
  // it (tokenize=False). Throws troupe::Error(unsupported) when there is no
  // template or it is not a family troupe renders, and (invalid_argument) for
  // conversations the template cannot render.
  std::string render_chat(std::span<const Message> messages, const ChatOptions& options = {}) const;

  // The ids of that prompt. The template's own markers become their ids; the
  // text of messages is encoded with parse_special off, so a message that
  // contains "<｜Assistant｜>" cannot start a turn. For messages without such
  // strings this equals apply_chat_template(tokenize=True).
  std::vector<int32_t> encode_chat(std::span<const Message> messages, const ChatOptions& options = {}) const;

  // The bytes token `id` stands for; one token may hold part of a character.
  // Throws troupe::Error(invalid_argument) for an unknown id.
  std::string_view token_bytes(int32_t id) const;
  bool is_special(int32_t id) const;
  // Every id's bytes, empty for added tokens (special or not) and ids the tokenizer
  // does not have: what text the model can write token by token (structured output).
  std::vector<std::string> vocabulary_bytes() const;
  // The id of a vocabulary or added-token string ("<｜User｜>", "Ġthe").
  std::optional<int32_t> token_id(std::string_view token) const;
  int32_t vocab_size() const { return static_cast<int32_t>(token_bytes_.size()); }
  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  const TokenizerConfig& config() const { return config_; }
  const std::string& path() const { return path_; }

 private:
  Tokenizer() = default;
  void encode_plain(std::string_view text, std::vector<int32_t>& out) const;
  const ChatTemplate& chat_template() const;

  std::string path_;
  TokenizerConfig config_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Bpe> bpe_;
  std::unique_ptr<AddedVocabulary> added_;
  std::optional<ChatTemplate> chat_template_;
  std::string chat_template_error_;                     // why chat_template_ is empty
  std::vector<std::string> token_bytes_;                // by id
  std::vector<uint8_t> token_kind_;                     // by id: 0 none, 1 vocabulary, 2 added, 3 added special
  std::unordered_map<std::string, int32_t> token_ids_;  // vocabulary and added strings
  std::optional<int32_t> bos_id_, eos_id_;
};

}  // namespace troupe::tokenizer
