//! The Wan pipeline's video as files a person opens: every frame as a PNG (its pixels the
//! pipeline's `"pil"` output, `(x * 255).round()` as `uint8`, the frames diffusers' `export_to_video`
//! would encode) and the whole clip as a looping animated GIF at the published 16 frames per
//! second (the `image` crate's encoder: its palette is its own, so the GIF's pixels are close to
//! the frames', not equal; a GIF counts delays in hundredths of a second, so each frame shows for
//! 6/100 s, as diffusers' `export_to_gif` at 16 frames per second stores it too). Every file is written beside its destination and renamed over it, so
//! a failed write leaves what was there before and never a partial frame.

use std::io::Write;
use std::path::{Path, PathBuf};

use image::codecs::gif::{GifEncoder, Repeat};
use image::{Delay, Frame, RgbImage};
use tch::{Kind, Tensor};

use crate::files::{write_atomically, FileError};

/// Wan2.1's frame rate (the model card's `export_to_video(output, "output.mp4", fps=16)`).
pub const FPS: u32 = 16;

/// The frames uint8 [F, H, W, 3] as images, or an error naming `path` when they are not.
fn images(path: &Path, frames: &Tensor) -> Result<Vec<RgbImage>, FileError> {
    let shape = |message: String| FileError::Shape { path: path.to_path_buf(), message };
    let size = frames.size();
    let (n, h, w) = match size[..] {
        [n, h, w, 3] if frames.kind() == Kind::Uint8 && n > 0 => (n, h, w),
        _ => {
            return Err(shape(format!(
                "frames are uint8 [F, H, W, 3] with F > 0; these are {:?} {size:?}",
                frames.kind()
            )))
        }
    };
    let (Ok(width), Ok(height)) = (u32::try_from(w), u32::try_from(h)) else {
        return Err(shape(format!("frames of {w}×{h} are too large for an image")));
    };
    (0..n)
        .map(|i| {
            let bytes = Vec::<u8>::try_from(frames.get(i).contiguous().flatten(0, -1))
                .map_err(|e| shape(format!("reading frame {i}: {e}")))?;
            RgbImage::from_raw(width, height, bytes).ok_or_else(|| shape(format!("frame {i} has another pixel count")))
        })
        .collect()
}

/// Writes each frame as `dir/frame_NNNN.png` (from 0000); returns their paths. `dir` must exist.
pub fn write_frames(dir: &Path, frames: &Tensor) -> Result<Vec<PathBuf>, FileError> {
    let images = images(dir, frames)?;
    let mut paths = Vec::with_capacity(images.len());
    for (i, image) in images.iter().enumerate() {
        let path = dir.join(format!("frame_{i:04}.png"));
        let mut encoded = std::io::Cursor::new(Vec::new());
        image
            .write_to(&mut encoded, image::ImageOutputFormat::Png)
            .map_err(|source| FileError::Encode { path: path.clone(), source })?;
        write_atomically(&path, |out| out.write_all(encoded.get_ref()))?;
        paths.push(path);
    }
    Ok(paths)
}

/// Writes the frames as one animated GIF at [`FPS`], looping.
pub fn write_gif(path: &Path, frames: &Tensor) -> Result<(), FileError> {
    let images = images(path, frames)?;
    let encode = |source| FileError::Encode { path: path.to_path_buf(), source };
    let mut encoded = Vec::new();
    {
        // Speed 10 of 1 (best palette, slowest) to 30: the encoder's documented default trade-off.
        let mut encoder = GifEncoder::new_with_speed(&mut encoded, 10);
        encoder.set_repeat(Repeat::Infinite).map_err(encode)?;
        let delay = Delay::from_numer_denom_ms(1000, FPS);
        let frames = images.into_iter().map(|image| {
            let rgba = image::DynamicImage::ImageRgb8(image).into_rgba8();
            Frame::from_parts(rgba, 0, 0, delay)
        });
        encoder.encode_frames(frames).map_err(encode)?;
    }
    write_atomically(path, |out| out.write_all(&encoded))
}
