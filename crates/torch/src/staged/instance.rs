//! One built model object and the ways users reach it: [`Handle`] (cheap, typed, survives
//! releases and reports them) and [`ModelGuard`] (the model, locked, mutable).
//!
//! An instance has three locks, taken in this order and never the other way: `body` (the model
//! itself; held by a user for as long as a guard lives), then the registry's state lock, then
//! `ctl` or `weights` (bookkeeping, held for a few statements); `registry.rs` gives the whole
//! order. A release never waits for `body`: it tries it, and when a user holds it the release
//! is left to that user's guard, which frees the storages as it drops and hands the release
//! back through the `Registry` trait. The release mark in `ctl` is the registry's to write,
//! derived from the slot's state (see `decide.rs`).

use std::any::{Any, TypeId};
use std::collections::HashSet;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};
use std::thread::ThreadId;

use tch::Tensor;

use super::decide::ReleaseMark;
use super::error::{Result, StageError};
use super::mapped::HeldFiles;
use super::spec::Built;
use crate::storage::{self, StorageRecord};
use crate::sync::lock;

/// What an instance needs of the registry that made it: a release that found the model locked
/// is left to whoever unlocks it, who hands it back here. The registry (`registry.rs`)
/// implements it, so this file names no registry type and the registry's files depend on this
/// one, not the other way.
pub(crate) trait Registry: Send + Sync {
    /// Carries out the release of `instance` that was left to the thread unlocking it.
    fn release_left_to_unlock(&self, instance: &Arc<Instance>);
}

pub(crate) struct Ctl {
    /// Written by the registry only: derived from the state the instance's slot takes
    /// (`State::set_state`), and a release's claim ([`ReleaseMark::claim`]).
    pub(crate) mark: ReleaseMark,
    holder: Option<ThreadId>,
}

/// The named tensors of a model and their distinct storages.
pub(crate) struct Weights {
    pub(crate) tensors: Vec<(String, Tensor)>,
    pub(crate) storages: Vec<StorageRecord>,
}

/// One built model object, shared by every handle to it.
pub(crate) struct Instance {
    pub(crate) name: String,
    pub(crate) type_id: TypeId,
    pub(crate) type_name: &'static str,
    /// (identity, bytes) of each distinct storage: fixed at creation and read without any lock.
    pub(crate) storage_sizes: Vec<(u64, u64)>,
    /// (identity, bytes) of the storages a release keeps resident: those of tensors no refill
    /// source holds (a lenient checkpoint's missing tensors, such as non-persistent buffers).
    /// Fixed at creation.
    pub(crate) kept: Vec<(u64, u64)>,
    pub(crate) body: Mutex<Box<dyn Any + Send>>,
    pub(crate) weights: Mutex<Weights>,
    pub(crate) ctl: Mutex<Ctl>,
    /// The registry, for a guard that must carry out a release left to it.
    pub(crate) registry: Weak<dyn Registry>,
    /// The files whose pages it may hold (a model that maps, on the CPU): checked before each
    /// hand-out ([`super::mapped`], rule 4). Fixed at creation.
    pub(crate) held: Option<HeldFiles>,
}

impl Instance {
    /// The instance of a model `built`, whose tensors named in `unrefillable` keep their
    /// storages resident through releases, and that may hold the pages of the `held` files.
    pub(crate) fn new(
        name: &str,
        built: Built,
        unrefillable: &[String],
        registry: Weak<dyn Registry>,
        held: Option<HeldFiles>,
    ) -> Result<Arc<Self>> {
        let Built { model, type_id, type_name, tensors } = built;
        let torch = |source| StageError::Torch { model: name.to_string(), source };
        let storages = storage::distinct_storages(&tensors).map_err(torch)?;
        let unrefillable: HashSet<&str> = unrefillable.iter().map(String::as_str).collect();
        let unrefillable: Vec<(String, Tensor)> =
            storage::shallow(&tensors).into_iter().filter(|(n, _)| unrefillable.contains(n.as_str())).collect();
        let kept = storage::distinct_storages(&unrefillable).map_err(torch)?;
        Ok(Arc::new(Instance {
            name: name.to_string(),
            type_id,
            type_name,
            storage_sizes: storages.iter().map(|s| (s.id, s.nbytes as u64)).collect(),
            kept: kept.iter().map(|s| (s.id, s.nbytes as u64)).collect(),
            body: Mutex::new(model),
            weights: Mutex::new(Weights { tensors, storages }),
            ctl: Mutex::new(Ctl { mark: ReleaseMark::Live, holder: None }),
            registry,
            held,
        }))
    }

    pub(crate) fn mark(&self) -> ReleaseMark {
        lock(&self.ctl).mark.clone()
    }

    pub(crate) fn storage_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.storage_sizes.iter().map(|(id, _)| *id)
    }

    /// Takes the body without waiting: `None` when any thread holds it.
    pub(crate) fn try_body(&self) -> Option<MutexGuard<'_, Box<dyn Any + Send>>> {
        match self.body.try_lock() {
            Ok(body) => Some(body),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Unlocks the body, then carries out a release that found it locked and was left to
    /// whoever unlocks it.
    pub(crate) fn unlock(self: &Arc<Self>, body: MutexGuard<'_, Box<dyn Any + Send>>) {
        drop(body);
        let requested = matches!(lock(&self.ctl).mark, ReleaseMark::Requested(_));
        if requested {
            if let Some(registry) = self.registry.upgrade() {
                registry.release_left_to_unlock(self);
            }
        }
    }

    /// The checked typed handle: [`StageError::WrongType`] unless the model is an `M`.
    pub(crate) fn handle<M: 'static>(self: &Arc<Self>) -> Result<Handle<M>> {
        if self.type_id != TypeId::of::<M>() {
            return Err(StageError::WrongType {
                model: self.name.clone(),
                expected: std::any::type_name::<M>(),
                actual: self.type_name,
            });
        }
        Ok(Handle { instance: Arc::clone(self), _model: PhantomData })
    }
}

/// A typed handle to a model. Cheap to clone; it stays valid across releases and reports them.
pub struct Handle<M> {
    instance: Arc<Instance>,
    _model: PhantomData<fn() -> M>,
}

impl<M> Clone for Handle<M> {
    fn clone(&self) -> Self {
        Handle { instance: Arc::clone(&self.instance), _model: PhantomData }
    }
}

impl<M: 'static> Handle<M> {
    /// The model's name in the registry.
    pub fn name(&self) -> &str {
        &self.instance.name
    }

    /// Whether the model was released (and not brought back).
    pub fn is_released(&self) -> bool {
        self.instance.mark() != ReleaseMark::Live
    }

    /// Locks the model for use; [`StageError::Released`] once it was released. While the guard
    /// lives, a stage entry that releases the model leaves the release to the guard, which
    /// frees the weights when it drops. Waits while another thread holds the model.
    pub fn lock(&self) -> Result<ModelGuard<'_, M>> {
        let instance = &self.instance;
        let body = match instance.try_body() {
            Some(body) => body,
            None => {
                if lock(&instance.ctl).holder == Some(std::thread::current().id()) {
                    return Err(StageError::LockedTwice { model: instance.name.clone() });
                }
                lock(&instance.body)
            }
        };
        let mut ctl = lock(&instance.ctl);
        if let Some(stage) = ctl.mark.stage() {
            drop(ctl);
            instance.unlock(body);
            return Err(StageError::Released { model: instance.name.clone(), stage });
        }
        ctl.holder = Some(std::thread::current().id());
        drop(ctl);
        Ok(ModelGuard { body: Some(body), instance, _model: PhantomData })
    }

    /// Shallow copies of the model's named tensors (they share its storages). Never waits for a
    /// user of the model.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        crate::storage::shallow(&lock(&self.instance.weights).tensors)
    }
}

/// The model, locked for use. Dereferences to it, mutably too.
pub struct ModelGuard<'a, M> {
    body: Option<MutexGuard<'a, Box<dyn Any + Send>>>,
    instance: &'a Arc<Instance>,
    _model: PhantomData<fn() -> M>,
}

impl<M: 'static> std::ops::Deref for ModelGuard<'_, M> {
    type Target = M;
    fn deref(&self) -> &M {
        let body = self.body.as_ref().expect("the body is held until drop");
        body.downcast_ref::<M>().expect("the type was checked when the handle was made")
    }
}

impl<M: 'static> std::ops::DerefMut for ModelGuard<'_, M> {
    fn deref_mut(&mut self) -> &mut M {
        let body = self.body.as_mut().expect("the body is held until drop");
        body.downcast_mut::<M>().expect("the type was checked when the handle was made")
    }
}

impl<M> Drop for ModelGuard<'_, M> {
    fn drop(&mut self) {
        lock(&self.instance.ctl).holder = None;
        if let Some(body) = self.body.take() {
            self.instance.unlock(body);
        }
    }
}
