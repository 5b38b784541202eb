// Torch-free interface of the CUDA augment kernel: raw pointers, plain structs and a stream, so
// that plain `nvcc -c augment_kernel.cu` compiles it (the tests do, without a GPU) and the torch
// binding (augment_cuda.cpp) stays a thin layer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace batchwire {
namespace cuda {

// One sample as the kernel reads it from the device-side table.
struct ImageDesc {
  const uint8_t* pixels;  // HWC uint8, contiguous, on the device
  int height, width, channels;
  float y0, x0, y1, x1;  // crop box in source pixels, end-exclusive
  float brightness, contrast, saturation;
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

// Enqueues the whole batch on `stream`, no host synchronisation. `images` is a device table of
// out.n entries. When `any_contrast`, `grey_sums` (out.n floats of device scratch) receives each
// image's grey sum in a first, write-free pass; it may be null otherwise.
cudaError_t launch_augment(const ImageDesc* images, const OutDesc& out, bool any_contrast,
                           float* grey_sums, cudaStream_t stream);

}  // namespace cuda
}  // namespace batchwire
