// Flags of the gateway's HTTP API, shared by `troupe serve` and `troupe run`
// (a gateway node), and the validator every real-valued flag uses.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace troupe::app {

// A finite number in an interval (lo_open: lo excluded; hi_open: hi
// excluded). CLI11's Range lets NaN through: no comparison fails.
CLI::Validator interval(double lo, double hi, bool lo_open, bool hi_open);

struct GatewayFlags {
  std::string api_key;          // --api-key / TROUPE_API_KEY
  std::string origins = "*";    // --allowed-origins
  int64_t max_model_len = 0;    // --max-model-len; 0: min(the model's positions, 32768)
  double max_body_mib = 8;      // --max-body-mib
  int read_timeout_s = 30;      // --read-timeout
  // After parsing, into actors::ServeOptions or actors::RunOptions (the same
  // fields). Throws Error naming a bad origin.
  template <class Options>
  void apply(Options& o) const {
    o.api_key = api_key;
    o.allowed_origins = allowed_origins();
    o.max_model_len = max_model_len;
    o.max_body_bytes = static_cast<size_t>(max_body_mib * (1 << 20));
    o.read_timeout_s = read_timeout_s;
  }
  std::vector<std::string> allowed_origins() const;
};

void add_gateway_flags(CLI::App* cmd, GatewayFlags& f);

}  // namespace troupe::app
