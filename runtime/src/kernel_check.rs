//! `gpulane kernel-check` (hidden): gpulane's own kernels on one device against the CPU
//! kernels (`gpulane_models::check_kernels`), as a table and optionally JSON; exits
//! non-zero when any check is out of bounds. `scripts/gpu-check.sh` runs it on a card.

use gpulane_models::{check_kernels, KernelCheck};
use serde::Serialize;

use crate::{bench, config::KernelCheckArgs, RuntimeError};

#[derive(Serialize)]
struct Row<'a> {
    op: &'a str,
    case: &'a str,
    dtype: &'a str,
    max_abs_diff: f32,
    max_scaled_diff: f32,
    bound: f32,
    ok: bool,
}

#[derive(Serialize)]
struct Report<'a> {
    device: &'a str,
    checks: Vec<Row<'a>>,
}

pub(crate) async fn run(args: &KernelCheckArgs) -> Result<(), RuntimeError> {
    // One device, named as `bench` names it; a card by its ordinal (no inventory read).
    let target = bench::targets(
        std::slice::from_ref(&args.device),
        || {
            Err(RuntimeError::Config(
                "kernel-check --device: name one card by its CUDA ordinal (cuda:N), or cpu".into(),
            ))
        },
        cfg!(feature = "cuda"),
    )?
    .into_iter()
    .next()
    .expect("one --device is one target; this is a bug");
    let label = target.label.clone();
    // Kernels, and the CUDA context, off the async runtime.
    let device = label.clone();
    let checks: Vec<KernelCheck> = tokio::task::spawn_blocking(move || {
        target
            .engine
            .open()
            .and_then(|d| check_kernels(&d))
            .map_err(|source| RuntimeError::Model {
                name: "kernel-check".to_owned(),
                device,
                source: Box::new(source),
            })
    })
    .await
    .expect("the kernel check does not panic; this is a bug")?;
    println!(
        "{:<17} {:<5} {:<26} {:>12} {:>15} {:>8}  ok",
        "op", "dtype", "case", "max_abs_diff", "max_scaled_diff", "bound"
    );
    for c in &checks {
        println!(
            "{:<17} {:<5} {:<26} {:>12.3e} {:>15.3e} {:>8.0e}  {}",
            c.op,
            c.dtype.as_str(),
            c.case,
            c.max_abs_diff,
            c.max_scaled_diff,
            c.bound,
            if c.ok() { "yes" } else { "NO" }
        );
    }
    if let Some(path) = &args.json {
        let report = Report {
            device: &label,
            checks: checks
                .iter()
                .map(|c| Row {
                    op: c.op,
                    case: &c.case,
                    dtype: c.dtype.as_str(),
                    max_abs_diff: c.max_abs_diff,
                    max_scaled_diff: c.max_scaled_diff,
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
            device: label,
            failed,
            total: checks.len(),
        });
    }
    Ok(())
}
