// Restart-marker random access (see jpeg_restart.h).
#include "jpeg_restart.h"

#include <algorithm>
#include <cstring>

namespace batchwire_jpeg {

namespace {

constexpr std::uint8_t kSOF0 = 0xC0, kSOF1 = 0xC1, kDHT = 0xC4, kDAC = 0xCC, kRST0 = 0xD0,
                       kRST7 = 0xD7, kSOI = 0xD8, kEOI = 0xD9, kSOS = 0xDA, kDRI = 0xDD,
                       kAPP0 = 0xE0, kAPP14 = 0xEE, kAPP15 = 0xEF, kCOM = 0xFE;

int be16(const std::uint8_t* p) { return (p[0] << 8) | p[1]; }

bool is_sof(std::uint8_t m) { return m >= 0xC0 && m <= 0xCF && m != kDHT && m != kDAC && m != 0xC8; }

// APP0 (JFIF) and APP14 (Adobe) decide how libjpeg reads the colour space; other APPn and COM
// carry nothing the decoder uses.
bool kept_in_small_jpeg(std::uint8_t m) {
  if (m >= kAPP0 && m <= kAPP15) return m == kAPP0 || m == kAPP14;
  return m != kCOM;
}

struct FrameComponent {
  int id, h, v;
};

std::string parse_frame(const std::uint8_t* p, std::size_t length, RestartLayout* out,
                        std::vector<FrameComponent>* comps) {
  if (length < 8) return "frame header too short";
  if (p[2] != 8) return "not 8-bit";
  out->height = be16(p + 3);
  out->width = be16(p + 5);
  const int count = p[7];
  if (out->height == 0 || out->width == 0) return "frame size left to a DNL marker";
  if (count < 1 || count > 4 || length < 8 + 3u * count) return "bad frame component count";
  for (int i = 0; i < count; ++i) {
    const std::uint8_t* c = p + 8 + 3 * i;
    const int h = c[1] >> 4, v = c[1] & 15;
    if (h < 1 || h > 4 || v < 1 || v > 4) return "bad sampling factors";
    comps->push_back({c[0], h, v});
  }
  return "";
}

// MCU size from the scan: one block of its component for a single-component scan, the largest
// sampling factors' blocks for an interleaved one.
std::string parse_scan(const std::uint8_t* p, std::size_t length,
                       const std::vector<FrameComponent>& comps, RestartLayout* out) {
  if (length < 6) return "scan header too short";
  const int count = p[2];
  if (length < 6 + 2u * count) return "scan header too short";
  if (count != static_cast<int>(comps.size())) return "not a single scan of every component";
  const std::uint8_t* tail = p + 3 + 2 * count;
  if (tail[0] != 0 || tail[1] != 63 || tail[2] != 0) return "not a sequential scan";
  int hmax = 1, vmax = 1;
  for (const auto& c : comps) {
    hmax = std::max(hmax, c.h);
    vmax = std::max(vmax, c.v);
  }
  if (count == 1) {
    const FrameComponent& c = comps[0];
    if (hmax % c.h != 0 || vmax % c.v != 0) return "unusual sampling factors";
    out->mcu_width = 8 * hmax / c.h;
    out->mcu_height = 8 * vmax / c.v;
  } else {
    out->mcu_width = 8 * hmax;
    out->mcu_height = 8 * vmax;
  }
  out->mcus_per_row = (out->width + out->mcu_width - 1) / out->mcu_width;
  out->mcu_rows = (out->height + out->mcu_height - 1) / out->mcu_height;
  return "";
}

// The intervals' bytes, from the scan's first byte to EOI. Every 0xFF in entropy-coded data is
// followed by 0x00 (stuffing) or is the start of a marker, possibly after 0xFF fill bytes.
std::string find_intervals(const std::uint8_t* data, std::size_t size, std::size_t from,
                           RestartLayout* out) {
  const long long mcus = static_cast<long long>(out->mcus_per_row) * out->mcu_rows;
  const long long expected = (mcus + out->interval - 1) / out->interval;
  if (size > UINT32_MAX) return "file over 4 GiB";
  // Every interval but the last ends in a 2-byte marker: a header claiming more intervals than
  // the file could hold reserves no more than the file could.
  const long long room = std::min<long long>(expected, static_cast<long long>(size - from) / 2 + 1);
  out->begin.reserve(static_cast<std::size_t>(room));
  out->end.reserve(static_cast<std::size_t>(room));
  std::size_t begin = from, i = from;
  while (true) {
    const void* hit = i < size ? std::memchr(data + i, 0xFF, size - i) : nullptr;
    if (hit == nullptr) return "no EOI marker";
    const std::size_t ff = static_cast<const std::uint8_t*>(hit) - data;
    std::size_t j = ff + 1;
    while (j < size && data[j] == 0xFF) ++j;
    if (j >= size) return "no EOI marker";
    const std::uint8_t m = data[j];
    if (m == 0x00) {
      i = j + 1;
      continue;
    }
    if (static_cast<long long>(out->begin.size()) >= expected) return "more intervals than MCUs";
    out->begin.push_back(static_cast<std::uint32_t>(begin));
    out->end.push_back(static_cast<std::uint32_t>(ff));
    if (m == kEOI) break;
    if (m < kRST0 || m > kRST7) return "a marker inside the scan";
    if (m - kRST0 != static_cast<int>((out->begin.size() - 1) % 8)) return "restart out of order";
    begin = i = j + 1;
  }
  if (static_cast<long long>(out->begin.size()) != expected) return "fewer intervals than MCUs";
  return "";
}

// find_intervals' reasons that no sound file gives (see `damaged` in jpeg_restart.h). "a marker
// inside the scan" is not one: a COM or APPn segment may follow the scan's data before EOI, and
// libjpeg then judges the file.
bool is_damage(const std::string& why) {
  return why == "restart out of order" || why == "more intervals than MCUs" ||
         why == "fewer intervals than MCUs" || why == "no EOI marker";
}

}  // namespace

std::string find_restart_layout(const std::uint8_t* data, std::size_t size, RestartLayout* out,
                                bool* damaged) {
  if (damaged != nullptr) *damaged = false;
  if (size < 4 || data[0] != 0xFF || data[1] != kSOI) return "not a JPEG";
  std::vector<FrameComponent> comps;
  bool have_frame = false;
  std::size_t pos = 2;
  while (true) {
    if (pos + 4 > size) return "no scan";
    if (data[pos] != 0xFF) return "bytes between header segments";
    while (pos < size && data[pos] == 0xFF) ++pos;
    if (pos + 3 > size) return "no scan";
    const std::uint8_t marker = data[pos++];
    if (marker == kSOI || marker == kEOI || marker == 0x01 || (marker >= kRST0 && marker <= kRST7)) {
      return "unexpected marker in the header";
    }
    const std::size_t length = static_cast<std::size_t>(be16(data + pos));
    if (length < 2 || pos + length > size) return "header segment runs past the end";
    const std::uint8_t* payload = data + pos;
    if (is_sof(marker)) {
      if (marker != kSOF0 && marker != kSOF1) return "not sequential Huffman (progressive?)";
      if (have_frame) return "two frames";
      std::string why = parse_frame(payload, length, out, &comps);
      if (!why.empty()) return why;
      have_frame = true;
      out->frame_index = out->header.size();
    } else if (marker == kDRI) {
      if (length != 4) return "bad DRI segment";
      out->interval = be16(payload + 2);
    } else if (marker == kSOS) {
      if (!have_frame) return "scan before frame";
      std::string why = parse_scan(payload, length, comps, out);
      if (!why.empty()) return why;
      out->header.push_back({marker, pos, length});
      if (out->interval <= 0) return "no restart markers";
      if (out->mcus_per_row % out->interval != 0) return "restart intervals straddle MCU rows";
      why = find_intervals(data, size, pos + length, out);
      if (damaged != nullptr) *damaged = is_damage(why);
      return why;
    }
    if (kept_in_small_jpeg(marker)) out->header.push_back({marker, pos, length});
    pos += length;
  }
}

McuRect covering_rect(const RestartLayout& layout, long long y0, long long x0, long long y1,
                      long long x1) {
  auto clamp = [](long long v, long long hi) { return std::min(std::max(v, 0LL), hi); };
  y0 = clamp(y0, layout.height);
  y1 = clamp(y1, layout.height);
  x0 = clamp(x0, layout.width);
  x1 = clamp(x1, layout.width);
  const int step = layout.interval;
  const int c0 = static_cast<int>(x0 / layout.mcu_width) / step * step;
  int c1 = static_cast<int>((x1 + layout.mcu_width - 1) / layout.mcu_width);
  c1 = std::min((c1 + step - 1) / step * step, layout.mcus_per_row);
  return {static_cast<int>(y0 / layout.mcu_height), c0,
          static_cast<int>((y1 + layout.mcu_height - 1) / layout.mcu_height), c1};
}

McuRect context_rect(const RestartLayout& layout, long long y0, long long x0, long long y1,
                     long long x1) {
  return covering_rect(layout, y0 - layout.mcu_height, x0 - layout.mcu_width,
                       y1 + layout.mcu_height, x1 + layout.mcu_width);
}

std::size_t assembled_size_bound(const RestartLayout& layout, const McuRect& rect) {
  const int per_row = layout.mcus_per_row / layout.interval;
  const int first = rect.col0 / layout.interval, last = rect.col1 / layout.interval;
  std::size_t bytes = 4;
  for (const HeaderSegment& s : layout.header) bytes += 2 + s.length;
  for (int r = rect.row0; r < rect.row1; ++r) {
    const std::size_t k0 = static_cast<std::size_t>(r) * per_row + first;
    const std::size_t k1 = static_cast<std::size_t>(r) * per_row + last - 1;
    bytes += layout.end[k1] - layout.begin[k0] + 2;  // an upper bound: markers included
  }
  return bytes;
}

std::size_t assemble_rect_into(const std::uint8_t* data, const RestartLayout& layout,
                               const McuRect& rect, std::uint8_t* out) {
  const int width = std::min(layout.width, rect.col1 * layout.mcu_width) -
                    rect.col0 * layout.mcu_width;
  const int height = std::min(layout.height, rect.row1 * layout.mcu_height) -
                     rect.row0 * layout.mcu_height;
  const int per_row = layout.mcus_per_row / layout.interval;
  const int first = rect.col0 / layout.interval, last = rect.col1 / layout.interval;
  std::uint8_t* p = out;
  *p++ = 0xFF;
  *p++ = kSOI;
  for (std::size_t i = 0; i < layout.header.size(); ++i) {
    const HeaderSegment& s = layout.header[i];
    *p++ = 0xFF;
    *p++ = s.marker;
    std::memcpy(p, data + s.offset, s.length);
    if (i == layout.frame_index) {  // length(2) precision(1) height(2) width(2)
      p[3] = static_cast<std::uint8_t>(height >> 8);
      p[4] = static_cast<std::uint8_t>(height & 0xFF);
      p[5] = static_cast<std::uint8_t>(width >> 8);
      p[6] = static_cast<std::uint8_t>(width & 0xFF);
    }
    p += s.length;
  }
  int written = 0;
  for (int r = rect.row0; r < rect.row1; ++r) {
    for (int k = first; k < last; ++k) {
      const std::size_t i = static_cast<std::size_t>(r) * per_row + k;
      if (written > 0) {
        *p++ = 0xFF;
        *p++ = static_cast<std::uint8_t>(kRST0 + (written - 1) % 8);
      }
      const std::size_t n = layout.end[i] - layout.begin[i];
      std::memcpy(p, data + layout.begin[i], n);
      p += n;
      ++written;
    }
  }
  *p++ = 0xFF;
  *p++ = kEOI;
  return static_cast<std::size_t>(p - out);
}

}  // namespace batchwire_jpeg
