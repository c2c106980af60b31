// SPDX-License-Identifier: Apache-2.0
// dte._native: the C++ side of the Python package (python/dte/__init__.py holds the torch side).
// It binds the publisher of publisher.hpp (over a rank's local pieces, on the host or, built with
// CUDA, on a device: cuda_publisher.hpp) and merge(), HfReceiver and ShardReceiver, and the
// storage adapters, over memory the Python side has checked (dtype, device, size, contiguity)
// and keeps alive: tensors arrive as addresses, so no per-tensor conversion runs in a
// publication. The GIL is released during every pass and apply. dte's exceptions become the
// dte.Error classes below.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda_publisher.hpp"
#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/fp8_grid.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "dte/publication/storage.hpp"
#include "dte/receive/fp8_core.hpp"
#include "publisher.hpp"

#if defined(DTE_PYTHON_CUDA)
#define DTE_PYTHON_CUDA_BUILT true
#else
#define DTE_PYTHON_CUDA_BUILT false
// Built without nvcc: CUDA tensors are refused by name (the Python side checks cuda_built first).
std::unique_ptr<dte::python::AnyPublisher> dte::python::make_cuda_publisher(
    const std::string&, const dte::python::PublisherArgs&, int device) {
  throw dte::unsupported("dte: the tensors are on CUDA device " + std::to_string(device) +
                         " but this dte._native was built without CUDA (nvcc was not found when "
                         "the package was built): install it again with nvcc on PATH");
}
int dte::python::cuda_devices() noexcept {
  return 0;
}
#endif

namespace nb = nanobind;
using namespace nb::literals;
using dte::publication::Bytes;

namespace {

// A model from what Python passes: a preset name, or a config.json as JSON text.
dte::layout::ModelSpec model_of(const std::string& config) {
  if (!config.empty() && config.front() == '{') {
    return dte::io::model_from_config_json(
        dte::io::parse_strict(config, "config", "model config", 64), "config");
  }
  dte::layout::ModelSpec m = dte::layout::model_preset(config);
  m.validate();
  return m;
}

nb::bytes to_python(const Bytes& b) {
  return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}
std::span<const std::byte> view(const nb::bytes& b) {
  return {reinterpret_cast<const std::byte*>(b.c_str()), b.size()};
}

template <class T>
T* address(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

nb::dict model_info(const std::string& config) {
  const dte::layout::ModelSpec spec = dte::publication::named_by_structure(model_of(config));
  const dte::layout::HfModel hf(spec);
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::int64_t> offsets;
  for (std::int64_t t = 0; t < hf.size(); ++t) {
    names.push_back(hf.name(t));
    const auto s = hf.shape(t);
    shapes.emplace_back(s.begin(), s.end());
    offsets.push_back(hf[t].base);
  }
  nb::dict d;
  d["names"] = names;
  d["shapes"] = shapes;
  d["offsets"] = offsets;
  d["total"] = hf.total();
  d["structure"] = spec.name;
  d["config"] = dte::io::config_json(spec).dump();
  return d;
}

// The receiver tensors of TP rank ts: names and shapes, in ServingLayout order.
nb::list shard_info(const std::string& config, std::int64_t tp, std::int64_t ep) {
  const dte::layout::ModelSpec spec = dte::publication::named_by_structure(model_of(config));
  const dte::layout::HfModel hf(spec);
  const dte::layout::ServingLayout l(hf, {.tp = tp, .ep = ep, .replicas = 1});
  nb::list out;
  for (std::int64_t k = 0; k < l.size(); ++k) {
    std::vector<std::int64_t> shape(l[k].shape.begin(), l[k].shape.end());
    out.append(nb::make_tuple(l.name(k), shape));
  }
  return out;
}

// An FP8-serving TP rank's tensors: (name, shape, dtype) in the order Fp8Receiver takes them:
// the tensors that stay BF16 ("bf16", ServingLayout order), then per quantized tensor its codes
// ("fp8", [out, in]) and its block scales ("f32", named as vLLM names weight_scale_inv).
nb::list fp8_info(const std::string& config, std::int64_t tp, std::int64_t ep,
                  const std::string& recipe) {
  const dte::layout::ModelSpec spec = dte::publication::named_by_structure(model_of(config));
  const dte::layout::HfModel hf(spec);
  const dte::layout::ServingLayout l(hf, {.tp = tp, .ep = ep, .replicas = 1});
  if (recipe != dte::VllmBlockFp8::name) {
    throw dte::unsupported("quantization=\"" + recipe + "\": dte covers \"" +
                           std::string(dte::VllmBlockFp8::name) + "\" (docs/fp8.md)");
  }
  const dte::layout::Fp8Grid g(l, dte::VllmBlockFp8::block_rows, dte::VllmBlockFp8::block_cols);
  nb::list out;
  for (std::int64_t k = 0; k < l.size(); ++k) {
    if (g.quantized(k)) continue;
    std::vector<std::int64_t> shape(l[k].shape.begin(), l[k].shape.end());
    out.append(nb::make_tuple(l.name(k), shape, "bf16"));
  }
  for (std::int64_t id : g.quantized_ids()) {
    const dte::layout::BlockGrid& b = g.grid(id);
    const std::string name = l.name(id);
    out.append(nb::make_tuple(name, std::vector<std::int64_t>{b.rows, b.cols}, "fp8"));
    out.append(nb::make_tuple(name + "_scale_inv",
                              std::vector<std::int64_t>{b.grid_rows, b.grid_cols}, "f32"));
  }
  return out;
}

// The recipe's rule alone, for checking it against the engine's own function: the scale of a
// block whose largest magnitude is amax, and the codes of the BF16 values `bf16` (little-endian
// bit patterns) at that scale.
nb::tuple fp8_recipe(const std::string& recipe, const nb::bytes& bf16, float amax) {
  if (recipe != dte::VllmBlockFp8::name) {
    throw dte::unsupported("fp8_recipe: no recipe \"" + recipe + "\"");
  }
  if (bf16.size() % 2 != 0) throw dte::invalid_argument("fp8_recipe: BF16 bytes of odd length");
  const float scale = dte::VllmBlockFp8::scale(amax);
  const float mult = dte::VllmBlockFp8::multiplier(scale);
  std::string codes(bf16.size() / 2, '\0');
  const auto* b = reinterpret_cast<const unsigned char*>(bf16.c_str());
  for (std::size_t k = 0; k < codes.size(); ++k) {
    const auto bits = static_cast<std::uint16_t>(b[2 * k] | (b[2 * k + 1] << 8));
    codes[k] = static_cast<char>(dte::VllmBlockFp8::code(bits, mult));
  }
  return nb::make_tuple(scale, nb::bytes(codes.data(), codes.size()));
}

// Where two configs make different models: their structure, or the first forward field on which
// they differ (io/forward_config.hpp), as "field (a_name: X, b_name: Y)"; "" when they agree.
// A preset has no forward fields: only the structure is compared then.
std::string config_difference(const std::string& a, const std::string& b, const std::string& a_name,
                              const std::string& b_name) {
  const dte::layout::ModelSpec x = model_of(a), y = model_of(b);
  if (x.structure() != y.structure()) {
    return "the structure (" + a_name + ": " + x.structure() + "; " + b_name + ": " +
           y.structure() + ")";
  }
  if (!x.forward || !y.forward) return {};
  return dte::io::forward_difference(*x.forward, *y.forward, a_name, b_name).value_or("");
}

// A config's forward fields as dte compares them (name -> JSON text); empty for a preset.
std::map<std::string, std::string> forward_fields(const std::string& config) {
  const dte::layout::ModelSpec m = model_of(config);
  return m.forward.value_or(dte::io::ForwardFields{});
}

// The model of a message (its config), for a receiver that learns it from the first one.
std::string message_config(const nb::bytes& msg) {
  const auto e = dte::publication::envelope(view(msg), "publication", "");
  return e.config.dump();
}

nb::dict report_dict(const dte::publication::ApplyReport& r) {
  nb::dict d;
  d["outcome"] = r.outcome == dte::ApplyOutcome::committed ? "committed" : "current";
  d["version"] = r.version;
  d["base"] = r.full() ? nb::none() : nb::cast(r.base);
  d["full"] = r.full();
  d["changed"] = r.written;
  d["touched"] = nb::cast(r.touched);  // receiver tensor indices (the Python side names them)
  d["bytes"] = r.bytes;
  d["seconds"] = r.seconds;
  return d;
}

nb::dict publish_dict(const dte::publication::PublishReport& r) {
  nb::dict d;
  d["version"] = r.version;
  d["base"] = r.full() ? nb::none() : nb::cast(r.base);
  d["full"] = r.full();
  d["changed"] = r.changed;
  d["scanned"] = r.scanned;
  d["guard"] = r.guard;
  d["bytes"] = r.bytes;
  d["dense_bytes"] = r.dense_bytes;
  d["fp8_codes"] = r.fp8_codes;
  d["fp8_scales"] = r.fp8_scales;
  d["digest"] = r.digest;
  d["seconds"] = r.seconds;
  return d;
}

using dte::python::Group;

// dte.TorchPublisher's native half: the publisher of python/src/publisher.hpp, on the host or
// (device >= 0) on a CUDA device (cuda_publisher.cu), with the GIL released while it works.
class PyPublisher {
 public:
  PyPublisher(const std::string& kind, const std::string& config, std::int64_t publish_every,
              int zstd_level, bool diff, std::vector<dte::python::PieceTuple> pieces,
              std::vector<std::int64_t> slot_numel, std::vector<std::int64_t> slot_group,
              bool decoupled, std::uint32_t writer, std::uint32_t writers, int device) {
    const dte::python::PublisherArgs args{.model = model_of(config),
                                          .publish_every = publish_every,
                                          .zstd_level = zstd_level,
                                          .diff = diff,
                                          .pieces = std::move(pieces),
                                          .slot_numel = std::move(slot_numel),
                                          .slot_group = std::move(slot_group),
                                          .decoupled = decoupled,
                                          .writer = writer,
                                          .writers = writers};
    p_ = device < 0 ? dte::python::make_publisher<dte::python::HostMemory>(kind, args)
                    : dte::python::make_cuda_publisher(kind, args, device);
  }

  std::optional<nb::bytes> step(const std::vector<Group>& groups,
                                const std::vector<std::uintptr_t>& theta,
                                const std::vector<std::uintptr_t>& a,
                                const std::vector<std::uintptr_t>& b,
                                const std::vector<std::int64_t>& steps, std::uintptr_t stream) {
    std::optional<Bytes> out;
    {
      nb::gil_scoped_release release;
      out = p_->step(groups, theta, a, b, steps, stream);
    }
    if (!out) return std::nullopt;
    return to_python(*out);
  }

  nb::bytes publish_full(const std::vector<std::uintptr_t>& theta, std::uintptr_t stream) {
    Bytes out;
    {
      nb::gil_scoped_release release;
      out = p_->publish_full(theta, stream);
    }
    return to_python(out);
  }

  void commit() { p_->commit(); }
  void abort() { p_->abort(); }
  void require_full() { p_->require_full(); }
  void continue_after(std::uint64_t v) { p_->continue_after(v); }
  void resync(const std::vector<std::int64_t>& steps, bool full) { p_->resync(steps, full); }
  [[nodiscard]] std::uint64_t version() const { return p_->version(); }
  [[nodiscard]] std::vector<std::uint32_t> digest() const { return p_->digest(); }
  [[nodiscard]] nb::dict last() const { return publish_dict(p_->last()); }
  void serve_fp8(const std::string& recipe, std::int64_t tp, std::int64_t ep) {
    p_->serve_fp8(recipe, {.tp = tp, .ep = ep, .replicas = 1});
  }

 private:
  std::unique_ptr<dte::python::AnyPublisher> p_;
};

// The writers' parts of one version as one message, with its digest (per canonical tensor) and
// changed elements.
nb::tuple merge(const std::string& config, const std::vector<nb::bytes>& parts) {
  std::vector<std::span<const std::byte>> views;
  for (const nb::bytes& p : parts)
    views.push_back(view(p));
  Bytes out;
  dte::storage::Manifest m;
  {
    nb::gil_scoped_release release;
    out = dte::publication::merge(model_of(config), views, &m);
  }
  return nb::make_tuple(to_python(out), m.digest, m.changed);
}

// Every writer's pieces (tensor, index, length, sender): each element sent exactly once.
void check_writers(
    const std::string& config,
    const std::vector<std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, bool>>>&
        writers) {
  const dte::layout::ModelSpec spec = dte::publication::named_by_structure(model_of(config));
  const dte::layout::HfModel hf(spec);
  std::vector<std::vector<dte::layout::LocalPiece>> w;
  for (const auto& list : writers) {
    auto& out = w.emplace_back();
    for (const auto& [tensor, index, length, sender] : list)
      out.push_back({tensor, index, length, sender});
  }
  dte::layout::check_writers(hf, w);
}

std::vector<std::span<std::uint16_t>> spans(const std::vector<std::uintptr_t>& ptrs,
                                            const std::vector<std::int64_t>& numel) {
  std::vector<std::span<std::uint16_t>> out;
  for (std::size_t k = 0; k < ptrs.size(); ++k)
    out.emplace_back(address<std::uint16_t>(ptrs[k]), static_cast<std::size_t>(numel[k]));
  return out;
}

// What both receiver kinds offer Python: apply (the GIL released), the version, the digest.
template <class R>
class PyReceiver {
 public:
  template <class... A>
  requires std::is_constructible_v<R, A...>
  explicit PyReceiver(A&&... a) : rx_(std::forward<A>(a)...) {}
  PyReceiver(const PyReceiver&) = delete;
  PyReceiver& operator=(const PyReceiver&) = delete;
  nb::dict apply(const nb::bytes& msg) {
    dte::publication::ApplyReport r;
    {
      nb::gil_scoped_release release;
      r = rx_.apply(view(msg));
    }
    return report_dict(r);
  }
  [[nodiscard]] std::optional<std::uint64_t> version() const {
    if (rx_.version() == dte::no_version) return std::nullopt;
    return rx_.version();
  }
  [[nodiscard]] std::vector<std::uint32_t> digest() const { return rx_.digest(); }
  [[nodiscard]] const R& get() const { return rx_; }

 protected:
  R rx_;
};

class PyHfReceiver : public PyReceiver<dte::publication::HfReceiver> {
 public:
  PyHfReceiver(const std::string& config, const std::vector<std::uintptr_t>& ptrs,
               const std::vector<std::int64_t>& numel)
      : PyReceiver(model_of(config), spans(ptrs, numel)) {}
  [[nodiscard]] std::string verify() const {
    nb::gil_scoped_release release;
    return rx_.verify();
  }
};

class PyShardReceiver : public PyReceiver<dte::publication::ShardReceiver> {
 public:
  PyShardReceiver(const std::string& config, std::int64_t tp, std::int64_t ep, std::int64_t rank,
                  const std::vector<std::uintptr_t>& ptrs, const std::vector<std::int64_t>& numel)
      : PyReceiver(model_of(config), dte::layout::InferTopology{.tp = tp, .ep = ep, .replicas = 1},
                   rank, spans(ptrs, numel)) {}
};

// An FP8-serving TP rank (an FP8 ShardReceiver) over the tensors fp8_info lists, in its order.
class PyFp8Receiver : public PyReceiver<dte::publication::ShardReceiver> {
 public:
  PyFp8Receiver(const std::string& config, std::int64_t tp, std::int64_t ep, std::int64_t rank,
                const std::string& recipe, const std::vector<std::uintptr_t>& bf16,
                const std::vector<std::int64_t>& bf16_numel,
                const std::vector<std::uintptr_t>& code,
                const std::vector<std::int64_t>& code_numel,
                const std::vector<std::uintptr_t>& scale,
                const std::vector<std::int64_t>& scale_numel)
      : PyReceiver(model_of(config), dte::layout::InferTopology{.tp = tp, .ep = ep, .replicas = 1},
                   rank, recipe, with_quantized(config, tp, ep, recipe, spans(bf16, bf16_numel)),
                   fp8(code, code_numel, scale, scale_numel)) {}
  [[nodiscard]] std::string verify() const {
    nb::gil_scoped_release release;
    return rx_.fp8_verify();
  }
  [[nodiscard]] std::vector<std::uint32_t> fp8_digest() const { return rx_.fp8_digest(); }

 private:
  // The BF16 views in ServingLayout order, an empty one in each quantized tensor's place.
  static dte::ReceiverTensors with_quantized(const std::string& config, std::int64_t tp,
                                             std::int64_t ep, const std::string& recipe,
                                             dte::ReceiverTensors bf16) {
    const dte::layout::ModelSpec spec = dte::publication::named_by_structure(model_of(config));
    const dte::layout::HfModel hf(spec);
    const dte::layout::ServingLayout l(hf, {.tp = tp, .ep = ep, .replicas = 1});
    (void)recipe;
    const dte::layout::Fp8Grid g(l, dte::VllmBlockFp8::block_rows, dte::VllmBlockFp8::block_cols);
    dte::ReceiverTensors out;
    std::size_t at = 0;
    for (std::int64_t k = 0; k < l.size(); ++k) {
      if (g.quantized(k)) {
        out.emplace_back();
      } else {
        if (at == bf16.size()) throw dte::invalid_argument("Fp8Receiver: too few BF16 tensors");
        out.push_back(bf16[at++]);
      }
    }
    if (at != bf16.size()) throw dte::invalid_argument("Fp8Receiver: too many BF16 tensors");
    return out;
  }
  static std::vector<dte::receive::Fp8Tensor> fp8(const std::vector<std::uintptr_t>& code,
                                                  const std::vector<std::int64_t>& code_numel,
                                                  const std::vector<std::uintptr_t>& scale,
                                                  const std::vector<std::int64_t>& scale_numel) {
    if (code.size() != code_numel.size() || scale.size() != scale_numel.size() ||
        code.size() != scale.size()) {
      throw dte::invalid_argument("Fp8Receiver: per-tensor lists of different lengths");
    }
    std::vector<dte::receive::Fp8Tensor> out;
    for (std::size_t k = 0; k < code.size(); ++k) {
      out.push_back({{address<std::uint8_t>(code[k]), static_cast<std::size_t>(code_numel[k])},
                     {address<float>(scale[k]), static_cast<std::size_t>(scale_numel[k])}});
    }
    return out;
  }
};

std::string check_replica(const std::vector<const PyShardReceiver*>& ranks,
                          const std::vector<std::uint32_t>& digest) {
  std::vector<const dte::publication::ShardReceiver*> r;
  for (const PyShardReceiver* p : ranks)
    r.push_back(&p->get());
  return dte::publication::check_replica(r, digest);
}

// The same from digests gathered from other processes (rank_digests[ts] per TP rank).
std::string check_replica_digests(const std::string& config, std::int64_t tp, std::int64_t ep,
                                  const std::vector<std::vector<std::uint32_t>>& rank_digests,
                                  const std::vector<std::uint32_t>& digest) {
  const dte::layout::ModelSpec spec = dte::publication::named_by_structure(model_of(config));
  const dte::layout::HfModel hf(spec);
  const dte::layout::ServingLayout l(hf, {.tp = tp, .ep = ep, .replicas = 1});
  return dte::publication::check_replica(l, rank_digests, digest);
}

class PyStorageWriter {
 public:
  PyStorageWriter(const std::string& root, const std::string& config)
      : w_(model_of(config), root) {}
  nb::dict write(const nb::bytes& msg) {
    dte::publication::WriteReport r;
    {
      nb::gil_scoped_release release;
      r = w_.write(view(msg));
    }
    nb::dict d;
    d["version"] = r.version;
    d["files"] = r.files;
    d["bytes"] = r.bytes;
    d["collected"] = r.collected;
    return d;
  }

 private:
  dte::publication::StorageWriter w_;
};

class PyStorageSource {
 public:
  PyStorageSource(const std::string& root, const std::string& config, const std::string& name)
      : s_(model_of(config), root, name) {}
  // The publications that take a receiver holding `held` (None: nothing) to LATEST.
  std::vector<nb::bytes> since(std::optional<std::uint64_t> held) {
    std::vector<Bytes> msgs;
    {
      nb::gil_scoped_release release;
      msgs = s_.since(held ? *held : dte::no_version);
    }
    std::vector<nb::bytes> out;
    for (const Bytes& b : msgs)
      out.push_back(to_python(b));
    return out;
  }
  void reached(std::uint64_t v) { s_.reached(v); }

 private:
  dte::publication::StorageSource s_;
};

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "dte's C++ core (use the dte package)";
  // The exception classes (dte/error.hpp), most derived first when translating.
  static nb::object Error = nb::steal(PyErr_NewException("dte.Error", PyExc_RuntimeError, nullptr));
  auto sub = [&](const char* name, PyObject* bases) {
    return nb::steal(PyErr_NewException(name, bases, nullptr));
  };
  static nb::object InvalidArgument =
      sub("dte.InvalidArgument", nb::make_tuple(Error, nb::handle(PyExc_ValueError)).ptr());
  static nb::object BoundsError = sub("dte.BoundsError", InvalidArgument.ptr());
  static nb::object NumericError = sub("dte.NumericError", InvalidArgument.ptr());
  static nb::object UnsupportedError = sub("dte.UnsupportedError", Error.ptr());
  static nb::object FormatError = sub("dte.FormatError", Error.ptr());
  static nb::object ProtocolError = sub("dte.ProtocolError", Error.ptr());
  static nb::object IoError = sub("dte.IoError", Error.ptr());
  static nb::object DeadlineError = sub("dte.DeadlineError", Error.ptr());
  m.attr("Error") = Error;
  m.attr("InvalidArgument") = InvalidArgument;
  m.attr("BoundsError") = BoundsError;
  m.attr("NumericError") = NumericError;
  m.attr("UnsupportedError") = UnsupportedError;
  m.attr("FormatError") = FormatError;
  m.attr("ProtocolError") = ProtocolError;
  m.attr("IoError") = IoError;
  m.attr("DeadlineError") = DeadlineError;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    auto raise = [](const nb::object& cls, const std::exception& e) {
      PyErr_SetString(cls.ptr(), e.what());
    };
    try {
      std::rethrow_exception(p);
    } catch (const dte::bounds_error& e) {
      raise(BoundsError, e);
    } catch (const dte::numeric_error& e) {
      raise(NumericError, e);
    } catch (const dte::invalid_argument& e) {
      raise(InvalidArgument, e);
    } catch (const dte::unsupported& e) {
      raise(UnsupportedError, e);
    } catch (const dte::format_error& e) {
      raise(FormatError, e);
    } catch (const dte::protocol_error& e) {
      raise(ProtocolError, e);
    } catch (const dte::io_error& e) {
      raise(IoError, e);
    } catch (const dte::deadline_error& e) {
      raise(DeadlineError, e);
    } catch (const dte::error& e) {
      raise(Error, e);
    }
  });

  m.def("model_info", &model_info, "config"_a);
  m.def("shard_info", &shard_info, "config"_a, "tp"_a, "ep"_a = 1);
  m.def("message_config", &message_config, "message"_a);
  m.def("config_difference", &config_difference, "a"_a, "b"_a, "a_name"_a, "b_name"_a);
  m.def("forward_fields", &forward_fields, "config"_a);
  m.def("fp8_info", &fp8_info, "config"_a, "tp"_a, "ep"_a, "recipe"_a);
  m.def("fp8_recipe", &fp8_recipe, "recipe"_a, "bf16"_a, "amax"_a);
  m.def("check_replica", &check_replica, "ranks"_a, "digest"_a);
  m.def("merge", &merge, "config"_a, "parts"_a);
  m.def("check_writers", &check_writers, "config"_a, "writers"_a);
  m.def("check_replica_digests", &check_replica_digests, "config"_a, "tp"_a, "ep"_a,
        "rank_digests"_a, "digest"_a);

  nb::class_<Group>(m, "Group")
      .def(nb::init<double, double, double, double, double, double, double>(), "lr"_a,
           "weight_decay"_a, "beta1"_a, "beta2"_a, "eps"_a, "momentum"_a, "dampening"_a);
  nb::class_<PyPublisher>(m, "Publisher")
      .def(nb::init<const std::string&, const std::string&, std::int64_t, int, bool,
                    std::vector<dte::python::PieceTuple>, std::vector<std::int64_t>,
                    std::vector<std::int64_t>, bool, std::uint32_t, std::uint32_t, int>(),
           "kind"_a, "config"_a, "publish_every"_a, "zstd_level"_a, "diff"_a, "pieces"_a,
           "slot_numel"_a, "slot_group"_a, "decoupled"_a, "writer"_a, "writers"_a, "device"_a)
      .def("step", &PyPublisher::step, "groups"_a, "theta"_a, "a"_a, "b"_a, "steps"_a,
           "stream"_a = 0)
      .def("publish_full", &PyPublisher::publish_full, "theta"_a, "stream"_a = 0)
      .def("commit", &PyPublisher::commit)
      .def("abort", &PyPublisher::abort)
      .def("require_full", &PyPublisher::require_full)
      .def("resync", &PyPublisher::resync)
      .def("continue_after", &PyPublisher::continue_after)
      .def_prop_ro("version", &PyPublisher::version)
      .def("digest", &PyPublisher::digest)
      .def("last", &PyPublisher::last)
      .def("serve_fp8", &PyPublisher::serve_fp8, "recipe"_a, "tp"_a, "ep"_a);
  // Whether this build has the CUDA publisher (nvcc was found), and the devices it sees.
  m.attr("cuda_built") = DTE_PYTHON_CUDA_BUILT;
  m.def("cuda_devices", &dte::python::cuda_devices);

  nb::class_<PyHfReceiver>(m, "HfReceiver")
      .def(nb::init<const std::string&, const std::vector<std::uintptr_t>&,
                    const std::vector<std::int64_t>&>())
      .def("apply", &PyHfReceiver::apply)
      .def("verify", &PyHfReceiver::verify)
      .def_prop_ro("version", &PyHfReceiver::version)
      .def("digest", &PyHfReceiver::digest);
  nb::class_<PyShardReceiver>(m, "ShardReceiver")
      .def(nb::init<const std::string&, std::int64_t, std::int64_t, std::int64_t,
                    const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&>())
      .def("apply", &PyShardReceiver::apply)
      .def_prop_ro("version", &PyShardReceiver::version)
      .def("digest", &PyShardReceiver::digest);
  nb::class_<PyFp8Receiver>(m, "Fp8Receiver")
      .def(
          nb::init<const std::string&, std::int64_t, std::int64_t, std::int64_t, const std::string&,
                   const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&,
                   const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&,
                   const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&>())
      .def("apply", &PyFp8Receiver::apply)
      .def("verify", &PyFp8Receiver::verify)
      .def_prop_ro("version", &PyFp8Receiver::version)
      .def("digest", &PyFp8Receiver::digest)
      .def("fp8_digest", &PyFp8Receiver::fp8_digest);
  nb::class_<PyStorageWriter>(m, "StorageWriter")
      .def(nb::init<const std::string&, const std::string&>())
      .def("write", &PyStorageWriter::write);
  nb::class_<PyStorageSource>(m, "StorageSource")
      .def(nb::init<const std::string&, const std::string&, const std::string&>())
      .def("since", &PyStorageSource::since)
      .def("reached", &PyStorageSource::reached);
}
