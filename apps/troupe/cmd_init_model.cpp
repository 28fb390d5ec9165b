// troupe init-model --preset tiny|flash-shaped --out DIR [--seed N] [--dtype f32|bf16] [--quantize fp8|fp4]
#include "apps/troupe/commands.hpp"
#include "model/init.hpp"

namespace troupe::app {

Command add_init_model(CLI::App& app) {
  struct Opts {
    model::InitOptions init;
    std::string out, dtype = "f32";
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("init-model", "write a random-weight DeepSeek-V4 model (deterministic)");
  cmd->add_option("--preset", o->init.preset, "tiny or flash-shaped")->check(CLI::IsMember({"tiny", "flash-shaped"}));
  cmd->add_option("--out", o->out, "output directory")->required();
  cmd->add_option("--seed", o->init.seed, "random seed");
  cmd->add_option("--dtype", o->dtype, "f32 or bf16 matrices")->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--quantize", o->init.quantize,
                  "fp8: linear layers in FP8 e4m3 with 128 x 128 block scales (DeepSeek's V4 checkpoints); fp4: also "
                  "the routed experts in FP4 e2m1 with a scale per 32 inputs")
      ->check(CLI::IsMember({"fp8", "fp4"}));
  cmd->add_option("--layers", o->init.layers, "number of layers (types cycle the preset's)");
  cmd->add_option("--layer-types", o->init.layer_types, "layer types, e.g. csa,hca,sliding (sets the layer count)")
      ->delimiter(',');
  cmd->add_option("--experts", o->init.experts, "number of routed experts");
  cmd->add_option("--vocab", o->init.vocab, "vocabulary size");
  return [o] {
    o->init.dtype = o->dtype == "bf16" ? DType::bf16 : DType::f32;
    model::init_model(o->out, o->init);
    return 0;
  };
}

}  // namespace troupe::app
