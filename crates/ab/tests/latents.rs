//! Latents files written as `stageload::latents::Latents` writes them (safetensors), compared:
//! identical, within the reference's own variation, beyond it, one reference only, and the
//! files that cannot be compared.

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use stageload_ab::latents::{compare, Difference, LatentFile, Verdict};

fn write(dir: &Path, name: &str, latents: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
    let path = dir.join(name);
    let views: Vec<(String, TensorView)> = latents
        .iter()
        .map(|(n, dtype, shape, bytes)| (n.to_string(), TensorView::new(*dtype, shape.clone(), bytes).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

fn f32s(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A run with latents `x` (f32) and `y` (bf16).
fn run(dir: &Path, name: &str, x: &[f32], y: &[f32]) -> LatentFile {
    let y: Vec<u8> = y.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
    let path = write(dir, name, &[("x", Dtype::F32, vec![x.len()], f32s(x)), ("y", Dtype::BF16, vec![y.len() / 2], y)]);
    LatentFile::read(&path).unwrap()
}

#[test]
fn identical_runs_are_identical_and_differences_are_measured_by_size() {
    let dir = tempfile::tempdir().unwrap();
    let eager = run(dir.path(), "eager.safetensors", &[1.0, 2.0, -4.0], &[0.5, 0.25]);
    let same = run(dir.path(), "same.safetensors", &[1.0, 2.0, -4.0], &[0.5, 0.25]);
    let moved = run(dir.path(), "moved.safetensors", &[1.0, 2.5, -4.0], &[0.5, 0.25]);
    let reports = compare(std::slice::from_ref(&eager), std::slice::from_ref(&same)).unwrap();
    assert_eq!(reports.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["x", "y"], "in the order recorded");
    assert!(reports.iter().all(|r| r.verdict == Verdict::Identical));
    let reports = compare(std::slice::from_ref(&eager), &[same, moved]).unwrap();
    assert_eq!(reports[0].runs[1].1, Difference::Differs { max_abs: 0.5, relative: 0.125 });
    assert_eq!(reports[0].verdict, Verdict::Differs, "one reference run: nothing to judge the difference by");
    assert_eq!(reports[1].verdict, Verdict::Identical);
}

#[test]
fn differences_are_judged_against_the_references_own_variation() {
    let dir = tempfile::tempdir().unwrap();
    let eager1 = run(dir.path(), "e1.safetensors", &[1.0, 2.0], &[1.0]);
    let eager2 = run(dir.path(), "e2.safetensors", &[1.0, 2.1], &[1.0]);
    let within = run(dir.path(), "s1.safetensors", &[1.05, 2.0], &[1.0]);
    let beyond = run(dir.path(), "s2.safetensors", &[1.0, 2.4], &[1.0]);
    let reports = compare(&[eager1.clone(), eager2.clone()], std::slice::from_ref(&within)).unwrap();
    let variation = reports[0].reference_variation.unwrap();
    assert!(matches!(variation, Difference::Differs { max_abs, .. } if (max_abs - 0.1).abs() < 1e-6), "{variation:?}");
    assert_eq!(reports[0].verdict, Verdict::WithinVariation);
    let reports = compare(&[eager1, eager2], &[within, beyond]).unwrap();
    let Verdict::Exceeds { factor } = reports[0].verdict else { panic!("{:?}", reports[0].verdict) };
    assert!((factor - 4.0).abs() < 1e-3, "0.4 against a variation of 0.1: {factor}");
    assert!(!reports[0].verdict.passes() && reports[1].verdict.passes());
}

#[test]
fn latents_that_cannot_be_compared_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let eager = run(dir.path(), "eager.safetensors", &[1.0, 2.0], &[1.0]);
    let other_shape = run(dir.path(), "shape.safetensors", &[1.0, 2.0, 3.0], &[1.0]);
    let error = compare(std::slice::from_ref(&eager), &[other_shape]).unwrap_err().to_string();
    assert!(error.contains("latent 'x'") && error.contains("F32 [3]") && error.contains("F32 [2]"), "{error}");
    let other_names = write(
        dir.path(),
        "other-names.safetensors",
        &[("x", Dtype::F32, vec![2], f32s(&[1.0, 2.0])), ("z", Dtype::F32, vec![1], f32s(&[1.0]))],
    );
    let error = compare(&[eager], &[LatentFile::read(&other_names).unwrap()]).unwrap_err().to_string();
    assert!(
        error.contains("other-names.safetensors") && error.contains("missing y; extra z"),
        "the names on both sides are listed: {error}"
    );
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    assert!(LatentFile::read(&junk).unwrap_err().to_string().contains("junk.safetensors"));
    assert!(LatentFile::read(dir.path()).unwrap_err().to_string().contains("not a regular file"));
}

#[test]
fn a_tiny_difference_and_a_nan_are_measured_not_hidden() {
    let dir = tempfile::tempdir().unwrap();
    let eager = run(dir.path(), "eager.safetensors", &[1.0, 2.0], &[1.0]);
    let tiny = run(dir.path(), "tiny.safetensors", &[1.0, 2.0 + 2.4e-7], &[1.0]);
    let nan = run(dir.path(), "nan.safetensors", &[f32::NAN, 2.0], &[1.0]);
    let reports = compare(std::slice::from_ref(&eager), &[tiny, nan]).unwrap();
    let Difference::Differs { max_abs, relative } = reports[0].runs[0].1 else { panic!("{:?}", reports[0]) };
    assert!(max_abs > 1e-7 && max_abs < 1e-6 && relative < 1e-6, "{max_abs} {relative}");
    let Difference::Differs { max_abs, .. } = reports[0].runs[1].1 else { panic!("{:?}", reports[0]) };
    assert!(max_abs.is_infinite(), "a NaN where the reference has a number is an unbounded difference");
    assert_eq!(reports[1].verdict, Verdict::Identical);
}

#[test]
fn an_infinite_difference_is_written_as_json_null_and_read_back_infinite() {
    for (written, read) in [
        (
            Difference::Differs { max_abs: 1.5, relative: f64::INFINITY },
            "{\"kind\":\"differs\",\"max_abs\":1.5,\"relative\":null}",
        ),
        (Difference::Identical, "{\"kind\":\"identical\"}"),
    ] {
        let json = serde_json::to_string(&written).unwrap();
        assert_eq!(json, read);
        assert_eq!(serde_json::from_str::<Difference>(&json).unwrap(), written);
    }
    let verdict = Verdict::Exceeds { factor: f64::INFINITY };
    assert_eq!(serde_json::from_str::<Verdict>(&serde_json::to_string(&verdict).unwrap()).unwrap(), verdict);
}
