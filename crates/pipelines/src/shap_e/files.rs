//! The Shap-E pipeline's outputs as files a person opens: the mesh as binary PLY with vertex
//! colours, byte for byte what diffusers' `export_to_ply` writes for the same mesh, and the
//! rendered views as one PNG strip, each view's pixels what the pipeline's `"pil"` output has
//! (`(x * 255).round()` as `uint8`). Every file is written beside its destination and renamed
//! over it, so a failed write leaves what was there before.

use std::io::Write;
use std::path::Path;

use tch::{Kind, Tensor};

use super::Mesh;
use crate::files::{write_atomically, FileError};

/// The mesh as binary little-endian PLY: float x, y, z and uchar red, green, blue per vertex (the
/// linear colours times 255.499, rounded half to even, as diffusers' `export_to_ply` computes them
/// in float32), and each face as a list of three uint32 indices.
pub fn write_ply(path: &Path, mesh: &Mesh) -> Result<(), FileError> {
    let shape = |message: String| FileError::Shape { path: path.to_path_buf(), message };
    let (v, f) = (mesh.verts.size(), mesh.faces.size());
    if v.len() != 2 || v[1] != 3 || mesh.colors.size() != v || f.len() != 2 || f[1] != 3 {
        return Err(shape(format!(
            "a mesh is verts [V, 3], colors [V, 3], faces [F, 3]; these are {v:?}, {:?}, {f:?}",
            mesh.colors.size()
        )));
    }
    let verts = Vec::<f32>::try_from(mesh.verts.to_kind(Kind::Float).flatten(0, -1))
        .map_err(|e| shape(format!("reading the vertices: {e}")))?;
    let colors = Vec::<f32>::try_from(mesh.colors.to_kind(Kind::Float).flatten(0, -1))
        .map_err(|e| shape(format!("reading the colours: {e}")))?;
    let faces =
        Vec::<i64>::try_from(mesh.faces.flatten(0, -1)).map_err(|e| shape(format!("reading the faces: {e}")))?;
    let vertices = verts.len() / 3;
    let index = |i: i64| u32::try_from(i).ok().filter(|&i| (i as usize) < vertices);
    let faces: Vec<u32> = faces
        .iter()
        .map(|&i| index(i).ok_or_else(|| shape(format!("face index {i} is not one of the {vertices} vertices"))))
        .collect::<Result<_, _>>()?;
    let channel = |c: f32| -> Result<u8, FileError> {
        let scaled = (c * 255.499f32).round_ties_even();
        if (0.0..=255.0).contains(&scaled) {
            Ok(scaled as u8)
        } else {
            Err(shape(format!("a vertex colour {c} is outside [0, 1]")))
        }
    };
    let colors: Vec<u8> = colors.iter().map(|&c| channel(c)).collect::<Result<_, _>>()?;
    write_atomically(path, |out| {
        write!(out, "ply\nformat binary_little_endian 1.0\nelement vertex {vertices}\n")?;
        out.write_all(b"property float x\nproperty float y\nproperty float z\n")?;
        out.write_all(b"property uchar red\nproperty uchar green\nproperty uchar blue\n")?;
        write!(out, "element face {}\nproperty list uchar int vertex_index\nend_header\n", faces.len() / 3)?;
        for (xyz, rgb) in verts.chunks_exact(3).zip(colors.chunks_exact(3)) {
            for value in xyz {
                out.write_all(&value.to_le_bytes())?;
            }
            out.write_all(rgb)?;
        }
        for face in faces.chunks_exact(3) {
            out.write_all(&[3])?;
            for index in face {
                out.write_all(&index.to_le_bytes())?;
            }
        }
        Ok(())
    })
}

/// The views [N, S, S, 3] in [0, 1] side by side as one RGB PNG, S high and N·S wide; each pixel
/// `(x * 255).round()` in float32, as the pipeline's PIL output has it.
pub fn write_views_png(path: &Path, views: &Tensor) -> Result<(), FileError> {
    let shape = |message: String| FileError::Shape { path: path.to_path_buf(), message };
    let size = views.size();
    let [n, h, w, 3] = size[..] else {
        return Err(shape(format!("views are [N, S, S, 3]; these are {size:?}")));
    };
    let strip = (views.to_kind(Kind::Float) * 255.0).round().clamp(0.0, 255.0).to_kind(Kind::Uint8);
    // [N, H, W, 3] -> [H, N, W, 3]: row y of the strip is row y of every view in turn.
    let strip = strip.permute([1, 0, 2, 3]).contiguous();
    let bytes = Vec::<u8>::try_from(strip.flatten(0, -1)).map_err(|e| shape(format!("reading the views: {e}")))?;
    let (width, height) = (u32::try_from(n * w).ok(), u32::try_from(h).ok());
    let (Some(width), Some(height)) = (width, height) else {
        return Err(shape(format!("a strip of {n} views of {w}×{h} is too large for a PNG")));
    };
    let image = image::RgbImage::from_raw(width, height, bytes)
        .ok_or_else(|| shape("the pixel count does not match the strip's size".into()))?;
    let mut encoded = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut encoded, image::ImageOutputFormat::Png)
        .map_err(|source| FileError::Encode { path: path.to_path_buf(), source })?;
    write_atomically(path, |out| out.write_all(encoded.get_ref()))
}
