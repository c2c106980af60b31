// SPDX-License-Identifier: Apache-2.0
// The exceptions of the host API. Every refusal is a dte::error; its class says what a caller
// can do about it, and its context names the file, rank, tensor, field and version involved:
//
//   format_error    the bytes of a file or message do not follow the format  -> fix the input
//   bounds_error    a value lies outside its documented range, or a product
//                   or offset of such values overflows (dte/bounds.hpp)       -> fix the input
//   numeric_error   a number that cannot be meaningful (NaN, Inf, lr 1e300)  -> fix the step
//   protocol_error  a well-formed message that does not belong: wrong or
//                   older version, wrong base, a sender's message missing     -> retry / resync
//   invalid_argument, unsupported, io_error, deadline_error: as named.
//
// bounds_error and numeric_error are invalid_arguments (a bad value passed in); protocol_error
// is not (the input was fine, the stream of publications was not).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <version>

#if __has_include(<source_location>)
#include <source_location>
#endif

namespace dte {

// std::source_location where the compiler provides it; a stand-in with the same members
// elsewhere (clang before 15 with libstdc++ has the header but not the type), so the public
// headers compile with every compiler the project supports, the fuzzing clang included.
#if defined(__cpp_lib_source_location)
using source_location = std::source_location;
#else
struct source_location {
  static constexpr source_location current(const char* file = __builtin_FILE(),
                                           const char* function = __builtin_FUNCTION(),
                                           unsigned line = __builtin_LINE()) noexcept {
    source_location s;
    s.file_ = file;
    s.function_ = function;
    s.line_ = line;
    return s;
  }
  [[nodiscard]] constexpr const char* file_name() const noexcept { return file_; }
  [[nodiscard]] constexpr const char* function_name() const noexcept { return function_; }
  [[nodiscard]] constexpr unsigned line() const noexcept { return line_; }
  [[nodiscard]] constexpr unsigned column() const noexcept { return 0; }

 private:
  const char* file_ = "";
  const char* function_ = "";
  unsigned line_ = 0;
};
#endif

// What a refusal is about; empty / -1 / no_version fields were not known where it was raised.
struct ErrorContext {
  std::string source;                         // the file, or the peer ("sender 3 to receiver 1")
  std::string field;                          // the field, key or tensor named
  std::int64_t rank = -1;                     // the rank that refused (trainer or receiver rank)
  std::int64_t peer = -1;                     // the other rank (the sender of a refused message)
  std::uint64_t version = ~std::uint64_t{0};  // the version concerned
  std::uint64_t held = ~std::uint64_t{0};     // the version the receiver holds
};

// The context of a refusal about a file or a field of it.
inline ErrorContext about(std::string source, std::string field = {}) {
  ErrorContext c;
  c.source = std::move(source);
  c.field = std::move(field);
  return c;
}

// Base of every exception the host API throws. what() is the message for the user (what went
// wrong, where, what to do); context() the same facts as fields; where() is the place in dte
// that raised it, for bug reports.
class error : public std::runtime_error {
 public:
  explicit error(const std::string& message, source_location where = source_location::current())
      : std::runtime_error(message), where_(where) {}
  error(const std::string& message, ErrorContext context,
        source_location where = source_location::current())
      : std::runtime_error(message), context_(std::move(context)), where_(where) {}

  [[nodiscard]] const ErrorContext& context() const noexcept { return context_; }
  [[nodiscard]] const source_location& where() const noexcept { return where_; }

 private:
  ErrorContext context_;
  source_location where_;
};

// The subclasses forward their constructors explicitly rather than inheriting them (`using
// error::error;`): nvcc 13's front end aborts with an internal error on an inherited
// constructor whose default argument is source_location::current().
#define DTE_ERROR_CONSTRUCTORS(name, base)                                                      \
  explicit name(const std::string& message, source_location where = source_location::current()) \
      : base(message, where) {}                                                                 \
  name(const std::string& message, ErrorContext context,                                        \
       source_location where = source_location::current())                                      \
      : base(message, std::move(context), where) {}

// Bad values or shapes passed by the caller (hyperparameters, optimizer state, topology).
class invalid_argument : public error {
 public:
  DTE_ERROR_CONSTRUCTORS(invalid_argument, error)
};

// A value outside its documented range, or a product / offset of values that overflows.
class bounds_error : public invalid_argument {
 public:
  DTE_ERROR_CONSTRUCTORS(bounds_error, invalid_argument)
};

// A number that cannot be meaningful: NaN or Inf where a value is needed, a hyperparameter far
// outside what any optimizer step uses.
class numeric_error : public invalid_argument {
 public:
  DTE_ERROR_CONSTRUCTORS(numeric_error, invalid_argument)
};

// A configuration dte understands but cannot handle correctly (amsgrad, Nesterov, ...).
class unsupported : public error {
 public:
  DTE_ERROR_CONSTRUCTORS(unsupported, error)
};

// A file or message whose bytes do not follow the format (safetensors, JSON, payloads).
class format_error : public error {
 public:
  DTE_ERROR_CONSTRUCTORS(format_error, error)
};

// A well-formed message that does not belong to the publication being applied: another or an
// older version, a delta on a base the receiver does not hold, a sender's message missing or
// doubled. The receiver is unchanged; the engine resyncs it.
class protocol_error : public error {
 public:
  DTE_ERROR_CONSTRUCTORS(protocol_error, error)
};

// The operating system refused a read or a write.
class io_error : public error {
 public:
  DTE_ERROR_CONSTRUCTORS(io_error, error)
};

// A peer of a transport's world did not answer within the deadline (stalled or dead).
class deadline_error : public error {
 public:
  DTE_ERROR_CONSTRUCTORS(deadline_error, error)
};

#undef DTE_ERROR_CONSTRUCTORS

}  // namespace dte
