// SPDX-License-Identifier: Apache-2.0
// The distributed-optimizer buffer layout as a trainer dumps it, so dte does not have to trust a
// hard-coded parameter order. JSON, one entry per trainer rank:
//
// {"format": "dte.buffer_layout/1",
//  "ranks": [{"rank": 0,
//             "buffers": {"dense":  {"size": N, "params": [{"name": "...", "shape": [r, c],
//                                                            "start": s}, ...],
//                                    "owned": [[begin, end], ...]},
//                         "expert": {...}}}, ...]}
//
// name: the Megatron local parameter name (a leading "module." is ignored, any number of
// times); start: its first element in the flat buffer; owned: the buffer ranges this rank's
// optimizer shard holds, in shard order (Megatron: one per bucket, from param_index_map and
// the bucket's DP slice). write_buffer_layout() produces the same format from dte's own model
// of Megatron, which is the easiest way to diff a real trainer's dump against it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/bounds.hpp"
#include "dte/error.hpp"
#include "dte/io/json.hpp"
#include "dte/layout/plan.hpp"
#include "dte/layout/shape_check.hpp"

namespace dte::io {

inline constexpr const char* buffer_layout_format = "dte.buffer_layout/1";

inline nlohmann::json write_buffer_layout(const layout::HfModel& hf,
                                          const layout::TrainTopology& t) {
  nlohmann::json ranks = nlohmann::json::array();
  for (std::int64_t g = 0; g < t.world(); ++g) {
    const layout::TrainRank r = layout::train_rank(t, g);
    const auto params = layout::megatron_params(hf.spec(), t, r);
    const layout::RankBuffers b = layout::megatron_rank_buffers(params, t, r);
    nlohmann::json buffers;
    for (int k = 0; k < 2; ++k) {
      nlohmann::json ps = nlohmann::json::array();
      for (const layout::BufferParam& bp : b.layout[k].params) {
        const auto& p = params[static_cast<std::size_t>(bp.param)];
        ps.push_back({{"name", p.name()}, {"shape", p.shape()}, {"start", bp.start}});
      }
      nlohmann::json owned = nlohmann::json::array();
      for (const layout::Bucket& s : b.owned[k])
        owned.push_back({s.start, s.end});
      buffers[k == 0 ? "dense" : "expert"] = {
          {"size", b.layout[k].size()}, {"params", ps}, {"owned", owned}};
    }
    ranks.push_back({{"rank", g}, {"buffers", buffers}});
  }
  return {{"format", buffer_layout_format}, {"ranks", ranks}};
}

// Reads and checks a dumped layout against the model and topology: every parameter of every
// rank exactly once, in the right buffer, with its shape, without overlaps, inside the buffer;
// owned ranges inside the buffer and disjoint. (That DP ranks' slices tile each buffer is then
// shown by layout::check_coverage.) Every number is an integer within dte/bounds.hpp's limits;
// every refusal names the file and the field's path. Returns one RankBuffers per trainer rank.
inline std::vector<layout::RankBuffers> read_buffer_layout(const nlohmann::json& j,
                                                           const layout::HfModel& hf,
                                                           const layout::TrainTopology& t,
                                                           const std::string& source) {
  const JsonReader r(source);
  auto fail = [&](const std::string& what) {
    throw invalid_argument(source + ": " + what, about(source));
  };
  if (!j.is_object() || !j.contains("format") || !j.at("format").is_string() ||
      j.at("format").get<std::string>() != buffer_layout_format) {
    throw format_error(
        source + ": not a buffer layout: expected \"format\": \"" + buffer_layout_format + "\"",
        about(source, "format"));
  }
  const auto& ranks = r.array(j, "ranks", "", static_cast<std::size_t>(limits::world));
  if (static_cast<std::int64_t>(ranks.size()) != t.world()) {
    fail("has " + std::to_string(ranks.size()) + " ranks but the trainer topology has " +
         std::to_string(t.world()));
  }
  std::vector<layout::RankBuffers> out(static_cast<std::size_t>(t.world()));
  std::vector<bool> seen(out.size(), false);
  for (std::size_t e = 0; e < ranks.size(); ++e) {
    const nlohmann::json& entry = ranks[e];
    const std::string at = "ranks[" + std::to_string(e) + "]";
    const std::int64_t g = r.integer(entry, "rank", at, 0, t.world() - 1);
    if (seen[static_cast<std::size_t>(g)]) fail("rank " + std::to_string(g) + " is listed twice");
    seen[static_cast<std::size_t>(g)] = true;
    const std::string where = "rank " + std::to_string(g);
    const auto params = layout::megatron_params(hf.spec(), t, layout::train_rank(t, g));
    std::map<std::string, std::int64_t> by_name;
    for (std::size_t i = 0; i < params.size(); ++i) {
      by_name[params[i].name()] = static_cast<std::int64_t>(i);
    }
    std::vector<bool> placed(params.size(), false);
    layout::RankBuffers& rb = out[static_cast<std::size_t>(g)];
    const nlohmann::json& buffers = r.object(entry, "buffers", at);
    for (int k = 0; k < 2; ++k) {
      const char* kind = k == 0 ? "dense" : "expert";
      if (!buffers.contains(kind)) continue;
      const std::string bat = at + ".buffers." + kind;
      const nlohmann::json& b = r.object(buffers, kind, at + ".buffers");
      const std::int64_t size = r.integer(b, "size", bat, 0, limits::buffer_elements);
      layout::BufferLayout& bl = rb.layout[k];
      const nlohmann::json& ps = r.array(b, "params", bat, params.size());
      for (std::size_t pi = 0; pi < ps.size(); ++pi) {
        const nlohmann::json& p = ps[pi];
        const std::string pat = bat + ".params[" + std::to_string(pi) + "]";
        std::string name = r.string(p, "name", pat);
        while (name.rfind("module.", 0) == 0)
          name.erase(0, 7);
        const auto it = by_name.find(name);
        if (it == by_name.end()) {
          fail(where + ": parameter " + detail::quote_name(name) +
               " is not one dte expects on this rank (" + std::to_string(params.size()) +
               " expected; check --model and --train)");
        }
        const layout::MegatronParam& mp = params[static_cast<std::size_t>(it->second)];
        if (mp.is_expert() != (k == 1)) {
          fail(where + ": parameter '" + name + "' is in the " + kind + " buffer but is " +
               (mp.is_expert() ? "an expert" : "a dense") + " parameter");
        }
        const nlohmann::json& shape = r.array(p, "shape", pat, 8);
        std::vector<std::int64_t> dims;
        for (std::size_t d = 0; d < shape.size(); ++d) {
          dims.push_back(r.integer(shape[d], pat + ".shape[" + std::to_string(d) + "]", 0,
                                   limits::tensor_elements));
        }
        if (dims != mp.shape()) {
          const std::string cause =
              layout::likely_cause(hf.spec(), t, [&](const layout::TrainTopology& alt) {
                for (const auto& q :
                     layout::megatron_params(hf.spec(), alt, layout::train_rank(alt, g)))
                  if (q.name() == name) return q.shape() == dims;
                return false;
              });
          fail(where + ": parameter '" + name + "' has shape " + detail::shown(shape) +
               " but dte's plan for --train says " + nlohmann::json(mp.shape()).dump() +
               (cause.empty() ? std::string() : "; likely cause: " + cause));
        }
        if (placed[static_cast<std::size_t>(it->second)]) {
          fail(where + ": parameter '" + name + "' is listed twice");
        }
        placed[static_cast<std::size_t>(it->second)] = true;
        // start + numel <= size, written so that it cannot overflow: size - numel first.
        const std::int64_t start = r.integer(p, "start", pat, 0, limits::buffer_elements);
        if (mp.numel() > size || start > size - mp.numel()) {
          fail(where + ": parameter '" + name + "' [" + std::to_string(start) + ", " +
               std::to_string(start + mp.numel()) + ") lies outside the " + kind + " buffer of " +
               std::to_string(size) + " elements");
        }
        bl.params.push_back({it->second, start, mp.numel()});
      }
      std::vector<layout::BufferParam> sorted = bl.params;
      std::sort(sorted.begin(), sorted.end(),
                [](const auto& a, const auto& b2) { return a.start < b2.start; });
      for (std::size_t i = 1; i < sorted.size(); ++i) {
        if (sorted[i].start < sorted[i - 1].start + sorted[i - 1].numel) {
          fail(where + ": parameters '" +
               params[static_cast<std::size_t>(sorted[i - 1].param)].name() + "' and '" +
               params[static_cast<std::size_t>(sorted[i].param)].name() + "' overlap in the " +
               kind + " buffer");
        }
      }
      bl.buckets = {{0, size}};
      std::vector<layout::Bucket> owned;
      const nlohmann::json& ranges =
          r.array(b, "owned", bat, static_cast<std::size_t>(std::max<std::int64_t>(size, 1)));
      for (std::size_t oi = 0; oi < ranges.size(); ++oi) {
        const std::string oat = bat + ".owned[" + std::to_string(oi) + "]";
        r.check_array(ranges[oi], oat, 2);
        if (ranges[oi].size() != 2) {
          fail(where + ": owned range " + detail::shown(ranges[oi]) +
               " is not [begin, end] inside the " + kind + " buffer of " + std::to_string(size) +
               " elements");
        }
        const std::int64_t begin = r.integer(ranges[oi][0], oat + "[0]", 0, size);
        const std::int64_t end = r.integer(ranges[oi][1], oat + "[1]", begin, size);
        owned.push_back({begin, end});
      }
      std::vector<layout::Bucket> check = owned;
      std::sort(check.begin(), check.end(),
                [](const auto& a, const auto& b2) { return a.start < b2.start; });
      for (std::size_t i = 1; i < check.size(); ++i) {
        if (check[i].start < check[i - 1].end)
          fail(where + ": owned ranges overlap in the " + std::string(kind) + " buffer");
      }
      rb.owned[k] = owned;
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!placed[i]) fail(where + ": parameter '" + params[i].name() + "' is missing");
    }
  }
  return out;
}

// A buffer layout file: 1 GiB holds the layout of any world dte plans.
inline std::vector<layout::RankBuffers> read_buffer_layout_file(const std::filesystem::path& path,
                                                                const layout::HfModel& hf,
                                                                const layout::TrainTopology& t) {
  return read_buffer_layout(read_json_file(path, "buffer layout", 16, std::uintmax_t{1} << 30), hf,
                            t, path.string());
}

}  // namespace dte::io
