// The interval index: where each restart interval of a pipeline-prepare'd JPEG begins, recorded
// in the file by pipeline-prepare so that a crop's cut (crop_bitstream, the restart decode path)
// need not scan every entropy-coded byte for restart markers (jpeg_index.cpp).
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
// Pure byte work, no libjpeg calls: nothing here can longjmp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "jpeg_restart.h"

namespace batchwire_jpeg {

// Fills `out` from the file's interval index and returns "" when the file has an index that
// agrees with it (see the trust rules above); otherwise returns why not and `out` is unusable.
std::string layout_from_index(const std::uint8_t* data, std::size_t size, RestartLayout* out);

// The restart layout by the index where it is usable, else by the scan (`find_restart_layout`,
// whose `damaged` rule then applies). `*indexed` says which one gave it.
std::string find_layout_fast(const std::uint8_t* data, std::size_t size, RestartLayout* out,
                             bool* damaged, bool* indexed);

// `data` with a fresh index segment just before its SOS (any interval index already in the
// header dropped: pipeline-prepare's transcoder copies the source's APPn segments), or "" plus
// why not in `why` when the file has no restart layout the scan can find.
std::vector<std::uint8_t> with_interval_index(const std::uint8_t* data, std::size_t size,
                                              std::string* why);

// Whether the header in `data` (a whole file or its first bytes) holds an interval index
// segment: 1 yes, 0 no (the SOS came first, or this is no JPEG), -1 the header runs past `size`
// (read more).
int index_presence(const std::uint8_t* data, std::size_t size);

}  // namespace batchwire_jpeg
