//! `gpulane kernel-check` (hidden): gpulane's own kernels on one device against the CPU
//! kernels (`gpulane_models::check_kernels`), as a table and optionally JSON; exits
//! non-zero when any check is out of bounds. `scripts/gpu-check.sh` runs it on a card.

use gpulane_models::{check_kernels, Device, KernelCheck};
use serde::Serialize;

use crate::{config::KernelCheckArgs, RuntimeError};

#[derive(Serialize)]
struct Row<'a> {
    op: &'a str,
    case: &'a str,
    dtype: &'a str,
    max_abs_diff: f32,
    bound: f32,
    ok: bool,
}

#[derive(Serialize)]
struct Report<'a> {
    device: &'a str,
    checks: Vec<Row<'a>>,
}

/// `cpu` or `cuda:N`.
fn device(spec: &str) -> Result<Device, RuntimeError> {
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = spec
        .strip_prefix("cuda:")
        .and_then(|n| n.parse::<usize>().ok())
        .ok_or_else(|| {
            RuntimeError::Config(format!("--device {spec:?}: use cpu or cuda:N (an ordinal)"))
        })?;
    Device::new_cuda(ordinal).map_err(|e| {
        RuntimeError::Config(format!(
            "--device {spec}: {e} (CUDA needs the cuda build and a card)"
        ))
    })
}

pub(crate) async fn run(args: &KernelCheckArgs) -> Result<(), RuntimeError> {
    let spec = args.device.clone();
    // Kernels, and the CUDA context, off the async runtime.
    let checks: Vec<KernelCheck> = tokio::task::spawn_blocking(move || {
        let dev = device(&spec)?;
        check_kernels(&dev).map_err(|source| RuntimeError::Model {
            name: "kernel-check".to_owned(),
            device: spec.clone(),
            source: Box::new(source),
        })
    })
    .await
    .expect("the kernel check does not panic; this is a bug")?;
    println!(
        "{:<17} {:<5} {:<26} {:>12} {:>8}  ok",
        "op", "dtype", "case", "max_abs_diff", "bound"
    );
    for c in &checks {
        println!(
            "{:<17} {:<5} {:<26} {:>12.3e} {:>8.0e}  {}",
            c.op,
            c.dtype.as_str(),
            c.case,
            c.max_abs_diff,
            c.bound,
            if c.ok() { "yes" } else { "NO" }
        );
    }
    if let Some(path) = &args.json {
        let report = Report {
            device: &args.device,
            checks: checks
                .iter()
                .map(|c| Row {
                    op: c.op,
                    case: &c.case,
                    dtype: c.dtype.as_str(),
                    max_abs_diff: c.max_abs_diff,
                    bound: c.bound,
                    ok: c.ok(),
                })
                .collect(),
        };
        let mut bytes = serde_json::to_vec_pretty(&report)
            .expect("the report always serialises; this is a bug");
        bytes.push(b'\n');
        std::fs::write(path, bytes).map_err(|source| RuntimeError::Write {
            path: path.clone(),
            source,
        })?;
    }
    let failed = checks.iter().filter(|c| !c.ok()).count();
    if failed > 0 {
        return Err(RuntimeError::KernelCheck {
            device: args.device.clone(),
            failed,
            total: checks.len(),
        });
    }
    Ok(())
}
