//! Builds models/cuda/kernels.cu two ways:
//!
//! - always, the f32 kernel bodies for the CPU under the SIMT emulator (`cuda/simt.h`), a
//!   static library only the tests call (models/src/simt_tests.rs), so every CPU test run
//!   checks the kernels a card will run; a binary that never calls it links none of it;
//! - with the `cuda` feature, PTX for `CUDA_COMPUTE_CAP` (default 90) by nvcc from
//!   `CUDA_HOME`/bin or the PATH, which models/src/cuda.rs embeds and candle loads. PTX
//!   (not a cubin) so that the driver compiles it for the card it runs on, as candle's own
//!   kernels ship.

use std::{env, path::PathBuf, process::Command};

fn main() {
    for f in ["cuda/kernels.cu", "cuda/simt.h", "cuda/emulate.cpp"] {
        println!("cargo:rerun-if-changed={f}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .opt_level(2)
        .warnings(true)
        // `#pragma unroll` is nvcc's; the host compiler needs no hint.
        .flag("-Wno-unknown-pragmas")
        .file("cuda/emulate.cpp")
        .compile("gpulane_simt");
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        ptx();
    }
}

fn ptx() {
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".to_owned());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("gpulane.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&out)
        .arg("cuda/kernels.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "running {} for models/cuda/kernels.cu: {e} (the cuda feature needs nvcc: \
                 scripts/cuda-build.sh sets CUDA_HOME)",
                nvcc.display()
            )
        });
    assert!(
        status.success(),
        "nvcc failed on models/cuda/kernels.cu ({status})"
    );
}
