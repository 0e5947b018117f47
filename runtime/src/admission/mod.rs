//! Memory admission: a card, or the host's CPU lanes, takes a task only when it has the
//! memory for it.
//!
//! sdk-core asks a lane's slot supplier for a permit before every poll. Each card has one
//! [`MemoryBudget`], shared by all its lanes (the shared `gpu-tools` queue, the card's
//! private queue, model queues), and each lane a [`LaneSlots`] supplier drawing on it. The
//! CPU lanes share one budget of the host's memory (`sysinfo`, within its cgroup's limit),
//! built the same way with two differences: the host also keeps room for the tokenizations
//! that may run at once (a `reserve`), and a task's waiting cost includes its input text,
//! which the host holds while the task runs.
//!
//! Memory is modelled the way the device really uses it:
//! - **weights** once per loaded model;
//! - **one working set per engine** that has work: each (card, model) engine runs one
//!   forward pass at a time, so however many activities wait, the card's peak is one
//!   batch per busy engine (`--vram-cost` or the cost formula, raised by out-of-memory
//!   errors and lowered again after a run of successes);
//! - **waiting rows** per admitted task, at their own small cost (token ids and masks);
//! - on the host, the **tokenizing reserve**;
//! - **headroom**, never promised.
//!
//! Other tenants' use is what the reading shows beyond this process's own (NVML's
//! per-process figure, or a simulated card's accounting), so memory that running work
//! already holds is not charged twice. The check for one more task is
//!
//! ```text
//! total - headroom - others - max(own now, weights + reserve + busy working sets)
//!       - waiting rows  >=  rows of one task + the largest idle engine's working set
//! ```
//!
//! and fewer than `cap` tasks run. A running task whose engine is not known yet (its
//! input is still being read and tokenized, or a dataset job is between chunks) keeps an
//! engine it could use promised. **Idle polls hold nothing**: a permit is only charged
//! when a task arrives on it (`mark_slot_used`). Each lane may always keep one poll open
//! while the card has room for one task, so one lane's idle polls never starve the other
//! (a pinned follow-up's private queue, or the shared one); a lane's further polls need
//! room for every poll open. The price: when tasks arrive on several lanes at once, the
//! card can run up to one task per extra lane beyond its cap or room for a moment. Tasks
//! for the same engine only queue in it (it runs one pass at a time); tasks that land on
//! different engines need a working set each, so on a card serving several models that
//! moment can over-commit, which an out-of-memory error (retryable, and raising the
//! estimate) answers. Without a permit the lane does not poll, so the task waits in
//! Temporal (visible as backlog) where another card or host can take it.

mod slots;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_host;

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use gpulane_models::EngineLoad;
use tokio::sync::Notify;

pub(crate) use slots::{LaneSlots, PollGate};

use crate::{
    devices::{DeviceError, DeviceInventory, HostMemory},
    metrics::Metrics,
};

/// Successes of an engine after which an estimate raised by out-of-memory errors moves
/// halfway back to its base.
const DECAY_AFTER: u32 = 32;

/// Smallest step of an estimate raised by an out-of-memory error.
const OOM_STEP: u64 = 64 << 20;

/// One engine of the card, as admission counts it.
#[derive(Clone)]
pub(crate) struct EngineCost {
    /// The model's served name.
    pub model: String,
    /// The activity types it serves (an embedder: `embed`, `embed_dataset`).
    pub serves: Vec<String>,
    /// Working memory of one forward pass at its largest batch.
    pub working: u64,
    /// Whether it has work now (then its working set counts).
    pub load: EngineLoad,
}

/// Whose memory a budget holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BudgetOf {
    /// A card, by UUID.
    Card(String),
    /// The host, for the CPU lanes.
    Host,
}

impl std::fmt::Display for BudgetOf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BudgetOf::Card(uuid) => write!(f, "card {uuid}"),
            BudgetOf::Host => f.write_str("host memory"),
        }
    }
}

/// How a budget is set.
#[derive(Clone)]
pub(crate) struct BudgetOptions {
    /// Bytes never promised to tasks, left for other tenants and allocator slack.
    pub headroom: u64,
    /// Most tasks running at once over the card's lanes.
    pub cap: usize,
    /// The weights of every model on the device, counted once.
    pub weights: u64,
    /// Bytes kept for work besides forward passes that may run at any time: on the host,
    /// the tokenizing slots' peak; 0 on a card.
    pub reserve: u64,
    /// Whether a reading holds the weights when no per-process figure says what this
    /// process holds: true on a real card once loaded; false in `gpulane admission`,
    /// which loads nothing on the card.
    pub weights_in_reading: bool,
    pub engines: Vec<EngineCost>,
    /// Per task, by activity type: its rows waiting in an engine's queue.
    pub waiting_rows: HashMap<String, u64>,
}

struct EngineState {
    cost: EngineCost,
    /// The working-set estimate now (`cost.working`, or more after out-of-memory errors).
    estimate: u64,
    /// Successes since the estimate was last raised or lowered.
    successes: u32,
}

impl EngineState {
    fn busy(&self) -> bool {
        self.cost.load.rows() > 0
    }

    fn serves(&self, activity_type: &str) -> bool {
        self.cost.serves.iter().any(|a| a == activity_type)
    }
}

struct State {
    /// The last memory reading: free bytes, or why it failed (then nothing is admitted).
    free: Result<u64, String>,
    /// What this process held on the card at the last reading, when known.
    own: Option<u64>,
    /// Tasks running (permits that received a task and are not yet released).
    running: usize,
    /// The same, by activity type.
    running_by_type: HashMap<String, usize>,
    /// The waiting-rows cost of the running tasks.
    waiting: u64,
    engines: Vec<EngineState>,
    /// Per active lane supplier (one per lane worker), its open polls (permits without a
    /// task yet). A stopped lane's supplier is removed, so it is not waited for, and its
    /// late releases do not touch its successor's count.
    idle: HashMap<u64, usize>,
    /// Lanes announced but whose supplier does not exist yet (start-up): they count as
    /// lanes without a poll.
    expected: HashSet<String>,
    next_supplier: u64,
}

/// A card's budget at one moment.
#[derive(Debug, Clone)]
pub(crate) struct BudgetSnapshot {
    pub total: u64,
    pub free: Result<u64, String>,
    /// Committed to running work: busy engines' working sets and waiting rows.
    pub reserved: u64,
    pub headroom: u64,
    pub weights: u64,
    /// Kept for tokenizing (the host); 0 on a card.
    pub reserve: u64,
    /// Other tenants' use, from the last reading.
    pub others: Option<u64>,
    pub running: usize,
    pub idle_polls: usize,
    pub cap: usize,
    /// Working-set estimate by model.
    pub estimates: std::collections::BTreeMap<String, u64>,
    /// The largest working-set estimate of the models serving each activity type.
    pub by_activity: std::collections::BTreeMap<String, u64>,
    /// Waiting-rows cost by activity type.
    pub waiting_rows: std::collections::BTreeMap<String, u64>,
}

/// Why a poll could not be granted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    Memory,
    Cap,
    NoReading,
}

/// One device's admission budget, shared by its lanes.
pub(crate) struct MemoryBudget {
    of: BudgetOf,
    total: u64,
    opts: BudgetOptions,
    state: Mutex<State>,
    changed: Notify,
    metrics: Arc<Metrics>,
}

impl MemoryBudget {
    /// A budget for `of`, of `total` bytes. Nothing is admitted until the first memory
    /// reading ([`MemoryBudget::set_reading`]).
    pub(crate) fn new(
        of: BudgetOf,
        total: u64,
        opts: BudgetOptions,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let engines = opts
            .engines
            .iter()
            .map(|c| EngineState {
                cost: c.clone(),
                estimate: c.working,
                successes: 0,
            })
            .collect();
        Arc::new(Self {
            of,
            total,
            opts,
            state: Mutex::new(State {
                free: Err("no memory reading yet".to_owned()),
                own: None,
                running: 0,
                running_by_type: HashMap::new(),
                waiting: 0,
                engines,
                idle: HashMap::new(),
                expected: HashSet::new(),
                next_supplier: 0,
            }),
            changed: Notify::new(),
            metrics,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("card budget lock poisoned; this is a bug")
    }

    /// Which engines count their working set now: every engine with work, and for each
    /// activity type with `n` running tasks, the `n` largest other engines serving it. A
    /// task's engine shows work only once its input is read and tokenized (and a dataset
    /// job's between its chunks not at all), and which engine it will use is unknown until
    /// then, so every engine it could use stays promised. On a card with one model per
    /// kind that is exactly the model's working set; with several, it is cautious.
    fn committed_engines(s: &State) -> Vec<bool> {
        let mut committed: Vec<bool> = s.engines.iter().map(EngineState::busy).collect();
        for (activity, n) in &s.running_by_type {
            let mut could: Vec<usize> = (0..s.engines.len())
                .filter(|&i| !committed[i] && s.engines[i].serves(activity))
                .collect();
            could.sort_by_key(|&i| std::cmp::Reverse(s.engines[i].estimate));
            for i in could.into_iter().take(*n) {
                committed[i] = true;
            }
        }
        committed
    }

    /// The committed engines' working sets.
    fn committed(s: &State) -> u64 {
        Self::working_of(s, &Self::committed_engines(s))
    }

    /// The working sets of the engines marked in `committed`.
    fn working_of(s: &State, committed: &[bool]) -> u64 {
        committed
            .iter()
            .zip(&s.engines)
            .filter(|(c, _)| **c)
            .map(|(_, e)| e.estimate)
            .sum()
    }

    fn publish(&self, s: &State) {
        let (free, reserved) = (
            s.free.as_ref().ok().copied(),
            s.waiting + Self::committed(s),
        );
        match &self.of {
            BudgetOf::Card(uuid) => self.metrics.gpu_memory(uuid, self.total, free, reserved),
            BudgetOf::Host => self.metrics.host_memory(self.total, free, reserved),
        }
    }

    /// Records a memory reading, and what this process held at it when the inventory can
    /// tell. A failure stops admission (and says so once); the next good reading resumes it.
    pub(crate) fn set_reading(&self, reading: Result<u64, DeviceError>, own: Option<u64>) {
        let mut s = self.lock();
        match (&s.free, &reading) {
            (Ok(_), Err(e)) => tracing::warn!(budget = %self.of, error = %e,
                "cannot read the memory: admitting nothing here until a reading succeeds"),
            (Err(was), Ok(free)) => tracing::info!(budget = %self.of, free, previous = %was,
                "memory readable: admission resumes"),
            _ => {}
        }
        s.free = reading.map_err(|e| e.to_string());
        s.own = own;
        self.publish(&s);
        drop(s);
        self.changed.notify_waiters();
    }

    /// What this process held at the last reading: the inventory's figure, else the
    /// weights when the reading holds them.
    fn own_now(&self, s: &State) -> u64 {
        s.own.unwrap_or(if self.opts.weights_in_reading {
            self.opts.weights
        } else {
            0
        })
    }

    /// Other tenants' use at the last reading: what the card uses beyond this process.
    fn others(&self, s: &State, free: u64) -> u64 {
        self.total
            .saturating_sub(free)
            .saturating_sub(self.own_now(s))
    }

    /// Bytes still free for new work, from a reading of `free` bytes, with `committed`
    /// bytes of working sets promised.
    fn available(&self, s: &State, free: u64, committed: u64) -> u64 {
        let own_peak = self
            .own_now(s)
            .max(self.opts.weights + self.opts.reserve + committed);
        self.total
            .saturating_sub(self.opts.headroom)
            .saturating_sub(self.others(s, free))
            .saturating_sub(own_peak)
            .saturating_sub(s.waiting)
    }

    fn waiting_cost(&self, kinds: &[String]) -> u64 {
        kinds
            .iter()
            .filter_map(|k| self.opts.waiting_rows.get(k))
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// How many more tasks of `kinds` (on `model`'s engine only, for a model lane) the card
    /// can take now: the first may land on the largest engine not yet committed (its
    /// working set), every one brings its waiting rows.
    fn room(&self, s: &State, kinds: &[String], model: Option<&str>) -> Result<usize, Blocked> {
        let free = *s.free.as_ref().map_err(|_| Blocked::NoReading)?;
        let slots = self.opts.cap.saturating_sub(s.running);
        if slots == 0 {
            return Err(Blocked::Cap);
        }
        let rows = self.waiting_cost(kinds);
        let committed = Self::committed_engines(s);
        let idle_working = s
            .engines
            .iter()
            .zip(&committed)
            .filter(|(e, c)| {
                !**c && kinds.iter().any(|k| e.serves(k)) && model.is_none_or(|m| e.cost.model == m)
            })
            .map(|(e, _)| e.estimate)
            .max()
            .unwrap_or(0);
        let available = self.available(s, free, Self::working_of(s, &committed));
        let first = rows + idle_working;
        if available < first {
            return Err(Blocked::Memory);
        }
        let more = match (available - first).checked_div(rows) {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => usize::MAX,
        };
        Ok(slots.min(more.saturating_add(1)))
    }

    /// The working-set estimate of `model` now.
    #[cfg(test)]
    pub(crate) fn estimate(&self, model: &str) -> Option<u64> {
        self.lock()
            .engines
            .iter()
            .find(|e| e.cost.model == model)
            .map(|e| e.estimate)
    }

    /// A task of `activity_type` ran out of memory, on `model` when known (else on every
    /// engine serving the type): raise the working-set estimate by half (at least 64 MiB),
    /// so less runs beside it from now on; but never past what leaves room for one task
    /// on the device as the last reading shows it with nothing running (this process's
    /// own use beyond the weights, a CUDA context, and other tenants included), or nothing
    /// would be admitted again while that reading holds (and with no successes, the
    /// estimate would never come down).
    pub(crate) fn record_oom(&self, activity_type: &str, model: Option<&str>) {
        let one_task = self.opts.waiting_rows.values().copied().max().unwrap_or(0);
        let mut s = self.lock();
        let others = s.free.as_ref().map_or(0, |f| self.others(&s, *f));
        let ceiling = self
            .total
            .saturating_sub(self.opts.headroom)
            .saturating_sub(others)
            .saturating_sub(self.own_now(&s).max(self.opts.weights + self.opts.reserve))
            .saturating_sub(one_task)
            .max(1);
        for e in s
            .engines
            .iter_mut()
            .filter(|e| model.map_or(e.serves(activity_type), |m| e.cost.model == m))
        {
            // Never lowered by an OOM, even when an override is already above the ceiling.
            let raised = (e.estimate + e.estimate / 2)
                .max(e.estimate + OOM_STEP)
                .min(ceiling)
                .max(e.estimate);
            tracing::warn!(budget = %self.of, activity_type, model = %e.cost.model,
                from = e.estimate, to = raised,
                "out of memory: raising the working-set estimate");
            e.estimate = raised;
            e.successes = 0;
        }
        drop(s);
        if let BudgetOf::Card(uuid) = &self.of {
            self.metrics.out_of_memory(uuid, activity_type);
        }
    }

    /// A task on `model` succeeded. After a run of them, an estimate that out-of-memory
    /// errors raised moves halfway back to its base: one bad moment (another tenant's
    /// spike) does not shrink the card for good.
    pub(crate) fn record_success(&self, model: &str) {
        let mut s = self.lock();
        let Some(e) = s
            .engines
            .iter_mut()
            .find(|e| e.cost.model == model && e.estimate > e.cost.working)
        else {
            return;
        };
        e.successes += 1;
        if e.successes >= DECAY_AFTER {
            let base = e.cost.working;
            let lowered = base + (e.estimate - base) / 2;
            let lowered = if lowered - base < OOM_STEP {
                base
            } else {
                lowered
            };
            tracing::info!(budget = %self.of, model, from = e.estimate, to = lowered,
                successes = e.successes, "no out-of-memory for a while: lowering the working-set estimate");
            e.estimate = lowered;
            e.successes = 0;
            drop(s);
            self.changed.notify_waiters();
        }
    }

    /// How many more tasks of `activity_type` the card would take now, from the last
    /// reading: what `gpulane admission` prints. Reserves nothing.
    pub(crate) fn would_admit(&self, activity_type: &str) -> Result<usize, String> {
        let s = self.lock();
        match self.room(&s, &[activity_type.to_owned()], None) {
            Ok(n) => Ok(n),
            Err(Blocked::NoReading) => Err(s.free.clone().err().unwrap_or_default()),
            Err(_) => Ok(0),
        }
    }

    /// Announces a lane that is about to start: until it polls, it counts as a lane
    /// without a poll (see [`MemoryBudget::try_poll`]).
    pub(crate) fn expect_lane(&self, queue: &str) {
        self.lock().expected.insert(queue.to_owned());
    }

    /// A lane's supplier stopped (its lane drains, or its worker did not start): its
    /// lane is no longer waited for.
    pub(crate) fn supplier_stopped(&self, supplier: u64) {
        let mut s = self.lock();
        s.idle.remove(&supplier);
        drop(s);
        self.changed.notify_waiters();
    }

    /// Opens a poll for `supplier`'s lane, serving `kinds`. A lane's first poll needs
    /// room for one task; a further one needs room for every poll open plus one for each
    /// lane that has none, so that one lane never holds a card's last room idle.
    fn try_poll(
        &self,
        supplier: u64,
        kinds: &[String],
        model: Option<&str>,
    ) -> Result<(), Blocked> {
        let mut s = self.lock();
        let mine = s.idle.get(&supplier).copied().unwrap_or(0);
        let need = if mine == 0 {
            1
        } else {
            let open: usize = s.idle.values().sum();
            let without = s.expected.len()
                + s.idle
                    .iter()
                    .filter(|(id, n)| **id != supplier && **n == 0)
                    .count();
            open + 1 + without
        };
        let room = self.room(&s, kinds, model)?;
        if room < need {
            return Err(if self.opts.cap.saturating_sub(s.running) < need {
                Blocked::Cap
            } else {
                Blocked::Memory
            });
        }
        if let Some(n) = s.idle.get_mut(&supplier) {
            *n += 1;
        }
        Ok(())
    }

    /// An open poll of `supplier` ended: it received a task (`Some((type, rows))`: the
    /// task and its waiting rows now count) or came back empty.
    fn poll_ended(&self, supplier: u64, task: Option<(&str, u64)>) {
        let mut s = self.lock();
        if let Some(n) = s.idle.get_mut(&supplier) {
            *n = n.saturating_sub(1);
        }
        if let Some((activity, bytes)) = task {
            s.running += 1;
            *s.running_by_type.entry(activity.to_owned()).or_insert(0) += 1;
            s.waiting += bytes;
            self.publish(&s);
        }
        drop(s);
        self.changed.notify_waiters();
    }

    /// A task of `activity` that held `bytes` of waiting rows ended.
    fn task_ended(&self, activity: &str, bytes: u64) {
        let mut s = self.lock();
        s.running = s.running.saturating_sub(1);
        if let Some(n) = s.running_by_type.get_mut(activity) {
            *n = n.saturating_sub(1);
        }
        s.waiting = s.waiting.saturating_sub(bytes);
        self.publish(&s);
        drop(s);
        self.changed.notify_waiters();
    }

    /// Bytes committed to running work (busy engines' working sets and waiting rows).
    #[cfg(test)]
    pub(crate) fn reserved(&self) -> u64 {
        let s = self.lock();
        s.waiting + Self::committed(&s)
    }

    /// Tasks running.
    #[cfg(test)]
    pub(crate) fn running(&self) -> usize {
        self.lock().running
    }

    /// Open polls of a supplier.
    #[cfg(test)]
    pub(crate) fn idle(&self, supplier: u64) -> usize {
        self.lock().idle.get(&supplier).copied().unwrap_or(0)
    }

    /// Whose memory this is.
    pub(crate) fn of(&self) -> &BudgetOf {
        &self.of
    }

    /// Why the last memory reading failed, if it did.
    pub(crate) fn reading_error(&self) -> Option<String> {
        self.lock().free.as_ref().err().cloned()
    }

    /// The budget as it stands, for `gpulane status` and `gpulane admission`.
    pub(crate) fn snapshot(&self) -> BudgetSnapshot {
        let s = self.lock();
        BudgetSnapshot {
            total: self.total,
            free: s.free.clone(),
            reserved: s.waiting + Self::committed(&s),
            headroom: self.opts.headroom,
            weights: self.opts.weights,
            reserve: self.opts.reserve,
            others: s.free.as_ref().ok().map(|f| self.others(&s, *f)),
            running: s.running,
            idle_polls: s.idle.values().sum(),
            cap: self.opts.cap,
            estimates: s
                .engines
                .iter()
                .map(|e| (e.cost.model.clone(), e.estimate))
                .collect(),
            by_activity: s.engines.iter().fold(Default::default(), |mut m, e| {
                for a in &e.cost.serves {
                    let v = m.entry(a.clone()).or_insert(0);
                    *v = (*v).max(e.estimate);
                }
                m
            }),
            waiting_rows: self
                .opts
                .waiting_rows
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
        }
    }

    /// A slot supplier for one lane of this card, serving `activity_types` (with `model`'s
    /// engine only, for a model lane). A lane's supplier is active from here until
    /// [`MemoryBudget::supplier_stopped`].
    pub(crate) fn lane(
        self: &Arc<Self>,
        queue: &str,
        activity_types: &[&str],
        model: Option<&str>,
    ) -> LaneSlots {
        let mut s = self.lock();
        let id = s.next_supplier;
        s.next_supplier += 1;
        s.idle.insert(id, 0);
        s.expected.remove(queue);
        drop(s);
        LaneSlots::new(
            self.clone(),
            id,
            queue,
            activity_types.iter().map(|s| (*s).to_owned()).collect(),
            model.map(str::to_owned),
        )
    }
}

/// Keeps every budget's memory reading fresh: reads the cards' inventory and the host
/// every `every` and feeds the budgets, which wakes lanes waiting for memory. Never
/// returns; a panic in a reading ends it, which the supervisor sees.
pub(crate) async fn refresh(
    budgets: Arc<Mutex<Vec<Arc<MemoryBudget>>>>,
    inventory: Arc<dyn DeviceInventory>,
    host: Arc<dyn HostMemory>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Cards that recover after start join the list; read the list each round.
        let now: Vec<Arc<MemoryBudget>> = budgets
            .lock()
            .expect("card list lock poisoned; this is a bug")
            .clone();
        for b in &now {
            // NVML and /proc reads are quick but blocking; a simulation file read is too.
            let (inv, host) = (inventory.clone(), host.clone());
            let of = b.of.clone();
            let (reading, own) = tokio::task::spawn_blocking(move || match &of {
                BudgetOf::Card(uuid) => (inv.free_memory(uuid), inv.own_usage(uuid)),
                BudgetOf::Host => (host.available(), host.own_usage()),
            })
            .await
            .expect("memory reading task panicked; this is a bug");
            b.set_reading(reading, own);
        }
    }
}
