// SPDX-License-Identifier: Apache-2.0
#include <cstdio>
#include <exception>

#include "commands.hpp"
#include "dte/config.hpp"
#include "dte/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"dte: sparse BF16 weight sync for RL, from the optimizer's own state"};
  app.set_version_flag("--version", std::string("dte ") + dte::version_string);
  app.require_subcommand(1);
  int status = dte::tool::exit_ok;
  dte::tool::register_audit_inverse(app, status);
  dte::tool::register_plan(app, status);
  dte::tool::register_simulate(app, status);
  dte::tool::register_bench(app, status);
  dte::tool::register_storage(app, status);
  dte::tool::register_verify_start(app, status);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : dte::tool::exit_bad_input;
  } catch (const dte::error& e) {
    std::fprintf(stderr, "dte: error: %s\n", e.what());
    return dte::tool::exit_bad_input;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dte: unexpected error: %s\n", e.what());
    return dte::tool::exit_bad_input;
  }
  return status;
}
