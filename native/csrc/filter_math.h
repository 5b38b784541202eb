// The resampling filter shared by the CPU kernel, the CUDA kernel and (in Python) the
// reference: PIL's BILINEAR with a box. Torch-free so that plain nvcc compiles it.
//
// For output index i over a source span [b0, b1) of an axis of length `in_size`:
//   scale  = (b1 - b0) / out_size
//   fscale = max(scale, 1)          (the triangle widens only when shrinking: antialiasing)
//   centre = b0 + (i + 0.5) * scale
//   taps   = [trunc(centre - fscale + 0.5), trunc(centre + fscale + 0.5)) clipped to the axis
//   w(x)   = triangle((x - centre + 0.5) / fscale), normalised to sum 1 over the taps.
#pragma once

#ifdef __CUDACC__
#define BW_HD __host__ __device__ __forceinline__
#else
#define BW_HD inline
#endif

namespace batchwire {

// Grey level weights (ITU-R 601), used by contrast and saturation.
constexpr float kGreyR = 0.299f;
constexpr float kGreyG = 0.587f;
constexpr float kGreyB = 0.114f;

BW_HD float triangle(float x) {
  x = x < 0.f ? -x : x;
  return x < 1.f ? 1.f - x : 0.f;
}

struct AxisSpan {
  float centre;   // filter centre in source pixel coordinates
  float inv_fs;   // 1 / fscale
  int start;      // first tap
  int count;      // number of taps (>= 1 for a box inside the axis)
};

// Scale of one axis: source pixels per output pixel.
BW_HD float axis_scale(float b0, float b1, int out_size) { return (b1 - b0) / out_size; }

BW_HD AxisSpan axis_span(float b0, float scale, int in_size, int i) {
  AxisSpan s;
  const float fscale = scale > 1.f ? scale : 1.f;
  s.centre = b0 + (i + 0.5f) * scale;
  s.inv_fs = 1.f / fscale;
  int lo = static_cast<int>(s.centre - fscale + 0.5f);  // truncation, as PIL
  int hi = static_cast<int>(s.centre + fscale + 0.5f);
  lo = lo < 0 ? 0 : lo;
  hi = hi > in_size ? in_size : hi;
  s.start = lo;
  s.count = hi > lo ? hi - lo : 0;
  return s;
}

// Unnormalised weight of source pixel x for span s.
BW_HD float tap_weight(const AxisSpan& s, int x) {
  return triangle((x - s.centre + 0.5f) * s.inv_fs);
}

// Upper bound of taps per output pixel for a given scale (PIL's ksize).
BW_HD int max_taps(float scale) {
  const float fscale = scale > 1.f ? scale : 1.f;
  int support = static_cast<int>(fscale);
  if (static_cast<float>(support) < fscale) support += 1;
  return 2 * support + 1;
}

}  // namespace batchwire
