//! The int8 product on AMX (Intel Sapphire Rapids and later): `tdpbusd` multiplies a
//! 16-row by 64-byte tile of quantized rows by a 16-group tile of weights into 16 × 16 i32
//! sums, 16,384 byte products an instruction where VNNI's `vpdpbusd` does 64.
//!
//! No repacking: the weights' VNNI layout (`[panel][group of 4 inputs][16 columns][4]`) is
//! already AMX's B layout, so 16 consecutive groups of a panel are one 1 KiB tile, rows 64
//! bytes apart. The sums are the same exact integers, so this route agrees with the others
//! bit for bit; only the epilogue's f32 steps follow, shared with the VNNI route
//! ([`super::avx512::store`]).
//!
//! Tiles are reached through inline assembly: Rust's AMX intrinsics are not stable. The
//! tile registers are state the compiler never allocates, so they live from one `asm!`
//! statement to the next within [`matmul`], which configures them on entry and releases
//! them on exit (a thread's tiles are then back in their initial state, which keeps its
//! context switches as cheap as before). `CpuIsa::runs_here` asked the kernel for the
//! permission (`arch_prctl`) before any route could be AMX.

use std::arch::{asm, x86_64::*};

use super::{avx512::store, Out, PANEL, TILE_BYTES, TILE_ROWS};

type Job<'a> = super::avx512::Job<'a>;

/// `ldtilecfg`'s 64-byte operand (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// All eight tiles 16 rows of 64 bytes: every A tile (16 quantized rows × 64 inputs), B
/// tile (16 groups × 16 columns × 4 bytes) and C tile (16 rows × 16 i32 sums) is that
/// shape. Tiles 0-3 hold sums (two row tiles × two panels), 4-5 rows, 6-7 weights.
const CONFIG: TileConfig = {
    let mut colsb = [0u16; 16];
    let mut rows = [0u8; 16];
    let mut t = 0;
    while t < 8 {
        colsb[t] = TILE_BYTES as u16;
        rows[t] = TILE_ROWS as u8;
        t += 1;
    }
    TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb,
        rows,
    }
};

/// Bytes of one panel's 16 groups: one B tile.
const B_TILE: usize = TILE_ROWS * PANEL * 4;

/// Loads tile `T` from 16 rows `stride` bytes apart.
#[inline(always)]
unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
    asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) p, s = in(reg) stride,
         options(nostack, readonly, preserves_flags));
}

/// `C += A · B` over tiles: u8 rows by i8 weights into i32 sums.
#[inline(always)]
unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
    asm!("tdpbusd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
         options(nostack, nomem, preserves_flags));
}

/// Stores tile `T`'s 16 × 16 sums.
#[inline(always)]
unsafe fn save<const T: u8>(out: &mut [i32; TILE_ROWS * PANEL]) {
    asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) out.as_mut_ptr(),
         s = in(reg) TILE_BYTES, options(nostack, preserves_flags));
}

/// `y = epi(dequant(qa · packedᵀ))` for `rows` quantized rows, in blocks of two row tiles
/// by two panels (32 rows × 32 columns: four sum tiles, two row tiles and two weight
/// tiles fill AMX's eight), each over the whole inner dimension.
///
/// # Safety
/// The CPU has AMX-INT8 and AVX-512 BW, this process may use its tiles, `j.lda` is a
/// multiple of 64 and `j.qa` holds `rows` rounded up to 16 rows of `j.lda` bytes.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn matmul(j: &Job, rows: usize, y: &mut [Out]) {
    let l = j.l;
    let lda = j.lda;
    let chunks = lda / TILE_BYTES;
    let panel_bytes = l.panel_stride;
    let panels = l.n.div_ceil(PANEL);
    let tiles = rows.div_ceil(TILE_ROWS);
    // The last B tile read ends `chunks` tiles into the last panel, past the panel itself
    // where `k4` is not a multiple of 64: within the packing's tail, by construction.
    assert!(
        (panels - 1) * panel_bytes + chunks * B_TILE <= l.w.len(),
        "AMX would read past the packed weights; this is a bug"
    );
    let mut sums = [[0i32; TILE_ROWS * PANEL]; 4];
    asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags));
    for p in (0..panels).step_by(2) {
        let two_panels = p + 1 < panels;
        let b0 = l.w.as_ptr().add(p * panel_bytes) as *const u8;
        let b1 = b0.add(panel_bytes);
        for t in (0..tiles).step_by(2) {
            let two_tiles = t + 1 < tiles;
            let a0 = j.qa.as_ptr().add(t * TILE_ROWS * lda);
            let a1 = a0.add(TILE_ROWS * lda);
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem, preserves_flags)
            );
            for c in 0..chunks {
                load::<4>(a0.add(c * TILE_BYTES), lda);
                load::<6>(b0.add(c * B_TILE), TILE_BYTES);
                dot::<0, 4, 6>();
                if two_panels {
                    load::<7>(b1.add(c * B_TILE), TILE_BYTES);
                    dot::<1, 4, 7>();
                }
                if two_tiles {
                    load::<5>(a1.add(c * TILE_BYTES), lda);
                    dot::<2, 5, 6>();
                    if two_panels {
                        dot::<3, 5, 7>();
                    }
                }
            }
            save::<0>(&mut sums[0]);
            save::<1>(&mut sums[1]);
            save::<2>(&mut sums[2]);
            save::<3>(&mut sums[3]);
            // Sum tile 2·(row tile) + panel: rows past `rows` are padding, never stored.
            for (s, sums) in sums.iter().enumerate() {
                let (tt, pp) = (t + s / 2, p + s % 2);
                if tt >= tiles || pp >= panels {
                    continue;
                }
                let first = tt * TILE_ROWS;
                for i in 0..TILE_ROWS.min(rows - first) {
                    let row = first + i;
                    let acc = _mm512_loadu_si512(sums.as_ptr().add(i * PANEL) as *const _);
                    let dst = y.as_mut_ptr().add(row * j.ldy) as *mut f32;
                    store(j, j.sa[row], acc, pp * PANEL, dst);
                }
            }
        }
    }
    asm!("tilerelease", options(nostack, nomem, preserves_flags));
}
