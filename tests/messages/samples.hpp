// One populated frame of every kind, for round-trip tests, the fuzzer's seed
// corpus and the two-process exchange test.
#pragma once

#include <string>
#include <vector>

#include "messages/kinds.hpp"

namespace troupe::test {

// Every frame kind once (Error ... StageActivation), request id = 1000 + kind.
std::vector<messages::Frame> sample_frames();

// The Cap'n Proto canonical form of a frame's body: equal for two frames iff
// their messages are equal, whatever the layout each encoder chose.
std::string canonical_body(const messages::Frame& frame);

}  // namespace troupe::test
