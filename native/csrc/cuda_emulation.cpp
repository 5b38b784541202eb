// Host emulation of the CUDA kernel for tests on machines without a GPU: the same per-pixel
// code (augment_pixel.h) in the same two passes (grey sums, then pixels), writing clamped float
// RGB pixels [n][out_h][out_w][3]. Not part of the extension; the tests compile it on its own.
#include <vector>

#include "augment_pixel.h"

extern "C" void batchwire_emulate_cuda(const batchwire::cuda::ImageDesc* images, int n,
                                       int out_h, int out_w, float* out) {
  using namespace batchwire::cuda;
  for (int i = 0; i < n; ++i) {
    const ImageDesc& im = images[i];
    float mean = 0.f;
    if (im.contrast != 1.f) {
      // The kernel sums in float in a fixed order (per warp, per block, then the blocks):
      // deterministic, and different from this double sum only by rounding.
      double sum = 0.0;
      for (int y = 0; y < out_h; ++y) {
        for (int x = 0; x < out_w; ++x) {
          float rgb[3];
          resample_pixel(im, out_h, out_w, y, x, rgb);
          sum += grey(rgb);
        }
      }
      mean = static_cast<float>(sum / (static_cast<double>(out_h) * out_w));
    }
    for (int y = 0; y < out_h; ++y) {
      for (int x = 0; x < out_w; ++x) {
        float* rgb = out + ((static_cast<int64_t>(i) * out_h + y) * out_w + x) * 3;
        resample_pixel(im, out_h, out_w, y, x, rgb);
        jitter_pixel(im, mean, rgb);
      }
    }
  }
}
