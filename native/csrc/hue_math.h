// Hue rotation shared by the CPU kernel, the CUDA kernel and the host emulation the tests
// compile: torchvision's adjust_hue (the HSV hue moved by a fraction of a turn, value and
// saturation kept) on 0-255 floats. Written without branches (selects only) so that the CPU
// loop over a row vectorises. Torch-free so that plain nvcc compiles it.
//
// With hi = max(r, g, b), lo = min(r, g, b) and chroma = hi - lo, the hue in sixths of a turn is
// (g - b) / chroma when red is the maximum, 2 + (b - r) / chroma when green is, else
// 4 + (r - g) / chroma (red wins ties, then green, as torchvision's). Back to RGB, channel n
// (5 = red, 3 = green, 1 = blue) is hi - chroma * clamp(min(k, 4 - k), 0, 1) with k = (n + hue)
// mod 6. A grey pixel (chroma 0) has no hue and comes back unchanged.
#pragma once

#include "filter_math.h"

namespace batchwire {

BW_HD float min_f(float a, float b) { return a < b ? a : b; }
BW_HD float max_f(float a, float b) { return a > b ? a : b; }

// Channel `n` of the colour with hue `sixths`, maximum `hi` and chroma `chroma`.
BW_HD float hsv_channel(float n, float sixths, float hi, float chroma) {
  // mod 6 by truncation (which vectorises, unlike floorf): `sixths` lies in [-4, 8) for a
  // shift within half a turn, so k + 12 is positive. The result is continuous across the wrap,
  // so rounding there is harmless.
  float k = n + sixths + 12.f;
  k -= 6.f * static_cast<float>(static_cast<int>(k * (1.f / 6.f)));
  return hi - chroma * max_f(min_f(min_f(k, 4.f - k), 1.f), 0.f);
}

// Rotates the hue of (r, g, b) by `turns` (torchvision's hue_factor, in [-0.5, 0.5]).
BW_HD void rotate_hue(float& r, float& g, float& b, float turns) {
  const float hi = max_f(r, max_f(g, b));
  const float lo = min_f(r, min_f(g, b));
  const float chroma = hi - lo;
  const float inv = 1.f / (chroma > 0.f ? chroma : 1.f);  // grey: any finite hue will do
  const float from_red = (g - b) * inv;
  const float from_green = 2.f + (b - r) * inv;
  const float from_blue = 4.f + (r - g) * inv;
  const float sixths = (hi == r ? from_red : (hi == g ? from_green : from_blue)) + 6.f * turns;
  r = hsv_channel(5.f, sixths, hi, chroma);
  g = hsv_channel(3.f, sixths, hi, chroma);
  b = hsv_channel(1.f, sixths, hi, chroma);
}

}  // namespace batchwire
