//! What an AOTInductor package records for its runner, read from the package itself rather than
//! from a record an exporter may or may not have added: each constant's shape (under its FQN,
//! as `ep.state_dict` and `ep.constants` name it) and whether the weights are inside its
//! compiled library. `aoti_compile_and_package` writes the model's generated C++ source beside
//! its library (`data/aotinductor/model/<hash>.wrapper.cpp`), whose constructor sets both:
//!
//! ```text
//!     : AOTInductorModelBase(1, 1, 1, device_str, std::move(cubin_dir), true) {  // weights inside
//!     constants_info_[0].shape = {4, 8};
//!     constants_info_[0].original_fqn = "l.weight";
//! ```
//!
//! (libtorch's runner answers names, FQNs and dtypes, not shapes.)

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;

/// The most a package's wrapper source may hold; a larger one is refused unread.
const MAX_SOURCE: u64 = 256 << 20;

/// What the package records of its constants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Record {
    /// Each constant's shape by FQN.
    pub(super) shapes: HashMap<String, Vec<i64>>,
    /// The weights are compiled into its library (`package_constants_in_so=True`).
    pub(super) weights_inside: bool,
}

/// The record of the package at `path`; why not, in words.
pub(super) fn read(path: &Path) -> Result<Record, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| format!("not a zip archive: {e}"))?;
    let name = archive
        .file_names()
        .find(|n| n.contains("/data/aotinductor/model/") && n.ends_with(".wrapper.cpp"))
        .map(str::to_string)
        .ok_or("it holds no data/aotinductor/model/*.wrapper.cpp, the generated source that records its constants")?;
    let entry = archive.by_name(&name).map_err(|e| format!("{name}: {e}"))?;
    if entry.size() > MAX_SOURCE {
        return Err(format!("{name} is {} bytes, more than the {MAX_SOURCE} read", entry.size()));
    }
    let mut source = String::new();
    entry.take(MAX_SOURCE + 1).read_to_string(&mut source).map_err(|e| format!("{name}: {e}"))?;
    parse(&source).map_err(|e| format!("{name}: {e}"))
}

/// The record in a wrapper's source.
pub(super) fn parse(source: &str) -> Result<Record, String> {
    let weights_inside = include_weights(source)?;
    let mut shapes = BTreeMap::new();
    let mut fqns = BTreeMap::new();
    for line in source.lines() {
        let Some(rest) = line.trim_start().strip_prefix("constants_info_[") else { continue };
        let Some((index, rest)) = rest.split_once("].") else { continue };
        let index: usize = index.parse().map_err(|_| format!("constant index '{index}' is not a number"))?;
        if let Some(dims) = rest.strip_prefix("shape = {").and_then(|r| r.strip_suffix("};")) {
            let dims = dims.split(',').map(str::trim).filter(|d| !d.is_empty());
            let shape = dims.map(|d| d.parse::<i64>().map_err(|_| format!("constant {index}: shape {{{rest}")));
            shapes.insert(index, shape.collect::<Result<Vec<i64>, String>>()?);
        } else if let Some(fqn) = rest.strip_prefix("original_fqn = \"").and_then(|r| r.strip_suffix("\";")) {
            fqns.insert(index, fqn.to_string());
        }
    }
    let shapes = fqns
        .into_iter()
        .map(|(index, fqn)| {
            shapes.remove(&index).map(|shape| (fqn.clone(), shape)).ok_or(format!("constant '{fqn}' has no shape"))
        })
        .collect::<Result<HashMap<_, _>, _>>()?;
    Ok(Record { shapes, weights_inside })
}

/// The last argument of the `AOTInductorModelBase` constructor: whether the library holds the
/// weights.
fn include_weights(source: &str) -> Result<bool, String> {
    let call = source
        .split_once(": AOTInductorModelBase(")
        .map(|(_, rest)| rest)
        .ok_or("no AOTInductorModelBase constructor")?;
    let arguments = call.split_once('{').map_or(call, |(arguments, _)| arguments).trim_end();
    let arguments = arguments.strip_suffix(')').unwrap_or(arguments);
    match arguments.rsplit(',').next().map(str::trim) {
        Some("true") => Ok(true),
        Some("false") => Ok(false),
        other => Err(format!("the constructor's last argument is {other:?}, not true or false")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of a wrapper `aoti_compile_and_package` wrote (torch 2.13, a Linear and a
    /// BatchNorm, `package_constants_in_so=False`).
    const WRAPPER: &str = r#"
AOTInductorModel::AOTInductorModel(std::shared_ptr<ConstantMap> constants_map,
                                   const std::string& device_str,
                                   std::optional<std::string> cubin_dir)
    : AOTInductorModelBase(1,
                           1,
                           2,
                           device_str,
                           std::move(cubin_dir),
                           false) {
    inputs_info_[0].name = "arg7_1";
    constants_info_[0].name = "l_weight";
    constants_info_[0].data_size = 128;
    constants_info_[0].shape = {4, 8};
    constants_info_[0].stride = {8, 1};
    constants_info_[0].original_fqn = "l.weight";
    constants_info_[1].name = "bn_num_batches_tracked";
    constants_info_[1].shape = {};
    constants_info_[1].stride = {};
    constants_info_[1].original_fqn = "bn.num_batches_tracked";
"#;

    #[test]
    fn a_wrappers_constructor_gives_each_constants_shape_by_fqn_and_where_the_weights_are() {
        let record = parse(WRAPPER).unwrap();
        assert_eq!(record.shapes["l.weight"], [4, 8]);
        assert_eq!(record.shapes["bn.num_batches_tracked"], Vec::<i64>::new(), "a scalar");
        assert_eq!(record.shapes.len(), 2);
        assert!(!record.weights_inside);
        assert!(parse(&WRAPPER.replace("false) {", "true) {")).unwrap().weights_inside);
    }

    #[test]
    fn a_wrapper_that_does_not_say_is_an_error_not_an_empty_record() {
        assert!(parse("int main() {}").unwrap_err().contains("AOTInductorModelBase"));
        let no_shape = WRAPPER.replace("    constants_info_[0].shape = {4, 8};\n", "");
        assert!(parse(&no_shape).unwrap_err().contains("'l.weight' has no shape"));
        let bad = WRAPPER.replace("{4, 8}", "{4, x}");
        assert!(parse(&bad).is_err());
        assert!(parse(&WRAPPER.replace("false) {", "maybe) {")).is_err());
    }
}
