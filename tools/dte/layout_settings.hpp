// SPDX-License-Identifier: Apache-2.0
// `--train` with `--stack` as the commands take them, and the printing of every layout-changing
// setting with whether it was given or assumed (and whose default it is): `dte plan`,
// `dte simulate` and their JSON.
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "dte/layout/model.hpp"
#include "dte/layout/stack.hpp"
#include "dte/layout/topology.hpp"

namespace dte::tool {

inline constexpr const char* stack_help =
    "whose defaults fill the layout settings --train leaves out (vocabulary padding, etp): "
    "megatron-lm (default; also slime), mbridge (also verl), megatron-bridge (also nemo-rl), "
    "areal";

inline layout::TrainTopology train_topology(const std::string& spec, const std::string& stack) {
  layout::TrainTopology t = layout::parse_train_topology(spec);
  layout::apply_stack(t, layout::parse_stack(stack));
  return t;
}

inline void print_layout_settings(const layout::ModelSpec& m, const layout::TrainTopology& t,
                                  const std::string& stack) {
  std::printf("  layout settings     stack %s\n", stack.c_str());
  for (const layout::LayoutSetting& s :
       layout::assumed_settings(m, t, layout::parse_stack(stack))) {
    std::printf("    %-28s %s (%s)\n", s.setting.c_str(), s.value.c_str(),
                s.assumed ? ("assumed: " + s.source).c_str() : "given");
  }
}

inline nlohmann::ordered_json layout_settings_json(const layout::ModelSpec& m,
                                                   const layout::TrainTopology& t,
                                                   const std::string& stack) {
  nlohmann::ordered_json out;
  out["stack"] = stack;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const layout::LayoutSetting& s :
       layout::assumed_settings(m, t, layout::parse_stack(stack))) {
    list.push_back(
        {{"setting", s.setting}, {"value", s.value}, {"assumed", s.assumed}, {"source", s.source}});
  }
  out["settings"] = list;
  return out;
}

}  // namespace dte::tool
