// Each subcommand of `troupe` registers itself on the CLI and returns the
// function that runs it (exit status).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace troupe::app {

using Command = std::function<int()>;

Command add_forward(CLI::App& app);
Command add_generate(CLI::App& app);
Command add_init_model(CLI::App& app);
Command add_deploy(CLI::App& app);
Command add_tokenize(CLI::App& app);
Command add_plan(CLI::App& app);
Command add_serve(CLI::App& app);
Command add_run(CLI::App& app);
Command add_client(CLI::App& app);

}  // namespace troupe::app
