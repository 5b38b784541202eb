// Torch binding of the CUDA kernel: checks, packs the per-image table into pinned memory, copies
// it to the device asynchronously and launches on the current stream (no host synchronisation
// when the parameter tensors are on the CPU, as the pipeline passes them). That fresh host table
// per call is why the op is tagged cudagraph_unsafe (augment_op.cpp): a CUDA graph replay would
// reuse the captured copy, i.e. the boxes and jitter of the call it captured.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "augment_kernel.cuh"
#include "augment_op.h"

namespace batchwire {
namespace {

cuda::OutType out_type(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return cuda::OutType::kUInt8;
    case at::kHalf:
      return cuda::OutType::kFloat16;
    case at::kBFloat16:
      return cuda::OutType::kBFloat16;
    default:
      return cuda::OutType::kFloat32;
  }
}

void augment_batch_cuda(at::TensorList images, const at::Tensor& boxes, const at::Tensor& flips,
                        const at::Tensor& jitter, const at::Tensor& mean, const at::Tensor& std,
                        const at::Tensor& out) {
  const std::vector<at::Tensor> imgs = images.vec();
  check_args(imgs, boxes, flips, jitter, mean, std, out);
  const int64_t n = out.size(0);
  if (n == 0) return;
  const std::vector<SampleParams> params = read_params(boxes, flips, jitter);
  const Normalize nz = make_normalize(mean, std, out.scalar_type());
  const c10::cuda::CUDAGuard guard(out.device());

  at::Tensor host = at::empty({static_cast<int64_t>(n * sizeof(cuda::ImageDesc))},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* table = reinterpret_cast<cuda::ImageDesc*>(host.data_ptr<uint8_t>());
  bool any_contrast = false;
  for (int64_t i = 0; i < n; ++i) {
    const SampleParams& p = params[i];
    const at::Tensor& img = imgs[i];
    table[i] = cuda::ImageDesc{img.data_ptr<uint8_t>(), static_cast<int>(img.size(0)),
                               static_cast<int>(img.size(1)), static_cast<int>(img.size(2)),
                               p.y0, p.x0, p.y1, p.x1, p.brightness, p.contrast, p.saturation,
                               p.hue, p.flip ? 1 : 0};
    any_contrast = any_contrast || p.contrast != 1.f;
  }
  // The caching host allocator keeps `host` alive until this copy has run.
  const at::Tensor device_table = host.to(out.device(), /*non_blocking=*/true);

  cuda::OutDesc od{};
  od.data = out.data_ptr();
  od.type = out_type(out.scalar_type());
  od.n = static_cast<int>(n);
  od.height = static_cast<int>(out.size(2));
  od.width = static_cast<int>(out.size(3));
  od.stride_n = out.stride(0);
  od.stride_c = out.stride(1);
  od.stride_h = out.stride(2);
  od.stride_w = out.stride(3);
  for (int c = 0; c < 3; ++c) {
    od.scale[c] = nz.scale[c];
    od.bias[c] = nz.bias[c];
  }
  at::Tensor grey_scratch;
  if (any_contrast) {
    grey_scratch = at::empty({cuda::grey_scratch_floats(od)}, out.options().dtype(at::kFloat));
  }
  const cudaError_t err = cuda::launch_augment(
      reinterpret_cast<const cuda::ImageDesc*>(device_table.data_ptr<uint8_t>()), od,
      any_contrast, any_contrast ? grey_scratch.data_ptr<float>() : nullptr,
      c10::cuda::getCurrentCUDAStream());  // = at::cuda::getCurrentCUDAStream()
  TORCH_CHECK(err == cudaSuccess, "augment_batch: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace batchwire

TORCH_LIBRARY_IMPL(batchwire, CUDA, m) {
  m.impl("augment_batch", &batchwire::augment_batch_cuda);
}
