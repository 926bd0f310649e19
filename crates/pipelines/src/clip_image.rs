//! CLIP image preprocessing, equal bit for bit on the CPU to transformers' `CLIPImageProcessor`
//! (5.24.0) as `ShapEImg2ImgPipeline` (diffusers 0.42.1) calls it:
//! `image_processor(image, return_tensors="pt").pixel_values[0].unsqueeze(0)`, for a PIL image
//! opened from a PNG file. This file owns the configuration (transformers' own
//! `preprocessor_config.json` document, [`ClipImageConfig`]), reading an image file
//! ([`load_image`]) and the preprocessing ([`preprocess`]): RGB conversion, PIL's bicubic resize,
//! the center crop, rescale and normalize. `tests/clip_image.rs` checks it against transformers
//! (`scripts/reference/clip_image_reference.py`) on PNG files of every colour type.
//!
//! # Which class
//!
//! In transformers 5.24 `CLIPImageProcessor` is the torchvision backend; without torchvision
//! installed (the cached environment has none) `from transformers import CLIPImageProcessor` falls
//! back, with a warning, to `CLIPImageProcessorPil`, the PIL/numpy backend, and that is the class
//! the pipeline gets there and the one this file ports. The torchvision backend resizes with
//! torchvision's own kernels and would give other numbers; the reference script records which
//! class it built and the test fails if it is not the PIL one.
//!
//! # What transformers does, step by step
//!
//! 1. **RGB** (`convert_to_rgb`): an image with an alpha band, or with a PNG `tRNS`
//!    transparency, is converted by PIL to `RGBA` and **composited onto opaque white**
//!    (`PIL.Image.alpha_composite`, whose fixed-point arithmetic is reproduced here), then
//!    converted to `RGB`: alpha is not simply dropped. Any other image is `convert("RGB")`-ed (grey
//!    replicated into the three channels). diffusers' `load_image` helper (which the pipeline's
//!    docstring example uses) converts to RGB before and so drops alpha instead; to match that
//!    path, pass an RGB image (for 8-bit images, `DynamicImage::ImageRgb8(image.to_rgb8())`).
//! 2. **Resize** (`size = {"shortest_edge": s}`): the short side becomes `s`, the long side
//!    `int(s * long / short)` (a float64 division, truncated); PIL's `Image.resize` with the
//!    bicubic filter (`resample = 3`) on the 8-bit RGB image: a horizontal and a vertical pass,
//!    each with the filter's float64 coefficients normalized to sum 1 and turned into 22-bit fixed
//!    point (rounded half away from zero), accumulated in integers from a bias of one half, shifted
//!    and clipped to 0..=255 after each pass. The order of the passes matters (the image between
//!    them is rounded to 8 bits): Pillow 13 runs the vertical pass first when the height shrinks by
//!    more than twice as many pixels as the width (`in_h - out_h > 2 * (in_w - out_w)`; tall
//!    portrait images, Pillow PR #9549), the horizontal pass first otherwise, as Pillow 12 and
//!    earlier always did. The rule was read from the disassembled `ImagingResample` of the
//!    installed wheel (its source is newer than the Pillow snapshot at hand) and checked on 397
//!    random size pairs. A pass whose side does not change is skipped; an image already at the
//!    target size is copied.
//! 3. **Center crop** on the 8-bit pixels: top `(h - crop_h) // 2` (floor division), left likewise.
//!    transformers pads with zeros where the crop is larger than the image (it does not fail), and
//!    so does this port.
//! 4. **Rescale**: `float32(float64(pixel) * rescale_factor)`: numpy upcasts to float64,
//!    multiplies by the Python float, then casts to float32.
//! 5. **Normalize**: in float32, `(x - float32(mean[c])) / float32(std[c])`.
//!
//! The result is float32 `[1, 3, crop_h, crop_w]`.
//!
//! # What decodes how
//!
//! [`load_image`] gives the pixels PIL's `Image.open` holds for a PNG of any colour type and bit
//! depth, and [`preprocess`] converts them as PIL does: grey 1, 2, 4 and 8 bits (expanded to 0..=255
//! as PIL's `1`/`L` modes hold them), grey + alpha, RGB, RGBA, palette (with or without a `tRNS`
//! alpha table), and a `tRNS` colour key on grey or RGB (transparent where the colour matches;
//! on 2- and 4-bit grey PIL compares a key to the samples scaled to 8 bits, so that a key other
//! than 0 matches nothing, and [`load_image`] follows it).
//! 16-bit PNGs: PIL keeps the high byte of each RGB, RGBA and grey + alpha sample, and clips a
//! 16-bit grey sample to 255 when it converts its `I;16` image to RGB (it does not scale), and so
//! does this port. A 16-bit PNG with a `tRNS` colour key is refused (PIL compares the key to the
//! 8-bit samples, the Rust decoder to the 16-bit ones), and so is a key outside the range of its
//! bit depth. Bit-equality is claimed for PNG inputs only: JPEG files are read too, but the Rust
//! decoder's output differs from libjpeg's by small amounts. PIL's `Image.open` does not apply an
//! EXIF orientation, and neither does this.
//!
//! The equality was checked against the x86-64 Pillow 13.0.0 wheel (baseline x86-64, without fused
//! multiply-add); a Pillow build that fuses the filter's float operations (common on aarch64) may
//! round some coefficients differently.
//!
//! Only what the published configuration and its neighbours use is supported: `shortest_edge` or
//! `height`/`width` sizes, the bicubic filter, no padding; any other value is an error naming the
//! key (see [`ClipImageConfig::from_json`]).

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use image::DynamicImage;
use serde_json::{Map, Value};
use tch::Tensor;

/// OpenAI CLIP's per-channel mean (transformers' `OPENAI_CLIP_MEAN`).
pub const OPENAI_CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
/// OpenAI CLIP's per-channel standard deviation (transformers' `OPENAI_CLIP_STD`).
pub const OPENAI_CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
/// PIL's number for its bicubic filter (`PIL.Image.Resampling.BICUBIC`), the only `resample`
/// value this port computes.
pub const PIL_BICUBIC: u64 = 3;
/// The most pixels an image this port builds may have (the resized image, the crop): 2^27, about
/// 134 million, 400 MiB of RGB bytes. PIL's own decompression-bomb limit is 179 million pixels.
pub const MAX_PIXELS: u64 = 1 << 27;

/// The fixed-point precision of PIL's 8-bit resampling (`PRECISION_BITS` in `Resample.c`).
const PRECISION_BITS: u32 = 22;
/// The bicubic filter's support and its `a` (PIL's `BICUBIC` filter).
const BICUBIC_SUPPORT: f64 = 2.0;
const BICUBIC_A: f64 = -0.5;

/// The target of the resize step: transformers' `size` dictionary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeTo {
    /// `{"shortest_edge": n}`: the short side becomes `n`, the long one keeps the aspect ratio.
    ShortestEdge(u32),
    /// `{"height": h, "width": w}`: exactly this size.
    Exact {
        /// Height in pixels.
        height: u32,
        /// Width in pixels.
        width: u32,
    },
}

/// The fields of transformers' `CLIPImageProcessor` configuration this port computes, with the
/// names of its `preprocessor_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipImageConfig {
    /// `do_convert_rgb`: convert to RGB (compositing alpha onto white) first.
    pub do_convert_rgb: bool,
    /// `do_resize`.
    pub do_resize: bool,
    /// `size`.
    pub size: ResizeTo,
    /// `resample`: PIL's filter number; only [`PIL_BICUBIC`] is computed.
    pub resample: u64,
    /// `do_center_crop`.
    pub do_center_crop: bool,
    /// `crop_size["height"]`.
    pub crop_height: u32,
    /// `crop_size["width"]`.
    pub crop_width: u32,
    /// `do_rescale`.
    pub do_rescale: bool,
    /// `rescale_factor` (a Python float: float64).
    pub rescale_factor: f64,
    /// `do_normalize`.
    pub do_normalize: bool,
    /// `image_mean`, one per RGB channel (rounded to float32 when used, as numpy does).
    pub image_mean: [f64; 3],
    /// `image_std`, one per RGB channel (rounded to float32 when used).
    pub image_std: [f64; 3],
}

impl Default for ClipImageConfig {
    /// `CLIPImageProcessor`'s class defaults, which are also openai/shap-e-img2img's values.
    fn default() -> Self {
        ClipImageConfig {
            do_convert_rgb: true,
            do_resize: true,
            size: ResizeTo::ShortestEdge(224),
            resample: PIL_BICUBIC,
            do_center_crop: true,
            crop_height: 224,
            crop_width: 224,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: OPENAI_CLIP_MEAN,
            image_std: OPENAI_CLIP_STD,
        }
    }
}

impl ClipImageConfig {
    /// The published image processor of openai/shap-e-img2img
    /// (`image_processor/preprocessor_config.json`): shortest edge 224, bicubic, center crop
    /// 224x224, rescale by 1/255, CLIP's mean and std, RGB conversion.
    pub fn shap_e_img2img() -> Self {
        ClipImageConfig::default()
    }

    /// Reads transformers' `preprocessor_config.json` document (what
    /// `CLIPImageProcessor(...).to_json_string()` writes, or the published file with its older
    /// integer `size` and `crop_size`). A key that is absent takes `CLIPImageProcessor`'s class
    /// default. An integer `size` is a shortest edge (unless `default_to_square` is true), an
    /// integer `crop_size` a square, a two-element list `[height, width]`. A value this port does
    /// not compute (another filter, `longest_edge`, padding, another processor type) is an error
    /// naming the key. Numbers are read with serde_json's parser, exact for decimals of up to 15
    /// significant digits, which covers Python's `repr` of every value of the published
    /// configuration (a 16- or 17-digit `rescale_factor` could be read one float64 ulp off).
    pub fn from_json(text: &str) -> Result<Self, ClipImageError> {
        let document: Value = serde_json::from_str(text).map_err(|e| ClipImageError::Json { error: e.to_string() })?;
        Self::from_value(&document)
    }

    /// [`ClipImageConfig::from_json`] of the file at `path`.
    pub fn from_json_file(path: &Path) -> Result<Self, ClipImageError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ClipImageError::ConfigRead { path: path.to_path_buf(), error: e.to_string() })?;
        Self::from_json(&text).map_err(|error| match error {
            ClipImageError::Json { error } => ClipImageError::Json { error: format!("{}: {error}", path.display()) },
            other => other,
        })
    }

    /// The configuration as transformers' `to_dict()` writes it for `CLIPImageProcessor`.
    pub fn to_value(&self) -> Value {
        let mut map = Map::new();
        let size = match self.size {
            ResizeTo::ShortestEdge(edge) => serde_json::json!({ "shortest_edge": edge }),
            ResizeTo::Exact { height, width } => serde_json::json!({ "height": height, "width": width }),
        };
        map.insert("crop_size".into(), serde_json::json!({ "height": self.crop_height, "width": self.crop_width }));
        map.insert("do_center_crop".into(), self.do_center_crop.into());
        map.insert("do_convert_rgb".into(), self.do_convert_rgb.into());
        map.insert("do_normalize".into(), self.do_normalize.into());
        map.insert("do_rescale".into(), self.do_rescale.into());
        map.insert("do_resize".into(), self.do_resize.into());
        map.insert("image_mean".into(), self.image_mean.to_vec().into());
        map.insert("image_processor_type".into(), "CLIPImageProcessor".into());
        map.insert("image_std".into(), self.image_std.to_vec().into());
        map.insert("resample".into(), self.resample.into());
        map.insert("rescale_factor".into(), self.rescale_factor.into());
        map.insert("size".into(), size);
        Value::Object(map)
    }

    /// [`ClipImageConfig::to_value`] as pretty JSON text.
    pub fn to_json(&self) -> String {
        // Serializing a `Value` of plain numbers, strings and objects cannot fail.
        serde_json::to_string_pretty(&self.to_value()).unwrap_or_default()
    }

    fn from_value(document: &Value) -> Result<Self, ClipImageError> {
        let object = document.as_object().ok_or_else(|| ClipImageError::Config {
            key: "the document",
            found: shown(Some(document)),
            expected: "a JSON object: transformers' preprocessor_config.json",
        })?;
        let get = |key: &str| object.get(key);
        let defaults = ClipImageConfig::default();
        for key in ["image_processor_type", "feature_extractor_type"] {
            if let Some(found) = get(key) {
                let name = found.as_str().unwrap_or_default();
                if !["CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPFeatureExtractor"].contains(&name) {
                    return Err(config_error(key, Some(found), "\"CLIPImageProcessor\""));
                }
            }
        }
        if let Some(found) = get("do_pad") {
            if found != &Value::Bool(false) && !found.is_null() {
                return Err(config_error("do_pad", Some(found), "false or absent (no padding)"));
            }
        }
        let flag = |key: &'static str, default: bool| match get(key) {
            None => Ok(default),
            Some(value) => value.as_bool().ok_or_else(|| config_error(key, Some(value), "true or false")),
        };
        let default_to_square = flag("default_to_square", false)?;
        let size = match get("size") {
            None => defaults.size,
            Some(value) => size_dict(value, "size", default_to_square)?,
        };
        let (crop_height, crop_width) = match get("crop_size") {
            None => (defaults.crop_height, defaults.crop_width),
            Some(value) => match size_dict(value, "crop_size", true)? {
                ResizeTo::Exact { height, width } => (height, width),
                ResizeTo::ShortestEdge(_) => {
                    return Err(config_error("crop_size", Some(value), "{\"height\": h, \"width\": w} or an integer"))
                }
            },
        };
        let resample = match get("resample") {
            None => defaults.resample,
            Some(value) => value.as_u64().ok_or_else(|| config_error("resample", Some(value), "3 (bicubic)"))?,
        };
        let rescale_factor = match get("rescale_factor") {
            None => defaults.rescale_factor,
            Some(value) => value.as_f64().ok_or_else(|| config_error("rescale_factor", Some(value), "a number"))?,
        };
        let config = ClipImageConfig {
            do_convert_rgb: flag("do_convert_rgb", defaults.do_convert_rgb)?,
            do_resize: flag("do_resize", defaults.do_resize)?,
            size,
            resample,
            do_center_crop: flag("do_center_crop", defaults.do_center_crop)?,
            crop_height,
            crop_width,
            do_rescale: flag("do_rescale", defaults.do_rescale)?,
            rescale_factor,
            do_normalize: flag("do_normalize", defaults.do_normalize)?,
            image_mean: channels(get("image_mean"), "image_mean", defaults.image_mean)?,
            image_std: channels(get("image_std"), "image_std", defaults.image_std)?,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks what [`preprocess`] needs: the bicubic filter, sides of at least one pixel, a crop
    /// of at most [`MAX_PIXELS`], finite numbers, and a float output.
    pub fn validate(&self) -> Result<(), ClipImageError> {
        let invalid = |key, found, expected| ClipImageError::Config { key, found, expected };
        if self.resample != PIL_BICUBIC {
            return Err(invalid(
                "resample",
                self.resample.to_string(),
                "3 (PIL's bicubic filter, the only one this port computes)",
            ));
        }
        match self.size {
            ResizeTo::ShortestEdge(0) | ResizeTo::Exact { height: 0, .. } | ResizeTo::Exact { width: 0, .. } => {
                return Err(invalid("size", format!("{:?}", self.size), "sides of at least one pixel"));
            }
            ResizeTo::Exact { height, width } if u64::from(height) * u64::from(width) > MAX_PIXELS => {
                return Err(invalid("size", format!("{:?}", self.size), "at most MAX_PIXELS (2^27) pixels"));
            }
            _ => {}
        }
        if self.crop_height == 0 || self.crop_width == 0 {
            return Err(invalid(
                "crop_size",
                format!("{}x{}", self.crop_height, self.crop_width),
                "sides of at least one pixel",
            ));
        }
        if u64::from(self.crop_height) * u64::from(self.crop_width) > MAX_PIXELS {
            return Err(invalid(
                "crop_size",
                format!("{}x{}", self.crop_height, self.crop_width),
                "at most MAX_PIXELS (2^27) pixels",
            ));
        }
        if !self.rescale_factor.is_finite() {
            return Err(invalid("rescale_factor", self.rescale_factor.to_string(), "a finite number"));
        }
        for (key, values) in [("image_mean", &self.image_mean), ("image_std", &self.image_std)] {
            if values.iter().any(|v| !(*v as f32).is_finite()) {
                return Err(invalid(key, format!("{values:?}"), "finite float32 numbers"));
            }
        }
        if !self.do_rescale && !self.do_normalize {
            return Err(invalid(
                "do_rescale",
                "false with do_normalize false".to_string(),
                "one of do_rescale and do_normalize true: transformers returns uint8 pixels otherwise, this port float32",
            ));
        }
        Ok(())
    }
}

impl serde::Serialize for ClipImageConfig {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for ClipImageConfig {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let document = Value::deserialize(deserializer)?;
        ClipImageConfig::from_value(&document).map_err(serde::de::Error::custom)
    }
}

/// A JSON value as an error shows it.
fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "nothing".to_string(), Value::to_string)
}

fn config_error(key: &'static str, found: Option<&Value>, expected: &'static str) -> ClipImageError {
    ClipImageError::Config { key, found: shown(found), expected }
}

/// A side of a size dictionary: a positive integer that fits `u32`.
fn side(value: Option<&Value>, key: &'static str) -> Result<u32, ClipImageError> {
    value
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
        .filter(|v| *v > 0)
        .ok_or_else(|| config_error(key, value, "a positive integer"))
}

/// transformers' `get_size_dict` for the forms this port computes.
fn size_dict(value: &Value, key: &'static str, default_to_square: bool) -> Result<ResizeTo, ClipImageError> {
    const EXPECTED: &str = "{\"shortest_edge\": n}, {\"height\": h, \"width\": w}, an integer or [h, w]";
    match value {
        Value::Number(_) => {
            let n = side(Some(value), key)?;
            Ok(if default_to_square { ResizeTo::Exact { height: n, width: n } } else { ResizeTo::ShortestEdge(n) })
        }
        Value::Array(items) if items.len() == 2 => {
            Ok(ResizeTo::Exact { height: side(items.first(), key)?, width: side(items.get(1), key)? })
        }
        Value::Object(map) => {
            let present = |k: &str| map.get(k).is_some_and(|v| !v.is_null());
            if ["longest_edge", "max_height", "max_width"].iter().any(|k| present(k)) {
                return Err(config_error(key, Some(value), EXPECTED));
            }
            if present("shortest_edge") {
                Ok(ResizeTo::ShortestEdge(side(map.get("shortest_edge"), key)?))
            } else if present("height") && present("width") {
                Ok(ResizeTo::Exact { height: side(map.get("height"), key)?, width: side(map.get("width"), key)? })
            } else {
                Err(config_error(key, Some(value), EXPECTED))
            }
        }
        _ => Err(config_error(key, Some(value), EXPECTED)),
    }
}

/// `image_mean` / `image_std`: three numbers, or one for every channel.
fn channels(value: Option<&Value>, key: &'static str, default: [f64; 3]) -> Result<[f64; 3], ClipImageError> {
    const EXPECTED: &str = "three numbers (one per RGB channel) or one number";
    match value {
        None => Ok(default),
        Some(Value::Number(n)) => n.as_f64().map(|v| [v; 3]).ok_or_else(|| config_error(key, value, EXPECTED)),
        Some(Value::Array(items)) if items.len() == 3 => {
            let mut out = [0.0; 3];
            for (slot, item) in out.iter_mut().zip(items) {
                *slot = item.as_f64().ok_or_else(|| config_error(key, value, EXPECTED))?;
            }
            Ok(out)
        }
        Some(_) => Err(config_error(key, value, EXPECTED)),
    }
}

/// Why an image could not be read or preprocessed, or a configuration not used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ClipImageError {
    /// The image file cannot be opened or read.
    #[error("cannot read the image file {}: {error}; pass a PNG or JPEG file", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's message.
        error: String,
    },
    /// The file is not an image this port decodes.
    #[error(
        "{} is not an image this port reads ({error}); pass a PNG file (bit for bit with transformers) or a JPEG file (decoded close to, not equal to, PIL's)",
        path.display()
    )]
    Decode {
        /// The file.
        path: PathBuf,
        /// The decoder's message.
        error: String,
    },
    /// A PNG whose pixels PIL and this port would read differently.
    #[error("{}: {what}; convert it to 8 bits per sample first", path.display())]
    UnsupportedPng {
        /// The file.
        path: PathBuf,
        /// What it holds.
        what: &'static str,
    },
    /// The image's pixel format is none a PNG decodes to.
    #[error(
        "the image's pixel format {format} is not one PIL opens a PNG as (8- or 16-bit grey, grey + alpha, RGB, RGBA){why}; convert it to 8-bit RGB or RGBA first"
    )]
    UnsupportedFormat {
        /// The format, as the `image` crate names it.
        format: String,
        /// What else is wrong (for `do_convert_rgb = false`).
        why: &'static str,
    },
    /// The image has a side of zero pixels.
    #[error("the image is {width}x{height} pixels: a side of zero cannot be resized; pass an image of at least 1x1")]
    EmptyImage {
        /// Width in pixels.
        width: u32,
        /// Height in pixels.
        height: u32,
    },
    /// An image this port would build is too large.
    #[error(
        "resizing a {width}x{height} image to {what} would make {pixels} pixels, more than MAX_PIXELS = {}; pass an image of a less extreme aspect ratio",
        MAX_PIXELS
    )]
    TooLarge {
        /// What the size is of.
        what: &'static str,
        /// The input's width.
        width: u32,
        /// The input's height.
        height: u32,
        /// The pixels it would make (saturated at `u64::MAX`).
        pixels: u64,
    },
    /// A configuration value this port does not compute.
    #[error("image processor configuration: {key} is {found}, but this CLIP image port supports only {expected}")]
    Config {
        /// The key.
        key: &'static str,
        /// What the configuration holds there.
        found: String,
        /// What the port supports.
        expected: &'static str,
    },
    /// The configuration is not JSON.
    #[error("the image processor configuration is not valid JSON: {error}")]
    Json {
        /// The parser's message.
        error: String,
    },
    /// The configuration file cannot be read.
    #[error(
        "cannot read the image processor configuration {}: {error}; write it with transformers' CLIPImageProcessor.to_json_file",
        path.display()
    )]
    ConfigRead {
        /// The file.
        path: PathBuf,
        /// The system's message.
        error: String,
    },
    /// libtorch refused to build the output tensor.
    #[error("libtorch: {error}")]
    Torch {
        /// libtorch's message.
        error: String,
    },
}

impl From<tch::TchError> for ClipImageError {
    fn from(error: tch::TchError) -> Self {
        ClipImageError::Torch { error: error.to_string() }
    }
}

/// Reads an image file as PIL's `Image.open` holds it: a PNG of any colour type and bit depth
/// (palette and `tRNS` transparency expanded to RGB or RGBA, grey below 8 bits scaled to 0..=255),
/// or a JPEG (not bit-equal to PIL's decoder). The `image` crate's default memory limit (512 MiB)
/// bounds the decode. An error names the file and says which formats work.
pub fn load_image(path: &Path) -> Result<DynamicImage, ClipImageError> {
    let read_error = |e: std::io::Error| ClipImageError::Read { path: path.to_path_buf(), error: e.to_string() };
    let decode_error = |e: image::ImageError| ClipImageError::Decode { path: path.to_path_buf(), error: e.to_string() };
    let reader = image::io::Reader::open(path).map_err(read_error)?.with_guessed_format().map_err(read_error)?;
    let key = match reader.format() {
        Some(image::ImageFormat::Png) => match png_colour_key(path).map_err(read_error)? {
            ColourKey::Unsupported(what) => {
                return Err(ClipImageError::UnsupportedPng { path: path.to_path_buf(), what });
            }
            other => other,
        },
        Some(image::ImageFormat::Jpeg) => ColourKey::None,
        other => {
            let error = match other {
                Some(format) => format!("a {format:?} file"),
                None => "not a format recognised from its first bytes".to_string(),
            };
            return Err(ClipImageError::Decode { path: path.to_path_buf(), error });
        }
    };
    let mut image = reader.decode().map_err(decode_error)?;
    if key == ColourKey::IgnoredByPil {
        // The decoder made the key's pixels transparent; PIL makes none transparent.
        if let DynamicImage::ImageLumaA8(buffer) = &mut image {
            for pixel in buffer.pixels_mut() {
                pixel.0[1] = u8::MAX;
            }
        }
    }
    Ok(image)
}

/// What a PNG's `tRNS` colour key (on a grey or RGB image) means to PIL against the `image` crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ColourKey {
    /// No key, or one both read alike.
    None,
    /// A key on 2- or 4-bit grey that is not 0: PIL compares it to the samples scaled to 8 bits
    /// (0, 17, 34, ... or 0, 85, 170, 255), which never match it, so no pixel is transparent;
    /// the `image` crate compares it to the unscaled samples.
    IgnoredByPil,
    /// A key the two read differently in ways this port does not follow.
    Unsupported(&'static str),
}

/// Walks a PNG's chunks up to its image data and classifies its `tRNS` colour key. A malformed
/// file is left to the decoder.
fn png_colour_key(path: &Path) -> std::io::Result<ColourKey> {
    let mut file = BufReader::new(File::open(path)?);
    let mut signature = [0u8; 8];
    if file.read_exact(&mut signature).is_err() {
        return Ok(ColourKey::None);
    }
    let (mut bit_depth, mut colour_type) = (0u8, 0u8);
    loop {
        let mut header = [0u8; 8];
        if file.read_exact(&mut header).is_err() {
            return Ok(ColourKey::None);
        }
        let length = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
        match &header[4..8] {
            b"IHDR" => {
                let mut ihdr = [0u8; 13];
                if length != 13 || file.read_exact(&mut ihdr).is_err() {
                    return Ok(ColourKey::None);
                }
                (bit_depth, colour_type) = (ihdr[8], ihdr[9]);
                file.seek(SeekFrom::Current(4))?; // the CRC
            }
            // A key: one 16-bit sample for grey (type 0), three for RGB (type 2).
            b"tRNS" if colour_type == 0 || colour_type == 2 => {
                let mut key = [0u8; 6];
                let samples = if colour_type == 0 { 1 } else { 3 };
                if usize::try_from(length).ok() != Some(2 * samples)
                    || file.read_exact(&mut key[..2 * samples]).is_err()
                {
                    return Ok(ColourKey::None); // the decoders' own business
                }
                let key: Vec<u32> =
                    key[..2 * samples].chunks_exact(2).map(|b| u32::from(u16::from_be_bytes([b[0], b[1]]))).collect();
                if bit_depth == 16 {
                    return Ok(ColourKey::Unsupported(
                        "a 16-bit PNG with a tRNS colour key (PIL compares the key to 8-bit samples, the Rust decoder to 16-bit ones)",
                    ));
                }
                if key.iter().any(|k| *k >= 1u32.checked_shl(u32::from(bit_depth)).unwrap_or(u32::MAX)) {
                    return Ok(ColourKey::Unsupported("a tRNS colour key outside the range of its bit depth"));
                }
                return Ok(if matches!(bit_depth, 2 | 4) && key[0] != 0 {
                    ColourKey::IgnoredByPil
                } else {
                    ColourKey::None
                });
            }
            b"IDAT" | b"IEND" => return Ok(ColourKey::None),
            _ => {
                file.seek(SeekFrom::Current(i64::from(length) + 4))?;
            }
        }
    }
}

/// An 8-bit RGB image, row after row, three bytes a pixel (PIL's `RGB` mode as numpy holds it).
struct Rgb {
    width: usize,
    height: usize,
    data: Vec<u8>,
}

/// Preprocesses `image` as transformers' `CLIPImageProcessor` (the PIL backend) does with
/// `config`, and returns the pipeline's `pixel_values[0].unsqueeze(0)`: float32
/// `[1, 3, crop_height, crop_width]` on the CPU (`[1, 3, h, w]` of the resized image without
/// the crop). See the module documentation for each step.
pub fn preprocess(image: &DynamicImage, config: &ClipImageConfig) -> Result<Tensor, ClipImageError> {
    config.validate()?;
    if image.width() == 0 || image.height() == 0 {
        return Err(ClipImageError::EmptyImage { width: image.width(), height: image.height() });
    }
    let rgb = to_rgb(image, config.do_convert_rgb)?;
    let rgb = if config.do_resize {
        let (height, width) = resized_size(image.width(), image.height(), config.size)?;
        resize_bicubic(&rgb, width, height)
    } else {
        rgb
    };
    let (out_h, out_w) = if config.do_center_crop {
        (to_usize(config.crop_height), to_usize(config.crop_width))
    } else {
        (rgb.height, rgb.width)
    };
    // Offsets of the crop in the image: negative where transformers pads with zeros.
    let (top, left) =
        if config.do_center_crop { (crop_offset(rgb.height, out_h), crop_offset(rgb.width, out_w)) } else { (0, 0) };
    let scale = config.rescale_factor;
    let mean = config.image_mean.map(|v| v as f32);
    let std = config.image_std.map(|v| v as f32);
    let plane = out_h * out_w;
    let mut values = vec![0f32; plane * 3];
    for y in 0..out_h {
        let source_y = checked_index(y, top, rgb.height);
        for x in 0..out_w {
            let source_x = checked_index(x, left, rgb.width);
            for c in 0..3 {
                let pixel = match (source_y, source_x) {
                    (Some(sy), Some(sx)) => rgb.data[(sy * rgb.width + sx) * 3 + c],
                    _ => 0,
                };
                let mut value = if config.do_rescale { (f64::from(pixel) * scale) as f32 } else { f32::from(pixel) };
                if config.do_normalize {
                    value = (value - mean[c]) / std[c];
                }
                values[c * plane + y * out_w + x] = value;
            }
        }
    }
    let shape = [1, 3, to_i64(out_h), to_i64(out_w)];
    Ok(Tensor::f_from_slice(&values)?.f_reshape(shape)?)
}

fn to_usize(value: u32) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

fn to_i64(value: usize) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// numpy's center-crop start, `(size - crop) // 2` (floor division: negative where it pads).
fn crop_offset(size: usize, crop: usize) -> i64 {
    (to_i64(size) - to_i64(crop)).div_euclid(2)
}

/// `index + offset` when it falls inside `0..size`.
fn checked_index(index: usize, offset: i64, size: usize) -> Option<usize> {
    let at = to_i64(index).checked_add(offset)?;
    usize::try_from(at).ok().filter(|at| *at < size)
}

/// transformers' `get_resize_output_image_size` with `default_to_square = False`: (height,
/// width).
fn resized_size(width: u32, height: u32, size: ResizeTo) -> Result<(usize, usize), ClipImageError> {
    let (out_h, out_w) = match size {
        ResizeTo::Exact { height, width } => (u64::from(height), u64::from(width)),
        ResizeTo::ShortestEdge(edge) => {
            let (short, long) = if width <= height { (width, height) } else { (height, width) };
            let product = u64::from(edge) * u64::from(long);
            // Python divides the integers exactly rounded; a product below 2^53 is exact in float64,
            // so the float64 division is the same. Above, the image would be far too large anyway.
            let new_long = if product < (1 << 53) { (product as f64 / f64::from(short)) as u64 } else { u64::MAX };
            if width <= height {
                (new_long, u64::from(edge))
            } else {
                (u64::from(edge), new_long)
            }
        }
    };
    let pixels = out_h.saturating_mul(out_w);
    if pixels > MAX_PIXELS || out_h == 0 || out_w == 0 {
        return Err(ClipImageError::TooLarge { what: "the resize size", width, height, pixels });
    }
    // Both are at most MAX_PIXELS, which fits usize.
    Ok((usize::try_from(out_h).unwrap_or(usize::MAX), usize::try_from(out_w).unwrap_or(usize::MAX)))
}

/// PIL's `alpha_composite` of `(r, g, b, a)` over opaque white, then the alpha dropped
/// (`AlphaComposite.c`, 7 extra bits of precision, divisions by 255 by shifts).
fn over_white(rgb: [u8; 3], alpha: u8) -> [u8; 3] {
    if alpha == 0 {
        return [255; 3];
    }
    // With the background's alpha 255 every term stays below 2^32: src_a * 255 * 255 * 128 is at
    // most 2_122_416_000.
    let a = u32::from(alpha);
    let blend = 255 * (255 - a);
    let out_a255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << 7) / out_a255;
    let coef2 = 255 * (1 << 7) - coef1;
    rgb.map(|channel| {
        let tmp = u32::from(channel) * coef1 + 255 * coef2 + (0x80 << 7);
        let div255 = ((tmp >> 8) + tmp) >> 8;
        // At most 255 by construction; saturate rather than wrap.
        u8::try_from(div255 >> 7).unwrap_or(u8::MAX)
    })
}

/// PIL's conversion to 8-bit RGB of the image as PIL holds it (see the module documentation),
/// compositing alpha onto white as transformers' `convert_to_rgb` does. Without `convert`, only an
/// image PIL holds as `RGB` is accepted (transformers would fail on the others: its mean and std
/// have three channels).
fn to_rgb(image: &DynamicImage, convert: bool) -> Result<Rgb, ClipImageError> {
    let width = to_usize(image.width());
    let height = to_usize(image.height());
    let format = || format!("{:?}", image.color());
    let high = |v: u16| v.to_be_bytes()[0];
    let data: Vec<u8> = match image {
        DynamicImage::ImageRgb8(buffer) => buffer.as_raw().clone(),
        DynamicImage::ImageRgb16(buffer) => buffer.as_raw().iter().map(|v| high(*v)).collect(),
        _ if !convert => {
            return Err(ClipImageError::UnsupportedFormat {
                format: format(),
                why: " with do_convert_rgb = false, where only an RGB image works",
            })
        }
        DynamicImage::ImageLuma8(buffer) => buffer.as_raw().iter().flat_map(|v| [*v; 3]).collect(),
        // PIL's I;16 -> RGB conversion clips each sample to 255.
        DynamicImage::ImageLuma16(buffer) => {
            buffer.as_raw().iter().flat_map(|v| [u8::try_from(*v).unwrap_or(u8::MAX); 3]).collect()
        }
        DynamicImage::ImageLumaA8(buffer) => {
            buffer.as_raw().chunks_exact(2).flat_map(|p| over_white([p[0]; 3], p[1])).collect()
        }
        DynamicImage::ImageLumaA16(buffer) => {
            buffer.as_raw().chunks_exact(2).flat_map(|p| over_white([high(p[0]); 3], high(p[1]))).collect()
        }
        DynamicImage::ImageRgba8(buffer) => {
            buffer.as_raw().chunks_exact(4).flat_map(|p| over_white([p[0], p[1], p[2]], p[3])).collect()
        }
        DynamicImage::ImageRgba16(buffer) => buffer
            .as_raw()
            .chunks_exact(4)
            .flat_map(|p| over_white([high(p[0]), high(p[1]), high(p[2])], high(p[3])))
            .collect(),
        _ => return Err(ClipImageError::UnsupportedFormat { format: format(), why: "" }),
    };
    Ok(Rgb { width, height, data })
}

/// PIL's bicubic filter (`bicubic_filter` in `Resample.c`, a = -0.5), the same float64 operations
/// in the same order.
fn bicubic(x: f64) -> f64 {
    let x = if x < 0.0 { -x } else { x };
    if x < 1.0 {
        ((BICUBIC_A + 2.0) * x - (BICUBIC_A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * BICUBIC_A
    } else {
        0.0
    }
}

/// The fixed-point filter of one output pixel: its first input pixel and one weight per input
/// pixel from there.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// PIL's `precompute_coeffs` and `normalize_coeffs_8bpc` for resampling `in_size` pixels to
/// `out_size` over the whole input (the box `0..in_size`).
fn coefficients(in_size: usize, out_size: usize) -> Vec<Taps> {
    // The box's ends are C floats; their difference is taken in float and widened.
    let in0 = 0f32;
    let in1 = in_size as f32;
    let scale = f64::from(in1 - in0) / out_size as f64;
    let filterscale = if scale < 1.0 { 1.0 } else { scale };
    let support = BICUBIC_SUPPORT * filterscale;
    let inv_filterscale = 1.0 / filterscale;
    let in_size_i = to_i64(in_size);
    let one = f64::from(1u32 << PRECISION_BITS);
    (0..out_size)
        .map(|xx| {
            let center = f64::from(in0) + (xx as f64 + 0.5) * scale;
            // C's (int) truncates toward zero, as `as` does.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size_i);
            let count = usize::try_from(xmax - xmin).unwrap_or(0);
            let mut weights: Vec<f64> =
                (0..count).map(|x| bicubic(((to_i64(x) + xmin) as f64 - center + 0.5) * inv_filterscale)).collect();
            let total: f64 = weights.iter().fold(0.0, |sum, w| sum + w);
            if total != 0.0 {
                for w in &mut weights {
                    *w /= total;
                }
            }
            let fixed = weights
                .iter()
                .map(|w| if *w < 0.0 { (-0.5 + w * one) as i32 } else { (0.5 + w * one) as i32 })
                .collect();
            Taps { first: usize::try_from(xmin).unwrap_or(0), weights: fixed }
        })
        .collect()
}

/// PIL's `clip8`: the accumulated fixed-point sum shifted back to 8 bits and clipped.
fn clip8(sum: i64) -> u8 {
    u8::try_from((sum >> PRECISION_BITS).clamp(0, 255)).unwrap_or(u8::MAX)
}

/// The accumulator's starting value: one half in fixed point.
const HALF: i64 = 1 << (PRECISION_BITS - 1);

/// PIL's `ImagingResample` of an RGB image with the bicubic filter to `width` x `height`, in two
/// passes through an 8-bit image. A pass whose side does not change is skipped. When both run,
/// Pillow 13 picks their order: vertical first when the height shrinks by more than twice as many
/// pixels as the width does (`in_h - out_h > 2 * (in_w - out_w)`), horizontal first otherwise, the
/// horizontal pass then covering only the input rows the vertical pass reads. The caller checked
/// the output size against [`MAX_PIXELS`]; an intermediate image has the output's width and the
/// input's height at most, or the input's width and the output's height.
fn resize_bicubic(input: &Rgb, width: usize, height: usize) -> Rgb {
    let need_horizontal = width != input.width;
    let need_vertical = height != input.height;
    let vertical = coefficients(input.height, height);
    let height_shrink = to_i64(input.height) - to_i64(height);
    let width_shrink = to_i64(input.width) - to_i64(width);
    if need_horizontal && need_vertical && height_shrink > 0 && height_shrink > width_shrink.saturating_mul(2) {
        let temp = vertical_pass(input, &vertical, 0);
        return horizontal_pass(&temp, &coefficients(input.width, width), 0, height);
    }
    match (need_horizontal, need_vertical) {
        (false, false) => Rgb { width: input.width, height: input.height, data: input.data.clone() },
        (false, true) => vertical_pass(input, &vertical, 0),
        (true, _) => {
            // Only the rows the vertical pass reads (all of them when the height stays).
            let first_row = vertical.first().map_or(0, |t| t.first);
            let last_row = vertical.last().map_or(0, |t| t.first + t.weights.len());
            let rows = last_row.saturating_sub(first_row);
            let temp = horizontal_pass(input, &coefficients(input.width, width), first_row, rows);
            if need_vertical {
                vertical_pass(&temp, &vertical, first_row)
            } else {
                temp
            }
        }
    }
}

/// PIL's `_ImagingResampleHorizontal_8bpc` over `rows` rows of `input` from `first_row`.
fn horizontal_pass(input: &Rgb, taps: &[Taps], first_row: usize, rows: usize) -> Rgb {
    let width = taps.len();
    let mut data = vec![0u8; width * rows * 3];
    for (row, out_row) in data.chunks_exact_mut(width * 3).enumerate() {
        let start = (first_row + row) * input.width * 3;
        let line = &input.data[start..start + input.width * 3];
        for (tap, out) in taps.iter().zip(out_row.chunks_exact_mut(3)) {
            let mut sums = [HALF; 3];
            for (x, weight) in tap.weights.iter().enumerate() {
                let pixel = &line[(tap.first + x) * 3..][..3];
                for (sum, value) in sums.iter_mut().zip(pixel) {
                    *sum += i64::from(*value) * i64::from(*weight);
                }
            }
            for (slot, sum) in out.iter_mut().zip(sums) {
                *slot = clip8(sum);
            }
        }
    }
    Rgb { width, height: rows, data }
}

/// PIL's `_ImagingResampleVertical_8bpc`; `input` starts at row `offset` of the image the taps
/// index.
fn vertical_pass(input: &Rgb, taps: &[Taps], offset: usize) -> Rgb {
    let row_len = input.width * 3;
    let mut data = vec![0u8; row_len * taps.len()];
    for (tap, out_row) in taps.iter().zip(data.chunks_exact_mut(row_len)) {
        for (i, out) in out_row.iter_mut().enumerate() {
            let mut sum = HALF;
            for (y, weight) in tap.weights.iter().enumerate() {
                let row = tap.first + y - offset;
                sum += i64::from(input.data[row * row_len + i]) * i64::from(*weight);
            }
            *out = clip8(sum);
        }
    }
    Rgb { width: input.width, height: taps.len(), data }
}
