use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    // NVML numbers cards in PCI bus order; CUDA, by default, fastest first. Make CUDA agree
    // before anything can initialise it, so a card's CUDA ordinal and NVML index match.
    // No other thread exists yet, so changing the environment races with nothing.
    std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = gpulane::Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(gpulane::run_cli(cli))?;
    Ok(())
}
