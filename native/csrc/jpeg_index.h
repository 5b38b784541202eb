// The interval index: where each restart interval of a pipeline-prepare'd JPEG begins, recorded
// in the file by pipeline-prepare so that a crop's cut (crop_bitstream, the restart decode path)
// need not scan every entropy-coded byte for restart markers.
//
// Format (version 1): one APP9 segment placed immediately before the SOS segment:
//   FF E9, length (2 bytes, big-endian, as for every segment),
//   the signature "batchwire-intervals\0" (20 bytes), a version byte (1),
//   N, the number of restart intervals, as an unsigned LEB128 varint,
//   N varints: for interval k < N-1, begin(k+1) - begin(k), i.e. its entropy-coded bytes plus
//   the 2-byte RSTn marker that ends it; for the last, its bytes up to the EOI marker.
// Interval 0 begins at the scan's first byte (just after the SOS segment), so offsets are
// relative to the scan and the index survives header segments being added or removed before it.
// About 2 bytes per interval (intervals of ~130-16,000 bytes): 0.3-1.5 kB for an ImageNet photo.
// N = 0 is an index that says "too many intervals for one segment (over ~20,000): scan instead";
// it is still written so that a rerun of pipeline-prepare sees the file as done.
//
// Why APP9 just before SOS: every JPEG reader skips APPn segments it does not know, anywhere in
// the header; JFIF's APP0 and EXIF's APP1 must come first after SOI, so the end of the header
// disturbs neither; APP9 has no common registered use (APP1 EXIF/XMP, APP2 ICC/MPF, APP11 JPEG
// XT/JUMBF, APP12 Ducky, APP13 Photoshop and APP14 Adobe do); and the signature tells ours from
// anyone else's APP9. The small JPEGs of a crop never carry it (assemble_rect keeps only APP0 and
// APP14).
//
// Trust: an index is used only when it agrees with the file completely: the right version, the
// count the frame's MCU layout needs, every interval boundary landing just after an FF D0+(k%8)
// restart marker of the right number, the last interval ending at an EOI that ends the file, and
// nothing left over in the segment. In entropy-coded data every 0xFF is followed by 0x00 or
// begins a marker, so N-1 boundaries that are all real markers in order, in a file whose scan has
// N-1 restart markers, are exactly the scan's intervals: the same layout the scan finds. Anything
// else (damaged, truncated, stale or someone else's APP9) and the caller scans as before.
// Checking every boundary costs about a microsecond; a damaged index can never pick out other
// intervals than the scan would (a file whose own markers are damaged fails check_jpeg, which
// scans, before any non-intact bytes are cut).
//
// Pure byte work, no libjpeg calls: nothing here can longjmp. Header-only (inline), for
// jpeg_roi.cpp, its one user, so that the extension's list of sources stays as it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "jpeg_restart.h"

namespace batchwire_jpeg {

namespace index_detail {

inline constexpr std::uint8_t kAPP9 = 0xE9, kRST0 = 0xD0, kRST7 = 0xD7, kSOI = 0xD8,
                              kEOI = 0xD9, kSOS = 0xDA;
inline constexpr char kSignature[] = "batchwire-intervals";  // 20 bytes with its NUL
inline constexpr std::size_t kSignatureSize = sizeof kSignature;
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kMaxPayload = 0xFFFF - 2;  // the length field counts itself

inline int be16(const std::uint8_t* p) { return (p[0] << 8) | p[1]; }

// Where the header's parts lie: the index segment's payload (after its length), the SOS
// marker and the scan's first byte. Zero where absent.
struct HeaderWalk {
  std::size_t index_at = 0, index_end = 0;  // the payload after the length field
  std::size_t sos_at = 0;                   // the SOS marker's 0xFF
  std::size_t scan_at = 0;                  // the scan's first byte
};

inline bool is_index_segment(const std::uint8_t* payload, std::size_t length) {
  return length >= 2 + kSignatureSize + 1 &&
         std::memcmp(payload + 2, kSignature, kSignatureSize) == 0;
}

// Steps over the header segments as find_restart_layout does (fill bytes allowed before a
// marker), up to the SOS: 1 when it reached it, 0 for no JPEG or a malformed header, -1 when
// the header runs past `size`. Records the first index segment it meets.
inline int walk_header(const std::uint8_t* data, std::size_t size, HeaderWalk* out) {
  if (size < 2) return -1;
  if (data[0] != 0xFF || data[1] != kSOI) return 0;
  std::size_t pos = 2;
  while (true) {
    const std::size_t at = pos;
    if (pos >= size) return -1;
    if (data[pos] != 0xFF) return 0;
    while (pos < size && data[pos] == 0xFF) ++pos;
    if (pos + 3 > size) return -1;
    const std::uint8_t marker = data[pos++];
    if (marker == kSOI || marker == kEOI || marker == 0x01 ||
        (marker >= kRST0 && marker <= kRST7)) {
      return 0;
    }
    const std::size_t length = static_cast<std::size_t>(be16(data + pos));
    if (length < 2) return 0;
    if (pos + length > size) return -1;
    if (marker == kSOS) {
      out->sos_at = at;
      out->scan_at = pos + length;
      return 1;
    }
    if (marker == kAPP9 && out->index_at == 0 && is_index_segment(data + pos, length)) {
      out->index_at = pos + 2;
      out->index_end = pos + length;
    }
    pos += length;
  }
}

// An unsigned LEB128 varint of at most 32 bits from [*p, end); false when it runs out or over.
inline bool read_varint(const std::uint8_t** p, const std::uint8_t* end, std::uint32_t* value) {
  std::uint64_t v = 0;
  for (int shift = 0; shift < 35; shift += 7) {
    if (*p >= end) return false;
    const std::uint8_t byte = *(*p)++;
    v |= static_cast<std::uint64_t>(byte & 0x7F) << shift;
    if ((byte & 0x80) == 0) {
      if (v > UINT32_MAX) return false;
      *value = static_cast<std::uint32_t>(v);
      return true;
    }
  }
  return false;
}

inline void write_varint(std::uint32_t v, std::vector<std::uint8_t>* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<std::uint8_t>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<std::uint8_t>(v));
}

inline long long expected_intervals(const RestartLayout& layout) {
  const long long mcus = static_cast<long long>(layout.mcus_per_row) * layout.mcu_rows;
  return (mcus + layout.interval - 1) / layout.interval;
}

// The header's layout (frame, MCUs, interval, kept segments) without the scan: find_restart_layout
// over the bytes up to the scan's first byte parses and checks every header segment, then finds
// no entropy-coded data at all, which it reports as "no EOI marker" (any other answer is the
// header's own refusal). `begin` and `end` are left empty.
inline std::string parse_header_only(const std::uint8_t* data, std::size_t scan_at,
                                     RestartLayout* out) {
  const std::string why = find_restart_layout(data, scan_at, out);
  return why == "no EOI marker" ? "" : why;
}

// Fills begin/end from the index's varints and checks them against the file (the file comment).
inline std::string read_index(const std::uint8_t* data, std::size_t size, const HeaderWalk& walk,
                              RestartLayout* out) {
  const std::uint8_t* p = data + walk.index_at + kSignatureSize;
  const std::uint8_t* const end = data + walk.index_end;
  if (*p++ != kVersion) return "interval index: unknown version";
  std::uint32_t count = 0;
  if (!read_varint(&p, end, &count)) return "interval index: truncated";
  if (count == 0) return "interval index: none recorded (too many intervals)";
  if (count != expected_intervals(*out)) return "interval index: wrong count for the frame";
  // Each interval takes at least one byte of the segment: a count the segment cannot hold is
  // refused before anything is sized by it.
  if (count > static_cast<std::size_t>(end - p)) return "interval index: truncated";
  if (size > UINT32_MAX || size < 2) return "interval index: file size";
  const std::size_t eoi = size - 2;  // prepared files end at their EOI
  if (walk.scan_at >= eoi) return "interval index: no scan data";
  if (data[eoi] != 0xFF || data[eoi + 1] != kEOI) return "interval index: file does not end at EOI";
  out->begin.resize(count);
  out->end.resize(count);
  std::size_t at = walk.scan_at;
  for (std::uint32_t k = 0; k < count; ++k) {
    std::uint32_t step = 0;
    if (!read_varint(&p, end, &step)) return "interval index: truncated";
    const bool last = k + 1 == count;
    // At least one byte of data, plus the marker for all but the last.
    if (step < (last ? 1u : 3u) || step > eoi - at) return "interval index: offset off the scan";
    out->begin[k] = static_cast<std::uint32_t>(at);
    at += step;
    if (last) {
      if (at != eoi) return "interval index: last interval does not end at EOI";
      out->end[k] = static_cast<std::uint32_t>(at);
    } else {
      if (data[at - 2] != 0xFF || data[at - 1] != kRST0 + k % 8) {
        return "interval index: a boundary is not the expected restart marker";
      }
      out->end[k] = static_cast<std::uint32_t>(at - 2);
    }
  }
  if (p != end) return "interval index: bytes left over";
  return "";
}

// Whether `out`'s index gives the intervals the scan found in the file it was made from (the
// same lengths: the offsets moved with the header). Fill bytes before a marker, which libjpeg
// never writes, would make them differ; such a file gets no index.
inline bool reads_back(const std::vector<std::uint8_t>& out, const RestartLayout& scanned) {
  RestartLayout back;
  HeaderWalk walk;
  if (walk_header(out.data(), out.size(), &walk) != 1 || walk.index_at == 0) return false;
  if (!parse_header_only(out.data(), walk.scan_at, &back).empty()) return false;
  if (!read_index(out.data(), out.size(), walk, &back).empty()) return false;
  if (back.begin.size() != scanned.begin.size()) return false;
  for (std::size_t k = 0; k < back.begin.size(); ++k) {
    if (back.end[k] - back.begin[k] != scanned.end[k] - scanned.begin[k]) return false;
  }
  return true;
}

}  // namespace index_detail

// Fills `out` from the file's interval index and returns "" when the file has an index that
// agrees with it (see the trust rules above); otherwise returns why not and `out` is unusable.
inline std::string layout_from_index(const std::uint8_t* data, std::size_t size,
                                     RestartLayout* out) {
  using namespace index_detail;
  HeaderWalk walk;
  if (walk_header(data, size, &walk) != 1) return "no scan";
  if (walk.index_at == 0) return "no interval index";
  const std::string why = parse_header_only(data, walk.scan_at, out);
  if (!why.empty()) return why;
  return read_index(data, size, walk, out);
}

// The restart layout by the index where it agrees with the file, else by the scan
// (`find_restart_layout`, whose optional `damaged` then applies: an index that agrees is a sound
// structure). The same layout either way; `layout_from_index` alone tells whether it is indexed.
inline std::string find_layout_fast(const std::uint8_t* data, std::size_t size,
                                    RestartLayout* out, bool* damaged = nullptr) {
  if (layout_from_index(data, size, out).empty()) {
    if (damaged != nullptr) *damaged = false;
    return "";
  }
  *out = RestartLayout{};
  return find_restart_layout(data, size, out, damaged);
}

// `data` with a fresh index segment just before its SOS (any interval index already in the
// header dropped: pipeline-prepare's transcoder copies the source's APPn segments), or "" plus
// why not in `why` when the file has no restart layout the scan can find.
inline std::vector<std::uint8_t> with_interval_index(const std::uint8_t* data, std::size_t size,
                                                     std::string* why) {
  using namespace index_detail;
  RestartLayout layout;
  *why = find_restart_layout(data, size, &layout);
  if (!why->empty()) return {};
  HeaderWalk walk;
  if (walk_header(data, size, &walk) != 1) {
    *why = "no scan";
    return {};
  }
  std::vector<std::uint8_t> index(kSignature, kSignature + kSignatureSize);
  index.push_back(kVersion);
  const std::size_t n = layout.begin.size();
  write_varint(static_cast<std::uint32_t>(n), &index);
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t next = k + 1 < n ? layout.begin[k + 1] : layout.end[k];
    write_varint(static_cast<std::uint32_t>(next - layout.begin[k]), &index);
  }
  const bool recorded = index.size() <= kMaxPayload;
  if (!recorded) {  // too many intervals for one segment: an empty index (the file comment)
    index.resize(kSignatureSize + 1);
    write_varint(0, &index);
  }
  // The file up to the SOS without any earlier index segment, the index, the SOS onwards up to
  // the EOI (bytes after it, which the transcoder never writes, would defeat the index).
  std::vector<std::uint8_t> out;
  out.reserve(size + index.size() + 4);
  std::size_t copy_from = 0;
  for (std::size_t at = 2; at < walk.sos_at;) {  // walk_header has checked these segments
    std::size_t p = at;
    while (data[p] == 0xFF) ++p;
    const std::size_t next = p + 1 + static_cast<std::size_t>(be16(data + p + 1));
    if (data[p] == kAPP9 && is_index_segment(data + p + 1, next - p - 1)) {
      out.insert(out.end(), data + copy_from, data + at);
      copy_from = next;
    }
    at = next;
  }
  out.insert(out.end(), data + copy_from, data + walk.sos_at);
  out.push_back(0xFF);
  out.push_back(kAPP9);
  const std::size_t length = index.size() + 2;
  out.push_back(static_cast<std::uint8_t>(length >> 8));
  out.push_back(static_cast<std::uint8_t>(length & 0xFF));
  out.insert(out.end(), index.begin(), index.end());
  out.insert(out.end(), data + walk.sos_at, data + layout.end.back() + 2);
  if (recorded && !reads_back(out, layout)) {
    *why = "the index does not read back (fill bytes before a marker?)";
    return {};
  }
  return out;
}

// Whether the header in `data` (a whole file or its first bytes) holds an interval index
// segment: 1 yes, 0 no (the SOS came first, or this is no JPEG), -1 the header runs past `size`
// (read more).
inline int index_presence(const std::uint8_t* data, std::size_t size) {
  using namespace index_detail;
  HeaderWalk walk;
  const int reached = walk_header(data, size, &walk);
  if (walk.index_at != 0) return 1;
  return reached == 1 ? 0 : reached;
}

}  // namespace batchwire_jpeg
