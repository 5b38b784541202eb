// Random access into a JPEG through its restart markers: find where every restart interval's
// entropy-coded bytes lie, and assemble a small, valid JPEG from the intervals under a rectangle
// of MCUs (jpeg_restart.cpp).
//
// Why this works: at a restart marker the encoder pads to a byte boundary and the decoder resets
// its DC predictors and bit buffer, so each interval's bytes decode on their own. A new header
// (the original's tables, a frame of the rectangle's size) followed by the chosen intervals,
// renumbered RST0..RST7 in order, is a JPEG whose every block holds exactly the original's
// coefficients. `pipeline-prepare` writes files with one MCU per interval, so the rectangle can
// be the crop's to within one MCU (16 px for 4:2:0).
//
// Pure byte work: no libjpeg calls here, so nothing here can longjmp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace batchwire_jpeg {

// A header segment kept in the small JPEG: its marker code and payload (length bytes included).
struct HeaderSegment {
  std::uint8_t marker;
  std::size_t offset;  // of the payload's two length bytes
  std::size_t length;  // payload length, as the segment's length field says
};

// Where the restart intervals of a single-scan, sequential Huffman JPEG lie.
struct RestartLayout {
  int width = 0, height = 0;          // the frame, in pixels
  int mcu_width = 0, mcu_height = 0;  // pixels per MCU
  int mcus_per_row = 0, mcu_rows = 0;
  int interval = 0;  // MCUs per restart interval (the DRI); a whole number per MCU row
  std::vector<HeaderSegment> header;  // DQT, DHT, DRI, APP0, APP14, ..., the frame and the scan
  std::size_t frame_index = 0;        // in `header`: the SOF segment, whose size is rewritten
  std::vector<std::uint32_t> begin, end;  // entropy-coded bytes of interval k: [begin, end)
};

// A rectangle of MCUs: rows [row0, row1), columns [col0, col1).
struct McuRect {
  int row0, col0, row1, col1;
};

// Fills `out` and returns an empty string when `data` is a baseline or extended sequential
// Huffman JPEG (8-bit) with one scan of all components and restart intervals that tile the MCU
// rows; otherwise returns why not (the caller then decodes the file as a whole). Cost: one pass
// over the entropy-coded bytes looking for 0xFF.
//
// `damaged` (optional) is set when the header promises such a layout but the scan breaks it:
// restart markers out of order, more or fewer intervals than the frame's MCUs need, no EOI. No
// sound file does that (an encoder writes exactly ceil(MCUs / interval) intervals, RST0..RST7
// in turn, then EOI), so callers fail the file rather than decode it some other way.
std::string find_restart_layout(const std::uint8_t* data, std::size_t size, RestartLayout* out,
                                bool* damaged = nullptr);

// `covering_rect` of the region widened by one MCU on each side (clamped to the frame): the
// context a decode of the small JPEG needs to give the whole file's pixels. Upsampling reads one
// chroma sample across an edge (at most one MCU away at any DCT scale), an 8x8 block is
// self-contained, and libjpeg picks its upsampler from the image's width (h2v1/h2v2 fancy
// upsampling only above 2 scaled chroma samples): an extra MCU each side keeps the small JPEG
// wider than any crop of it, so the same upsampler runs on the same samples as in the file.
McuRect context_rect(const RestartLayout& layout, long long y0, long long x0, long long y1,
                     long long x1);

// The smallest rectangle of whole restart intervals that covers full-size pixel rows [y0, y1)
// and columns [x0, x1) (clamped to the frame).
McuRect covering_rect(const RestartLayout& layout, long long y0, long long x0, long long y1,
                      long long x1);

// At least the size of `assemble_rect_into`'s JPEG: what a caller allocates for it. Per MCU row
// it counts the file's bytes from the row's first chosen interval to the end of its last, plus 2
// (the marker before the row): every layout (scanned or indexed) has at least a 2-byte marker
// between consecutive intervals, where the small JPEG writes exactly 2, so this is never short.
std::size_t assembled_size_bound(const RestartLayout& layout, const McuRect& rect);

// Writes a complete JPEG of the rectangle's MCUs into `out` (which holds `assembled_size_bound`
// bytes) and returns its size: the original's header segments (APPn other than JFIF and Adobe,
// and COM, left out), a frame of the rectangle's size, its intervals, EOI. The caller owns the
// destination, so crop_bitstream writes straight into the `bytes` it returns (one copy of the
// small JPEG, not two).
std::size_t assemble_rect_into(const std::uint8_t* data, const RestartLayout& layout,
                               const McuRect& rect, std::uint8_t* out);

}  // namespace batchwire_jpeg
