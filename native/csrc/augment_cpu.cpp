// CPU kernel of batchwire::augment_batch.
//
// Per output row: a vertical pass over the crop's columns (contiguous uint8 -> float, the loop
// the compiler vectorises), then a horizontal pass with precomputed taps (4-wide SSE over the
// interleaved channels), then jitter, normalisation and a write through `out`'s strides. Work is
// split over (image, row block) items run by at::parallel_for's threads; an image with
// contrast != 1 is one item, since contrast needs its whole-image grey mean before any write.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "augment_op.h"
#include "filter_math.h"

// Hot loops get an AVX2 clone picked at load time, so one build runs on any x86-64 machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BW_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BW_CLONES
#endif

namespace batchwire {
namespace {

// Taps of one axis for every output index, in output order (reversed for a flipped axis).
struct AxisTable {
  int stride = 0;              // weights per output index (max taps)
  int lo = 0, hi = 0;          // union of all taps: [lo, hi)
  std::vector<int> start, count;
  std::vector<float> weights;  // [out][stride], normalised
};

AxisTable make_axis(float b0, float b1, int in_size, int out_size, bool reverse) {
  AxisTable t;
  const float scale = axis_scale(b0, b1, out_size);
  t.stride = max_taps(scale);
  t.start.resize(out_size);
  t.count.resize(out_size);
  t.weights.assign(static_cast<size_t>(out_size) * t.stride, 0.f);
  t.lo = in_size;
  t.hi = 0;
  for (int i = 0; i < out_size; ++i) {
    const AxisSpan s = axis_span(b0, scale, in_size, i);
    const int o = reverse ? out_size - 1 - i : i;
    const int count = std::min(s.count, t.stride);
    float* w = &t.weights[static_cast<size_t>(o) * t.stride];
    double sum = 0.0;
    for (int k = 0; k < count; ++k) {
      w[k] = tap_weight(s, s.start + k);
      sum += w[k];
    }
    if (sum > 0.0) {
      for (int k = 0; k < count; ++k) w[k] = static_cast<float>(w[k] / sum);
    }
    t.start[o] = s.start;
    t.count[o] = count;
    t.lo = std::min(t.lo, s.start);
    t.hi = std::max(t.hi, s.start + count);
  }
  return t;
}

// acc[j] = sum_k w[k] * rows[k][j], j < n: the vertical pass over one output row.
BW_CLONES void vertical_pass(float* __restrict acc, const uint8_t* const* rows, const float* w,
                             int taps, int64_t n) {
  if (taps <= 0) {
    for (int64_t j = 0; j < n; ++j) acc[j] = 0.f;
    return;
  }
  {
    const uint8_t* __restrict r = rows[0];
    const float w0 = w[0];
    for (int64_t j = 0; j < n; ++j) acc[j] = w0 * static_cast<float>(r[j]);
  }
  int k = 1;
  for (; k + 1 < taps; k += 2) {
    const uint8_t* __restrict r0 = rows[k];
    const uint8_t* __restrict r1 = rows[k + 1];
    const float w0 = w[k], w1 = w[k + 1];
    for (int64_t j = 0; j < n; ++j) {
      acc[j] += w0 * static_cast<float>(r0[j]) + w1 * static_cast<float>(r1[j]);
    }
  }
  if (k < taps) {
    const uint8_t* __restrict r = rows[k];
    const float w0 = w[k];
    for (int64_t j = 0; j < n; ++j) acc[j] += w0 * static_cast<float>(r[j]);
  }
}

// dst[3 * o + c] = sum_k w[o][k] * src[3 * (start[o] + k) + c]. `src` has one float of padding
// after its last pixel, so the 4-wide load of the last pixel stays inside the buffer; likewise
// each pixel is stored 4 wide (its lane 3 lands on the next pixel's R, rewritten next), so `dst`
// needs one float of padding too.
#if defined(__SSE2__)
inline __m128 taps_rgb(__m128 acc, const float* s, const float* w, int from, int to) {
  for (int k = from; k < to; ++k) {
    acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(w[k]), _mm_loadu_ps(s + 3 * k)));
  }
  return acc;
}

void horizontal_pass_rgb(float* __restrict dst, const float* __restrict src, const AxisTable& t,
                         int out_w) {
  const auto tap_src = [&](int o) { return src + 3 * (t.start[o] - t.lo); };
  const auto tap_w = [&](int o) { return &t.weights[static_cast<size_t>(o) * t.stride]; };
  int o = 0;
  for (; o + 1 < out_w; o += 2) {  // two pixels at a time: two independent add chains
    const float *sa = tap_src(o), *sb = tap_src(o + 1), *wa = tap_w(o), *wb = tap_w(o + 1);
    const int ca = t.count[o], cb = t.count[o + 1], common = std::min(ca, cb);
    __m128 a = _mm_setzero_ps(), b = _mm_setzero_ps();
    for (int k = 0; k < common; ++k) {
      a = _mm_add_ps(a, _mm_mul_ps(_mm_set1_ps(wa[k]), _mm_loadu_ps(sa + 3 * k)));
      b = _mm_add_ps(b, _mm_mul_ps(_mm_set1_ps(wb[k]), _mm_loadu_ps(sb + 3 * k)));
    }
    _mm_storeu_ps(dst + 3 * o, taps_rgb(a, sa, wa, common, ca));
    _mm_storeu_ps(dst + 3 * o + 3, taps_rgb(b, sb, wb, common, cb));
  }
  if (o < out_w) {
    _mm_storeu_ps(dst + 3 * o, taps_rgb(_mm_setzero_ps(), tap_src(o), tap_w(o), 0, t.count[o]));
  }
}
#else
void horizontal_pass_rgb(float* __restrict dst, const float* __restrict src, const AxisTable& t,
                         int out_w) {
  for (int o = 0; o < out_w; ++o) {
    const float* s = src + 3 * (t.start[o] - t.lo);
    const float* w = &t.weights[static_cast<size_t>(o) * t.stride];
    float a0 = 0.f, a1 = 0.f, a2 = 0.f;
    for (int k = 0; k < t.count[o]; ++k) {
      a0 += w[k] * s[3 * k];
      a1 += w[k] * s[3 * k + 1];
      a2 += w[k] * s[3 * k + 2];
    }
    dst[3 * o] = a0;
    dst[3 * o + 1] = a1;
    dst[3 * o + 2] = a2;
  }
}
#endif

// Greyscale source: one channel filtered, then expanded to RGB.
void horizontal_pass_grey(float* __restrict dst, const float* __restrict src, const AxisTable& t,
                          int out_w) {
  for (int o = 0; o < out_w; ++o) {
    const float* s = src + (t.start[o] - t.lo);
    const float* w = &t.weights[static_cast<size_t>(o) * t.stride];
    float a = 0.f;
    for (int k = 0; k < t.count[o]; ++k) a += w[k] * s[k];
    dst[3 * o] = dst[3 * o + 1] = dst[3 * o + 2] = a;
  }
}

inline float clamp255(float v) { return std::min(std::max(v, 0.f), 255.f); }

BW_CLONES void scale_clamp(float* px, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) px[j] = clamp255(px[j] * factor);
}

// v = clamp(f * v + (1 - f) * target) with target the pixel's grey (saturation) or `mean`.
void blend_grey(float* px, int w, float f, bool per_pixel, float mean) {
  const float g = 1.f - f;
  for (int o = 0; o < w; ++o) {
    float* p = px + 3 * o;
    const float t = per_pixel ? kGreyR * p[0] + kGreyG * p[1] + kGreyB * p[2] : mean;
    p[0] = clamp255(f * p[0] + g * t);
    p[1] = clamp255(f * p[1] + g * t);
    p[2] = clamp255(f * p[2] + g * t);
  }
}

template <typename T>
inline T convert(float v, float scale, float bias);
template <>
inline uint8_t convert<uint8_t>(float v, float, float) {
  // Round half to even without a libm call: adding 1.5 * 2^23 leaves no fraction bits, so the
  // FPU's default rounding (to nearest even) does the work. Valid for |v| < 2^22.
  constexpr float kMagic = 12582912.f;
  return static_cast<uint8_t>((clamp255(v) + kMagic) - kMagic);
}
template <>
inline float convert<float>(float v, float scale, float bias) { return v * scale + bias; }
template <>
inline c10::Half convert<c10::Half>(float v, float scale, float bias) {
  return c10::Half(v * scale + bias);
}
template <>
inline c10::BFloat16 convert<c10::BFloat16>(float v, float scale, float bias) {
  return c10::BFloat16(v * scale + bias);
}

// Writes one RGB float row through the output strides; the two common layouts get
// contiguous inner loops.
template <typename T>
void write_row(T* base, int64_t sc, int64_t sw, const float* px, int w, const Normalize& nz) {
  if (sw == 1) {  // NCHW: three planes
    for (int c = 0; c < 3; ++c) {
      T* d = base + c * sc;
      const float s = nz.scale[c], b = nz.bias[c];
      for (int o = 0; o < w; ++o) d[o] = convert<T>(px[3 * o + c], s, b);
    }
  } else if (sc == 1 && sw == 3) {  // NHWC: interleaved, same order as px
    for (int o = 0; o < w; ++o) {
      for (int c = 0; c < 3; ++c) {
        base[3 * o + c] = convert<T>(px[3 * o + c], nz.scale[c], nz.bias[c]);
      }
    }
  } else {
    for (int o = 0; o < w; ++o) {
      for (int c = 0; c < 3; ++c) {
        base[c * sc + o * sw] = convert<T>(px[3 * o + c], nz.scale[c], nz.bias[c]);
      }
    }
  }
}

struct WorkItem {
  int image, row0, row1;
};

// Everything one image needs, built once per call.
struct ImagePlan {
  const uint8_t* pixels;
  int height, width, channels;
  AxisTable ys, xs;
  SampleParams p;
};

template <typename T>
class CpuAugment {
 public:
  CpuAugment(std::vector<ImagePlan>& plans, const at::Tensor& out, const Normalize& nz)
      : plans_(plans), nz_(nz), out_(out.data_ptr<T>()), out_h_(static_cast<int>(out.size(2))),
        out_w_(static_cast<int>(out.size(3))), sn_(out.stride(0)), sc_(out.stride(1)),
        sh_(out.stride(2)), sw_(out.stride(3)) {}

  void run(const WorkItem& item) {
    const ImagePlan& ip = plans_[item.image];
    const bool contrast = ip.p.contrast != 1.f;
    const int w3 = 3 * out_w_;
    const int span = (ip.xs.hi - ip.xs.lo) * ip.channels;
    tmp_.resize(static_cast<size_t>(span) + 1);
    rows_.resize(ip.ys.stride);
    buf_.resize(static_cast<size_t>(contrast ? out_h_ : 1) * w3 + 1);  // +1: 4-wide stores
    double grey_sum = 0.0;
    for (int oy = item.row0; oy < item.row1; ++oy) {
      float* px = buf_.data() + (contrast ? static_cast<size_t>(oy) * w3 : 0);
      resample_row(ip, oy, px);
      if (ip.p.brightness != 1.f) scale_clamp(px, w3, ip.p.brightness);
      if (contrast) {
        grey_sum += row_grey_sum(px);
      } else {
        finish_row(ip, item.image, oy, px);
      }
    }
    if (contrast) {
      const float mean = static_cast<float>(grey_sum / (static_cast<double>(out_h_) * out_w_));
      for (int oy = 0; oy < out_h_; ++oy) {
        float* px = buf_.data() + static_cast<size_t>(oy) * w3;
        blend_grey(px, out_w_, ip.p.contrast, false, mean);
        finish_row(ip, item.image, oy, px);
      }
    }
  }

 private:
  void resample_row(const ImagePlan& ip, int oy, float* px) {
    const int ys = ip.ys.start[oy], taps = ip.ys.count[oy];
    const int64_t row_bytes = static_cast<int64_t>(ip.width) * ip.channels;
    for (int k = 0; k < taps; ++k) {
      rows_[k] = ip.pixels + (ys + k) * row_bytes + static_cast<int64_t>(ip.xs.lo) * ip.channels;
    }
    const int64_t span = static_cast<int64_t>(ip.xs.hi - ip.xs.lo) * ip.channels;
    vertical_pass(tmp_.data(), rows_.data(), &ip.ys.weights[static_cast<size_t>(oy) * ip.ys.stride],
                  taps, span);
    tmp_[span] = 0.f;
    if (ip.channels == 3) {
      horizontal_pass_rgb(px, tmp_.data(), ip.xs, out_w_);
    } else {
      horizontal_pass_grey(px, tmp_.data(), ip.xs, out_w_);
    }
  }

  double row_grey_sum(const float* px) const {
    double s = 0.0;
    for (int o = 0; o < out_w_; ++o) {
      s += kGreyR * px[3 * o] + kGreyG * px[3 * o + 1] + kGreyB * px[3 * o + 2];
    }
    return s;
  }

  void finish_row(const ImagePlan& ip, int n, int oy, float* px) {
    if (ip.p.saturation != 1.f) blend_grey(px, out_w_, ip.p.saturation, true, 0.f);
    write_row<T>(out_ + n * sn_ + oy * sh_, sc_, sw_, px, out_w_, nz_);
  }

  std::vector<ImagePlan>& plans_;
  const Normalize nz_;
  T* out_;
  const int out_h_, out_w_;
  const int64_t sn_, sc_, sh_, sw_;
  std::vector<float> tmp_, buf_;
  std::vector<const uint8_t*> rows_;
};

// Row blocks small enough that every thread gets work even for a small batch.
std::vector<WorkItem> make_items(const std::vector<ImagePlan>& plans, int out_h) {
  const int64_t n = static_cast<int64_t>(plans.size());
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t blocks = n >= 2 * threads ? 1 : (4 * threads + n - 1) / std::max<int64_t>(n, 1);
  const int rows = static_cast<int>(std::max<int64_t>(1, (out_h + blocks - 1) / blocks));
  std::vector<WorkItem> items;
  for (int i = 0; i < static_cast<int>(n); ++i) {
    if (plans[i].p.contrast != 1.f) {
      items.push_back({i, 0, out_h});
      continue;
    }
    for (int r = 0; r < out_h; r += rows) items.push_back({i, r, std::min(out_h, r + rows)});
  }
  return items;
}

// Items are handed out one at a time from a shared counter rather than in fixed per-thread
// blocks: on a busy machine (decode threads, other processes) a thread that loses its core
// delays only the item it holds, and uneven items (whole contrast images) balance themselves.
template <typename T>
void run_items(std::vector<ImagePlan>& plans, const std::vector<WorkItem>& items,
               const at::Tensor& out, const Normalize& nz) {
  const int64_t total = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), total);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    CpuAugment<T> worker(plans, out, nz);
    for (int64_t i = next++; i < total; i = next++) worker.run(items[i]);
  });
}

void augment_batch_cpu(at::TensorList images, const at::Tensor& boxes, const at::Tensor& flips,
                       const at::Tensor& jitter, const at::Tensor& mean, const at::Tensor& std,
                       const at::Tensor& out) {
  const std::vector<at::Tensor> imgs = images.vec();
  check_args(imgs, boxes, flips, jitter, mean, std, out);
  const std::vector<SampleParams> params = read_params(boxes, flips, jitter);
  const Normalize nz = make_normalize(mean, std, out.scalar_type());
  const int out_h = static_cast<int>(out.size(2)), out_w = static_cast<int>(out.size(3));

  // Weight tables cost microseconds per image: built serially, no thread barrier to wait on.
  std::vector<ImagePlan> plans(imgs.size());
  for (size_t i = 0; i < imgs.size(); ++i) {
    const at::Tensor& img = imgs[i];
    const SampleParams& p = params[i];
    ImagePlan& ip = plans[i];
    ip.pixels = img.data_ptr<uint8_t>();
    ip.height = static_cast<int>(img.size(0));
    ip.width = static_cast<int>(img.size(1));
    ip.channels = static_cast<int>(img.size(2));
    ip.ys = make_axis(p.y0, p.y1, ip.height, out_h, false);
    ip.xs = make_axis(p.x0, p.x1, ip.width, out_w, p.flip);
    ip.p = p;
  }
  const std::vector<WorkItem> items = make_items(plans, out_h);

  AT_DISPATCH_SWITCH(out.scalar_type(), "augment_batch_cpu",
      AT_DISPATCH_CASE(at::kByte, [&] { run_items<scalar_t>(plans, items, out, nz); })
      AT_DISPATCH_CASE(at::kFloat, [&] { run_items<scalar_t>(plans, items, out, nz); })
      AT_DISPATCH_CASE(at::kHalf, [&] { run_items<scalar_t>(plans, items, out, nz); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { run_items<scalar_t>(plans, items, out, nz); }));
}

}  // namespace
}  // namespace batchwire

TORCH_LIBRARY_IMPL(batchwire, CPU, m) {
  m.impl("augment_batch", &batchwire::augment_batch_cpu);
}
