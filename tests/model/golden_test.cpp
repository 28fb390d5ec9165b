// The CPU forward pass against transformers' logits, stateless and fed in pieces.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "kernels/backend.hpp"
#include "kernels/cpu/cpu_backend.hpp"
#include "model/forward.hpp"
#include "model/safetensors.hpp"
#include "tests/model/fixtures.hpp"
#include "tests/support/process.hpp"

namespace troupe::testing {
namespace {

constexpr double kTolerance = 1e-3;  // issue bound; the measured error is ~1e-5

// Runs the ids through `model` in chunks of the given sizes (one chunk per call)
// and returns all logits rows.
std::vector<float> run_chunked(model::Model& m, const std::vector<int32_t>& ids, const std::vector<int64_t>& sizes) {
  auto state = m.new_dense_state();
  std::vector<float> out;
  size_t at = 0;
  for (int64_t n : sizes) {
    model::Chunk c{state.get(), std::span<const int32_t>(ids).subspan(at, static_cast<size_t>(n)),
                   model::LogitsWanted::all};
    auto rows = m.forward(std::span(&c, 1));
    out.insert(out.end(), rows.begin(), rows.end());
    at += static_cast<size_t>(n);
  }
  return out;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, stateless_and_every_split_match_transformers) {
  const Fixture f = load_fixture(GetParam());
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(f.dir, *backend);
  const auto T = static_cast<int64_t>(f.ids.size());
  ASSERT_EQ(m->config().vocab_size, f.vocab);

  std::vector<std::pair<std::string, std::vector<int64_t>>> splits;
  splits.push_back({"stateless", {T}});
  const int64_t p = f.meta.at("prefill").get<int64_t>();
  std::vector<int64_t> prefill_then_decode{p};
  for (int64_t t = p; t < T; ++t) prefill_then_decode.push_back(1);
  splits.push_back({"prefill " + std::to_string(p) + " then decode", prefill_then_decode});
  std::mt19937 rng(static_cast<uint32_t>(T));
  for (int r = 0; r < 2; ++r) {  // random chunkings: lengths not multiples of any rate
    std::vector<int64_t> sizes;
    for (int64_t left = T; left > 0;) {
      int64_t n = std::min<int64_t>(left, 1 + static_cast<int64_t>(rng() % 97));
      sizes.push_back(n);
      left -= n;
    }
    splits.push_back({"random chunking " + std::to_string(r), sizes});
  }
  for (const auto& [what, sizes] : splits) {
    auto got = run_chunked(*m, f.ids, sizes);
    ASSERT_EQ(got.size(), f.logits.size()) << what;
    const double err = max_abs_diff(got.data(), f.logits.data(), got.size());
    EXPECT_LE(err, kTolerance) << f.name << " " << what;
    std::cout << "[ fixture  ] " << f.name << " " << what << ": max |logit - transformers| = " << err << "\n";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

// The bf16 checkpoint: exact against transformers running the same (bf16-rounded)
// weights in fp32, and as far from its fp32 twin as transformers' own bf16 copy is.
TEST(Bf16Checkpoint, matches_rounded_oracle_and_fp32_twin_within_bf16_tolerance) {
  const Fixture f = load_fixture("basic_bf16");
  auto fp32_twin = read_npy(f.dir + "/fp32_logits.npy").as_f32();
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(f.dir, *backend);
  auto got = run_chunked(*m, f.ids, {static_cast<int64_t>(f.ids.size())});
  EXPECT_LE(max_abs_diff(got.data(), f.logits.data(), got.size()), kTolerance);
  double num = 0, den = 0, hf_num = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += std::pow(got[i] - fp32_twin[i], 2);
    hf_num += std::pow(f.logits[i] - fp32_twin[i], 2);
    den += std::pow(fp32_twin[i], 2);
  }
  const double rel = std::sqrt(num / den), hf_rel = std::sqrt(hf_num / den);
  std::cout << "[ bf16     ] relative error vs fp32 twin: troupe " << rel << ", transformers " << hf_rel << "\n";
  EXPECT_LT(rel, 0.2);
  EXPECT_NEAR(rel, hf_rel, 0.01 * hf_rel + 1e-6);
}

// The FP8 / FP4 checkpoint held as its codes and block scales (the CPU backend's
// default) gives the same bits as the same checkpoint dequantized to fp32 as it
// loads, at every chunking, in a fraction of the memory.
void expect_quantized_same_as_dequantized(const std::string& dir, const Fixture& f) {
  auto backend = kernels::make_cpu_backend();
  auto kept = model::Model::load(dir, *backend);
  auto dense = model::Model::load(dir, *backend, kernels::WeightType::f32);
  const auto T = static_cast<int64_t>(f.ids.size());
  const int64_t p = f.meta.at("prefill").get<int64_t>();
  std::vector<int64_t> prefill_then_decode{p};
  for (int64_t t = p; t < T; ++t) prefill_then_decode.push_back(1);
  for (const auto& sizes : {std::vector<int64_t>{T}, prefill_then_decode, std::vector<int64_t>{7, 30, T - 37}}) {
    auto a = run_chunked(*kept, f.ids, sizes), b = run_chunked(*dense, f.ids, sizes);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << dir << ": " << sizes.size() << " chunks";
    EXPECT_LE(max_abs_diff(a.data(), f.logits.data(), a.size()), kTolerance);
  }
  std::cout << "[ fp8/fp4  ] " << dir << ": weights " << kept->weights_bytes() << " bytes as codes, "
            << dense->weights_bytes() << " dequantized\n";
  EXPECT_LT(kept->weights_bytes() * 2, dense->weights_bytes());
  EXPECT_EQ(kept->weights().layers[0].attn.q_a_proj.type, kernels::WeightType::e4m3);
  EXPECT_EQ(kept->weights().layers[0].moe.gate[0].type, kernels::WeightType::e2m1);
  EXPECT_EQ(dense->weights().layers[0].attn.q_a_proj.type, kernels::WeightType::f32);
}

TEST(QuantizedWeights, kept_as_codes_give_the_bits_of_the_dequantized_load) {
  const Fixture f = load_fixture("fp8_fp4");
  expect_quantized_same_as_dequantized(f.dir, f);
}

// A backend may keep some matrices' codes and have the rest dequantized (the CUDA backend's
// TROUPE_CUDA_QUANTIZED=experts): here the CPU backend keeping only the routed experts'. The logits keep
// the dequantized load's bits, and the weights' bytes fall between the two loads'.
class RoutedExpertCodesOnly : public kernels::cpu::CpuBackend {
 public:
  bool keeps_quantized(bool routed_expert) const override { return routed_expert; }
};

TEST(QuantizedWeights, a_backend_may_keep_only_the_routed_experts_codes) {
  const Fixture f = load_fixture("fp8_fp4");
  RoutedExpertCodesOnly experts_only;
  auto cpu = kernels::make_cpu_backend();
  auto mixed = model::Model::load(f.dir, experts_only);
  auto kept = model::Model::load(f.dir, *cpu);
  auto dense = model::Model::load(f.dir, *cpu, kernels::WeightType::f32);
  const auto& l0 = mixed->weights().layers[0];
  EXPECT_EQ(l0.attn.q_a_proj.type, kernels::WeightType::f32);
  EXPECT_EQ(l0.moe.shared_gate.type, kernels::WeightType::f32);
  for (const auto* w : {&l0.moe.gate, &l0.moe.up, &l0.moe.down}) {
    ASSERT_FALSE(w->empty());
    for (const auto& e : *w) EXPECT_EQ(e.type, kernels::WeightType::e2m1);
  }
  EXPECT_LT(kept->weights_bytes(), mixed->weights_bytes());
  EXPECT_LT(mixed->weights_bytes(), dense->weights_bytes());
  const auto T = static_cast<int64_t>(f.ids.size());
  const auto a = run_chunked(*mixed, f.ids, {T}), b = run_chunked(*dense, f.ids, {T});
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
}

// transformers' layout of the same experts: one gate_up_proj [E, 2I, D] and one down_proj
// [E, D, I] a layer, with stacked scales; `up` is rows [I, 2I) of each expert's matrix.
TEST(QuantizedWeights, stacked_experts_as_transformers_saves_them) {
  const Fixture f = load_fixture("fp8_fp4");
  TempDir d;
  std::filesystem::copy_file(f.dir + "/config.json", d.path() + "/config.json");
  auto ck = model::Checkpoint::open(f.dir);
  std::vector<model::TensorToWrite> out;
  std::map<std::string, std::vector<uint8_t>> stacked;  // name -> bytes, in expert order
  std::map<std::string, std::pair<DType, std::vector<int64_t>>> meta;
  int experts = 0;
  for (const auto& [name, v] : ck.tensors()) {
    const auto at = name.find(".ffn.experts.");
    if (at == std::string::npos) {
      out.push_back({name, v.dtype, v.shape, v.data});
      continue;
    }
    experts = std::max(experts, std::stoi(name.substr(at + 13)) + 1);
  }
  ASSERT_GT(experts, 0);
  for (int layer = 0;; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".ffn.experts.";
    if (ck.tensors().count(p + "0.w1.weight") == 0) break;
    const std::string q = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    for (int e = 0; e < experts; ++e) {
      const std::string x = p + std::to_string(e) + ".";
      for (const auto& [to, parts] : std::vector<std::pair<std::string, std::vector<std::string>>>{
               {"gate_up_proj", {"w1.weight", "w3.weight"}},
               {"gate_up_proj_scale_inv", {"w1.scale", "w3.scale"}},
               {"down_proj", {"w2.weight"}},
               {"down_proj_scale_inv", {"w2.scale"}}}) {
        int64_t rows = 0;
        for (const auto& part : parts) {
          const auto& v = ck.tensors().at(x + part);
          const auto* b = static_cast<const uint8_t*>(v.data);
          auto& bytes = stacked[q + to];
          bytes.insert(bytes.end(), b, b + v.bytes);
          rows += v.shape[0];
          meta[q + to] = {v.dtype, {experts, rows, v.shape[1]}};
        }
      }
    }
  }
  for (const auto& [name, bytes] : stacked) out.push_back({name, meta[name].first, meta[name].second, bytes.data()});
  model::write_safetensors(d.path() + "/model.safetensors", out);
  expect_quantized_same_as_dequantized(d.path(), f);
}

}  // namespace
}  // namespace troupe::testing
