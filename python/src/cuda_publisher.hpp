// SPDX-License-Identifier: Apache-2.0
// What the binding (native.cpp) calls of the CUDA publisher: defined by cuda_publisher.cu when
// the package is built with CUDA (DTE_PYTHON_CUDA), else by native.cpp, where make_cuda_publisher
// refuses and cuda_devices() is 0.
#pragma once

#include <memory>
#include <string>

#include "publisher.hpp"

namespace dte::python {

// The publisher of optimizer `kind` over tensors on CUDA device `device`. Throws
// dte::unsupported when this process has no such device.
std::unique_ptr<AnyPublisher> make_cuda_publisher(const std::string& kind,
                                                  const PublisherArgs& args, int device);

// The CUDA devices this process can use (0 without a driver, or in a build without CUDA).
int cuda_devices() noexcept;

}  // namespace dte::python
