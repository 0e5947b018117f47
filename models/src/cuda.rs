//! Launches gpulane's own CUDA kernels (`models/cuda/kernels.cu`, built to PTX by
//! `build.rs`) on candle's CUDA storage: packed attention and the fused bias + GELU,
//! gated GELU and bias + residual + LayerNorm steps. Each reads its inputs in place
//! (contiguous, at their layouts' offsets) and writes a new buffer, on candle's stream.
//!
//! The kernel bodies are checked on the CPU under the SIMT emulator (`simt_tests.rs`)
//! with the geometry [`launch_geometry`] gives; what only a card shows (f16/bf16 storage,
//! the driver's JIT) is checked by `scripts/gpu-check.sh`.

use candle_core::{
    backend::BackendStorage,
    cuda_backend::{
        cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg},
        CudaDType, WrapErr,
    },
    CudaDevice, CudaStorage, DType, Layout, Result, WithDType,
};

use crate::{
    kernels::Heads,
    varlen::{dims_per_lane, launch_geometry},
};

/// The PTX nvcc made of `models/cuda/kernels.cu`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gpulane.ptx"));
/// The name candle caches the loaded module under.
const MODULE: &str = "gpulane-kernels";

fn config(items: usize) -> LaunchConfig {
    let (grid, block) = launch_geometry(items);
    LaunchConfig {
        grid_dim: (grid.max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn view<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let slice: &CudaSlice<T> = s.as_cuda_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(slice.slice(a..b)),
        None => candle_core::bail!("{what}: input must be contiguous"),
    }
}

/// An output buffer of `len` values for a kernel that writes each of them, so it is not
/// zeroed first.
fn output<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: written in full by the kernel before anything reads it (see above).
    unsafe { dev.alloc::<T>(len) }
}

/// Loads kernel `name` (once per device), pushes the arguments in the kernel's order (the
/// output as `&mut`, so cudarc records the kernel's write), and launches `items` warps of
/// work.
macro_rules! launch {
    ($dev:expr, $name:expr, $items:expr, $($arg:expr),+ $(,)?) => {{
        let func = $dev.get_or_load_custom_func(&$name, MODULE, PTX)?;
        let mut b = func.builder();
        $( b.arg($arg); )+
        // SAFETY: the argument list is the kernel's signature, in order.
        unsafe { b.launch(config($items)) }.w()
    }};
}

fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} {x} exceeds u32")))
}

/// Runs `f` for the storage's dtype (f32, f16, bf16), which names the kernel.
macro_rules! by_dtype {
    ($s:expr, $f:ident ( $($arg:expr),* )) => {
        match $s.dtype() {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            other => candle_core::bail!("gpulane's CUDA kernels run f32, f16 and bf16, not {other:?}"),
        }
    };
}

/// One packed attention's operands (see `varlen.rs`): `qkv`, the key ranges and, for a
/// relative bias, its table, each with its layout; `n` tokens of `heads`.
pub(crate) struct VarlenArgs<'a> {
    pub(crate) qkv: (&'a CudaStorage, &'a Layout),
    pub(crate) ranges: (&'a CudaStorage, &'a Layout),
    pub(crate) rel: Option<(&'a CudaStorage, &'a Layout)>,
    pub(crate) n: usize,
    pub(crate) heads: Heads,
    pub(crate) span: usize,
}

/// Packed attention: `[n, q·d]`.
pub(crate) fn varlen_attention(a: &VarlenArgs) -> Result<CudaStorage> {
    by_dtype!(a.qkv.0, attention(a))
}

fn attention<T: CudaDType + DeviceRepr + WithDType>(a: &VarlenArgs) -> Result<CudaStorage> {
    let VarlenArgs {
        qkv: (qkv, l_qkv),
        ranges: (ranges, l_ranges),
        rel,
        n,
        heads,
        span,
    } = *a;
    let dev: &CudaDevice = qkv.device();
    let dpl = dims_per_lane(heads.d)
        .ok_or_else(|| candle_core::Error::Msg(format!("attention heads of {} > 256", heads.d)))?;
    let name = format!("varlen_attention_{}_{dpl}", T::DTYPE.as_str());
    let mut out = output::<T>(dev, n * heads.q * heads.d)?;
    let src = view::<T>(qkv, l_qkv, "varlen qkv")?;
    let keys = view::<u32>(ranges, l_ranges, "varlen key ranges")?;
    let (n32, q, kv, d, span32) = (
        u32_of(n, "tokens")?,
        u32_of(heads.q, "heads")?,
        u32_of(heads.kv, "kv heads")?,
        u32_of(heads.d, "head size")?,
        u32_of(span, "relative span")?,
    );
    let items = n * heads.q;
    match rel {
        Some((s, l)) => {
            let table = view::<f32>(s, l, "varlen relative bias")?;
            launch!(dev, name, items, &src, &keys, &table, &mut out, &n32, &q, &kv, &d, &span32)?;
        }
        None => {
            // Unread when span is 0: a null pointer.
            let null: u64 = 0;
            launch!(dev, name, items, &src, &keys, &null, &mut out, &n32, &q, &kv, &d, &span32)?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// LayerNorm(x + bias + residual) · gamma + beta; `params` = `[3, h]`.
pub(crate) fn add_norm(
    x: (&CudaStorage, &Layout),
    res: (&CudaStorage, &Layout),
    params: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    by_dtype!(x.0, add_norm_t(x, res, params, eps))
}

fn add_norm_t<T: CudaDType + DeviceRepr + WithDType>(
    x: (&CudaStorage, &Layout),
    res: (&CudaStorage, &Layout),
    params: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let dev = x.0.device();
    let h = params.1.shape().elem_count() / 3;
    let el = x.1.shape().elem_count();
    if h == 0 || !el.is_multiple_of(h) || res.1.shape().elem_count() != el {
        candle_core::bail!(
            "add-norm: {:?}, {:?}, params {:?}",
            x.1.shape(),
            res.1.shape(),
            params.1.shape()
        );
    }
    let rows = el / h;
    let name = format!("add_norm_{}", T::DTYPE.as_str());
    let mut out = output::<T>(dev, el)?;
    let xv = view::<T>(x.0, x.1, "add-norm x")?;
    let rv = view::<T>(res.0, res.1, "add-norm residual")?;
    let pv = view::<T>(params.0, params.1, "add-norm params")?;
    let (rows32, h32) = (u32_of(rows, "rows")?, u32_of(h, "width")?);
    launch!(dev, name, rows, &xv, &rv, &pv, &mut out, &rows32, &h32, &eps)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// GELU(x + bias), `bias` `[h]` over the last dimension.
pub(crate) fn bias_gelu(
    x: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    by_dtype!(x.0, bias_gelu_t(x, bias))
}

fn bias_gelu_t<T: CudaDType + DeviceRepr + WithDType>(
    x: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev = x.0.device();
    let (el, h) = (x.1.shape().elem_count(), bias.1.shape().elem_count());
    if h == 0 || !el.is_multiple_of(h) {
        candle_core::bail!("bias-gelu: {:?} with a bias of {h}", x.1.shape());
    }
    let rows = el / h;
    let name = format!("bias_gelu_{}", T::DTYPE.as_str());
    let mut out = output::<T>(dev, el)?;
    let xv = view::<T>(x.0, x.1, "bias-gelu x")?;
    let bv = view::<T>(bias.0, bias.1, "bias-gelu bias")?;
    let (rows32, h32) = (u32_of(rows, "rows")?, u32_of(h, "width")?);
    launch!(dev, name, rows, &xv, &bv, &mut out, &rows32, &h32)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// GELU(x[:, :i]) · x[:, i:] of `x` `[rows, 2i]`.
pub(crate) fn gated_gelu(x: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    by_dtype!(x.0, gated_gelu_t(x))
}

fn gated_gelu_t<T: CudaDType + DeviceRepr + WithDType>(
    x: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dev = x.0.device();
    let (rows, two_i) = x.1.shape().dims2()?;
    let i = two_i / 2;
    let name = format!("gated_gelu_{}", T::DTYPE.as_str());
    let mut out = output::<T>(dev, rows * i)?;
    let xv = view::<T>(x.0, x.1, "gated-gelu x")?;
    let (rows32, i32_) = (u32_of(rows, "rows")?, u32_of(i, "width")?);
    launch!(dev, name, rows, &xv, &mut out, &rows32, &i32_)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
