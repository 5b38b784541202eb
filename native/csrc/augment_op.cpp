// The batchwire::augment_batch schema, its argument checks, and a Meta kernel (shape-only, so
// the op traces under torch.compile / FakeTensor). CPU and CUDA kernels register elsewhere.
#include "augment_op.h"

#include <torch/library.h>
#include <torch/version.h>

#include <cmath>

namespace batchwire {
namespace {

// Boxes computed in float by a planner may overshoot the image by rounding; the filter clips
// taps to the image anyway, so a hair outside is harmless.
constexpr double kBoxSlack = 1e-3;

bool is_output_dtype(at::ScalarType t) {
  return t == at::kByte || t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

void check_param(const at::Tensor& t, const char* name, at::ScalarType dtype,
                 at::IntArrayRef shape) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "augment_batch: ", name, " must be ",
                   c10::toString(dtype), ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, "augment_batch: ", name, " must have shape ", shape,
                    ", got ", t.sizes());
}

void check_image(const at::Tensor& img, size_t i, const at::Tensor& out) {
  TORCH_CHECK_VALUE(img.defined(), "augment_batch: images[", i, "] is undefined");
  TORCH_CHECK_TYPE(img.scalar_type() == at::kByte, "augment_batch: images[", i,
                   "] must be uint8 HWC, got ", img.scalar_type());
  TORCH_CHECK_VALUE(img.dim() == 3 && (img.size(2) == 1 || img.size(2) == 3),
                    "augment_batch: images[", i, "] must be HWC with 1 or 3 channels, got shape ",
                    img.sizes());
  TORCH_CHECK_VALUE(img.size(0) >= 1 && img.size(1) >= 1, "augment_batch: images[", i,
                    "] is empty: ", img.sizes());
  TORCH_CHECK_VALUE(img.is_contiguous(), "augment_batch: images[", i, "] must be contiguous");
  TORCH_CHECK_VALUE(img.device() == out.device(), "augment_batch: images[", i, "] is on ",
                    img.device(), " but out is on ", out.device());
}

void check_box(const SampleParams& p, size_t i, int64_t h, int64_t w) {
  const bool finite = std::isfinite(p.y0) && std::isfinite(p.x0) && std::isfinite(p.y1) &&
                      std::isfinite(p.x1);
  const bool inside = finite && p.y0 >= -kBoxSlack && p.x0 >= -kBoxSlack &&
                      p.y1 <= h + kBoxSlack && p.x1 <= w + kBoxSlack && p.y1 > p.y0 &&
                      p.x1 > p.x0;
  TORCH_CHECK_VALUE(inside, "augment_batch: box ", i, " (y0, x0, y1, x1) = (", p.y0, ", ", p.x0,
                    ", ", p.y1, ", ", p.x1, ") must lie inside its ", h, "x", w,
                    " image and have a positive size");
}

void check_factors(const SampleParams& p, size_t i) {
  const float hue = p.hue;
  const bool ok = std::isfinite(p.brightness) && std::isfinite(p.contrast) &&
                  std::isfinite(p.saturation) && p.brightness >= 0.f && p.contrast >= 0.f &&
                  p.saturation >= 0.f;
  TORCH_CHECK_VALUE(ok, "augment_batch: jitter[", i, "] = (", p.brightness, ", ", p.contrast,
                    ", ", p.saturation, ", ", hue,
                    ") must have finite, non-negative brightness, contrast and saturation");
  TORCH_CHECK_VALUE(std::isfinite(hue) && hue >= -0.5f && hue <= 0.5f,
                    "augment_batch: hue jitter[", i, "][3] = ", hue,
                    " must be in [-0.5, 0.5] (turns)");
}

}  // namespace

void check_args(const std::vector<at::Tensor>& images, const at::Tensor& boxes,
                const at::Tensor& flips, const at::Tensor& jitter, const at::Tensor& mean,
                const at::Tensor& std, const at::Tensor& out) {
  TORCH_CHECK_VALUE(out.dim() == 4 && out.size(1) == 3,
                    "augment_batch: out must be [N, 3, H, W], got shape ", out.sizes());
  TORCH_CHECK_VALUE(out.size(2) >= 1 && out.size(3) >= 1, "augment_batch: out is empty: ",
                    out.sizes());
  TORCH_CHECK_TYPE(is_output_dtype(out.scalar_type()),
                   "augment_batch: out must be uint8, float16, bfloat16 or float32, got ",
                   out.scalar_type());
  TORCH_CHECK_VALUE(out.is_non_overlapping_and_dense(),
                    "augment_batch: out must be dense (contiguous or channels_last)");
  const int64_t n = out.size(0);
  TORCH_CHECK_VALUE(static_cast<int64_t>(images.size()) == n, "augment_batch: got ",
                    images.size(), " images for an out batch of ", n);
  check_param(boxes, "boxes", at::kFloat, {n, 4});
  check_param(flips, "flips", at::kBool, {n});
  check_param(jitter, "jitter", at::kFloat, {n, 4});
  check_param(mean, "mean", at::kFloat, {3});
  check_param(std, "std", at::kFloat, {3});
  for (size_t i = 0; i < images.size(); ++i) check_image(images[i], i, out);

  const std::vector<SampleParams> params = read_params(boxes, flips, jitter);
  for (size_t i = 0; i < params.size(); ++i) {
    check_box(params[i], i, images[i].size(0), images[i].size(1));
    check_factors(params[i], i);
  }
  if (out.scalar_type() != at::kByte) {
    const at::Tensor m = mean.to(at::kCPU), s = std.to(at::kCPU);
    for (int c = 0; c < 3; ++c) {
      const float mc = m[c].item<float>(), sc = s[c].item<float>();
      TORCH_CHECK_VALUE(std::isfinite(mc) && std::isfinite(sc) && sc != 0.f,
                        "augment_batch: mean/std must be finite and std non-zero, got mean[", c,
                        "] = ", mc, ", std[", c, "] = ", sc);
    }
  }
}

std::vector<SampleParams> read_params(const at::Tensor& boxes, const at::Tensor& flips,
                                      const at::Tensor& jitter) {
  const at::Tensor b = boxes.to(at::kCPU).contiguous();
  const at::Tensor f = flips.to(at::kCPU).contiguous();
  const at::Tensor j = jitter.to(at::kCPU).contiguous();
  const float* bp = b.data_ptr<float>();
  const bool* fp = f.data_ptr<bool>();
  const float* jp = j.data_ptr<float>();
  std::vector<SampleParams> out(static_cast<size_t>(b.size(0)));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = SampleParams{bp[4 * i], bp[4 * i + 1], bp[4 * i + 2], bp[4 * i + 3],
                          jp[4 * i], jp[4 * i + 1], jp[4 * i + 2], jp[4 * i + 3], fp[i]};
  }
  return out;
}

Normalize make_normalize(const at::Tensor& mean, const at::Tensor& std, at::ScalarType dtype) {
  Normalize n{};
  const at::Tensor m = mean.to(at::kCPU).contiguous(), s = std.to(at::kCPU).contiguous();
  for (int c = 0; c < 3; ++c) {
    if (dtype == at::kByte) {
      n.scale[c] = 1.f;
      n.bias[c] = 0.f;
    } else {
      const double sc = s.data_ptr<float>()[c], mc = m.data_ptr<float>()[c];
      n.scale[c] = static_cast<float>(1.0 / (255.0 * sc));
      n.bias[c] = static_cast<float>(-mc / sc);
    }
  }
  return n;
}

namespace {

// Shapes only: lets FakeTensor/torch.compile trace through the op.
void augment_batch_meta(at::TensorList images, const at::Tensor& boxes, const at::Tensor& flips,
                        const at::Tensor& jitter, const at::Tensor& mean, const at::Tensor& std,
                        const at::Tensor& out) {
  TORCH_CHECK_VALUE(out.dim() == 4 && out.size(1) == 3,
                    "augment_batch: out must be [N, 3, H, W], got shape ", out.sizes());
  TORCH_CHECK_VALUE(static_cast<int64_t>(images.size()) == out.size(0), "augment_batch: got ",
                    images.size(), " images for an out batch of ", out.size(0));
}

}  // namespace
}  // namespace batchwire

// cudagraph_unsafe: the CUDA kernel reads its per-image parameters (boxes, flips, jitter) from
// a host table that each call packs and copies anew, so a captured CUDA graph would replay the
// parameters of the captured call. The tag makes torch.compile(mode="reduce-overhead") keep the
// op out of its CUDA graphs (torch 2.8 and later know the tag).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define BATCHWIRE_OP_TAGS {at::Tag::cudagraph_unsafe}
#else
#define BATCHWIRE_OP_TAGS {}
#endif

TORCH_LIBRARY(batchwire, m) {
  m.def(
      "augment_batch(Tensor[] images, Tensor boxes, Tensor flips, Tensor jitter, Tensor mean, "
      "Tensor std, Tensor(a!) out) -> ()",
      BATCHWIRE_OP_TAGS);
}

TORCH_LIBRARY_IMPL(batchwire, Meta, m) {
  m.impl("augment_batch", &batchwire::augment_batch_meta);
}
