// What the node says to its proxies (internal to actors/node).
#pragma once

#include <caf/all.hpp>

namespace troupe::actors::node {

using proxy_retry_atom = caf::atom_constant<caf::atom("pxretry")>;  // send what backpressure held back
using proxy_reply_atom = caf::atom_constant<caf::atom("pxreply")>;  // (corr, result message or error text): a Call's Reply
using proxy_quit_atom = caf::atom_constant<caf::atom("pxquit")>;    // (reason): the remote actor or its process is gone
using node_call_atom = caf::atom_constant<caf::atom("nodecall")>;   // (peer, corr, target, request): run a remote Call here

}  // namespace troupe::actors::node
