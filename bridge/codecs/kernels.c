/* The trainer's CPU work per tensor in one pass (bridge/codecs/kernels.py builds and loads this file).
 *
 * The delta's diff: each function reads a piece of the new weights and the base once and writes the positions and new
 * values of the elements that differ, bit for bit, and the base's values there (the undo log), and with `write` moves
 * the base to the new values there as it goes (a publish's base moves where it changed): no cast buffer, no change
 * mask, no second pass over the differing words or the base. Each block of BLOCK elements is compared in a loop the
 * compiler vectorizes, into a bit mask of its differing elements (one multiply per eight); a block whose mask is 0
 * writes nothing, the others append their differing elements.
 * A call has room for `cap` entries and gives up (returns -1, the base as it was) once they would not fit: the caller
 * then diffs that piece the plain way.
 *
 * Plain C, no headers beyond the standard library: any C compiler builds it in a fraction of a second.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 64

/* float32 -> bfloat16 bits as torch's vectorized CPU cast makes them (ATen's cvtfp32_bf16): round to nearest, ties to
 * even, and every NaN to 0xFFFF (torch's scalar cast, which does the last few elements of a tensor, writes 0x7FC0). */
static inline uint16_t bf16_bits(uint32_t u) {
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0xffff : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* BLOCK flags (0 or 1 each) as a BLOCK-bit mask, bit i for flag i: eight at a time, one multiply each (the
 * multiplier moves byte i's low bit to bit 56 + i, every other product lands elsewhere, and none carries). */
static inline uint64_t mask_of(const uint8_t *flags) {
    uint64_t mask = 0;
    for (int g = 0; g < BLOCK / 8; g++) {
        uint64_t w;
        memcpy(&w, flags + 8 * g, 8);
        mask |= ((w * 0x0102040810204080ull) >> 56) << (8 * g);
    }
    return mask;
}

/* Append the position, new value (of `v`) and old value (of the base block `b`) of each set bit of `mask`, for block
 * `at`, and with `write` put the new value into the base there (it is in cache: the undo log has the old one); -1 when
 * `cap` is short, with the base as it was. */
#define APPEND(v)                                                                                                  \
    if (mask) {                                                                                                    \
        if (c + __builtin_popcountll(mask) > cap) {                                                                \
            for (int64_t j = 0; write && j < c; j++) /* the base as it was: the caller diffs the plain way */     \
                base[pos[j] - offset] = old[j];                                                                    \
            return -1;                                                                                             \
        }                                                                                                          \
        while (mask) {                                                                                             \
            const int i = __builtin_ctzll(mask);                                                                   \
            pos[c] = offset + at + i;                                                                              \
            old[c] = b[i];                                                                                         \
            val[c++] = (v)[i];                                                                                     \
            if (write)                                                                                             \
                b[i] = (v)[i];                                                                                     \
            mask &= mask - 1;                                                                                      \
        }                                                                                                          \
    }

/* `n` float32 `src` cast to bfloat16 and compared with the bfloat16 bits `base`. */
int64_t wsync_diff_f32_bf16(const uint32_t *src, uint16_t *base, int64_t n, int64_t offset,
                            int64_t *pos, uint16_t *val, uint16_t *old, int64_t cap, int write) {
    uint16_t tmp[BLOCK];
    uint8_t ne[BLOCK];
    int64_t c = 0;
    for (int64_t at = 0; at < n; at += BLOCK) {
        const int64_t m = n - at < BLOCK ? n - at : BLOCK;
        const uint32_t *s = src + at;
        uint16_t *b = base + at;
        if (m == BLOCK) {
            for (int i = 0; i < BLOCK; i++) {
                tmp[i] = bf16_bits(s[i]);
                ne[i] = tmp[i] != b[i];
            }
        } else {
            memset(ne, 0, sizeof ne);
            for (int i = 0; i < m; i++) {
                tmp[i] = bf16_bits(s[i]);
                ne[i] = tmp[i] != b[i];
            }
        }
        uint64_t mask = mask_of(ne);
        APPEND(tmp);
    }
    return c;
}

/* `n` elements of `src` and `base` of one width compared bit for bit (the piece is already in the serving dtype). */
#define SAME_WIDTH(NAME, T)                                                                                        \
    int64_t NAME(const T *src, T *base, int64_t n, int64_t offset, int64_t *pos, T *val, T *old, int64_t cap,     \
                 int write) {                                                                                      \
        uint8_t ne[BLOCK];                                                                                         \
        int64_t c = 0;                                                                                             \
        for (int64_t at = 0; at < n; at += BLOCK) {                                                                \
            const int64_t m = n - at < BLOCK ? n - at : BLOCK;                                                     \
            const T *s = src + at;                                                                                 \
            T *b = base + at;                                                                                      \
            if (m == BLOCK) {                                                                                      \
                for (int i = 0; i < BLOCK; i++)                                                                    \
                    ne[i] = s[i] != b[i];                                                                          \
            } else {                                                                                               \
                memset(ne, 0, sizeof ne);                                                                          \
                for (int i = 0; i < m; i++)                                                                        \
                    ne[i] = s[i] != b[i];                                                                          \
            }                                                                                                      \
            uint64_t mask = mask_of(ne);                                                                           \
            APPEND(s);                                                                                             \
        }                                                                                                          \
        return c;                                                                                                  \
    }

SAME_WIDTH(wsync_diff_same_1, uint8_t)
SAME_WIDTH(wsync_diff_same_2, uint16_t)
SAME_WIDTH(wsync_diff_same_4, uint32_t)
SAME_WIDTH(wsync_diff_same_8, uint64_t)

/* ---------------------------------------------------------------------------------------------------------------------
 * Block FP8: e4m3fn bytes and one float32 scale per 128x128 block, as bridge/codecs/fp8.py makes them in torch.
 */
#define QBLOCK 128

/* float32 -> float8_e4m3fn bits exactly as torch casts (torch/headeronly/util/Float8_e4m3fn.h,
 * fp8e4m3fn_from_fp32_value, and its AVX-512 twin): round to nearest even, saturate to 448, NaN to 0x7F. */
static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Every case computed, then chosen with masks: no branch, so the loop that calls it vectorizes (with `?:` gcc keeps
 * a branch around the float addition). */
static inline uint32_t e4m3_bits(uint32_t f_bits) {
    const uint32_t sign = f_bits & 0x80000000u;
    const uint32_t a = f_bits ^ sign;
    const uint32_t denormal = bits_of(as_float(a) + as_float(141u << 23)) - (141u << 23);
    uint32_t normal = (a + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    normal -= normal == 0x7f; /* rounding may carry into the NaN pattern: saturate to 0x7E */
    const int32_t m = (int32_t)a; /* (the sign is off: signed compares, which SIMD has, order it as unsigned) */
    const uint32_t small = -(uint32_t)(m < (int32_t)(121u << 23));
    const uint32_t over = -(uint32_t)(m >= (int32_t)(1087u << 20));
    const uint32_t r = (((denormal & small) | (normal & ~small)) & ~over) | ((0x7eu + (m > 0x7f800000)) & over);
    return r | (sign >> 24);
}

/* e4m3_bits of a value below 456 in magnitude and not NaN, where torch's cast neither saturates nor makes a NaN: a
 * block's values scaled by its own absmax (448 at most, and a rounding of it), in two thirds of the work. */
static inline uint32_t e4m3_bits_in_range(uint32_t f_bits) {
    const uint32_t sign = f_bits & 0x80000000u;
    const uint32_t a = f_bits ^ sign;
    const uint32_t denormal = bits_of(as_float(a) + as_float(141u << 23)) - (141u << 23);
    const uint32_t normal = (a + ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    const uint32_t small = -(uint32_t)((int32_t)a < (int32_t)(121u << 23));
    return ((denormal & small) | (normal & ~small)) | (sign >> 24);
}

/* The value a float32 element serves as: itself, or its bfloat16 cast (`bf16`) back in float32. */
static inline float served(uint32_t u, int bf16) {
    return bf16 ? as_float((uint32_t)bf16_bits(u) << 16) : as_float(u);
}

/* The scales of one block row (128 rows of `k` float32 at `block`, `kb` blocks): max(absmax, floor) / 448 of the
 * served values, as torch's block_amax and block_scales take them. */
static void block_row_scales(const uint32_t *block, int64_t k, int64_t kb, int bf16, float floor, float *scales) {
    for (int64_t j = 0; j < kb; j++) {
        /* A running maximum per column (a loop the compiler vectorizes) of the magnitudes' bits: they order as the
         * magnitudes do, and every NaN above infinity, so a NaN makes the scale NaN, as torch's amax does. */
        uint32_t top[QBLOCK] = {0};
        for (int64_t r = 0; r < QBLOCK; r++) {
            const uint32_t *s = block + r * k + j * QBLOCK;
            for (int i = 0; i < QBLOCK; i++) {
                const uint32_t m = s[i] & 0x7fffffffu;
                top[i] = m > top[i] ? m : top[i];
            }
        }
        for (int i = 1; i < QBLOCK; i++)
            top[0] = top[i] > top[0] ? top[i] : top[0];
        const float amax = served(top[0] > 0x7f800000u ? 0x7fc00000u : top[0], bf16);
        scales[j] = (amax < floor ? floor : amax) / 448.0f;
    }
}

/* 128 float32 `x`, served as bfloat16 (`bf16`) or float32, times `f` (a block's 1 / scale) as e4m3fn into `q`;
 * `own`: `f` is the block's own (1 / scale of its absmax, finite), so every value is in e4m3_bits_in_range's range. */
static inline void quantize_run(const uint32_t *x, float f, int bf16, int own, uint8_t *q) {
    uint32_t wide[QBLOCK]; /* (32-bit lanes throughout, then one narrowing: fewer shuffles) */
    if (own && bf16) { /* (one loop per case, so that each vectorizes; no NaN to cast in a block of finite scale) */
        for (int i = 0; i < QBLOCK; i++)
            wide[i] = e4m3_bits_in_range(bits_of(as_float((x[i] + 0x7fffu + ((x[i] >> 16) & 1u)) & 0xffff0000u) * f));
    } else if (own) {
        for (int i = 0; i < QBLOCK; i++)
            wide[i] = e4m3_bits_in_range(bits_of(as_float(x[i]) * f));
    } else if (bf16) {
        for (int i = 0; i < QBLOCK; i++)
            wide[i] = e4m3_bits(bits_of(as_float((uint32_t)bf16_bits(x[i]) << 16) * f));
    } else {
        for (int i = 0; i < QBLOCK; i++)
            wide[i] = e4m3_bits(bits_of(as_float(x[i]) * f));
    }
    for (int i = 0; i < QBLOCK; i++)
        q[i] = (uint8_t)wide[i];
}

/* Block-aligned float32 `rows` ([n, k], both multiples of 128, row-major), served as bfloat16 (`bf16`) or float32,
 * quantized per block into `out` ([n, k] e4m3fn). `grid` ([n / 128, k / 128] float32) holds the blocks' scales: taken
 * here (`take`: max(absmax, floor) / 448 of the served values, torch's block_amax and block_scales) or given. One block
 * row at a time: its absmax pass leaves it in cache for the quantizing pass. */
void wsync_quantize_blocks(const uint32_t *rows, int64_t n, int64_t k, int bf16, int take, float floor,
                           float *grid, uint8_t *out) {
    const int64_t kb = k / QBLOCK;
    float inv[kb > 0 ? kb : 1];
    int own[kb > 0 ? kb : 1];
    for (int64_t b = 0; b < n / QBLOCK; b++) {
        const uint32_t *block = rows + b * QBLOCK * k;
        float *scales = grid + b * kb;
        if (take)
            block_row_scales(block, k, kb, bf16, floor, scales);
        for (int64_t j = 0; j < kb; j++) {
            inv[j] = 1.0f / scales[j];
            own[j] = take && scales[j] - scales[j] == 0.0f && inv[j] - inv[j] == 0.0f; /* (both finite) */
        }
        for (int64_t r = 0; r < QBLOCK; r++)
            for (int64_t j = 0; j < kb; j++)
                quantize_run(block + r * k + j * QBLOCK, inv[j], bf16, own[j], out + (b * QBLOCK + r) * k + j * QBLOCK);
    }
}

/* ---- the delta's gap records (bridge/codecs/delta.py: GAPS8/16/32). A gap g > 0 moves the position by g and marks
 * it; a gap 0 (the escape) moves it by the type's largest value and marks nothing. Reading from position -1. Each
 * loop is written once per gap type and item size (macros), so that the compiler makes each a plain loop. */

#define GAPS_COUNT(T)                                                                                              \
    static int64_t gaps_count_##T(const T *gaps, int64_t entries, int64_t length, int64_t *last) {                 \
        const int64_t top = (T)~(T)0;                                                                              \
        int64_t p = -1, c = 0;                                                                                     \
        for (int64_t i = 0; i < entries; i++) {                                                                    \
            const int64_t g = gaps[i];                                                                             \
            p += g ? g : top;                                                                                      \
            c += g != 0;                                                                                           \
            if (p >= length)                                                                                       \
                return -1;                                                                                         \
        }                                                                                                          \
        *last = c ? p : -1;                                                                                        \
        return c;                                                                                                  \
    }
GAPS_COUNT(uint8_t)
GAPS_COUNT(uint16_t)
GAPS_COUNT(uint32_t)

/* The positions `entries` gaps of `width` bytes mark: how many, the last in *last (-1 for none); -1 as soon as one
 * reaches `length` (the record would write outside its piece). */
int64_t wsync_gaps_count(const void *gaps, int width, int64_t entries, int64_t length, int64_t *last) {
    if (width == 1)
        return gaps_count_uint8_t(gaps, entries, length, last);
    if (width == 2)
        return gaps_count_uint16_t(gaps, entries, length, last);
    return gaps_count_uint32_t(gaps, entries, length, last);
}

#define GAPS_APPLY(T, V)                                                                                           \
    static void gaps_apply_##T##_##V(const T *gaps, int64_t entries, const V *values, V *target) {                 \
        const int64_t top = (T)~(T)0;                                                                              \
        int64_t p = -1;                                                                                            \
        for (int64_t i = 0; i < entries; i++) {                                                                    \
            const int64_t g = gaps[i];                                                                             \
            if (g) {                                                                                               \
                p += g;                                                                                            \
                target[p] = *values++;                                                                             \
            } else                                                                                                 \
                p += top;                                                                                          \
        }                                                                                                          \
    }
#define GAPS_APPLY_ALL(T) GAPS_APPLY(T, uint8_t) GAPS_APPLY(T, uint16_t) GAPS_APPLY(T, uint32_t) GAPS_APPLY(T, uint64_t)
GAPS_APPLY_ALL(uint8_t)
GAPS_APPLY_ALL(uint16_t)
GAPS_APPLY_ALL(uint32_t)

#define GAPS_APPLY_TO(T)                                                                                           \
    switch (itemsize) {                                                                                            \
    case 1: gaps_apply_##T##_uint8_t(gaps, entries, values, target); return;                                       \
    case 2: gaps_apply_##T##_uint16_t(gaps, entries, values, target); return;                                      \
    case 4: gaps_apply_##T##_uint32_t(gaps, entries, values, target); return;                                      \
    default: gaps_apply_##T##_uint64_t(gaps, entries, values, target); return;                                     \
    }

/* Assign the values (`itemsize` bytes each: 1, 2, 4 or 8, in position order) at the positions the gaps mark, into
 * the piece `target`; the gaps were checked with wsync_gaps_count. */
void wsync_gaps_apply(const void *gaps, int width, int64_t entries, const void *values, int itemsize, void *target) {
    if (width == 1) {
        GAPS_APPLY_TO(uint8_t)
    } else if (width == 2) {
        GAPS_APPLY_TO(uint16_t)
    } else {
        GAPS_APPLY_TO(uint32_t)
    }
}

/* For the encoder's choice: the escapes each gap width (1, 2, 4 bytes) would need between `n` increasing positions
 * (from -1), in esc[0..2] (a distance d needs (d - 1) / M of them). */
void wsync_gaps_escapes(const int64_t *pos, int64_t n, int64_t *esc) {
    int64_t prev = -1, e1 = 0, e2 = 0, e4 = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t d = pos[i] - prev;
        prev = pos[i];
        if (d > 0xff) { /* (rare where gaps pay: no division otherwise) */
            e1 += (d - 1) / 0xff;
            e2 += (d - 1) / 0xffff;
            e4 += (d - 1) / 0xffffffffll;
        }
    }
    esc[0] = e1;
    esc[1] = e2;
    esc[2] = e4;
}

#define GAPS_WRITE(T)                                                                                              \
    static int64_t gaps_write_##T(const int64_t *pos, int64_t n, T *out) {                                         \
        const int64_t top = (T)~(T)0;                                                                              \
        int64_t prev = -1, e = 0;                                                                                  \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            int64_t d = pos[i] - prev;                                                                             \
            prev = pos[i];                                                                                         \
            for (; d > top; d -= top) /* an escape: the type's largest value, nothing marked */                    \
                out[e++] = 0;                                                                                      \
            out[e++] = (T)d;                                                                                       \
        }                                                                                                          \
        return e;                                                                                                  \
    }
GAPS_WRITE(uint8_t)
GAPS_WRITE(uint16_t)
GAPS_WRITE(uint32_t)

/* The gaps of `n` increasing positions in `width` bytes each (escapes included) into `out`; how many. */
int64_t wsync_gaps_write(const int64_t *pos, int64_t n, int width, void *out) {
    if (width == 1)
        return gaps_write_uint8_t(pos, n, out);
    if (width == 2)
        return gaps_write_uint16_t(pos, n, out);
    return gaps_write_uint32_t(pos, n, out);
}
