// The Kubernetes side of the fleet's scale decisions: the replicas of a
// node's StatefulSet through its scale subresource
//   GET   /apis/apps/v1/namespaces/NS/statefulsets/NAME/scale
//   PATCH (same, application/merge-patch+json {"spec":{"replicas":N}})
// over HTTPS, as the pod's service account (the renderer's Role grants
// exactly get/patch/update on statefulsets/scale of the scaled nodes; see
// deploy/k8s_render.cpp). Calls block: the fleet makes them on a thread of
// their own and hears the outcome as a message.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "base/error.hpp"

namespace troupe::actors {

struct KubeApiOptions {
  std::string host;  // the API server (KUBERNETES_SERVICE_HOST in a pod)
  uint16_t port = 443;
  std::string token_file = "/var/run/secrets/kubernetes.io/serviceaccount/token";  // read on every call (rotated)
  std::string ca_file = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
  std::string namespace_name;  // the StatefulSets' namespace
  std::chrono::seconds timeout{10};

  // Inside a pod: the API server from KUBERNETES_SERVICE_HOST/PORT, the
  // namespace from the service account's `namespace` file (or `fallback`).
  // None outside a pod.
  static std::optional<KubeApiOptions> in_cluster(const std::string& fallback_namespace = "");
};

class KubeScaler {
 public:
  explicit KubeScaler(KubeApiOptions options) : o_(std::move(options)) {}
  // The StatefulSet's desired replicas.
  Expected<int32_t> replicas(const std::string& statefulset) const;
  // Sets them; returns what the API server then reports.
  Expected<int32_t> set_replicas(const std::string& statefulset, int32_t replicas) const;

 private:
  KubeApiOptions o_;
};

}  // namespace troupe::actors
