//! The gpulane worker daemon: reads the machine's devices, plans its lanes (task queues),
//! loads one engine per (device, model), serves each lane with an sdk-core worker whose
//! activity slots come from a supplier shared by the device's lanes, and supervises it
//! all: metrics, probes, the admin API (drain, resume, status) and shutdown.
//!
//! The `gpulane` binary is a thin shell over [`run_cli`].
#![warn(missing_docs)]

mod admin;
mod admission;
mod bench;
mod cli;
mod config;
mod devices;
mod error;
mod health;
mod heap;
mod http;
mod kernel_check;
mod lanes;
mod metrics;
mod registry;
mod reports;
mod settings;
mod startup;
mod supervisor;
mod temporal;
mod units;
mod worker;

pub use crate::{
    bench::{BenchArgs, BenchDevice},
    cli::run_cli,
    config::{
        AdminArgs, Cli, Command, CpuLane, DeviceArgs, DeviceTarget, ModelArgs, RunArgs, Secret,
        StatusArgs,
    },
    devices::DeviceError,
    error::RuntimeError,
};
