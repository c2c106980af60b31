// SPDX-License-Identifier: Apache-2.0
// dte._native: the C++ side of the Python package (python/dte/__init__.py holds the torch side).
// It binds publication::Publisher (one per optimizer inverse), HfReceiver and ShardReceiver,
// and the storage adapters, over memory the Python side has checked (dtype, device, size,
// contiguity) and keeps alive: tensors arrive as addresses, so no per-tensor conversion runs
// in a publication. The GIL is released during every pass and apply. dte's exceptions become
// the dte.Error classes below.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/io/model_config.hpp"
#include "dte/layout/hf.hpp"
#include "dte/layout/model.hpp"
#include "dte/layout/serving.hpp"
#include "dte/layout/topology.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/publication/publisher.hpp"
#include "dte/publication/receiver.hpp"
#include "dte/publication/storage.hpp"

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

// The model of a message (its config), for a receiver that learns it from the first one.
std::string message_config(const nb::bytes& msg) {
  const auto e = dte::publication::envelope(view(msg), "publication");
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
  d["digest"] = r.digest;
  d["seconds"] = r.seconds;
  return d;
}

// One parameter group's hyperparameters as Python passes them each step.
struct Group {
  double lr, weight_decay, beta1, beta2, eps, momentum, dampening;
};

// A publisher over one optimizer inverse. Python passes, once, the flat FP32 buffer and each
// tensor's parameter group; then per step the groups' hyperparameters as the step used them and
// per tensor its state's addresses and step count.
template <class Inverse>
class PyPublisher {
 public:
  PyPublisher(const std::string& config, std::int64_t publish_every, int zstd_level, bool diff,
              std::uintptr_t theta, std::int64_t numel, std::vector<std::int64_t> group_of,
              bool decoupled)
      : pub_(model_of(config),
             {.publish_every = publish_every,
              .zstd_level = zstd_level,
              .encoding = diff ? dte::storage::Encoding::diff : dte::storage::Encoding::value}),
        group_of_(std::move(group_of)),
        decoupled_(decoupled) {
    const auto& hf = pub_.model();
    if (numel != hf.total() || static_cast<std::int64_t>(group_of_.size()) != hf.size()) {
      throw dte::invalid_argument("dte._native publisher: the flat buffer has " +
                                  std::to_string(numel) + " elements and " +
                                  std::to_string(group_of_.size()) + " tensors, the model " +
                                  std::to_string(hf.total()) + " and " + std::to_string(hf.size()));
    }
    flat_.theta = {address<const float>(theta), static_cast<std::size_t>(numel)};
    flat_.hyper.resize(group_of_.size());
    flat_.state.resize(group_of_.size());
    last_step_.assign(group_of_.size(), 0);
  }

  // Per tensor: state addresses (0: no state yet) and step count; per group: hyperparameters.
  std::optional<nb::bytes> step(const std::vector<Group>& groups,
                                const std::vector<std::uintptr_t>& a,
                                const std::vector<std::uintptr_t>& b,
                                const std::vector<std::int64_t>& steps) {
    bind(groups, a, b, steps);
    std::optional<Bytes> out;
    {
      nb::gil_scoped_release release;
      out = pub_.step(dte::publication::FlatAccess<Inverse>{&flat_});
    }
    if (!out) return std::nullopt;
    return to_python(*out);
  }

  nb::bytes publish_full() {
    Bytes out;
    {
      nb::gil_scoped_release release;
      out = pub_.publish(dte::publication::FlatAccess<Inverse>{&flat_}, true);
    }
    return to_python(out);
  }

  void require_full() { pub_.require_full(); }
  void continue_after(std::uint64_t v) { pub_.continue_after(v); }
  // The step counts as they are now are the start of the next step (a new publisher over an
  // optimizer that stepped before, or a full publication); full: the caller lost track of the
  // optimizer steps, so the next publication is full.
  void resync(const std::vector<std::int64_t>& steps, bool full) {
    if (steps.size() != last_step_.size()) {
      throw dte::invalid_argument("dte._native publisher: per-tensor lists of the wrong length");
    }
    last_step_ = steps;
    if (full) pub_.require_full();
  }

  [[nodiscard]] std::uint64_t version() const { return pub_.version(); }
  [[nodiscard]] std::vector<std::uint32_t> digest() const { return pub_.digest(); }
  [[nodiscard]] nb::dict last() const { return publish_dict(pub_.last()); }

 private:
  // Each tensor's kernel inputs for this step. A tensor whose step count did not move was not
  // updated (torch skips parameters without a gradient): its inverse is the identity (lr 0).
  void bind(const std::vector<Group>& groups, const std::vector<std::uintptr_t>& a,
            const std::vector<std::uintptr_t>& b, const std::vector<std::int64_t>& steps) {
    const auto& hf = pub_.model();
    const auto n = static_cast<std::size_t>(hf.size());
    if (a.size() != n || b.size() != n || steps.size() != n) {
      throw dte::invalid_argument("dte._native publisher: per-tensor lists of the wrong length");
    }
    for (std::size_t t = 0; t < n; ++t) {
      const auto numel = static_cast<std::size_t>(hf[static_cast<std::int64_t>(t)].numel());
      if (group_of_[t] < 0) {
        // Frozen (in no parameter group): never updated, its inverse the identity.
        if (zeros_.empty()) zeros_.assign(static_cast<std::size_t>(max_numel()), 0.0f);
        set(t, {0.0, 0.0, 0.9, 0.999, 1e-8, 0.9, 0.0}, 1, false, zeros_.data(), zeros_.data(),
            numel);
        continue;
      }
      const auto g = static_cast<std::size_t>(group_of_[t]);
      if (g >= groups.size()) throw dte::invalid_argument("dte._native publisher: bad group");
      const Group& G = groups[g];
      const bool moved = steps[t] != last_step_[t];
      if (steps[t] < last_step_[t] || steps[t] > last_step_[t] + 1) {
        const std::int64_t before = last_step_[t];
        pub_.require_full();
        last_step_ = steps;
        throw dte::protocol_error(
            "tensor " + hf.name(static_cast<std::int64_t>(t)) + ": the optimizer's step count " +
            "went from " + std::to_string(before) + " to " + std::to_string(steps[t]) +
            " between two calls of step(); dte inverts exactly one optimizer step per call "
            "(call pub.step() after every optimizer.step()). The next publication will be full");
      }
      last_step_[t] = steps[t];
      const float* s0 = address<const float>(a[t]);
      const float* s1 = address<const float>(b[t]);
      if (a[t] == 0 || (needs_second() && b[t] == 0)) {
        // No state: never updated (lr 0 below); zeros stand in for the moments.
        // (allocated once at the largest tensor's size: earlier tensors keep pointers into it)
        if (zeros_.empty()) zeros_.assign(static_cast<std::size_t>(max_numel()), 0.0f);
        s0 = zeros_.data();
        s1 = zeros_.data();
      }
      set(t, G, moved ? steps[t] : std::max<std::int64_t>(steps[t], 1), moved, s0, s1, numel);
    }
  }

  [[nodiscard]] std::int64_t max_numel() const {
    std::int64_t n = 0;
    for (std::int64_t t = 0; t < pub_.model().size(); ++t)
      n = std::max(n, pub_.model()[t].numel());
    return n;
  }

  static constexpr bool needs_second() { return !std::is_same_v<Inverse, dte::SgdMomentumInverse>; }

  void set(std::size_t t, const Group& G, std::int64_t step, bool moved, const float* s0,
           const float* s1, std::size_t numel) {
    if constexpr (std::is_same_v<Inverse, dte::SgdMomentumInverse>) {
      flat_.hyper[t] = {.lr = moved ? G.lr : 0.0,
                        .momentum = G.momentum,
                        .dampening = G.dampening,
                        .weight_decay = G.weight_decay};
      flat_.state[t] = {std::span<const float>(s0, numel)};
    } else {
      flat_.hyper[t] = {
          .lr = moved ? G.lr : 0.0,
          .weight_decay = G.weight_decay,
          .beta1 = G.beta1,
          .beta2 = G.beta2,
          .eps = G.eps,
          .step = step,
          .decay_form = decoupled_ ? dte::DecayForm::multiply : dte::DecayForm::unknown};
      flat_.state[t] = {std::span<const float>(s0, numel), std::span<const float>(s1, numel)};
    }
  }

  dte::publication::Publisher<Inverse, dte::BF16Detect> pub_;
  std::vector<std::int64_t> group_of_;
  bool decoupled_;
  dte::publication::FlatTrainer<Inverse> flat_;
  std::vector<std::int64_t> last_step_;
  std::vector<float> zeros_;
};

template <class Inverse>
void bind_publisher(nb::module_& m, const char* name) {
  nb::class_<PyPublisher<Inverse>>(m, name)
      .def(nb::init<const std::string&, std::int64_t, int, bool, std::uintptr_t, std::int64_t,
                    std::vector<std::int64_t>, bool>(),
           "config"_a, "publish_every"_a, "zstd_level"_a, "diff"_a, "theta"_a, "numel"_a,
           "group_of"_a, "decoupled"_a)
      .def("step", &PyPublisher<Inverse>::step)
      .def("publish_full", &PyPublisher<Inverse>::publish_full)
      .def("require_full", &PyPublisher<Inverse>::require_full)
      .def("resync", &PyPublisher<Inverse>::resync)
      .def("continue_after", &PyPublisher<Inverse>::continue_after)
      .def_prop_ro("version", &PyPublisher<Inverse>::version)
      .def("digest", &PyPublisher<Inverse>::digest)
      .def("last", &PyPublisher<Inverse>::last);
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
  m.def("check_replica", &check_replica, "ranks"_a, "digest"_a);
  m.def("check_replica_digests", &check_replica_digests, "config"_a, "tp"_a, "ep"_a,
        "rank_digests"_a, "digest"_a);

  nb::class_<Group>(m, "Group")
      .def(nb::init<double, double, double, double, double, double, double>(), "lr"_a,
           "weight_decay"_a, "beta1"_a, "beta2"_a, "eps"_a, "momentum"_a, "dampening"_a);
  bind_publisher<dte::AdamWInverse>(m, "AdamWPublisher");
  bind_publisher<dte::AdamInverse>(m, "AdamPublisher");
  bind_publisher<dte::SgdMomentumInverse>(m, "SgdPublisher");

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
  nb::class_<PyStorageWriter>(m, "StorageWriter")
      .def(nb::init<const std::string&, const std::string&>())
      .def("write", &PyStorageWriter::write);
  nb::class_<PyStorageSource>(m, "StorageSource")
      .def(nb::init<const std::string&, const std::string&, const std::string&>())
      .def("since", &PyStorageSource::since)
      .def("reached", &PyStorageSource::reached);
}
