// SPDX-License-Identifier: Apache-2.0
// The first-publication check: at the start of an RL run the trainer's weights ARE the
// checkpoint the run started from, so the canonical BF16 values of dte's first full publication
// must equal that Hugging Face checkpoint, tensor by tensor. Any layout mistake (vocabulary
// padding, expert split, a QKV order, a wrong config) shows up here before a single delta is
// served, including the ones no digest can catch (sender and receivers sharing the wrong map).
//
// The checkpoint is a directory with model.safetensors.index.json (weight_map: tensor -> file)
// and its shards, or a single model.safetensors. Tensors may be BF16 (compared bit for bit) or
// F32 (rounded to BF16 first, as the trainer's first publication rounds its FP32 weights). Shards
// are read one at a time; file names from the index must be plain names inside the directory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/error.hpp"
#include "dte/io/file.hpp"
#include "dte/io/json.hpp"
#include "dte/io/safetensors.hpp"
#include "dte/layout/hf.hpp"
#include "dte/numeric/round.hpp"

namespace dte::io {

struct StartMismatch {
  std::int64_t index = 0;  // flat index in the HF tensor
  std::vector<std::int64_t> coords;
  std::uint16_t checkpoint = 0, published = 0;  // BF16 bits
};

struct StartReport {
  std::int64_t tensors = 0, elements = 0, mismatched_elements = 0;
  std::string first_tensor;  // the first tensor found to differ (shard by shard); empty if none
  std::int64_t first_tensor_mismatches = 0;
  std::vector<StartMismatch> examples;  // up to 5, in the first differing tensor
  std::vector<std::string> problems;    // missing/extra tensors, shapes, dtypes
  [[nodiscard]] bool ok() const noexcept { return problems.empty() && mismatched_elements == 0; }
  // One paragraph for the user: what differs, where, and what it likely means.
  [[nodiscard]] std::string describe() const {
    if (ok()) {
      return "the first publication equals the checkpoint: " + std::to_string(tensors) +
             " tensors, " + std::to_string(elements) + " elements, bit for bit";
    }
    std::string s;
    for (const std::string& p : problems)
      s += p + "; ";
    if (mismatched_elements > 0) {
      s += std::to_string(mismatched_elements) + " elements differ, first in " + first_tensor +
           " (" + std::to_string(first_tensor_mismatches) + " there), e.g.";
      for (const StartMismatch& e : examples) {
        s += " [";
        for (std::size_t i = 0; i < e.coords.size(); ++i)
          s += (i ? ", " : "") + std::to_string(e.coords[i]);
        s += "] checkpoint " + std::to_string(bf16_to_float(e.checkpoint)) + " published " +
             std::to_string(bf16_to_float(e.published)) + ";";
      }
      s += " the trainer's layout is not the one dte was given (vocabulary padding, expert "
           "split, pipeline split, TP), or the run did not start from this checkpoint";
    }
    return s;
  }
};

// tensor -> file of an HF checkpoint directory (the index, or the single model.safetensors).
inline std::map<std::string, std::string> hf_checkpoint_files(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  const std::filesystem::path index = dir / "model.safetensors.index.json";
  if (std::filesystem::exists(index)) {
    const nlohmann::json j =
        read_json_file(index, "checkpoint index", 16, std::uintmax_t{64} << 20);
    const JsonReader r(index.string());
    const nlohmann::json& map = r.object(j, "weight_map", "");
    for (const auto& [name, file] : map.items()) {
      if (!file.is_string() || !plain_file_name(file.get<std::string>())) {
        r.fail("weight_map." + name, "is not a plain file name inside the checkpoint directory");
      }
      out.emplace(name, file.get<std::string>());
    }
    return out;
  }
  const std::filesystem::path single = dir / "model.safetensors";
  if (!std::filesystem::exists(single)) {
    throw io_error(dir.string() + ": neither model.safetensors.index.json nor model.safetensors; " +
                   "give the directory of a Hugging Face safetensors checkpoint");
  }
  const SafetensorsFile f = SafetensorsFile::read(single);
  for (const TensorInfo& t : f.tensors())
    out.emplace(t.name, "model.safetensors");
  return out;
}

// Compares the checkpoint in `dir` with the canonical BF16 values dte publishes: published(t,
// out) fills out (hf[t].numel() elements) with tensor t's BF16 bits as the first full
// publication carries them.
inline StartReport verify_start(
    const layout::HfModel& hf, const std::filesystem::path& dir,
    const std::function<void(std::int64_t, std::span<std::uint16_t>)>& published) {
  StartReport rep;
  const std::map<std::string, std::string> files = hf_checkpoint_files(dir);
  std::map<std::string, std::vector<std::int64_t>> by_file;  // file -> canonical tensor ids
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    const auto it = files.find(hf.name(t));
    if (it == files.end()) {
      rep.problems.push_back("the checkpoint has no tensor " + hf.name(t));
      continue;
    }
    by_file[it->second].push_back(t);
  }
  std::set<std::string> names;
  for (std::int64_t t = 0; t < hf.size(); ++t)
    names.insert(hf.name(t));
  for (const auto& [name, file] : files) {
    if (!names.count(name)) {
      rep.problems.push_back("the checkpoint has tensor " + name + ", which the model (" +
                             hf.spec().structure() + ") does not" +
                             (name == "lm_head.weight" ? " (is tie_word_embeddings right?)" : ""));
    }
  }
  std::vector<std::uint16_t> mine;
  for (const auto& [file, ids] : by_file) {
    const SafetensorsFile f = SafetensorsFile::read(dir / file);
    for (std::int64_t t : ids) {
      const TensorInfo& info = f.at(hf.name(t));
      const std::vector<std::int64_t> have(info.shape.begin(), info.shape.end());
      if (have != hf.shape(t)) {
        rep.problems.push_back(hf.name(t) + " has shape " + layout::shape_text(have) +
                               " in the checkpoint");
        continue;
      }
      std::vector<std::uint16_t> theirs;
      if (info.dtype == DType::BF16) {
        theirs = f.read_as<std::uint16_t>(info.name, DType::BF16);
      } else if (info.dtype == DType::F32) {
        const std::vector<float> x = f.read_as<float>(info.name);
        theirs.resize(x.size());
        std::transform(x.begin(), x.end(), theirs.begin(), [](float v) { return round_bf16(v); });
      } else {
        rep.problems.push_back(hf.name(t) + " is " + std::string(dtype_name(info.dtype)) +
                               " in the checkpoint; dte compares BF16 or F32 checkpoints");
        continue;
      }
      mine.assign(theirs.size(), 0);
      published(t, mine);
      ++rep.tensors;
      rep.elements += static_cast<std::int64_t>(theirs.size());
      std::int64_t bad = 0;
      for (std::size_t i = 0; i < theirs.size(); ++i) {
        if (theirs[i] == mine[i]) continue;
        ++bad;
        if (rep.first_tensor.empty() || rep.first_tensor == hf.name(t)) {
          if (rep.examples.size() < 5) {
            StartMismatch e{static_cast<std::int64_t>(i), {}, theirs[i], mine[i]};
            const std::int64_t cols = hf[t].cols;
            e.coords = cols == 0 ? std::vector<std::int64_t>{e.index}
                                 : std::vector<std::int64_t>{e.index / cols, e.index % cols};
            rep.examples.push_back(e);
          }
        }
      }
      if (bad > 0 && rep.first_tensor.empty()) {
        rep.first_tensor = hf.name(t);
        rep.first_tensor_mismatches = bad;
      }
      rep.mismatched_elements += bad;
    }
  }
  return rep;
}

}  // namespace dte::io
