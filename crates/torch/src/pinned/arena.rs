//! The host tier's registered arena: page-locked host memory registered with the driver in large
//! pieces, once, and sub-allocated to the tier's stores, so that a store after the first is only
//! the device → host copy (registering 1 GiB with `cudaHostRegister` takes 0.44 s on the H200
//! machine, the copy into registered pages 0.02 s: traces/gpu/README.md).
//!
//! Rules:
//!
//! 1. **Pieces, registered once.** Memory is registered a piece at a time ([`Registrar`]) and
//!    stays registered while the arena keeps the piece; every store that fits in the free ranges
//!    of the pieces it has registers nothing.
//! 2. **Each tensor its own range, best fit, largest first.** A store's tensors are placed
//!    largest first, each in the smallest free range of any piece that holds it (the lowest
//!    piece and offset among equals), aligned to [`ALIGN`]; a freed range joins its free
//!    neighbours (coalescing). A tensor-sized range, not one range per store, so that a store
//!    fills the holes others left (a smaller model in a larger one's piece leaves a tail the next
//!    larger model still uses), and the only holes that can stay unused are smaller than a
//!    tensor. Best fit, largest first, rather than first fit in order: on the cycles of the test
//!    below first fit left 8.5 % unused with models of equal tensors, best fit largest first 3.4 %
//!    (and 0.1 % with models' real mix of sizes); rather than size classes, which round every
//!    tensor up (up to 2× per tensor), which the waste bound (rule 4) does not allow. The tier
//!    stores a few models of hundreds of tensors each, so a scan of the free ranges costs
//!    microseconds against a copy of milliseconds.
//! 3. **Grown to fit, within the limits.** When a store's tensors do not all fit, the arena
//!    grows by one piece as large as what is left of the store, rounded up to a grain of at most
//!    1/64 of it ([`grain`]), and only where the pieces, with the new one, stay within the tier's
//!    budget and the new piece within what the machine has to give (`MemAvailable` bounded by the
//!    cgroup's headroom, less a reserve: [`Room`]); wholly free pieces are given back first
//!    where that makes the piece fit either. A store the arena cannot take (limits, or the registration
//!    failed) falls back to a buffer of its own, and the caller says why in its event; a failed
//!    registration leaves nothing registered and CUDA's last error cleared (the shim), so that
//!    the next kernel launch does not report it.
//! 4. **Waste bounded.** The bytes registered exceed the most the stores held at once by the
//!    grain of each growth (≤ 1/64 of the store that grew it) and the holes smaller than a
//!    tensor: over cycles of stores and withdrawals of models with the sizes models have (the
//!    test's transformers: layers of several widths, their norms and biases), at most 2 %
//!    (0.11 % measured); where every tensor of a model is one size and larger than the holes
//!    smaller models left, more (3.4 % in the same cycles).
//! 5. **Shrunk in whole pieces.** A piece goes back (unregistered and unmapped) only when
//!    nothing is placed in it: when the budget falls below what is registered, when the machine's
//!    room falls below the reserve, when a growth needs its room, or when the arena goes. Pieces
//!    that are free otherwise stay registered for the next store: that is the point of the arena.
//! 6. **One owner, no lock held while registering.** The bookkeeping ([`Book`], a pure type) is
//!    the arena's alone, behind one lock; registering and giving pieces back run with it let
//!    go (the bytes being registered are counted as pending meanwhile, so two growths never
//!    overrun the budget together).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// Every range starts at a multiple of this (as the block slots' offsets do,
/// [`crate::storage::aligned_offsets`]), so of every element size.
pub(crate) const ALIGN: u64 = 64;

/// The largest grain a piece is rounded up to (a huge page).
const MAX_GRAIN: u64 = 2 << 20;

/// The grain a piece for `bytes` is rounded up to: the largest power of two at most `bytes / 64`,
/// from `page` to 2 MiB, so that rounding adds at most 1/64 of the piece (or less than a page).
pub(crate) fn grain(bytes: u64, page: u64) -> u64 {
    let sixty_fourth = bytes / 64;
    let power = if sixty_fourth == 0 { 1 } else { 1u64 << (63 - sixty_fourth.leading_zeros()) };
    power.clamp(page.max(1), MAX_GRAIN.max(page))
}

fn aligned(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// Where one tensor of a store lies: its piece, its offset there, its bytes (aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) piece: u64,
    pub(crate) offset: u64,
    pub(crate) bytes: u64,
}

/// What the arena may hold now: the tier's budget, and what the machine can still give a new
/// piece beyond its reserve (`None`: not known, no bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) budget: u64,
    pub(crate) room: Option<u64>,
    /// The machine is under its reserve by this much (0 when not): whole free pieces go back.
    pub(crate) short: u64,
}

/// Why the arena does not take a store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
    /// A piece of `piece` bytes would take the registered bytes past the tier's budget.
    #[error("a piece of {} would take the registered host memory to {} (the tier's budget is {})", stageload_units::format_bytes(*.piece), stageload_units::format_bytes(*.total), stageload_units::format_bytes(*.budget))]
    Budget { piece: u64, total: u64, budget: u64 },
    /// The machine has less room than the piece beyond its reserve.
    #[error("a piece of {} is more than the machine can give beyond its reserve ({})", stageload_units::format_bytes(*.piece), stageload_units::format_bytes(*.room))]
    Room { piece: u64, room: u64 },
    /// The driver refused to register the piece (said by the registrar).
    #[error("registering {} of host memory failed: {why}", stageload_units::format_bytes(*.piece))]
    Register { piece: u64, why: String },
}

/// One registered piece's bookkeeping: its size and its free ranges (offset → bytes).
#[derive(Debug)]
struct PieceBook {
    id: u64,
    bytes: u64,
    free: BTreeMap<u64, u64>,
}

impl PieceBook {
    fn new(id: u64, bytes: u64) -> Self {
        PieceBook { id, bytes, free: BTreeMap::from([(0, bytes)]) }
    }

    fn wholly_free(&self) -> bool {
        self.free.get(&0) == Some(&self.bytes)
    }

    /// The first free range holding `bytes`: taken, its offset returned.
    fn take(&mut self, bytes: u64) -> Option<u64> {
        let (&offset, &len) = self.free.iter().find(|(_, &len)| len >= bytes)?;
        self.free.remove(&offset);
        if len > bytes {
            self.free.insert(offset + bytes, len - bytes);
        }
        Some(offset)
    }

    /// Takes `bytes` from the start of the free range at `offset`.
    fn take_at(&mut self, offset: u64, bytes: u64) {
        if let Some(len) = self.free.remove(&offset) {
            if len > bytes {
                self.free.insert(offset + bytes, len - bytes);
            }
        }
    }

    /// Gives `bytes` at `offset` back, joined with the free ranges beside it.
    fn give(&mut self, offset: u64, bytes: u64) {
        let (mut start, mut len) = (offset, bytes);
        if let Some((&before, &before_len)) = self.free.range(..offset).next_back() {
            if before + before_len == offset {
                self.free.remove(&before);
                start = before;
                len += before_len;
            }
        }
        if let Some(after_len) = self.free.remove(&(offset + bytes)) {
            len += after_len;
        }
        self.free.insert(start, len);
    }
}

/// The arena's bookkeeping, pure: pieces, their free ranges, the bytes registered, being
/// registered and placed. No memory of its own; [`Arena`] pairs it with the registered pieces.
#[derive(Debug)]
pub(crate) struct Book {
    pieces: Vec<PieceBook>,
    next_id: u64,
    registered: u64,
    pending: u64,
    placed: u64,
    page: u64,
}

/// A growth decided: the new piece's id and bytes (pending until [`Book::add`]), and the wholly
/// free pieces to give back first.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Growth {
    pub(crate) piece: u64,
    pub(crate) bytes: u64,
    pub(crate) give_back: Vec<u64>,
}

impl Book {
    /// An empty book; pieces are whole multiples of `page`.
    pub(crate) fn new(page: u64) -> Self {
        Book { pieces: Vec::new(), next_id: 0, registered: 0, pending: 0, placed: 0, page: page.max(1) }
    }

    /// Bytes registered (pieces the arena holds).
    #[cfg(test)]
    pub(crate) fn registered(&self) -> u64 {
        self.registered
    }

    /// Bytes placed (the stores' ranges, aligned).
    #[cfg(test)]
    pub(crate) fn placed(&self) -> u64 {
        self.placed
    }

    /// How many pieces are registered.
    #[cfg(test)]
    pub(crate) fn pieces(&self) -> usize {
        self.pieces.len()
    }

    /// Places every size it can (rule 2): a range per size, `None` where none fits.
    pub(crate) fn place(&mut self, sizes: &[u64]) -> Vec<Option<Range>> {
        // Largest first, each into the smallest free range that holds it.
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
        let mut ranges = vec![None; sizes.len()];
        for i in order {
            let bytes = aligned(sizes[i]);
            if bytes == 0 {
                continue;
            }
            let best = self
                .pieces
                .iter()
                .enumerate()
                .flat_map(|(p, piece)| {
                    piece.free.iter().filter(move |(_, &len)| len >= bytes).map(move |(&o, &len)| (len, p, o))
                })
                .min();
            if let Some((_, p, offset)) = best {
                let piece = &mut self.pieces[p];
                piece.take_at(offset, bytes);
                ranges[i] = Some(Range { piece: piece.id, offset, bytes });
                self.placed += bytes;
            }
        }
        ranges
    }

    /// Gives `ranges` back (rule 2's coalescing).
    pub(crate) fn free(&mut self, ranges: &[Range]) {
        for range in ranges {
            if let Some(piece) = self.pieces.iter_mut().find(|p| p.id == range.piece) {
                piece.give(range.offset, range.bytes);
                self.placed = self.placed.saturating_sub(range.bytes);
            }
        }
    }

    /// The piece that would hold `unplaced` (sizes that found no range), within `limits` (rule
    /// 3): its size, and the wholly free pieces to give back so that it fits the budget; the
    /// piece is pending until [`add`](Self::add) or [`abandon`](Self::abandon).
    pub(crate) fn grow(&mut self, unplaced: &[u64], limits: Limits) -> Result<Growth, Refused> {
        let need: u64 = unplaced.iter().map(|&s| aligned(s)).sum();
        let grain = grain(need, self.page);
        let bytes = need.div_ceil(grain).saturating_mul(grain).div_ceil(self.page).saturating_mul(self.page);
        // Wholly free pieces go back first where the budget or the machine's room needs it.
        let mut total = self.registered + self.pending + bytes;
        let (mut give_back, mut given) = (Vec::new(), 0u64);
        let short_of_room = |given: u64| limits.room.is_some_and(|room| room.saturating_add(given) < bytes);
        for piece in self.pieces.iter().filter(|p| p.wholly_free()) {
            if total <= limits.budget && !short_of_room(given) {
                break;
            }
            give_back.push(piece.id);
            total -= piece.bytes;
            given += piece.bytes;
        }
        if let Some(room) = limits.room.filter(|_| short_of_room(given)) {
            return Err(Refused::Room { piece: bytes, room });
        }
        if total > limits.budget {
            return Err(Refused::Budget { piece: bytes, total, budget: limits.budget });
        }
        for id in &give_back {
            self.remove(*id);
        }
        self.pending += bytes;
        let piece = self.next_id;
        self.next_id += 1;
        Ok(Growth { piece, bytes, give_back })
    }

    /// The pending piece `growth` is registered: it joins the book, and `unplaced` (the sizes
    /// it was grown for, in order) are placed in it.
    pub(crate) fn add(&mut self, growth: &Growth, unplaced: &[u64]) -> Vec<Range> {
        self.pending = self.pending.saturating_sub(growth.bytes);
        self.registered += growth.bytes;
        let mut piece = PieceBook::new(growth.piece, growth.bytes);
        let ranges = unplaced
            .iter()
            .map(|&size| {
                let bytes = aligned(size);
                let offset = piece.take(bytes).expect("a piece grown for these sizes holds them");
                Range { piece: growth.piece, offset, bytes }
            })
            .collect::<Vec<_>>();
        self.placed += ranges.iter().map(|r| r.bytes).sum::<u64>();
        self.pieces.push(piece);
        ranges
    }

    /// The pending piece `growth` was not registered: forgotten.
    pub(crate) fn abandon(&mut self, growth: &Growth) {
        self.pending = self.pending.saturating_sub(growth.bytes);
    }

    /// The wholly free pieces to give back under `limits` (rule 5): while the registered bytes
    /// are over the budget, or the machine is short of its reserve; removed from the book.
    pub(crate) fn trim(&mut self, limits: Limits) -> Vec<u64> {
        let mut short = limits.short;
        let mut gone = Vec::new();
        let free: Vec<(u64, u64)> = self.pieces.iter().filter(|p| p.wholly_free()).map(|p| (p.id, p.bytes)).collect();
        for (id, bytes) in free {
            if self.registered <= limits.budget && short == 0 {
                break;
            }
            self.remove(id);
            short = short.saturating_sub(bytes);
            gone.push(id);
        }
        gone
    }

    /// Every wholly free piece, removed from the book (the arena's owner lets them all go).
    #[cfg(test)]
    pub(crate) fn give_back_free(&mut self) -> Vec<u64> {
        let free: Vec<u64> = self.pieces.iter().filter(|p| p.wholly_free()).map(|p| p.id).collect();
        for id in &free {
            self.remove(*id);
        }
        free
    }

    fn remove(&mut self, id: u64) {
        if let Some(position) = self.pieces.iter().position(|p| p.id == id) {
            self.registered = self.registered.saturating_sub(self.pieces.remove(position).bytes);
        }
    }
}

/// Registers host memory with the device's driver: a piece that stays registered (and mapped)
/// until it is dropped. The real one is [`Registered`]; tests use a fake.
pub(crate) trait Registrar: Send + Sync + 'static {
    /// A registered piece.
    type Piece: Send + 'static;

    /// Registers a piece of `bytes` bytes (a multiple of the page size); why not, where the
    /// driver refuses (with nothing left registered, and the driver's error cleared).
    fn register(&self, bytes: u64) -> Result<Self::Piece, String>;
}

/// What the machine can give the arena, read when it grows or gives memory back.
pub(crate) trait Room: Send + Sync + 'static {
    /// The bytes a new piece may take (what the machine has beyond its reserve), and how far the
    /// machine is under its reserve; `None` where it cannot be read.
    fn read(&self) -> Option<(u64, u64)>;
}

/// The machine's room: `MemAvailable` bounded by the tightest cgroup's headroom
/// ([`stageload_probe::SystemMemory::budget_available`]), less a reserve of 1/16 of the memory
/// this process's world has (the cgroup's limit, else the machine's).
pub(crate) struct MachineRoom;

impl Room for MachineRoom {
    fn read(&self) -> Option<(u64, u64)> {
        let memory = stageload_probe::system_memory().ok()?;
        let reserve = memory.budget_total() / 16;
        let available = memory.budget_available();
        Some((available.saturating_sub(reserve), reserve.saturating_sub(available)))
    }
}

/// A store's ranges, given back to the arena when dropped (with the arena's pieces trimmed).
pub(crate) struct Lease<R: Registrar> {
    ranges: Vec<Range>,
    arena: Arc<Arena<R>>,
}

impl<R: Registrar> Lease<R> {
    /// The ranges, in the order of the sizes placed (`None` for a size of 0 bytes).
    pub(crate) fn ranges(&self) -> &[Range] {
        &self.ranges
    }
}

impl<R: Registrar> Drop for Lease<R> {
    fn drop(&mut self) {
        self.arena.free(&self.ranges);
    }
}

/// A registered piece, shared by the arena and the stores placed in it (behind a lock: a
/// libtorch tensor is not `Sync`; views of it are cut under the lock, in microseconds).
pub(crate) type Held<P> = Arc<Mutex<P>>;

/// A store placed: each size's range and piece (`None` for 0 bytes), and the lease that gives
/// the ranges back.
pub(crate) struct Placed<R: Registrar> {
    pub(crate) places: Vec<Option<(Held<R::Piece>, Range)>>,
    pub(crate) lease: Lease<R>,
}

/// The registered arena: [`Book`] under one lock, the registered pieces beside it.
pub(crate) struct Arena<R: Registrar> {
    registrar: R,
    room: Box<dyn Room>,
    state: Mutex<ArenaState<R>>,
}

struct ArenaState<R: Registrar> {
    book: Book,
    pieces: Vec<(u64, Held<R::Piece>)>,
    budget: u64,
}

impl<R: Registrar> Arena<R> {
    /// An empty arena registering with `registrar`, its room read from `room`, its pieces whole
    /// multiples of `page`, under a budget of 0 until [`set_budget`](Self::set_budget).
    pub(crate) fn new(registrar: R, room: Box<dyn Room>, page: u64) -> Arc<Self> {
        Arc::new(Arena {
            registrar,
            room,
            state: Mutex::new(ArenaState { book: Book::new(page), pieces: Vec::new(), budget: 0 }),
        })
    }

    fn limits(&self, budget: u64) -> Limits {
        let (room, short) = self.room.read().map_or((None, 0), |(room, short)| (Some(room), short));
        Limits { budget, room, short }
    }

    /// Bytes registered, and bytes placed.
    #[cfg(test)]
    pub(crate) fn usage(&self) -> (u64, u64) {
        let state = lock(&self.state);
        (state.book.registered(), state.book.placed())
    }

    /// How many pieces are registered.
    #[cfg(test)]
    pub(crate) fn pieces(&self) -> usize {
        lock(&self.state).book.pieces()
    }

    /// Sets the budget the pieces stay within; gives back wholly free pieces over it.
    pub(crate) fn set_budget(&self, budget: u64) {
        let limits = self.limits(budget);
        let gone = {
            let mut state = lock(&self.state);
            state.budget = budget;
            let ids = state.book.trim(limits);
            take_pieces(&mut state.pieces, &ids)
        };
        drop(gone);
    }

    /// Places tensors of `sizes` bytes (rules 2 and 3): registering one piece first where they
    /// do not all fit and the limits allow; refused (nothing placed) otherwise.
    pub(crate) fn place(self: &Arc<Self>, sizes: &[u64]) -> Result<Placed<R>, Refused> {
        let (mut ranges, growth, unplaced) = {
            let mut state = lock(&self.state);
            let ranges = state.book.place(sizes);
            let unplaced: Vec<u64> = sizes
                .iter()
                .zip(&ranges)
                .filter(|(&size, range)| range.is_none() && size > 0)
                .map(|(&size, _)| size)
                .collect();
            if unplaced.is_empty() {
                (ranges, None, unplaced)
            } else {
                let budget = state.budget;
                drop(state);
                let limits = self.limits(budget);
                let mut state = lock(&self.state);
                match state.book.grow(&unplaced, limits) {
                    Ok(growth) => {
                        let gone = take_pieces(&mut state.pieces, &growth.give_back);
                        drop(state);
                        drop(gone);
                        (ranges, Some(growth), unplaced)
                    }
                    Err(refused) => {
                        state.book.free(&ranges.iter().flatten().copied().collect::<Vec<_>>());
                        return Err(refused);
                    }
                }
            }
        };
        if let Some(growth) = growth {
            // Rule 6: registered with the lock let go; the piece is pending meanwhile.
            let registered = self.registrar.register(growth.bytes);
            let mut state = lock(&self.state);
            match registered {
                Ok(piece) => {
                    let mut added = state.book.add(&growth, &unplaced).into_iter();
                    for (range, &size) in ranges.iter_mut().zip(sizes) {
                        if range.is_none() && size > 0 {
                            *range = added.next();
                        }
                    }
                    state.pieces.push((growth.piece, Arc::new(Mutex::new(piece))));
                }
                Err(why) => {
                    state.book.abandon(&growth);
                    state.book.free(&ranges.iter().flatten().copied().collect::<Vec<_>>());
                    return Err(Refused::Register { piece: growth.bytes, why });
                }
            }
        }
        let state = lock(&self.state);
        let places = ranges
            .iter()
            .map(|range| {
                let range = (*range)?;
                let piece = state.pieces.iter().find(|(id, _)| *id == range.piece).map(|(_, p)| Arc::clone(p))?;
                Some((piece, range))
            })
            .collect();
        drop(state);
        let lease = Lease { ranges: ranges.into_iter().flatten().collect(), arena: Arc::clone(self) };
        Ok(Placed { places, lease })
    }

    /// Gives `ranges` back, then the wholly free pieces the limits no longer allow (rule 5).
    fn free(&self, ranges: &[Range]) {
        let budget = lock(&self.state).budget;
        let limits = self.limits(budget);
        let gone = {
            let mut state = lock(&self.state);
            state.book.free(ranges);
            let ids = state.book.trim(limits);
            take_pieces(&mut state.pieces, &ids)
        };
        drop(gone);
    }

    /// Gives back every wholly free piece (the tier closes, or is emptied).
    #[cfg(test)]
    pub(crate) fn give_back_free(&self) {
        let gone = {
            let mut state = lock(&self.state);
            let ids = state.book.give_back_free();
            take_pieces(&mut state.pieces, &ids)
        };
        drop(gone);
    }
}

/// The pieces of `ids`, taken out (for the caller to drop with the lock let go).
fn take_pieces<P>(pieces: &mut Vec<(u64, Held<P>)>, ids: &[u64]) -> Vec<Held<P>> {
    let mut gone = Vec::with_capacity(ids.len());
    pieces.retain(|(id, piece)| {
        let keep = !ids.contains(id);
        if !keep {
            gone.push(Arc::clone(piece));
        }
        keep
    });
    gone
}

/// The real registrar: a mapping of its own per piece, page-locked by `cudaHostRegister`
/// ([`stageload_torch_sys::registered_host_buffer`]), as a uint8 tensor the pieces' ranges are
/// views of; unregistered and unmapped when the piece and its last view go.
pub(crate) struct Registered;

impl Registrar for Registered {
    type Piece = tch::Tensor;

    fn register(&self, bytes: u64) -> Result<tch::Tensor, String> {
        let bytes = usize::try_from(bytes).map_err(|_| format!("{bytes} bytes: too large"))?;
        stageload_torch_sys::registered_host_buffer(bytes).map(|(tensor, _)| tensor).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    const PAGE: u64 = 4096;

    /// Counts what is registered now and how often; refuses when told.
    #[derive(Default)]
    struct FakeRegistrar {
        now: Arc<AtomicU64>,
        registrations: AtomicUsize,
        refuse: AtomicBool,
    }

    struct FakePiece {
        bytes: u64,
        now: Arc<AtomicU64>,
    }

    impl Drop for FakePiece {
        fn drop(&mut self) {
            self.now.fetch_sub(self.bytes, Ordering::SeqCst);
        }
    }

    impl Registrar for Arc<FakeRegistrar> {
        type Piece = FakePiece;

        fn register(&self, bytes: u64) -> Result<FakePiece, String> {
            assert!(bytes.is_multiple_of(PAGE), "pieces are whole pages");
            if self.refuse.load(Ordering::SeqCst) {
                return Err("out of memory (the fake)".into());
            }
            self.registrations.fetch_add(1, Ordering::SeqCst);
            self.now.fetch_add(bytes, Ordering::SeqCst);
            Ok(FakePiece { bytes, now: Arc::clone(&self.now) })
        }
    }

    /// The machine's room, set by the test: (room beyond the reserve, short of it).
    #[derive(Default)]
    struct FakeRoom(Reading);

    impl Room for FakeRoom {
        fn read(&self) -> Option<(u64, u64)> {
            *self.0.lock().unwrap()
        }
    }

    /// The room a test sets: (room beyond the reserve, short of it).
    type Reading = Arc<Mutex<Option<(u64, u64)>>>;

    fn arena(budget: u64) -> (Arc<Arena<Arc<FakeRegistrar>>>, Arc<FakeRegistrar>, Reading) {
        let registrar = Arc::new(FakeRegistrar::default());
        let room = FakeRoom::default();
        let reading = Arc::clone(&room.0);
        let arena = Arena::new(Arc::clone(&registrar), Box::new(room), PAGE);
        arena.set_budget(budget);
        (arena, registrar, reading)
    }

    /// A model of `bytes`: tensors of 1/16 of it and small ones beside them (weights and biases).
    fn model(bytes: u64) -> Vec<u64> {
        let mut sizes = Vec::new();
        for _ in 0..16 {
            sizes.push(bytes / 16 - 4096);
            sizes.push(4096);
        }
        sizes
    }

    /// A transformer of `layers` layers of width `d` in f16: per layer the attention's four
    /// projections, the MLP's two, two norms and the biases, then the embedding of `vocab` rows.
    fn transformer(layers: u64, d: u64, vocab: u64) -> Vec<u64> {
        let mut sizes = Vec::new();
        for _ in 0..layers {
            sizes.extend([3 * d * d * 2, 3 * d * 2, d * d * 2, d * 2, 4 * d * d * 2, 4 * d * 2, 4 * d * d * 2, d * 2]);
            sizes.extend([d * 2, d * 2, d * 2, d * 2]);
        }
        sizes.push(vocab * d * 2);
        sizes
    }

    #[test]
    fn a_store_that_fits_registers_nothing_and_a_freed_store_leaves_its_piece_registered_for_the_next() {
        let (arena, registrar, _) = arena(4 * GIB);
        let first = arena.place(&model(GIB)).unwrap();
        assert_eq!(registrar.registrations.load(Ordering::SeqCst), 1, "one piece for the first store");
        assert_eq!(arena.pieces(), 1);
        drop(first);
        assert_eq!(arena.usage(), (GIB, 0), "free, still registered");
        let again = arena.place(&model(GIB)).unwrap();
        let smaller = arena.place(&model(256 * MIB));
        assert_eq!(
            registrar.registrations.load(Ordering::SeqCst),
            2,
            "the same model again: nothing; the other: a piece"
        );
        drop((again, smaller));
        let half = arena.place(&model(512 * MIB)).unwrap();
        let quarter = arena.place(&model(256 * MIB)).unwrap();
        assert_eq!(registrar.registrations.load(Ordering::SeqCst), 2, "smaller models fill the pieces there are");
        drop((half, quarter));
    }

    #[test]
    fn ranges_never_overlap_are_aligned_and_lie_inside_their_piece() {
        let (arena, _, _) = arena(GIB);
        let sizes = [100, 0, 64, 65, 4096, 3 * MIB + 7, 1];
        let placed = arena.place(&sizes).unwrap();
        assert!(placed.places[1].is_none(), "no range for 0 bytes");
        let mut ranges: Vec<Range> = placed.places.iter().flatten().map(|(_, r)| *r).collect();
        for (range, &size) in placed.places.iter().zip(&sizes).filter_map(|(p, s)| Some((p.as_ref()?.1, s))) {
            assert!(range.bytes >= size && range.offset % ALIGN == 0, "{range:?} for {size}");
        }
        ranges.sort_by_key(|r| (r.piece, r.offset));
        for pair in ranges.windows(2) {
            assert!(pair[0].piece != pair[1].piece || pair[0].offset + pair[0].bytes <= pair[1].offset, "{pair:?}");
        }
        let (registered, placed_bytes) = arena.usage();
        assert!(ranges.iter().all(|r| r.offset + r.bytes <= registered), "inside the one piece");
        assert_eq!(placed_bytes, ranges.iter().map(|r| r.bytes).sum::<u64>());
    }

    #[test]
    fn pieces_grow_and_shrink_within_the_budget_and_the_machines_room() {
        let (arena, registrar, room) = arena(2 * GIB);
        let a = arena.place(&model(GIB)).unwrap();
        let b = arena.place(&model(GIB)).unwrap();
        let refused = arena.place(&model(256 * MIB)).err().unwrap();
        assert!(matches!(refused, Refused::Budget { budget, .. } if budget == 2 * GIB), "{refused}");
        assert_eq!(registrar.now.load(Ordering::SeqCst), 2 * GIB, "never past the budget");
        drop(a);
        // Room for the store in the free piece: no growth needed, so the budget is no bar.
        let c = arena.place(&model(256 * MIB)).unwrap();
        drop(c);
        // The budget shrinks: the wholly free piece goes, the one in use stays.
        arena.set_budget(GIB);
        assert_eq!((arena.pieces(), registrar.now.load(Ordering::SeqCst)), (1, GIB));
        drop(b);
        assert_eq!(arena.pieces(), 1, "free, and within the budget: kept");
        // The machine runs short of its reserve: a store that fits the free piece is taken, and
        // when it goes, the piece goes back whole.
        *room.lock().unwrap() = Some((0, MIB));
        drop(arena.place(&model(64 * MIB)).unwrap());
        assert_eq!((arena.pieces(), registrar.now.load(Ordering::SeqCst)), (0, 0));
        // No room for a piece beyond the reserve: refused, nothing registered.
        *room.lock().unwrap() = Some((100 * MIB, 0));
        let refused = arena.place(&model(GIB)).err().unwrap();
        assert!(matches!(refused, Refused::Room { room, .. } if room == 100 * MIB), "{refused}");
        assert_eq!(registrar.now.load(Ordering::SeqCst), 0);
        assert!(arena.place(&model(64 * MIB)).is_ok(), "a piece within the room");
    }

    #[test]
    fn a_growth_over_the_budget_gives_wholly_free_pieces_back_first() {
        let (arena, registrar, _) = arena(GIB + 512 * MIB);
        drop((arena.place(&model(512 * MIB)).unwrap(), arena.place(&model(GIB)).unwrap()));
        assert_eq!((arena.pieces(), registrar.now.load(Ordering::SeqCst)), (2, GIB + 512 * MIB), "both kept");
        // A tensor larger than either piece: both go back before its piece is registered.
        let large = arena.place(&[GIB + 256 * MIB]).unwrap();
        assert_eq!((arena.pieces(), registrar.now.load(Ordering::SeqCst)), (1, GIB + 256 * MIB));
        drop(large);
    }

    #[test]
    fn a_failed_registration_places_nothing_and_leaves_the_arena_as_it_was() {
        let (arena, registrar, _) = arena(4 * GIB);
        let kept = arena.place(&model(256 * MIB)).unwrap();
        let before = arena.usage();
        registrar.refuse.store(true, Ordering::SeqCst);
        let refused = arena.place(&model(GIB)).err().unwrap();
        assert!(matches!(&refused, Refused::Register { why, .. } if why.contains("the fake")), "{refused}");
        assert_eq!(arena.usage(), before, "the ranges placed before the growth were given back");
        registrar.refuse.store(false, Ordering::SeqCst);
        let next = arena.place(&model(GIB));
        assert!(next.is_ok(), "the next store grows the arena as usual");
        drop((kept, next));
    }

    #[test]
    fn freeing_returns_whole_pieces_never_part_of_one() {
        let (arena, registrar, room) = arena(4 * GIB);
        let a = arena.place(&model(GIB)).unwrap();
        let b = arena.place(&model(GIB)).unwrap();
        *room.lock().unwrap() = Some((0, 4 * GIB));
        drop(a);
        assert_eq!(registrar.now.load(Ordering::SeqCst), GIB, "a's piece went back whole, at once");
        // b's piece partly freed: nothing goes back while a range in it is placed.
        let Placed { places, lease } = b;
        drop(places);
        let mut book = Book::new(PAGE);
        let growth = book.grow(&[GIB / 2, GIB / 2], Limits { budget: 4 * GIB, room: None, short: 0 }).unwrap();
        let halves = book.add(&growth, &[GIB / 2, GIB / 2]);
        book.free(&halves[..1]);
        assert!(book.trim(Limits { budget: 0, room: None, short: GIB }).is_empty(), "half placed: kept");
        book.free(&halves[1..]);
        assert_eq!(book.trim(Limits { budget: 0, room: None, short: GIB }), [growth.piece]);
        assert_eq!(book.registered(), 0);
        drop(lease);
        assert_eq!(registrar.now.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn freed_neighbours_join_so_a_tensor_as_large_as_both_fits_where_they_were() {
        let mut book = Book::new(PAGE);
        let limits = Limits { budget: GIB, room: None, short: 0 };
        let growth = book.grow(&[64 * MIB; 3], limits).unwrap();
        let thirds = book.add(&growth, &[64 * MIB; 3]);
        book.free(&[thirds[0], thirds[1]]);
        let joined = book.place(&[128 * MIB]);
        assert_eq!(joined, [Some(Range { piece: growth.piece, offset: 0, bytes: 128 * MIB })]);
    }

    #[test]
    fn the_registered_bytes_stay_within_2_percent_of_the_most_the_stores_held_at_once() {
        // A cascade's models, stored when released and withdrawn when reloaded, in the orders
        // of its stages, several rounds; and a model seen the first time between rounds.
        let (arena, registrar, _) = arena(16 * GIB);
        let models: Vec<Vec<u64>> = vec![
            transformer(24, 2048, 32_000),
            transformer(12, 1024, 49_408),
            transformer(32, 2560, 32_000),
            transformer(6, 768, 30_522),
            transformer(16, 1536, 0),
            model(5 * MIB + 123),
        ];
        let rounds: [&[&[usize]]; 4] = [
            &[&[0, 1], &[2], &[3, 4], &[5]],
            &[&[2, 3], &[0], &[1, 4, 5]],
            &[&[0, 1, 2, 3, 4, 5]],
            &[&[4], &[3], &[2], &[1], &[0], &[5]],
        ];
        let mut held: Vec<Option<Placed<Arc<FakeRegistrar>>>> = (0..models.len()).map(|_| None).collect();
        let mut most_held = 0u64;
        let mut worst = 0f64;
        for (round, stages) in rounds.iter().enumerate() {
            for stage in stages.iter() {
                // The stage's models come back (withdrawn), the others are stored when released.
                for (m, copy) in held.iter_mut().enumerate() {
                    if stage.contains(&m) {
                        *copy = None;
                    } else if copy.is_none() {
                        *copy = Some(arena.place(&models[m]).unwrap());
                    }
                    let live: u64 = arena.usage().1;
                    most_held = most_held.max(live);
                    let registered = registrar.now.load(Ordering::SeqCst);
                    worst = worst.max(registered as f64 / most_held.max(1) as f64);
                }
            }
            assert!(worst <= 1.02, "round {round}: registered {worst:.4}× the most held at once");
        }
        drop(held);
        arena.give_back_free();
        assert_eq!(registrar.now.load(Ordering::SeqCst), 0, "everything back once the stores are gone");
    }

    #[test]
    fn a_grain_is_at_most_a_sixty_fourth_of_the_piece_and_whole_pages() {
        assert_eq!(grain(GIB, PAGE), 2 * MIB);
        assert_eq!(grain(64 * MIB, PAGE), MIB);
        assert_eq!(grain(100 * MIB, PAGE), MIB, "a power of two at most 1/64");
        assert_eq!(grain(10_000, PAGE), PAGE);
        assert_eq!(grain(0, PAGE), PAGE);
        for bytes in [1, 4095, 4097, 65 * MIB + 3, 3 * GIB + 1] {
            let g = grain(bytes, PAGE);
            assert!(g.is_multiple_of(PAGE) && (g <= bytes / 64 || g == PAGE), "{bytes}: {g}");
        }
    }
}
