// Region-of-interest JPEG decoding with libjpeg-turbo's libjpeg API: decode only the rows and
// columns a random-resized crop will read, at a DCT scale, into RGB.
//
// Why not TurboJPEG: its 2.x API (what PyTurboJPEG < 2 binds) cannot crop, and a crop of a
// typical training sample is about half the image. Here rows above the region are entropy
// decoded only (jpeg_skip_scanlines), columns outside it skip the IDCT, upsampling and colour
// conversion (jpeg_crop_scanline), and rows below it are entropy decoded only too when `verify`
// asks (the default, and what the server does), so that corrupt data anywhere in the file fails
// as it fails a full decode.
//
// Errors (strict): libjpeg reports fatal errors through error_exit and recoverable ones
// (corrupt data, premature end of file) as warnings (emit_message with msg_level -1) after which
// it carries on with made-up pixels. Both jump back here and become a JpegRoiError, so no
// warning ever leaves a decoded region. One warning is let through, as the TurboJPEG path in
// pipeline/decode/backends.py does: "extraneous bytes before marker" for a marker that is not
// EOI or a restart marker, i.e. stray bytes between header segments (the pixels are whole; PIL
// and djpeg accept them). Extraneous bytes before EOI or RSTn mean the entropy-coded data did
// not end where the image did (a corrupt, desynchronised scan) and fail like any warning.
// Arithmetic-coded frames are refused (`unsupported_frame` in jpeg_strict.h: libjpeg cannot
// tell their garbage from data). The setjmp function holds no C++ objects with destructors, so
// the longjmp skips nothing that needs unwinding.
//
// What each path verifies:
// - Region path (any JPEG without a restart layout), `verify` on: every byte libjpeg would read
//   in a full decode: the header, every scan's entropy-coded data (rows above the region by
//   jpeg_skip_scanlines, the region's by decoding, the rest by skipping to the last row and
//   jpeg_finish_decompress, which reads up to EOI), strictly. Exactly what a full strict decode
//   (`check_jpeg`) rejects, for about the cost of the entropy decoding of the rows outside the
//   region. With `verify` off (tests, benchmarks): only what is read, plus a missing EOI marker.
//   A progressive file is read whole at jpeg_start_decompress either way.
// - Restart path (a file whose restart intervals tile its MCU rows, as pipeline-prepare writes
//   them): the header (libjpeg parses the same tables in the small JPEG; APPn other than
//   JFIF/Adobe and COM are not looked at), the structure of the whole scan (restart markers
//   RST0..RST7 in order, exactly as many intervals as the frame has MCUs for, EOI: see
//   `damaged` in jpeg_restart.h), and the entropy-coded data of the intervals under the region
//   plus one MCU of context, strictly (each interval must decode to exactly its MCUs: a short or
//   long one hits a marker early or leaves bytes before the next). The other intervals' data is
//   not decoded: damage there that keeps the markers intact is caught by pipeline-prepare's
//   check of every interval when it wrote the file, and by checksums (issue 20, item 3).
//   The small JPEG's entropy-coded data is read by our own baseline Huffman decoder
//   (jpeg_fast_huffman.h: libjpeg-turbo reads files with restart markers with its slow one
//   only), which gives libjpeg's coefficients and hands anything but sound intervals back to
//   libjpeg's decoder, whose verdict is then the one given.
//   Where pipeline-prepare recorded an interval index (jpeg_index.h) that agrees with the file,
//   the layout comes from it instead of a scan of every entropy-coded byte: the same structure
//   is checked (every interval boundary is the restart marker of its number, the count is the
//   frame's, EOI ends the file) by looking at the boundaries alone; an index that disagrees in
//   any way is ignored and the file scanned.
// - `check_jpeg`: the whole file strictly (any colour space) plus the restart structure.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "jpeg_fast_huffman.h"
#include "jpeg_index.h"
#include "jpeg_restart.h"
#include "jpeg_strict.h"

namespace py = pybind11;

namespace {

using batchwire_jpeg::ErrorManager;
using batchwire_jpeg::install_strict;

struct Request {
  const unsigned char* data;
  std::size_t size;
  long long y0, x0, y1, x1;  // wanted region in the scaled, stored (unoriented) image
  int scale_denom;
  bool verify;    // entropy decode the rows below the region too (see the file comment)
  bool restarts;  // enter a file with a restart layout at its markers
  bool fast_entropy;  // the restart path's small JPEG: our entropy decoder (jpeg_fast_huffman.h)
};

struct Region {
  unsigned char* pixels;  // malloc'd (height x width x 3), owned by the caller on success
  int full_height, full_width;  // the whole image at this scale
  int y0, x0, height, width;    // the region decoded: rows exact, columns widened to iMCUs
  bool has_eoi;
};

// Whether an EOI marker follows the first scan's header. Entropy-coded data never contains
// 0xFF 0xD9 (0xFF is always stuffed), so one found there is the end of the image; without it
// the file is truncated, which the rows we skip would otherwise hide.
bool has_eoi_after(const unsigned char* data, std::size_t size, std::size_t from) {
  for (std::size_t i = size; i >= from + 2; --i) {
    if (data[i - 2] == 0xFF && data[i - 1] == 0xD9) return true;
  }
  return false;
}

long long clamp(long long v, long long lo, long long hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Plain C control flow only between setjmp and every libjpeg call (see the file comment).
// Returns true on success; on failure writes the reason into `message`. With `fast` (the
// caller's, so that its `gave_up` outlives the longjmp), the scan is entropy decoded by
// jpeg_fast_huffman.h's decoder where it qualifies; a failure with `fast->gave_up` set is its
// giving up, which the caller answers by decoding again without it.
bool decode_region(const Request& req, Region* out, char* message, std::size_t message_size,
                   batchwire_jpeg::FastEntropy* fast = nullptr) {
  jpeg_decompress_struct cinfo;
  ErrorManager jerr;
  out->pixels = nullptr;
  unsigned char* volatile scratch = nullptr;
  std::memset(&cinfo, 0, sizeof cinfo);  // destroying it is safe even if creating it failed
  install_strict(reinterpret_cast<j_common_ptr>(&cinfo), &jerr);
  if (setjmp(jerr.jump)) {
    jpeg_destroy_decompress(&cinfo);
    std::free(out->pixels);
    std::free(scratch);
    out->pixels = nullptr;
    std::snprintf(message, message_size, "%s", jerr.message);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, req.data, static_cast<unsigned long>(req.size));
  jpeg_read_header(&cinfo, TRUE);
  if (const char* why = batchwire_jpeg::unsupported_frame(cinfo)) {
    std::snprintf(jerr.message, sizeof jerr.message, "%s", why);
    std::longjmp(jerr.jump, 1);
  }
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    std::snprintf(jerr.message, sizeof jerr.message, "CMYK/YCCK JPEGs are not decoded here");
    std::longjmp(jerr.jump, 1);
  }
  out->has_eoi = has_eoi_after(req.data, req.size, req.size - cinfo.src->bytes_in_buffer);
  cinfo.out_color_space = JCS_EXT_RGB;  // greyscale is expanded by the colour converter
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  cinfo.scale_num = 1;
  cinfo.scale_denom = static_cast<unsigned int>(req.scale_denom);
  jpeg_calc_output_dimensions(&cinfo);
  out->full_height = static_cast<int>(cinfo.output_height);
  out->full_width = static_cast<int>(cinfo.output_width);
  const long long y0 = clamp(req.y0, 0, out->full_height);
  const long long y1 = clamp(req.y1, 0, out->full_height);
  const long long x0 = clamp(req.x0, 0, out->full_width);
  const long long x1 = clamp(req.x1, 0, out->full_width);
  if (y1 <= y0 || x1 <= x0) {
    std::snprintf(jerr.message, sizeof jerr.message,
                  "region (%lld, %lld, %lld, %lld) is empty in the %dx%d image", req.y0, req.x0,
                  req.y1, req.x1, out->full_width, out->full_height);
    std::longjmp(jerr.jump, 1);
  }
  jpeg_start_decompress(&cinfo);
  JDIMENSION xoffset = static_cast<JDIMENSION>(x0);
  JDIMENSION width = static_cast<JDIMENSION>(x1 - x0);
  if (width < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoffset, &width);
  if (fast != nullptr) batchwire_jpeg::install_fast_entropy(&cinfo, fast);
  out->y0 = static_cast<int>(y0);
  out->x0 = static_cast<int>(xoffset);
  out->height = static_cast<int>(y1 - y0);
  out->width = static_cast<int>(width);
  const std::size_t stride = static_cast<std::size_t>(width) * 3;
  out->pixels = static_cast<unsigned char*>(std::malloc(stride * out->height));
  if (out->pixels == nullptr) {
    std::snprintf(jerr.message, sizeof jerr.message, "out of memory for a %ux%d region", width,
                  out->height);
    std::longjmp(jerr.jump, 1);
  }
  if (y0 > 0 && jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(y0)) != y0) {
    std::snprintf(jerr.message, sizeof jerr.message, "could not skip to row %lld", y0);
    std::longjmp(jerr.jump, 1);
  }
  while (cinfo.output_scanline < y1) {
    JSAMPROW row = out->pixels + (cinfo.output_scanline - y0) * stride;
    if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
      std::snprintf(jerr.message, sizeof jerr.message, "no data for row %u",
                    cinfo.output_scanline);
      std::longjmp(jerr.jump, 1);
    }
  }
  if (req.verify) {
    // Entropy decode the rest (skipping costs no IDCT) and read up to EOI, so that a corrupt
    // or truncated tail fails here as it fails a full decode. Skipping straight to the end
    // would not: libjpeg short-cuts that without reading, so the last row is decoded.
    const JDIMENSION last = cinfo.output_height - 1;
    if (cinfo.output_scanline < last) {
      jpeg_skip_scanlines(&cinfo, last - cinfo.output_scanline);
    }
    if (cinfo.output_scanline == last) {
      scratch = static_cast<unsigned char*>(std::malloc(stride));
      if (scratch == nullptr) {
        std::snprintf(jerr.message, sizeof jerr.message, "out of memory for a row");
        std::longjmp(jerr.jump, 1);
      }
      JSAMPROW row = scratch;
      jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
  } else {
    jpeg_abort_decompress(&cinfo);
  }
  jpeg_destroy_decompress(&cinfo);
  std::free(scratch);
  return true;
}

// Entropy decodes a whole JPEG (any colour space, CMYK/YCCK included) with the strict error
// handling above, producing no pixels but the last row's: the check OpenCV-decoded JPEGs get,
// since OpenCV's own libjpeg ignores every warning. Returns true when the file is sound.
bool check_stream(const unsigned char* data, std::size_t size, char* message,
                  std::size_t message_size) {
  jpeg_decompress_struct cinfo;
  ErrorManager jerr;
  unsigned char* volatile scratch = nullptr;
  std::memset(&cinfo, 0, sizeof cinfo);
  install_strict(reinterpret_cast<j_common_ptr>(&cinfo), &jerr);
  if (setjmp(jerr.jump)) {
    jpeg_destroy_decompress(&cinfo);
    std::free(scratch);
    std::snprintf(message, message_size, "%s", jerr.message);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  if (const char* why = batchwire_jpeg::unsupported_frame(cinfo)) {
    std::snprintf(jerr.message, sizeof jerr.message, "%s", why);
    std::longjmp(jerr.jump, 1);
  }
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    cinfo.out_color_space = JCS_CMYK;
  }
  cinfo.scale_num = 1;
  cinfo.scale_denom = 8;  // the one row decoded at the end is cheap
  jpeg_start_decompress(&cinfo);
  const JDIMENSION last = cinfo.output_height - 1;
  if (last > 0) jpeg_skip_scanlines(&cinfo, last);
  if (cinfo.output_scanline == last) {
    scratch = static_cast<unsigned char*>(
        std::malloc(static_cast<std::size_t>(cinfo.output_width) * cinfo.output_components));
    if (scratch == nullptr) {
      std::snprintf(jerr.message, sizeof jerr.message, "out of memory for a row");
      std::longjmp(jerr.jump, 1);
    }
    JSAMPROW row = scratch;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  std::free(scratch);
  return true;
}

// The restart layout of a file, checked: false, with the reason in `message`, when the header
// promises restart intervals that tile the MCU rows but the scan breaks that promise (markers out
// of order, intervals missing or extra, no EOI). `*entered` says whether the layout can be used.
// `use_index`: take the layout from the file's interval index where it agrees with the file
// (jpeg_index.h), else scan; the strict whole-file check scans always.
bool check_restart_layout(const unsigned char* data, std::size_t size,
                          batchwire_jpeg::RestartLayout* layout, bool* entered, char* message,
                          std::size_t message_size, bool use_index) {
  bool damaged = false;
  const std::string why = use_index
                              ? batchwire_jpeg::find_layout_fast(data, size, layout, &damaged)
                              : batchwire_jpeg::find_restart_layout(data, size, layout, &damaged);
  *entered = why.empty();
  if (damaged) {
    std::snprintf(message, message_size, "Corrupt JPEG data: restart intervals: %s",
                  why.c_str());
  }
  return !damaged;
}

// For a file with restart markers that tile its MCU rows (what pipeline-prepare writes): copy
// the intervals under the region plus one MCU of context on every side (`context_rect`, which
// says why) into a small JPEG and decode that instead, asking it for the same region, so that
// libjpeg skips and crops exactly as it would in the whole file: the same region comes back,
// with the same pixels, for a fraction of the entropy decoding. Any error in the small JPEG is
// the file's (its bytes are the file's intervals and tables) and fails the decode. Returns
// false with `*tried` false, nothing allocated, when the region is empty (the caller's decode
// reports that).
bool decode_from_restarts(const Request& req, const batchwire_jpeg::RestartLayout& layout,
                          Region* out, bool* tried, char* message, std::size_t message_size) {
  const long long d = req.scale_denom;
  const long long full_h = (layout.height + d - 1) / d, full_w = (layout.width + d - 1) / d;
  const long long y0 = clamp(req.y0, 0, full_h), y1 = clamp(req.y1, 0, full_h);
  const long long x0 = clamp(req.x0, 0, full_w), x1 = clamp(req.x1, 0, full_w);
  *tried = y1 > y0 && x1 > x0;
  if (!*tried) return false;
  const batchwire_jpeg::McuRect rect =
      batchwire_jpeg::context_rect(layout, y0 * d, x0 * d, y1 * d, x1 * d);
  const std::unique_ptr<std::uint8_t[]> small(
      new std::uint8_t[batchwire_jpeg::assembled_size_bound(layout, rect)]);
  const std::size_t small_size =
      batchwire_jpeg::assemble_rect_into(req.data, layout, rect, small.get());
  const long long oy = rect.row0 * layout.mcu_height / d, ox = rect.col0 * layout.mcu_width / d;
  const Request sub{small.get(), small_size, y0 - oy, x0 - ox, y1 - oy, x1 - ox,
                    req.scale_denom, true, false, false};
  // Our entropy decoder first; where it gives up (data that is not a sound interval), libjpeg's
  // own decodes the small JPEG again and gives its verdict (jpeg_fast_huffman.h).
  bool decoded = false;
  if (req.fast_entropy) {
    batchwire_jpeg::FastEntropy fast;
    fast.gave_up = false;
    decoded = decode_region(sub, out, message, message_size, &fast);
    if (!decoded && !fast.gave_up) return false;
  }
  if (!decoded && !decode_region(sub, out, message, message_size)) return false;
  out->y0 += static_cast<int>(oy);
  out->x0 += static_cast<int>(ox);
  out->full_height = static_cast<int>(full_h);
  out->full_width = static_cast<int>(full_w);
  out->has_eoi = true;  // the scan or the index found the original's EOI
  return true;
}

// The region `req` asks for, by the restart path where the file has a usable layout and
// `req.restarts`, else by reading the file (see the file comment for what each verifies).
bool decode_request(const Request& req, Region* out, char* message, std::size_t message_size) {
  if (req.size < 2) {
    std::snprintf(message, message_size, "not a JPEG (fewer than 2 bytes)");
    return false;
  }
  batchwire_jpeg::RestartLayout layout;
  bool entered = false;
  if (!check_restart_layout(req.data, req.size, &layout, &entered, message, message_size,
                            req.restarts)) {
    return false;
  }
  if (entered && req.restarts) {
    bool tried = false;
    if (decode_from_restarts(req, layout, out, &tried, message, message_size)) return true;
    if (tried) return false;
  }
  if (!decode_region(req, out, message, message_size)) return false;
  if (!out->has_eoi && !req.verify) {
    std::free(out->pixels);
    out->pixels = nullptr;
    std::snprintf(message, message_size, "Premature end of JPEG file (no EOI marker)");
    return false;
  }
  return true;
}

class JpegRoiError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The buffer's bytes (held until the info goes), or ValueError for anything but contiguous bytes.
const py::buffer_info contiguous_bytes(const py::buffer& data) {
  py::buffer_info info = data.request();
  if (info.itemsize != 1 || info.ndim != 1 || info.strides[0] != 1) {
    throw py::value_error("data must be a contiguous bytes-like object");
  }
  return info;
}

py::tuple decode_jpeg_roi(const py::buffer& data, long long y0, long long x0, long long y1,
                          long long x1, int scale_denom, bool verify, bool restarts,
                          bool fast_entropy) {
  if (scale_denom != 1 && scale_denom != 2 && scale_denom != 4 && scale_denom != 8) {
    throw py::value_error("scale_denom must be 1, 2, 4 or 8, got " + std::to_string(scale_denom));
  }
  const py::buffer_info info = contiguous_bytes(data);  // holds the bytes until return
  Request req{static_cast<const unsigned char*>(info.ptr), static_cast<std::size_t>(info.size),
              y0, x0, y1, x1, scale_denom, verify, restarts, fast_entropy};
  Region region{};
  char message[JMSG_LENGTH_MAX + 64];
  bool ok;
  {
    py::gil_scoped_release release;
    ok = decode_request(req, &region, message, sizeof message);
  }
  if (!ok) throw JpegRoiError(message);
  py::capsule owner(region.pixels, [](void* p) { std::free(p); });
  py::array_t<std::uint8_t> pixels({region.height, region.width, 3}, region.pixels, owner);
  return py::make_tuple(
      pixels, py::make_tuple(region.y0, region.x0, region.y0 + region.height,
                             region.x0 + region.width),
      py::make_tuple(region.full_height, region.full_width));
}

void check_jpeg(const py::buffer& data) {
  const py::buffer_info info = contiguous_bytes(data);
  char message[JMSG_LENGTH_MAX + 64];
  bool ok;
  const auto* bytes = static_cast<const unsigned char*>(info.ptr);
  const auto size = static_cast<std::size_t>(info.size);
  {
    py::gil_scoped_release release;
    batchwire_jpeg::RestartLayout layout;
    bool entered = false;
    ok = size >= 2 &&
         check_restart_layout(bytes, size, &layout, &entered, message, sizeof message, false) &&
         check_stream(bytes, size, message, sizeof message);
  }
  if (!ok) throw JpegRoiError(size < 2 ? "not a JPEG (fewer than 2 bytes)" : message);
}

// (layout dict, "") for a file the restart path reads, else (None, why not).
py::tuple restart_layout(const py::buffer& data) {
  const py::buffer_info info = contiguous_bytes(data);
  batchwire_jpeg::RestartLayout layout;
  std::string why = batchwire_jpeg::find_layout_fast(
      static_cast<const std::uint8_t*>(info.ptr), static_cast<std::size_t>(info.size), &layout);
  if (!why.empty()) return py::make_tuple(py::none(), why);
  py::dict d;
  d["height"] = layout.height;
  d["width"] = layout.width;
  d["mcu_height"] = layout.mcu_height;
  d["mcu_width"] = layout.mcu_width;
  d["mcu_rows"] = layout.mcu_rows;
  d["mcus_per_row"] = layout.mcus_per_row;
  d["interval"] = layout.interval;
  d["intervals"] = layout.begin.size();
  return py::make_tuple(d, "");
}

// Whether the file's interval index agrees with it, so that the restart path and
// crop_bitstream use it rather than scanning.
bool index_agrees(const py::buffer& data) {
  const py::buffer_info info = contiguous_bytes(data);
  batchwire_jpeg::RestartLayout layout;
  return batchwire_jpeg::layout_from_index(static_cast<const std::uint8_t*>(info.ptr),
                                           static_cast<std::size_t>(info.size), &layout)
      .empty();
}

// pipeline-prepare's last step: the file with its interval index (jpeg_index.h).
py::bytes with_interval_index(const py::buffer& data) {
  const py::buffer_info info = contiguous_bytes(data);
  std::string why;
  std::vector<std::uint8_t> out;
  {
    py::gil_scoped_release release;
    out = batchwire_jpeg::with_interval_index(static_cast<const std::uint8_t*>(info.ptr),
                                              static_cast<std::size_t>(info.size), &why);
  }
  if (!why.empty()) throw py::value_error("no restart layout to index: " + why);
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
}

// Whether a file's header (or its first bytes) holds an interval index: True, False, or None
// when the header runs past the bytes given.
py::object has_interval_index(const py::buffer& data) {
  const py::buffer_info info = contiguous_bytes(data);
  const int found = batchwire_jpeg::index_presence(static_cast<const std::uint8_t*>(info.ptr),
                                                   static_cast<std::size_t>(info.size));
  if (found < 0) return py::none();
  return py::bool_(found == 1);
}

// (small JPEG bytes, (y0, x0, y1, x1) the file's pixels it holds) covering full-size rows
// [y0, y1) and columns [x0, x1), or None when the file has no restart layout.
py::object crop_bitstream(const py::buffer& data, long long y0, long long x0, long long y1,
                          long long x1) {
  const py::buffer_info info = contiguous_bytes(data);
  const auto* bytes = static_cast<const std::uint8_t*>(info.ptr);
  batchwire_jpeg::RestartLayout layout;
  batchwire_jpeg::McuRect rect{};
  bool cut = false;
  {
    // Byte work on the caller's immutable buffer (kept alive by `info`), so other producers'
    // Python runs meanwhile. The interval index, where pipeline-prepare wrote one that agrees
    // with the file, spares the scan for restart markers (jpeg_index.h).
    py::gil_scoped_release release;
    if (batchwire_jpeg::find_layout_fast(bytes, static_cast<std::size_t>(info.size), &layout)
            .empty()) {
      rect = batchwire_jpeg::context_rect(layout, y0, x0, y1, x1);
      cut = rect.row1 > rect.row0 && rect.col1 > rect.col0;
    }
  }
  if (!cut) return py::none();
  // The small JPEG is written straight into the `bytes` returned (allocated at its bound, with
  // the GIL, then shrunk in place): nobody else holds it while the GIL is released.
  const std::size_t bound = batchwire_jpeg::assembled_size_bound(layout, rect);
  PyObject* small = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(bound));
  if (small == nullptr) throw py::error_already_set();
  std::size_t size;
  {
    py::gil_scoped_release release;
    size = batchwire_jpeg::assemble_rect_into(
        bytes, layout, rect, reinterpret_cast<std::uint8_t*>(PyBytes_AS_STRING(small)));
  }
  if (_PyBytes_Resize(&small, static_cast<Py_ssize_t>(size)) != 0) throw py::error_already_set();
  const int top = rect.row0 * layout.mcu_height, left = rect.col0 * layout.mcu_width;
  const int bottom = std::min(layout.height, rect.row1 * layout.mcu_height);
  const int right = std::min(layout.width, rect.col1 * layout.mcu_width);
  return py::make_tuple(py::reinterpret_steal<py::bytes>(small),
                        py::make_tuple(top, left, bottom, right));
}

// ---- read_header's fast path (pipeline/decode/headers.py) ----------------------------------
//
// read_header asks TurboJPEG for a JPEG's size and colour space (tjDecompressHeader3: a libjpeg
// handle made and destroyed per call, through ctypes) and walks the header again in Python for
// the EXIF orientation (exif.py): about 8 us an image, a quarter of the GPU path's CPU per image
// on prepared files. `jpeg_header` answers both in one call: jpeg_read_header on a libjpeg
// handle kept per thread (reset by jpeg_abort_decompress, libjpeg's documented way to reuse one)
// and exif.py's walk and IFD0 lookup, ported line for line. It only ever answers "yes": for a
// header that libjpeg reads without error, Huffman-coded, greyscale or 3-component YCbCr/RGB with
// a sampling TurboJPEG names (4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, the chroma at 1x1), TurboJPEG's
// call returns the same size and a colour space read_header routes to "jpeg". Anything else
// (CMYK/YCCK, odd sampling, arithmetic coding, an error, a tables-only stream) gets None, and
// read_header asks TurboJPEG as before, so every refusal and its message stay TurboJPEG's.
// Warnings are ignored, as TurboJPEG's header call ignores them (the decoders judge the data).

struct LenientErrors {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
};

[[noreturn]] void lenient_error_exit(j_common_ptr cinfo) {
  std::longjmp(reinterpret_cast<LenientErrors*>(cinfo->err)->jump, 1);
}

void ignore_message(j_common_ptr, int) {}

struct HeaderReader {
  jpeg_decompress_struct cinfo;
  LenientErrors jerr;
  bool made = false;
  ~HeaderReader() {
    if (made) jpeg_destroy_decompress(&cinfo);
  }
};

// The sampling of a greyscale or YCbCr/RGB frame that TurboJPEG's getSubsamp names: the luma's
// factors are 1x1, 2x1, 2x2, 1x2 or 4x1 and both chroma components' 1x1.
bool turbo_names_sampling(const jpeg_decompress_struct& c) {
  if (c.num_components == 1) return c.jpeg_color_space == JCS_GRAYSCALE;
  if (c.num_components != 3 || (c.jpeg_color_space != JCS_YCbCr && c.jpeg_color_space != JCS_RGB)) {
    return false;
  }
  for (int k = 1; k < 3; ++k) {
    if (c.comp_info[k].h_samp_factor != 1 || c.comp_info[k].v_samp_factor != 1) return false;
  }
  const int h = c.comp_info[0].h_samp_factor, v = c.comp_info[0].v_samp_factor;
  return (v == 1 && (h == 1 || h == 2 || h == 4)) || (v == 2 && (h == 1 || h == 2));
}

// The frame's size when the header qualifies (see above); false otherwise. Plain C control flow
// between setjmp and the libjpeg calls.
bool libjpeg_header(const std::uint8_t* data, std::size_t size, int* height, int* width) {
  thread_local HeaderReader reader;
  jpeg_decompress_struct* const cinfo = &reader.cinfo;
  if (!reader.made) {
    std::memset(cinfo, 0, sizeof *cinfo);
    cinfo->err = jpeg_std_error(&reader.jerr.pub);
    reader.jerr.pub.error_exit = lenient_error_exit;
    reader.jerr.pub.emit_message = ignore_message;
    if (setjmp(reader.jerr.jump)) {
      jpeg_destroy_decompress(cinfo);  // safe on a half-made handle (its memset)
      return false;
    }
    jpeg_create_decompress(cinfo);
    reader.made = true;
  }
  if (setjmp(reader.jerr.jump)) {
    jpeg_abort_decompress(cinfo);
    return false;
  }
  jpeg_mem_src(cinfo, data, static_cast<unsigned long>(size));
  const bool ok = jpeg_read_header(cinfo, FALSE) == JPEG_HEADER_OK && !cinfo->arith_code &&
                  turbo_names_sampling(*cinfo);
  if (ok) {
    *height = static_cast<int>(cinfo->image_height);
    *width = static_cast<int>(cinfo->image_width);
  }
  jpeg_abort_decompress(cinfo);
  return ok;
}

// exif.py's `_jpeg_exif`, step for step: the TIFF payload of the first "Exif" APP1 segment.
bool jpeg_exif(const std::uint8_t* data, std::size_t n, const std::uint8_t** tiff,
               std::size_t* tiff_size) {
  if (n < 4 || data[0] != 0xFF || data[1] != 0xD8) return false;
  std::size_t pos = 2;
  while (pos + 4 <= n) {
    if (data[pos] != 0xFF) return false;  // lost sync
    const std::uint8_t marker = data[pos + 1];
    if (marker == 0xFF) {  // fill byte
      pos += 1;
      continue;
    }
    if (marker == 0xD9 || marker == 0xDA) return false;
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) {
      pos += 2;
      continue;
    }
    const std::size_t length = static_cast<std::size_t>((data[pos + 2] << 8) | data[pos + 3]);
    if (length < 2) return false;
    const std::size_t start = pos + 4, end = pos + 2 + length;
    if (marker == 0xE1 && end <= n && start + 6 <= n &&
        std::memcmp(data + start, "Exif\0\0", 6) == 0) {
      *tiff = data + start + 6;
      *tiff_size = end > start + 6 ? end - (start + 6) : 0;
      return true;
    }
    pos = end;
  }
  return false;
}

// exif.py's `orientation_from_tiff`, step for step: IFD0's Orientation, 1 if absent or bad.
int orientation_from_tiff(const std::uint8_t* b, std::size_t len) {
  if (len < 8) return 1;
  bool little;
  if (std::memcmp(b, "II*\0", 4) == 0) {
    little = true;
  } else if (std::memcmp(b, "MM\0*", 4) == 0) {
    little = false;
  } else {
    return 1;
  }
  auto u16 = [&](std::size_t at) -> std::uint32_t {
    return little ? b[at] | (b[at + 1] << 8) : (b[at] << 8) | b[at + 1];
  };
  auto u32 = [&](std::size_t at) -> std::uint64_t {
    return little ? u16(at) | (static_cast<std::uint64_t>(u16(at + 2)) << 16)
                  : (static_cast<std::uint64_t>(u16(at)) << 16) | u16(at + 2);
  };
  const std::uint64_t ifd = u32(4);
  if (ifd < 8 || ifd + 2 > len) return 1;
  const std::uint64_t count =
      std::min<std::uint64_t>({u16(ifd), 1024, (len - ifd - 2) / 12});  // exif.py's bounds
  for (std::uint64_t k = 0; k < count; ++k) {
    const std::size_t at = static_cast<std::size_t>(ifd + 2 + 12 * k);
    if (u16(at) != 0x0112) continue;
    const std::uint32_t type = u16(at + 2);
    const std::uint64_t n = u32(at + 4);
    std::uint64_t value;
    if (type == 3 && n >= 1) {  // SHORT, the standard type; LONG from some writers
      value = u16(at + 8);
    } else if (type == 4 && n >= 1) {
      value = u32(at + 8);
    } else {
      return 1;
    }
    return value >= 1 && value <= 8 ? static_cast<int>(value) : 1;
  }
  return 1;
}

// (height, width, EXIF orientation) as stored (orientation not applied), or None: see above.
py::object jpeg_header(const py::buffer& data) {
  const py::buffer_info info = contiguous_bytes(data);
  const auto* bytes = static_cast<const std::uint8_t*>(info.ptr);
  const auto size = static_cast<std::size_t>(info.size);
  int height = 0, width = 0;
  if (!libjpeg_header(bytes, size, &height, &width)) return py::none();
  const std::uint8_t* tiff = nullptr;
  std::size_t tiff_size = 0;
  const int orientation = jpeg_exif(bytes, size, &tiff, &tiff_size)
                              ? orientation_from_tiff(tiff, tiff_size)
                              : 1;
  return py::make_tuple(height, width, orientation);
}

}  // namespace

// jpeg_transcode.cpp: lossless rewriting for pipeline-prepare, in this module so that both
// share one build and one strict error policy.
void register_transcode(py::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Region-of-interest JPEG decoding (libjpeg-turbo) for batchwire's CPU decode path.";
  py::register_exception<JpegRoiError>(m, "JpegRoiError", PyExc_ValueError);
  m.def("decode_jpeg_roi", &decode_jpeg_roi, py::arg("data"), py::arg("y0"), py::arg("x0"),
        py::arg("y1"), py::arg("x1"), py::arg("scale_denom") = 1, py::arg("verify") = true,
        py::arg("restarts") = true, py::arg("fast_entropy") = true,
        R"(Decodes rows [y0, y1) and at least columns [x0, x1) of a JPEG, as RGB, at 1/scale_denom.

Coordinates are in the stored (EXIF-unoriented) image at that scale and are clamped to it.
Returns (pixels HxWx3 uint8, (ry0, rx0, ry1, rx1) the region decoded, (height, width) of the
whole scaled image): libjpeg widens the columns to iMCU boundaries. With restarts, a file whose
restart intervals tile its MCU rows is read through a small JPEG of the intervals under the
region (their data strictly, the whole scan's structure); otherwise with verify the rest of the
file is entropy decoded too, so corrupt or truncated data anywhere raises JpegRoiError (a
ValueError), as a full decode would; without it only a missing EOI marker is checked.
fast_entropy=False makes the restart path use libjpeg's own entropy decoder rather than ours
(the same pixels and verdicts, slower): for tests and benchmarks that compare the two.)");
  m.def("check_jpeg", &check_jpeg, py::arg("data"),
        R"(Entropy decodes a whole JPEG (CMYK/YCCK too) strictly, producing no pixels, and checks
the structure of its restart intervals where the header promises ones that tile the MCU rows.

Raises JpegRoiError (a ValueError) for the corrupt or truncated data a full decode would warn
about; returns None for a sound file.)");
  m.def("restart_layout", &restart_layout, py::arg("data"),
        R"(Where a JPEG's restart intervals lie: (dict, "") when decode_jpeg_roi can enter the
file at its restart markers (sequential Huffman, one scan, intervals tiling the MCU rows),
else (None, the reason). The layout comes from the file's interval index where it agrees
with the file (index_agrees), else from a scan.)");
  m.def("index_agrees", &index_agrees, py::arg("data"),
        R"(Whether the JPEG's interval index (pipeline-prepare's APP9 segment) is present and agrees
with the file, so that the restart path and crop_bitstream read the layout from it.)");
  m.def("with_interval_index", &with_interval_index, py::arg("data"),
        R"(The JPEG with an interval index segment (APP9, just before the SOS) recording where each
restart interval begins, any earlier one dropped: ValueError when it has no restart layout.)");
  m.def("has_interval_index", &has_interval_index, py::arg("data"),
        R"(Whether the JPEG's header holds an interval index segment (valid or not): True or
False, or None when the header runs past the bytes given.)");
  m.def("jpeg_header", &jpeg_header, py::arg("data"),
        R"((height, width, EXIF orientation) of a JPEG as stored, or None: what TurboJPEG's
header call and exif.py's walk give, for a header libjpeg reads without error that is
Huffman-coded greyscale or YCbCr/RGB at a sampling TurboJPEG names; None for anything else.)");
  m.def("crop_bitstream", &crop_bitstream, py::arg("data"), py::arg("y0"), py::arg("x0"),
        py::arg("y1"), py::arg("x1"),
        R"(A small JPEG of the whole restart intervals covering full-size rows [y0, y1) and
columns [x0, x1) of the stored image, and (y0, x0, y1, x1) the pixels of the file it holds;
None when the file has no restart layout. The intervals cover the region plus one MCU of context
on every side, but its own edges replicate in upsampling where an independent decoder reads
them: the region itself decodes as in the whole file.)");
  m.def("fast_entropy_gave_up", &batchwire_jpeg::fast_entropy_gave_up,
        R"(How many restart-path decodes in this process the fast entropy decoder handed back to
libjpeg's (data that is not a sound interval): for tests; sound files never need it.)");
  m.attr("LIBJPEG_VERSION") = JPEG_LIB_VERSION;
  register_transcode(m);
}
