//! A safetensors file's header, read and checked without reading its data: what `stageload plan`
//! sizes models from and what the checkpoint loader indexes before it reads anything.

use std::fs::File;
use std::io::Read;

use safetensors::tensor::Metadata;

/// A checked header: where the data begins and what it holds.
#[derive(Debug)]
pub struct Header {
    /// Offset of the first data byte in the file (8 + the header's length).
    pub data_start: u64,
    /// Tensor names, dtypes, shapes and offsets (relative to `data_start`).
    pub metadata: Metadata,
}

/// Reads the header at the start of `file` and checks that its length fits the file, that it is
/// a valid safetensors header (safetensors' own `Metadata` checks the JSON, the dtypes, and that
/// the offsets are contiguous and match each tensor's shape and dtype), and that the data it
/// describes is all in the file. The error says what is wrong, for a message naming the file.
pub fn read_header(file: &mut File) -> Result<Header, String> {
    let file_len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut length = [0u8; 8];
    file.read_exact(&mut length).map_err(|_| format!("{file_len} bytes: too short for a safetensors header"))?;
    let header_len = u64::from_le_bytes(length);
    if header_len > file_len - 8 {
        return Err(format!(
            "header length {header_len} B is larger than the file ({file_len} B): truncated or not safetensors"
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    let text = std::str::from_utf8(&header).map_err(|e| format!("header is not UTF-8: {e}"))?;
    let metadata: Metadata =
        serde_json::from_str(text).map_err(|e| format!("header is not a valid safetensors header: {e}"))?;
    let data_start = 8 + header_len;
    let data_end = metadata.tensors().values().map(|info| info.data_offsets.1 as u64).max().unwrap_or(0);
    if data_start + data_end > file_len {
        return Err(format!(
            "the header describes {data_end} B of data but the file holds {} B after it: truncated",
            file_len - data_start
        ));
    }
    Ok(Header { data_start, metadata })
}
