// troupe deploy check  --manifest FILE [--node NAME]
// troupe deploy render --manifest FILE --target k8s [--out DIR]
// `check` validates a topology manifest and prints what it describes; every
// problem is printed as FILE:LINE:COL: FIELD: MESSAGE and the exit status is 1.
// `render` writes the Kubernetes objects of a valid manifest: to stdout as one
// YAML stream, or with --out one file per object plus a kustomization.yaml.
// Neither starts anything.
#include <filesystem>
#include <fstream>
#include <iostream>

#include "apps/troupe/commands.hpp"
#include "base/error.hpp"
#include "deploy/k8s_render.hpp"
#include "deploy/manifest.hpp"

namespace troupe::app {
namespace {

// Prints every diagnostic; returns the topology only when there are none.
std::optional<deploy::Topology> load_or_report(const std::string& path) {
  auto parsed = deploy::load_manifest(path);
  if (!parsed.ok()) {
    std::cerr << parsed.report();
    std::cerr << fmt::format("troupe: error: {}: {} error{}; nothing was started or written\n", path,
                             parsed.errors.size(), parsed.errors.size() == 1 ? "" : "s");
    return std::nullopt;
  }
  return std::move(parsed.topology);
}

std::string actor_list(const deploy::Node& n) {
  std::string out;
  for (auto a : n.actors) out += (out.empty() ? "" : ", ") + std::string(deploy::to_string(a));
  return out;
}

int run_check(const std::string& path, const std::string& node) {
  auto t = load_or_report(path);
  if (!t) return 1;
  const auto discovery = deploy::effective_discovery(*t);
  if (!node.empty()) {
    auto inst = t->find_instance(node);
    if (!inst) {
      std::cerr << fmt::format("troupe: error: {}: no node instance '{}' (instances:", path, node);
      for (auto& i : t->instances()) std::cerr << " " << i.name;
      std::cerr << ")\n";
      return 1;
    }
  }
  std::cout << fmt::format("{}: ok: topology '{}', model {}, discovery {}\n", path, t->name, t->model.path,
                           deploy::to_string(discovery));
  for (const auto& inst : t->instances()) {
    if (!node.empty() && inst.name != t->find_instance(node)->name) continue;
    const auto& n = *inst.node;
    std::string where = n.workload == deploy::Workload::deployment
                            ? std::string("deployment (no stable address)")
                            : t->transport_endpoint(inst, discovery).to_string();
    std::cout << fmt::format("  {:<12} [{}]  devices {}  http {}  transport {}\n", inst.name, actor_list(n), n.devices,
                             n.ports.http, where);
    if (!node.empty()) {
      std::string peers;
      for (auto& p : t->required_peers(inst)) peers += (peers.empty() ? "" : ", ") + p;
      std::cout << fmt::format("  ready when connected to: {}\n", peers.empty() ? "(none)" : peers);
    }
  }
  return 0;
}

int run_render(const std::string& path, const std::string& out_dir) {
  auto t = load_or_report(path);
  if (!t) return 1;
  auto objects = deploy::render_k8s(*t);
  if (out_dir.empty()) {
    std::cout << deploy::to_yaml_stream(objects);
    return 0;
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) raise(ErrorCode::invalid_argument, "--out {}: cannot create the directory: {}", out_dir, ec.message());
  auto write = [&](const std::string& name, const std::string& text) {
    const fs::path p = fs::path(out_dir) / name;
    std::ofstream f(p, std::ios::binary);
    f << text;
    if (!f) raise(ErrorCode::invalid_argument, "cannot write {}", p.string());
  };
  for (const auto& o : objects) write(o.file_name(), o.yaml);
  write("kustomization.yaml", deploy::kustomization(objects));
  std::cout << fmt::format("{}: {} objects and kustomization.yaml\n", out_dir, objects.size());
  return 0;
}

}  // namespace

Command add_deploy(CLI::App& app) {
  struct Opts {
    std::string manifest, node, target = "k8s", out;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("deploy", "check topology manifests and render them for a cluster");
  cmd->require_subcommand(1);
  auto* check = cmd->add_subcommand("check", "validate a topology manifest; exit 1 with every error");
  check->add_option("--manifest", o->manifest, "topology manifest (YAML)")->required();
  check->add_option("--node", o->node, "also check this instance (what `troupe run --node` takes)");
  auto* render = cmd->add_subcommand("render", "write the Kubernetes objects of a topology");
  render->add_option("--manifest", o->manifest, "topology manifest (YAML)")->required();
  render->add_option("--target", o->target, "k8s")->check(CLI::IsMember({"k8s"}));
  render->add_option("--out", o->out, "directory: one file per object and a kustomization.yaml (default: stdout)");
  return [o, check, render]() -> int {
    if (check->parsed()) return run_check(o->manifest, o->node);
    if (render->parsed()) return run_render(o->manifest, o->out);
    return 2;
  };
}

}  // namespace troupe::app
