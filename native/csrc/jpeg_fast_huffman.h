// A fast baseline Huffman entropy decoder for the restart path's small JPEGs, installed in place
// of libjpeg-turbo's own (header only: jpeg_roi.cpp is its one user); everything else (IDCT, upsampling, colour
// conversion, jpeg_crop_scanline, jpeg_skip_scanlines, the markers around the scan) stays
// libjpeg's.
//
// Why: a file with restart markers makes libjpeg-turbo 2.1.5 decode every MCU with its slow
// Huffman path (jdhuff.c's decode_mcu takes the fast one only when restart_interval is 0), and
// that path was 45 % of the prepared path's CPU (bench/RESULTS.md, 2026-11-27 evening). This
// decoder reads the same bits the same way (jdhuff.c's decode_mcu_slow, step for step: the
// canonical codes, HUFF_EXTEND, the DC prediction as a wrapping int stored as a JCOEF, runs past
// the 64th coefficient landing on the 63rd, the ACs dropped when the block is NULL or the scale
// is 1/8), with a 64-bit bit buffer filled 8 bytes at a time, a 10-bit lookahead table, and for
// AC codes one giving code, run and value at once for the common short ones (stb_image's).
//
// Exactness where the data is bad: this decoder never reports an error itself. Anything libjpeg
// might treat otherwise than a sound interval (a bad code, data running out or a marker inside an
// interval, a whole byte left over at an interval's end, a restart marker out of turn, no EOI
// after the last interval) makes it give up: `FastEntropy::gave_up` is set and the decode jumps
// out through the error manager, and the caller decodes again with libjpeg's own decoder, whose
// verdict (an error, or for a leftover byte sometimes none) is then the one given. A sound
// interval is one where libjpeg's slow path emits no warning whatever its read-ahead state, so
// both decoders agree on it bit for bit.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <jpeglib.h>  // after <cstdio>: it uses FILE and size_t without including them
#include <jerror.h>
#include <jpegint.h>  // struct jpeg_entropy_decoder, struct jpeg_marker_reader

namespace batchwire_jpeg {

constexpr int kFastLookahead = 10;  // bits looked up at once; longer codes take a loop
// (10 measured a little faster than 9, and as fast as 11 with half the tables)
constexpr std::int32_t kFastEob = 0x100;  // in FastHuffTable::fast_ac: the end-of-block code
constexpr int kFastValueShift = 12;       // in FastHuffTable::fast_ac: where the value starts

// One Huffman table, derived as jdhuff.c's jpeg_make_d_derived_tbl derives it.
struct FastHuffTable {
  std::uint16_t look[1 << kFastLookahead];  // (length << 8) | symbol; 0: a longer code
  std::int32_t maxcode[18];                 // largest code of each length, -1 if none
  std::int32_t valoffset[18];               // huffval index of a code of each length, less code
  std::uint8_t huffval[256];
  // For each prefix holding a whole code of a nonzero coefficient and its value bits,
  // (value << kFastValueShift) | (run << 4) | (code and value bits); for one holding the whole
  // end-of-block code, kFastEob | its length; 0 otherwise (stb_image's fast_ac). The common
  // small coefficients and the block's end then take one lookup. A DC table's symbols are
  // sizes (run 0), so its entries are the DC differences (size 0: "end of block", value 0).
  std::int32_t fast_ac[1 << kFastLookahead];
};

// The entropy-coded data being read: `bits` valid bits at the top of `buffer` (zeros below), of
// which the last `pad` are zeros made up after the segment's end (a marker, or the end of the
// data), and the bytes not yet read, [next, end).
struct BitReader {
  std::uint64_t buffer;
  int bits, pad;
  const std::uint8_t *next, *end;
  const std::uint8_t* stop;  // where the segment's ending marker (its first 0xFF) lies, or end
  bool at_marker;  // the segment's end was reached: `marker` ends it
  int marker;      // its code, 0 when the data ran out
  const std::uint8_t* after_marker;
};

// The decoder's state for one decompress: the caller owns it (outside its setjmp function, so
// `gave_up` survives the longjmp), `install_fast_entropy` fills it.
struct FastEntropy {
  const FastHuffTable* dc_of[D_MAX_BLOCKS_IN_MCU];
  const FastHuffTable* ac_of[D_MAX_BLOCKS_IN_MCU];
  int component_of[D_MAX_BLOCKS_IN_MCU];
  bool dc_needed[D_MAX_BLOCKS_IN_MCU], ac_needed[D_MAX_BLOCKS_IN_MCU];
  int last_dc[MAX_COMPS_IN_SCAN];
  BitReader reader;
  unsigned restarts_to_go;
  long long mcus_left;  // in the scan
  bool gave_up;
};

// The decoder's parts; install_fast_entropy, at the end, puts them in place.
namespace fast_huffman_detail {

// jutils.c's jpeg_natural_order: zigzag index to natural index, with 16 extra entries so that a
// run past the end of a corrupt block lands on coefficient 63, as libjpeg's does.
inline constexpr int kNaturalOrder[64 + 16] = {
    0,  1,  8,  16, 9,  2,  3,  10, 17, 24, 32, 25, 18, 11, 4,  5,  12, 19, 26, 33,
    40, 48, 41, 34, 27, 20, 13, 6,  7,  14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36,
    29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54,
    47, 55, 62, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63};

// The entries of every prefix that starts with `code` (`length` bits, at most kFastLookahead)
// for `symbol`: the lookahead table's, and fast_ac's where the value bits fit too.
inline void fill_prefixes(int length, int code, int symbol, FastHuffTable* out) {
  const int free = kFastLookahead - length, first = code << free;
  const int run = symbol >> 4, size = symbol & 15, total = length + size;
  for (int j = 0; j < (1 << free); ++j) {
    out->look[first + j] = static_cast<std::uint16_t>((length << 8) | symbol);
    if (size == 0) {
      if (run == 0) out->fast_ac[first + j] = kFastEob | length;
    } else if (total <= kFastLookahead) {
      const int bits = (j >> (kFastLookahead - total)) & ((1 << size) - 1);
      const int value = bits < (1 << (size - 1)) ? bits - (1 << size) + 1 : bits;  // HUFF_EXTEND
      const unsigned shifted = static_cast<unsigned>(value) << kFastValueShift;
      out->fast_ac[first + j] = static_cast<std::int32_t>(shifted) | (run << 4) | total;
    }
  }
}

// jpeg_make_d_derived_tbl's canonical codes (libjpeg has already built and validated the same
// table at jpeg_start_decompress: at most 256 symbols, no code overflowing its length), and a
// lookahead table whose entry for each kFastLookahead-bit prefix is the code of length
// l <= kFastLookahead it starts with, as jdhuff.c's lookahead table is built (0 where only a
// longer code, or none, fits), and the AC table's combined entries (fast_ac). False for a table
// libjpeg would have refused (never, after its check).
inline bool derive_table(const JHUFF_TBL& table, FastHuffTable* out) {
  std::memset(out->look, 0, sizeof out->look);
  std::memset(out->fast_ac, 0, sizeof out->fast_ac);
  std::memcpy(out->huffval, table.huffval, sizeof out->huffval);
  std::int32_t code = 0;
  int p = 0;  // index of the next symbol in huffval
  for (int l = 1; l <= 16; ++l) {
    const int n = table.bits[l];
    if (p + n > 256 || code + n > (1 << l)) return false;
    if (n == 0) {
      out->valoffset[l] = 0;
      out->maxcode[l] = -1;
    } else {
      out->valoffset[l] = p - code;
      out->maxcode[l] = code + n - 1;
      if (l <= kFastLookahead) {
        for (int i = 0; i < n; ++i) fill_prefixes(l, code + i, table.huffval[p + i], out);
      }
      p += n;
      code += n;
    }
    code <<= 1;
  }
  out->valoffset[0] = out->valoffset[17] = 0;
  out->maxcode[0] = -1;
  out->maxcode[17] = 0xFFFFF;
  return true;
}

// How many decodes gave up (process-wide): the tests check it stays 0 on sound files.
inline std::atomic<unsigned long long> gave_up_count{0};

// Stops the decode: the caller decodes again with libjpeg's own decoder (see the header).
[[noreturn]] inline void give_up(j_decompress_ptr cinfo, FastEntropy* s) {
  s->gave_up = true;
  gave_up_count.fetch_add(1, std::memory_order_relaxed);
  cinfo->err->msg_code = JERR_CANT_SUSPEND;
  (*cinfo->err->error_exit)(reinterpret_cast<j_common_ptr>(cinfo));
  std::abort();  // error_exit does not return
}

// The derived tables of the last few distinct Huffman tables this thread decoded with: most
// datasets' files share a handful (one encoder's), and deriving costs about a microsecond each.
struct CachedTable {
  unsigned long long last_used = 0;  // 0: empty
  std::uint8_t bits[17];
  std::uint8_t huffval[256];
  FastHuffTable derived;
};
// Least recently used goes first, so a scan's own tables (at most 4) never evict one another.
inline constexpr int kCachedTables = 8;

// `table` derived (from this thread's cache when it has it), or null where libjpeg would have
// refused it.
inline const FastHuffTable* derived_table(const JHUFF_TBL& table) {
  thread_local CachedTable cache[kCachedTables];
  thread_local unsigned long long clock = 0;
  CachedTable* victim = &cache[0];
  for (CachedTable& c : cache) {
    if (c.last_used != 0 && std::memcmp(c.bits, table.bits, sizeof c.bits) == 0 &&
        std::memcmp(c.huffval, table.huffval, sizeof c.huffval) == 0) {
      c.last_used = ++clock;
      return &c.derived;
    }
    if (c.last_used < victim->last_used) victim = &c;
  }
  victim->last_used = 0;
  if (!derive_table(table, &victim->derived)) return nullptr;
  std::memcpy(victim->bits, table.bits, sizeof victim->bits);
  std::memcpy(victim->huffval, table.huffval, sizeof victim->huffval);
  victim->last_used = ++clock;
  return &victim->derived;
}

inline bool has_ff_byte(std::uint64_t x) {
  const std::uint64_t v = ~x;  // a 0xFF byte of x is a zero byte of v
  return ((v - 0x0101010101010101ULL) & ~v & 0x8080808080808080ULL) != 0;
}

inline std::uint64_t load_be64(const std::uint8_t* p) {
  std::uint64_t x;
  std::memcpy(&x, p, 8);
  return __builtin_bswap64(x);
}

// refill's byte-at-a-time part (near 0xFF bytes, the segment's end and the data's end), taking
// and returning the reader by value so that the hot loop's copy stays in registers.
inline __attribute__((noinline)) BitReader refill_bytes(BitReader r) {
  while (r.bits <= 56) {
    if (r.at_marker) {
      r.pad += 64 - r.bits;
      r.bits = 64;
      break;
    }
    if (r.next >= r.end) {
      r.at_marker = true;  // the data ran out: libjpeg's source would warn
      r.marker = 0;
      continue;
    }
    std::uint64_t c = *r.next++;
    if (c == 0xFF) {
      const std::uint8_t* q = r.next;
      while (q < r.end && *q == 0xFF) ++q;
      if (q >= r.end || *q != 0) {
        r.at_marker = true;
        r.marker = q < r.end ? *q : 0;
        r.after_marker = q + 1;
        continue;
      }
      r.next = q + 1;
    }
    r.buffer |= c << (56 - r.bits);
    r.bits += 8;
  }
  return r;
}

// Fills the bit buffer to at least 57 bits: whole bytes as jdhuff.c's jpeg_fill_bit_buffer
// reads them (FF 00 is a data byte FF, any FFs before it too; FF followed by anything else is
// the marker that ends the segment), zeros after the segment's end, counted in `pad`. Eight
// bytes without an 0xFF among them are taken at once.
inline __attribute__((always_inline)) void refill(BitReader& r) {
  const std::ptrdiff_t room = r.stop - r.next;  // bytes before the segment's marker
  if (!r.at_marker && room > 0 && r.end - r.next >= 8) {
    std::uint64_t x = load_be64(r.next);
    int n = (64 - r.bits) >> 3;  // whole bytes that fit: at least 1, and then 57+ bits
    if (room < n) n = static_cast<int>(room);
    x &= ~0ULL << (64 - 8 * n);
    if (!has_ff_byte(x)) {
      r.buffer |= x >> r.bits;
      r.bits += 8 * n;
      r.next += n;
      if (r.bits > 56) return;
    }
  }
  r = refill_bytes(r);
}

inline void consume(BitReader& r, int n) {
  r.buffer <<= n;
  r.bits -= n;
}

// The next n (1..16) bits as an unsigned number.
inline int take_bits(BitReader& r, int n) {
  const int v = static_cast<int>(r.buffer >> (64 - n));
  consume(r, n);
  return v;
}

// jdhuff.c's HUFF_EXTEND: n bits read as a signed coefficient (n >= 1), branch-free as
// libjpeg's (a branch here is mispredicted about half the time).
inline int extend(int v, int n) {
  const unsigned negative = static_cast<unsigned>((v - (1 << (n - 1))) >> 31);  // all ones or 0
  return static_cast<int>(static_cast<unsigned>(v) + (negative & ((~0U << n) + 1U)));
}

// One Huffman symbol; needs at least 16 bits in the buffer (real or made up).
inline int decode_symbol(j_decompress_ptr cinfo, FastEntropy* s, BitReader& r,
                         const FastHuffTable& t) {
  const std::uint16_t e = t.look[r.buffer >> (64 - kFastLookahead)];
  if (e != 0) {
    consume(r, e >> 8);
    return e & 0xFF;
  }
  const std::int32_t top = static_cast<std::int32_t>(r.buffer >> 48);
  for (int l = kFastLookahead + 1; l <= 16; ++l) {
    const std::int32_t code = top >> (16 - l);
    if (code <= t.maxcode[l]) {
      consume(r, l);
      return t.huffval[(code + t.valoffset[l]) & 0xFF];
    }
  }
  give_up(cinfo, s);  // a bad code: libjpeg warns (JWRN_HUFF_BAD_CODE or JWRN_HIT_MARKER)
}

// The end of a segment (an interval's data): sound when fewer than 8 of its bits are left unread
// (the encoder's padding) and a marker follows; returns the marker's code and moves past it.
inline int finish_segment(j_decompress_ptr cinfo, FastEntropy* s) {
  BitReader& r = s->reader;
  const int left = r.bits - r.pad;  // real bits not consumed; negative: read past the end
  if (left < 0 || left >= 8) give_up(cinfo, s);
  if (!r.at_marker) {
    // The buffer ended on a byte boundary before the marker: the next bytes must be it.
    const std::uint8_t* q = r.next;
    if (q >= r.end || *q != 0xFF) give_up(cinfo, s);
    while (q < r.end && *q == 0xFF) ++q;
    if (q >= r.end || *q == 0) give_up(cinfo, s);
    r.marker = *q;
    r.after_marker = q + 1;
  }
  if (r.marker == 0) give_up(cinfo, s);
  return r.marker;
}

// The first 0xFF of the marker that ends the segment starting at `p` (FF 00 and FF FF ... 00
// are data), or `end`: refill takes whole words up to it.
inline const std::uint8_t* segment_stop(const std::uint8_t* p, const std::uint8_t* end) {
  for (;;) {
    p = static_cast<const std::uint8_t*>(std::memchr(p, 0xFF, static_cast<std::size_t>(end - p)));
    if (p == nullptr) return end;
    const std::uint8_t* q = p + 1;
    while (q < end && *q == 0xFF) ++q;
    if (q >= end || *q != 0) return p;
    p = q + 1;
  }
}

inline void start_segment(BitReader* r, const std::uint8_t* from) {
  r->stop = segment_stop(from, r->end);
  r->buffer = 0;
  r->bits = r->pad = 0;
  r->next = from;
  r->at_marker = false;
  r->marker = 0;
  r->after_marker = nullptr;
}

// jdhuff.c's process_restart, for a sound interval: the marker must be the next RSTn.
inline void next_interval(j_decompress_ptr cinfo, FastEntropy* s) {
  if (finish_segment(cinfo, s) != JPEG_RST0 + cinfo->marker->next_restart_num) give_up(cinfo, s);
  cinfo->marker->next_restart_num = (cinfo->marker->next_restart_num + 1) & 7;
  start_segment(&s->reader, s->reader.after_marker);
  for (int ci = 0; ci < cinfo->comps_in_scan; ++ci) s->last_dc[ci] = 0;
  s->restarts_to_go = cinfo->restart_interval;
}

// After the scan's last MCU: leave the source where libjpeg's reader would have stopped on
// hitting EOI (the marker read, `unread_marker` set), so jpeg_finish_decompress finds it.
inline void finish_scan(j_decompress_ptr cinfo, FastEntropy* s) {
  if (finish_segment(cinfo, s) != JPEG_EOI) give_up(cinfo, s);
  cinfo->src->bytes_in_buffer = static_cast<std::size_t>(s->reader.end - s->reader.after_marker);
  cinfo->src->next_input_byte = s->reader.after_marker;
  cinfo->unread_marker = JPEG_EOI;
}

// jdhuff.c's decode_mcu_slow: one MCU's coefficients, in natural order, not dequantized, into
// blocks the caller zeroed (MCU_data null: skipped rows, decoded and dropped).
inline boolean fast_decode_mcu(j_decompress_ptr cinfo, JBLOCKROW* MCU_data) {
  auto* s = static_cast<FastEntropy*>(cinfo->client_data);
  if (s->mcus_left <= 0) give_up(cinfo, s);
  if (s->restarts_to_go == 0) next_interval(cinfo, s);
  BitReader r = s->reader;
  const int blocks = cinfo->blocks_in_MCU;
  for (int blkn = 0; blkn < blocks; ++blkn) {
    JCOEF* block = MCU_data ? MCU_data[blkn][0] : nullptr;
    if (r.bits < 16) refill(r);
    // A DC table's fast_ac entries are its short codes with their value bits (the symbol is the
    // size; size 0, a difference of 0, reads as an end-of-block entry, value 0).
    const FastHuffTable& dc = *s->dc_of[blkn];
    int v;
    if (const std::int32_t fast = dc.fast_ac[r.buffer >> (64 - kFastLookahead)]; fast != 0) {
      consume(r, fast & 15);
      v = fast >> kFastValueShift;
    } else {
      v = decode_symbol(cinfo, s, r, dc);
      if (v) {
        if (r.bits < v) refill(r);
        v = extend(take_bits(r, v), v);
      }
    }
    if (s->dc_needed[blkn]) {
      // A wrapping int, as libjpeg's (its UBSan note), stored truncated to a JCOEF.
      const int ci = s->component_of[blkn];
      v = static_cast<int>(static_cast<unsigned>(v) + static_cast<unsigned>(s->last_dc[ci]));
      s->last_dc[ci] = v;
      if (block) block[0] = static_cast<JCOEF>(v);
    }
    const FastHuffTable& ac = *s->ac_of[blkn];
    if (s->ac_needed[blkn] && block) {
      for (int k = 1; k < DCTSIZE2; ++k) {
        if (r.bits < 16) refill(r);
        const std::int32_t fast = ac.fast_ac[r.buffer >> (64 - kFastLookahead)];
        if (fast != 0) {
          consume(r, fast & 15);
          if (fast & kFastEob) break;
          k += (fast >> 4) & 15;
          block[kNaturalOrder[k]] = static_cast<JCOEF>(fast >> kFastValueShift);
          continue;
        }
        const int rs = decode_symbol(cinfo, s, r, ac);
        const int run = rs >> 4, size = rs & 15;
        if (size) {
          k += run;
          if (r.bits < size) refill(r);
          const int bits = take_bits(r, size);
          block[kNaturalOrder[k]] = static_cast<JCOEF>(extend(bits, size));
        } else {
          if (run != 15) break;
          k += 15;
        }
      }
    } else {
      for (int k = 1; k < DCTSIZE2; ++k) {
        if (r.bits < 16) refill(r);
        const std::int32_t fast = ac.fast_ac[r.buffer >> (64 - kFastLookahead)];
        if (fast != 0) {
          consume(r, fast & 15);
          if (fast & kFastEob) break;
          k += (fast >> 4) & 15;
          continue;
        }
        const int rs = decode_symbol(cinfo, s, r, ac);
        const int run = rs >> 4, size = rs & 15;
        if (size) {
          k += run;
          if (r.bits < size) refill(r);
          consume(r, size);
        } else {
          if (run != 15) break;
          k += 15;
        }
      }
    }
  }
  s->reader = r;
  --s->restarts_to_go;
  if (--s->mcus_left == 0) finish_scan(cinfo, s);
  return TRUE;
}

inline void fast_start_pass(j_decompress_ptr cinfo) {
  // Not called again in a single-scan decode; should libjpeg ever do so, its own decoder
  // restarts the scan from its own state, which this one no longer mirrors.
  auto* s = static_cast<FastEntropy*>(cinfo->client_data);
  give_up(cinfo, s);
}

}  // namespace fast_huffman_detail

// How many decodes in this process the fast decoder gave up on (libjpeg's then decoded them):
// for tests, which check that sound files never need it.
inline unsigned long long fast_entropy_gave_up() {
  return fast_huffman_detail::gave_up_count.load(std::memory_order_relaxed);
}

// Installs the fast decoder on `cinfo` (call after jpeg_start_decompress and any
// jpeg_crop_scanline, before the first row is read or skipped) when the scan is one it decodes
// exactly as libjpeg would: sequential Huffman, 8-bit, a single scan of every component, with
// restart intervals, read from a memory source. Returns whether it did; `cinfo->client_data`
// then points at `state`.
inline bool install_fast_entropy(j_decompress_ptr cinfo, FastEntropy* s) {
  using namespace fast_huffman_detail;
  s->gave_up = false;
  if (cinfo->progressive_mode || cinfo->arith_code || cinfo->data_precision != 8 ||
      cinfo->restart_interval == 0 || cinfo->comps_in_scan != cinfo->num_components ||
      cinfo->Ss != 0 || cinfo->Se != DCTSIZE2 - 1 || cinfo->Ah != 0 || cinfo->Al != 0 ||
      cinfo->blocks_in_MCU > D_MAX_BLOCKS_IN_MCU || cinfo->unread_marker != 0 ||
      cinfo->output_scanline != 0 || cinfo->input_iMCU_row != 0 || cinfo->entropy == nullptr) {
    return false;
  }
  const FastHuffTable *dc_of[MAX_COMPS_IN_SCAN], *ac_of[MAX_COMPS_IN_SCAN];
  for (int ci = 0; ci < cinfo->comps_in_scan; ++ci) {
    const jpeg_component_info* comp = cinfo->cur_comp_info[ci];
    const JHUFF_TBL* dc = cinfo->dc_huff_tbl_ptrs[comp->dc_tbl_no];
    const JHUFF_TBL* ac = cinfo->ac_huff_tbl_ptrs[comp->ac_tbl_no];
    if (dc == nullptr || ac == nullptr) return false;
    dc_of[ci] = derived_table(*dc);
    ac_of[ci] = derived_table(*ac);
    if (dc_of[ci] == nullptr || ac_of[ci] == nullptr) return false;
    s->last_dc[ci] = 0;
  }
  // jdhuff.c's start_pass_huff_decoder: which tables and which coefficients each block needs.
  for (int blkn = 0; blkn < cinfo->blocks_in_MCU; ++blkn) {
    const int ci = cinfo->MCU_membership[blkn];
    const jpeg_component_info* comp = cinfo->cur_comp_info[ci];
    s->component_of[blkn] = ci;
    s->dc_of[blkn] = dc_of[ci];
    s->ac_of[blkn] = ac_of[ci];
    s->dc_needed[blkn] = comp->component_needed;
    s->ac_needed[blkn] = comp->component_needed && comp->DCT_scaled_size > 1;
  }
  s->reader.end = cinfo->src->next_input_byte + cinfo->src->bytes_in_buffer;
  start_segment(&s->reader, cinfo->src->next_input_byte);
  s->restarts_to_go = cinfo->restart_interval;
  s->mcus_left = static_cast<long long>(cinfo->MCUs_per_row) * cinfo->MCU_rows_in_scan;
  cinfo->client_data = s;
  cinfo->entropy->decode_mcu = fast_decode_mcu;
  cinfo->entropy->start_pass = fast_start_pass;
  return true;
}

}  // namespace batchwire_jpeg
