// The second pass of the manifest reader (deploy/manifest.cpp): checks a
// Topology whose fields each read cleanly against each other; reports through
// `r` at the remembered positions. Derives the disaggregation groups when the
// manifest did not give them. Internal to deploy/.
#pragma once

#include "deploy/topology.hpp"
#include "deploy/yaml_fields.hpp"

namespace troupe::deploy::detail {

void check_topology(Reader& r, Topology& t, bool disaggregation_given);

}  // namespace troupe::deploy::detail
