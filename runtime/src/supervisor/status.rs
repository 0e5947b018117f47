//! The admin API's `Status`, as the supervisor sees it (the backlog is added by the admin
//! service, from Temporal, outside the supervisor's loop).

use std::sync::atomic::Ordering;

use gpulane_proto::admin::{self, StatusResponse};

use super::{DeviceState, Supervisor};

impl Supervisor {
    pub(super) fn status(&self) -> StatusResponse {
        let readiness = self.health.readiness();
        let mut problems = readiness.clone();
        problems.extend(self.health.liveness());
        let mut devices: Vec<admin::Device> = self
            .devices
            .iter()
            .map(|d| {
                let gpu = d.setup.plan.gpu.as_ref();
                admin::Device {
                    id: d.id().to_owned(),
                    kind: if gpu.is_some() { "gpu" } else { "cpu" }.to_owned(),
                    index: gpu.map(|g| g.index),
                    name: gpu.map_or_else(|| "cpu".to_owned(), |g| g.name.clone()),
                    simulated: gpu.is_some_and(|g| g.simulated),
                    state: match (d.failed.is_some(), d.state) {
                        (true, _) => "failed",
                        (false, DeviceState::Serving) => "serving",
                        (false, DeviceState::Draining) => "draining",
                        (false, DeviceState::Drained) => "drained",
                        (false, DeviceState::Stopping) => "stopping",
                    }
                    .to_owned(),
                    error: d.failed.clone().unwrap_or_default(),
                    budget: Some({
                        let s = d.setup.budget.snapshot();
                        admin::Budget {
                            total_bytes: s.total,
                            free_bytes: s.free.as_ref().ok().copied(),
                            reading_error: s.free.err().unwrap_or_default(),
                            reserved_bytes: s.reserved,
                            headroom_bytes: s.headroom,
                            unseen_resident_bytes: 0,
                            weights_bytes: s.weights,
                            permits_out: s.running as u32,
                            permit_cap: s.cap as u32,
                            estimates_bytes: s.by_activity.into_iter().collect(),
                            working_set_bytes: s.estimates.into_iter().collect(),
                            others_bytes: s.others,
                            idle_polls: s.idle_polls as u32,
                            waiting_rows_bytes: s.waiting_rows.into_iter().collect(),
                            reserve_bytes: s.reserve,
                        }
                    }),
                }
            })
            .collect();
        devices.extend(self.broken.iter().map(|b| {
            let g = b.plan.gpu.as_ref();
            admin::Device {
                id: b.plan.label().to_owned(),
                kind: "gpu".to_owned(),
                index: g.map(|g| g.index),
                name: g.map(|g| g.name.clone()).unwrap_or_default(),
                simulated: g.is_some_and(|g| g.simulated),
                state: "broken".to_owned(),
                error: b.error.clone(),
                budget: None,
            }
        }));
        let lanes = self
            .lanes
            .iter()
            .map(|l| admin::Lane {
                task_queue: l.queue.clone(),
                device: self.devices[l.device].id().to_owned(),
                kind: l.kind.label().to_owned(),
                state: l.state.label().to_owned(),
                identity: l.identity.clone(),
                running: l.running.load(Ordering::Relaxed) as u32,
                backlog: None,
            })
            .collect();
        let engines = self
            .health
            .engines()
            .into_iter()
            .map(|e| admin::Engine {
                model: e.model,
                device: e.device,
                kind: e.kind.to_owned(),
                alive: e.alive,
                health: match e.check {
                    Ok(()) => "ok".to_owned(),
                    Err(why) => why,
                },
                pending_rows: e.pending_rows as u64,
            })
            .collect();
        StatusResponse {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            host: self.settings.devices.host.clone(),
            namespace: self.settings.temporal.namespace.clone(),
            identity: self.settings.identity.clone(),
            ready: readiness.is_empty(),
            draining: self.health.draining(),
            problems,
            devices,
            lanes,
            engines,
        }
    }
}
