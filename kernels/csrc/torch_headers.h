// The torch and standard headers every native library includes, compiled once per set of flags
// into a GCC precompiled header (kernels/native_build.py) that each library's compile reads
// first: parsing these is most of a library's build time. Each source still includes what it
// uses itself; a compiler that cannot use the precompiled form reads this text instead.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>
