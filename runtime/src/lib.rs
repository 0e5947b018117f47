//! The gpulane worker daemon: reads the machine's devices, plans its lanes (task queues),
//! loads one engine per (device, model), and serves each lane with an sdk-core worker whose
//! activity slots come from a supplier shared by the device's lanes.
//!
//! The `gpulane` binary is a thin shell over [`run_cli`].
#![warn(missing_docs)]

mod admission;
mod bench;
mod config;
mod daemon;
mod devices;
mod error;
mod lanes;
mod metrics;
mod registry;
mod temporal;
mod units;
mod worker;

pub use crate::{
    bench::{BenchArgs, BenchDevice},
    config::{Cli, Command, CpuLane, DeviceArgs, ModelArgs, RunArgs, Secret},
    daemon::run_cli,
    devices::DeviceError,
    error::RuntimeError,
};
