//! Draining, resuming and stopping devices: which lanes stop when, and the private lane's
//! window.

use gpulane_proto::admin::{DrainResponse, ResumeResponse};
use tokio::time::Instant;

use super::{AdminError, DeviceState, Event, LaneState, Stop, Supervisor};
use crate::{lanes::LaneKind, startup::DeviceSetup};

impl Supervisor {
    /// The devices `target` names: a card's UUID (any case), `cpu`, or `all`.
    fn targets(&self, target: &str) -> Result<Vec<usize>, AdminError> {
        let target = target.trim();
        if target.eq_ignore_ascii_case("all") {
            return Ok((0..self.devices.len()).collect());
        }
        match self
            .devices
            .iter()
            .position(|d| d.id().eq_ignore_ascii_case(target))
        {
            Some(i) => Ok(vec![i]),
            None => {
                let known: Vec<&str> = self.devices.iter().map(|d| d.id()).collect();
                let broken = self
                    .broken
                    .iter()
                    .any(|b| b.plan.label().eq_ignore_ascii_case(target));
                Err(AdminError::NotFound(if broken {
                    format!("device {target:?} is not served (it could not be read; see `gpulane status`); served devices: {known:?}")
                } else {
                    format!(
                        "no device {:?} on this worker; pass one of {known:?} or \"all\"",
                        target.chars().take(64).collect::<String>()
                    )
                }))
            }
        }
    }

    fn refuse_when_stopping(&self) -> Result<(), AdminError> {
        match self.stop {
            Some(_) => Err(AdminError::Refused(
                "the worker is shutting down; nothing can be drained or resumed".to_owned(),
            )),
            None => Ok(()),
        }
    }

    /// `Drain`: the device's shared and model lanes stop now, its private lane after the
    /// window. Refused, changing nothing, for a device already draining or drained.
    pub(super) fn drain(&mut self, target: &str) -> Result<DrainResponse, AdminError> {
        self.refuse_when_stopping()?;
        let all = target.trim().eq_ignore_ascii_case("all");
        let mut chosen = self.targets(target)?;
        if all {
            chosen.retain(|&d| self.devices[d].state == DeviceState::Serving);
            if chosen.is_empty() {
                return Err(AdminError::Refused(
                    "nothing to drain: every device is already draining or drained".to_owned(),
                ));
            }
        } else if let Some(&d) = chosen.first() {
            let dev = &self.devices[d];
            if dev.state != DeviceState::Serving {
                return Err(AdminError::Refused(format!(
                    "device {} is already {}; resume it first",
                    dev.id(),
                    if dev.state == DeviceState::Draining {
                        "draining"
                    } else {
                        "drained"
                    }
                )));
            }
        }
        for &d in &chosen {
            self.drain_device(d);
        }
        Ok(DrainResponse {
            devices: chosen
                .iter()
                .map(|&d| self.devices[d].id().to_owned())
                .collect(),
            private_window_seconds: self.settings.drain_private.as_secs_f64(),
        })
    }

    /// Stops the device's shared and model lanes and opens its private lane's window.
    fn drain_device(&mut self, d: usize) {
        tracing::info!(
            device = self.devices[d].id(),
            private_window_s = self.settings.drain_private.as_secs_f64(),
            "draining"
        );
        for i in self.lanes_of(d, false) {
            self.stop_lane(i);
        }
        self.devices[d].state = DeviceState::Draining;
        self.open_window(d);
    }

    /// The private lane keeps serving for `--drain-private-secs`, then stops.
    fn open_window(&mut self, d: usize) {
        self.devices[d].window += 1;
        let generation = self.devices[d].window;
        let wait = self.settings.drain_private;
        if wait.is_zero() {
            self.window_over(d, generation);
            return;
        }
        let events = self.events.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let _ = events.send(Event::WindowOver {
                device: d,
                generation,
            });
        });
    }

    pub(super) fn window_over(&mut self, d: usize, generation: u64) {
        if self.devices[d].window != generation {
            return;
        }
        for i in self.lanes_of(d, true) {
            if self.lanes[i].kind == LaneKind::Private {
                self.stop_lane(i);
            }
        }
        if self.devices[d].state == DeviceState::Draining {
            self.devices[d].state = DeviceState::Drained;
            tracing::info!(device = self.devices[d].id(), "drained");
        }
    }

    /// `Resume`: every lane of the device polls again (with a new worker where the old
    /// one stopped). Refused, changing nothing, for a device that is not drained.
    pub(super) async fn resume(&mut self, target: &str) -> Result<ResumeResponse, AdminError> {
        self.refuse_when_stopping()?;
        let all = target.trim().eq_ignore_ascii_case("all");
        let mut chosen = self.targets(target)?;
        chosen.retain(|&d| self.devices[d].state != DeviceState::Serving);
        if chosen.is_empty() {
            return Err(AdminError::Refused(if all {
                "nothing to resume: no device is draining or drained".to_owned()
            } else {
                format!(
                    "device {} is not drained: it serves; drain it first",
                    target.trim()
                )
            }));
        }
        if let Some(&d) = chosen.iter().find(|&&d| self.devices[d].failed.is_some()) {
            return Err(AdminError::Refused(format!(
                "device {} failed ({}); the worker is restarting",
                self.devices[d].id(),
                self.devices[d].failed.as_deref().unwrap_or("")
            )));
        }
        let mut resumed = Vec::new();
        for d in chosen {
            let was = self.devices[d].state;
            // A window still open is cancelled: its private lane keeps its worker.
            self.devices[d].window += 1;
            let mut started = Vec::new();
            for i in self.lanes_of(d, true) {
                if self.lanes[i].state == LaneState::Polling {
                    continue;
                }
                if let Err(e) = self.start_lane(i).await {
                    tracing::error!(task_queue = %self.lanes[i].queue, error = %e, "could not resume a lane");
                    // Undo this device's resume: what started stops again, and a private
                    // lane still in its window gets a new one.
                    for j in started {
                        self.stop_lane(j);
                    }
                    if was == DeviceState::Draining {
                        self.open_window(d);
                    }
                    return Err(AdminError::Refused(format!(
                        "resuming {} failed ({e}); it stays {}{}",
                        self.devices[d].id(),
                        if was == DeviceState::Draining {
                            "draining"
                        } else {
                            "drained"
                        },
                        if resumed.is_empty() {
                            String::new()
                        } else {
                            format!("; resumed before it: {resumed:?}")
                        }
                    )));
                }
                started.push(i);
            }
            self.devices[d].state = DeviceState::Serving;
            tracing::info!(device = self.devices[d].id(), "resumed");
            resumed.push(self.devices[d].id().to_owned());
        }
        Ok(ResumeResponse { devices: resumed })
    }

    /// Starts the stop: readiness 503 at once, shared and model lanes stop now, private
    /// lanes after their window (a failed device's at once too). `failure` is why, when
    /// it is not a stop signal.
    pub(super) fn begin_stop(&mut self, failure: Option<String>) {
        if self.stop.is_some() {
            return;
        }
        self.stop = Some(Stop {
            deadline: Instant::now() + self.settings.shutdown_deadline(),
            failure,
        });
        for d in 0..self.devices.len() {
            match self.devices[d].state {
                DeviceState::Serving => {
                    for i in self.lanes_of(d, false) {
                        self.stop_lane(i);
                    }
                    if self.devices[d].failed.is_some() {
                        for i in self.lanes_of(d, true) {
                            self.stop_lane(i);
                        }
                    } else {
                        self.open_window(d);
                    }
                }
                // A draining device's window runs on; a drained one has nothing left.
                DeviceState::Draining | DeviceState::Drained | DeviceState::Stopping => {}
            }
            self.devices[d].state = DeviceState::Stopping;
        }
        // Whatever the device's state says, no lane but a private one in its window may
        // keep polling once the worker stops.
        for i in 0..self.lanes.len() {
            let windowed = self.lanes[i].kind == LaneKind::Private
                && self.devices[self.lanes[i].device].failed.is_none();
            if !windowed {
                self.stop_lane(i);
            }
        }
        self.update_health();
    }

    /// A card that could not be read at start reads again: serve it.
    pub(super) async fn card_ready(&mut self, setup: DeviceSetup) {
        let id = setup.plan.label().to_owned();
        if self.stop.is_some() {
            return;
        }
        self.broken.retain(|b| b.plan.label() != id);
        let first = self.lanes.len();
        self.add_device(setup);
        for i in first..self.lanes.len() {
            if let Err(e) = self.start_lane(i).await {
                let why = format!(
                    "card {id} recovered but its lane {} did not start: {e}",
                    self.lanes[i].queue
                );
                tracing::error!(reason = %why, "failure");
                self.lanes[i].state = LaneState::Failed(e.to_string());
                self.fail(why);
                return;
            }
        }
        tracing::info!(gpu_uuid = %id, "card readable again: its lanes poll");
    }
}
