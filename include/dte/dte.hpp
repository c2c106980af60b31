// SPDX-License-Identifier: Apache-2.0
// Umbrella header: every host-safe part of dte (no CUDA, no third-party dependency).
#pragma once

#include "dte/audit.hpp"
#include "dte/concepts.hpp"
#include "dte/config.hpp"
#include "dte/detect/detect.hpp"
#include "dte/error.hpp"
#include "dte/numeric/round.hpp"
#include "dte/optim/adam.hpp"
#include "dte/optim/reconstruction.hpp"
#include "dte/optim/sgd.hpp"
#include "dte/optim/snapshot.hpp"
