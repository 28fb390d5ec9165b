// Reading a topology manifest (YAML, docs/manifest.md) into a Topology.
// Every problem becomes a Diagnostic that names the file, the line and column,
// and the field (`nodes[1].actors[2]`); parsing goes on after an error so one
// run reports them all. A Topology is returned only when there are none.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "deploy/topology.hpp"

namespace troupe::deploy {

struct Diagnostic {
  std::string file;
  int line = 0;    // 1-based; 0 when the problem has no place (e.g. an unreadable file)
  int column = 0;  // 1-based
  std::string field;    // path of the field: "policies.scale[0].max_workers"; empty for syntax errors
  std::string message;  // one sentence a user can act on
  // "file:line:col: field: message"
  std::string to_string() const;
};

struct ParsedManifest {
  std::optional<Topology> topology;  // set iff errors is empty
  std::vector<Diagnostic> errors;
  bool ok() const { return errors.empty(); }
  // Every diagnostic, one per line.
  std::string report() const;
};

// Every field of the format as a path ("policies.scale[].cooldown_s"), for
// documentation and its test.
std::vector<std::string> manifest_fields();

// Parses and validates manifest text; `source_name` names it in diagnostics.
ParsedManifest parse_manifest(std::string_view yaml_text, std::string source_name);
// Reads and parses a file; an unreadable file is a diagnostic too.
ParsedManifest load_manifest(const std::string& path);
// For callers that must stop on a bad manifest (`troupe run`): throws
// troupe::Error(invalid_file) whose message lists every diagnostic.
Topology load_manifest_or_throw(const std::string& path);

}  // namespace troupe::deploy
