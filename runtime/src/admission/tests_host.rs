//! The host's budget for the CPU lanes (issue 14): a flood of long texts on a small host
//! admits what the host can hold, and a neighbour's use stops admission.

use std::sync::Arc;

use gpulane_models::Tokenizing;
use temporalio_sdk_core::SlotSupplier;

use super::tests::{end, fill, options, FakeEngine, Reserve, GIB, MIB};
use super::*;
use crate::devices::{HostMemory, SimulatedHost};

/// What a call of the largest input holds on the host while it runs: its text as
/// received and decoded, at most 4 bytes a character each.
const MAX_CHARS: usize = 1_000_000;
const LONG_INPUT: u64 = 2 * 4 * MAX_CHARS as u64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_long_texts_on_a_small_host_admits_what_fits_and_never_overfills_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mem.json");
    std::fs::write(&file, "{}").unwrap();
    let total = 2 * GIB;
    let host = SimulatedHost::new(total, Some(file.clone()));
    let mem = host.engine_memory().unwrap();
    let read = |b: &MemoryBudget| b.set_reading(host.available(), host.own_usage());

    // MiniLM on the CPU: 90 MiB of weights, a 352 MiB working set, two tokenizing slots,
    // and per task its rows and its input (as run builds it).
    let (weights, working, rows) = (90 * MIB, 352 * MIB, 2 * MIB + LONG_INPUT);
    mem.hold(weights);
    let tokenizing = Tokenizing::new(2, Some(mem.clone()));
    let engine = FakeEngine::new();
    let mut opts = options(
        256,
        100 * MIB,
        weights,
        vec![engine.cost("minilm", working)],
    );
    opts.reserve = tokenizing.reserve(MAX_CHARS);
    opts.waiting_rows = [("embed".to_owned(), rows)].into();
    let reserve = opts.reserve;
    let b = MemoryBudget::new(BudgetOf::Host, total, opts, Arc::default());
    read(&b);

    // What fits: the first task brings the working set, each one its rows.
    let room = total - 100 * MIB - weights - reserve;
    let fits = 1 + ((room - working - rows) / rows) as usize;
    assert!(
        (50..256).contains(&fits),
        "{fits}: the host, not the cap, bounds it"
    );
    assert_eq!(b.would_admit("embed"), Ok(fits));

    // The flood: every round admits what admission lets in; each new task holds its
    // input, tokenizes through the slots while the engine runs a pass, and the older
    // half of the running tasks end. Long calls (a million characters) and short ones
    // alternate. Any take past the host's total would fail the round.
    let lane = b.lane("cpu-tools", &["embed"], None);
    let mut running: Vec<(super::tests::Used, u64)> = Vec::new();
    let mut admitted = 0;
    for round in 0..12 {
        read(&b);
        let long = round % 2 == 0;
        let (input, chars) = if long {
            (LONG_INPUT, MAX_CHARS)
        } else {
            (4096, 512)
        };
        let new = fill(&lane, 1000);
        assert!(
            running.len() + new.len() <= fits,
            "round {round}: over what fits"
        );
        admitted += new.len();
        for u in new {
            mem.take(input)
                .unwrap_or_else(|e| panic!("round {round}: an input did not fit: {e}"));
            running.push((u, input));
        }
        engine.busy(true);
        mem.take(working)
            .unwrap_or_else(|e| panic!("round {round}: the pass did not fit: {e}"));
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let t = tokenizing.clone();
                tokio::spawn(async move { t.run(chars, || Ok(())).await })
            })
            .collect();
        for c in calls {
            c.await
                .unwrap()
                .unwrap_or_else(|e| panic!("round {round}: tokenizing did not fit: {e}"));
        }
        mem.give_back(working);
        engine.busy(false);
        for (u, input) in running.drain(..running.len() / 2) {
            mem.give_back(input);
            end(&lane, u);
        }
    }
    assert!(admitted > 2 * fits, "the flood ran: {admitted} tasks");
    assert!(
        host.peak() <= total - 100 * MIB,
        "peak {} MiB",
        host.peak() / MIB
    );

    // A neighbour takes all but 300 MiB: less than one working set is left, so nothing
    // is admitted; it leaves, and admission resumes.
    for (u, input) in running.drain(..) {
        mem.give_back(input);
        end(&lane, u);
    }
    std::fs::write(&file, format!(r#"{{"host": {}}}"#, 300 * MIB)).unwrap();
    read(&b);
    assert_eq!(b.would_admit("embed"), Ok(0), "a neighbour stops admission");
    assert!(lane.try_reserve_slot(&Reserve).is_none());
    std::fs::write(&file, "{}").unwrap();
    read(&b);
    assert!(lane.try_reserve_slot(&Reserve).is_some());
}
