// CPU kernel of batchwire::augment_batch.
//
// Per output row: a vertical pass over the crop's columns (contiguous uint8 -> float, the loop
// the compiler vectorises), then a horizontal pass with precomputed taps over the interleaved
// channels (SSE, 4 pixels per step, transposed into three planes; AVX2 + FMA where the CPU has
// it), then jitter and normalisation on the planes and a vectorised store per layout and dtype
// (uint8: cvtps2dq + saturating packs). Work is split over (image, row block) items run by
// at::parallel_for's threads, and only as many threads as the work pays for; an image with
// contrast != 1 is one item, since contrast needs its whole-image grey mean before any write.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "augment_op.h"
#include "filter_math.h"
#include "hue_math.h"

// Hot loops get an AVX2 clone picked at load time, so one build runs on any x86-64 machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BW_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BW_CLONES
#endif

// The horizontal pass also has a hand-written AVX2 + FMA version (intrinsics, so not
// target_clones), chosen at run time by cpu_has_avx2_fma().
#if defined(__x86_64__) && defined(__GNUC__)
#define BW_HAVE_AVX2_PATH 1
#endif

namespace batchwire {
namespace {

#ifdef BW_HAVE_AVX2_PATH
// BATCHWIRE_NATIVE_SIMD=baseline turns the hand-written AVX2 / F16C paths off, so that the
// portable ones can be tested (and compared) on a machine that has AVX2.
bool simd_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("BATCHWIRE_NATIVE_SIMD");
    return v == nullptr || std::strcmp(v, "baseline") != 0;
  }();
  return allowed;
}

bool cpu_has_avx2_fma() {
  static const bool has =
      simd_allowed() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

// Taps of one axis for every output index, in output order (reversed for a flipped axis).
struct AxisTable {
  int stride = 0;              // weights per output index (max taps)
  int lo = 0, hi = 0;          // union of all taps: [lo, hi)
  std::vector<int> start, count;
  std::vector<float> weights;  // [out][stride], normalised, zero past count
  // The same weights for pixel pairs (2p, 2p + 1), each broadcast 4 wide: [pair][stride][8],
  // one 8-float load per tap for the AVX2 horizontal pass. Built for the x axis only.
  std::vector<float> pair_weights;
};

// pair_weights from weights (see AxisTable); a missing last pixel of an odd width has zeros.
void make_pair_weights(AxisTable& t, int out_size) {
  const int pairs = (out_size + 1) / 2;
  t.pair_weights.assign(static_cast<size_t>(pairs) * t.stride * 8, 0.f);
  for (int o = 0; o < out_size; ++o) {
    const float* w = &t.weights[static_cast<size_t>(o) * t.stride];
    float* d = &t.pair_weights[static_cast<size_t>(o / 2) * t.stride * 8 + 4 * (o % 2)];
    for (int k = 0; k < t.stride; ++k) std::fill(d + 8 * k, d + 8 * k + 4, w[k]);
  }
}

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

// A resampled row is three planes (R, G, B) of `pitch` floats, pitch = out_w rounded up to 4:
// planar rows make jitter, normalisation and NCHW writes plain contiguous loops.
inline int plane_pitch(int out_w) { return (out_w + 3) & ~3; }

// px[c * pitch + o] = sum_k w[o][k] * src[3 * (start[o] + k) + c]. `src` has one float of
// padding after its last pixel, so the 4-wide load of the last pixel stays inside the buffer.
#if defined(__SSE2__)
// [R, G, B, junk] of output pixel o, summing taps [from, to) onto acc.
inline __m128 taps_rgb(__m128 acc, const float* s, const float* w, int from, int to) {
  for (int k = from; k < to; ++k) {
    acc = _mm_add_ps(acc, _mm_mul_ps(_mm_set1_ps(w[k]), _mm_loadu_ps(s + 3 * k)));
  }
  return acc;
}

void horizontal_pass_rgb(float* __restrict px, int pitch, const float* __restrict src,
                         const AxisTable& t, int out_w) {
  const auto tap_src = [&](int o) { return src + 3 * (t.start[o] - t.lo); };
  const auto tap_w = [&](int o) { return &t.weights[static_cast<size_t>(o) * t.stride]; };
  const auto count = [&](int o) { return o < out_w ? t.count[o] : 0; };
  for (int o = 0; o < out_w; o += 4) {
    // Four pixels at once: four independent add chains, then a 4x4 transpose turns the four
    // [R, G, B, junk] vectors into four lanes of each plane. Pixels past out_w are zero and
    // land in the planes' padding.
    const float* s[4];
    const float* w[4];
    int c[4];
    for (int q = 0; q < 4; ++q) {
      c[q] = count(o + q);
      s[q] = c[q] ? tap_src(o + q) : src;
      w[q] = c[q] ? tap_w(o + q) : nullptr;
    }
    const int common = std::min(std::min(c[0], c[1]), std::min(c[2], c[3]));
    __m128 a = _mm_setzero_ps(), b = _mm_setzero_ps(), d = _mm_setzero_ps(),
           e = _mm_setzero_ps();
    for (int k = 0; k < common; ++k) {
      a = _mm_add_ps(a, _mm_mul_ps(_mm_set1_ps(w[0][k]), _mm_loadu_ps(s[0] + 3 * k)));
      b = _mm_add_ps(b, _mm_mul_ps(_mm_set1_ps(w[1][k]), _mm_loadu_ps(s[1] + 3 * k)));
      d = _mm_add_ps(d, _mm_mul_ps(_mm_set1_ps(w[2][k]), _mm_loadu_ps(s[2] + 3 * k)));
      e = _mm_add_ps(e, _mm_mul_ps(_mm_set1_ps(w[3][k]), _mm_loadu_ps(s[3] + 3 * k)));
    }
    a = taps_rgb(a, s[0], w[0], common, c[0]);
    b = taps_rgb(b, s[1], w[1], common, c[1]);
    d = taps_rgb(d, s[2], w[2], common, c[2]);
    e = taps_rgb(e, s[3], w[3], common, c[3]);
    _MM_TRANSPOSE4_PS(a, b, d, e);
    _mm_storeu_ps(px + o, a);
    _mm_storeu_ps(px + pitch + o, b);
    _mm_storeu_ps(px + 2 * pitch + o, d);
  }
}

#ifdef BW_HAVE_AVX2_PATH
// The AVX2 + FMA horizontal pass: two pixels per 8-wide register (one per 128-bit half), four
// pixels per step. Taps run to the longest count of the four; the weights past a pixel's count
// are zero and `src` is padded with zeros (kSrcPad) so those extra taps add exact zeros.
__attribute__((target("avx2,fma"))) void horizontal_pass_rgb_avx2(
    float* __restrict px, int pitch, const float* __restrict src, const AxisTable& t, int out_w) {
  const auto tap_src = [&](int o) { return src + 3 * (t.start[std::min(o, out_w - 1)] - t.lo); };
  const auto count = [&](int o) { return o < out_w ? t.count[o] : 0; };
  const size_t pair_stride = static_cast<size_t>(t.stride) * 8;
  for (int o = 0; o < out_w; o += 4) {
    const int taps =
        std::max(std::max(count(o), count(o + 1)), std::max(count(o + 2), count(o + 3)));
    const float *s0 = tap_src(o), *s1 = tap_src(o + 1), *s2 = tap_src(o + 2), *s3 = tap_src(o + 3);
    const float* wa = &t.pair_weights[(o / 2) * pair_stride];
    const float* wb = (o + 2 < out_w) ? wa + pair_stride : wa;  // wb unused lanes: zero below
    const bool second = o + 2 < out_w;
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int k = 0; k < taps; ++k) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(wa + 8 * k), _mm256_loadu2_m128(s1 + 3 * k, s0 + 3 * k),
                          a);
      if (second) {
        b = _mm256_fmadd_ps(_mm256_loadu_ps(wb + 8 * k),
                            _mm256_loadu2_m128(s3 + 3 * k, s2 + 3 * k), b);
      }
    }
    __m128 p0 = _mm256_castps256_ps128(a), p1 = _mm256_extractf128_ps(a, 1);
    __m128 p2 = _mm256_castps256_ps128(b), p3 = _mm256_extractf128_ps(b, 1);
    _MM_TRANSPOSE4_PS(p0, p1, p2, p3);
    _mm_storeu_ps(px + o, p0);
    _mm_storeu_ps(px + pitch + o, p1);
    _mm_storeu_ps(px + 2 * pitch + o, p2);
  }
}
#endif
#else
void horizontal_pass_rgb(float* __restrict px, int pitch, const float* __restrict src,
                         const AxisTable& t, int out_w) {
  for (int o = 0; o < out_w; ++o) {
    const float* s = src + 3 * (t.start[o] - t.lo);
    const float* w = &t.weights[static_cast<size_t>(o) * t.stride];
    float a0 = 0.f, a1 = 0.f, a2 = 0.f;
    for (int k = 0; k < t.count[o]; ++k) {
      a0 += w[k] * s[3 * k];
      a1 += w[k] * s[3 * k + 1];
      a2 += w[k] * s[3 * k + 2];
    }
    px[o] = a0;
    px[pitch + o] = a1;
    px[2 * pitch + o] = a2;
  }
}
#endif

// Greyscale source: one channel filtered, then copied to the G and B planes.
void horizontal_pass_grey(float* __restrict px, int pitch, const float* __restrict src,
                          const AxisTable& t, int out_w) {
  for (int o = 0; o < out_w; ++o) {
    const float* s = src + (t.start[o] - t.lo);
    const float* w = &t.weights[static_cast<size_t>(o) * t.stride];
    float a = 0.f;
    for (int k = 0; k < t.count[o]; ++k) a += w[k] * s[k];
    px[o] = a;
  }
  std::copy(px, px + out_w, px + pitch);
  std::copy(px, px + out_w, px + 2 * pitch);
}

inline float clamp255(float v) { return std::min(std::max(v, 0.f), 255.f); }

BW_CLONES void scale_clamp(float* __restrict px, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) px[j] = clamp255(px[j] * factor);
}

// v = clamp(f * v + (1 - f) * target) with target the pixel's grey (saturation) or `mean`.
BW_CLONES void blend_grey(float* __restrict px, int pitch, int w, float f, bool per_pixel,
                          float mean) {
  const float g = 1.f - f;
  float* __restrict r = px;
  float* __restrict gr = px + pitch;
  float* __restrict b = px + 2 * pitch;
  if (per_pixel) {
    for (int o = 0; o < w; ++o) {
      const float t = g * (kGreyR * r[o] + kGreyG * gr[o] + kGreyB * b[o]);
      r[o] = clamp255(f * r[o] + t);
      gr[o] = clamp255(f * gr[o] + t);
      b[o] = clamp255(f * b[o] + t);
    }
  } else {
    const float t = g * mean;
    for (int o = 0; o < w; ++o) {
      r[o] = clamp255(f * r[o] + t);
      gr[o] = clamp255(f * gr[o] + t);
      b[o] = clamp255(f * b[o] + t);
    }
  }
}

// Each pixel of a planar row with its hue moved by `turns` (hue_math.h).
BW_CLONES void rotate_hue_row(float* __restrict px, int pitch, int w, float turns) {
  float* __restrict r = px;
  float* __restrict g = px + pitch;
  float* __restrict b = px + 2 * pitch;
  for (int o = 0; o < w; ++o) rotate_hue(r[o], g[o], b[o], turns);
}

// d[j] = s[j] clamped to [0, 255] and rounded half to even, j < n. cvtps2dq rounds with the
// MXCSR mode, round-to-nearest-even by default (as the reference's torch.round), 16 at a time
// with two saturating packs; the scalar tail uses the same instruction.
void store_u8(uint8_t* __restrict d, const float* __restrict s, int64_t n) {
  int64_t j = 0;
#if defined(__SSE2__)
  const __m128 lo = _mm_setzero_ps(), hi = _mm_set1_ps(255.f);
  const auto round4 = [&](const float* p) {
    return _mm_cvtps_epi32(_mm_min_ps(_mm_max_ps(_mm_loadu_ps(p), lo), hi));
  };
  for (; j + 16 <= n; j += 16) {
    const __m128i ab = _mm_packs_epi32(round4(s + j), round4(s + j + 4));
    const __m128i cd = _mm_packs_epi32(round4(s + j + 8), round4(s + j + 12));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + j), _mm_packus_epi16(ab, cd));
  }
  for (; j < n; ++j) {
    d[j] = static_cast<uint8_t>(_mm_cvtss_si32(_mm_min_ss(_mm_max_ss(_mm_set_ss(s[j]), lo), hi)));
  }
#else
  // Adding 1.5 * 2^23 leaves no fraction bits, so the FPU's default rounding (to nearest even)
  // does the work; valid for |v| < 2^22.
  constexpr float kMagic = 12582912.f;
  for (; j < n; ++j) d[j] = static_cast<uint8_t>((clamp255(s[j]) + kMagic) - kMagic);
#endif
}

// px[c * pitch + o] = px[c * pitch + o] * scale[c] + bias[c], o < w: float normalisation, in
// place on the planes, before an NHWC interleave.
BW_CLONES void normalise_planes(float* __restrict px, int pitch, int w, const Normalize& nz) {
  for (int c = 0; c < 3; ++c) {
    float* __restrict p = px + c * pitch;
    const float sc = nz.scale[c], bi = nz.bias[c];
    for (int o = 0; o < w; ++o) p[o] = p[o] * sc + bi;
  }
}

// d[j] = s[j] * scale + bias, j < n: one normalised NCHW float plane in one pass.
BW_CLONES void store_affine(float* __restrict d, const float* __restrict s, int n, float scale,
                            float bias) {
  for (int j = 0; j < n; ++j) d[j] = s[j] * scale + bias;
}

// d[j] = T(s[j]), j < n, rounding to nearest even (c10's conversions).
template <typename T>
BW_CLONES void store_linear(T* __restrict d, const float* __restrict s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) d[j] = T(s[j]);
}

template <>
void store_linear<float>(float* __restrict d, const float* __restrict s, int64_t n) {
  std::copy(s, s + n, d);
}

#ifdef BW_HAVE_AVX2_PATH
// float -> half with F16C, 8 at a time (c10::Half converts one value at a time in software).
// Both round to nearest even.
__attribute__((target("avx,f16c"))) void store_half_f16c(c10::Half* __restrict d,
                                                         const float* __restrict s, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; j < n; ++j) d[j] = c10::Half(s[j]);
}

bool cpu_has_f16c() {
  static const bool has =
      simd_allowed() && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}

template <>
void store_linear<c10::Half>(c10::Half* __restrict d, const float* __restrict s, int64_t n) {
  if (cpu_has_f16c()) {
    store_half_f16c(d, s, n);
  } else {
    for (int64_t j = 0; j < n; ++j) d[j] = c10::Half(s[j]);
  }
}
#endif

// dst[3 * o + c] = px[c * pitch + o]: planes back to interleaved pixels for an NHWC write.
// `dst` needs one float of padding (4-wide stores of the last pixel).
void interleave_rgb(float* __restrict dst, const float* __restrict px, int pitch, int w) {
  int o = 0;
#if defined(__SSE2__)
  for (; o + 4 <= w; o += 4) {
    __m128 r = _mm_loadu_ps(px + o), g = _mm_loadu_ps(px + pitch + o);
    __m128 b = _mm_loadu_ps(px + 2 * pitch + o), z = _mm_setzero_ps();
    _MM_TRANSPOSE4_PS(r, g, b, z);  // r..z now hold pixels o..o+3 as [R, G, B, 0]
    _mm_storeu_ps(dst + 3 * o, r);
    _mm_storeu_ps(dst + 3 * o + 3, g);
    _mm_storeu_ps(dst + 3 * o + 6, b);
    _mm_storeu_ps(dst + 3 * o + 9, z);
  }
#endif
  for (; o < w; ++o) {
    for (int c = 0; c < 3; ++c) dst[3 * o + c] = px[c * pitch + o];
  }
}

// Writes one planar row through the output strides, normalising float outputs on the way (in
// place on the planes, except for float32 NCHW which does it in its one store pass). NCHW
// writes each plane contiguously; NHWC interleaves into `scratch` (3 * w + 1 floats) and
// converts that linearly.
template <typename T>
void write_row(T* base, int64_t sc, int64_t sw, float* px, int pitch, int w, const Normalize& nz,
               float* scratch) {
  constexpr bool kU8 = std::is_same_v<T, uint8_t>;
  if constexpr (std::is_same_v<T, float>) {
    if (sw == 1) {
      for (int c = 0; c < 3; ++c) {
        store_affine(base + c * sc, px + c * pitch, w, nz.scale[c], nz.bias[c]);
      }
      return;
    }
  }
  if constexpr (!kU8) normalise_planes(px, pitch, w, nz);
  const auto store = [](T* d, const float* s, int64_t n) {
    if constexpr (kU8) {
      store_u8(d, s, n);
    } else {
      store_linear<T>(d, s, n);
    }
  };
  if (sw == 1) {
    for (int c = 0; c < 3; ++c) store(base + c * sc, px + c * pitch, w);
  } else if (sc == 1 && sw == 3) {
    interleave_rgb(scratch, px, pitch, w);
    store(base, scratch, 3 * static_cast<int64_t>(w));
  } else {  // any other dense order (a batch of one, odd strides): element by element
    for (int c = 0; c < 3; ++c) {
      for (int o = 0; o < w; ++o) store(base + c * sc + o * sw, px + c * pitch + o, 1);
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
    const int pitch = plane_pitch(out_w_);
    const int row = 3 * pitch;
    const int span = (ip.xs.hi - ip.xs.lo) * ip.channels;
    // Zero padding past the span: the 4-wide load of the last pixel, and the AVX2 pass's taps
    // past a pixel's count (up to the axis's stride).
    const size_t pad = 3 * static_cast<size_t>(ip.xs.stride) + 4;
    tmp_.resize(static_cast<size_t>(span) + pad);
    std::fill(tmp_.begin() + span, tmp_.end(), 0.f);
    rows_.resize(ip.ys.stride);
    buf_.resize(static_cast<size_t>(contrast ? out_h_ : 1) * row);
    scratch_.resize(3 * static_cast<size_t>(out_w_) + 1);
    double grey_sum = 0.0;
    for (int oy = item.row0; oy < item.row1; ++oy) {
      float* px = buf_.data() + (contrast ? static_cast<size_t>(oy) * row : 0);
      resample_row(ip, oy, px, pitch);
      if (ip.p.brightness != 1.f) scale_clamp(px, row, ip.p.brightness);
      if (contrast) {
        grey_sum += row_grey_sum(px, pitch);
      } else {
        finish_row(ip, item.image, oy, px, pitch);
      }
    }
    if (contrast) {
      const float mean = static_cast<float>(grey_sum / (static_cast<double>(out_h_) * out_w_));
      for (int oy = 0; oy < out_h_; ++oy) {
        float* px = buf_.data() + static_cast<size_t>(oy) * row;
        blend_grey(px, pitch, out_w_, ip.p.contrast, false, mean);
        finish_row(ip, item.image, oy, px, pitch);
      }
    }
  }

 private:
  void resample_row(const ImagePlan& ip, int oy, float* px, int pitch) {
    const int ys = ip.ys.start[oy], taps = ip.ys.count[oy];
    const int64_t row_bytes = static_cast<int64_t>(ip.width) * ip.channels;
    for (int k = 0; k < taps; ++k) {
      rows_[k] = ip.pixels + (ys + k) * row_bytes + static_cast<int64_t>(ip.xs.lo) * ip.channels;
    }
    const int64_t span = static_cast<int64_t>(ip.xs.hi - ip.xs.lo) * ip.channels;
    const float* wy = &ip.ys.weights[static_cast<size_t>(oy) * ip.ys.stride];
    vertical_pass(tmp_.data(), rows_.data(), wy, taps, span);
    if (ip.channels == 3) {
#ifdef BW_HAVE_AVX2_PATH
      if (!ip.xs.pair_weights.empty()) {
        horizontal_pass_rgb_avx2(px, pitch, tmp_.data(), ip.xs, out_w_);
        return;
      }
#endif
      horizontal_pass_rgb(px, pitch, tmp_.data(), ip.xs, out_w_);
    } else {
      horizontal_pass_grey(px, pitch, tmp_.data(), ip.xs, out_w_);
    }
  }

  double row_grey_sum(const float* px, int pitch) const {
    float s = 0.f;  // one row's sum: float is exact enough, the image total is double
    for (int o = 0; o < out_w_; ++o) {
      s += kGreyR * px[o] + kGreyG * px[pitch + o] + kGreyB * px[2 * pitch + o];
    }
    return s;
  }

  void finish_row(const ImagePlan& ip, int n, int oy, float* px, int pitch) {
    if (ip.p.saturation != 1.f) blend_grey(px, pitch, out_w_, ip.p.saturation, true, 0.f);
    if (ip.p.hue != 0.f) rotate_hue_row(px, pitch, out_w_, ip.p.hue);
    write_row<T>(out_ + n * sn_ + oy * sh_, sc_, sw_, px, pitch, out_w_, nz_, scratch_.data());
  }

  std::vector<ImagePlan>& plans_;
  const Normalize nz_;
  T* out_;
  const int out_h_, out_w_;
  const int64_t sn_, sc_, sh_, sw_;
  std::vector<float> tmp_, buf_, scratch_;
  std::vector<const uint8_t*> rows_;
};

// A work plan: the items, and how many threads to run them on.
struct Schedule {
  std::vector<WorkItem> items;
  int64_t workers = 1;
};

// Rough cost of one image in multiply-adds: the vertical pass over the crop's columns and the
// 4-lane horizontal pass, both with their widest tap count.
double image_cost(const ImagePlan& ip, int out_h, int out_w) {
  const double span = static_cast<double>(ip.xs.hi - ip.xs.lo) * ip.channels;
  return static_cast<double>(out_h) * (span * ip.ys.stride + 4.0 * out_w * ip.xs.stride);
}

// Work below this many multiply-adds per thread (~0.2 ms) runs on fewer threads: waking a
// thread and joining it costs microseconds on an idle machine but can cost milliseconds when
// the cores are shared (decode threads, other processes) and the joined thread waits for one.
constexpr double kMinCostPerThread = 2e6;

// Whole images are the items when there are enough of them; otherwise row blocks small enough
// that every thread gets work. An image with contrast != 1 is always one item.
Schedule make_schedule(const std::vector<ImagePlan>& plans, int out_h, int out_w) {
  const int64_t n = static_cast<int64_t>(plans.size());
  double cost = 0.0;
  for (const ImagePlan& ip : plans) cost += image_cost(ip, out_h, out_w);
  Schedule s;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  s.workers = std::clamp<int64_t>(static_cast<int64_t>(cost / kMinCostPerThread), 1, threads);
  const int64_t blocks =
      s.workers == 1 || n >= 2 * s.workers ? 1 : (4 * s.workers + n - 1) / std::max<int64_t>(n, 1);
  const int rows = static_cast<int>(std::max<int64_t>(1, (out_h + blocks - 1) / blocks));
  for (int i = 0; i < static_cast<int>(n); ++i) {
    if (plans[i].p.contrast != 1.f) {
      s.items.push_back({i, 0, out_h});
      continue;
    }
    for (int r = 0; r < out_h; r += rows) s.items.push_back({i, r, std::min(out_h, r + rows)});
  }
  s.workers = std::min<int64_t>(s.workers, static_cast<int64_t>(s.items.size()));
  return s;
}

// Items are handed out one at a time from a shared counter rather than in fixed per-thread
// blocks: on a busy machine (decode threads, other processes) a thread that loses its core
// delays only the item it holds, and uneven items (whole contrast images) balance themselves.
template <typename T>
void run_items(std::vector<ImagePlan>& plans, const Schedule& s, const at::Tensor& out,
               const Normalize& nz) {
  const int64_t total = static_cast<int64_t>(s.items.size());
  std::atomic<int64_t> next{0};
  const auto work = [&](int64_t, int64_t) {
    CpuAugment<T> worker(plans, out, nz);
    for (int64_t i = next++; i < total; i = next++) worker.run(s.items[i]);
  };
  if (s.workers <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, s.workers, 1, work);
  }
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
#ifdef BW_HAVE_AVX2_PATH
    if (ip.channels == 3 && cpu_has_avx2_fma()) make_pair_weights(ip.xs, out_w);
#endif
    ip.p = p;
  }
  const Schedule schedule = make_schedule(plans, out_h, out_w);

  AT_DISPATCH_SWITCH(out.scalar_type(), "augment_batch_cpu",
      AT_DISPATCH_CASE(at::kByte, [&] { run_items<scalar_t>(plans, schedule, out, nz); })
      AT_DISPATCH_CASE(at::kFloat, [&] { run_items<scalar_t>(plans, schedule, out, nz); })
      AT_DISPATCH_CASE(at::kHalf, [&] { run_items<scalar_t>(plans, schedule, out, nz); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { run_items<scalar_t>(plans, schedule, out, nz); }));
}

}  // namespace
}  // namespace batchwire

TORCH_LIBRARY_IMPL(batchwire, CPU, m) {
  m.impl("augment_batch", &batchwire::augment_batch_cpu);
}
