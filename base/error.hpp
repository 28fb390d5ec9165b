// Errors a user or a peer can cause: bad files, bad requests, bad bytes.
// They carry a code and one sentence a user can act on.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace troupe {

enum class ErrorCode {
  invalid_argument,   // a request or flag is malformed
  not_found,          // a file, model or request id does not exist
  invalid_file,       // a file exists but its contents are wrong
  unsupported,        // valid, but not something troupe does
  resource_exhausted, // no memory, queue full
  unavailable,        // a peer is gone or not ready
  deadline_exceeded,
  cancelled,
  internal,
};

const char* to_string(ErrorCode code);

// Thrown by operations that must stop (loading a model, parsing a file);
// callers at the edge turn it into an exit code, an HTTP status or an error frame.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

template <class... Args>
[[noreturn]] void raise(ErrorCode code, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(code, fmt::format(f, std::forward<Args>(args)...));
}

// A value or an Error, for outcomes a caller is expected to handle.
template <class T>
class Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}
  Expected(Error error) : v_(std::move(error)) {}
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  const T& value() const& { return std::get<0>(v_); }
  const Error& error() const { return std::get<1>(v_); }
  T& operator*() { return value(); }
  T* operator->() { return &value(); }

 private:
  std::variant<T, Error> v_;
};

}  // namespace troupe
