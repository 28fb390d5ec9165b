#include "apps/troupe/model_args.hpp"

#include <climits>
#include <optional>
#include <sstream>

#include "base/error.hpp"

namespace troupe::app {

std::vector<int32_t> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0 || v > INT32_MAX) {
      raise(ErrorCode::invalid_argument, "--ids: '{}' is not a token id (non-negative integer)", item);
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) raise(ErrorCode::invalid_argument, "--ids: no token ids given");
  return ids;
}

void add_backend_options(CLI::App* cmd, BackendArgs& args) {
  cmd->add_option("--backend", args.backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--weights", args.weights, "matrix type: auto (f32 on cpu, bf16 on cuda; a checkpoint's FP8 / FP4 matrices kept as they are where the backend takes them: cpu), f32 or bf16 (every matrix)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}));
}

LoadedModel load_model(const std::string& dir, const BackendArgs& args, const std::vector<int32_t>& ids) {
  if (args.weights == "bf16" && args.backend != "cuda") {
    raise(ErrorCode::invalid_argument, "--weights bf16 needs --backend cuda (the CPU backend computes in fp32)");
  }
  LoadedModel m;
  m.backend = args.backend == "cuda" ? kernels::make_cuda_backend() : kernels::make_cpu_backend();
  if (!m.backend) raise(ErrorCode::unavailable, "the CUDA backend is not available (no GPU or not compiled)");
  std::optional<kernels::WeightType> type;
  if (args.weights == "f32") type = kernels::WeightType::f32;
  if (args.weights == "bf16") type = kernels::WeightType::bf16;
  m.model = model::Model::load(dir, *m.backend, type);
  const int64_t V = m.model->config().vocab_size;
  for (int32_t id : ids) {
    if (id >= V) raise(ErrorCode::invalid_argument, "token id {} is out of range for a vocabulary of {}", id, V);
  }
  return m;
}

}  // namespace troupe::app
