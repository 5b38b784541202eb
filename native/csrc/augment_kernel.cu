// CUDA augment kernel: every image of a batch in one launch (blockIdx.z walks the images, whose
// sizes differ), one thread per output pixel computing all three channels with the separable
// triangle filter evaluated on the fly (fp32), then jitter, normalisation and a strided write.
// Deterministic: the same inputs give the same bits on every run (no atomics, fixed-order sums).
// Consecutive threads own consecutive output columns, so NCHW writes are coalesced per plane and
// channels_last writes form one contiguous run per warp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "augment_kernel.cuh"
#include "augment_pixel.h"

namespace batchwire {
namespace cuda {
namespace {

constexpr int kBlockX = 32;
constexpr int kBlockY = 8;
constexpr unsigned kMaxGridZ = 65535;

template <typename T>
__device__ __forceinline__ T convert(float v, float scale, float bias);
template <>
__device__ __forceinline__ uint8_t convert<uint8_t>(float v, float, float) {
  return static_cast<uint8_t>(__float2int_rn(clamp255(v)));  // round half to even
}
template <>
__device__ __forceinline__ float convert<float>(float v, float scale, float bias) {
  return v * scale + bias;
}
template <>
__device__ __forceinline__ __half convert<__half>(float v, float scale, float bias) {
  return __float2half_rn(v * scale + bias);
}
template <>
__device__ __forceinline__ __nv_bfloat16 convert<__nv_bfloat16>(float v, float scale, float bias) {
  return __float2bfloat16_rn(v * scale + bias);
}

// The per-image grey mean that contrast blends towards, in two deterministic passes (only for
// images with contrast != 1). No float atomics: their order, and so the rounding of the sum,
// changed from run to run, and a uint8 pixel could differ by one level between two runs.
//
// Pass 1: each block sums its tile's grey values in a fixed order (a shuffle tree within each
// warp, i.e. each row of the tile, then the warps in order) and writes the sum to its own slot
// of `partials` [out.n][blocks per image].
__global__ void grey_partials_kernel(const ImageDesc* __restrict__ images, OutDesc out,
                                     float* __restrict__ partials) {
  static_assert(kBlockX == 32, "one warp per tile row");
  __shared__ float warp_sums[kBlockY];
  const unsigned blocks = gridDim.x * gridDim.y;
  const unsigned block = blockIdx.y * gridDim.x + blockIdx.x;
  for (unsigned n = blockIdx.z; n < static_cast<unsigned>(out.n); n += gridDim.z) {
    if (images[n].contrast == 1.f) continue;  // uniform over the block
    const ImageDesc im = images[n];
    const int ox = blockIdx.x * kBlockX + threadIdx.x;
    const int oy = blockIdx.y * kBlockY + threadIdx.y;
    float g = 0.f;
    if (ox < out.width && oy < out.height) {
      float rgb[3];
      resample_pixel(im, out.height, out.width, oy, ox, rgb);
      g = grey(rgb);
    }
    for (int offset = 16; offset > 0; offset /= 2) g += __shfl_down_sync(0xffffffffu, g, offset);
    if (threadIdx.x == 0) warp_sums[threadIdx.y] = g;
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
      float sum = 0.f;
      for (int w = 0; w < kBlockY; ++w) sum += warp_sums[w];
      partials[static_cast<size_t>(n) * blocks + block] = sum;
    }
    __syncthreads();  // warp_sums is reused for the next image
  }
}

// Pass 2: one warp per image sums its blocks' partials in a fixed order (lane l takes slots l,
// l + 32, ... in turn, then a shuffle tree) and writes the image's grey mean.
__global__ void grey_mean_kernel(const ImageDesc* __restrict__ images, OutDesc out,
                                 unsigned blocks, const float* __restrict__ partials,
                                 float* __restrict__ means) {
  for (unsigned n = blockIdx.x; n < static_cast<unsigned>(out.n); n += gridDim.x) {
    if (images[n].contrast == 1.f) continue;
    const float* slots = partials + static_cast<size_t>(n) * blocks;
    float sum = 0.f;
    for (unsigned i = threadIdx.x; i < blocks; i += 32) sum += slots[i];
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += __shfl_down_sync(0xffffffffu, sum, offset);
    }
    if (threadIdx.x == 0) means[n] = sum / (static_cast<float>(out.height) * out.width);
  }
}

dim3 pixel_grid(const OutDesc& out) {
  const unsigned z = static_cast<unsigned>(out.n) < kMaxGridZ ? out.n : kMaxGridZ;
  return dim3((out.width + kBlockX - 1) / kBlockX, (out.height + kBlockY - 1) / kBlockY, z);
}

template <typename T>
__global__ void augment_kernel(const ImageDesc* __restrict__ images, OutDesc out,
                               const float* __restrict__ grey_means) {
  const int ox = blockIdx.x * kBlockX + threadIdx.x;
  const int oy = blockIdx.y * kBlockY + threadIdx.y;
  if (ox >= out.width || oy >= out.height) return;
  T* dst_base = static_cast<T*>(out.data);
  for (unsigned n = blockIdx.z; n < static_cast<unsigned>(out.n); n += gridDim.z) {
    const ImageDesc im = images[n];
    float rgb[3];
    resample_pixel(im, out.height, out.width, oy, ox, rgb);
    const float mean = im.contrast != 1.f ? grey_means[n] : 0.f;
    jitter_pixel(im, mean, rgb);
    T* dst = dst_base + n * out.stride_n + oy * out.stride_h + ox * out.stride_w;
    for (int c = 0; c < 3; ++c) {
      dst[c * out.stride_c] = convert<T>(rgb[c], out.scale[c], out.bias[c]);
    }
  }
}

template <typename T>
cudaError_t launch_typed(const ImageDesc* images, const OutDesc& out, bool any_contrast,
                         float* grey_scratch, cudaStream_t stream) {
  const dim3 block(kBlockX, kBlockY);
  const dim3 grid = pixel_grid(out);
  float* means = nullptr;
  if (any_contrast) {
    if (grey_scratch == nullptr) return cudaErrorInvalidValue;
    const unsigned blocks = grid.x * grid.y;
    float* partials = grey_scratch;
    means = grey_scratch + static_cast<size_t>(out.n) * blocks;
    grey_partials_kernel<<<grid, block, 0, stream>>>(images, out, partials);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const unsigned mean_blocks = static_cast<unsigned>(out.n) < kMaxGridZ ? out.n : kMaxGridZ;
    grey_mean_kernel<<<mean_blocks, 32, 0, stream>>>(images, out, blocks, partials, means);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  augment_kernel<T><<<grid, block, 0, stream>>>(images, out, means);
  return cudaGetLastError();
}

}  // namespace

int64_t grey_scratch_floats(const OutDesc& out) {
  if (out.n <= 0) return 0;
  const dim3 grid = pixel_grid(out);
  return static_cast<int64_t>(out.n) * (static_cast<int64_t>(grid.x) * grid.y + 1);
}

cudaError_t launch_augment(const ImageDesc* images, const OutDesc& out, bool any_contrast,
                           float* grey_scratch, cudaStream_t stream) {
  if (out.n <= 0) return cudaSuccess;
  switch (out.type) {
    case OutType::kUInt8:
      return launch_typed<uint8_t>(images, out, any_contrast, grey_scratch, stream);
    case OutType::kFloat16:
      return launch_typed<__half>(images, out, any_contrast, grey_scratch, stream);
    case OutType::kBFloat16:
      return launch_typed<__nv_bfloat16>(images, out, any_contrast, grey_scratch, stream);
    case OutType::kFloat32:
      return launch_typed<float>(images, out, any_contrast, grey_scratch, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace batchwire
