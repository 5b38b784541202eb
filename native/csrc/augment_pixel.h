// The CUDA kernel's per-pixel arithmetic, host-and-device so that the tests can run exactly
// this code on a machine without a GPU (cuda_emulation.cpp) against the reference.
#pragma once

#include "augment_desc.h"
#include "filter_math.h"
#include "hue_math.h"

namespace batchwire {
namespace cuda {

BW_HD float clamp255(float v) { return v < 0.f ? 0.f : (v > 255.f ? 255.f : v); }

BW_HD float grey(const float* p) { return kGreyR * p[0] + kGreyG * p[1] + kGreyB * p[2]; }

// Resampled RGB pixel (oy, ox) of image `im` for an out_h x out_w output, brightness applied:
// the separable triangle filter evaluated on the fly, normalised by the product of both axes'
// weight sums.
BW_HD void resample_pixel(const ImageDesc& im, int out_h, int out_w, int oy, int ox, float* rgb) {
  const AxisSpan ys = axis_span(im.y0, axis_scale(im.y0, im.y1, out_h), im.height, oy);
  const int sx = im.flip ? out_w - 1 - ox : ox;
  const AxisSpan xs = axis_span(im.x0, axis_scale(im.x0, im.x1, out_w), im.width, sx);
  float wx_sum = 0.f;
  for (int k = 0; k < xs.count; ++k) wx_sum += tap_weight(xs, xs.start + k);
  float acc[3] = {0.f, 0.f, 0.f};
  float wy_sum = 0.f;
  const int64_t row_elems = static_cast<int64_t>(im.width) * im.channels;
  for (int ky = 0; ky < ys.count; ++ky) {
    const float wy = tap_weight(ys, ys.start + ky);
    wy_sum += wy;
    const uint8_t* row = im.pixels + (ys.start + ky) * row_elems;
    float r[3] = {0.f, 0.f, 0.f};
    if (im.channels == 3) {
      for (int kx = 0; kx < xs.count; ++kx) {
        const float wx = tap_weight(xs, xs.start + kx);
        const uint8_t* p = row + 3 * (xs.start + kx);
        r[0] += wx * p[0];
        r[1] += wx * p[1];
        r[2] += wx * p[2];
      }
    } else {
      for (int kx = 0; kx < xs.count; ++kx) {
        r[0] += tap_weight(xs, xs.start + kx) * row[xs.start + kx];
      }
      r[1] = r[2] = r[0];
    }
    acc[0] += wy * r[0];
    acc[1] += wy * r[1];
    acc[2] += wy * r[2];
  }
  const float total = wy_sum * wx_sum;
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int c = 0; c < 3; ++c) {
    const float v = acc[c] * inv;
    rgb[c] = im.brightness != 1.f ? clamp255(v * im.brightness) : v;
  }
}

// Contrast (towards the image's grey mean), saturation (towards the pixel's grey), then hue.
BW_HD void jitter_pixel(const ImageDesc& im, float grey_mean, float* rgb) {
  if (im.contrast != 1.f) {
    for (int c = 0; c < 3; ++c) {
      rgb[c] = clamp255(im.contrast * rgb[c] + (1.f - im.contrast) * grey_mean);
    }
  }
  if (im.saturation != 1.f) {
    const float g = grey(rgb);
    for (int c = 0; c < 3; ++c) {
      rgb[c] = clamp255(im.saturation * rgb[c] + (1.f - im.saturation) * g);
    }
  }
  if (im.hue != 0.f) rotate_hue(rgb[0], rgb[1], rgb[2], im.hue);
}

}  // namespace cuda
}  // namespace batchwire
