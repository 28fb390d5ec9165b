// Topology -> Kubernetes objects (docs/deploy.md says what each is for).
// Per node (a role): a StatefulSet (stable pod names and DNS; a Deployment
// only for gateway-only nodes), a headless Service for peer discovery and a
// PodDisruptionBudget. Once: the gateway Service, the ConfigMap with the
// manifest, two NetworkPolicies (gateway port from anywhere to gateway pods;
// transport ports between the topology's pods), and, when a scale policy
// exists, the ServiceAccount/Role/RoleBinding the supervisor scales with.
#pragma once

#include <string>
#include <vector>

#include "deploy/topology.hpp"

namespace troupe::deploy {

struct K8sObject {
  std::string kind;  // "StatefulSet"
  std::string name;  // metadata.name
  std::string yaml;  // one YAML document, without the leading "---"
  // "statefulset-<name>.yaml": the file `render --out DIR` writes it to.
  std::string file_name() const;
};

// The objects for a valid topology, in apply order (config and RBAC first).
std::vector<K8sObject> render_k8s(const Topology& topology);
// All objects as one multi-document YAML stream.
std::string to_yaml_stream(const std::vector<K8sObject>& objects);
// A kustomization.yaml listing the objects' files.
std::string kustomization(const std::vector<K8sObject>& objects);

// Constants the pods and the docs share.
inline constexpr const char* kManifestMountDir = "/etc/troupe";
inline constexpr const char* kManifestFile = "/etc/troupe/manifest.yaml";
inline constexpr const char* kCacheDir = "/var/cache/troupe";
inline constexpr const char* kReadinessPath = "/health";
inline constexpr const char* kLivenessPath = "/health/live";
inline constexpr int64_t kRunAsUser = 10001;

}  // namespace troupe::deploy
