//! Which task queues this host serves, and for which device. A *lane* is one task queue
//! served by one device; a card serves the shared `gpu-tools`, one model queue
//! (`gpu-tools@<model>`) per model that asks for one, and its private queue; the CPU
//! likewise with `cpu-tools`. Names come from `gpulane_proto`, the one place workflow
//! authors read them from.

use gpulane_activities::Route;
use gpulane_proto::{
    cpu_host_queue, gpu_card_queue, model_queue, DeviceInfo, DeviceKind, CPU_TOOLS, GPU_TOOLS,
};

use crate::{
    config::{CpuLane, GpuSelection},
    devices::GpuDevice,
};

/// One device and the queues it serves.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DevicePlan {
    /// The card, or `None` for the CPU.
    pub gpu: Option<GpuDevice>,
    /// The device's private queue, named in every result as `host_task_queue`.
    pub host_queue: String,
}

impl DevicePlan {
    /// What results say about the device.
    pub(crate) fn device_info(&self) -> DeviceInfo {
        match &self.gpu {
            Some(g) => DeviceInfo {
                kind: DeviceKind::Gpu,
                uuid: Some(g.uuid.clone()),
                index: Some(g.index),
                name: g.name.clone(),
                simulated: g.simulated,
            },
            None => DeviceInfo {
                kind: DeviceKind::Cpu,
                uuid: None,
                index: None,
                name: "cpu".to_owned(),
                simulated: false,
            },
        }
    }

    /// A short label for logs and identities: the card UUID or `cpu`.
    pub(crate) fn label(&self) -> &str {
        self.gpu.as_ref().map_or("cpu", |g| g.uuid.as_str())
    }

    /// The device's shared queue: `gpu-tools` or `cpu-tools`.
    pub(crate) fn shared_queue(&self) -> &'static str {
        if self.gpu.is_some() {
            GPU_TOOLS
        } else {
            CPU_TOOLS
        }
    }

    /// Every lane of the device once its models are known: the shared queue, a model
    /// queue for each of `model_queues` (served models that asked for one), then the
    /// private queue. Draining stops them in that order too: all but the private lane at
    /// once, the private lane after its window.
    pub(crate) fn lanes(&self, model_queues: &[&str]) -> Vec<LanePlan> {
        let shared = self.shared_queue();
        let mut lanes = vec![LanePlan {
            queue: shared.to_owned(),
            kind: LaneKind::Shared,
            route: Route::Shared(shared.to_owned()),
        }];
        lanes.extend(model_queues.iter().map(|m| {
            let queue = model_queue(shared, m);
            LanePlan {
                route: Route::Model {
                    queue: queue.clone(),
                    model: (*m).to_owned(),
                },
                queue,
                kind: LaneKind::Model,
            }
        }));
        lanes.push(LanePlan {
            queue: self.host_queue.clone(),
            kind: LaneKind::Private,
            route: Route::Private,
        });
        lanes
    }
}

/// What a lane's queue is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaneKind {
    /// `gpu-tools` / `cpu-tools`: every worker of the kind polls it.
    Shared,
    /// `gpu-tools@<model>`: every worker serving the model polls it.
    Model,
    /// The device's own queue: only this device polls it.
    Private,
}

impl LaneKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            LaneKind::Shared => "shared",
            LaneKind::Model => "model",
            LaneKind::Private => "private",
        }
    }
}

/// One lane to serve.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LanePlan {
    pub queue: String,
    pub kind: LaneKind,
    /// How its activities judge a model this worker lacks.
    pub route: Route,
}

/// Chooses devices and queues. `cards` is the visible inventory; `select` narrows it;
/// `cpu` decides the CPU lane (`Auto`: only when no card is served).
pub(crate) fn plan(
    host: &str,
    cards: &[GpuDevice],
    select: &GpuSelection,
    cpu: CpuLane,
) -> Vec<DevicePlan> {
    let chosen: Vec<&GpuDevice> = match select {
        GpuSelection::All => cards.iter().collect(),
        GpuSelection::None => Vec::new(),
        GpuSelection::Some(list) => cards
            .iter()
            .filter(|c| {
                list.iter().any(|s| {
                    s.parse::<u32>().ok() == Some(c.index) || s.eq_ignore_ascii_case(&c.uuid)
                })
            })
            .collect(),
    };
    let mut plans: Vec<DevicePlan> = chosen
        .into_iter()
        .map(|g| {
            let host_queue = gpu_card_queue(host, &g.uuid);
            DevicePlan {
                gpu: Some(g.clone()),
                host_queue,
            }
        })
        .collect();
    let want_cpu = match cpu {
        CpuLane::On => true,
        CpuLane::Off => false,
        CpuLane::Auto => plans.is_empty(),
    };
    if want_cpu {
        let host_queue = cpu_host_queue(host);
        plans.push(DevicePlan {
            gpu: None,
            host_queue,
        });
    }
    plans
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{DeviceInventory, SimulatedInventory};

    fn queues(p: &DevicePlan) -> Vec<String> {
        p.lanes(&[]).into_iter().map(|l| l.queue).collect()
    }

    fn cards(n: u32) -> Vec<GpuDevice> {
        SimulatedInventory::new(n, 16 << 30, Some("0"))
            .devices()
            .to_vec()
    }

    #[test]
    fn each_card_serves_shared_and_private_queue() {
        let p = plan("h1", &cards(2), &GpuSelection::All, CpuLane::Auto);
        assert_eq!(p.len(), 2, "no cpu lane when cards are served in auto mode");
        assert_eq!(queues(&p[0]), vec!["gpu-tools", "gpu-tools.h1.gpu-sim-0-0"]);
        assert_eq!(p[1].host_queue, "gpu-tools.h1.gpu-sim-0-1");
        assert_eq!(p[0].device_info().uuid.as_deref(), Some("GPU-SIM-0-0"));
        assert!(p[0].device_info().simulated);
    }

    #[test]
    fn model_queues_sit_between_the_shared_and_the_private_lane() {
        let p = plan("h1", &cards(1), &GpuSelection::All, CpuLane::Auto);
        let lanes = p[0].lanes(&["e5", "bge"]);
        let queues: Vec<&str> = lanes.iter().map(|l| l.queue.as_str()).collect();
        assert_eq!(
            queues,
            vec![
                "gpu-tools",
                "gpu-tools@e5",
                "gpu-tools@bge",
                "gpu-tools.h1.gpu-sim-0-0"
            ]
        );
        assert_eq!(lanes[0].route, Route::Shared("gpu-tools".into()));
        assert_eq!(
            lanes[1].route,
            Route::Model {
                queue: "gpu-tools@e5".into(),
                model: "e5".into()
            }
        );
        assert_eq!(lanes[3].kind, LaneKind::Private);
        let cpu = plan("h1", &[], &GpuSelection::All, CpuLane::Auto);
        assert_eq!(cpu[0].lanes(&["m"])[1].queue, "cpu-tools@m");
    }

    #[test]
    fn no_cards_means_cpu_lane() {
        let p = plan("h1", &[], &GpuSelection::All, CpuLane::Auto);
        assert_eq!(p.len(), 1);
        assert_eq!(queues(&p[0]), vec!["cpu-tools", "cpu-tools.h1"]);
        assert_eq!(p[0].device_info().kind, DeviceKind::Cpu);
    }

    #[test]
    fn flags_choose_cards_and_cpu() {
        let p = plan(
            "h",
            &cards(3),
            &GpuSelection::Some(vec!["2".into(), "GPU-SIM-0-0".into()]),
            CpuLane::On,
        );
        let labels: Vec<&str> = p.iter().map(DevicePlan::label).collect();
        assert_eq!(labels, vec!["GPU-SIM-0-0", "GPU-SIM-0-2", "cpu"]);
        assert!(plan("h", &cards(1), &GpuSelection::All, CpuLane::Off)
            .iter()
            .all(|p| p.gpu.is_some()));
        assert!(plan("h", &cards(1), &GpuSelection::None, CpuLane::Off).is_empty());
    }
}
