// Compile-time dispatch helpers for the kernel launchers: turn a runtime dtype code, conv width or flag into a
// template argument. Each calls f with a tag whose type carries the value:
//
//   dtype_switch(p.dtype, [&](auto tag) { using T = decltype(tag); ... });
//   width_switch(p.width, [&](auto w) { constexpr int kW = decltype(w)::value; ... });
//   bool_switch(p.z != nullptr, [&](auto b) { constexpr bool kHasZ = decltype(b)::value; ... });
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#include "ops_common.h"

namespace packloader_ops {

template <typename F>
inline void dtype_switch(int dtype, F &&f) {
  switch (dtype) {
    case kF32: f(float{}); break;
    case kF16: f(__half{}); break;
    default: f(__nv_bfloat16{}); break;   // kBF16 (the Python side admits only these three)
  }
}

template <typename F>
inline void width_switch(int width, F &&f) {
  switch (width) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;   // 4 (the Python side admits 2..4)
  }
}

template <typename F>
inline void bool_switch(bool cond, F &&f) {
  if (cond) f(std::true_type{});
  else f(std::false_type{});
}

}  // namespace packloader_ops

// explicit instantiations of a conv launcher for every dtype and width
#define PACKLOADER_CONV_FOR_EACH_TYPE_WIDTH(X) \
  X(float, 2) X(float, 3) X(float, 4) X(__half, 2) X(__half, 3) X(__half, 4) \
  X(__nv_bfloat16, 2) X(__nv_bfloat16, 3) X(__nv_bfloat16, 4)
