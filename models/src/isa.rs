//! Which x86 vector extensions the CPU kernels may use: what the CPU has, capped by the
//! operator (`--cpu-isa`); and the one cache size the kernels plan by (`l2_bytes`).
//!
//! Why a cap: the kernels pick their widest route at run time, so on an AVX-512 machine
//! (this project's CI and benchmark hosts) the AVX2 and portable routes would never run
//! end to end. Capping the process runs them there, for tests against the fixtures and for
//! benchmarks of what an AVX2-only CPU (AMD Zen 2/3, most desktops) gets; in production it
//! is also the way out should a wide route misbehave on some CPU. `gemm`, under candle's
//! matmul, keeps its own detection: the cap covers gpulane's kernels only.

use std::sync::atomic::{AtomicU8, Ordering};

/// A level of x86 vector support, each including the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuIsa {
    /// No wide vectors assumed: the portable, auto-vectorized bodies (SSE2 on x86-64).
    Baseline,
    /// AVX2 with FMA: 256-bit registers, 16 of them.
    Avx2,
    /// AVX-512 F: 512-bit registers, 32 of them.
    Avx512,
    /// AVX-512 F, BW and VNNI: the int8 kernel's `vpdpbusd`.
    Avx512Vnni,
    /// The above and AMX-INT8's tiles, which the kernel lets this process use: the int8
    /// kernel's `tdpbusd` (f32 layers stay on AVX-512).
    Amx,
}

impl CpuIsa {
    /// Its name, as `--cpu-isa` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuIsa::Baseline => "baseline",
            CpuIsa::Avx2 => "avx2",
            CpuIsa::Avx512 => "avx512",
            CpuIsa::Avx512Vnni => "avx512-vnni",
            CpuIsa::Amx => "amx",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => CpuIsa::Baseline,
            1 => CpuIsa::Avx2,
            2 => CpuIsa::Avx512,
            3 => CpuIsa::Avx512Vnni,
            _ => CpuIsa::Amx,
        }
    }

    /// What this CPU has, AMX only where Linux grants this process its tiles (asked the
    /// first time the answer needs it, see [`amx_granted`]).
    pub fn detected() -> Self {
        usable(cpu_level())
    }

    /// Whether this level's routes may run here: the CPU has it and, for AMX, Linux
    /// granted the tiles. Only an AMX level asks for them.
    pub(crate) fn runs_here(self) -> bool {
        self <= cpu_level() && (self < CpuIsa::Amx || amx_granted())
    }
}

/// The CPU's level by CPUID alone (checked once): AMX when it has AMX-INT8 (and VNNI),
/// whether or not the tiles are usable yet.
fn cpu_level() -> CpuIsa {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<CpuIsa> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            use std::arch::is_x86_feature_detected as has;
            if !(has!("avx2") && has!("fma")) {
                CpuIsa::Baseline
            } else if !has!("avx512f") {
                CpuIsa::Avx2
            } else if has!("avx512bw") && has!("avx512vnni") {
                // CPUID leaf 7, sub-leaf 0: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
                let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
                if edx & (3 << 24) == 3 << 24 {
                    CpuIsa::Amx
                } else {
                    CpuIsa::Avx512Vnni
                }
            } else {
                CpuIsa::Avx512
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        CpuIsa::Baseline
    }
}

/// `level` (at most the CPU's), or AVX-512 VNNI where it is AMX and Linux refuses the
/// tiles: [`CpuIsa::runs_here`]'s rule. Only an AMX level asks.
fn usable(level: CpuIsa) -> CpuIsa {
    if level.runs_here() {
        level
    } else {
        CpuIsa::Avx512Vnni
    }
}

/// Whether Linux lets this process use the AMX tiles (asked once). Linux keeps the tiles'
/// 8 KiB of state off until a process asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and a tile
/// instruction before that faults; one grant covers every thread. Asked only when a level
/// at or above AMX is about to be used, so `--cpu-isa avx512` never makes the call (the
/// way around a sandbox that objects to it). The answer is logged, since a kernel or
/// hypervisor that withholds AMX is otherwise silent.
fn amx_granted() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            };
            if r == 0 {
                tracing::debug!("AMX tiles enabled for the int8 kernel");
                true
            } else {
                let why = std::io::Error::last_os_error();
                tracing::warn!(%why, "the CPU has AMX-INT8 but the kernel refused its tiles; int8 runs on AVX-512 VNNI");
                false
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// One core's L2 cache in bytes, as Linux reports it (read once); where it does not say,
/// 2 MiB, the L2 of the Xeon the f32 kernel's chunks were measured on. The kernel sizes
/// those chunks of panels by it, so a CPU with less L2 (AMD Zen 4/5: 1 MiB) takes smaller
/// chunks instead of spilling them to L3.
pub(crate) fn l2_bytes() -> usize {
    static L2: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *L2.get_or_init(|| {
        (0..8)
            .find_map(|i| {
                let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
                let level = std::fs::read_to_string(format!("{dir}/level")).ok()?;
                if level.trim() != "2" {
                    return None;
                }
                parse_cache_size(&std::fs::read_to_string(format!("{dir}/size")).ok()?)
            })
            .unwrap_or(2 << 20)
    })
}

/// A sysfs cache size (`2048K`, `1M`, `512`) in bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .filter(|&v| v > 0)
        .and_then(|v| v.checked_mul(unit))
}

/// The cap, as a `CpuIsa` discriminant; none until [`cap_cpu_isa`] is called.
static CAP: AtomicU8 = AtomicU8::new(u8::MAX);

/// Keeps the CPU kernels at or below `cap` from now on. Call it before loading models:
/// f32 layers are packed at load for the route the level then allows.
pub fn cap_cpu_isa(cap: CpuIsa) {
    CAP.store(cap as u8, Ordering::Relaxed);
}

/// What the kernels may use: the CPU's level, capped. A cap below AMX never asks Linux for
/// the tiles.
pub fn cpu_isa() -> CpuIsa {
    usable(cpu_level().min(CpuIsa::from_u8(CAP.load(Ordering::Relaxed))))
}

/// The first `live` of 8 i32/f32 lanes set (all eight if `live` ≥ 8), as AVX2's
/// `maskload`/`maskstore` take them: AVX2 has no mask registers, so every AVX2 route's
/// partial vectors (a row's tail, a panel's last columns) go through this.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) fn avx2_lanes(live: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(live.min(8) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// The first `live` of 16 lanes set (all sixteen if `live` ≥ 16), as an AVX-512 mask: every
/// AVX-512 route's partial vectors (a row's tail, a panel's last columns) go through this.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512_lanes(live: usize) -> std::arch::x86_64::__mmask16 {
    if live >= 16 {
        !0
    } else {
        (1u16 << live) - 1
    }
}

/// Stores four vectors of sixteen i32 levels, each in 0..=255, as 64 bytes in order at
/// `p`: one 64-byte store where narrowing each vector with its own store (`vpmovusdb`)
/// costs about four uops a 16-byte store on Intel. Both packs work within 128-bit lanes:
/// lane L of the bytes holds four values of each input in turn, [a 4L..4L+3, b .., c ..,
/// d ..], and the permutation puts the dwords back. Levels in range, neither pack
/// saturates.
///
/// # Safety
/// The CPU has AVX-512 F and BW, and `p` is writable for 64 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn store_levels64(p: *mut u8, [a, b, c, d]: [std::arch::x86_64::__m512i; 4]) {
    use std::arch::x86_64::*;
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let bytes = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
    _mm512_storeu_si512(p.cast(), _mm512_permutexvar_epi32(order, bytes));
}

/// Stores the first `live` ≤ 8 lanes of `v` at `p`: a plain store when all eight are
/// live, a masked one only for a partial vector, since on Zen 2 and 3 a masked 256-bit
/// store (`vmaskmovps`) is microcoded.
///
/// # Safety
/// `p` is writable for `live` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn avx2_store(p: *mut f32, live: usize, v: std::arch::x86_64::__m256) {
    use std::arch::x86_64::*;
    if live >= 8 {
        _mm256_storeu_ps(p, v);
    } else {
        _mm256_maskstore_ps(p, avx2_lanes(live), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sysfs writes sizes with a unit letter or none; anything else is not a size.
    #[test]
    fn cache_sizes_parse_with_and_without_units() {
        assert_eq!(parse_cache_size("2048K\n"), Some(2 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        for bad in ["", "K", "0K", "big", "-1K", "99999999999999999999M"] {
            assert_eq!(parse_cache_size(bad), None, "{bad:?}");
        }
        assert!(l2_bytes() > 0);
    }

    #[test]
    fn levels_round_trip_and_order() {
        for isa in [
            CpuIsa::Baseline,
            CpuIsa::Avx2,
            CpuIsa::Avx512,
            CpuIsa::Avx512Vnni,
            CpuIsa::Amx,
        ] {
            assert_eq!(CpuIsa::from_u8(isa as u8), isa);
        }
        assert!(CpuIsa::Baseline < CpuIsa::Avx2 && CpuIsa::Avx512 < CpuIsa::Avx512Vnni);
        assert!(CpuIsa::Avx512Vnni < CpuIsa::Amx);
        // No cap set in this test binary: the level is the CPU's.
        assert_eq!(cpu_isa(), CpuIsa::detected());
    }
}
