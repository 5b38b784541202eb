// CUDA augment kernel: every image of a batch in one launch (blockIdx.z walks the images, whose
// sizes differ), one thread per output pixel computing all three channels with the separable
// triangle filter evaluated on the fly (fp32), then jitter, normalisation and a strided write.
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

// First pass, only for images with contrast != 1: the grey sum of the brightness-adjusted
// output, reduced per warp, then per block in shared memory, then one atomic per block.
__global__ void grey_sum_kernel(const ImageDesc* __restrict__ images, OutDesc out,
                                float* __restrict__ grey_sums) {
  __shared__ float block_sum;
  for (unsigned n = blockIdx.z; n < static_cast<unsigned>(out.n); n += gridDim.z) {
    const ImageDesc im = images[n];
    if (im.contrast == 1.f) continue;  // uniform over the block
    if (threadIdx.x == 0 && threadIdx.y == 0) block_sum = 0.f;
    __syncthreads();
    const int ox = blockIdx.x * kBlockX + threadIdx.x;
    const int oy = blockIdx.y * kBlockY + threadIdx.y;
    float g = 0.f;
    if (ox < out.width && oy < out.height) {
      float rgb[3];
      resample_pixel(im, out.height, out.width, oy, ox, rgb);
      g = grey(rgb);
    }
    for (int offset = 16; offset > 0; offset /= 2) g += __shfl_down_sync(0xffffffffu, g, offset);
    if (threadIdx.x == 0) atomicAdd(&block_sum, g);
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) atomicAdd(&grey_sums[n], block_sum);
    __syncthreads();
  }
}

template <typename T>
__global__ void augment_kernel(const ImageDesc* __restrict__ images, OutDesc out,
                               const float* __restrict__ grey_sums) {
  const int ox = blockIdx.x * kBlockX + threadIdx.x;
  const int oy = blockIdx.y * kBlockY + threadIdx.y;
  if (ox >= out.width || oy >= out.height) return;
  T* dst_base = static_cast<T*>(out.data);
  for (unsigned n = blockIdx.z; n < static_cast<unsigned>(out.n); n += gridDim.z) {
    const ImageDesc im = images[n];
    float rgb[3];
    resample_pixel(im, out.height, out.width, oy, ox, rgb);
    const float mean = im.contrast != 1.f
                           ? grey_sums[n] / (static_cast<float>(out.height) * out.width)
                           : 0.f;
    jitter_pixel(im, mean, rgb);
    T* dst = dst_base + n * out.stride_n + oy * out.stride_h + ox * out.stride_w;
    for (int c = 0; c < 3; ++c) {
      dst[c * out.stride_c] = convert<T>(rgb[c], out.scale[c], out.bias[c]);
    }
  }
}

template <typename T>
cudaError_t launch_typed(const ImageDesc* images, const OutDesc& out, bool any_contrast,
                         float* grey_sums, cudaStream_t stream) {
  const dim3 block(kBlockX, kBlockY);
  const unsigned z = static_cast<unsigned>(out.n) < kMaxGridZ ? out.n : kMaxGridZ;
  const dim3 grid((out.width + kBlockX - 1) / kBlockX, (out.height + kBlockY - 1) / kBlockY, z);
  if (any_contrast) {
    if (grey_sums == nullptr) return cudaErrorInvalidValue;
    cudaError_t err = cudaMemsetAsync(grey_sums, 0, sizeof(float) * out.n, stream);
    if (err != cudaSuccess) return err;
    grey_sum_kernel<<<grid, block, 0, stream>>>(images, out, grey_sums);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  augment_kernel<T><<<grid, block, 0, stream>>>(images, out, grey_sums);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_augment(const ImageDesc* images, const OutDesc& out, bool any_contrast,
                           float* grey_sums, cudaStream_t stream) {
  if (out.n <= 0) return cudaSuccess;
  switch (out.type) {
    case OutType::kUInt8:
      return launch_typed<uint8_t>(images, out, any_contrast, grey_sums, stream);
    case OutType::kFloat16:
      return launch_typed<__half>(images, out, any_contrast, grey_sums, stream);
    case OutType::kBFloat16:
      return launch_typed<__nv_bfloat16>(images, out, any_contrast, grey_sums, stream);
    case OutType::kFloat32:
      return launch_typed<float>(images, out, any_contrast, grey_sums, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace batchwire
