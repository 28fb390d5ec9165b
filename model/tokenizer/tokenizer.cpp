#include "model/tokenizer/tokenizer.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/error.hpp"
#include "base/mapped_file.hpp"
#include "model/tokenizer/added_vocabulary.hpp"
#include "model/tokenizer/bpe.hpp"
#include "model/tokenizer/byte_level.hpp"
#include "model/tokenizer/pre_tokenizer.hpp"
#include "model/tokenizer/utf8.hpp"

namespace troupe::tokenizer {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

enum Kind : uint8_t { kNone = 0, kVocab = 1, kAdded = 2, kAddedSpecial = 3 };

// Everything in tokenizer.json that would change ids and that this
// implementation does not do is refused here, by name, rather than ignored.
void check_supported(const json& j, const std::string& path) {
  auto unsupported = [&](const std::string& what) {
    raise(ErrorCode::unsupported, "{}: {} (troupe reads byte-level BPE tokenizers)", path, what);
  };
  const json& model = j.at("model");
  if (model.value("type", "BPE") != "BPE") unsupported("model type '" + model.value("type", "") + "'");
  if (model.contains("dropout") && !model["dropout"].is_null()) unsupported("BPE dropout");
  if (model.value("byte_fallback", false)) unsupported("byte_fallback");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() && !model[key].get<std::string>().empty()) {
      unsupported(std::string("BPE ") + key);
    }
  }
  if (model.value("ignore_merges", false)) unsupported("BPE ignore_merges");
  if (const auto& n = j.value("normalizer", json()); !n.is_null()) {
    if (n.value("type", "") != "Sequence" || !n.value("normalizers", json::array()).empty()) {
      unsupported("normalizer '" + n.value("type", "") + "'");
    }
  }
  if (const auto& d = j.value("decoder", json()); d.is_null() || d.value("type", "") != "ByteLevel") {
    unsupported("a decoder other than ByteLevel");
  }
  for (const auto& t : j.value("added_tokens", json::array())) {
    if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false)) {
      unsupported("added token '" + t.value("content", "") + "' with lstrip, rstrip or single_word");
    }
  }
}

std::string find_tokenizer_json(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path file = fs::path(path) / "tokenizer.json";
    if (!fs::exists(file, ec)) raise(ErrorCode::not_found, "{}: no tokenizer.json in this directory", path);
    return file.string();
  }
  if (!fs::exists(path, ec)) raise(ErrorCode::not_found, "{}: no such file or directory", path);
  return path;
}

}  // namespace

Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  const std::string file = find_tokenizer_json(path);
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->path_ = file;
  json j;
  {
    MappedFile mapped(file);
    const auto bytes = mapped.bytes();
    j = json::parse(reinterpret_cast<const char*>(bytes.data()),
                    reinterpret_cast<const char*>(bytes.data()) + bytes.size(), nullptr, /*allow_exceptions=*/false);
  }
  if (j.is_discarded() || !j.is_object() || !j.contains("model")) {
    raise(ErrorCode::invalid_file, "{}: not a tokenizer.json (no JSON object with a 'model')", file);
  }
  try {
    check_supported(j, file);
    t->pre_tokenizer_ = std::make_unique<PreTokenizer>(PreTokenizer::from_json(j.value("pre_tokenizer", json())));
    if (!t->pre_tokenizer_->byte_level()) {
      raise(ErrorCode::unsupported, "{}: the pre-tokenizer has no ByteLevel step (troupe reads byte-level BPE)", file);
    }

    // Ids: the vocabulary, then added tokens (which may repeat vocabulary entries).
    const json& model = j.at("model");
    const auto& byte_level_alphabet = byte_level();
    auto define = [&](const std::string& token, int64_t id, Kind kind) {
      if (id < 0 || id > (1 << 30)) raise(ErrorCode::invalid_file, "{}: token '{}' has id {}", file, token, id);
      if (static_cast<size_t>(id) >= t->token_bytes_.size()) {
        t->token_bytes_.resize(id + 1);
        t->token_kind_.resize(id + 1, kNone);
      }
      // Hugging Face's ByteLevel decoder: a token whose every code point is in
      // the byte alphabet stands for those bytes, any other for its own UTF-8.
      auto bytes = byte_level_alphabet.decode(token);
      t->token_bytes_[id] = bytes ? *bytes : token;
      t->token_kind_[id] = std::max<uint8_t>(t->token_kind_[id], kind);
      t->token_ids_[token] = static_cast<int32_t>(id);
    };
    const json& vocab = model.at("vocab");
    std::unordered_map<std::string, int32_t> vocab_ids;  // merges name vocabulary entries only
    vocab_ids.reserve(vocab.size());
    for (const auto& [token, id] : vocab.items()) {
      define(token, id.get<int64_t>(), kVocab);
      vocab_ids.emplace(token, id.get<int32_t>());
    }
    std::vector<AddedToken> added;
    for (const auto& a : j.value("added_tokens", json::array())) {
      AddedToken tok{a.at("content").get<std::string>(), a.at("id").get<int32_t>(), a.value("special", false),
                     a.value("normalized", false)};
      define(tok.content, tok.id, tok.special ? kAddedSpecial : kAdded);
      added.push_back(std::move(tok));
    }
    t->added_ = std::make_unique<AddedVocabulary>(std::move(added));

    std::array<int32_t, 256> byte_ids;
    for (int b = 0; b < 256; ++b) {
      auto it = vocab_ids.find(byte_level_alphabet.encode(static_cast<uint8_t>(b)));
      byte_ids[b] = it == vocab_ids.end() ? -1 : it->second;
    }
    std::vector<Bpe::Merge> merges;
    const json& merge_list = model.at("merges");
    merges.reserve(merge_list.size());
    std::string joined;
    for (const auto& m : merge_list) {
      std::string left, right;
      if (m.is_string()) {  // "left right"
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          raise(ErrorCode::invalid_file, "{}: merge '{}' is not two tokens separated by a space", file, s);
        }
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {  // ["left", "right"]
        left = m.at(0).get<std::string>();
        right = m.at(1).get<std::string>();
      }
      auto id_of = [&](const std::string& token) {
        auto it = vocab_ids.find(token);
        if (it == vocab_ids.end()) {
          raise(ErrorCode::invalid_file, "{}: merge token '{}' is not in the vocabulary", file, token);
        }
        return it->second;
      };
      joined.assign(left).append(right);
      merges.push_back({id_of(left), id_of(right), id_of(joined)});
    }
    t->bpe_ = std::make_unique<Bpe>(byte_ids, merges);
  } catch (const json::exception& e) {
    raise(ErrorCode::invalid_file, "{}: unexpected structure: {}", file, e.what());
  }

  const fs::path config_file = fs::path(file).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (fs::exists(config_file, ec)) t->config_ = TokenizerConfig::from_file(config_file.string());
  if (!t->config_.bos_token.empty()) t->bos_id_ = t->token_id(t->config_.bos_token);
  if (!t->config_.eos_token.empty()) t->eos_id_ = t->token_id(t->config_.eos_token);
  if (t->config_.chat_template.empty()) {
    t->chat_template_error_ = "there is no chat_template in " + config_file.string();
  } else {
    t->chat_template_ = ChatTemplate::recognize(t->config_.chat_template, t->config_.bos_token);
    if (!t->chat_template_) {
      t->chat_template_error_ = "the chat_template in " + config_file.string() +
                                " is not one troupe renders (troupe renders the DeepSeek-V3 template family)";
    }
  }
  return t;
}

void Tokenizer::encode_plain(std::string_view text, std::vector<int32_t>& out) const {
  for (const Span& piece : pre_tokenizer_->split(text)) {
    bpe_->encode_piece(text.substr(piece.begin, piece.end - piece.begin), out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  if (auto bad = find_invalid_utf8(text)) {
    raise(ErrorCode::invalid_argument, "text is not valid UTF-8: byte 0x{:02x} at offset {} starts no valid character",
          static_cast<unsigned char>(text[*bad]), *bad);
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 2);
  if (options.add_bos) {
    if (!bos_id_) raise(ErrorCode::unsupported, "{}: this tokenizer has no BOS token", path_);
    ids.push_back(*bos_id_);
  }
  if (!options.parse_special) {
    encode_plain(text, ids);
    return ids;
  }
  for (const Segment& s : added_->split(text)) {
    if (s.token >= 0) {
      ids.push_back(s.token);
    } else {
      encode_plain(text.substr(s.begin, s.end - s.begin), ids);
    }
  }
  return ids;
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size() || token_kind_[id] == kNone) {
    raise(ErrorCode::invalid_argument, "{} is not a token id of this tokenizer (vocabulary of {})", id, vocab_size());
  }
  return token_bytes_[id];
}

std::vector<std::string> Tokenizer::vocabulary_bytes() const {
  std::vector<std::string> out(token_bytes_.size());
  for (size_t id = 0; id < out.size(); ++id) {
    if (token_kind_[id] == kVocab) out[id] = token_bytes_[id];
  }
  return out;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && token_kind_[id] == kAddedSpecial;
}

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  auto it = token_ids_.find(std::string(token));
  if (it == token_ids_.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, const DecodeOptions& options) const {
  std::string bytes;
  for (int32_t id : ids) {
    const std::string_view b = token_bytes(id);
    if (options.skip_special && token_kind_[id] == kAddedSpecial) continue;
    bytes += b;
  }
  if (!find_invalid_utf8(bytes)) return bytes;
  std::string text;
  append_utf8_lossy(bytes, text);
  return text;
}

const ChatTemplate& Tokenizer::chat_template() const {
  if (!chat_template_) raise(ErrorCode::unsupported, "{}", chat_template_error_);
  return *chat_template_;
}

std::string Tokenizer::render_chat(std::span<const Message> messages, const ChatOptions& options) const {
  return chat_template().render(messages, options);
}

std::vector<int32_t> Tokenizer::encode_chat(std::span<const Message> messages, const ChatOptions& options) const {
  std::vector<int32_t> ids;
  for (const ChatPart& part : chat_template().render_parts(messages, options)) {
    if (!part.marker) {
      if (auto bad = find_invalid_utf8(part.text)) {
        raise(ErrorCode::invalid_argument, "a message is not valid UTF-8 (byte 0x{:02x})",
              static_cast<unsigned char>(part.text[*bad]));
      }
      encode_plain(part.text, ids);
      continue;
    }
    auto id = token_id(part.text);
    if (!id) raise(ErrorCode::invalid_file, "{}: the chat marker '{}' is not in the vocabulary", path_, part.text);
    ids.push_back(*id);
  }
  return ids;
}

}  // namespace troupe::tokenizer
