fn main() -> Result<(), stageload::BoxError> {
    let folder = std::env::temp_dir().join(format!("my-pipeline-{}", std::process::id()));
    std::fs::create_dir_all(&folder)?;
    let outcome = my_pipeline::run(&folder, 256);
    std::fs::remove_dir_all(&folder)?;
    let outcome = outcome?;
    println!("resident after decode: {:?}", outcome.resident_after_decode);
    println!("output {:?}", outcome.output);
    // CUDA is seen where libtorch has it (libtorch_cuda linked): the build's `link_libtorch`.
    println!("cuda available: {}", tch::Cuda::is_available());
    Ok(())
}
