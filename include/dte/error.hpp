// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>

namespace dte {

// Base of every exception the host API throws. what() is the message for the user (what went
// wrong, where, what to do); where() is the place in dte that raised it, for bug reports.
class error : public std::runtime_error {
 public:
  explicit error(const std::string& message,
                 std::source_location where = std::source_location::current())
      : std::runtime_error(message), where_(where) {}

  [[nodiscard]] const std::source_location& where() const noexcept { return where_; }

 private:
  std::source_location where_;
};

// The subclasses forward their constructor explicitly rather than inheriting it (`using
// error::error;`): nvcc 13's front end aborts with an internal error on an inherited
// constructor whose default argument is std::source_location::current().

// Bad values or shapes passed by the caller (hyperparameters, optimizer state, topology).
class invalid_argument : public error {
 public:
  explicit invalid_argument(const std::string& message,
                            std::source_location where = std::source_location::current())
      : error(message, where) {}
};

// A configuration dte understands but cannot handle correctly (amsgrad, Nesterov, ...).
class unsupported : public error {
 public:
  explicit unsupported(const std::string& message,
                       std::source_location where = std::source_location::current())
      : error(message, where) {}
};

// A file or message whose bytes do not follow the format (safetensors, payloads).
class format_error : public error {
 public:
  explicit format_error(const std::string& message,
                        std::source_location where = std::source_location::current())
      : error(message, where) {}
};

// The operating system refused a read or a write.
class io_error : public error {
 public:
  explicit io_error(const std::string& message,
                    std::source_location where = std::source_location::current())
      : error(message, where) {}
};

// A peer of a transport's world did not answer within the deadline (stalled or dead).
class deadline_error : public error {
 public:
  explicit deadline_error(const std::string& message,
                          std::source_location where = std::source_location::current())
      : error(message, where) {}
};

}  // namespace dte
