// Manifests -> Topology: every example is valid and says what it means; every
// bad manifest is rejected with the line, column and field of its problem.
#include "deploy/manifest.hpp"

#include <gtest/gtest.h>

#include <cstdlib>

#include "base/error.hpp"
#include "tests/deploy/test_util.hpp"

namespace troupe::deploy {
namespace {

using test::expectation;
using test::files_in;
using test::source;

std::vector<std::string> names(const std::vector<Instance>& v) {
  std::vector<std::string> out;
  for (auto& i : v) out.push_back(i.name);
  return out;
}

const char* kMinimal = R"(version: 1
name: mini
model: {path: embedded}
discovery: kubernetes
nodes:
  - name: serve
    actors: [gateway, router, prefill, decode, cache_shard]
)";

TEST(DeployManifest, every_example_is_valid) {
  auto examples = files_in("deploy/examples");
  ASSERT_GE(examples.size(), 4u);
  for (const auto& f : examples) {
    auto parsed = load_manifest(f);
    EXPECT_TRUE(parsed.ok()) << f << ":\n" << parsed.report();
    ASSERT_TRUE(parsed.topology.has_value());
    EXPECT_EQ(parsed.topology->source_text, test::read_text(f));
  }
}

TEST(DeployManifest, three_host_example_is_three_static_processes) {
  auto t = load_manifest_or_throw(source("deploy/examples/three-host.yaml"));
  EXPECT_EQ(t.name, "three-host");
  EXPECT_TRUE(t.model.embedded());
  EXPECT_EQ(t.discovery, Discovery::static_addresses);
  EXPECT_EQ(names(t.instances()), (std::vector<std::string>{"front-0", "prefill-0", "decode-0"}));
  auto decode = t.find_instance("decode");
  ASSERT_TRUE(decode);
  EXPECT_EQ(decode->name, "decode-0");
  EXPECT_EQ(t.transport_endpoint(*decode, Discovery::static_addresses).to_string(), "10.77.0.3:7400");
  EXPECT_EQ(t.required_peers(*decode), (std::vector<std::string>{"front-0"}));
  EXPECT_EQ(t.required_peers(*t.find_instance("front-0")), (std::vector<std::string>{"prefill-0", "decode-0"}));
  EXPECT_EQ(t.policies.disaggregation.prefill, (std::vector<std::string>{"prefill"}));
  EXPECT_EQ(t.policies.disaggregation.handoff_transport, HandoffTransport::tcp);
  EXPECT_DOUBLE_EQ(t.policies.disaggregation.handoff_timeout_s, 10);
  ASSERT_TRUE(t.policies.long_tail);
  EXPECT_DOUBLE_EQ(t.policies.long_tail->resume_threshold, 0.6);
  EXPECT_EQ(t.ports.transport_range.first, 7401);
  EXPECT_EQ(t.ports.transport_range.last, 7431);
  EXPECT_EQ(t.pools.host_tier, 512ull << 20);
  EXPECT_EQ(t.pools.memory_budget.bytes, 1ull << 30);
  // The same manifest on Kubernetes: pods behind headless Services.
  EXPECT_EQ(t.transport_endpoint(*decode, Discovery::kubernetes, "ns").to_string(),
            "three-host-decode-0.three-host-decode.ns.svc.cluster.local:7400");
}

TEST(DeployManifest, elastic_example_has_scale_slots_and_a_gateway_deployment) {
  auto t = load_manifest_or_throw(source("deploy/examples/elastic.yaml"));
  const Node* decode = t.find_node("decode");
  ASSERT_NE(decode, nullptr);
  EXPECT_EQ(decode->replicas, 2);
  EXPECT_EQ(decode->devices, 8);
  EXPECT_EQ(t.slots(*decode), 8);
  EXPECT_TRUE(t.find_instance("decode-7"));
  EXPECT_FALSE(t.find_instance("decode-8"));
  EXPECT_FALSE(t.find_instance("decode"));  // several slots: the ordinal is required
  auto gw = t.find_instance("gateway");
  ASSERT_TRUE(gw);
  EXPECT_EQ(gw->ordinal, -1);
  EXPECT_EQ(gw->node->workload, Workload::deployment);
  ASSERT_NE(t.scale_rule("decode"), nullptr);
  EXPECT_EQ(t.scale_rule("decode")->min_workers, 2);
  EXPECT_DOUBLE_EQ(t.scale_rule("decode")->cooldown_s, 180);
  EXPECT_EQ(t.scale_rule("prefill")->outstanding_handoffs_high, 32);
  // The router waits for min_workers of each scaled node, not for max.
  EXPECT_EQ(t.required_peers(*t.find_instance("router")),
            (std::vector<std::string>{"prefill-0", "decode-0", "decode-1"}));
  ASSERT_TRUE(t.pools.ratios);
  EXPECT_DOUBLE_EQ(t.pools.ratios->csa_entries, 0.45);
  EXPECT_DOUBLE_EQ(t.pools.memory_budget.fraction, 0.88);
  EXPECT_EQ(t.pools.memory_budget.bytes, 0u);
  EXPECT_EQ(t.kubernetes.namespace_name, "troupe-elastic");
  EXPECT_EQ(t.kubernetes.model_claim, "deepseek-v4-flash");
  EXPECT_EQ(t.termination_grace_s(), 615);
  EXPECT_EQ(t.transport_endpoint(*t.find_instance("decode-3"), Discovery::kubernetes, "ignored").host,
            "elastic-decode-3.elastic-decode.troupe-elastic.svc.cluster.local");
}

TEST(DeployManifest, colocated_example_derives_its_disaggregation_groups) {
  auto t = load_manifest_or_throw(source("deploy/examples/colocated.yaml"));
  EXPECT_TRUE(t.policies.disaggregation.derived);
  EXPECT_EQ(t.policies.disaggregation.prefill, (std::vector<std::string>{"serve"}));
  EXPECT_EQ(t.policies.disaggregation.decode, (std::vector<std::string>{"serve"}));
  EXPECT_TRUE(t.required_peers(*t.find_instance("serve")).empty());
}

TEST(DeployManifest, defaults_apply_to_a_minimal_manifest) {
  auto p = parse_manifest(kMinimal, "mini.yaml");
  ASSERT_TRUE(p.ok()) << p.report();
  const Topology& t = *p.topology;
  EXPECT_EQ(t.ports.http, 8000);
  EXPECT_EQ(t.ports.transport, 7400);
  EXPECT_EQ(t.nodes[0].ports.http, 8000);
  EXPECT_EQ(t.policies.restart.max_restarts, 3);
  EXPECT_DOUBLE_EQ(t.policies.restart.window_s, 60);
  EXPECT_FALSE(t.policies.long_tail);
  EXPECT_TRUE(t.policies.scale.empty());
  EXPECT_DOUBLE_EQ(t.drain.timeout_s, 120);
  EXPECT_EQ(t.termination_grace_s(), 135);
  EXPECT_DOUBLE_EQ(t.pools.memory_budget.fraction, 0.9);
  EXPECT_EQ(t.kubernetes.image, "troupe:0.1.0");
  EXPECT_EQ(t.nodes[0].source.line, 6);
  EXPECT_EQ(t.nodes[0].source.column, 5);
}

TEST(DeployManifest, bad_manifests_report_the_line_column_and_field) {
  auto bad = files_in("tests/deploy/bad");
  ASSERT_GE(bad.size(), 10u);
  for (const auto& f : bad) {
    const std::string want = expectation(f);
    ASSERT_FALSE(want.empty()) << f << " has no '# expect: ' first line";
    auto p = load_manifest(f);
    EXPECT_FALSE(p.ok()) << f;
    EXPECT_FALSE(p.topology.has_value()) << f;
    EXPECT_NE(p.report().find(f + ":" + want), std::string::npos) << f << "\nwant: " << want << "\ngot:\n"
                                                                   << p.report();
  }
}

TEST(DeployManifest, every_field_error_is_reported_not_just_the_first) {
  auto p = parse_manifest(R"(name: Bad_Name
model: {path: embedded}
discovery: dns
ports: {http: 70000}
nodes:
  - name: serve
    actors: [gateway, router, prefill, decode, cache_shard]
    devices: -1
)",
                          "many.yaml");
  ASSERT_EQ(p.errors.size(), 4u) << p.report();
  EXPECT_EQ(p.errors[0].to_string().substr(0, 21), "many.yaml:1:7: name: ");
  EXPECT_EQ(p.errors[1].field, "discovery");
  EXPECT_EQ(p.errors[1].line, 3);
  EXPECT_EQ(p.errors[2].field, "ports.http");
  EXPECT_NE(p.errors[2].message.find("70000 is out of range [1, 65535]"), std::string::npos);
  EXPECT_EQ(p.errors[3].field, "nodes[0].devices");
  EXPECT_EQ(p.errors[3].line, 8);
}

TEST(DeployManifest, numbers_past_a_double_are_out_of_range_not_an_exception) {
  const std::string big(400, '9');
  const auto p = parse_manifest("version: 1\nname: n\nmodel: {path: embedded}\ndrain: {timeout_s: 1e999}\n"
                                "pools: {memory_budget: 1GiB, host_tier: " + big + "}\n"
                                "nodes:\n  - name: a\n    actors: [gateway, router, decode]\n",
                                "n.yaml");
  ASSERT_GE(p.errors.size(), 2u);
  std::string all;
  for (const auto& e : p.errors) all += e.message + "\n";
  EXPECT_NE(all.find("1e999 is out of range"), std::string::npos) << all;
  EXPECT_NE(all.find("is not a size"), std::string::npos) << all;
}

TEST(DeployManifest, memory_budget_is_a_size_or_a_fraction) {
  auto with_budget = [](const std::string& b) {
    std::string text = kMinimal;
    text += "pools: {memory_budget: " + b + "}\n";
    return parse_manifest(text, "b.yaml");
  };
  EXPECT_EQ(with_budget("40GiB").topology->pools.memory_budget.bytes, 40ull << 30);
  EXPECT_EQ(with_budget("512MB").topology->pools.memory_budget.bytes, 512000000ull);
  EXPECT_DOUBLE_EQ(with_budget("0.5").topology->pools.memory_budget.fraction, 0.5);
  auto two = with_budget("2");
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.report().find("pools.memory_budget: 2 is neither a fraction"), std::string::npos) << two.report();
  EXPECT_FALSE(with_budget("lots").ok());
}

TEST(DeployManifest, cross_field_rules) {
  auto check = [](const std::string& extra, const std::string& want) {
    auto p = parse_manifest(std::string(kMinimal) + extra, "x.yaml");
    EXPECT_NE(p.report().find(want), std::string::npos) << "want: " << want << "\ngot:\n" << p.report();
  };
  check("pools: {context_mix: [{prompt_tokens: 10, output_tokens: 5, share: 0.5}]}\n", "shares sum to 0.5, not 1");
  check("pools: {ratios: {swa: 0.5, csa_entries: 0.6}}\n", "ratios sum to 1.1, not 1");
  check("policies: {long_tail: {pressure_threshold: 0.9}}\n",
        "decode node 'serve' runs no offload");
  check("policies: {scale: [{node: serve, max_workers: 2}]}\n", "runs the router, which never scales");
  check("policies: {scale: [{node: serve, min_workers: 3, max_workers: 2}]}\n", "min_workers 3 is above max_workers 2");
  check("kubernetes: {gateway_service: {type: Ingress}}\n",
        "kubernetes.gateway_service.type: 'Ingress' is not one of: ClusterIP, NodePort, LoadBalancer");
}

TEST(DeployManifest, slots_of_a_node_on_one_host_get_their_own_http_ports) {
  auto p = parse_manifest(R"(version: 1
name: one-host
model: {path: embedded}
discovery: static
nodes:
  - {name: front, actors: [gateway, router], address: 127.0.0.1:7400, ports: {transport_range: 7600-7610}}
  - name: decode
    actors: [prefill, decode, cache_shard]
    address: [127.0.0.1:7410, 127.0.0.1:7411, 127.0.0.2:7410]
    ports: {http: 7420, transport_range: 7501-7520}
policies:
  scale: [{node: decode, max_workers: 3}]
)",
                          "x.yaml");
  ASSERT_TRUE(p.ok()) << p.report();
  const auto& t = *p.topology;
  EXPECT_EQ(t.http_port(*t.find_instance("decode-0")), 7420);
  EXPECT_EQ(t.http_port(*t.find_instance("decode-1")), 7421);  // the second slot on 127.0.0.1
  EXPECT_EQ(t.http_port(*t.find_instance("decode-2")), 7420);  // the first on 127.0.0.2
  EXPECT_EQ(t.http_port(*t.find_instance("front")), 8000);
}

TEST(DeployManifest, embedded_model_needs_no_model_volume_path) {
  auto p = parse_manifest(std::string(kMinimal) + "kubernetes: {model_volume: {claim: weights}}\n", "x.yaml");
  EXPECT_TRUE(p.ok()) << p.report();
  auto q = parse_manifest(std::string(kMinimal).replace(std::string(kMinimal).find("embedded"), 8, "/data/m") +
                              "kubernetes: {model_volume: {claim: weights, mount: /models}}\n",
                          "y.yaml");
  EXPECT_NE(q.report().find("y.yaml:3:15: model.path: '/data/m' is not under kubernetes.model_volume.mount '/models'"),
            std::string::npos)
      << q.report();
}

TEST(DeployManifest, unreadable_file_is_a_diagnostic) {
  auto p = load_manifest("/nonexistent/manifest.yaml");
  ASSERT_EQ(p.errors.size(), 1u);
  EXPECT_EQ(p.errors[0].to_string(),
            "/nonexistent/manifest.yaml: cannot read the manifest (no such file, or not readable)");
}

TEST(DeployManifest, load_or_throw_lists_every_error) {
  try {
    load_manifest_or_throw(source("tests/deploy/bad/duplicate_node.yaml"));
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_file);
    EXPECT_NE(std::string(e.what()).find("the manifest has 2 errors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("duplicate_node.yaml:14:11: nodes[2].name"), std::string::npos) << e.what();
  }
}

TEST(DeployManifest, discovery_environment_overrides_the_manifest) {
  auto t = load_manifest_or_throw(source("deploy/examples/three-host.yaml"));
  ::unsetenv("TROUPE_DISCOVERY");
  EXPECT_EQ(effective_discovery(t), Discovery::static_addresses);
  ::setenv("TROUPE_DISCOVERY", "kubernetes", 1);
  EXPECT_EQ(effective_discovery(t), Discovery::kubernetes);
  ::unsetenv("TROUPE_DISCOVERY");
}

}  // namespace
}  // namespace troupe::deploy

namespace troupe::deploy {
namespace {

TEST(DeployManifest, docs_manifest_md_documents_every_field) {
  std::string docs = test::read_text(test::source("docs/manifest.md"));
  for (size_t p; (p = docs.find("[]")) != std::string::npos;) docs.erase(p, 2);
  auto fields = manifest_fields();
  EXPECT_GT(fields.size(), 50u);
  for (std::string f : fields) {
    // Documented as `leaf` in its section's table, or by a longer dotted
    // path (`gateway_service.type`, `drain.timeout_s`).
    for (size_t p; (p = f.find("[]")) != std::string::npos;) f.erase(p, 2);
    bool found = false;
    for (size_t dot = f.size(); !found;) {
      dot = dot == 0 ? std::string::npos : f.rfind('.', dot - 1);
      const std::string suffix = dot == std::string::npos ? f : f.substr(dot + 1);
      found = docs.find("`" + suffix + "`") != std::string::npos;
      if (dot == std::string::npos) break;
    }
    EXPECT_TRUE(found) << f << " is not in docs/manifest.md";
  }
  for (auto a : kAllActorKinds) EXPECT_NE(docs.find(std::string("`") + to_string(a) + "`"), std::string::npos);
}

}  // namespace
}  // namespace troupe::deploy
