// Plain structs shared by the CUDA kernel, its torch binding and the host emulation the tests
// compile (no CUDA or torch headers here).
#pragma once

#include <cstdint>

namespace batchwire {
namespace cuda {

// One sample as the kernel reads it from the device-side table.
struct ImageDesc {
  const uint8_t* pixels;  // HWC uint8, contiguous, on the device
  int height, width, channels;
  float y0, x0, y1, x1;  // crop box in source pixels, end-exclusive
  float brightness, contrast, saturation, hue;  // hue: a shift in turns, 0 = none
  int flip;
};

enum class OutType : int { kUInt8 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3 };

// The output batch [n, 3, height, width], addressed through its strides (in elements), so one
// kernel writes NCHW and channels_last alike.
struct OutDesc {
  void* data;
  OutType type;
  int n, height, width;
  int64_t stride_n, stride_c, stride_h, stride_w;
  float scale[3], bias[3];  // value = pixel * scale + bias (identity for uint8)
};

}  // namespace cuda
}  // namespace batchwire
