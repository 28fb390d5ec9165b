// troupe plan --model DIR --memory 80GiB [--mix 4K:0.7,32K:0.25,128K:0.05] [--cache-share 0.2]
//             [--ratios window=0.05,csa_entry=0.6,...] [--page-tokens N] [--slab-bytes 64MiB]
// Prints the device pool sizes the memory planner picks (cache/planner.hpp).
// Only config.json is read: no weights are needed.
#include <filesystem>
#include <iostream>
#include <sstream>

#include "apps/troupe/commands.hpp"
#include "base/error.hpp"
#include "cache/planner.hpp"
#include "model/config.hpp"

namespace troupe::app {
namespace {

std::string with_k(int64_t tokens) {
  if (tokens >= 1024 * 1024 && tokens % (1024 * 1024) == 0) return fmt::format("{}M", tokens / (1024 * 1024));
  if (tokens >= 1024 && tokens % 1024 == 0) return fmt::format("{}K", tokens / 1024);
  return std::to_string(tokens);
}

}  // namespace

Command add_plan(CLI::App& app) {
  struct Opts {
    std::string model, memory, mix, ratios, slab;
    double cache_share = 0.0;
    int64_t page_tokens = 0;
    bool markdown = false;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("plan", "size the KV cache pools for a model and a memory budget");
  cmd->add_option("--model", o->model, "model directory or config.json (only the config is read)")->required();
  cmd->add_option("--memory", o->memory, "device bytes for the pools, e.g. 80GiB")->required();
  cmd->add_option("--mix", o->mix, "expected context lengths TOKENS[:WEIGHT],... (default 4K:0.7,32K:0.25,128K:0.05)");
  cmd->add_option("--cache-share", o->cache_share, "share of the pools kept for cached prefixes, [0, 1)");
  cmd->add_option("--ratios", o->ratios, "explicit shares per pool instead of a mix, e.g. window=0.1,csa_entry=0.6");
  cmd->add_option("--page-tokens", o->page_tokens, "tokens per page (default: sliding_window rounded to the rates)");
  cmd->add_option("--slab-bytes", o->slab, "slab size, e.g. 64MiB (default: four of the largest pages)");
  cmd->add_flag("--markdown", o->markdown, "one markdown table row per pool");
  return [o] {
    namespace fs = std::filesystem;
    const std::string path = fs::is_directory(o->model) ? (fs::path(o->model) / "config.json").string() : o->model;
    if (!fs::exists(path)) raise(ErrorCode::not_found, "{} does not exist", path);
    const auto config = model::load_config(path);
    const auto g = cache::CacheGeometry::of(config, o->page_tokens);
    cache::PlanInput in;
    in.bytes = cache::parse_bytes(o->memory);
    in.cache_share = o->cache_share;
    if (!o->slab.empty()) in.slab_bytes = static_cast<size_t>(cache::parse_bytes(o->slab));
    if (!o->ratios.empty()) in.ratios = cache::parse_ratios(o->ratios);
    if (!o->ratios.empty() && o->mix.empty()) {
      // Ratios alone: the plan still reports one sequence's reach.
    } else {
      in.mix = cache::parse_mix(o->mix.empty() ? cache::kDefaultMix : o->mix);
    }
    const auto plan = cache::plan_pools(g, in);

    int counts[3] = {0, 0, 0};
    for (const auto& s : g.shapes) ++counts[static_cast<int>(s.type)];
    if (!o->markdown) {
      std::cout << fmt::format("model: {} ({} layers: {} sliding, {} CSA rate {}, {} HCA rate {}; window {})\n", path,
                               g.layers, counts[0], counts[1], g.csa_rate, counts[2], g.hca_rate, g.window);
      std::cout << fmt::format("pages: {} tokens; state rows fp32; budget {} in {} slabs of {}\n", g.page_tokens,
                               cache::format_bytes(static_cast<double>(in.bytes)), plan.slabs,
                               cache::format_bytes(static_cast<double>(plan.slab_bytes)));
      std::cout << fmt::format("{:<10} {:>11} {:>10} {:>11} {:>7} {:>13}\n", "pool", "page bytes", "pages", "bytes",
                               "share", "per sequence");
    }
    for (auto k : cache::kAllPools) {
      const auto& p = plan.pools[static_cast<size_t>(cache::index(k))];
      if (p.page_bytes == 0) continue;
      const double share = 100.0 * static_cast<double>(p.bytes) / static_cast<double>(in.bytes);
      if (o->markdown) {
        std::cout << fmt::format("| {} | {} | {} | {} | {:.1f}% | {:.1f} |\n", cache::to_string(k),
                                 cache::format_bytes(static_cast<double>(p.page_bytes)), p.pages,
                                 cache::format_bytes(static_cast<double>(p.bytes)), share, p.per_sequence);
      } else {
        std::cout << fmt::format("{:<10} {:>11} {:>10} {:>11} {:>6.1f}% {:>13.1f}\n", cache::to_string(k), p.page_bytes,
                                 p.pages, cache::format_bytes(static_cast<double>(p.bytes)), share, p.per_sequence);
      }
    }
    if (o->markdown) return 0;
    if (!in.mix.empty()) {
      std::string mix;
      for (const auto& s : in.mix) mix += fmt::format("{}{}:{:g}", mix.empty() ? "" : ",", with_k(s.tokens), s.weight);
      std::cout << fmt::format("mix {}: mean context {:.0f} tokens, {} per sequence -> {} sequences at once\n", mix,
                               plan.mean_context, cache::format_bytes(plan.bytes_per_sequence),
                               static_cast<int64_t>(plan.sequences));
    }
    std::cout << fmt::format("entry state {:.0f} bytes per token; one sequence alone reaches {} tokens\n",
                             plan.entry_bytes_per_token, plan.max_context);
    std::cout << "pools start at these sizes; empty slabs move between pools as demand shifts\n";
    return 0;
  };
}

}  // namespace troupe::app
