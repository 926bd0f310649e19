//! What a checkpoint's header says a model holds: its entries' names and bytes, as stored and
//! once loaded in the model's dtype (float entries convert, integer and bool ones keep theirs),
//! read without touching the data.

use std::path::Path;

use stageload_input::HeaderError;

use super::total;

/// Whether entries of `dtype` convert to a model's load dtype (floats do; integers and bools
/// keep theirs).
fn converts(dtype: safetensors::Dtype) -> bool {
    use safetensors::Dtype::*;
    matches!(dtype, F16 | BF16 | F32 | F64 | F8_E4M3 | F8_E5M2)
}

/// What one checkpoint holds for a model: the entries it loads and their bytes as stored, once
/// loaded with `load_bits` per float element (as stored without it), and of floats once loaded.
pub(super) struct FileSizes {
    /// Each loaded entry's name and bytes once loaded.
    pub(super) loaded: Vec<(String, u64)>,
    pub(super) stored: u64,
    pub(super) resident: u64,
    pub(super) float_bytes: u64,
    pub(super) float_elements: u64,
}

pub(super) fn read_header(
    path: &Path,
    ignore: &[glob::Pattern],
    load_bits: Option<usize>,
) -> Result<FileSizes, HeaderError> {
    let mut file = stageload_input::open_regular(path)?;
    let header = stageload_input::read_header(&mut file)?;
    let loaded: Vec<_> =
        header.metadata.tensors().into_iter().filter(|(name, _)| !ignore.iter().any(|p| p.matches(name))).collect();
    // safetensors checked each entry's offsets against its shape and dtype, and the reader
    // checked them against the file, so each size below fits the file.
    let stored = total(loaded.iter().map(|(_, info)| (info.data_offsets.1 - info.data_offsets.0) as u64));
    let resident_of = |info: &safetensors::tensor::TensorInfo| match load_bits {
        Some(bits) if converts(info.dtype) => {
            (info.shape.iter().product::<usize>() as u64).saturating_mul(bits as u64) / 8
        }
        _ => (info.data_offsets.1 - info.data_offsets.0) as u64,
    };
    let floats: Vec<_> = loaded.iter().filter(|(_, info)| converts(info.dtype)).collect();
    Ok(FileSizes {
        loaded: loaded.iter().map(|(name, info)| (name.clone(), resident_of(info))).collect(),
        stored,
        resident: total(loaded.iter().map(|(_, info)| resident_of(info))),
        float_bytes: total(floats.iter().map(|(_, info)| resident_of(info))),
        float_elements: total(floats.iter().map(|(_, info)| info.shape.iter().product::<usize>() as u64)),
    })
}
