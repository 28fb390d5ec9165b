// The whole engine on the GPU, end to end (bench/gpu/e2e.sh runs it next to
// transformers on the same card). One JSON object per line on stdout.
//
//   troupe_gpu_e2e fixtures --dir tests/fixtures/model
//       every committed fixture through the CUDA backend (bf16 and fp32 weights; with
//       TROUPE_CUDA_QUANTIZED=1 also "auto": a quantized fixture's FP8 / FP4 codes kept):
//       one call over all tokens, and a prefill then Decoder steps (graphs), against
//       transformers' logits and the CPU backend's
//   troupe_gpu_e2e logits --model DIR --ids IDS.npy --prefill P --out OUT.npy
//       teacher-forced logits: P tokens through Model::forward, the rest one Decoder
//       step each (replayed graphs)
//   troupe_gpu_e2e logits ... --weights f32
//       the same with fp32 matrices (TROUPE_ATTENTION_FP32=1 in the environment: fp32
//       attention too), against transformers' fp32 oracle; --weights auto: a quantized
//       checkpoint's codes kept (TROUPE_CUDA_QUANTIZED=1)
//   troupe_gpu_e2e profile-steps --model DIR --prompt N --steps S
//       S eager batch-1 decode steps between cudaProfilerStart/Stop (for ncu)
//   troupe_gpu_e2e bench --model DIR --batch B --prompt N --new M
//       generate (prefill + M-1 chained greedy Decoder steps) and steady decode
//       steps/s, the weight bytes a step reads and the copy bandwidth of the card
//   troupe_gpu_e2e context --model DIR --contexts 4096,131072
//       decode steps/s at long contexts (state rows filled with random values)
//   troupe_gpu_e2e engine --model DIR --batch B --prompt N --new M
//       engine::Engine on the CUDA backend (paged pools in device memory, decode
//       steps through the Decoder, a host tier on the copy stream): tok/s, and a
//       parked-and-resumed request against an unparked one
//   troupe_gpu_e2e moe --experts 256 --k 6 --dim 4096 --inter 2048 --rows 8,16,64
//       Backend::moe alone on random bf16 experts and routes (k distinct experts a row):
//       microseconds a call and the touched experts' weight bytes over it; --dump DIR
//       writes each call's output (moe_rows<R>.npy) to compare two settings' results
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#if TROUPE_E2E_PROFILER
#include <cuda_profiler_api.h>
#endif

#include "base/dtype.hpp"
#include "base/npy.hpp"
#include "engine/engine.hpp"
#include "kernels/backend.hpp"
#include "model/decoder.hpp"
#include "model/forward.hpp"

using namespace troupe;
using json = nlohmann::json;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::unique_ptr<kernels::Backend> cuda() {
  auto b = kernels::make_cuda_backend();
  if (!b) throw std::runtime_error("no CUDA device (or a build without the CUDA backend)");
  return b;
}

void emit(const json& j) {
  std::cout << j.dump() << std::endl;
}

struct Compare {
  double max_abs = 0, rel_l2 = 0, top1 = 0;
};
Compare compare(const std::vector<float>& got, const std::vector<float>& ref, int64_t V) {
  Compare c;
  double num = 0, den = 0;
  int64_t agree = 0;
  const int64_t rows = static_cast<int64_t>(ref.size()) / V;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = got.data() + r * V;
    const float* f = ref.data() + r * V;
    for (int64_t j = 0; j < V; ++j) {
      const double d = static_cast<double>(g[j]) - f[j];
      num += d * d;
      den += static_cast<double>(f[j]) * f[j];
      c.max_abs = std::max(c.max_abs, std::fabs(d));
    }
    agree += (std::max_element(g, g + V) - g) == (std::max_element(f, f + V) - f);
  }
  c.rel_l2 = std::sqrt(num / std::max(den, 1e-30));
  c.top1 = rows > 0 ? static_cast<double>(agree) / static_cast<double>(rows) : 1.0;
  return c;
}

// Prefill `p` tokens through Model::forward (all logits), then one Decoder step per token.
std::vector<float> prefill_then_decode(model::Model& m, const std::vector<int32_t>& ids, int64_t p, int64_t* replays) {
  auto st = m.new_dense_state();
  model::Chunk c{st.get(), std::span<const int32_t>(ids).subspan(0, static_cast<size_t>(p)), model::LogitsWanted::all};
  auto out = m.forward(std::span(&c, 1));
  const auto n = static_cast<int64_t>(ids.size());
  if (p < n) {
    model::Decoder dec(m, {1, n + 1, true});
    const int slot = dec.bind(*st);
    const int slots[1] = {slot};
    for (int64_t t = p; t < n; ++t) {
      dec.step(slots, std::span<const int32_t>(&ids[static_cast<size_t>(t)], 1));
      auto row = dec.logits();
      out.insert(out.end(), row.begin(), row.end());
    }
    if (replays != nullptr) *replays = dec.replays();
  }
  return out;
}

std::vector<float> one_call(model::Model& m, const std::vector<int32_t>& ids) {
  auto st = m.new_dense_state();
  model::Chunk c{st.get(), ids, model::LogitsWanted::all};
  return m.forward(std::span(&c, 1));
}

// --weights: bf16 / f32 (every matrix that type), or auto (Model::load's default: a quantized checkpoint's FP8 / FP4
// matrices kept as codes where the backend takes them, TROUPE_CUDA_QUANTIZED=1; the rest bf16).
std::optional<kernels::WeightType> weight_type(const std::string& name) {
  if (name == "bf16") return kernels::WeightType::bf16;
  if (name == "f32") return kernels::WeightType::f32;
  if (name == "auto") return std::nullopt;
  throw std::invalid_argument("--weights must be bf16, f32 or auto, not '" + name + "'");
}

int fixtures(const std::string& dir) {
  auto gpu = cuda();
  auto cpu = kernels::make_cpu_backend();
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (std::filesystem::exists(e.path() / "logits.npy")) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    const std::string d = dir + "/" + name;
    std::vector<int32_t> ids;
    for (int64_t v : read_npy(d + "/ids.npy").as_i64()) ids.push_back(static_cast<int32_t>(v));
    const auto ref_arr = read_npy(d + "/logits.npy");
    const auto ref = ref_arr.as_f32();
    const int64_t V = ref_arr.shape.at(1);
    std::ifstream mf(d + "/meta.json");
    const json meta = json::parse(mf);
    const int64_t p = meta.at("prefill").get<int64_t>();
    auto mc = model::Model::load(d, *cpu);
    const auto cpu_logits = one_call(*mc, ids);
    const Compare cc = compare(cpu_logits, ref, V);
    emit({{"kind", "fixture"}, {"fixture", name}, {"backend", "cpu"}, {"weights", "f32"}, {"mode", "one call"},
          {"max_abs", cc.max_abs}, {"rel_l2", cc.rel_l2}, {"top1", cc.top1}});
    std::vector<std::string> types = {"bf16", "f32"};
    // a quantized fixture's codes kept (for the others, auto is the bf16 load again)
    if (gpu->takes_quantized() && mc->config().quantization.fp8) types.push_back("auto");
    for (const auto& w : types) {
      auto m = model::Model::load(d, *gpu, weight_type(w));
      int64_t replays = 0;
      const double t0 = now();
      const auto a = one_call(*m, ids);
      const auto b = prefill_then_decode(*m, ids, p, &replays);
      const double t1 = now();
      for (const auto& [mode, got] : {std::pair<std::string, const std::vector<float>*>{"one call", &a},
                                      {"prefill " + std::to_string(p) + " then decoder steps", &b}}) {
        const Compare vr = compare(*got, ref, V), vc = compare(*got, cpu_logits, V);
        bool finite = true;
        for (float x : *got) finite &= std::isfinite(x);
        emit({{"kind", "fixture"}, {"fixture", name}, {"backend", "cuda"}, {"weights", w}, {"mode", mode},
              {"max_abs", vr.max_abs}, {"rel_l2", vr.rel_l2}, {"top1", vr.top1}, {"vs_cpu_rel_l2", vc.rel_l2},
              {"vs_cpu_top1", vc.top1}, {"finite", finite}, {"replays", replays}, {"tokens", ids.size()},
              {"seconds", t1 - t0}});
      }
    }
  }
  return 0;
}

int logits(const std::string& dir, const std::string& ids_path, int64_t p, const std::string& out_path,
           const std::string& weights) {
  auto gpu = cuda();
  const double t0 = now();
  auto m = model::Model::load(dir, *gpu, weight_type(weights));
  const double t1 = now();
  std::vector<int32_t> ids;
  for (int64_t v : read_npy(ids_path).as_i64()) ids.push_back(static_cast<int32_t>(v));
  int64_t replays = 0;
  const auto out = prefill_then_decode(*m, ids, p, &replays);
  const double t2 = now();
  write_npy_f32(out_path, out.data(), {static_cast<int64_t>(ids.size()), m->config().vocab_size});
  const char* exact = std::getenv("TROUPE_ATTENTION_FP32");
  emit({{"kind", "logits"}, {"weights", weights}, {"attention_fp32", exact != nullptr && std::string(exact) == "1"},
        {"out", out_path}, {"tokens", ids.size()}, {"prefill", p}, {"replays", replays}, {"load_s", t1 - t0},
        {"run_s", t2 - t1}, {"weight_bytes", m->weights_bytes()}});
  return 0;
}

// Bytes of weights one decode step reads with `experts` routed experts per layer touched.
double step_weight_bytes(const model::Model& m, double experts) {
  const auto& w = m.weights();
  auto bytes = [](const kernels::Weight& x) {
    const double n = static_cast<double>(x.rows) * static_cast<double>(x.cols);
    if (kernels::is_quantized(x.type)) {  // codes and the fp32 scales of the blocks they cover
      const double scales = std::ceil(static_cast<double>(x.rows) / x.block_rows) *
                            std::ceil(static_cast<double>(x.cols) / x.block_cols) * 4;
      return n * (x.type == kernels::WeightType::e4m3 ? 1.0 : 0.5) + scales;
    }
    return n * (x.type == kernels::WeightType::f32 ? 4 : 2);
  };
  double total = bytes(w.lm_head) + bytes(w.hc_head.fn) + static_cast<double>(w.embed.cols) * 2;
  for (const auto& l : w.layers) {
    total += bytes(l.attn_hc.fn) + bytes(l.ffn_hc.fn);
    const auto& a = l.attn;
    total += bytes(a.q_a_proj) + bytes(a.q_b_proj) + bytes(a.kv_proj) + bytes(a.o_a_proj) + bytes(a.o_b_proj);
    if (a.compressor) total += bytes(a.compressor->kv_proj) + bytes(a.compressor->gate_proj);
    if (a.indexer) {
      total += bytes(a.indexer->compressor.kv_proj) + bytes(a.indexer->compressor.gate_proj) +
               bytes(a.indexer->q_b_proj) + bytes(a.indexer->weights_proj);
    }
    const auto& mo = l.moe;
    total += bytes(mo.router) + bytes(mo.shared_gate) + bytes(mo.shared_up) + bytes(mo.shared_down);
    total += experts * (bytes(mo.gate[0]) + bytes(mo.up[0]) + bytes(mo.down[0]));
  }
  return total;
}

// State bytes a decode step reads at context `ctx` (window, entries, index keys; fp32 rows).
double step_state_bytes(const model::ModelConfig& c, int64_t ctx) {
  double total = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const auto s = model::LayerShape::of(c, l);
    total += static_cast<double>(std::min<int64_t>(ctx, c.sliding_window) * c.head_dim) * 4;
    if (s.type == model::LayerType::hca) total += static_cast<double>(ctx / s.rate * c.head_dim) * 4;
    if (s.type == model::LayerType::csa) {
      total += static_cast<double>(ctx / s.rate * c.index_head_dim) * 4;
      total += static_cast<double>(std::min<int64_t>(ctx / s.rate, c.index_topk) * c.head_dim) * 4;
    }
  }
  return total;
}

// Device-to-device copy bandwidth (bytes read + written per second), best of a few.
double copy_bandwidth(kernels::Backend& be) {
  const size_t bytes = size_t{1} << 30;
  void* a = be.alloc(bytes);
  void* b = be.alloc(bytes);
  be.copy(b, a, bytes);
  be.synchronize();
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    const double t0 = now();
    for (int i = 0; i < 4; ++i) be.copy(i % 2 ? a : b, i % 2 ? b : a, bytes);
    be.synchronize();
    best = std::max(best, 4.0 * 2.0 * static_cast<double>(bytes) / (now() - t0));
  }
  be.free(a);
  be.free(b);
  return best;
}

std::vector<int32_t> random_ids(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(2 + rng() % static_cast<uint64_t>(std::min<int64_t>(vocab, 100000) - 2));
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Where a step's time goes: steps run eagerly, synchronizing after each group of ops
// (launch gaps included, so the groups sum to more than a replayed step). Emits a
// "profile" line with `extra` fields; the sequences' states grow by the steps run.
void emit_profile(model::Model& m, const std::vector<model::SequenceState*>& seqs, int64_t max_context,
                  const std::vector<int32_t>& ids, json extra) {
  model::Decoder prof(m, {static_cast<int>(seqs.size()), max_context, false, true});
  std::vector<int> pslots;
  for (auto* s : seqs) pslots.push_back(prof.bind(*s));
  prof.step(pslots, ids);
  const int psteps = 20;
  for (int i = 1; i < psteps; ++i) prof.step(pslots, {});
  prof.tokens();
  json groups = json::object();
  double prof_total = 0;
  for (const auto& [name, sec] : prof.profile()) {
    groups[name] = sec / psteps * 1e6;
    prof_total += sec / psteps * 1e6;
  }
  extra["kind"] = "profile";
  extra["us_per_step"] = groups;
  extra["total_us"] = prof_total;
  emit(extra);
}

int bench(const std::string& dir, int batch, int64_t prompt, int64_t fresh, int repeats, uint64_t seed) {
  auto gpu = cuda();
  auto m = model::Model::load(dir, *gpu);
  const auto& c = m->config();
  const int64_t V = c.vocab_size;
  const double bw = copy_bandwidth(*gpu);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int b = 0; b < batch; ++b) prompts.push_back(random_ids(rng, prompt, V));
  model::Decoder dec(*m, {batch, prompt + fresh + 8, true});

  struct Run {
    double prefill = 0, decode = 0;
    std::vector<std::vector<int32_t>> tokens;
  };
  auto run_once = [&]() {
    std::vector<std::unique_ptr<model::SequenceState>> st;
    for (int b = 0; b < batch; ++b) st.push_back(m->new_dense_state());
    gpu->synchronize();
    Run r;
    r.tokens.resize(static_cast<size_t>(batch));
    const double t0 = now();
    std::vector<model::Chunk> chunks;
    for (int b = 0; b < batch; ++b) chunks.push_back({st[b].get(), prompts[b], model::LogitsWanted::last});
    const auto rows = m->forward(chunks);
    std::vector<int32_t> first(static_cast<size_t>(batch));
    for (int b = 0; b < batch; ++b) {
      const float* row = rows.data() + static_cast<int64_t>(b) * V;
      first[b] = static_cast<int32_t>(std::max_element(row, row + V) - row);
      r.tokens[b].push_back(first[b]);
    }
    const double t1 = now();
    std::vector<int> slots;
    for (int b = 0; b < batch; ++b) slots.push_back(dec.bind(*st[b]));
    std::vector<std::vector<int32_t>> produced;
    dec.step(slots, first);
    for (int64_t t = 1; t < fresh - 1; ++t) dec.step(slots, {});  // the previous samples feed the next step
    const auto last = dec.tokens();
    const double t2 = now();
    for (int b = 0; b < batch; ++b) r.tokens[b].push_back(last[b]);
    for (int s : slots) dec.unbind(s);
    r.prefill = t1 - t0;
    r.decode = t2 - t1;
    return r;
  };
  run_once();  // warm: sizes every buffer, records the graph of this batch
  std::vector<double> pre, dsec;
  Run last;
  for (int r = 0; r < repeats; ++r) {
    last = run_once();
    pre.push_back(last.prefill);
    dsec.push_back(last.decode);
  }
  // Steady decode: many chained replays on live states.
  std::vector<std::unique_ptr<model::SequenceState>> st;
  for (int b = 0; b < batch; ++b) st.push_back(m->new_dense_state());
  std::vector<model::Chunk> chunks;
  for (int b = 0; b < batch; ++b) chunks.push_back({st[b].get(), prompts[b], model::LogitsWanted::none});
  m->forward(chunks);
  model::Decoder steady(*m, {batch, prompt + 200, true});
  std::vector<int> slots;
  for (int b = 0; b < batch; ++b) slots.push_back(steady.bind(*st[b]));
  std::vector<int32_t> ids(static_cast<size_t>(batch), 5);
  steady.step(slots, ids);
  for (int i = 0; i < 5; ++i) steady.step(slots, {});
  steady.tokens();
  const int steps = 100;
  const double t0 = now();
  for (int i = 0; i < steps; ++i) steady.step(slots, {});
  steady.tokens();
  const double step_s = (now() - t0) / steps;

  std::vector<model::SequenceState*> seqs;
  for (auto& s : st) seqs.push_back(s.get());
  emit_profile(*m, seqs, prompt + 400, ids, {{"batch", batch}, {"replayed_step_us", step_s * 1e6}});

  const double pre_s = median(pre), dec_s = median(dsec);
  const double experts = batch == 1 ? static_cast<double>(c.num_experts_per_tok)
                                    : c.n_routed_experts * (1.0 - std::pow(1.0 - static_cast<double>(c.num_experts_per_tok) /
                                                                                     c.n_routed_experts,
                                                                           batch));
  const double wbytes = step_weight_bytes(*m, experts);
  double sbytes = 0;
  for (int b = 0; b < batch; ++b) sbytes += step_state_bytes(c, prompt + fresh / 2);
  const double roof_s = (wbytes + sbytes) / bw;
  json toks = json::array();
  for (const auto& t : last.tokens) toks.push_back(t);
  const char* variant = std::getenv("TROUPE_VARIANT");
  emit({{"kind", "bench"}, {"variant", variant != nullptr ? variant : "default"}, {"batch", batch}, {"prompt", prompt}, {"new", fresh}, {"repeats", repeats},
        {"prefill_s", pre_s}, {"decode_s", dec_s}, {"generate_tok_s", batch * fresh / (pre_s + dec_s)},
        {"prefill_tok_s", batch * prompt / pre_s}, {"decode_tok_s", batch * (fresh - 1) / dec_s},
        {"steady_step_ms", step_s * 1e3}, {"steady_tok_s", batch / step_s}, {"copy_tb_s", bw / 1e12},
        {"experts_touched_per_layer", experts}, {"weight_bytes_per_step", wbytes}, {"state_bytes_per_step", sbytes},
        {"roofline_step_ms", roof_s * 1e3}, {"roofline_tok_s", batch / roof_s},
        {"fraction_of_roofline", roof_s / step_s}, {"replays", dec.replays() + steady.replays()},
        {"steps", dec.steps() + steady.steps()}, {"tokens_last_run", toks}});
  return 0;
}

// Eager decode steps (no graphs) between cudaProfilerStart/Stop, for
// `ncu --profile-from-start off`: the kernels of `steps` batch-1 steps at `prompt` context.
int profile_steps(const std::string& dir, int64_t prompt, int steps, int batch) {
  auto gpu = cuda();
  auto m = model::Model::load(dir, *gpu);
  std::mt19937_64 rng(5);
  std::vector<std::unique_ptr<model::SequenceState>> st;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<model::Chunk> chunks;
  for (int b = 0; b < batch; ++b) {
    st.push_back(m->new_dense_state());
    prompts.push_back(random_ids(rng, prompt, m->config().vocab_size));
  }
  for (int b = 0; b < batch; ++b) chunks.push_back({st[b].get(), prompts[b], model::LogitsWanted::none});
  m->forward(chunks);
  model::Decoder dec(*m, {batch, prompt + steps + 8, false});
  std::vector<int> slots;
  for (int b = 0; b < batch; ++b) slots.push_back(dec.bind(*st[b]));
  const std::vector<int32_t> first(static_cast<size_t>(batch), 7);
  dec.step(slots, first);
  dec.step(slots, {});
  dec.tokens();
#if TROUPE_E2E_PROFILER
  if (cudaProfilerStart() != cudaSuccess) throw std::runtime_error("cudaProfilerStart failed");
#endif
  for (int i = 0; i < steps; ++i) dec.step(slots, {});
  dec.tokens();
#if TROUPE_E2E_PROFILER
  if (cudaProfilerStop() != cudaSuccess) throw std::runtime_error("cudaProfilerStop failed");
#endif
  emit({{"kind", "profile_steps"}, {"batch", batch}, {"prompt", prompt}, {"steps", steps}});
  return 0;
}

int context(const std::string& dir, const std::vector<int64_t>& contexts, int steps) {
  auto gpu = cuda();
  auto m = model::Model::load(dir, *gpu);
  const auto& c = m->config();
  std::mt19937 rng(3);
  std::normal_distribution<float> n01;
  std::vector<float> pool(size_t{1} << 22);
  for (auto& x : pool) x = n01(rng);
  size_t at = 0;
  auto fill = [&](float* row, int64_t n) {
    if (at + static_cast<size_t>(n) > pool.size()) at = (at * 7 + 13) % 4096;
    gpu->to_device(row, pool.data() + at, static_cast<size_t>(n) * 4);
    at += static_cast<size_t>(n) + 5;
  };
  for (int64_t ctx : contexts) {
    auto st = m->new_dense_state();
    st->reserve(ctx);
    const double f0 = now();
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const auto shape = model::LayerShape::of(c, l);
      for (int64_t p = std::max<int64_t>(0, ctx - c.sliding_window); p < ctx; ++p) fill(st->swa_row(l, p), c.head_dim);
      if (shape.rate == 0) continue;
      for (int64_t i = 0; i < ctx / shape.rate; ++i) {
        fill(st->entry_row(l, i), c.head_dim);
        if (shape.type == model::LayerType::csa) fill(st->index_key_row(l, i), c.index_head_dim);
      }
      for (int64_t p = ctx - shape.ring_slots; p < ctx; ++p) {
        fill(st->ring_row(l, model::Ring::compressor, p), shape.ring_width);
        if (shape.type == model::LayerType::csa) fill(st->ring_row(l, model::Ring::indexer, p), shape.index_ring_width);
      }
    }
    st->commit(ctx);
    gpu->synchronize();
    const double fill_s = now() - f0;
    model::Decoder dec(*m, {1, ctx + steps + 16, true});
    const int slot = dec.bind(*st);
    const int slots[1] = {slot};
    const int32_t first = 7;
    dec.step(slots, std::span<const int32_t>(&first, 1));
    for (int i = 0; i < 4; ++i) dec.step(slots, {});
    dec.tokens();
    const double t0 = now();
    for (int i = 0; i < steps; ++i) dec.step(slots, {});
    dec.tokens();
    const double s = (now() - t0) / steps;
    emit({{"kind", "context"}, {"context", ctx}, {"steps", steps}, {"step_ms", s * 1e3}, {"tok_s", 1.0 / s},
          {"fill_s", fill_s}, {"replays", dec.replays()}, {"state_bytes_per_step", step_state_bytes(c, ctx)}});
    dec.unbind(slot);
    emit_profile(*m, {st.get()}, ctx + steps + 64, {first}, {{"context", ctx}, {"replayed_step_us", s * 1e6}});
#if TROUPE_E2E_PROFILER
    // TROUPE_E2E_NCU=1: two eager steps at this context between cudaProfilerStart/Stop
    // (`ncu --profile-from-start off`), after the profiled ones.
    if (const char* e = std::getenv("TROUPE_E2E_NCU"); e != nullptr && e[0] == '1') {
      model::Decoder eager(*m, {1, ctx + steps + 128, false});
      const int es = eager.bind(*st);
      const int eslots[1] = {es};
      eager.step(eslots, std::span<const int32_t>(&first, 1));
      eager.tokens();
      if (cudaProfilerStart() != cudaSuccess) throw std::runtime_error("cudaProfilerStart failed");
      for (int i = 0; i < 2; ++i) eager.step(eslots, {});
      eager.tokens();
      if (cudaProfilerStop() != cudaSuccess) throw std::runtime_error("cudaProfilerStop failed");
    }
#endif
  }
  return 0;
}

int run_engine(const std::string& dir, int batch, int64_t prompt, int64_t fresh, uint64_t seed) {
  auto gpu = cuda();
  auto m = model::Model::load(dir, *gpu);
  const int64_t V = m->config().vocab_size;
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int b = 0; b < batch; ++b) prompts.push_back(random_ids(rng, prompt, V));
  engine::EngineOptions o;
  o.device_bytes = uint64_t{8} << 30;
  o.host_bytes = uint64_t{4} << 30;
  o.step_tokens = 8192;
  o.prefix_cache = false;
  auto request = [&](const std::vector<int32_t>& p) {
    engine::Request r;
    r.prompt = p;
    r.sampling.max_tokens = static_cast<int32_t>(fresh);
    r.sampling.ignore_eos = true;
    r.prefix_cache = false;
    return r;
  };
  auto collect = [](engine::Engine& e, std::map<engine::RequestId, std::vector<int32_t>>& toks) {
    for (const auto& ev : e.take_events()) {
      if (ev.kind == engine::EventKind::token) toks[ev.id].push_back(ev.token);
    }
  };
  json out = {{"kind", "engine"}, {"batch", batch}, {"prompt", prompt}, {"new", fresh}};
  std::vector<std::vector<int32_t>> engine_tokens;
  {
    engine::Engine e(*m, o);
    // Warm (records the graphs of the batch sizes this run meets).
    for (int b = 0; b < batch; ++b) e.submit(request(prompts[b]));
    e.run_until_idle();
    e.take_events();
    gpu->synchronize();
    std::map<engine::RequestId, std::vector<int32_t>> toks;
    std::vector<engine::RequestId> ids;
    const double t0 = now();
    for (int b = 0; b < batch; ++b) ids.push_back(e.submit(request(prompts[b])));
    e.run_until_idle();
    const double t1 = now();
    collect(e, toks);
    for (auto id : ids) engine_tokens.push_back(toks[id]);
    const auto s = e.stats();
    out["generate_tok_s"] = batch * fresh / (t1 - t0);
    out["seconds"] = t1 - t0;
    out["decoder_steps"] = s.decoder_steps;
    out["graph_replays"] = s.graph_replays;
    out["steps"] = s.steps;
    json tj = json::array();
    for (const auto& t : engine_tokens) tj.push_back(t);
    out["tokens"] = tj;
  }
  {
    // Park and resume one request halfway (its pages through the host tier on the
    // copy stream); its tokens must equal an unparked run's.
    engine::Engine e(*m, o);
    std::map<engine::RequestId, std::vector<int32_t>> toks;
    const auto id = e.submit(request(prompts[0]));
    for (int i = 0; i < 100000 && toks[id].size() < static_cast<size_t>(fresh / 2); ++i) {
      e.step();
      collect(e, toks);
    }
    e.park(id);
    for (int i = 0; i < 1000 && e.stats().parked == 0; ++i) {
      e.step();
      collect(e, toks);
    }
    const bool parked = e.stats().parked == 1;
    e.resume(id);
    e.run_until_idle();
    collect(e, toks);
    const auto s = e.stats();
    out["park_parked"] = parked;
    out["park_tokens_equal"] = toks[id] == engine_tokens[0];
    out["park_copied_bytes"] = s.copied_bytes;
    out["park_resumes"] = s.resumes;
  }
  emit(out);
  return 0;
}

// Backend::moe alone: E experts of random bf16 (gate, up: inter x dim; down: dim x inter) in
// one allocation, random x and routes of k distinct experts a row; each rows count timed over
// `calls` calls after 3 warm-up calls (the environment's TROUPE_MOE_BATCHED picks the path).
int moe_bench(int experts, int k, int64_t dim, int64_t inter, const std::vector<int64_t>& rows_list, int calls,
              uint64_t seed, const std::string& dump) {
  if (experts < 1 || k < 1 || k > experts || dim < 1 || inter < 1 || calls < 1) {
    throw std::invalid_argument("moe: need 1 <= k <= experts and positive dim, inter, calls");
  }
  auto be = cuda();
  const int64_t per_matrix = (inter * dim + 127) / 128 * 128, per_expert = 3 * per_matrix;  // 256-byte aligned
  auto* weights = static_cast<uint16_t*>(be->alloc(static_cast<size_t>(experts * per_expert) * 2));
  // A random block, uploaded once and copied across the experts at shifting offsets.
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t block = std::min<int64_t>(int64_t{16} << 20, experts * per_expert);
  std::vector<uint16_t> host(static_cast<size_t>(block + 4096));
  const float wscale = 1.f / std::sqrt(static_cast<float>(dim));
  for (auto& h : host) h = f32_to_bf16(normal(rng) * wscale);
  void* staging = be->alloc(host.size() * 2);
  be->to_device(staging, host.data(), host.size() * 2);
  for (int64_t at = 0, i = 0; at < experts * per_expert; at += block, ++i) {
    const int64_t n = std::min(block, experts * per_expert - at);
    be->copy(weights + at, static_cast<uint16_t*>(staging) + (i * 97) % 4096, static_cast<size_t>(n) * 2);
  }
  std::vector<kernels::Weight> gate(experts), up(experts), down(experts);
  for (int e = 0; e < experts; ++e) {
    const uint16_t* base = weights + e * per_expert;
    gate[e] = {base, kernels::WeightType::bf16, inter, dim};
    up[e] = {base + per_matrix, kernels::WeightType::bf16, inter, dim};
    down[e] = {base + 2 * per_matrix, kernels::WeightType::bf16, dim, inter};
  }
  for (int64_t rows : rows_list) {
    std::vector<float> x(static_cast<size_t>(rows * dim)), wt(static_cast<size_t>(rows * k));
    for (auto& v : x) v = normal(rng);
    for (auto& v : wt) v = 0.5f + 0.1f * normal(rng);
    std::vector<int32_t> idx(static_cast<size_t>(rows * k)), order(static_cast<size_t>(experts));
    std::vector<char> touched(static_cast<size_t>(experts), 0);
    for (int64_t r = 0; r < rows; ++r) {
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      for (int j = 0; j < k; ++j) {
        idx[static_cast<size_t>(r * k + j)] = order[static_cast<size_t>(j)];
        touched[static_cast<size_t>(order[static_cast<size_t>(j)])] = 1;
      }
    }
    auto* dx = static_cast<float*>(be->alloc(x.size() * 4));
    auto* dw = static_cast<float*>(be->alloc(wt.size() * 4));
    auto* di = static_cast<int32_t*>(be->alloc(idx.size() * 4));
    auto* dout = static_cast<float*>(be->alloc(x.size() * 4));
    be->to_device(dx, x.data(), x.size() * 4);
    be->to_device(dw, wt.data(), wt.size() * 4);
    be->to_device(di, idx.data(), idx.size() * 4);
    const std::vector<float> zeros(x.size(), 0.f);
    be->to_device(dout, zeros.data(), zeros.size() * 4);
    const auto call = [&] {
      be->moe(dx, rows, dim, di, dw, k, experts, gate.data(), up.data(), down.data(), 10.f, dout);
    };
    call();
    be->synchronize();
    std::vector<float> first(x.size());
    be->to_host(first.data(), dout, first.size() * 4);  // one call's output (out starts at zero)
    for (int i = 0; i < 2; ++i) call();
    be->synchronize();
    const double t0 = now();
    for (int i = 0; i < calls; ++i) call();
    be->synchronize();
    const double us = (now() - t0) / calls * 1e6;
    const auto n_touched = std::count(touched.begin(), touched.end(), 1);
    const double bytes = static_cast<double>(n_touched) * static_cast<double>(per_expert) * 2;
    const char* setting = std::getenv("TROUPE_VARIANT");  // the run's label, else its TROUPE_MOE_BATCHED
    if (setting == nullptr) setting = std::getenv("TROUPE_MOE_BATCHED");
    emit({{"kind", "moe"}, {"setting", setting != nullptr ? setting : ""}, {"experts", experts}, {"k", k},
          {"dim", dim}, {"inter", inter}, {"rows", rows}, {"touched", n_touched}, {"us", us},
          {"touched_weight_gbs", bytes / us * 1e-3}});
    if (!dump.empty()) {
      std::filesystem::create_directories(dump);
      write_npy_f32(dump + "/moe_rows" + std::to_string(rows) + ".npy", first.data(), {rows, dim});
    }
    for (void* p : {static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(di), static_cast<void*>(dout)}) {
      be->free(p);
    }
  }
  be->free(staging);
  be->free(weights);
  return 0;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe_gpu_e2e"};
  app.require_subcommand(1);
  std::string dir, model_dir, ids, out, contexts = "4096,131072";
  int64_t prefill = 0, prompt = 512, fresh = 32;
  int batch = 1, repeats = 3, steps = 50;
  uint64_t seed = 1;
  auto* fx = app.add_subcommand("fixtures", "committed fixtures through the CUDA backend");
  fx->add_option("--dir", dir)->required();
  auto* lg = app.add_subcommand("logits", "teacher-forced logits (prefill, then Decoder steps)");
  lg->add_option("--model", model_dir)->required();
  lg->add_option("--ids", ids)->required();
  lg->add_option("--prefill", prefill)->required();
  lg->add_option("--out", out)->required();
  std::string weights = "bf16";
  lg->add_option("--weights", weights, "matrix type on the device: bf16, f32 or auto (as served)");
  auto* ps = app.add_subcommand("profile-steps", "eager decode steps inside cudaProfilerStart/Stop (ncu)");
  ps->add_option("--model", model_dir)->required();
  ps->add_option("--prompt", prompt);
  ps->add_option("--steps", steps);
  ps->add_option("--batch", batch, "sequences a step (1 unless given)");
  auto* bn = app.add_subcommand("bench", "generate and decode throughput");
  auto* cx = app.add_subcommand("context", "decode throughput at long contexts");
  auto* en = app.add_subcommand("engine", "engine::Engine on the CUDA backend");
  for (auto* sc : {bn, cx, en}) sc->add_option("--model", model_dir)->required();
  for (auto* sc : {bn, en}) {
    sc->add_option("--batch", batch);
    sc->add_option("--prompt", prompt);
    sc->add_option("--new", fresh);
    sc->add_option("--seed", seed);
  }
  bn->add_option("--repeats", repeats);
  cx->add_option("--contexts", contexts);
  cx->add_option("--steps", steps);
  auto* mo = app.add_subcommand("moe", "Backend::moe alone on random bf16 experts");
  int experts = 256, top_k = 6, calls = 20;
  int64_t dim = 4096, inter = 2048;
  std::string rows_list = "8,16,64", dump;
  mo->add_option("--experts", experts);
  mo->add_option("--k", top_k);
  mo->add_option("--dim", dim);
  mo->add_option("--inter", inter);
  mo->add_option("--rows", rows_list);
  mo->add_option("--calls", calls);
  mo->add_option("--seed", seed);
  mo->add_option("--dump", dump, "write each rows count's output here (moe_rows<R>.npy)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (fx->parsed()) return fixtures(dir);
    if (lg->parsed()) return logits(model_dir, ids, prefill, out, weights);
    if (ps->parsed()) return profile_steps(model_dir, prompt, steps, batch);
    if (bn->parsed()) return bench(model_dir, batch, prompt, fresh, repeats, seed);
    if (cx->parsed()) return context(model_dir, parse_list(contexts), steps);
    if (en->parsed()) return run_engine(model_dir, batch, prompt, fresh, seed);
    if (mo->parsed()) return moe_bench(experts, top_k, dim, inter, parse_list(rows_list), calls, seed, dump);
  } catch (const std::exception& e) {
    std::cerr << "troupe_gpu_e2e: " << e.what() << "\n";
    emit({{"kind", "error"}, {"what", e.what()}});
    return 1;
  }
  return 0;
}
