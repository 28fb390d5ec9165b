// troupe forward --model DIR --ids 5,17,300 --prefill N --out FILE.npy
// Runs the first N ids as one call, then each remaining id as its own call, and
// writes float32 logits [number of ids, vocab] (row t: the logits after id t).
#include <optional>
#include <sstream>

#include "apps/troupe/commands.hpp"
#include "base/error.hpp"
#include "base/npy.hpp"
#include "model/forward.hpp"

namespace troupe::app {
namespace {

std::vector<int32_t> parse_ids(const std::string& text) {
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

}  // namespace

Command add_forward(CLI::App& app) {
  struct Opts {
    std::string model, ids, out, backend = "cpu", weights = "auto";
    int64_t prefill = -1;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("forward", "run the model over token ids and write the logits as .npy");
  cmd->add_option("--model", o->model, "model directory (config.json + safetensors)")->required();
  cmd->add_option("--ids", o->ids, "comma-separated token ids")->required();
  cmd->add_option("--prefill", o->prefill, "ids run as the first call (default: all)");
  cmd->add_option("--out", o->out, "output .npy file")->required();
  cmd->add_option("--backend", o->backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--weights", o->weights, "matrix type: auto (f32 on cpu, bf16 on cuda), f32 or bf16")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}));
  return [o] {
    const auto ids = parse_ids(o->ids);
    const auto n = static_cast<int64_t>(ids.size());
    const int64_t prefill = o->prefill < 0 ? n : o->prefill;
    if (prefill == 0) raise(ErrorCode::invalid_argument, "--prefill must be at least 1");
    if (prefill > n) raise(ErrorCode::invalid_argument, "--prefill {} is larger than the {} ids given", prefill, n);
    std::unique_ptr<kernels::Backend> backend =
        o->backend == "cuda" ? kernels::make_cuda_backend() : kernels::make_cpu_backend();
    if (!backend) raise(ErrorCode::unavailable, "the CUDA backend is not available (no GPU or not compiled)");
    if (o->weights == "bf16" && o->backend != "cuda") {
      raise(ErrorCode::invalid_argument, "--weights bf16 needs --backend cuda (the CPU backend computes in fp32)");
    }
    std::optional<kernels::WeightType> type;
    if (o->weights == "f32") type = kernels::WeightType::f32;
    if (o->weights == "bf16") type = kernels::WeightType::bf16;
    auto model = model::Model::load(o->model, *backend, type);
    const int64_t V = model->config().vocab_size;
    for (int32_t id : ids) {
      if (id >= V) raise(ErrorCode::invalid_argument, "token id {} is out of range for a vocabulary of {}", id, V);
    }
    auto state = model->new_dense_state();
    std::vector<float> logits;
    logits.reserve(static_cast<size_t>(n * V));
    std::span<const int32_t> all(ids);
    model::Chunk first{state.get(), all.subspan(0, static_cast<size_t>(prefill)), model::LogitsWanted::all};
    auto rows = model->forward(std::span(&first, 1));
    logits.insert(logits.end(), rows.begin(), rows.end());
    for (int64_t t = prefill; t < n; ++t) {
      model::Chunk step{state.get(), all.subspan(static_cast<size_t>(t), 1), model::LogitsWanted::last};
      rows = model->forward(std::span(&step, 1));
      logits.insert(logits.end(), rows.begin(), rows.end());
    }
    write_npy_f32(o->out, logits.data(), {n, V});
    return 0;
  };
}

}  // namespace troupe::app
