#include "base/error.hpp"

namespace troupe {

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::not_found: return "not_found";
    case ErrorCode::invalid_file: return "invalid_file";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::resource_exhausted: return "resource_exhausted";
    case ErrorCode::unavailable: return "unavailable";
    case ErrorCode::deadline_exceeded: return "deadline_exceeded";
    case ErrorCode::cancelled: return "cancelled";
    case ErrorCode::internal: return "internal";
  }
  return "unknown";
}

}  // namespace troupe
