// troupe: serve DeepSeek-V4-class models as a graph of actors.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <iostream>
#include <map>

#include "apps/troupe/commands.hpp"
#include "base/check.hpp"
#include "base/error.hpp"
#include "kernels/cpu/cpu_backend.hpp"

int main(int argc, char** argv) {
  troupe::kernels::cpu::ensure_blas_kernels(argv);
  CLI::App app{"troupe: a DeepSeek-V4 serving runtime"};
  app.require_subcommand(1);
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  spdlog::set_default_logger(spdlog::stderr_color_mt("troupe"));
  std::map<CLI::App*, troupe::app::Command> commands;
  auto reg = [&](auto add) {
    size_t before = app.get_subcommands({}).size();
    auto run = add(app);
    commands[app.get_subcommands({})[before]] = std::move(run);
  };
  reg(troupe::app::add_forward);
  reg(troupe::app::add_generate);
  reg(troupe::app::add_init_model);
  reg(troupe::app::add_deploy);
  reg(troupe::app::add_tokenize);
  reg(troupe::app::add_plan);
  reg(troupe::app::add_serve);
  reg(troupe::app::add_run);
  reg(troupe::app::add_client);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto* sub : app.get_subcommands()) return commands.at(sub)();
  } catch (const troupe::Error& e) {
    std::cerr << "troupe: error: " << e.what() << "\n";
    return 1;
  } catch (const troupe::InvariantError& e) {
    std::cerr << "troupe: internal error: " << e.what() << "\n";
    return 70;
  } catch (const std::bad_alloc&) {
    std::cerr << "troupe: error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {  // a library's own exception: still one line, not an abort
    std::cerr << "troupe: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
