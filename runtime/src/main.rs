use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    // NVML numbers cards in PCI bus order; CUDA, by default, fastest first. Make CUDA agree
    // before anything can initialise it, so a card's CUDA ordinal and NVML index match.
    // No other thread exists yet, so changing the environment races with nothing.
    std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = gpulane::Cli::parse();
    set_cpu_threads(cli.cpu_threads);
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| {
            let result = rt.block_on(gpulane::run_cli(cli));
            // Dropping a runtime waits for its blocking tasks for ever (a model still
            // loading for a recovered card, an NVML call on a card that fell off the bus);
            // the stop has already had its deadline, so give them a moment only.
            rt.shutdown_timeout(std::time::Duration::from_secs(5));
            result.map_err(anyhow::Error::from)
        });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The error and its causes on one line, for people and log collectors; no
            // backtrace: these are operational errors, not bugs.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Fixes candle's CPU thread count once. Without RAYON_NUM_THREADS candle asks for the
/// CPU count on every matrix multiply, and the standard library answers by reading
/// /proc and the cgroup files each time (2,076 opens in one run). Called before any
/// other thread exists, so changing the environment races with nothing.
fn set_cpu_threads(flag: Option<u16>) {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let n = flag.map(usize::from).unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
}

/// Stops glibc's malloc from handing every large activation buffer back to the kernel.
/// By default allocations over 128 KiB (the threshold then adapts, up to 32 MiB) are
/// mmap'ed and unmapped on free, so each forward pass faults in and zeroes fresh pages
/// for every temporary tensor: the page faults were 10-20% of a CPU embed in profiles.
/// With mmap off for anything under 1 GiB and trimming off, freed buffers stay in the heap
/// and the next batch reuses them; the heap peaks at about one batch's working memory.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; it is called before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
        // Grow the heap in 64 MiB steps rather than page by page.
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
