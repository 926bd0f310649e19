//! A safetensors file's header, read and checked without reading its data: what `stageload plan`
//! sizes models from and what the checkpoint loader indexes before it reads anything.
//!
//! A hostile or broken file cannot make this allocate more than it reads: the length field is
//! checked against the file's size and against safetensors' own 100 MB cap before a byte of the
//! header is read, and the header is read into a buffer that grows with what arrives.

use std::fs::File;
use std::io::Read;

use safetensors::tensor::Metadata;

/// The largest header accepted, as safetensors itself caps it (`MAX_HEADER_SIZE`).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Why a file's header was refused; the message says what is wrong, for one that names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// The file's size could not be read, or its header not read.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The file is shorter than the 8-byte length field.
    #[error("{file_len} B: too short for a safetensors header")]
    TooShort {
        /// The file's size.
        file_len: u64,
    },
    /// The length field is over safetensors' cap.
    #[error("header length {header_len} B is over safetensors' limit of {MAX_HEADER_LEN} B: not a safetensors file")]
    OverLimit {
        /// The length field.
        header_len: u64,
    },
    /// The length field runs past the end of the file.
    #[error("header length {header_len} B is larger than the file ({file_len} B): truncated or not safetensors")]
    PastTheEnd {
        /// The length field.
        header_len: u64,
        /// The file's size.
        file_len: u64,
    },
    /// The file ended inside the header (it shrank while being read).
    #[error("the file ended {read} B into its {header_len} B header: truncated")]
    Cut {
        /// Bytes of the header read.
        read: u64,
        /// The length field.
        header_len: u64,
    },
    /// The header is not UTF-8.
    #[error("header is not UTF-8: {0}")]
    NotUtf8(#[source] std::str::Utf8Error),
    /// The header is not what safetensors accepts (JSON, dtypes, offsets against shapes).
    #[error("header is not a valid safetensors header: {0}")]
    Invalid(#[source] serde_json::Error),
    /// The data the header describes is not all in the file.
    #[error("the header describes {data_end} B of data but the file holds {data_len} B after it: truncated")]
    DataCut {
        /// Where the described data ends, after the header.
        data_end: u64,
        /// The bytes after the header.
        data_len: u64,
    },
}

/// A checked header: where the data begins and what it holds.
#[derive(Debug)]
pub struct Header {
    /// Offset of the first data byte in the file (8 + the header's length).
    pub data_start: u64,
    /// Tensor names, dtypes, shapes and offsets (relative to `data_start`).
    pub metadata: Metadata,
}

/// Reads the header at the start of `file` and checks that its length fits the file and the
/// cap, that it is a valid safetensors header (safetensors' own `Metadata` checks the JSON, the
/// dtypes, and that the offsets are contiguous and match each tensor's shape and dtype), and
/// that the data it describes is all in the file. The error says what is wrong, for a message
/// naming the file. `file` should come from [`crate::open_regular`].
pub fn read_header(file: &mut File) -> Result<Header, HeaderError> {
    let file_len = file.metadata()?.len();
    let mut length = [0u8; 8];
    file.read_exact(&mut length).map_err(|_| HeaderError::TooShort { file_len })?;
    let header_len = u64::from_le_bytes(length);
    if header_len > MAX_HEADER_LEN {
        return Err(HeaderError::OverLimit { header_len });
    }
    if header_len > file_len.saturating_sub(8) {
        return Err(HeaderError::PastTheEnd { header_len, file_len });
    }
    let mut header = Vec::new();
    file.take(header_len).read_to_end(&mut header)?;
    if header.len() as u64 != header_len {
        return Err(HeaderError::Cut { read: header.len() as u64, header_len });
    }
    let text = std::str::from_utf8(&header).map_err(HeaderError::NotUtf8)?;
    let metadata: Metadata = serde_json::from_str(text).map_err(HeaderError::Invalid)?;
    let data_start = 8 + header_len;
    let data_end = metadata.tensors().values().map(|info| info.data_offsets.1 as u64).max().unwrap_or(0);
    let data_len = file_len - data_start;
    if data_end > data_len {
        return Err(HeaderError::DataCut { data_end, data_len });
    }
    Ok(Header { data_start, metadata })
}

#[cfg(test)]
mod tests {
    use std::io::{Seek, Write};

    use proptest::prelude::*;

    use super::*;

    /// A file holding exactly `bytes`.
    fn file_of(bytes: &[u8]) -> File {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(bytes).unwrap();
        file.rewind().unwrap();
        file
    }

    fn with_header(header: &str, data: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data, 0);
        bytes
    }

    const ONE_F32: &str = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;

    #[test]
    fn a_valid_header_gives_where_the_data_starts() {
        let header = read_header(&mut file_of(&with_header(ONE_F32, 8))).unwrap();
        assert_eq!(header.data_start, 8 + ONE_F32.len() as u64);
        assert_eq!(header.metadata.tensors().len(), 1);
    }

    #[test]
    fn a_file_shorter_than_the_length_field_is_too_short() {
        let error = read_header(&mut file_of(b"abc")).unwrap_err();
        assert!(matches!(error, HeaderError::TooShort { file_len: 3 }), "{error}");
        assert_eq!(error.to_string(), "3 B: too short for a safetensors header");
        assert_eq!(read_header(&mut file_of(b"")).unwrap_err().to_string(), "0 B: too short for a safetensors header");
    }

    #[test]
    fn a_length_over_the_cap_is_refused_before_reading_even_in_a_sparse_file_that_holds_it() {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&(4u64 << 30).to_le_bytes()).unwrap();
        file.set_len(8 << 30).unwrap();
        file.rewind().unwrap();
        let error = read_header(&mut file).unwrap_err();
        assert!(matches!(error, HeaderError::OverLimit { header_len: 4294967296 }), "{error}");
        assert!(error.to_string().starts_with("header length 4294967296 B is over safetensors' limit"), "{error}");
    }

    #[test]
    fn a_length_past_the_end_of_the_file_is_truncation() {
        let mut bytes = with_header(ONE_F32, 8);
        bytes[0] += 100;
        let error = read_header(&mut file_of(&bytes)).unwrap_err();
        assert!(
            matches!(error, HeaderError::PastTheEnd { .. }) && error.to_string().contains("is larger than the file")
        );
        let error = read_header(&mut file_of(&u64::MAX.to_le_bytes())).unwrap_err();
        assert!(matches!(error, HeaderError::OverLimit { .. }), "{error}");
    }

    #[test]
    fn data_missing_after_the_header_is_truncation() {
        let error = read_header(&mut file_of(&with_header(ONE_F32, 4))).unwrap_err();
        assert!(matches!(error, HeaderError::DataCut { data_end: 8, data_len: 4 }), "{error}");
        assert_eq!(error.to_string(), "the header describes 8 B of data but the file holds 4 B after it: truncated");
    }

    #[test]
    fn offsets_that_do_not_match_the_shape_are_refused() {
        let header = r#"{"w":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,8]}}"#;
        let error = read_header(&mut file_of(&with_header(header, 8))).unwrap_err();
        assert!(matches!(error, HeaderError::Invalid(_)), "{error}");
        assert!(error.to_string().starts_with("header is not a valid safetensors header"), "{error}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Any bytes at all: an answer (never a panic), and a header only when its data fits.
        #[test]
        fn any_bytes_get_an_answer(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(header) = read_header(&mut file_of(&bytes)) {
                let end = header.metadata.tensors().values().map(|i| i.data_offsets.1 as u64).max().unwrap_or(0);
                prop_assert!(header.data_start + end <= bytes.len() as u64);
            }
        }

        /// A valid header with its length field or its text damaged.
        #[test]
        fn damaged_headers_get_an_answer(length in any::<u64>(), cut in 0usize..60, flip in any::<u8>()) {
            let mut bytes = with_header(ONE_F32, 8);
            if length % 2 == 0 {
                bytes[..8].copy_from_slice(&length.to_le_bytes());
            }
            let at = 8 + cut.min(ONE_F32.len() - 1);
            bytes[at] ^= flip;
            let _ = read_header(&mut file_of(&bytes));
        }
    }
}
