// Strict libjpeg error handling shared by the ROI decoder (jpeg_roi.cpp) and the lossless
// transcoder (jpeg_transcode.cpp): fatal errors and every warning jump back to the caller's
// setjmp, except stray bytes between header segments (see jpeg_roi.cpp's file comment).
#pragma once

#include <csetjmp>
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>  // after <cstdio>: it uses FILE and size_t without including them
#include <jerror.h>

namespace batchwire_jpeg {

struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] inline void jump_on_error(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Stray bytes between header segments: the only warning after which the pixels are whole.
inline bool benign_warning(const jpeg_error_mgr* err) {
  if (err->msg_code != JWRN_EXTRANEOUS_DATA) return false;
  const int marker = err->msg_parm.i[1];  // "%u extraneous bytes before marker 0x%02x"
  return marker != 0xD9 && !(marker >= 0xD0 && marker <= 0xD7);
}

inline void jump_on_warning(j_common_ptr cinfo, int msg_level) {
  if (msg_level >= 0) return;  // trace messages
  if (benign_warning(cinfo->err)) {
    cinfo->err->num_warnings++;
    return;
  }
  jump_on_error(cinfo);
}

// Frames whose data libjpeg decodes without being able to tell garbage from data: arithmetic
// coding (SOF9..SOF15) turns any byte string into some coefficients and warns about almost
// nothing, so one changed byte (SOF0 -> SOF9) makes a Huffman file decode to noise without a
// word. batchwire refuses them on every path (backends.py's TurboJPEG path too); no camera or
// common encoder writes them. Call after jpeg_read_header; null when the frame is decoded here.
inline const char* unsupported_frame(const jpeg_decompress_struct& cinfo) {
  if (cinfo.arith_code) return "arithmetic-coded JPEG (SOF9..SOF15): not decoded here";
  return nullptr;
}

// Installs the strict handlers on `cinfo` (before jpeg_create_*), message cleared.
inline void install_strict(j_common_ptr cinfo, ErrorManager* jerr) {
  cinfo->err = jpeg_std_error(&jerr->pub);
  jerr->pub.error_exit = jump_on_error;
  jerr->pub.emit_message = jump_on_warning;
  jerr->message[0] = '\0';
}

}  // namespace batchwire_jpeg
