// troupe forward --model DIR --ids 5,17,300 --prefill N --out FILE.npy
// Runs the first N ids as one call, then each remaining id as its own call, and
// writes float32 logits [number of ids, vocab] (row t: the logits after id t).

#include "apps/troupe/commands.hpp"
#include "apps/troupe/model_args.hpp"
#include "base/error.hpp"
#include "base/npy.hpp"
#include "model/forward.hpp"

namespace troupe::app {

Command add_forward(CLI::App& app) {
  struct Opts {
    std::string model, ids, out;
    BackendArgs backend;
    int64_t prefill = -1;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("forward", "run the model over token ids and write the logits as .npy");
  cmd->add_option("--model", o->model, "model directory (config.json + safetensors)")->required();
  cmd->add_option("--ids", o->ids, "comma-separated token ids")->required();
  cmd->add_option("--prefill", o->prefill, "ids run as the first call (default: all)");
  cmd->add_option("--out", o->out, "output .npy file")->required();
  add_backend_options(cmd, o->backend);
  return [o] {
    const auto ids = parse_token_ids(o->ids);
    const auto n = static_cast<int64_t>(ids.size());
    const int64_t prefill = o->prefill < 0 ? n : o->prefill;
    if (prefill == 0) raise(ErrorCode::invalid_argument, "--prefill must be at least 1");
    if (prefill > n) raise(ErrorCode::invalid_argument, "--prefill {} is larger than the {} ids given", prefill, n);
    auto loaded = load_model(o->model, o->backend, ids);
    auto& model = loaded.model;
    const int64_t V = model->config().vocab_size;
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
