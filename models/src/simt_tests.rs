//! gpulane's CUDA kernels (`models/cuda/kernels.cu`), run on the CPU under the SIMT
//! emulator (`models/cuda/simt.h`, built by `build.rs`) with the launch geometry a card
//! gets, against the CPU kernels they stand in for. This checks the kernel bodies (lane
//! and warp indexing, the shuffle reductions, the online softmax, the key ranges and the
//! grouped-query and relative-bias offsets) on every machine; only f32 storage exists
//! here, so f16/bf16 and the driver are left to `scripts/gpu-check.sh` on a card.

use candle_core::{DType, Device, Tensor};

use crate::{
    kernel_check::{attention_inputs, masks, max_abs_diff, HEADS, LENS},
    kernels::{self, CardOps, Heads, Keys, Mask, Products},
    varlen::{dims_per_lane, key_ranges, launch_geometry, row_starts},
};

extern "C" {
    fn gpulane_simt_varlen_attention(
        grid: u32,
        block: u32,
        dpl: u32,
        qkv: *const f32,
        keys: *const u32,
        rel: *const f32,
        out: *mut f32,
        n: u32,
        nq: u32,
        nkv: u32,
        d: u32,
        span: u32,
    );
    fn gpulane_simt_add_norm(
        grid: u32,
        block: u32,
        x: *const f32,
        res: *const f32,
        params: *const f32,
        out: *mut f32,
        rows: u32,
        h: u32,
        eps: f32,
    );
    fn gpulane_simt_bias_gelu(
        grid: u32,
        block: u32,
        x: *const f32,
        bias: *const f32,
        out: *mut f32,
        rows: u32,
        h: u32,
    );
    fn gpulane_simt_gated_gelu(
        grid: u32,
        block: u32,
        x: *const f32,
        out: *mut f32,
        rows: u32,
        i: u32,
    );
}

fn randn(n: usize, scale: f32) -> Vec<f32> {
    let t = Tensor::randn(0f32, scale, n, &Device::Cpu).unwrap();
    t.to_vec1().unwrap()
}

/// The emulated kernel's context for packed `qkv`, as `varlen.rs` would launch it.
fn emulated_attention(
    qkv: &[f32],
    starts: &[usize],
    lens: &[usize],
    heads: Heads,
    mask: &Mask,
) -> Vec<f32> {
    let n: usize = lens.iter().sum();
    let ranges = key_ranges(starts, lens, Keys::of(mask));
    let (rel, span) = match mask {
        Mask::Relative(r) => (r.table.as_ptr(), r.span as u32),
        _ => (std::ptr::null(), 0),
    };
    let mut out = vec![f32::NAN; n * heads.q * heads.d];
    let (grid, block) = launch_geometry(n * heads.q);
    let dpl = dims_per_lane(heads.d).expect("a head the kernel serves");
    // SAFETY: every buffer is as long as the kernel reads and writes for these sizes.
    unsafe {
        gpulane_simt_varlen_attention(
            grid,
            block,
            dpl,
            qkv.as_ptr(),
            ranges.as_ptr(),
            rel,
            out.as_mut_ptr(),
            n as u32,
            heads.q as u32,
            heads.kv as u32,
            heads.d as u32,
            span,
        );
    }
    out
}

/// The packed kernel's, the reference.
fn packed_attention(
    qkv: &[f32],
    starts: &[usize],
    lens: &[usize],
    heads: Heads,
    mask: Mask,
) -> Vec<f32> {
    let n: usize = lens.iter().sum();
    let t = Tensor::from_slice(qkv, (n, heads.qkv_width()), &Device::Cpu).unwrap();
    kernels::attention(&t, starts, lens, heads, mask, Products::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The kernel check's cases (`kernel_check.rs`: rows of mixed lengths, one of a single
/// token; heads of every lane split the kernel has, grouped-query heads included; every
/// mask), under the emulator; the token count leaves the last block's warps partly past
/// the end.
#[test]
fn emulated_varlen_kernel_matches_the_packed_cpu_kernel() {
    let starts = row_starts(&LENS);
    for heads in HEADS {
        let (qkv, relative) = attention_inputs(heads, DType::F32, &Device::Cpu).unwrap();
        let qkv: Vec<f32> = qkv.flatten_all().unwrap().to_vec1().unwrap();
        for (_, mask) in masks(&relative) {
            let want = packed_attention(&qkv, &starts, &LENS, heads, mask);
            let got = emulated_attention(&qkv, &starts, &LENS, heads, &mask);
            let diff = max_abs_diff(&want, &got);
            assert!(diff < 1e-5, "{heads:?}, {mask:?}: max diff {diff}");
        }
    }
}

/// Rows whose width is not a multiple of a warp, and a row count that leaves the last
/// block partly empty.
#[test]
fn emulated_row_kernels_match_the_cpu_kernels() {
    let (rows, h) = (9usize, 40usize);
    let x = randn(rows * h, 2.0);
    let res = randn(rows * h, 2.0);
    let mut params = randn(3 * h, 0.5);
    for g in &mut params[h..2 * h] {
        *g += 1.0;
    }
    let eps = 1e-12f32;
    let (grid, block) = launch_geometry(rows);
    let t = |v: &[f32], shape: (usize, usize)| Tensor::from_slice(v, shape, &Device::Cpu).unwrap();
    let flat = |t: Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };

    let mut out = vec![f32::NAN; rows * h];
    // SAFETY: buffers sized for rows × h, params 3 × h.
    unsafe {
        gpulane_simt_add_norm(
            grid,
            block,
            x.as_ptr(),
            res.as_ptr(),
            params.as_ptr(),
            out.as_mut_ptr(),
            rows as u32,
            h as u32,
            eps,
        );
    }
    let want = flat(
        kernels::add_norm(
            &t(&x, (rows, h)),
            &t(&res, (rows, h)),
            &t(&params, (3, h)),
            eps,
            CardOps::Gpulane,
        )
        .unwrap(),
    );
    let diff = max_abs_diff(&want, &out);
    assert!(diff < 1e-4, "add-norm: max diff {diff}");

    let bias = &params[..h];
    let mut out = vec![f32::NAN; rows * h];
    // SAFETY: as above, bias h.
    unsafe {
        gpulane_simt_bias_gelu(
            grid,
            block,
            x.as_ptr(),
            bias.as_ptr(),
            out.as_mut_ptr(),
            rows as u32,
            h as u32,
        );
    }
    let bias_t = Tensor::from_slice(bias, h, &Device::Cpu).unwrap();
    let want = flat(kernels::bias_gelu(&t(&x, (rows, h)), &bias_t, CardOps::Gpulane).unwrap());
    let diff = max_abs_diff(&want, &out);
    assert!(diff < 1e-5, "bias-gelu: max diff {diff}");

    let i = h / 2;
    let mut out = vec![f32::NAN; rows * i];
    // SAFETY: x is rows × 2i, out rows × i.
    unsafe {
        gpulane_simt_gated_gelu(
            grid,
            block,
            x.as_ptr(),
            out.as_mut_ptr(),
            rows as u32,
            i as u32,
        );
    }
    let want = flat(kernels::gated_gelu(&t(&x, (rows, h)), CardOps::Gpulane).unwrap());
    let diff = max_abs_diff(&want, &out);
    assert!(diff < 1e-5, "gated-gelu: max diff {diff}");
}
