use std::{
    collections::HashMap,
    sync::{atomic::AtomicUsize, Arc},
    time::Duration,
};

use gpulane_models::EngineLoad;
use temporalio_common::{protos::coresdk::ActivitySlotInfo, worker::WorkerDeploymentVersion};
use temporalio_sdk_core::{
    ActivitySlotKind, SlotMarkUsedContext, SlotReleaseContext, SlotReservationContext,
    SlotSupplier, SlotSupplierPermit,
};

use super::*;
use crate::devices::{DeviceInventory, SimulatedInventory};

pub(super) const GIB: u64 = 1 << 30;
pub(super) const MIB: u64 = 1 << 20;

pub(super) struct Reserve;
impl SlotReservationContext for Reserve {
    fn task_queue(&self) -> &str {
        "q"
    }
    fn worker_identity(&self) -> &str {
        "test"
    }
    fn worker_deployment_version(&self) -> &Option<WorkerDeploymentVersion> {
        &None
    }
    fn num_issued_slots(&self) -> usize {
        0
    }
    fn is_sticky(&self) -> bool {
        false
    }
}

pub(super) struct Used(SlotSupplierPermit, ActivitySlotInfo);
impl SlotMarkUsedContext for Used {
    type SlotKind = ActivitySlotKind;
    fn permit(&self) -> &SlotSupplierPermit {
        &self.0
    }
    fn info(&self) -> &ActivitySlotInfo {
        &self.1
    }
}

struct Release(SlotSupplierPermit, Option<ActivitySlotInfo>);
impl SlotReleaseContext for Release {
    type SlotKind = ActivitySlotKind;
    fn permit(&self) -> &SlotSupplierPermit {
        &self.0
    }
    fn info(&self) -> Option<&ActivitySlotInfo> {
        self.1.as_ref()
    }
}

/// An engine whose pending rows the test sets.
pub(super) struct FakeEngine {
    rows: Arc<AtomicUsize>,
}

impl FakeEngine {
    pub(super) fn new() -> Self {
        Self {
            rows: Arc::default(),
        }
    }
    pub(super) fn busy(&self, busy: bool) {
        self.rows
            .store(usize::from(busy), std::sync::atomic::Ordering::Relaxed);
    }
    pub(super) fn cost(&self, model: &str, working: u64) -> EngineCost {
        EngineCost {
            model: model.to_owned(),
            serves: vec!["embed".to_owned()],
            working,
            load: EngineLoad::fixed(self.rows.clone()),
        }
    }
}

pub(super) fn options(
    cap: usize,
    headroom: u64,
    weights: u64,
    engines: Vec<EngineCost>,
) -> BudgetOptions {
    BudgetOptions {
        headroom,
        cap,
        weights,
        reserve: 0,
        weights_in_reading: true,
        engines,
        waiting_rows: HashMap::from([("embed".to_owned(), MIB)]),
    }
}

fn budget(total: u64, opts: BudgetOptions) -> Arc<MemoryBudget> {
    MemoryBudget::new(
        BudgetOf::Card("GPU-T".to_owned()),
        total,
        opts,
        Arc::default(),
    )
}

pub(super) fn info(activity: &str) -> ActivitySlotInfo {
    ActivitySlotInfo {
        activity_type: activity.to_owned(),
    }
}

/// A poll of `lane` that receives an `embed` task.
pub(super) fn task(lane: &LaneSlots) -> Option<Used> {
    let p = lane.try_reserve_slot(&Reserve)?;
    let u = Used(p, info("embed"));
    lane.mark_slot_used(&u);
    Some(u)
}

pub(super) fn end(lane: &LaneSlots, u: Used) {
    lane.release_slot(&Release(u.0, Some(u.1)));
}

/// Tasks `lane` takes one after the other (each poll receiving a task) until refused.
pub(super) fn fill(lane: &LaneSlots, most: usize) -> Vec<Used> {
    std::iter::from_fn(|| task(lane)).take(most).collect()
}

#[tokio::test(start_paused = true)]
async fn idle_polls_hold_nothing_and_only_arriving_tasks_are_charged() {
    let e = FakeEngine::new();
    let b = budget(16 * GIB, options(8, 0, GIB, vec![e.cost("m", 2 * GIB)]));
    b.set_reading(Ok(15 * GIB), None); // the weights are in the reading
    let lane = b.lane("gpu-tools", &["embed"], None);
    let p1 = lane.try_reserve_slot(&Reserve).unwrap();
    assert_eq!(b.reserved(), 0, "an idle poll holds no memory");
    assert_eq!(b.running(), 0);
    let u = Used(p1, info("embed"));
    lane.mark_slot_used(&u);
    assert_eq!(
        b.reserved(),
        MIB + 2 * GIB,
        "the task's waiting rows, and the working set of the engine it will use, before \
         that engine shows any work (its input is still being tokenized)"
    );
    e.busy(true);
    assert_eq!(b.reserved(), MIB + 2 * GIB, "counted once when it does");
    e.busy(false);
    assert_eq!(b.reserved(), MIB + 2 * GIB, "and between its passes");
    end(&lane, u);
    assert_eq!(b.reserved(), 0);
    assert_eq!(b.running(), 0);
    // An empty poll returns nothing it did not take.
    let p = lane.try_reserve_slot(&Reserve).unwrap();
    lane.release_slot(&Release(p, None));
    assert_eq!((b.reserved(), b.running(), b.idle(lane.id())), (0, 0, 0));
}

/// Issue 17: with a cap of 1, or memory for exactly one working set, both lanes of an
/// idle card keep a poll open, so neither a pinned call nor a shared one waits.
#[tokio::test(start_paused = true)]
async fn both_lanes_of_an_idle_card_poll_at_cap_one_and_with_memory_for_one_task() {
    for (cap, total) in [(1, 16 * GIB), (8, 3 * GIB)] {
        let e = FakeEngine::new();
        let b = budget(total, options(cap, 0, 0, vec![e.cost("m", 2 * GIB)]));
        b.set_reading(Ok(total), Some(0));
        b.expect_lane("gpu-tools");
        b.expect_lane("private");
        let shared = b.lane("gpu-tools", &["embed"], None);
        let s1 = shared
            .try_reserve_slot(&Reserve)
            .expect("the shared lane polls");
        if cap == 1 {
            assert!(
                shared.try_reserve_slot(&Reserve).is_none(),
                "a second shared poll would leave the private lane none"
            );
        }
        let private = b.lane("private", &["embed"], None);
        let p1 = private
            .try_reserve_slot(&Reserve)
            .expect("the private lane polls too");
        assert_eq!(b.reserved(), 0, "cap {cap}: the idle card reserves nothing");
        // Both receive a task at once: both run (the engine takes them one pass at a
        // time), and no further poll opens until one ends.
        let (a, c) = (Used(s1, info("embed")), Used(p1, info("embed")));
        shared.mark_slot_used(&a);
        private.mark_slot_used(&c);
        e.busy(true);
        assert_eq!(b.running(), 2);
        if cap == 1 {
            assert!(shared.try_reserve_slot(&Reserve).is_none());
            assert!(private.try_reserve_slot(&Reserve).is_none());
        } else {
            // Memory for one working set: more tasks for the busy engine only add their
            // waiting rows.
            let more = task(&shared).expect("a third task joins the busy engine");
            end(&shared, more);
        }
        end(&shared, a);
        end(&private, c);
        e.busy(false);
        assert!(private.try_reserve_slot(&Reserve).is_some());
    }
}

/// Issue 14: a simulated 16 GiB card, admission and the card's own accounting together.
#[tokio::test(start_paused = true)]
async fn a_16_gib_card_admits_what_its_engines_really_hold() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mem.json");
    std::fs::write(&file, "{}").unwrap();
    let inv = SimulatedInventory::new(1, 16 * GIB, Some("t")).with_memory_file(Some(file.clone()));
    let uuid = "GPU-SIM-t-0";
    let card = inv.engine_memory(uuid).unwrap();
    let read = |b: &MemoryBudget| b.set_reading(inv.free_memory(uuid), inv.own_usage(uuid));
    let headroom = 16 * GIB / 20;

    // MiniLM-sized: 90 MB of weights, a 200 MB working set: the card admits its cap.
    let minilm = FakeEngine::new();
    card.hold(90 * MIB);
    let b = budget(
        16 * GIB,
        options(
            32,
            headroom,
            90 * MIB,
            vec![minilm.cost("minilm", 200 * MIB)],
        ),
    );
    read(&b);
    let lane = b.lane("gpu-tools", &["embed"], None);
    let held = fill(&lane, 100);
    assert_eq!(held.len(), 32, "MiniLM: up to the cap");
    held.into_iter().for_each(|u| end(&lane, u));
    card.give_back(90 * MIB);

    // A model whose working set is 6 GiB, served twice on the card (two engines): one
    // busy engine's working set fits beside the other idle one's, three would not.
    let (a, c) = (FakeEngine::new(), FakeEngine::new());
    card.hold(2 * GIB);
    let b = budget(
        16 * GIB,
        options(
            32,
            headroom,
            2 * GIB,
            vec![a.cost("big-a", 6 * GIB), c.cost("big-b", 6 * GIB)],
        ),
    );
    read(&b);
    assert_eq!(
        b.would_admit("embed"),
        Ok(32),
        "16 - 0.8 - 2 leaves room for both"
    );
    a.busy(true);
    card.take(6 * GIB).unwrap(); // a's pass runs
    read(&b);
    assert!(
        b.would_admit("embed").unwrap() > 0,
        "b's working set still fits"
    );
    c.busy(true);
    card.take(6 * GIB).unwrap();
    read(&b);
    assert_eq!(
        b.would_admit("embed"),
        Ok(32),
        "both busy: tasks only add waiting rows"
    );
    // Not counted twice: the passes' memory is in the reading and in the commitment, and
    // the budget sees 16 - 0.8 - 2 - 12 = 1.2 GiB for waiting rows, not less.
    assert!(b.snapshot().others == Some(0));
    card.give_back(12 * GIB);
    a.busy(false);
    c.busy(false);

    // A neighbour takes 12 GiB: 16 - 0.8 - 12 - 2 leaves 1.2 GiB, less than one 6 GiB
    // working set, so nothing is admitted; it leaves, and admission resumes.
    std::fs::write(&file, format!(r#"{{"0": {}}}"#, 4 * GIB)).unwrap();
    read(&b);
    assert_eq!(
        b.would_admit("embed"),
        Ok(0),
        "a neighbour's 12 GiB stops admission"
    );
    let lane = b.lane("gpu-tools", &["embed"], None);
    assert!(lane.try_reserve_slot(&Reserve).is_none());
    std::fs::write(&file, "{}").unwrap();
    read(&b);
    assert!(lane.try_reserve_slot(&Reserve).is_some());
}

/// Review regression: on a card with two models, a task's engine shows work only after
/// its input is tokenized; until then that engine's working set stays promised, so a
/// second task cannot be admitted into it.
#[tokio::test(start_paused = true)]
async fn a_task_keeps_its_engine_promised_before_the_engine_shows_work() {
    let (a, c) = (FakeEngine::new(), FakeEngine::new());
    // 7 GiB for working sets: one 4 GiB engine and one 3 GiB one, not 4 + 4.
    let b = budget(
        7 * GIB + 2 * MIB,
        options(8, 0, 0, vec![a.cost("a", 4 * GIB), c.cost("c", 3 * GIB)]),
    );
    b.set_reading(Ok(7 * GIB + 2 * MIB), Some(0));
    let lane = b.lane("gpu-tools", &["embed"], None);
    let t1 = task(&lane).expect("room for the first");
    // t1 is still tokenizing: no engine shows work, yet the larger one it could use is
    // promised, so a second task (which could need the 4 GiB one too) waits.
    assert_eq!(b.reserved(), MIB + 4 * GIB);
    let t2 = task(&lane).expect("the 3 GiB engine is still free");
    assert_eq!(b.reserved(), 2 * MIB + 7 * GIB, "both engines promised");
    assert!(
        task(&lane).is_none(),
        "nothing left for a third engine's pass"
    );
    end(&lane, t1);
    end(&lane, t2);
    assert_eq!(b.reserved(), 0);
}

/// Issue 14: whatever mix of long and short calls admission lets in, the simulated card
/// never has to hold more than its total: every pass the engines run fits.
#[tokio::test(start_paused = true)]
async fn a_mixed_load_never_drives_simulated_use_over_the_total() {
    let inv = SimulatedInventory::new(1, 16 * GIB, Some("t"));
    let uuid = "GPU-SIM-t-0";
    let card = inv.engine_memory(uuid).unwrap();
    let engines: Vec<FakeEngine> = (0..3).map(|_| FakeEngine::new()).collect();
    // Working sets at their largest batch: 5, 4 and 3 GiB; weights 1 GiB.
    let sizes = [5 * GIB, 4 * GIB, 3 * GIB];
    card.hold(GIB);
    let b = budget(
        16 * GIB,
        options(
            64,
            GIB,
            GIB,
            engines
                .iter()
                .zip(sizes)
                .enumerate()
                .map(|(i, (e, s))| e.cost(&format!("m{i}"), s))
                .collect(),
        ),
    );
    let lane = b.lane("gpu-tools", &["embed"], None);
    let mut running: Vec<(Used, usize)> = Vec::new();
    let mut passes = 0;
    for step in 0..400usize {
        b.set_reading(inv.free_memory(uuid), inv.own_usage(uuid));
        // Admit what admission lets in; each task goes to an engine in turn, and its
        // pass is long (the working set at the largest batch) or short (a tenth).
        if let Some(u) = task(&lane) {
            let engine = step % 3;
            engines[engine].busy(true);
            running.push((u, engine));
        }
        // Every busy engine runs a pass now, as they would at once on a card.
        let mut taken = Vec::new();
        for (i, e) in engines.iter().enumerate() {
            if running.iter().any(|(_, en)| *en == i) {
                let bytes = if step % 2 == 0 {
                    sizes[i]
                } else {
                    sizes[i] / 10
                };
                card.take(bytes)
                    .unwrap_or_else(|err| panic!("step {step}: admission over-committed: {err}"));
                taken.push(bytes);
                passes += 1;
            } else {
                e.busy(false);
            }
        }
        taken.into_iter().for_each(|t| card.give_back(t));
        // Some tasks end.
        if step % 3 == 0 && !running.is_empty() {
            let (u, engine) = running.remove(0);
            end(&lane, u);
            if !running.iter().any(|(_, en)| *en == engine) {
                engines[engine].busy(false);
            }
        }
    }
    assert!(passes > 300, "the load ran: {passes} passes");
    assert!(inv.simulated_peak(uuid).unwrap() <= 16 * GIB);
}

#[tokio::test(start_paused = true)]
async fn no_poll_below_one_working_set_then_polls_flow_when_memory_frees() {
    let e = FakeEngine::new();
    let b = budget(8 * GIB, options(8, 0, 0, vec![e.cost("m", 2 * GIB)]));
    let lane = b.lane("gpu-tools", &["embed"], None);
    b.set_reading(Ok(GIB), Some(0)); // one pass needs 2 GiB
    assert!(lane.try_reserve_slot(&Reserve).is_none());
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            b.lane("gpu-tools", &["embed"], None)
                .reserve_slot(&Reserve)
                .await
        })
    };
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    b.set_reading(Ok(5 * GIB), Some(0));
    tokio::time::timeout(Duration::from_secs(1), waiter)
        .await
        .expect("the waiting lane is woken by the new reading")
        .unwrap();
}

#[test]
fn would_admit_counts_what_polls_would_get() {
    let e = FakeEngine::new();
    let b = budget(8 * GIB, options(100, GIB, 0, vec![e.cost("m", 2 * GIB)]));
    assert!(b.would_admit("embed").is_err(), "no reading yet");
    b.set_reading(Ok(8 * GIB), Some(0));
    // 7 GiB usable: one 2 GiB working set, then 1 MiB of waiting rows per task.
    assert_eq!(b.would_admit("embed"), Ok(100), "the cap binds first");
    b.set_reading(Ok(GIB), Some(0)); // another tenant took the card
    assert_eq!(b.would_admit("embed"), Ok(0));
}

#[tokio::test(start_paused = true)]
async fn out_of_memory_raises_the_estimate_and_successes_lower_it_again() {
    let e = FakeEngine::new();
    let b = budget(8 * GIB, options(8, 0, 0, vec![e.cost("m", 2 * GIB)]));
    b.set_reading(Ok(5 * GIB), Some(0));
    b.record_oom("embed", Some("m"));
    assert_eq!(b.estimate("m"), Some(3 * GIB));
    for _ in 0..10 {
        b.record_oom("embed", None);
    }
    // 3 GiB are another tenant's at this reading: never past what is left, less one
    // task's rows, so one task still fits.
    assert_eq!(
        b.estimate("m"),
        Some(5 * GIB - MIB),
        "never past what the reading leaves less one task's rows"
    );
    assert_eq!(b.would_admit("embed"), Ok(1), "one task, and no more");
    let mut seen = vec![b.estimate("m").unwrap()];
    for _ in 0..(DECAY_AFTER as usize * 12) {
        b.record_success("m");
        seen.push(b.estimate("m").unwrap());
    }
    assert_eq!(
        b.estimate("m"),
        Some(2 * GIB),
        "back to the base after enough successes"
    );
    assert!(seen.windows(2).all(|w| w[1] <= w[0]), "only ever lowered");
    assert!(
        seen.iter().filter(|&&v| v == 5 * GIB - MIB).count() >= DECAY_AFTER as usize,
        "not at once"
    );
    assert_eq!(b.would_admit("embed"), Ok(8));
}

#[tokio::test(start_paused = true)]
async fn a_failed_reading_stops_admission_until_one_succeeds() {
    let e = FakeEngine::new();
    let b = budget(8 * GIB, options(8, 0, 0, vec![e.cost("m", GIB)]));
    let lane = b.lane("gpu-tools", &["embed"], None);
    b.set_reading(Ok(8 * GIB), Some(0));
    assert!(lane.try_reserve_slot(&Reserve).is_some());
    b.set_reading(Err(DeviceError::UnknownDevice("GPU-T".into())), None);
    let other = b.lane("other", &["embed"], None);
    assert!(other.try_reserve_slot(&Reserve).is_none());
    b.set_reading(Ok(8 * GIB), Some(0));
    assert!(other.try_reserve_slot(&Reserve).is_some());
}

/// Regression: one lane's idle polls held every permit of a card with a small cap, so the
/// other lane (a pinned call's private queue) waited a whole long poll.
#[tokio::test(start_paused = true)]
async fn turn_taking_survives_drains_and_resumes() {
    let e = FakeEngine::new();
    let b = budget(8 * GIB, options(2, 0, 0, vec![e.cost("m", GIB / 2)]));
    b.set_reading(Ok(8 * GIB), Some(0));
    let shared = b.lane("gpu-tools", &["embed"], None);
    let s1 = shared.try_reserve_slot(&Reserve).unwrap();
    let s2 = shared
        .try_reserve_slot(&Reserve)
        .expect("room for two, no other lane");
    let private = b.lane("private", &["embed"], None);
    assert!(shared.try_reserve_slot(&Reserve).is_none(), "the cap");
    let p1 = private
        .try_reserve_slot(&Reserve)
        .expect("a lane's first poll needs room for one task only");
    // A drained lane is not waited for.
    b.supplier_stopped(private.id());
    private.release_slot(&Release(p1, None));
    shared.release_slot(&Release(s2, None));
    let s3 = shared
        .try_reserve_slot(&Reserve)
        .expect("no lane is left without a poll");
    // A resumed lane's new supplier keeps its own count; the old one's late releases do
    // not change it.
    let old = b.lane("private", &["embed"], None);
    let late = old
        .try_reserve_slot(&Reserve)
        .expect("the old worker's poll");
    b.supplier_stopped(old.id());
    let resumed = b.lane("private", &["embed"], None);
    let r1 = resumed
        .try_reserve_slot(&Reserve)
        .expect("the resumed lane polls");
    assert_eq!(b.idle(resumed.id()), 1);
    old.release_slot(&Release(late, None));
    assert_eq!(
        b.idle(resumed.id()),
        1,
        "the old poll's end is not the new one's"
    );
    resumed.release_slot(&Release(r1, None));
    shared.release_slot(&Release(s1, None));
    shared.release_slot(&Release(s3, None));
    assert_eq!(b.idle(resumed.id()), 0);
}

/// Issue 17: a stopping lane's gate takes no new polls and settles once its open polls
/// came back (a task on one counts as arrived), or once no task came for a while.
#[tokio::test(start_paused = true)]
async fn a_closed_gate_opens_no_poll_and_settles_when_its_polls_are_back() {
    let e = FakeEngine::new();
    let b = budget(8 * GIB, options(8, 0, 0, vec![e.cost("m", GIB)]));
    b.set_reading(Ok(8 * GIB), Some(0));
    let lane = b.lane("gpu-tools", &["embed"], None);
    let gate = lane.gate();
    let p1 = lane.try_reserve_slot(&Reserve).unwrap();
    let p2 = lane.try_reserve_slot(&Reserve).unwrap();
    assert_eq!(gate.open_polls(), 2);
    gate.close();
    assert!(lane.try_reserve_slot(&Reserve).is_none());
    assert!(
        tokio::time::timeout(Duration::from_secs(60), lane.reserve_slot(&Reserve))
            .await
            .is_err(),
        "a closed lane's reservation waits until core shuts the worker down"
    );
    let settle = {
        let gate = gate.clone();
        tokio::spawn(async move {
            gate.settle(Duration::from_secs(5), Duration::from_secs(60))
                .await
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let u = Used(p1, info("embed"));
    lane.mark_slot_used(&u); // a task arrives on an open poll: it runs
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !settle.is_finished(),
        "one poll is still open and a task came 1 s ago"
    );
    lane.release_slot(&Release(p2, None));
    assert_eq!(settle.await.unwrap(), 0, "every poll came back");
    end(&lane, u);

    // An idle queue: the polls stay open; the gate settles after the quiet time.
    let lane = b.lane("idle", &["embed"], None);
    let gate = lane.gate();
    let _p = lane.try_reserve_slot(&Reserve).unwrap();
    gate.close();
    let t = tokio::time::Instant::now();
    assert_eq!(
        gate.settle(Duration::from_secs(1), Duration::from_secs(10))
            .await,
        1
    );
    assert_eq!(t.elapsed(), Duration::from_secs(1));
}

/// Regression (issue 14): out-of-memory errors raised an estimate up to everything the
/// device could give, so one task's rows no longer fitted beside it: nothing was admitted
/// again, and with no task succeeding the estimate never came down.
#[tokio::test(start_paused = true)]
async fn repeated_out_of_memory_still_leaves_room_for_one_task() {
    let e = FakeEngine::new();
    let b = budget(GIB, options(8, 0, 0, vec![e.cost("m", 100 * MIB)]));
    b.set_reading(Ok(GIB), Some(0));
    for _ in 0..20 {
        b.record_oom("embed", Some("m"));
    }
    assert_eq!(b.estimate("m"), Some(GIB - MIB), "raised to the ceiling");
    assert_eq!(b.would_admit("embed"), Ok(1), "one task still fits");
}

/// Review regression: the ceiling of an OOM-raised estimate comes from the last reading,
/// so memory this process holds beyond the weights (a CUDA context, allocator slack) does
/// not leave a raised estimate that never fits again.
#[tokio::test(start_paused = true)]
async fn the_oom_ceiling_leaves_room_for_one_task_beside_what_the_reading_shows() {
    let e = FakeEngine::new();
    let b = budget(GIB, options(8, 0, 100 * MIB, vec![e.cost("m", 100 * MIB)]));
    // This process holds the weights and 300 MiB more (a context), another tenant 50 MiB.
    b.set_reading(Ok(GIB - 450 * MIB), Some(400 * MIB));
    for _ in 0..20 {
        b.record_oom("embed", Some("m"));
    }
    assert_eq!(b.estimate("m"), Some(GIB - 450 * MIB - MIB));
    assert_eq!(b.would_admit("embed"), Ok(1), "one task still fits");
}
