// Shared by the CPU and CUDA implementations of batchwire::augment_batch: argument checks and
// the per-sample parameters read from the (host) parameter tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace batchwire {

// One sample's parameters, as the kernels consume them.
struct SampleParams {
  float y0, x0, y1, x1;           // crop box, source pixel coordinates, end-exclusive
  float brightness, contrast, saturation, hue;
  bool flip;
};

// Per-channel affine map from a [0, 255] pixel to the output value; identity for uint8.
struct Normalize {
  float scale[3];
  float bias[3];
};

// Validates every argument (dtype, shape, device, box inside its image, finite factors) with a
// clear TORCH_CHECK message. `images_device` is the device all images and `out` must be on.
void check_args(const std::vector<at::Tensor>& images, const at::Tensor& boxes,
                const at::Tensor& flips, const at::Tensor& jitter, const at::Tensor& mean,
                const at::Tensor& std, const at::Tensor& out);

// Reads the (already checked) parameter tensors on the host, one entry per sample.
std::vector<SampleParams> read_params(const at::Tensor& boxes, const at::Tensor& flips,
                                      const at::Tensor& jitter);

// (x / 255 - mean) / std as x * scale + bias; identity for uint8 outputs.
Normalize make_normalize(const at::Tensor& mean, const at::Tensor& std, at::ScalarType dtype);

}  // namespace batchwire
