#include "apps/troupe/gateway_flags.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

#include "actors/gateway/http_server.hpp"

namespace troupe::app {

CLI::Validator interval(double lo, double hi, bool lo_open, bool hi_open) {
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        const bool ok = end != in.c_str() && *end == '\0' && std::isfinite(v) && (lo_open ? v > lo : v >= lo) &&
                        (hi_open ? v < hi : v <= hi);
        return ok ? "" : fmt::format("must be a number in {}{}, {}{}, got {}", lo_open ? "(" : "[", lo, hi,
                                     hi_open ? ")" : "]", in);
      },
      "NUMBER");
}

std::vector<std::string> GatewayFlags::allowed_origins() const { return gateway::parse_origins(origins); }

void add_gateway_flags(CLI::App* cmd, GatewayFlags& f) {
  cmd->add_option("--api-key", f.api_key, "require 'Authorization: Bearer KEY' on /v1/* and /admin/*")
      ->envname("TROUPE_API_KEY");
  cmd->add_option("--allowed-origins", f.origins,
                  "web pages that may call the API from a browser (CORS): *, none, or origins separated by commas "
                  "(https://ui.example.com,http://localhost:3000)");
  cmd->add_option("--max-model-len", f.max_model_len,
                  "prompt + completion token limit (default: min(the model's positions, 32768))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--max-body-mib", f.max_body_mib, "largest request body, MiB (larger ones get 413)")
      ->check(interval(0, 1048576, true, false));
  cmd->add_option("--read-timeout", f.read_timeout_s, "seconds a client has to send a whole request")
      ->check(CLI::Range(1, 86400));
}

}  // namespace troupe::app
