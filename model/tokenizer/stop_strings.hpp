// Stop strings over streamed text: holds back the end of the text while it
// could still be the start of a stop string, so a client never sees part of
// one, and reports the stop when one is complete. Sits after StreamDecoder:
//   decoder.push(id) -> stops.push(text) -> SSE.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace troupe::tokenizer {

class StopStrings {
 public:
  struct Step {
    std::string text;      // safe to send now
    bool stopped = false;  // a stop string ended the stream; `text` ends before it
  };

  // Empty stop strings are ignored.
  explicit StopStrings(std::vector<std::string> stops);

  // Feeds more text. After a stop, further pushes return nothing.
  Step push(std::string_view text);
  // The end of the stream: the held-back text (no stop string was completed).
  std::string finish();

 private:
  std::vector<std::string> stops_;
  size_t longest_ = 0;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace troupe::tokenizer
