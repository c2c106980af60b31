// SPDX-License-Identifier: Apache-2.0
// The subcommands of the `dte` command. Each registers itself on the CLI11 app and returns the
// process exit status through a callback.
#pragma once

#include <CLI/CLI.hpp>

namespace dte::tool {

// Exit statuses shared by every subcommand.
inline constexpr int exit_ok = 0;
inline constexpr int exit_check_failed = 1;  // ran fine, and found a problem (e.g. a miss)
inline constexpr int exit_bad_input = 2;     // refused its input: message on stderr

void register_audit_inverse(CLI::App& app, int& status);
void register_plan(CLI::App& app, int& status);
void register_simulate(CLI::App& app, int& status);
void register_bench(CLI::App& app, int& status);
void register_bench_compare(CLI::App& bench, int& status);  // with storage: `dte bench compare`
void register_storage(CLI::App& app, int& status);          // inspect, verify
void register_verify_start(CLI::App& app, int& status);

}  // namespace dte::tool
