// Lossless JPEG rewriting for pipeline-prepare: any 8-bit JPEG (baseline, progressive,
// arithmetic coded) becomes a single-scan baseline Huffman JPEG with a restart marker every
// `restart_interval` MCUs, from its quantised DCT coefficients, so that no pixel changes. The
// ROI decoder can then cut a crop's MCUs out of the entropy-coded data between markers.
//
// What is kept: the coefficients, quantisation tables, sampling factors and component ids
// (jpeg_copy_critical_parameters), and every APPn and COM marker of the source, verbatim and in
// their order. libjpeg's own JFIF APP0 and Adobe APP14 are switched off instead of skipped in
// the copy: a decoder infers the colour space from those markers and the component ids, so a
// verbatim copy is read exactly as the source was, with no duplicate and no invented marker.
// What changes: progressive and arithmetic-coded sources become sequential Huffman; Huffman
// tables are optimised for the file (offsetting part of the markers' cost); a DRI segment and
// the RSTn markers appear; bytes after EOI are dropped. CMYK and YCCK are rewritten like any
// other colour space (the coefficients are all there is). The frame is SOF0 (baseline) unless a
// source quantisation table holds values above 255, which libjpeg then writes as SOF1.
//
// Verification (`verify`) decodes what was written again: the coefficients of every component
// must equal the source's, and a full decode of both files with identical settings (ISLOW IDCT,
// fancy upsampling; RGB, greyscale or CMYK output) must give the same bytes.
//
// Errors: the strict policy of jpeg_strict.h (every libjpeg warning fails, bar stray bytes
// between header segments), so a corrupt or truncated source is refused, never rewritten.
// Failures are told apart by where they happen: reading the source (corrupt, or unsupported
// such as 12-bit or lossless JPEG), writing, or verifying. Each setjmp function keeps its state
// in a struct owned by its caller, so nothing the longjmp crosses needs a destructor and no
// local modified after setjmp is read after the jump.
#include <pybind11/pybind11.h>

#include <algorithm>

#include <csetjmp>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "jpeg_strict.h"

namespace py = pybind11;

namespace {

using batchwire_jpeg::ErrorManager;
using batchwire_jpeg::install_strict;

// libjpeg's virtual arrays (the whole image's coefficients) may not grow beyond this per
// decompressor unless the caller says otherwise: a 2 kB file whose header claims 60000x60000
// fails cleanly instead of allocating gigabytes. 1 GiB holds a ~350-megapixel 4:2:0 photo.
constexpr long long kDefaultMaxMemory = 1LL << 30;

enum class Failure { none, corrupt, unsupported, cannot_write, mismatch };

struct Bytes {
  const unsigned char* data;
  std::size_t size;
};

// A growing output buffer (malloc'd) behind libjpeg's destination interface. libjpeg's own
// jpeg_mem_dest keeps its latest buffer where an error cannot reach it; this one is always
// reachable from the caller's struct, so every error path frees it.
struct GrowingDest {
  jpeg_destination_mgr pub;
  unsigned char* buffer;
  std::size_t capacity;
};

void dest_init(j_compress_ptr) {}

boolean dest_grow(j_compress_ptr cinfo) {
  auto* dest = reinterpret_cast<GrowingDest*>(cinfo->dest);
  const std::size_t grown = dest->capacity * 2;
  auto* bigger = static_cast<unsigned char*>(std::realloc(dest->buffer, grown));
  if (bigger == nullptr) ERREXIT1(cinfo, JERR_OUT_OF_MEMORY, 99);
  dest->pub.next_output_byte = bigger + dest->capacity;  // the full buffer is all used
  dest->pub.free_in_buffer = grown - dest->capacity;
  dest->buffer = bigger;
  dest->capacity = grown;
  return TRUE;
}

void dest_term(j_compress_ptr) {}

std::size_t dest_used(const GrowingDest& dest) { return dest.capacity - dest.pub.free_in_buffer; }

// Read errors that say "libjpeg cannot do this", not "the file is damaged".
bool unsupported_code(int code) {
  switch (code) {
    case JERR_BAD_PRECISION:     // 12-bit data
    case JERR_SOF_UNSUPPORTED:   // lossless, hierarchical
    case JERR_NOT_COMPILED:
    case JERR_ARITH_NOTIMPL:
    case JERR_EMPTY_IMAGE:       // height given by a DNL marker
    case JERR_IMAGE_TOO_BIG:
    case JERR_WIDTH_OVERFLOW:
    case JERR_NO_BACKING_STORE:  // over the memory limit
    case JERR_OUT_OF_MEMORY:
      return true;
    default:
      return false;
  }
}

// Ends the current setjmp function with `why` as the message.
[[noreturn]] void fail(ErrorManager* err, const char* why) {
  std::snprintf(err->message, sizeof err->message, "%s", why);
  std::longjmp(err->jump, 1);
}

void open_source(j_decompress_ptr cinfo, ErrorManager* err, Bytes in, long long max_memory) {
  cinfo->err = &err->pub;  // shared by every libjpeg object of one setjmp function
  jpeg_create_decompress(cinfo);
  cinfo->mem->max_memory_to_use = static_cast<long>(max_memory);
  jpeg_mem_src(cinfo, in.data, static_cast<unsigned long>(in.size));
}

// Whether the coefficients (and what gives them meaning: block counts, sampling factors,
// quantisation tables) of every component are equal; the first difference goes into `why`.
// Both objects must have been read with jpeg_read_coefficients. Plain C control flow: libjpeg
// errors here jump to the caller's setjmp.
bool same_coefficients(j_decompress_ptr a, jvirt_barray_ptr* ca, j_decompress_ptr b,
                       jvirt_barray_ptr* cb, char* why, std::size_t why_size) {
  if (a->image_width != b->image_width || a->image_height != b->image_height ||
      a->num_components != b->num_components || a->jpeg_color_space != b->jpeg_color_space) {
    std::snprintf(why, why_size, "frame differs: %ux%u %d components (space %d) vs %ux%u %d (%d)",
                  a->image_width, a->image_height, a->num_components, a->jpeg_color_space,
                  b->image_width, b->image_height, b->num_components, b->jpeg_color_space);
    return false;
  }
  for (int ci = 0; ci < a->num_components; ++ci) {
    const jpeg_component_info* x = &a->comp_info[ci];
    const jpeg_component_info* y = &b->comp_info[ci];
    if (x->component_id != y->component_id || x->h_samp_factor != y->h_samp_factor ||
        x->v_samp_factor != y->v_samp_factor || x->width_in_blocks != y->width_in_blocks ||
        x->height_in_blocks != y->height_in_blocks) {
      std::snprintf(why, why_size, "component %d: id, sampling or size differs", ci);
      return false;
    }
    if (x->quant_table == nullptr || y->quant_table == nullptr ||
        std::memcmp(x->quant_table->quantval, y->quant_table->quantval,
                    sizeof x->quant_table->quantval) != 0) {
      std::snprintf(why, why_size, "component %d: quantisation table differs", ci);
      return false;
    }
    const std::size_t row_bytes = sizeof(JBLOCK) * x->width_in_blocks;
    for (JDIMENSION row = 0; row < x->height_in_blocks; ++row) {
      JBLOCKARRAY xa = (*a->mem->access_virt_barray)(reinterpret_cast<j_common_ptr>(a), ca[ci],
                                                      row, 1, FALSE);
      JBLOCKARRAY yb = (*b->mem->access_virt_barray)(reinterpret_cast<j_common_ptr>(b), cb[ci],
                                                      row, 1, FALSE);
      if (std::memcmp(xa[0], yb[0], row_bytes) != 0) {
        std::snprintf(why, why_size, "component %d: coefficients differ in block row %u", ci, row);
        return false;
      }
    }
  }
  return true;
}

// ---- pixels --------------------------------------------------------------------------------

struct PixelPair {  // owned by the caller of same_pixels
  jpeg_decompress_struct a, b;
  ErrorManager err;
  unsigned char* row_a;
  unsigned char* row_b;
};

void set_output(j_decompress_ptr cinfo) {
  switch (cinfo->jpeg_color_space) {
    case JCS_YCbCr:
    case JCS_RGB:
      cinfo->out_color_space = JCS_RGB;
      break;
    case JCS_GRAYSCALE:
      cinfo->out_color_space = JCS_GRAYSCALE;
      break;
    case JCS_CMYK:
    case JCS_YCCK:
      cinfo->out_color_space = JCS_CMYK;
      break;
    default:  // unknown spaces (2 or 5+ components) are decoded as stored
      break;
  }
  cinfo->dct_method = JDCT_ISLOW;
  cinfo->do_fancy_upsampling = TRUE;
}

// Opens `x` and `y` on two decompressors sharing one error manager and reads both headers;
// errors longjmp to the caller's setjmp (nothing here needs unwinding).
void open_pair(jpeg_decompress_struct* a, jpeg_decompress_struct* b, ErrorManager* err, Bytes x,
               Bytes y, long long max_memory) {
  open_source(a, err, x, max_memory);
  open_source(b, err, y, max_memory);
  jpeg_read_header(a, TRUE);
  jpeg_read_header(b, TRUE);
}

// Decodes both JPEGs in lockstep, one row at a time, and compares the rows byte for byte.
// Returns 1 when equal, 0 when they differ (reason in `why`), -1 when either cannot be decoded
// (message in p->err.message).
int same_pixels(PixelPair* p, Bytes x, Bytes y, long long max_memory, char* why,
                std::size_t why_size) {
  if (setjmp(p->err.jump)) return -1;
  open_pair(&p->a, &p->b, &p->err, x, y, max_memory);
  set_output(&p->a);
  set_output(&p->b);
  jpeg_start_decompress(&p->a);
  jpeg_start_decompress(&p->b);
  if (p->a.output_width != p->b.output_width || p->a.output_height != p->b.output_height ||
      p->a.output_components != p->b.output_components) {
    std::snprintf(why, why_size, "decoded sizes differ: %ux%ux%d vs %ux%ux%d",
                  p->a.output_width, p->a.output_height, p->a.output_components,
                  p->b.output_width, p->b.output_height, p->b.output_components);
    return 0;
  }
  const std::size_t stride = static_cast<std::size_t>(p->a.output_width) * p->a.output_components;
  p->row_a = static_cast<unsigned char*>(std::malloc(stride));
  p->row_b = static_cast<unsigned char*>(std::malloc(stride));
  if (p->row_a == nullptr || p->row_b == nullptr) fail(&p->err, "out of memory for a row");
  while (p->a.output_scanline < p->a.output_height) {
    const JDIMENSION row = p->a.output_scanline;
    JSAMPROW ra = p->row_a;
    JSAMPROW rb = p->row_b;
    if (jpeg_read_scanlines(&p->a, &ra, 1) != 1 || jpeg_read_scanlines(&p->b, &rb, 1) != 1) {
      fail(&p->err, "a decoder returned no row");
    }
    if (std::memcmp(p->row_a, p->row_b, stride) != 0) {
      std::snprintf(why, why_size, "decoded pixels differ in row %u", row);
      return 0;
    }
  }
  jpeg_finish_decompress(&p->a);
  jpeg_finish_decompress(&p->b);
  return 1;
}

// same_pixels with its state set up and released here. Returns as same_pixels; `message`
// receives the reason for 0 and -1.
int compare_pixels(Bytes x, Bytes y, long long max_memory, char* message, std::size_t size) {
  PixelPair p;
  std::memset(&p, 0, sizeof p);  // destroying a zeroed object is a no-op
  install_strict(reinterpret_cast<j_common_ptr>(&p.a), &p.err);
  const int result = same_pixels(&p, x, y, max_memory, message, size);
  if (result < 0) std::snprintf(message, size, "%s", p.err.message);
  jpeg_destroy_decompress(&p.a);
  jpeg_destroy_decompress(&p.b);
  std::free(p.row_a);
  std::free(p.row_b);
  return result;
}

// ---- coefficients of two files ---------------------------------------------------------------

struct CoefficientPair {  // owned by the caller of same_coefficients_of
  jpeg_decompress_struct a, b;
  ErrorManager err;
};

int same_coefficients_of(CoefficientPair* p, Bytes x, Bytes y, long long max_memory, char* why,
                         std::size_t why_size) {
  if (setjmp(p->err.jump)) return -1;
  open_pair(&p->a, &p->b, &p->err, x, y, max_memory);
  jvirt_barray_ptr* ca = jpeg_read_coefficients(&p->a);
  jvirt_barray_ptr* cb = jpeg_read_coefficients(&p->b);
  return same_coefficients(&p->a, ca, &p->b, cb, why, why_size) ? 1 : 0;
}

int compare_coefficients(Bytes x, Bytes y, long long max_memory, char* message,
                         std::size_t size) {
  CoefficientPair p;
  std::memset(&p, 0, sizeof p);
  install_strict(reinterpret_cast<j_common_ptr>(&p.a), &p.err);
  const int result = same_coefficients_of(&p, x, y, max_memory, message, size);
  if (result < 0) std::snprintf(message, size, "%s", p.err.message);
  jpeg_destroy_decompress(&p.a);
  jpeg_destroy_decompress(&p.b);
  return result;
}

// ---- the rewrite ---------------------------------------------------------------------------

struct Settings {
  unsigned int restart_interval;
  bool fit_rows;  // restart_interval is the most: use the largest that divides the MCU rows
  bool optimize;
  bool verify;
  long long max_memory;
};

struct Rewrite {  // owned by the caller of rewrite()
  jpeg_decompress_struct src;
  jpeg_compress_struct dst;
  jpeg_decompress_struct check;  // the written file, read back for verification
  ErrorManager err;
  GrowingDest out;
  Failure stage;  // what a failure at this point means
};

void attach_dest(j_compress_ptr cinfo, GrowingDest* dest, std::size_t first_capacity) {
  dest->capacity = first_capacity < 4096 ? 4096 : first_capacity;
  dest->buffer = static_cast<unsigned char*>(std::malloc(dest->capacity));
  if (dest->buffer == nullptr) ERREXIT1(cinfo, JERR_OUT_OF_MEMORY, 98);
  dest->pub.init_destination = dest_init;
  dest->pub.empty_output_buffer = dest_grow;
  dest->pub.term_destination = dest_term;
  dest->pub.next_output_byte = dest->buffer;
  dest->pub.free_in_buffer = dest->capacity;
  cinfo->dest = &dest->pub;
}

// MCUs per row of the one scan the writer emits: an MCU spans max_h_samp_factor blocks of
// several interleaved components, or one block of a single component.
unsigned int mcus_per_row(const jpeg_compress_struct& c) {
  int hmax = 1;
  for (int i = 0; i < c.num_components; ++i) hmax = std::max(hmax, c.comp_info[i].h_samp_factor);
  const unsigned long width = c.image_width;
  if (c.num_components == 1) {
    const unsigned long h = static_cast<unsigned long>(c.comp_info[0].h_samp_factor);
    return static_cast<unsigned int>((width * h + hmax * DCTSIZE - 1) / (hmax * DCTSIZE));
  }
  return static_cast<unsigned int>((width + hmax * DCTSIZE - 1) / (hmax * DCTSIZE));
}

// The largest interval up to `most` MCUs that divides a row of `per_row` MCUs: intervals then
// tile the rows, which the decoder's restart path needs to cut out a rectangle.
unsigned int fitting_interval(unsigned int most, unsigned int per_row) {
  for (unsigned int d = std::min(most, per_row); d > 1; --d) {
    if (per_row % d == 0) return d;
  }
  return 1;
}

// Reads `in`'s coefficients, writes them to w->out as described in the file comment, and with
// `verify` reads the result back and compares coefficients. Returns false with w->stage saying
// which step failed and w->err.message why.
bool rewrite(Rewrite* w, Bytes in, const Settings& s) {
  if (setjmp(w->err.jump)) return false;
  w->stage = Failure::corrupt;
  open_source(&w->src, &w->err, in, s.max_memory);
  jpeg_save_markers(&w->src, JPEG_COM, 0xFFFF);
  for (int n = 0; n < 16; ++n) jpeg_save_markers(&w->src, JPEG_APP0 + n, 0xFFFF);
  jpeg_read_header(&w->src, TRUE);
  jvirt_barray_ptr* coefficients = jpeg_read_coefficients(&w->src);

  w->stage = Failure::cannot_write;
  w->dst.err = &w->err.pub;
  jpeg_create_compress(&w->dst);
  jpeg_copy_critical_parameters(&w->src, &w->dst);
  w->dst.write_JFIF_header = FALSE;  // the source's own APP0 / APP14, if any, are copied below
  w->dst.write_Adobe_marker = FALSE;
  w->dst.arith_code = FALSE;
  w->dst.optimize_coding = s.optimize ? TRUE : FALSE;
  w->dst.restart_interval = s.restart_interval;
  if (s.fit_rows && s.restart_interval > 0) {
    w->dst.restart_interval = fitting_interval(s.restart_interval, mcus_per_row(w->dst));
  }
  w->dst.restart_in_rows = 0;
  // Room for the data plus a few bytes per restart marker, so most files never regrow.
  attach_dest(&w->dst, &w->out, in.size + in.size / 8 + 1024);
  jpeg_write_coefficients(&w->dst, coefficients);
  for (jpeg_saved_marker_ptr m = w->src.marker_list; m != nullptr; m = m->next) {
    jpeg_write_marker(&w->dst, m->marker, m->data, m->data_length);
  }
  jpeg_finish_compress(&w->dst);
  if (!s.verify) return true;

  w->stage = Failure::mismatch;
  open_source(&w->check, &w->err, Bytes{w->out.buffer, dest_used(w->out)}, s.max_memory);
  jpeg_read_header(&w->check, TRUE);
  jvirt_barray_ptr* written = jpeg_read_coefficients(&w->check);
  char why[JMSG_LENGTH_MAX];
  if (!same_coefficients(&w->src, coefficients, &w->check, written, why, sizeof why)) {
    fail(&w->err, why);
  }
  return true;
}

// ---- Python-facing -------------------------------------------------------------------------

class TranscodeError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};
class CorruptError : public TranscodeError {
  using TranscodeError::TranscodeError;
};
class MismatchError : public TranscodeError {
  using TranscodeError::TranscodeError;
};

Bytes view_of(const py::buffer_info& info, const char* name) {
  if (info.itemsize != 1 || info.ndim != 1 || info.strides[0] != 1) {
    throw py::value_error(std::string(name) + " must be a contiguous bytes-like object");
  }
  return Bytes{static_cast<const unsigned char*>(info.ptr), static_cast<std::size_t>(info.size)};
}

struct FreeDeleter {
  void operator()(unsigned char* p) const { std::free(p); }
};

py::bytes transcode_restart(const py::buffer& data, long long restart_interval, bool fit_rows,
                            bool optimize, bool verify, long long max_memory) {
  if (restart_interval < 0 || restart_interval > 65535) {
    throw py::value_error("restart_interval must be 0 to 65535 MCUs, got " +
                          std::to_string(restart_interval));
  }
  if (max_memory < 1) throw py::value_error("max_memory must be positive");
  const py::buffer_info info = data.request();
  const Bytes in = view_of(info, "data");
  if (in.size < 2) throw CorruptError("not a JPEG (fewer than 2 bytes)");
  const Settings settings{static_cast<unsigned int>(restart_interval), fit_rows, optimize,
                          verify, max_memory};
  Failure failure = Failure::none;
  char message[JMSG_LENGTH_MAX + 64] = "";
  std::unique_ptr<unsigned char, FreeDeleter> out;
  std::size_t out_size = 0;
  {
    py::gil_scoped_release release;
    Rewrite w;
    std::memset(&w, 0, sizeof w);
    install_strict(reinterpret_cast<j_common_ptr>(&w.src), &w.err);
    const bool ok = rewrite(&w, in, settings);
    const int code = w.err.pub.msg_code;
    jpeg_destroy_decompress(&w.src);
    jpeg_destroy_compress(&w.dst);
    jpeg_destroy_decompress(&w.check);
    out.reset(w.out.buffer);
    out_size = dest_used(w.out);
    if (!ok) {
      failure = w.stage;
      if (failure == Failure::corrupt && unsupported_code(code)) failure = Failure::unsupported;
      if (code == JERR_NO_BACKING_STORE || code == JERR_OUT_OF_MEMORY) {
        std::snprintf(message, sizeof message,
                      "too large: its coefficients need more than %lld bytes (libjpeg: %s)",
                      max_memory, w.err.message);
      } else {
        std::snprintf(message, sizeof message, "%s", w.err.message);
      }
    } else if (verify) {
      char why[JMSG_LENGTH_MAX + 64];
      const int same = compare_pixels(in, Bytes{out.get(), out_size}, max_memory, why,
                                      sizeof why);
      if (same != 1) {
        failure = Failure::mismatch;
        std::snprintf(message, sizeof message, "%s", why);
      }
    }
  }
  switch (failure) {
    case Failure::none:
      return py::bytes(reinterpret_cast<const char*>(out.get()), out_size);
    case Failure::corrupt:
      throw CorruptError(message);
    case Failure::unsupported:
      throw TranscodeError(std::string("unsupported: ") + message);
    case Failure::cannot_write:
      throw TranscodeError(std::string("cannot write: ") + message);
    case Failure::mismatch:
      throw MismatchError(std::string("verification failed: ") + message);
  }
  throw TranscodeError("unreachable");
}

py::object jpeg_difference(const py::buffer& a, const py::buffer& b, long long max_memory) {
  if (max_memory < 1) throw py::value_error("max_memory must be positive");
  const py::buffer_info ia = a.request();
  const py::buffer_info ib = b.request();
  const Bytes x = view_of(ia, "a");
  const Bytes y = view_of(ib, "b");
  if (x.size < 2 || y.size < 2) throw TranscodeError("not a JPEG (fewer than 2 bytes)");
  char message[JMSG_LENGTH_MAX + 64] = "";
  int same;
  {
    py::gil_scoped_release release;
    same = compare_coefficients(x, y, max_memory, message, sizeof message);
    if (same == 1) same = compare_pixels(x, y, max_memory, message, sizeof message);
  }
  if (same < 0) throw TranscodeError(message);
  if (same == 0) return py::str(message);
  return py::none();
}

}  // namespace

void register_transcode(py::module_& m) {
  // Translators run newest first, so the subclasses are matched before their base.
  auto& base = py::register_exception<TranscodeError>(m, "JpegTranscodeError", PyExc_ValueError);
  py::register_exception<CorruptError>(m, "JpegCorruptError", base.ptr());
  py::register_exception<MismatchError>(m, "JpegMismatchError", base.ptr());
  m.attr("TRANSCODE_MAX_MEMORY") = kDefaultMaxMemory;
  m.def("transcode_restart", &transcode_restart, py::arg("data"), py::arg("restart_interval") = 1,
        py::arg("fit_rows") = false, py::arg("optimize") = true, py::arg("verify") = true,
        py::arg("max_memory") = kDefaultMaxMemory,
        R"(Rewrites a JPEG losslessly as baseline Huffman with a restart marker every
restart_interval MCUs (0: none), keeping every APPn and COM marker; returns the new bytes.
fit_rows: restart_interval is the most; the interval is the largest that divides the MCU rows.

optimize: Huffman tables fitted to the file. verify: the result is read back and its
coefficients, and a full decode's pixels, compared with the source's. max_memory: bytes of
coefficient arrays allowed per decoder. Raises JpegCorruptError (the source is corrupt or
truncated), JpegMismatchError (verification failed) or JpegTranscodeError (unsupported, e.g.
12-bit or lossless, or too large); all are ValueErrors. The GIL is released.)");
  m.def("jpeg_difference", &jpeg_difference, py::arg("a"), py::arg("b"),
        py::arg("max_memory") = kDefaultMaxMemory,
        R"(None when two JPEGs hold the same coefficients and decode to the same pixels, else
a sentence saying where they first differ. JpegTranscodeError if either cannot be decoded.)");
}
