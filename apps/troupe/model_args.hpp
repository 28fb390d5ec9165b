// What `troupe forward` and `troupe generate` share: token ids from the command line,
// and a model loaded on the backend and matrix type the options name.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "model/forward.hpp"

namespace troupe::app {

// "5,17,300" -> ids; a clear error for anything that is not a non-negative int32.
std::vector<int32_t> parse_token_ids(const std::string& text);

struct BackendArgs {
  std::string backend = "cpu";
  std::string weights = "auto";
};
// --backend cpu|cuda and --weights auto|f32|bf16.
void add_backend_options(CLI::App* cmd, BackendArgs& args);

struct LoadedModel {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::Model> model;
};
// Loads `dir` on the named backend; errors (one line) for a CUDA backend that is not
// there, bf16 on the CPU backend, and an id of `ids` outside the vocabulary.
LoadedModel load_model(const std::string& dir, const BackendArgs& args, const std::vector<int32_t>& ids);

}  // namespace troupe::app
