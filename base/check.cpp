#include "base/check.hpp"

#include <fmt/format.h>

namespace troupe {

void fail_check(const char* condition, const std::string& message, std::source_location where) {
  throw InvariantError(fmt::format("invariant broken at {}:{}: {} ({})", where.file_name(), where.line(),
                                   message, condition));
}

}  // namespace troupe
