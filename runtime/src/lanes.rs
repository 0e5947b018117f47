//! Which task queues this host serves, and for which device. A *lane* is one task queue
//! served by one device; a card serves two (the shared `gpu-tools` and its private
//! queue), the CPU serves `cpu-tools` and the host's private CPU queue. Names come from
//! `gpulane_proto`, the one place workflow authors read them from.

use gpulane_proto::{cpu_host_queue, gpu_card_queue, DeviceInfo, DeviceKind, CPU_TOOLS, GPU_TOOLS};

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
    /// Every queue served: the shared lane first, then the private one.
    pub queues: Vec<String>,
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
                queues: vec![GPU_TOOLS.to_owned(), host_queue.clone()],
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
            queues: vec![CPU_TOOLS.to_owned(), host_queue.clone()],
            host_queue,
        });
    }
    plans
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{DeviceInventory, SimulatedInventory};

    fn cards(n: u32) -> Vec<GpuDevice> {
        SimulatedInventory::new(n, 16 << 30).devices().to_vec()
    }

    #[test]
    fn each_card_serves_shared_and_private_queue() {
        let p = plan("h1", &cards(2), &GpuSelection::All, CpuLane::Auto);
        assert_eq!(p.len(), 2, "no cpu lane when cards are served in auto mode");
        assert_eq!(p[0].queues, vec!["gpu-tools", "gpu-tools.h1.gpu-sim-0"]);
        assert_eq!(p[1].host_queue, "gpu-tools.h1.gpu-sim-1");
        assert_eq!(p[0].device_info().uuid.as_deref(), Some("GPU-SIM-0"));
        assert!(p[0].device_info().simulated);
    }

    #[test]
    fn no_cards_means_cpu_lane() {
        let p = plan("h1", &[], &GpuSelection::All, CpuLane::Auto);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].queues, vec!["cpu-tools", "cpu-tools.h1"]);
        assert_eq!(p[0].device_info().kind, DeviceKind::Cpu);
    }

    #[test]
    fn flags_choose_cards_and_cpu() {
        let p = plan(
            "h",
            &cards(3),
            &GpuSelection::Some(vec!["2".into(), "GPU-SIM-0".into()]),
            CpuLane::On,
        );
        let labels: Vec<&str> = p.iter().map(DevicePlan::label).collect();
        assert_eq!(labels, vec!["GPU-SIM-0", "GPU-SIM-2", "cpu"]);
        assert!(plan("h", &cards(1), &GpuSelection::All, CpuLane::Off)
            .iter()
            .all(|p| p.gpu.is_some()));
        assert!(plan("h", &cards(1), &GpuSelection::None, CpuLane::Off).is_empty());
    }
}
