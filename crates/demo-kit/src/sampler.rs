//! The demo pipelines' sampler: a flow model run over a step schedule that draws from both torch's
//! generator and the pipeline's ChaCha generator, as a stochastic sampler would.

use tch::nn::Module;
use tch::Tensor;

use crate::models::Transformer;

/// One sampler step size schedule: `steps` times in (0, 1], each nudged by the pipeline's ChaCha
/// generator as a stochastic sampler would.
pub fn schedule(steps: i64, chacha: &stageload::SharedRng<rand_chacha::ChaCha8Rng>) -> Vec<f64> {
    use rand::Rng;
    (0..steps).map(|i| (i as f64 + 1.0) / steps as f64 - chacha.lock().gen_range(0.0..0.01)).collect()
}

/// Runs a flow model for the schedule: x ← x − dt · v(x + cond), fresh noise mixed in per step.
pub fn sample_flow(model: &Transformer, x: Tensor, cond: &Tensor, times: &[f64]) -> Tensor {
    let velocity = |input: &Tensor| Ok::<_, std::convert::Infallible>(model.forward(input));
    match sample_flow_with(x, cond, times, velocity) {
        Ok(x) => x,
        Err(never) => match never {},
    }
}

/// [`sample_flow`] with the velocity from any forward (a streamed model's, say); the noise is
/// drawn outside it, so a forward run again after an out-of-memory draws nothing twice.
pub fn sample_flow_with<E>(
    mut x: Tensor,
    cond: &Tensor,
    times: &[f64],
    mut velocity: impl FnMut(&Tensor) -> Result<Tensor, E>,
) -> Result<Tensor, E> {
    let _no_grad = tch::no_grad_guard();
    let mut previous = 0.0;
    for &t in times {
        let v = velocity(&(&x + cond))?;
        let noise = Tensor::randn_like(&x) * 0.05;
        x = x - v * (t - previous) + noise;
        previous = t;
    }
    Ok(x)
}
