#[test]
fn entering_decode_releases_the_encoder() {
    let folder = std::env::temp_dir().join(format!("my-pipeline-test-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let outcome = my_pipeline::run(&folder, 64);
    std::fs::remove_dir_all(&folder).unwrap();
    let outcome = outcome.unwrap();
    assert_eq!(outcome.resident_after_decode, ["decoder"]);
    assert_eq!(outcome.output, [8, 64]);
}
