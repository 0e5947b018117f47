//! The binary's commands, each handed to the module that owns it.

use crate::{
    admin,
    config::{Cli, Command},
    reports, supervisor, RuntimeError,
};

/// Runs a parsed command line to completion.
pub async fn run_cli(cli: Cli) -> Result<(), RuntimeError> {
    // Before any model loads: f32 layers are packed for the route the level allows.
    if let Some(cap) = cli.cpu_isa.cap() {
        gpulane_models::cap_cpu_isa(cap);
    }
    tracing::debug!(cpu_isa = gpulane_models::cpu_isa().as_str(), "CPU kernels");
    match cli.command {
        Command::Run(args) => supervisor::run(*args).await,
        Command::Devices(args) => {
            reports::print_devices(&args);
            Ok(())
        }
        Command::Models(args) => reports::print_models(&args).await,
        Command::Bench(args) => crate::bench::run_bench(*args).await,
        Command::Admission(args) => reports::print_admission(&args).await,
        Command::Status(args) => admin::status_command(&args).await,
        Command::Drain(args) => admin::drain_command(&args).await,
        Command::Resume(args) => admin::resume_command(&args).await,
        Command::Schema => {
            print!("{}", gpulane_proto::contract_schema_text());
            Ok(())
        }
        Command::KernelCheck(args) => crate::kernel_check::run(&args).await,
    }
}
