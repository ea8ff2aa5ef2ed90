#include "services/vision/image_decoder.h"

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

// clang-format off: jpeglib.h needs <cstdio> first.
#include <jpeglib.h>
#include <jerror.h>
// clang-format on
#include <png.h>
#include <webp/decode.h>
#include <webp/demux.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

// The libjpeg and libpng error paths longjmp. Each setjmp lives in a small
// function whose locals are all trivially destructible; every C++ object
// (buffers, messages) is created by the caller before the call, so a longjmp
// never skips a destructor.

namespace vlm::vision {
namespace {

// Progressive JPEGs with thousands of tiny scans are a known CPU sink; real
// files use about ten.
constexpr int kMaxJpegScans = 1000;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(message);
}

absl::Status CheckDimensions(const char* format, int64_t width, int64_t height,
                             const DecodeLimits& limits) {
  if (width <= 0 || height <= 0) {
    return Invalid(absl::StrFormat("%s image has invalid dimensions %dx%d", format, width,
                                   height));
  }
  const int64_t pixels = width * height;  // both < 2^32: no overflow
  if (pixels > limits.max_decoded_pixels) {
    return Invalid(absl::StrFormat("image is %dx%d = %d pixels; max_decoded_pixels is %d",
                                   width, height, pixels, limits.max_decoded_pixels));
  }
  const double ratio = static_cast<double>(std::max(width, height)) /
                       static_cast<double>(std::min(width, height));
  if (ratio > limits.max_aspect_ratio) {
    return Invalid(absl::StrFormat(
        "image is %dx%d, aspect ratio %.6g; the maximum aspect ratio is %g", width, height,
        ratio, limits.max_aspect_ratio));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- JPEG ----

struct JpegState {
  jpeg_decompress_struct cinfo;
  jpeg_error_mgr err;
  jpeg_progress_mgr progress;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX + 64] = {0};
  bool created = false;

  ~JpegState() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

JpegState* StateOf(j_common_ptr cinfo) { return static_cast<JpegState*>(cinfo->client_data); }

[[noreturn]] void JpegErrorExit(j_common_ptr cinfo) {
  JpegState* state = StateOf(cinfo);
  (*cinfo->err->format_message)(cinfo, state->message);
  longjmp(state->jump, 1);
}

// Warnings that mean the entropy-coded data is damaged or cut short are
// errors here: libjpeg would otherwise return grey or garbage pixels. Benign
// warnings (extraneous bytes before a marker, odd JFIF versions) are ignored,
// as Pillow ignores them.
void JpegEmitMessage(j_common_ptr cinfo, int msg_level) {
  if (msg_level >= 0) return;  // trace messages
  switch (cinfo->err->msg_code) {
    case JWRN_JPEG_EOF:
    case JWRN_HIT_MARKER:
    case JWRN_HUFF_BAD_CODE:
    case JWRN_ARITH_BAD_CODE:
    case JWRN_MUST_RESYNC:
      JpegErrorExit(cinfo);
    default:
      cinfo->err->num_warnings++;
  }
}

void JpegOutputMessage(j_common_ptr) {}

void JpegProgressMonitor(j_common_ptr cinfo) {
  if (!cinfo->is_decompressor) return;
  auto* dinfo = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (dinfo->input_scan_number > kMaxJpegScans) {
    JpegState* state = StateOf(cinfo);
    std::snprintf(state->message, sizeof(state->message),
                  "progressive JPEG has more than %d scans", kMaxJpegScans);
    longjmp(state->jump, 1);
  }
}

// Phase 1: parse the headers. Returns false with state->message on error.
bool JpegReadHeader(JpegState* state, const uint8_t* data, size_t size) {
  state->cinfo.err = jpeg_std_error(&state->err);
  state->err.error_exit = JpegErrorExit;
  state->err.emit_message = JpegEmitMessage;
  state->err.output_message = JpegOutputMessage;
  state->cinfo.client_data = state;  // jpeg_create_decompress keeps it
  if (setjmp(state->jump)) return false;
  jpeg_create_decompress(&state->cinfo);
  state->created = true;
  state->progress.progress_monitor = JpegProgressMonitor;
  state->cinfo.progress = &state->progress;
  jpeg_mem_src(&state->cinfo, data, static_cast<unsigned long>(size));
  jpeg_save_markers(&state->cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(&state->cinfo, TRUE);
  return true;
}

// Phase 2: decode into `image` (sized here: the output size follows the DCT
// scale set on the decompressor) using `scratch_buffer` for grey and CMYK rows.
bool JpegDecodePixels(JpegState* state, RgbImage* image, std::vector<uint8_t>* scratch_buffer) {
  if (setjmp(state->jump)) return false;
  j_decompress_ptr cinfo = &state->cinfo;
  const int components = cinfo->num_components;
  if (components == 1) {
    cinfo->out_color_space = JCS_GRAYSCALE;
  } else if (components == 3) {
    cinfo->out_color_space = JCS_RGB;
  } else {
    cinfo->out_color_space = JCS_CMYK;  // CMYK or YCCK in the file
  }
  jpeg_start_decompress(cinfo);
  const size_t width = cinfo->output_width;
  image->width = static_cast<int>(cinfo->output_width);
  image->height = static_cast<int>(cinfo->output_height);
  image->pixels.resize(width * cinfo->output_height * 3);
  scratch_buffer->resize(width * 4);
  uint8_t* const rgb = image->pixels.data();
  uint8_t* const scratch = scratch_buffer->data();
  while (cinfo->output_scanline < cinfo->output_height) {
    uint8_t* out = rgb + static_cast<size_t>(cinfo->output_scanline) * width * 3;
    JSAMPROW row = components == 3 ? out : scratch;
    jpeg_read_scanlines(cinfo, &row, 1);
    if (components == 1) {
      for (size_t x = 0; x < width; ++x) out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = scratch[x];
    } else if (components == 4) {
      // Pillow reads every CMYK JPEG as "CMYK;I" (Adobe polarity: stored
      // inverted), then converts with cmyk2rgb:
      // out = nk - nk*c/255 (rounded as MULDIV255), nk = 255 - k.
      for (size_t x = 0; x < width; ++x) {
        const uint8_t* in = scratch + 4 * x;
        const int nk = in[3];  // 255 - (255 - stored k)
        for (int c = 0; c < 3; ++c) {
          const int cyan = 255 - in[c];
          const int tmp = cyan * nk + 128;
          const int v = nk - (((tmp >> 8) + tmp) >> 8);
          out[3 * x + c] = static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
        }
      }
    }
  }
  return true;
}

absl::StatusOr<DecodedImage> DecodeJpeg(absl::string_view bytes, const DecodeLimits& limits,
                                        const DecodeSizeHint& min_size) {
  auto state = std::make_unique<JpegState>();
  if (!JpegReadHeader(state.get(), reinterpret_cast<const uint8_t*>(bytes.data()),
                      bytes.size())) {
    return Invalid(absl::StrCat("invalid JPEG: ", state->message));
  }
  jpeg_decompress_struct& cinfo = state->cinfo;
  if (absl::Status s = CheckDimensions("JPEG", cinfo.image_width, cinfo.image_height, limits);
      !s.ok()) {
    return s;
  }
  const int components = cinfo.num_components;
  if (components != 1 && components != 3 && components != 4) {
    return Invalid(absl::StrFormat(
        "JPEG with %d colour components is not supported (1, 3 or 4 are)", components));
  }
  std::string exif;
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != nullptr; m = m->next) {
    // Pillow keeps the first APP1 that starts with "Exif\0".
    if (m->marker == JPEG_APP0 + 1 && m->data_length >= 5 &&
        std::memcmp(m->data, "Exif\0", 5) == 0) {
      exif.assign(reinterpret_cast<const char*>(m->data), m->data_length);
      break;
    }
  }

  DecodedImage result;
  result.format = ImageFormat::kJpeg;
  result.exif_orientation = exif.empty() ? 1 : ExifOrientation(exif);
  const int64_t width = cinfo.image_width, height = cinfo.image_height;
  const bool swapped = result.exif_orientation >= 5 && result.exif_orientation <= 8;
  result.source_width = static_cast<int>(swapped ? height : width);
  result.source_height = static_cast<int>(swapped ? width : height);
  if (min_size) {
    // The smallest DCT scale n/8 whose output (rounded up, as libjpeg does)
    // is at least the size asked for, in stored orientation.
    auto [min_w, min_h] = min_size(result.source_width, result.source_height);
    if (swapped) std::swap(min_w, min_h);
    for (int n = 1; n < 8; ++n) {
      if ((width * n + 7) / 8 >= min_w && (height * n + 7) / 8 >= min_h) {
        result.scale_num = n;
        break;
      }
    }
  }
  cinfo.scale_num = static_cast<unsigned int>(result.scale_num);
  cinfo.scale_denom = 8;
  std::vector<uint8_t> scratch;
  if (!JpegDecodePixels(state.get(), &result.image, &scratch)) {
    return Invalid(absl::StrCat("invalid JPEG data: ", state->message));
  }
  // The rest of the file (after the last scanline) is not read: a missing EOI
  // after complete image data is tolerated.
  return result;
}

// ----------------------------------------------------------------- PNG ----

struct PngState {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t pos = 0;
  char message[256] = {0};

  ~PngState() {
    if (png != nullptr) png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr);
  }
};

[[noreturn]] void PngError(png_structp png, png_const_charp message) {
  auto* state = static_cast<PngState*>(png_get_error_ptr(png));
  std::snprintf(state->message, sizeof(state->message), "%s", message);
  png_longjmp(png, 1);
}

void PngWarning(png_structp, png_const_charp) {}

void PngRead(png_structp png, png_bytep out, size_t length) {
  auto* state = static_cast<PngState*>(png_get_io_ptr(png));
  if (state->size - state->pos < length) png_error(png, "unexpected end of file (truncated)");
  std::memcpy(out, state->data + state->pos, length);
  state->pos += length;
}

struct PngHeader {
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0, interlace = 0;
};

// Phase 1: signature and the chunks before the first IDAT.
bool PngReadInfo(PngState* state, PngHeader* header) {
  if (setjmp(png_jmpbuf(state->png))) return false;
  png_set_read_fn(state->png, state, PngRead);
  // Our own limits decide; libpng's default 1e6 x 1e6 limit would preempt them.
  png_set_user_limits(state->png, PNG_UINT_31_MAX, PNG_UINT_31_MAX);
  png_set_chunk_malloc_max(state->png, 16 << 20);
  // Only IHDR, PLTE, IDAT, IEND (and eXIf for orientation) matter for
  // convert("RGB"); every other ancillary chunk (gamma, ICC, text) is skipped.
  png_set_keep_unknown_chunks(state->png, PNG_HANDLE_CHUNK_NEVER, nullptr, -1);
  static const png_byte kExif[] = {'e', 'X', 'I', 'f', '\0'};
  png_set_keep_unknown_chunks(state->png, PNG_HANDLE_CHUNK_AS_DEFAULT, kExif, 1);
#ifdef PNG_CHECK_FOR_INVALID_INDEX_SUPPORTED
  png_set_check_for_invalid_index(state->png, 0);  // out-of-range indices read as grey
#endif
  png_read_info(state->png, state->info);
  png_get_IHDR(state->png, state->info, &header->width, &header->height, &header->bit_depth,
               &header->color_type, &header->interlace, nullptr, nullptr);
  return true;
}

// Phase 2: the transforms that give one byte per sample (two for 16-bit
// grey, which is clipped, not shifted) and, for interlaced files, the number
// of passes. The row size after them must be `expected_row_bytes`.
bool PngSetTransforms(PngState* state, const PngHeader& h, size_t expected_row_bytes,
                      int* passes) {
  if (setjmp(png_jmpbuf(state->png))) return false;
  png_structp png = state->png;
  if (h.color_type == PNG_COLOR_TYPE_GRAY && h.bit_depth < 8) {
    png_set_expand_gray_1_2_4_to_8(png);  // 1-bit -> 0/255, 2-bit -> *0x55, 4-bit -> *0x11
  }
  if (h.color_type == PNG_COLOR_TYPE_PALETTE && h.bit_depth < 8) png_set_packing(png);
  if (h.bit_depth == 16 && h.color_type != PNG_COLOR_TYPE_GRAY) png_set_strip_16(png);
  *passes = png_set_interlace_handling(png);
  png_read_update_info(png, state->info);
  if (png_get_rowbytes(png, state->info) != expected_row_bytes) {
    png_error(png, "unexpected row size after transforms");
  }
  return true;
}

// Reads `count` rows (one pass over them for interlaced files).
bool PngReadRows(PngState* state, png_bytepp rows, int count) {
  if (setjmp(png_jmpbuf(state->png))) return false;
  png_read_rows(state->png, rows, nullptr, static_cast<png_uint_32>(count));
  return true;
}

// Phase 3: chunks after the image data (an eXIf may sit there). Errors here
// are ignored: the pixels are complete, and Pillow does not read past them
// strictly either.
bool PngReadEnd(PngState* state) {
  if (setjmp(png_jmpbuf(state->png))) return false;
  png_read_end(state->png, state->info);
  return true;
}

// Converts one row of libpng output (after PngSetTransforms) to RGB.
void PngRowToRgb(const PngHeader& h, const uint8_t* in, const uint8_t (*palette)[3],
                 uint8_t* out) {
  const size_t width = h.width;
  switch (h.color_type) {
    case PNG_COLOR_TYPE_GRAY:
      if (h.bit_depth == 16) {
        // Pillow opens it as "I" (0..65535); I -> RGB clips at 255.
        for (size_t x = 0; x < width; ++x) {
          const int v = (in[2 * x] << 8) | in[2 * x + 1];
          out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = static_cast<uint8_t>(v > 255 ? 255 : v);
        }
      } else {
        for (size_t x = 0; x < width; ++x) out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = in[x];
      }
      break;
    case PNG_COLOR_TYPE_RGB:
      std::memcpy(out, in, width * 3);
      break;
    case PNG_COLOR_TYPE_PALETTE:
      for (size_t x = 0; x < width; ++x) std::memcpy(out + 3 * x, palette[in[x]], 3);
      break;
    case PNG_COLOR_TYPE_GRAY_ALPHA:
      for (size_t x = 0; x < width; ++x) {
        out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = in[2 * x];
      }
      break;
    case PNG_COLOR_TYPE_RGB_ALPHA:
      for (size_t x = 0; x < width; ++x) std::memcpy(out + 3 * x, in + 4 * x, 3);
      break;
  }
}

absl::StatusOr<DecodedImage> DecodePng(absl::string_view bytes, const DecodeLimits& limits) {
  auto state = std::make_unique<PngState>();
  state->data = reinterpret_cast<const uint8_t*>(bytes.data());
  state->size = bytes.size();
  state->png = png_create_read_struct(PNG_LIBPNG_VER_STRING, state.get(), PngError, PngWarning);
  if (state->png == nullptr) return absl::ResourceExhaustedError("cannot create a PNG reader");
  state->info = png_create_info_struct(state->png);
  if (state->info == nullptr) return absl::ResourceExhaustedError("cannot create a PNG reader");

  PngHeader h;
  if (!PngReadInfo(state.get(), &h)) return Invalid(absl::StrCat("invalid PNG: ", state->message));
  if (absl::Status s = CheckDimensions("PNG", h.width, h.height, limits); !s.ok()) return s;

  int channels = 0;
  switch (h.color_type) {
    case PNG_COLOR_TYPE_GRAY: channels = 1; break;
    case PNG_COLOR_TYPE_RGB: channels = 3; break;
    case PNG_COLOR_TYPE_PALETTE: channels = 1; break;
    case PNG_COLOR_TYPE_GRAY_ALPHA: channels = 2; break;
    case PNG_COLOR_TYPE_RGB_ALPHA: channels = 4; break;
    default: return Invalid(absl::StrFormat("PNG colour type %d is not supported", h.color_type));
  }
  const size_t sample_bytes = (h.color_type == PNG_COLOR_TYPE_GRAY && h.bit_depth == 16) ? 2 : 1;
  const size_t row_bytes = static_cast<size_t>(h.width) * channels * sample_bytes;

  // Pillow's palette has 256 entries: PLTE's colours, then the grey ramp it
  // starts from (an index past PLTE reads as (i, i, i)).
  uint8_t palette[256][3];
  for (int i = 0; i < 256; ++i) palette[i][0] = palette[i][1] = palette[i][2] = static_cast<uint8_t>(i);
  if (h.color_type == PNG_COLOR_TYPE_PALETTE) {
    png_colorp entries = nullptr;
    int count = 0;
    if (png_get_PLTE(state->png, state->info, &entries, &count) != 0) {
      for (int i = 0; i < count && i < 256; ++i) {
        palette[i][0] = entries[i].red;
        palette[i][1] = entries[i].green;
        palette[i][2] = entries[i].blue;
      }
    }
  }

  int passes = 1;
  if (!PngSetTransforms(state.get(), h, row_bytes, &passes)) {
    return Invalid(absl::StrCat("invalid PNG: ", state->message));
  }

  DecodedImage result;
  result.format = ImageFormat::kPng;
  result.image.width = static_cast<int>(h.width);
  result.image.height = static_cast<int>(h.height);
  result.image.pixels.resize(static_cast<size_t>(h.width) * h.height * 3);
  uint8_t* rgb = result.image.pixels.data();
  if (passes == 1) {
    std::vector<uint8_t> row(row_bytes);
    png_bytep row_ptr = row.data();
    for (png_uint_32 y = 0; y < h.height; ++y) {
      if (!PngReadRows(state.get(), &row_ptr, 1)) {
        return Invalid(absl::StrCat("invalid PNG data: ", state->message));
      }
      PngRowToRgb(h, row.data(), palette, rgb + static_cast<size_t>(y) * h.width * 3);
    }
  } else {
    std::vector<uint8_t> all(row_bytes * h.height);
    std::vector<png_bytep> rows(h.height);
    for (png_uint_32 y = 0; y < h.height; ++y) rows[y] = all.data() + y * row_bytes;
    for (int pass = 0; pass < passes; ++pass) {
      if (!PngReadRows(state.get(), rows.data(), static_cast<int>(h.height))) {
        return Invalid(absl::StrCat("invalid PNG data: ", state->message));
      }
    }
    for (png_uint_32 y = 0; y < h.height; ++y) {
      PngRowToRgb(h, rows[y], palette, rgb + static_cast<size_t>(y) * h.width * 3);
    }
  }
  PngReadEnd(state.get());  // best effort, see PngReadEnd

  png_bytep exif = nullptr;
  png_uint_32 exif_size = 0;
  if (png_get_eXIf_1(state->png, state->info, &exif_size, &exif) != 0 && exif != nullptr) {
    result.exif_orientation =
        ExifOrientation(absl::string_view(reinterpret_cast<const char*>(exif), exif_size));
  }
  return result;
}

// ---------------------------------------------------------------- WebP ----

absl::StatusOr<DecodedImage> DecodeWebp(absl::string_view bytes, const DecodeLimits& limits) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  WebPBitstreamFeatures features;
  if (WebPGetFeatures(data, bytes.size(), &features) != VP8_STATUS_OK) {
    return Invalid("invalid WebP: malformed or truncated header");
  }
  if (absl::Status s = CheckDimensions("WebP", features.width, features.height, limits); !s.ok()) {
    return s;
  }
  // The whole container must parse (Pillow's decoder demuxes it first).
  const WebPData webp_data{data, bytes.size()};
  std::unique_ptr<WebPDemuxer, void (*)(WebPDemuxer*)> demux(WebPDemux(&webp_data),
                                                             WebPDemuxDelete);
  if (demux == nullptr) return Invalid("invalid WebP: malformed or truncated container");
  const uint32_t canvas_width = WebPDemuxGetI(demux.get(), WEBP_FF_CANVAS_WIDTH);
  const uint32_t canvas_height = WebPDemuxGetI(demux.get(), WEBP_FF_CANVAS_HEIGHT);
  if (absl::Status s = CheckDimensions("WebP", canvas_width, canvas_height, limits); !s.ok()) {
    return s;
  }

  DecodedImage result;
  result.format = ImageFormat::kWebp;
  result.image.width = static_cast<int>(canvas_width);
  result.image.height = static_cast<int>(canvas_height);
  const size_t pixels = static_cast<size_t>(canvas_width) * canvas_height;
  if (!features.has_animation) {
    // A still image: straight into the RGB buffer. Pillow decodes to RGBA
    // (non-premultiplied) and drops alpha: the same colour values.
    result.image.pixels.resize(pixels * 3);
    if (WebPDecodeRGBInto(data, bytes.size(), result.image.pixels.data(),
                          result.image.pixels.size(), static_cast<int>(canvas_width) * 3) ==
        nullptr) {
      return Invalid("invalid WebP data: the image data is corrupt or truncated");
    }
  } else {
    // Animated: the first frame on its canvas, as Pillow's WebPAnimDecoder
    // (default options: RGBA, no threads) composes it.
    WebPAnimDecoderOptions options;
    if (!WebPAnimDecoderOptionsInit(&options)) return absl::InternalError("libwebp mismatch");
    options.color_mode = MODE_RGBA;
    options.use_threads = 0;
    std::unique_ptr<WebPAnimDecoder, void (*)(WebPAnimDecoder*)> decoder(
        WebPAnimDecoderNew(&webp_data, &options), WebPAnimDecoderDelete);
    if (decoder == nullptr) return Invalid("invalid WebP: malformed animation");
    uint8_t* rgba = nullptr;
    int timestamp = 0;
    if (!WebPAnimDecoderGetNext(decoder.get(), &rgba, &timestamp) || rgba == nullptr) {
      return Invalid("invalid WebP data: the first frame is corrupt or truncated");
    }
    result.image.pixels.resize(pixels * 3);
    for (size_t i = 0; i < pixels; ++i) std::memcpy(&result.image.pixels[3 * i], rgba + 4 * i, 3);
  }

  WebPChunkIterator chunk;
  if (WebPDemuxGetChunk(demux.get(), "EXIF", 1, &chunk)) {
    result.exif_orientation = ExifOrientation(absl::string_view(
        reinterpret_cast<const char*>(chunk.chunk.bytes), chunk.chunk.size));
    WebPDemuxReleaseChunkIterator(&chunk);
  }
  return result;
}

// ---------------------------------------------------------------- EXIF ----

uint32_t ReadU16(const uint8_t* p, bool little) {
  return little ? (p[0] | (p[1] << 8)) : ((p[0] << 8) | p[1]);
}
uint32_t ReadU32(const uint8_t* p, bool little) {
  return little ? (p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24))
                : ((static_cast<uint32_t>(p[0]) << 24) | (p[1] << 16) | (p[2] << 8) | p[3]);
}

}  // namespace

std::string RgbImage::HashHeader() const {
  return absl::StrFormat("rgb8 %dx%d\n", width, height);
}

const char* ImageFormatName(ImageFormat format) {
  switch (format) {
    case ImageFormat::kJpeg: return "JPEG";
    case ImageFormat::kPng: return "PNG";
    case ImageFormat::kWebp: return "WebP";
    case ImageFormat::kGif: return "GIF";
    case ImageFormat::kBmp: return "BMP";
    case ImageFormat::kTiff: return "TIFF";
    case ImageFormat::kUnknown: break;
  }
  return "unknown";
}

ImageFormat SniffImageFormat(absl::string_view b) {
  auto starts = [&](absl::string_view magic) { return b.substr(0, magic.size()) == magic; };
  if (starts(absl::string_view("\xFF\xD8\xFF", 3))) return ImageFormat::kJpeg;
  if (starts(absl::string_view("\x89PNG\r\n\x1A\n", 8))) return ImageFormat::kPng;
  if (b.size() >= 12 && starts("RIFF") && b.substr(8, 4) == "WEBP") return ImageFormat::kWebp;
  if (starts("GIF87a") || starts("GIF89a")) return ImageFormat::kGif;
  if (starts("BM")) return ImageFormat::kBmp;
  if (starts(absl::string_view("II*\0", 4)) || starts(absl::string_view("MM\0*", 4))) {
    return ImageFormat::kTiff;
  }
  return ImageFormat::kUnknown;
}

int ExifOrientation(absl::string_view exif) {
  if (exif.substr(0, 6) == absl::string_view("Exif\0\0", 6)) exif.remove_prefix(6);
  const auto* p = reinterpret_cast<const uint8_t*>(exif.data());
  const size_t size = exif.size();
  if (size < 8) return 1;
  bool little;
  if (std::memcmp(p, "II*\0", 4) == 0) {
    little = true;
  } else if (std::memcmp(p, "MM\0*", 4) == 0) {
    little = false;
  } else {
    return 1;
  }
  const size_t ifd = ReadU32(p + 4, little);
  if (ifd > size || size - ifd < 2) return 1;
  const size_t entries = ReadU16(p + ifd, little);
  for (size_t i = 0; i < entries; ++i) {
    const size_t off = ifd + 2 + 12 * i;
    if (off + 12 > size) break;
    if (ReadU16(p + off, little) != 0x0112) continue;
    const uint32_t type = ReadU16(p + off + 2, little);
    const uint32_t count = ReadU32(p + off + 4, little);
    if (count != 1) return 1;
    int64_t value;
    switch (type) {
      case 1: case 6: value = p[off + 8]; break;           // BYTE, SBYTE
      case 3: case 8: value = ReadU16(p + off + 8, little); break;  // SHORT, SSHORT
      case 4: case 9: value = ReadU32(p + off + 8, little); break;  // LONG, SLONG
      default: return 1;
    }
    return (value >= 1 && value <= 8) ? static_cast<int>(value) : 1;
  }
  return 1;
}

RgbImage ApplyExifOrientation(RgbImage image, int orientation) {
  if (orientation < 2 || orientation > 8) return image;
  const int w = image.width, h = image.height;
  const bool swap = orientation >= 5;
  RgbImage out;
  out.width = swap ? h : w;
  out.height = swap ? w : h;
  out.pixels.resize(image.pixels.size());
  // For each output pixel (x, y), the source column/row as PIL's transpose
  // methods define them (6 = ROTATE_270 = 90 deg clockwise, 8 = ROTATE_90).
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      int sx = x, sy = y;
      switch (orientation) {
        case 2: sx = w - 1 - x; sy = y; break;              // FLIP_LEFT_RIGHT
        case 3: sx = w - 1 - x; sy = h - 1 - y; break;      // ROTATE_180
        case 4: sx = x; sy = h - 1 - y; break;              // FLIP_TOP_BOTTOM
        case 5: sx = y; sy = x; break;                      // TRANSPOSE
        case 6: sx = y; sy = h - 1 - x; break;              // ROTATE_270
        case 7: sx = w - 1 - y; sy = h - 1 - x; break;      // TRANSVERSE
        case 8: sx = w - 1 - y; sy = x; break;              // ROTATE_90
      }
      const uint8_t* src = &image.pixels[(static_cast<size_t>(sy) * w + sx) * 3];
      uint8_t* dst = &out.pixels[(static_cast<size_t>(y) * out.width + x) * 3];
      dst[0] = src[0];
      dst[1] = src[1];
      dst[2] = src[2];
    }
  }
  return out;
}

absl::StatusOr<DecodedImage> DecodeImage(absl::string_view bytes, const DecodeLimits& limits,
                                         const DecodeSizeHint& min_size) {
  if (bytes.empty()) return Invalid("image is empty (0 bytes)");
  if (static_cast<int64_t>(bytes.size()) > limits.max_encoded_bytes) {
    return Invalid(absl::StrFormat("image is %d bytes; max_encoded_bytes is %d", bytes.size(),
                                   limits.max_encoded_bytes));
  }
  const ImageFormat format = SniffImageFormat(bytes);
  try {
    absl::StatusOr<DecodedImage> decoded;
    switch (format) {
      case ImageFormat::kJpeg: decoded = DecodeJpeg(bytes, limits, min_size); break;
      case ImageFormat::kPng: decoded = DecodePng(bytes, limits); break;
      case ImageFormat::kWebp: decoded = DecodeWebp(bytes, limits); break;
      case ImageFormat::kGif:
      case ImageFormat::kBmp:
      case ImageFormat::kTiff:
        return Invalid(absl::StrCat("unsupported image format ", ImageFormatName(format),
                                    "; supported formats are JPEG, PNG and WebP"));
      case ImageFormat::kUnknown: {
        std::string head;
        for (size_t i = 0; i < bytes.size() && i < 8; ++i) {
          absl::StrAppendFormat(&head, "%s%02x", i ? " " : "", static_cast<uint8_t>(bytes[i]));
        }
        return Invalid(absl::StrCat("unrecognised image format (first bytes ", head,
                                    "); supported formats are JPEG, PNG and WebP"));
      }
    }
    if (!decoded.ok()) return decoded.status();
    if (decoded->exif_orientation != 1) {
      decoded->image = ApplyExifOrientation(std::move(decoded->image), decoded->exif_orientation);
    }
    if (decoded->scale_num == 8) {  // formats that set no source size decode at full size
      decoded->source_width = decoded->image.width;
      decoded->source_height = decoded->image.height;
    }
    return decoded;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory decoding a ", ImageFormatName(format), " image"));
  }
}

}  // namespace vlm::vision
