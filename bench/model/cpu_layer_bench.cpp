// One decode step of a V4-Flash-shaped layer (hidden 4096, 64 heads x 512,
// q_lora 1024, o 8 x 1024, index 64 x 128 top-512, window 128, 16 experts top-6)
// on the CPU backend, at a given context, with the layer's state filled with
// random values (the cost of a step does not depend on them).
//
//   cpu_layer_bench --model DIR --context N [--steps S]
// Prints one JSON line: {"layer_type":..., "context":..., "ms_per_step":...}.
#include <CLI/CLI.hpp>

#include <chrono>
#include <iostream>
#include <random>

#include "kernels/backend.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "model/forward.hpp"

using namespace troupe;

int main(int argc, char** argv) {
  kernels::cpu::ensure_blas_kernels(argv);
  std::string dir;
  int64_t context = 4096;
  int steps = 5;
  CLI::App app{"cpu_layer_bench"};
  app.add_option("--model", dir)->required();
  app.add_option("--context", context);
  app.add_option("--steps", steps);
  CLI11_PARSE(app, argc, argv);

  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(dir, *backend);
  const auto& c = m->config();
  auto state = m->new_dense_state();
  state->reserve(context);
  std::mt19937 rng(1);
  std::normal_distribution<float> n01;
  auto fill = [&](float* row, int64_t n) {
    for (int64_t i = 0; i < n; ++i) row[i] = n01(rng);
  };
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const auto shape = model::LayerShape::of(c, l);
    for (int64_t p = std::max<int64_t>(0, context - c.sliding_window); p < context; ++p) fill(state->swa_row(l, p), c.head_dim);
    if (shape.rate == 0) continue;
    for (int64_t i = 0; i < context / shape.rate; ++i) {
      fill(state->entry_row(l, i), c.head_dim);
      if (shape.type == model::LayerType::csa) fill(state->index_key_row(l, i), c.index_head_dim);
    }
    for (int64_t p = context - shape.ring_slots; p < context; ++p) {
      fill(state->ring_row(l, model::Ring::compressor, p), shape.ring_width);
      if (shape.type == model::LayerType::csa) fill(state->ring_row(l, model::Ring::indexer, p), shape.index_ring_width);
    }
  }
  state->commit(context);
  std::vector<int32_t> ids{7};
  std::vector<double> ms;
  for (int s = 0; s < steps + 1; ++s) {
    model::Chunk chunk{state.get(), ids, model::LogitsWanted::last};
    auto t0 = std::chrono::steady_clock::now();
    m->forward(std::span(&chunk, 1));
    auto t1 = std::chrono::steady_clock::now();
    if (s > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());  // first step warms up
  }
  std::sort(ms.begin(), ms.end());
  std::cout << "{\"layer_type\": \"" << model::to_string(c.layer_types[0]) << "\", \"context\": " << context
            << ", \"ms_per_step\": " << ms[ms.size() / 2] << "}" << std::endl;
  return 0;
}
