// Torch-free interface of the CUDA augment kernel: raw pointers, plain structs and a stream, so
// that plain `nvcc -c augment_kernel.cu` compiles it (the tests do, without a GPU) and the torch
// binding (augment_cuda.cpp) stays a thin layer.
#pragma once

#include <cuda_runtime.h>

#include "augment_desc.h"

namespace batchwire {
namespace cuda {

// Enqueues the whole batch on `stream`, no host synchronisation. `images` is a device table of
// out.n entries. When `any_contrast`, `grey_sums` (out.n floats of device scratch) receives each
// image's grey sum in a first, write-free pass; it may be null otherwise.
cudaError_t launch_augment(const ImageDesc* images, const OutDesc& out, bool any_contrast,
                           float* grey_sums, cudaStream_t stream);

}  // namespace cuda
}  // namespace batchwire
