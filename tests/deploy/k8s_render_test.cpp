// Topology -> Kubernetes objects: the shape the deploy issue asks for, read
// back with a YAML parser. (Schema validity: k8s_objects_test.py.)
#include "deploy/k8s_render.hpp"

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <map>

#include "deploy/manifest.hpp"
#include "tests/deploy/test_util.hpp"

namespace troupe::deploy {
namespace {

struct Rendered {
  Topology topology;
  std::vector<K8sObject> objects;
  std::map<std::string, YAML::Node> by_id;  // "Kind/name"
  YAML::Node get(const std::string& id) const {
    auto it = by_id.find(id);
    EXPECT_NE(it, by_id.end()) << id << " was not rendered";
    return it == by_id.end() ? YAML::Node() : it->second;
  }
};

Rendered render_example(const std::string& name) {
  Rendered r{load_manifest_or_throw(test::source("deploy/examples/" + name)), {}, {}};
  r.objects = render_k8s(r.topology);
  for (const auto& o : r.objects) r.by_id[o.kind + "/" + o.name] = YAML::Load(o.yaml);
  return r;
}

YAML::Node container(const YAML::Node& workload) { return workload["spec"]["template"]["spec"]["containers"][0]; }

std::string env_value(const YAML::Node& c, const std::string& name) {
  for (const auto& e : c["env"]) {
    if (e["name"].as<std::string>() == name) return e["value"] ? e["value"].as<std::string>() : "<fieldRef>";
  }
  return "<absent>";
}

TEST(DeployRender, disaggregated_example_has_a_statefulset_per_node_and_its_services) {
  auto r = render_example("disaggregated-1p1d.yaml");
  std::vector<std::string> ids;
  for (auto& o : r.objects) ids.push_back(o.kind + "/" + o.name);
  EXPECT_EQ(ids, (std::vector<std::string>{
                     "ConfigMap/troupe-manifest", "Service/troupe-front", "Service/troupe-prefill",
                     "Service/troupe-decode", "Service/troupe", "StatefulSet/troupe-front", "StatefulSet/troupe-prefill",
                     "StatefulSet/troupe-decode", "PodDisruptionBudget/troupe-front",
                     "PodDisruptionBudget/troupe-prefill", "PodDisruptionBudget/troupe-decode",
                     "NetworkPolicy/troupe-peers", "NetworkPolicy/troupe-gateway"}));
  auto sts = r.get("StatefulSet/troupe-decode");
  EXPECT_EQ(sts["spec"]["serviceName"].as<std::string>(), "troupe-decode");
  EXPECT_EQ(sts["spec"]["podManagementPolicy"].as<std::string>(), "Parallel");
  auto pod = sts["spec"]["template"]["spec"];
  EXPECT_EQ(pod["terminationGracePeriodSeconds"].as<int>(), 315);  // drain 300 s + 15
  EXPECT_TRUE(pod["securityContext"]["runAsNonRoot"].as<bool>());
  EXPECT_EQ(pod["securityContext"]["runAsUser"].as<int>(), 10001);
  auto c = container(sts);
  EXPECT_TRUE(c["securityContext"]["readOnlyRootFilesystem"].as<bool>());
  EXPECT_FALSE(c["securityContext"]["allowPrivilegeEscalation"].as<bool>());
  std::vector<std::string> cmd;
  for (auto a : c["command"]) cmd.push_back(a.as<std::string>());
  EXPECT_EQ(cmd, (std::vector<std::string>{"troupe", "run", "--manifest", "/etc/troupe/manifest.yaml", "--node",
                                            "$(NODE_NAME)"}));
  EXPECT_EQ(env_value(c, "NODE_NAME"), "decode-$(POD_INDEX)");
  EXPECT_EQ(env_value(c, "POD_INDEX"), "<fieldRef>");
  EXPECT_EQ(env_value(c, "TROUPE_DISCOVERY"), "kubernetes");
  EXPECT_EQ(env_value(c, "UCX_TCP_PORT_RANGE"), "7401-7463");
  EXPECT_EQ(c["resources"]["limits"]["nvidia.com/gpu"].as<int>(), 1);
  EXPECT_EQ(c["resources"]["requests"]["memory"].as<std::string>(), "128Gi");
  EXPECT_EQ(c["readinessProbe"]["httpGet"]["path"].as<std::string>(), "/health");
  EXPECT_EQ(c["livenessProbe"]["httpGet"]["path"].as<std::string>(), "/health/live");
  bool model_mounted = false;
  for (auto m : c["volumeMounts"]) {
    if (m["name"].as<std::string>() == "model") {
      model_mounted = m["mountPath"].as<std::string>() == "/models" && m["readOnly"].as<bool>();
    }
  }
  EXPECT_TRUE(model_mounted);
  // Front: no GPU, runs the gateway.
  auto front = container(r.get("StatefulSet/troupe-front"));
  EXPECT_FALSE(front["resources"]["limits"]["nvidia.com/gpu"]);
  EXPECT_EQ(r.get("StatefulSet/troupe-front")["spec"]["template"]["metadata"]["labels"]["troupe.dev/gateway"].as<std::string>(),
            "true");

  auto headless = r.get("Service/troupe-decode")["spec"];
  EXPECT_EQ(headless["clusterIP"].as<std::string>(), "None");
  EXPECT_TRUE(headless["publishNotReadyAddresses"].as<bool>());
  auto gateway = r.get("Service/troupe")["spec"];
  EXPECT_EQ(gateway["selector"]["troupe.dev/gateway"].as<std::string>(), "true");
  EXPECT_EQ(gateway["ports"][0]["targetPort"].as<std::string>(), "http");

  auto pdb = r.get("PodDisruptionBudget/troupe-decode")["spec"];
  EXPECT_EQ(pdb["maxUnavailable"].as<int>(), 1);

  // ConfigMap: the manifest exactly as written.
  EXPECT_EQ(r.get("ConfigMap/troupe-manifest")["data"]["manifest.yaml"].as<std::string>(), r.topology.source_text);
}

TEST(DeployRender, network_policies_admit_the_gateway_port_from_anywhere_and_transport_between_pods) {
  auto r = render_example("disaggregated-1p1d.yaml");
  auto gw = r.get("NetworkPolicy/troupe-gateway")["spec"];
  EXPECT_EQ(gw["podSelector"]["matchLabels"]["troupe.dev/gateway"].as<std::string>(), "true");
  ASSERT_EQ(gw["ingress"].size(), 1u);
  EXPECT_FALSE(gw["ingress"][0]["from"]);  // any source
  ASSERT_EQ(gw["ingress"][0]["ports"].size(), 1u);
  EXPECT_EQ(gw["ingress"][0]["ports"][0]["port"].as<int>(), 8000);
  auto peers = r.get("NetworkPolicy/troupe-peers")["spec"];
  EXPECT_EQ(peers["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"].as<std::string>(),
            "troupe");
  auto ports = peers["ingress"][0]["ports"];
  ASSERT_EQ(ports.size(), 2u);
  EXPECT_EQ(ports[0]["port"].as<int>(), 7400);
  EXPECT_EQ(ports[1]["port"].as<int>(), 7401);
  EXPECT_EQ(ports[1]["endPort"].as<int>(), 7463);
}

TEST(DeployRender, elastic_example_has_a_gateway_deployment_and_scale_rbac) {
  auto r = render_example("elastic.yaml");
  auto dep = r.get("Deployment/elastic-gateway");
  EXPECT_EQ(dep["metadata"]["namespace"].as<std::string>(), "troupe-elastic");
  EXPECT_EQ(dep["spec"]["replicas"].as<int>(), 2);
  EXPECT_EQ(env_value(container(dep), "NODE_NAME"), "gateway");
  // The gateways take their API key from the Secret; other pods do not see it.
  bool keyed = false;
  for (const auto& e : container(dep)["env"]) {
    if (e["name"].as<std::string>() != "TROUPE_API_KEY") continue;
    keyed = true;
    EXPECT_EQ(e["valueFrom"]["secretKeyRef"]["name"].as<std::string>(), "troupe-api-key");
    EXPECT_EQ(e["valueFrom"]["secretKeyRef"]["key"].as<std::string>(), "api-key");
  }
  EXPECT_TRUE(keyed);
  EXPECT_EQ(env_value(container(r.get("StatefulSet/elastic-decode")), "TROUPE_API_KEY"), "<absent>");
  EXPECT_EQ(r.by_id.count("Service/elastic-gateway"), 0u);  // no headless Service: nothing dials a gateway
  EXPECT_EQ(r.get("Service/elastic")["spec"]["type"].as<std::string>(), "LoadBalancer");
  auto role = r.get("Role/elastic-supervisor");
  std::vector<std::string> scaled;
  for (auto n : role["rules"][0]["resourceNames"]) scaled.push_back(n.as<std::string>());
  EXPECT_EQ(scaled, (std::vector<std::string>{"elastic-prefill", "elastic-decode"}));
  EXPECT_EQ(role["rules"][0]["resources"][0].as<std::string>(), "statefulsets/scale");
  auto router = r.get("StatefulSet/elastic-router")["spec"]["template"]["spec"];
  EXPECT_EQ(router["serviceAccountName"].as<std::string>(), "elastic-supervisor");
  EXPECT_TRUE(router["automountServiceAccountToken"].as<bool>());
  auto decode = r.get("StatefulSet/elastic-decode")["spec"];
  EXPECT_EQ(decode["replicas"].as<int>(), 2);
  EXPECT_FALSE(decode["template"]["spec"]["automountServiceAccountToken"].as<bool>());
  EXPECT_EQ(r.get("RoleBinding/elastic-supervisor")["subjects"][0]["namespace"].as<std::string>(), "troupe-elastic");
}

TEST(DeployRender, strings_that_look_like_numbers_or_bools_stay_strings) {
  auto r = render_example("colocated.yaml");
  for (const auto& o : r.objects) {
    if (o.kind == "StatefulSet") {
      EXPECT_NE(o.yaml.find("troupe.dev/gateway: \"true\""), std::string::npos);
      EXPECT_NE(o.yaml.find("cpu: \"2\""), std::string::npos);
    }
  }
}

TEST(DeployRender, stream_and_kustomization_list_every_object) {
  auto r = render_example("three-host.yaml");
  const std::string stream = to_yaml_stream(r.objects);
  EXPECT_EQ(YAML::LoadAll(stream).size(), r.objects.size());
  const std::string k = kustomization(r.objects);
  for (const auto& o : r.objects) EXPECT_NE(k.find("- " + o.file_name() + "\n"), std::string::npos) << o.file_name();
  EXPECT_EQ(r.objects[0].file_name(), "configmap-three-host-manifest.yaml");
}

}  // namespace
}  // namespace troupe::deploy
