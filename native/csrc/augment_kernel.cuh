// Torch-free interface of the CUDA augment kernel: raw pointers, plain structs and a stream, so
// that plain `nvcc -c augment_kernel.cu` compiles it (the tests do, without a GPU) and the torch
// binding (augment_cuda.cpp) stays a thin layer.
#pragma once

#include <cuda_runtime.h>

#include "augment_desc.h"

namespace batchwire {
namespace cuda {

// Device scratch (in floats) that `launch_augment` needs for a batch with contrast jitter: one
// partial grey sum per image and thread block, and one grey mean per image.
int64_t grey_scratch_floats(const OutDesc& out);

// Enqueues the whole batch on `stream`, no host synchronisation. `images` is a device table of
// out.n entries. When `any_contrast`, `grey_scratch` (grey_scratch_floats(out) floats of device
// memory, no initialisation needed) receives the images' grey means, summed in a fixed order so
// that a run's output is bit-identical to the last; it may be null otherwise.
cudaError_t launch_augment(const ImageDesc* images, const OutDesc& out, bool any_contrast,
                           float* grey_scratch, cudaStream_t stream);

}  // namespace cuda
}  // namespace batchwire
