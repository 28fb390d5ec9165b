// Invariant checks. A failed TROUPE_CHECK is a bug in troupe, never bad input:
// bad input is reported through troupe::Error (base/error.hpp).
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>

namespace troupe {

// Thrown when an invariant breaks. Actors treat it as a crash: the supervisor
// restarts the actor and releases what it held.
class InvariantError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] void fail_check(const char* condition, const std::string& message,
                             std::source_location where = std::source_location::current());

}  // namespace troupe

#define TROUPE_CHECK(cond, msg)                    \
  do {                                             \
    if (!(cond)) [[unlikely]] {                    \
      ::troupe::fail_check(#cond, (msg));          \
    }                                              \
  } while (0)
