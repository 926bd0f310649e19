//! A job's resource request from its plan: what one run asks a scheduler for (Ray, Slurm,
//! Kubernetes), and what `stageload guard --plan` holds the run to. One function,
//! [`Request::of`], turns a [`Plan`] into the numbers; the renderers only spell them in each
//! scheduler's words.
//!
//! The memory a run may use (`memory`) is the plan's largest stage need, reserve included: a
//! scheduler's reservation and limit. What it is expected to use (`expected`) is the same need
//! before the reserve: a Kubernetes request. Device memory is the plan's largest device need, over
//! all the pipeline's devices together.

use serde::Serialize;
use stageload_units::format_bytes;

use crate::pipeline::{DeviceName, Pipeline, Placement};
use crate::plan::{peak, Budget, Plan, Verdict};

/// What one run loads: stage by stage (the plan's staged run) or every model up front.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Stage by stage, as the plan's staged run.
    Staged,
    /// Every model up front.
    Eager,
}

/// What one run of a pipeline asks a scheduler for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Request {
    /// Staged or eager.
    pub mode: Mode,
    /// The stage whose need is the request (the plan's peak stage in this mode).
    pub stage: String,
    /// Host bytes the run may use: the largest stage need plus the reserve.
    pub memory: u64,
    /// Host bytes it is expected to use: the same need before the reserve.
    pub expected: u64,
    /// GPUs one run asks for (`num_gpus`, `--gres=gpu:N`): the highest CUDA index the
    /// pipeline's models name, plus one. A scheduler numbers the GPUs it gives a job from 0, so a
    /// model on `cuda:1` needs two.
    pub gpus: usize,
    /// Device bytes the run may use over all its devices.
    pub device_memory: u64,
    /// Device bytes it is expected to use: the same before the reserve.
    pub device_expected: u64,
    /// CPUs, when the pipeline file declares them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
}

/// A plan that fits no machine of its budget: the stage and by how much, for a message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "the plan does not fit: stage '{stage}' needs {} of {where_}, over {} by {}; \
     a run needs a larger machine (`stageload plan --memory SIZE --device-memory SIZE` plans for \
     the largest node a scheduler can place it on) or a smaller stage (`stageload plan` lists what would)",
    format_bytes(*.need), format_bytes(*.total), format_bytes(*.by)
)]
pub struct DoesNotFit {
    /// The stage that does not fit.
    pub stage: String,
    /// `host memory` or `device memory`, and the budget's source.
    pub where_: String,
    /// Bytes it needs.
    pub need: u64,
    /// Bytes of the budget's total.
    pub total: u64,
    /// Bytes over.
    pub by: u64,
}

impl Request {
    /// The request of one run of `pipeline` as `plan` sizes it, or why no machine of the plan's
    /// budget holds it.
    pub fn of(pipeline: &Pipeline, plan: &Plan, mode: Mode) -> Result<Request, DoesNotFit> {
        // A device budget is the user's: --device-memory or the file's device_memory, never this machine.
        let host = format!("host memory ({})", plan.budget.source.describe());
        let device = "device memory (--device-memory, or the file's device_memory)";
        let refuse = |stage: &str, verdict: &Verdict, need: u64, budget: Option<&Budget>, where_: &str| match (
            verdict, budget,
        ) {
            (Verdict::DoesNotFit { by }, Some(budget)) => Err(DoesNotFit {
                stage: stage.to_string(),
                where_: where_.to_string(),
                need,
                total: budget.total,
                by: *by,
            }),
            _ => Ok(()),
        };
        let (stage, memory, expected, device_memory, device_expected) = match mode {
            Mode::Staged => {
                for s in &plan.stages {
                    refuse(&s.name, &s.verdict, s.need, Some(&plan.budget), &host)?;
                    refuse(&s.name, &s.device_verdict, s.device_need, plan.device_budget.as_ref(), device)?;
                }
                let (host, device) = (peak(&plan.stages, |s| s.need), peak(&plan.stages, |s| s.device_need));
                (
                    host.map_or_else(String::new, |s| s.name.clone()),
                    host.map_or(0, |s| s.need),
                    host.map_or(0, |s| s.need_before_reserve),
                    device.map_or(0, |s| s.device_need),
                    device.map_or(0, |s| s.device_need_before_reserve),
                )
            }
            Mode::Eager => {
                let eager = &plan.eager;
                refuse(&eager.peak_stage, &eager.verdict, eager.need, Some(&plan.budget), &host)?;
                refuse(
                    &eager.peak_stage,
                    &eager.device_verdict,
                    eager.device_need,
                    plan.device_budget.as_ref(),
                    device,
                )?;
                let stage = eager.peak_stage.clone();
                (stage, eager.need, eager.need_before_reserve, eager.device_need, eager.device_need_before_reserve)
            }
        };
        let gpus = pipeline
            .models
            .iter()
            .filter(|m| m.placement == Placement::Device)
            .filter_map(|m| match m.device {
                DeviceName::Cuda(index) => index.checked_add(1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        Ok(Request { mode, stage, memory, expected, gpus, device_memory, device_expected, cpus: pipeline.cpus })
    }

    /// Ray's task or actor options (`ray.remote(**options)`, `.options(**options)`) as JSON:
    /// `memory` in bytes, `num_cpus`, `num_gpus`, and device memory as the custom resource
    /// `device_memory_mib` (start each node with `--resources '{"device_memory_mib": M}'`).
    pub fn ray(&self) -> String {
        let mut options = serde_json::Map::new();
        options.insert("memory".into(), self.memory.into());
        if let Some(cpus) = self.cpus {
            options.insert("num_cpus".into(), cpus.into());
        }
        if self.gpus > 0 {
            options.insert("num_gpus".into(), self.gpus.into());
        }
        if self.device_memory > 0 {
            options.insert("resources".into(), serde_json::json!({ "device_memory_mib": mib(self.device_memory) }));
        }
        serde_json::Value::Object(options).to_string()
    }

    /// `#SBATCH` lines: `--mem` (MiB, rounded up), `--cpus-per-task`, `--gres=gpu:N`, and the
    /// device memory as a comment (Slurm counts GPUs, not their memory).
    pub fn slurm(&self) -> String {
        let mut lines = vec![format!("#SBATCH --mem={}M", mib(self.memory))];
        if let Some(cpus) = self.cpus {
            lines.push(format!("#SBATCH --cpus-per-task={cpus}"));
        }
        if self.gpus > 0 {
            lines.push(format!("#SBATCH --gres=gpu:{}", self.gpus));
        }
        if self.device_memory > 0 {
            lines.push(format!(
                "# device memory: {} over the job's GPUs; choose GPUs with at least this (--constraint, --partition)",
                format_bytes(self.device_memory)
            ));
        }
        lines.join("\n")
    }

    /// A container's `resources` block: requests are what the run is expected to use, limits
    /// what it may use (MiB, rounded up); GPUs as `nvidia.com/gpu` in both, as Kubernetes wants.
    pub fn kubernetes(&self) -> String {
        let mut requests = vec![format!("    memory: {}Mi", mib(self.expected))];
        let mut limits = vec![format!("    memory: {}Mi", mib(self.memory))];
        if let Some(cpus) = self.cpus {
            requests.push(format!("    cpu: \"{cpus}\""));
        }
        if self.gpus > 0 {
            let gpus = format!("    nvidia.com/gpu: {}", self.gpus);
            requests.push(gpus.clone());
            limits.push(gpus);
        }
        let mut out = format!("resources:\n  requests:\n{}\n  limits:\n{}", requests.join("\n"), limits.join("\n"));
        if self.device_memory > 0 {
            out += &format!(
                "\n# device memory: {} over the pod's GPUs (a node selector picks GPUs with at least this)",
                format_bytes(self.device_memory)
            );
        }
        out
    }
}

/// Bytes as whole MiB, rounded up (a request is never under the plan).
fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Request {
        Request {
            mode: Mode::Staged,
            stage: "denoise".into(),
            memory: (1 << 30) + 1,
            expected: 900 << 20,
            gpus: 1,
            device_memory: 10 << 30,
            device_expected: 9 << 30,
            cpus: Some(4),
        }
    }

    #[test]
    fn ray_options_are_json_with_memory_in_bytes_and_device_memory_as_a_custom_resource() {
        let options: serde_json::Value = serde_json::from_str(&request().ray()).unwrap();
        assert_eq!(
            options,
            serde_json::json!({ "memory": (1u64 << 30) + 1, "num_cpus": 4, "num_gpus": 1,
                                "resources": { "device_memory_mib": 10240 } })
        );
        let host_only = Request { gpus: 0, device_memory: 0, cpus: None, ..request() };
        assert_eq!(host_only.ray(), format!("{{\"memory\":{}}}", (1u64 << 30) + 1));
    }

    #[test]
    fn slurm_memory_is_rounded_up_to_whole_mebibytes() {
        let lines = request().slurm();
        assert!(
            lines.starts_with(
                "#SBATCH --mem=1025M\n#SBATCH --cpus-per-task=4\n#SBATCH --gres=gpu:1\n# device memory: 10.0 GiB"
            ),
            "{lines}"
        );
    }

    #[test]
    fn kubernetes_requests_are_the_need_and_limits_the_need_with_its_reserve() {
        let block = request().kubernetes();
        assert!(
            block.starts_with(
                "resources:\n  requests:\n    memory: 900Mi\n    cpu: \"4\"\n    nvidia.com/gpu: 1\n  limits:\n    memory: 1025Mi\n    nvidia.com/gpu: 1"
            ),
            "{block}"
        );
    }
}
