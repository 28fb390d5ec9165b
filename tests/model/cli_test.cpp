// `troupe forward`: the CLI contract and a clear one-line error for every bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "model/safetensors.hpp"
#include "tests/model/fixtures.hpp"
#include "tests/support/process.hpp"

namespace troupe::testing {
namespace {

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

// A bad input: non-zero exit, one line on stderr naming the problem.
void expect_error(const CommandResult& r, const std::string& phrase) {
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("troupe: error:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(phrase), std::string::npos) << "stderr was: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

class ForwardCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    auto r = run_command(troupe_binary() + " init-model --preset tiny --vocab 512 --layers 2 --out " + model());
    ASSERT_EQ(r.status, 0) << r.err;
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string model() { return dir_->path() + "/tiny"; }
  static std::string forward(const std::string& model_dir, const std::string& ids, const std::string& extra = "") {
    return troupe_binary() + " forward --model " + model_dir + " --ids " + ids + " --out " + dir_->path() +
           "/out.npy " + extra;
  }
  static TempDir* dir_;
};
TempDir* ForwardCli::dir_ = nullptr;

TEST_F(ForwardCli, writes_logits_rows_equal_to_transformers) {
  const Fixture f = load_fixture("yarn_hc3");
  const int64_t p = f.meta.at("prefill").get<int64_t>();
  auto r = run_command(forward(f.dir, join(f.ids), "--prefill " + std::to_string(p)));
  ASSERT_EQ(r.status, 0) << r.err;
  auto got = read_npy(dir_->path() + "/out.npy");
  ASSERT_EQ(got.descr, "<f4");
  ASSERT_EQ(got.shape, (std::vector<int64_t>{static_cast<int64_t>(f.ids.size()), f.vocab}));
  auto v = got.as_f32();
  EXPECT_LE(max_abs_diff(v.data(), f.logits.data(), v.size()), 1e-3);
}

TEST_F(ForwardCli, missing_model_directory) {
  expect_error(run_command(forward("/nonexistent/model", "1,2,3")), "does not exist");
}

TEST_F(ForwardCli, truncated_safetensors) {
  TempDir d;
  std::filesystem::copy(model(), d.path(), std::filesystem::copy_options::recursive);
  const auto file = d.path() + "/model.safetensors";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
  expect_error(run_command(forward(d.path(), "1,2,3")), "truncated");
}

TEST_F(ForwardCli, tensor_with_the_wrong_shape) {
  TempDir d;
  std::filesystem::copy(model(), d.path(), std::filesystem::copy_options::recursive);
  auto cfg = nlohmann::json::parse(read_text_file(d.path() + "/config.json"));
  cfg["q_lora_rank"] = 96;  // the checkpoint holds 128
  std::ofstream(d.path() + "/config.json") << cfg.dump();
  expect_error(run_command(forward(d.path(), "1,2,3")), "q_a_proj.weight' has shape [128, 256], expected [96, 256]");
}

TEST_F(ForwardCli, token_id_beyond_the_vocabulary) {
  expect_error(run_command(forward(model(), "1,2,512")), "token id 512 is out of range for a vocabulary of 512");
}

TEST_F(ForwardCli, prefill_larger_than_the_ids) {
  expect_error(run_command(forward(model(), "1,2,3", "--prefill 4")), "--prefill 4 is larger than the 3 ids given");
}

TEST_F(ForwardCli, bf16_weights_on_the_cpu_backend) {
  expect_error(run_command(forward(model(), "1,2", "--weights bf16")), "--weights bf16 needs --backend cuda");
  EXPECT_EQ(run_command(forward(model(), "1,2", "--weights f32")).status, 0);
}

TEST_F(ForwardCli, malformed_ids) {
  expect_error(run_command(forward(model(), "1,x,3")), "'x' is not a token id");
}

TEST_F(ForwardCli, unknown_and_missing_config_fields) {
  TempDir d;
  std::filesystem::copy(model(), d.path(), std::filesystem::copy_options::recursive);
  auto cfg = nlohmann::json::parse(read_text_file(d.path() + "/config.json"));
  auto bad = cfg;
  bad["attention_temperature"] = 2.0;
  std::ofstream(d.path() + "/config.json") << bad.dump();
  expect_error(run_command(forward(d.path(), "1,2")), "field 'attention_temperature' is unknown");
  bad = cfg;
  bad.erase("sliding_window");
  std::ofstream(d.path() + "/config.json") << bad.dump();
  expect_error(run_command(forward(d.path(), "1,2")), "field 'sliding_window' is missing");
}

TEST_F(ForwardCli, missing_shard_listed_in_the_index) {
  TempDir d;
  std::filesystem::copy(fixtures_dir() + "/hf_names_sharded", d.path(), std::filesystem::copy_options::recursive);
  std::filesystem::remove(d.path() + "/model-00003-of-00010.safetensors");
  expect_error(run_command(forward(d.path(), "1,2")), "model-00003-of-00010.safetensors listed in the index is missing");
}

// `troupe generate`: the serving engine (paged pools, chunked prefill, prefix cache) from the CLI.
// The corners fixture has a window of 2 tokens, shorter than its CSA ring of 8 (the engine keeps the
// ring's window pages too).
TEST_F(ForwardCli, generate_runs_the_engine_and_its_prompt_rows_match_transformers) {
  const Fixture f = load_fixture("corners");
  const int64_t p = f.meta.at("prefill").get<int64_t>();
  const std::vector<int32_t> prompt(f.ids.begin(), f.ids.begin() + p);
  const std::string out = dir_->path() + "/gen.npy";
  auto r = run_command(troupe_binary() + " generate --model " + f.dir + " --ids " + join(prompt) +
                       " --max-tokens 5 --ignore-eos --repeat 2 --max-chunk 7 --step-tokens 16 --out " + out);
  ASSERT_EQ(r.status, 0) << r.err;
  // two lines of five ids, the same: the second run starts from the prefix cache
  const auto nl = r.out.find('\n');
  ASSERT_NE(nl, std::string::npos);
  EXPECT_EQ(r.out.substr(0, nl + 1), r.out.substr(nl + 1)) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.begin() + static_cast<long>(nl), ','), 4) << r.out;
  const auto rows = read_npy(out);
  ASSERT_EQ(rows.shape.at(0), p + 4);
  const auto got = rows.as_f32();
  EXPECT_LE(max_abs_diff(got.data(), f.logits.data(), static_cast<size_t>(p * f.vocab)), 1e-3);
  expect_error(run_command(troupe_binary() + " generate --model " + f.dir + " --ids 1,999"),
               "token id 999 is out of range for a vocabulary of 256");
}

// init-model --quantize: DeepSeek's FP8 layout (e4m3, 128 x 128 power-of-two block scales) and FP4
// routed experts; troupe's logits hold the same bits whether it keeps the codes (the default) or
// dequantizes them as they load (--weights f32), and stay near the unquantized twin drawn from the
// same normals. (Against transformers' dequantizing load: 4.3e-6 / 4.8e-6 on the tiny preset, measured
// with the oracle venv when this landed; CI has no transformers.)
TEST_F(ForwardCli, init_model_quantized_checkpoints) {
  const std::string ids = "5,17,300,9,100,42,7,7,7,123,4,99,201,11";
  auto base = run_command(forward(model(), ids));
  ASSERT_EQ(base.status, 0) << base.err;
  const auto twin = read_npy(dir_->path() + "/out.npy").as_f32();
  for (const std::string q : {"fp8", "fp4"}) {
    SCOPED_TRACE(q);
    const std::string d = dir_->path() + "/tiny-" + q;
    auto r = run_command(troupe_binary() + " init-model --preset tiny --vocab 512 --layers 2 --quantize " + q +
                         " --out " + d);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto cfg = nlohmann::json::parse(read_text_file(d + "/config.json"));
    EXPECT_EQ(cfg.at("quantization_config").at("weight_block_size"), nlohmann::json::array({128, 128}));
    EXPECT_EQ(cfg.at("expert_dtype"), q == "fp4" ? "fp4" : "fp8");
    const auto ck = model::Checkpoint::open(d);
    EXPECT_EQ(ck.tensors().at("model.layers.0.self_attn.q_a_proj.weight").dtype, DType::f8_e4m3);
    EXPECT_EQ(ck.tensors().at("model.layers.1.ffn.experts.3.w2.weight").dtype, q == "fp4" ? DType::i8 : DType::f8_e4m3);
    auto kept = run_command(forward(d, ids));
    ASSERT_EQ(kept.status, 0) << kept.err;
    const auto a = read_npy(dir_->path() + "/out.npy").as_f32();
    auto dense = run_command(forward(d, ids, "--weights f32"));
    ASSERT_EQ(dense.status, 0) << dense.err;
    const auto b = read_npy(dir_->path() + "/out.npy").as_f32();
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
    ASSERT_EQ(a.size(), twin.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += std::pow(a[i] - twin[i], 2);
      den += std::pow(twin[i], 2);
    }
    const double rel = std::sqrt(num / den);
    std::cout << "[ quantize ] " << q << ": relative L2 distance from the unquantized twin " << rel << "\n";
    EXPECT_GT(rel, 0.0);
    EXPECT_LT(rel, q == "fp4" ? 0.5 : 0.2);
  }
  auto bad = run_command(troupe_binary() + " init-model --preset tiny --quantize int4 --out " + dir_->path() + "/x");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("--quantize: int4 not in {fp8,fp4}"), std::string::npos) << bad.err;
}

// The FP8 / FP4 checkpoint (tests/fixtures/model/fp8_fp4, as DeepSeek ships V4) with one file or
// field broken: each an error that names the tensor or the field.
class QuantizedCheckpoint : public ForwardCli {
 protected:
  void SetUp() override {
    std::filesystem::copy(fixtures_dir() + "/fp8_fp4", d_.path(), std::filesystem::copy_options::recursive);
    cfg_ = nlohmann::json::parse(read_text_file(d_.path() + "/config.json"));
  }
  void write_config(const nlohmann::json& c) { std::ofstream(d_.path() + "/config.json") << c.dump(); }
  TempDir d_;
  nlohmann::json cfg_;
};

TEST_F(QuantizedCheckpoint, loads_and_matches_transformers_dequantizing_load) {
  const Fixture f = load_fixture("fp8_fp4");
  auto r = run_command(forward(d_.path(), join(f.ids), "--prefill 45"));
  ASSERT_EQ(r.status, 0) << r.err;
  auto got = read_npy(dir_->path() + "/out.npy").as_f32();
  ASSERT_EQ(got.size(), f.logits.size());
  EXPECT_LE(max_abs_diff(got.data(), f.logits.data(), got.size()), 1e-3);
}

TEST_F(QuantizedCheckpoint, fp8_tensors_without_a_quantization_config) {
  cfg_.erase("quantization_config");
  cfg_.erase("expert_dtype");
  write_config(cfg_);
  expect_error(run_command(forward(d_.path(), "1,2")), "is F8_E4M3 but config.json has no quantization_config");
}

TEST_F(QuantizedCheckpoint, other_quantization_methods_and_settings) {
  auto c = cfg_;
  c["quantization_config"]["quant_method"] = "awq";
  write_config(c);
  expect_error(run_command(forward(d_.path(), "1,2")), "quantization_config.quant_method' is 'awq'");
  c = cfg_;
  c["quantization_config"]["activation_scheme"] = "static";
  write_config(c);
  expect_error(run_command(forward(d_.path(), "1,2")), "activation_scheme' is \"static\"");
  c = cfg_;
  c["quantization_config"]["weight_block_size"] = {16, 64};
  write_config(c);
  expect_error(run_command(forward(d_.path(), "1,2")), "blocks of 16 x 64");
  c = cfg_;
  c["expert_dtype"] = "int4";
  write_config(c);
  expect_error(run_command(forward(d_.path(), "1,2")), "field 'expert_dtype' is 'int4'");
}

TEST_F(QuantizedCheckpoint, weight_without_its_scale) {
  {
    auto ck = model::Checkpoint::open(d_.path());
    std::vector<model::TensorToWrite> keep;
    for (const auto& [name, v] : ck.tensors()) {
      if (name == "model.layers.1.attn.wq_a.scale") continue;
      keep.push_back({name, v.dtype, v.shape, v.data});
    }
    model::write_safetensors(dir_->path() + "/rewritten.safetensors", keep);
  }
  std::filesystem::rename(dir_->path() + "/rewritten.safetensors", d_.path() + "/model.safetensors");
  expect_error(run_command(forward(d_.path(), "1,2")), "wq_a.weight' is F8_E4M3 but has no scale tensor");
}

}  // namespace
}  // namespace troupe::testing
