//! Reads beside a computation: a streamed model's refills without the streaming, for the floor
//! a streamed flow cannot go below on a machine whose cores the reads share with the compute.

use std::collections::HashMap;
use std::path::Path;
use std::sync::mpsc;
use std::thread::JoinHandle;

use stageload::checkpoint::Checkpoint;
use stageload::BoxError;
use tch::{Device, Tensor};

/// Reads blocks of a checkpoint on a thread of its own while the caller computes, the way an
/// uncached streamed refill reads one (`Checkpoint::load_into` into two slots' tensors in turn,
/// then, when `uncached`, `Checkpoint::drop_cached`). Nothing waits for these reads: a resident
/// model's flow with the same bytes read beside it is the least time a streamed flow reading them
/// through the same path can take here.
pub struct ReadsBeside {
    requests: Option<mpsc::Sender<usize>>,
    reader: Option<JoinHandle<Result<u64, BoxError>>>,
}

impl ReadsBeside {
    /// Opens `path`, whose block `i` is every entry named `{prefix}.{i}.*`, and starts the reader.
    pub fn start(path: &Path, prefix: &str, uncached: bool) -> Result<Self, BoxError> {
        let checkpoint = Checkpoint::open(&[path])?.host_reads(stageload::stream::REFILL_READS);
        let file = path.display().to_string();
        let prefix = format!("{prefix}.");
        let (requests, received) = mpsc::channel::<usize>();
        let reader = std::thread::Builder::new().name("reads-beside".into()).spawn(move || {
            let _no_grad = tch::no_grad_guard();
            // The two slots, each tensor under its name inside a block.
            let mut slots: [HashMap<String, Tensor>; 2] = Default::default();
            let mut bytes = 0u64;
            for (turn, block) in received.into_iter().enumerate() {
                let inside = format!("{prefix}{block}.");
                let slot = &mut slots[turn % 2];
                let targets: Vec<(String, Tensor)> = checkpoint
                    .entries()
                    .iter()
                    .filter_map(|(name, entry)| Some((name, entry, name.strip_prefix(&inside)?)))
                    .map(|(name, entry, within)| {
                        let tensor = slot
                            .entry(within.to_string())
                            .or_insert_with(|| Tensor::empty(entry.shape.as_slice(), (entry.kind, Device::Cpu)));
                        (name.clone(), tensor.shallow_clone())
                    })
                    .collect();
                if targets.is_empty() {
                    return Err(format!("{file}: no tensor named {inside}*").into());
                }
                bytes += checkpoint.load_into(&targets, |_| {})?.bytes;
                if uncached {
                    checkpoint.drop_cached(targets.iter().map(|(name, _)| name.as_str()))?;
                }
            }
            Ok(bytes)
        })?;
        Ok(Self { requests: Some(requests), reader: Some(reader) })
    }

    /// Asks for block `block` to be read (after those asked for before).
    pub fn read(&self, block: usize) {
        if let Some(requests) = &self.requests {
            // A reader that has stopped has an error for `finish` to return.
            let _ = requests.send(block);
        }
    }

    /// Waits for every block asked for; the bytes read.
    pub fn finish(mut self) -> Result<u64, BoxError> {
        match self.stop() {
            Some(Ok(read)) => read,
            Some(Err(_)) => Err("the reads beside the flow panicked".into()),
            None => Ok(0),
        }
    }

    /// Tells the reader no more blocks come and waits for it (once).
    fn stop(&mut self) -> Option<std::thread::Result<Result<u64, BoxError>>> {
        self.requests = None;
        self.reader.take().map(JoinHandle::join)
    }
}

impl Drop for ReadsBeside {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
