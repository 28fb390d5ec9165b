#include "model/tokenizer/stream_decoder.hpp"

#include "model/tokenizer/utf8.hpp"

namespace troupe::tokenizer {

std::string StreamDecoder::push(int32_t id) {
  const std::string_view bytes = tokenizer_.token_bytes(id);
  if (options_.skip_special && tokenizer_.is_special(id)) return "";
  pending_ += bytes;
  // The held-back tail starts at a lead byte, so no character before it can
  // reach into it: decoding the two parts apart equals decoding them together.
  const size_t hold = incomplete_utf8_tail(pending_);
  const std::string_view ready = std::string_view(pending_).substr(0, pending_.size() - hold);
  std::string out;
  if (!find_invalid_utf8(ready)) {
    out.assign(ready);
  } else {
    append_utf8_lossy(ready, out);
  }
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out;
  append_utf8_lossy(pending_, out);
  pending_.clear();
  return out;
}

}  // namespace troupe::tokenizer
