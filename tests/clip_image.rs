//! The Rust CLIP image preprocessing (`crates/pipelines/src/clip_image.rs`) against transformers'
//! `CLIPImageProcessor` as `ShapEImg2ImgPipeline` calls it, run by the cached Python environment
//! (`scripts/reference/clip_image_reference.py`): the pixel values of every test image equal bit
//! for bit, under the published openai/shap-e-img2img configuration and under one whose crop is
//! taller than the resized image (transformers pads). The test writes its PNG files itself (a
//! small encoder below, stored deflate blocks) so that every PNG colour type and bit depth PIL
//! opens is covered: RGB, RGBA, grey, grey + alpha at 8 and 16 bits, 1-, 2- and 4-bit grey,
//! palettes with and without a `tRNS` alpha table, `tRNS` colour keys. Sizes: square, landscape,
//! portrait, exactly 224x224, upscaled (50x30, 1x1), odd, extreme (600x7), tall enough for
//! Pillow 13 to resize vertically first (273x877), and a dozen seeded random sizes; content with
//! sharp edges, noise and gradients from a seeded generator. All the comparisons share one Python
//! run. Without STAGELOAD_PYTHON (or without transformers in it) those tests fail and say what to
//! run; the error tests need no Python.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stageload_pipelines::clip_image::{load_image, preprocess, ClipImageConfig, ClipImageError, ResizeTo};
use tch::{Kind, Tensor};

const SEED: u64 = 224;
const DEADLINE: Duration = Duration::from_secs(120);
/// The configurations the reference writes, by the name of its JSON file and its outputs.
const CONFIGS: [&str; 2] = ["shap_e", "padded"];

/// What a test image holds: its PNG colour type and bit depth, and extra chunks.
#[derive(Debug, Clone, Copy)]
enum PngKind {
    Rgb,
    Rgba,
    Grey,
    GreyAlpha,
    Rgb16,
    Rgba16,
    Grey16,
    GreyAlpha16,
    /// 8-bit palette of 256 colours with a `tRNS` table of 200 alpha values.
    PaletteAlpha,
    /// 4-bit palette of 16 colours, no transparency.
    Palette4,
    /// 2-bit palette whose `tRNS` makes one entry fully transparent (PIL's "simple" case).
    Palette2Key,
    /// 1-bit grey.
    Grey1,
    /// 4-bit grey with a `tRNS` colour key of 5 (which PIL compares to the scaled samples).
    Grey4Key,
    /// 2-bit grey with a `tRNS` colour key of 0.
    Grey2Key0,
    /// 8-bit RGB with a `tRNS` colour key.
    RgbKey,
}

/// Random sizes (seeded) of RGB, RGBA and grey images added to [`IMAGES`]: each side in 1..=900.
const RANDOM_IMAGES: usize = 12;

/// The test images: name, width, height, content.
const IMAGES: [(&str, u32, u32, PngKind); 26] = [
    ("rgb_256x256", 256, 256, PngKind::Rgb),
    ("rgb_640x480_landscape", 640, 480, PngKind::Rgb),
    ("rgb_300x500_portrait", 300, 500, PngKind::Rgb),
    ("rgb_224x224_exact", 224, 224, PngKind::Rgb),
    ("rgb_50x30_upscaled", 50, 30, PngKind::Rgb),
    ("rgb_225x401_odd", 225, 401, PngKind::Rgb),
    // Tall enough that Pillow 13 runs the vertical pass first.
    ("rgb_273x877_tall", 273, 877, PngKind::Rgb),
    ("rgba_150x520_tall", 150, 520, PngKind::Rgba),
    ("rgb_1x1", 1, 1, PngKind::Rgb),
    ("rgb_3x2", 3, 2, PngKind::Rgb),
    ("rgb_600x7_extreme", 600, 7, PngKind::Rgb),
    ("rgba_320x240", 320, 240, PngKind::Rgba),
    ("rgba_97x181_upscaled", 97, 181, PngKind::Rgba),
    ("grey_333x257", 333, 257, PngKind::Grey),
    ("grey_alpha_200x300", 200, 300, PngKind::GreyAlpha),
    ("rgb16_260x230", 260, 230, PngKind::Rgb16),
    ("rgba16_230x260", 230, 260, PngKind::Rgba16),
    ("grey16_240x240", 240, 240, PngKind::Grey16),
    ("grey_alpha16_231x229", 231, 229, PngKind::GreyAlpha16),
    ("palette8_alpha_250x260", 250, 260, PngKind::PaletteAlpha),
    ("palette4_227x300", 227, 300, PngKind::Palette4),
    ("palette2_key_150x160", 150, 160, PngKind::Palette2Key),
    ("grey1_230x227", 230, 227, PngKind::Grey1),
    ("grey4_key_229x231", 229, 231, PngKind::Grey4Key),
    ("grey2_key0_201x199", 201, 199, PngKind::Grey2Key0),
    ("rgb_key_240x250", 240, 250, PngKind::RgbKey),
];

/// [`IMAGES`] and [`RANDOM_IMAGES`] more of random sizes.
fn test_images() -> Vec<(String, u32, u32, PngKind)> {
    let mut rng = ChaCha8Rng::seed_from_u64(SEED + 1);
    let mut images: Vec<_> = IMAGES.iter().map(|(name, w, h, kind)| (name.to_string(), *w, *h, *kind)).collect();
    for i in 0..RANDOM_IMAGES {
        let (width, height) = (rng.gen_range(1..=900), rng.gen_range(1..=900));
        let kind = [PngKind::Rgb, PngKind::Rgba, PngKind::Grey][i % 3];
        images.push((format!("random{i}_{kind:?}_{width}x{height}"), width, height, kind));
    }
    images
}

/// What the reference wrote, with the images it read.
struct Reference {
    outputs: HashMap<String, Tensor>,
    folder: tempfile::TempDir,
    images: Vec<PathBuf>,
}

/// Writes the test images, runs the reference on them within the deadline and reads what it wrote.
fn run_reference() -> Result<Reference, String> {
    let folder = tempfile::TempDir::new().map_err(|e| format!("no temporary folder: {e}"))?;
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let mut images = Vec::new();
    for (name, width, height, kind) in test_images() {
        let path = folder.path().join(format!("{name}.png"));
        std::fs::write(&path, test_png(width, height, kind, &mut rng))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        images.push(path);
    }
    let output = folder.path().join("reference.safetensors");
    let mut args = vec![output.as_os_str(), folder.path().as_os_str()];
    args.extend(images.iter().map(|path| path.as_os_str()));
    let outputs = crate::reference::run("clip_image_reference.py", &args, folder.path(), &output, DEADLINE)?;
    Ok(Reference { outputs, folder, images })
}

/// Runs `check` on the reference, failing with the reference's error if there is none. The
/// reference runs once for all the tests that need it.
fn with_reference(check: impl FnOnce(&Reference)) {
    static REFERENCE: Mutex<Option<Result<Reference, String>>> = Mutex::new(None);
    let mut slot = REFERENCE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match slot.get_or_insert_with(run_reference) {
        Ok(reference) => check(reference),
        Err(error) => panic!("{error}"),
    }
}

/// The number of values whose bits differ and the largest absolute difference, or why the two
/// cannot be compared.
fn difference(rust: &Tensor, python: &Tensor) -> Result<(i64, f64), String> {
    if (rust.kind(), rust.size()) != (python.kind(), python.size()) {
        return Err(format!(
            "Rust gives {:?} {:?}, transformers {:?} {:?}",
            rust.kind(),
            rust.size(),
            python.kind(),
            python.size()
        ));
    }
    let differing = rust.view_dtype(Kind::Int).ne_tensor(&python.view_dtype(Kind::Int)).sum(Kind::Int64);
    let largest = (rust.to_kind(Kind::Double) - python.to_kind(Kind::Double)).abs().max();
    Ok((differing.int64_value(&[]), largest.double_value(&[])))
}

#[test]
fn the_rust_preprocessing_equals_transformers_bit_for_bit_on_every_test_png() {
    with_reference(|reference| {
        let mut failures = Vec::new();
        for config_name in CONFIGS {
            let config_path = reference.folder.path().join(format!("{config_name}.json"));
            let config = ClipImageConfig::from_json_file(&config_path).unwrap_or_else(|e| panic!("{e}"));
            for (i, ((name, ..), path)) in test_images().iter().zip(&reference.images).enumerate() {
                let key = format!("{i}.{config_name}");
                let python = reference.outputs.get(&key).unwrap_or_else(|| panic!("the reference wrote no {key}"));
                let image = load_image(path).unwrap_or_else(|e| panic!("{e}"));
                let rust = preprocess(&image, &config).unwrap_or_else(|e| panic!("{name}: {e}"));
                match difference(&rust, python) {
                    Ok((differing, largest)) => {
                        eprintln!(
                            "{config_name:>6} {name:<30} {:?}: {differing} values differ, max |diff| = {largest:e}",
                            rust.size()
                        );
                        if differing != 0 {
                            failures.push(format!(
                                "{config_name} {name}: {differing} of {} values differ, the largest by {largest:e}",
                                rust.numel()
                            ));
                        }
                    }
                    Err(error) => failures.push(format!("{config_name} {name}: {error}")),
                }
            }
        }
        assert!(failures.is_empty(), "Rust against transformers:\n{}", failures.join("\n"));
    });
}

#[test]
fn the_reference_builds_the_pil_backend_class_this_port_matches() {
    with_reference(|reference| {
        let path = reference.folder.path().join("class.txt");
        let class = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            class.trim().ends_with(".CLIPImageProcessorPil"),
            "`from transformers import CLIPImageProcessor` gave {} (torchvision installed?); this port matches the PIL backend, CLIPImageProcessorPil",
            class.trim()
        );
    });
}

#[test]
fn transformers_own_json_reads_back_as_the_configurations_it_was_built_from() {
    with_reference(|reference| {
        let read = |name: &str| {
            ClipImageConfig::from_json_file(&reference.folder.path().join(format!("{name}.json")))
                .unwrap_or_else(|e| panic!("{e}"))
        };
        assert_eq!(read("shap_e"), ClipImageConfig::shap_e_img2img());
        let padded = ClipImageConfig {
            size: ResizeTo::ShortestEdge(200),
            crop_height: 256,
            crop_width: 240,
            ..ClipImageConfig::shap_e_img2img()
        };
        assert_eq!(read("padded"), padded);
        // What Rust writes reads back the same.
        assert_eq!(ClipImageConfig::from_json(&padded.to_json()).unwrap_or_else(|e| panic!("{e}")), padded);
    });
}

#[test]
fn the_published_json_with_integer_sizes_reads_as_a_shortest_edge_and_a_square_crop() {
    let published = r#"{"crop_size": 224, "do_center_crop": true, "do_normalize": true, "do_resize": true,
        "feature_extractor_type": "CLIPFeatureExtractor",
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3, "size": 224}"#;
    let config = ClipImageConfig::from_json(published).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config, ClipImageConfig::shap_e_img2img());
    assert_eq!(config.rescale_factor.to_bits(), (1.0f64 / 255.0).to_bits());
}

#[test]
fn a_configuration_this_port_does_not_compute_is_an_error_naming_the_key() {
    for (json, key) in [
        (r#"{"resample": 2}"#, "resample"),
        (r#"{"size": {"shortest_edge": 224, "longest_edge": 500}}"#, "size"),
        (r#"{"crop_size": {"shortest_edge": 224}}"#, "crop_size"),
        (r#"{"do_pad": true}"#, "do_pad"),
        (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
        (r#"{"size": 0}"#, "size"),
        (r#"{"image_processor_type": "SiglipImageProcessor"}"#, "image_processor_type"),
        (r#"{"do_rescale": false, "do_normalize": false}"#, "do_rescale"),
    ] {
        match ClipImageConfig::from_json(json) {
            Err(error @ ClipImageError::Config { .. }) => {
                assert!(error.to_string().contains(key), "{json}: the error does not name {key}: {error}")
            }
            other => panic!("{json}: expected a configuration error naming {key}, got {other:?}"),
        }
    }
}

#[test]
fn a_file_that_is_not_an_image_is_an_error_naming_the_file_and_the_formats_that_work() {
    let folder = tempfile::TempDir::new().expect("a temporary folder");
    let path = folder.path().join("notes.png");
    std::fs::write(&path, "these are not pixels\n").expect("writing the file");
    let error = load_image(&path).expect_err("text is not an image");
    let message = error.to_string();
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(message.contains("PNG") && message.contains("JPEG"), "{message}");
    // A PNG signature with nothing after it is a decode error too, not a panic.
    std::fs::write(&path, b"\x89PNG\r\n\x1a\n").expect("writing the file");
    let message = load_image(&path).expect_err("a truncated PNG").to_string();
    assert!(message.contains(&path.display().to_string()), "{message}");
}

#[test]
fn a_missing_file_is_an_error_naming_the_file() {
    let folder = tempfile::TempDir::new().expect("a temporary folder");
    let path = folder.path().join("absent.png");
    let error = load_image(&path).expect_err("the file does not exist");
    assert!(matches!(error, ClipImageError::Read { .. }), "{error:?}");
    assert!(error.to_string().contains(&path.display().to_string()), "{error}");
}

#[test]
fn colour_keys_pil_reads_differently_are_refused_naming_the_file() {
    let folder = tempfile::TempDir::new().expect("a temporary folder");
    // A 16-bit RGB key (PIL compares it to the 8-bit samples it keeps), an 8-bit grey key of 300.
    let cases = [
        ("keyed16.png", encode_png(4, 3, 16, 2, &[[0u8; 25].as_slice(); 3].concat(), None, Some(&[0, 1, 0, 2, 0, 3]))),
        ("keyed300.png", encode_png(4, 3, 8, 0, &[0u8; 15], None, Some(&[1, 44]))),
    ];
    for (name, png) in cases {
        let path = folder.path().join(name);
        std::fs::write(&path, png).expect("writing the file");
        let error = load_image(&path).expect_err("a key PIL reads differently");
        assert!(matches!(error, ClipImageError::UnsupportedPng { .. }), "{name}: {error:?}");
        assert!(error.to_string().contains(&path.display().to_string()), "{error}");
    }
}

#[test]
fn an_image_with_a_zero_side_is_an_error_not_a_panic() {
    let folder = tempfile::TempDir::new().expect("a temporary folder");
    let path = folder.path().join("small.png");
    std::fs::write(&path, test_png(4, 3, PngKind::Rgb, &mut ChaCha8Rng::seed_from_u64(SEED))).expect("writing");
    let image = load_image(&path).unwrap_or_else(|e| panic!("{e}"));
    for (width, height) in [(0, 3), (4, 0)] {
        let empty = image.crop_imm(0, 0, width, height);
        match preprocess(&empty, &ClipImageConfig::shap_e_img2img()) {
            Err(ClipImageError::EmptyImage { .. }) => {}
            other => panic!("{width}x{height}: expected EmptyImage, got {other:?}"),
        }
    }
}

// ---- The test images ----

/// Seeded content with sharp edges, noise and gradients: sample `c` of the pixel at (x, y), in
/// 0..=255.
fn pattern(x: u32, y: u32, c: u32, width: u32, rng: &mut ChaCha8Rng) -> u8 {
    let third = (width / 3).max(1);
    let value = if x < third {
        rng.gen::<u8>()
    } else if x < 2 * third {
        // A checkerboard of light and dark cells, the cells of each channel of another size.
        let cell = 3 + c;
        [250, 5][((x / cell + y / (cell + 1)) & 1) as usize]
    } else {
        ((x * 255 / width.max(1) + 3 * y + 40 * c) % 256) as u8
    };
    // A sharp diagonal edge across everything, in bands of 9 rows out of 27.
    let band = (y / 9) % 3;
    if x + y / 2 < width / 2 && band == 0 {
        255 - value
    } else {
        value
    }
}

/// Alpha that is 0, 255 and everything between, in stripes.
fn alpha(y: u32, rng: &mut ChaCha8Rng) -> u8 {
    match y % 4 {
        0 => 0,
        1 => 255,
        _ => rng.gen(),
    }
}

/// A PNG of `kind` (rows unfiltered, one stored deflate block per 64 KiB).
fn test_png(width: u32, height: u32, kind: PngKind, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut rows = Vec::new();
    let push16 = |rows: &mut Vec<u8>, v: u16| rows.extend_from_slice(&v.to_be_bytes());
    // Packs samples of `bits` bits into a row, most significant first.
    let pack = |rows: &mut Vec<u8>, samples: &[u8], bits: u32| {
        let per_byte = 8 / bits;
        for chunk in samples.chunks(per_byte as usize) {
            let mut byte = 0u8;
            for (i, s) in chunk.iter().enumerate() {
                byte |= s << (8 - bits * (i as u32 + 1));
            }
            rows.push(byte);
        }
    };
    let (bit_depth, colour_type, palette, mut trns) = match kind {
        PngKind::Rgb | PngKind::RgbKey => (8, 2, None, None),
        PngKind::Rgba => (8, 6, None, None),
        PngKind::Grey => (8, 0, None, None),
        PngKind::GreyAlpha => (8, 4, None, None),
        PngKind::Rgb16 => (16, 2, None, None),
        PngKind::Rgba16 => (16, 6, None, None),
        PngKind::Grey16 => (16, 0, None, None),
        PngKind::GreyAlpha16 => (16, 4, None, None),
        PngKind::PaletteAlpha | PngKind::Palette4 | PngKind::Palette2Key => {
            let (bits, colours) = match kind {
                PngKind::PaletteAlpha => (8, 256),
                PngKind::Palette4 => (4, 16),
                _ => (2, 4),
            };
            let palette: Vec<u8> = (0..colours * 3).map(|_| rng.gen()).collect();
            let trns: Option<Vec<u8>> = match kind {
                PngKind::PaletteAlpha => Some((0..200).map(|i| [0, 255, rng.gen()][i % 3]).collect()),
                PngKind::Palette2Key => Some(vec![255, 0, 255]),
                _ => None,
            };
            (bits, 3, Some(palette), trns)
        }
        PngKind::Grey1 => (1, 0, None, None),
        PngKind::Grey4Key => (4, 0, None, Some(vec![0, 5])),
        PngKind::Grey2Key0 => (2, 0, None, Some(vec![0, 0])),
    };
    if let PngKind::RgbKey = kind {
        trns = Some(vec![0, 5, 0, 5, 0, 5]);
    }
    for y in 0..height {
        let mut samples = Vec::new();
        for x in 0..width {
            let p = |c: u32, rng: &mut ChaCha8Rng| pattern(x, y, c, width, rng);
            match kind {
                PngKind::Rgb => samples.extend([p(0, rng), p(1, rng), p(2, rng)]),
                // The checkerboard's dark cells (5, 5, 5) are the transparent colour.
                PngKind::RgbKey => {
                    let v = p(0, rng);
                    samples.extend(if v == 5 { [5, 5, 5] } else { [v, p(1, rng), p(2, rng)] })
                }
                PngKind::Rgba => samples.extend([p(0, rng), p(1, rng), p(2, rng), alpha(y, rng)]),
                PngKind::Grey => samples.push(p(0, rng)),
                PngKind::GreyAlpha => samples.extend([p(0, rng), alpha(y, rng)]),
                PngKind::Rgb16 | PngKind::Rgba16 | PngKind::GreyAlpha16 => {
                    let channels = match kind {
                        PngKind::Rgb16 => 3,
                        PngKind::Rgba16 => 4,
                        _ => 2,
                    };
                    for c in 0..channels {
                        let high = if c + 1 == channels && channels != 3 { alpha(y, rng) } else { p(c, rng) };
                        push16(&mut rows, u16::from_be_bytes([high, rng.gen()]));
                    }
                }
                // Mostly below 600, so that both sides of PIL's clip to 255 are taken.
                PngKind::Grey16 => {
                    let v = if rng.gen_bool(0.2) { rng.gen() } else { u16::from(p(0, rng)) * 2 + rng.gen_range(0..2) };
                    push16(&mut rows, v);
                }
                PngKind::PaletteAlpha => samples.push(p(0, rng)),
                PngKind::Palette4 | PngKind::Grey4Key => samples.push(p(0, rng) >> 4),
                PngKind::Palette2Key | PngKind::Grey2Key0 => samples.push(p(0, rng) >> 6),
                PngKind::Grey1 => samples.push(p(0, rng) >> 7),
            }
        }
        match kind {
            PngKind::Rgb16 | PngKind::Rgba16 | PngKind::Grey16 | PngKind::GreyAlpha16 => {}
            _ => pack(&mut rows, &samples, bit_depth),
        }
        // Each row is one filter byte (0: none) then the samples: insert the filter byte before
        // this row's bytes.
        let row_bytes = row_len(width, bit_depth, colour_type);
        let start = rows.len() - row_bytes;
        rows.insert(start, 0);
    }
    encode_png(width, height, bit_depth as u8, colour_type, &rows, palette.as_deref(), trns.as_deref())
}

/// Bytes of one row of samples (without its filter byte).
fn row_len(width: u32, bit_depth: u32, colour_type: u8) -> usize {
    let channels = match colour_type {
        2 => 3,
        4 => 2,
        6 => 4,
        _ => 1,
    };
    ((width * channels * bit_depth).div_ceil(8)) as usize
}

/// A PNG file: IHDR, PLTE and tRNS when given, IDAT of `filtered_rows` (each row's filter byte
/// included) in stored deflate blocks, IEND.
fn encode_png(
    width: u32,
    height: u32,
    bit_depth: u8,
    colour_type: u8,
    filtered_rows: &[u8],
    palette: Option<&[u8]>,
    trns: Option<&[u8]>,
) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[bit_depth, colour_type, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    if let Some(palette) = palette {
        chunk(&mut png, b"PLTE", palette);
    }
    if let Some(trns) = trns {
        chunk(&mut png, b"tRNS", trns);
    }
    let mut zlib = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = filtered_rows.chunks(65535).collect();
    for (i, block) in blocks.iter().enumerate() {
        zlib.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        zlib.extend_from_slice(&len.to_le_bytes());
        zlib.extend_from_slice(&(!len).to_le_bytes());
        zlib.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for byte in filtered_rows {
        a = (a + u32::from(*byte)) % 65521;
        b = (b + a) % 65521;
    }
    zlib.extend_from_slice(&((b << 16) | a).to_be_bytes());
    chunk(&mut png, b"IDAT", &zlib);
    chunk(&mut png, b"IEND", &[]);
    png
}

/// Appends a chunk with its length and CRC-32.
fn chunk(png: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    png.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = png.len();
    png.extend_from_slice(kind);
    png.extend_from_slice(data);
    let mut crc = 0xffff_ffffu32;
    for byte in &png[start..] {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    png.extend_from_slice(&(!crc).to_be_bytes());
}
