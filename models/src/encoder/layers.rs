//! The weight-holding layers the families share: a dense layer with its weight laid out
//! `[in, out]` once at load, LayerNorm with an optional bias, and RMSNorm.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use super::{
    act::Act,
    batch::{Batch, Route},
    rope::{read_angles, rotate, rotate_qk_normed},
};
use crate::{
    attention::{self, Around, BlockWeights},
    dense::{self, Epilogue, PackedLinear, RowNorm, TaskProduct},
    feed_forward::{self, PreNorm},
    int8::QuantLinear,
    isa::cpu_isa,
    kernels::{self, CardOps, CpuF32, Heads, Keys, Mask, Products},
    ModelError,
};

/// A dense layer's weight: f32/f16/bf16 transposed to `[in, out]` at load (contiguous
/// for `x.matmul(w)`); on a CPU with AVX-512, f32 packed for gpulane's kernel
/// ([`Weight::pack_for_cpu`]); or, after [`Weight::quantize_int8`], int8 for the CPU.
pub(crate) enum Weight {
    Float(Tensor),
    Dense(PackedLinear),
    Int8(QuantLinear),
}

impl Weight {
    /// What attention multiplies in after this QKV projection: int8 after an int8 one
    /// (the int8 dtype quantizes every dense layer), f32 otherwise.
    pub(crate) fn products(&self) -> Products {
        match self {
            Weight::Int8(_) => Products::Int8,
            Weight::Float(_) | Weight::Dense(_) => Products::F32,
        }
    }

    /// Loads `[out, in]` from the checkpoint as `[in, out]`.
    pub(crate) fn load(vb: &VarBuilder, i: usize, o: usize) -> Result<Self, ModelError> {
        Ok(Weight::Float(vb.get((o, i), "weight")?.t()?.contiguous()?))
    }

    /// Several weights of one input side by side, as one `[in, Σ out]` matrix (Q, K and
    /// V; gate and up), so one matmul serves them all. Before quantization only.
    pub(crate) fn concat(parts: &[Weight]) -> Result<Self, ModelError> {
        let ws = parts
            .iter()
            .map(|p| match p {
                Weight::Float(w) => Ok(w.clone()),
                Weight::Dense(_) | Weight::Int8(_) => Err(candle_core::Error::Msg(
                    "weights are concatenated before packing or quantizing, not after".into(),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Weight::Float(Tensor::cat(&ws, 1)?.contiguous()?))
    }

    /// `x · w` over the last dimension of `x`.
    pub(crate) fn matmul(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        match self {
            Weight::Float(w) => Ok(x.matmul(w)?),
            _ => self.product(x, Epilogue::None),
        }
    }

    /// `x · w + bias`; on the CPU the bias is added as the kernel stores each output.
    pub(crate) fn matmul_bias(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor, ModelError> {
        if self.own_kernel() {
            let b = CpuF32::read(bias, "bias")?;
            return self.product(x, Epilogue::Bias(b.values()));
        }
        Ok(self.matmul(x)?.broadcast_add(bias)?)
    }

    /// `act(x · w + bias)`; on the CPU with the exact GELU, both are applied as the
    /// kernel stores each output (no second pass over the feed-forward's widest tensor).
    pub(crate) fn matmul_bias_act(
        &self,
        x: &Tensor,
        bias: &Tensor,
        act: Act,
        ops: CardOps,
    ) -> Result<Tensor, ModelError> {
        if act == Act::Gelu && self.own_kernel() {
            let b = CpuF32::read(bias, "bias")?;
            return self.product(x, Epilogue::BiasGelu(b.values()));
        }
        Ok(act.with_bias(&self.matmul(x)?, bias, ops)?)
    }

    /// LayerNorm(x · w + bias + residual) with `params` = [bias; gamma; beta] (BERT's
    /// add-and-norm, [`kernels::add_norm`]). Packed f32 or int8 on the CPU normalizes each
    /// row in the task that stored it (see [`RowNorm`]); anything else runs the two ops.
    pub(crate) fn matmul_add_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        params: &Tensor,
        eps: f32,
        ops: CardOps,
    ) -> Result<Tensor, ModelError> {
        if self.own_kernel() && kernels::cpu_f32(residual) && kernels::cpu_f32(params) {
            let norm = RowNormRead::read(residual, params, eps)?;
            return self.product_norm(x, Epilogue::None, Some(norm.norm()));
        }
        Ok(kernels::add_norm(
            &self.matmul(x)?,
            residual,
            params,
            eps,
            ops,
        )?)
    }

    /// Whether gpulane's own CPU kernels run this layer (packed f32, int8); candle's
    /// matmul serves the rest (cards, f16/bf16, CPUs without AVX-512).
    fn own_kernel(&self) -> bool {
        !matches!(self, Weight::Float(_))
    }

    /// `epi(x · w)` on gpulane's own kernel; only where [`Weight::own_kernel`] holds.
    fn product(&self, x: &Tensor, epi: Epilogue) -> Result<Tensor, ModelError> {
        self.product_norm(x, epi, None)
    }

    /// [`Weight::product`], each output row then normalized by `norm`.
    fn product_norm(
        &self,
        x: &Tensor,
        epi: Epilogue,
        norm: Option<RowNorm>,
    ) -> Result<Tensor, ModelError> {
        fn on<W: TaskProduct>(
            w: &W,
            x: &Tensor,
            epi: Epilogue,
            norm: Option<RowNorm>,
        ) -> Result<Tensor, ModelError> {
            cpu_product(x, w.out_features(), |x, m| {
                w.forward_on(cpu_isa(), x, m, epi, norm)
            })
        }
        match self {
            Weight::Dense(d) => on(d, x, epi, norm),
            Weight::Int8(q) => on(q, x, epi, norm),
            Weight::Float(_) => Err(candle_core::Error::Msg(
                "a float weight on candle's matmul reached gpulane's CPU kernel".into(),
            )
            .into()),
        }
    }

    /// Packs an f32 CPU weight for gpulane's kernel where this CPU runs it (the `[in,
    /// out]` copy is freed); anything else stays as it is. After every load-time change
    /// to the weight (concatenation, column scales).
    pub(crate) fn pack_for_cpu(&mut self) -> Result<(), ModelError> {
        if let Weight::Float(w) = self {
            if w.device().is_cpu() && w.dtype() == DType::F32 && dense::runs_here() {
                let (k, n) = w.dims2()?;
                let v = w.flatten_all()?.to_vec1::<f32>()?;
                *self = Weight::Dense(PackedLinear::new(&v, k, n));
            }
        }
        Ok(())
    }

    /// Scales each output column by `s` (`[out]`), before quantization.
    pub(crate) fn scale_columns(&mut self, s: &Tensor) -> Result<(), ModelError> {
        match self {
            Weight::Float(w) => {
                *w = w.broadcast_mul(s)?;
                Ok(())
            }
            _ => Err(candle_core::Error::Msg(
                "column scales are folded in before packing or quantizing, not after".into(),
            )
            .into()),
        }
    }

    /// Replaces an f32 CPU weight by its int8 quantization (the f32 copy is freed).
    pub(crate) fn quantize_int8(&mut self) -> Result<(), ModelError> {
        if let Weight::Dense(d) = self {
            *self = Weight::Int8(QuantLinear::new(
                &d.rows(),
                d.out_features(),
                d.in_features(),
            ));
            return Ok(());
        }
        if let Weight::Float(w) = self {
            if !w.device().is_cpu() || w.dtype() != DType::F32 {
                return Err(candle_core::Error::Msg(format!(
                    "int8 quantizes f32 weights on the CPU, not {:?} on {:?}",
                    w.dtype(),
                    w.device()
                ))
                .into());
            }
            let (k, n) = w.dims2()?;
            // `[in, out]` here; the kernel packs from `[out, in]` rows.
            let rows = w.t()?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
            *self = Weight::Int8(QuantLinear::new(&rows, n, k));
        }
        Ok(())
    }
}

/// BERT's attention block: the QKV projection (Q pre-scaled by 1/√d), attention, the
/// output projection and the add-norm after it, `norm` = [bias; gamma; beta].
pub(crate) struct AttentionBlock<'a> {
    pub(crate) qkv: &'a Weight,
    pub(crate) qkv_bias: &'a Tensor,
    pub(crate) out: &'a Weight,
    pub(crate) norm: &'a Tensor,
    pub(crate) eps: f32,
}

impl AttentionBlock<'_> {
    /// LayerNorm(attention(x · qkv + qkv_bias) · out + bias + x) over `batch`'s rows.
    /// Packed f32 or int8 on the CPU with every key seen carries each task's sequences
    /// through all of it on one thread ([`attention::block`]), where the batch has the
    /// tasks for it; anything else runs the steps in turn.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        batch: &Batch,
        heads: Heads,
        mask: Mask,
        ops: CardOps,
    ) -> Result<Tensor, ModelError> {
        if let (Route::Packed, Mask::Full) = (batch.route(), &mask) {
            let fused = match (self.qkv, self.out) {
                (Weight::Dense(qkv), Weight::Dense(out)) => {
                    self.fused(x, batch, heads, qkv, out)?
                }
                (Weight::Int8(qkv), Weight::Int8(out)) => self.fused(x, batch, heads, qkv, out)?,
                _ => None,
            };
            if let Some(y) = fused {
                return Ok(y);
            }
        }
        let qkv = self.qkv.matmul_bias(x, self.qkv_bias)?;
        let ctx = batch.attend(&qkv, heads, mask, self.qkv.products())?;
        self.out.matmul_add_norm(&ctx, x, self.norm, self.eps, ops)
    }

    /// [`attention::block`] on CPU f32 tensors; None for any other, or where it declines.
    fn fused<W: TaskProduct>(
        &self,
        x: &Tensor,
        batch: &Batch,
        heads: Heads,
        qkv: &W,
        out: &W,
    ) -> Result<Option<Tensor>, ModelError> {
        if !(kernels::cpu_f32(x) && kernels::cpu_f32(self.norm)) {
            return Ok(None);
        }
        let qkv_bias = CpuF32::read(self.qkv_bias, "qkv bias")?;
        let w = BlockWeights {
            qkv,
            qkv_bias: Some(qkv_bias.values()),
            out,
            out_bias: None,
        };
        // `x` is the input and the residual: the output has its shape.
        let norm = RowNormRead::read(x, self.norm, self.eps)?;
        let norm = norm.norm();
        let around = Around::PostNorm(norm);
        let y = attention::block(w, norm.residual, batch.lens(), heads, Keys::Row, around);
        y.map(|y| Tensor::from_vec(y, x.dims(), x.device()))
            .transpose()
            .map_err(Into::into)
    }
}

/// A pre-norm layer's attention block and its residual (ModernBERT's, Qwen3's):
/// `x + out(attention(rope(qkv(norm(x)))))`, `norm` none in ModernBERT's first layer,
/// each Q and K head RMS-normalized by `qk_norm` before the rotation in Qwen3.
pub(crate) struct PreNormAttention<'a> {
    pub(crate) norm: Option<NormRef<'a>>,
    pub(crate) eps: f32,
    pub(crate) qkv: &'a Linear,
    pub(crate) qk_norm: Option<(&'a RmsNorm, &'a RmsNorm)>,
    pub(crate) out: &'a Linear,
}

impl PreNormAttention<'_> {
    /// Over `batch`'s rows, Q and K rotated by each token's `cos` and `sin` (`[N, 1,
    /// d/2]`, `Rope::at`). Packed f32 on the CPU carries each task's sequences through
    /// all of it on one thread ([`attention::block`]), where the batch has the tasks for
    /// it; anything else runs the steps in turn.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        batch: &Batch,
        heads: Heads,
        mask: Mask,
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Tensor, ModelError> {
        if let (Weight::Dense(qkv), Weight::Dense(out), Route::Packed, false) = (
            &self.qkv.w,
            &self.out.w,
            batch.route(),
            matches!(mask, Mask::Relative(_)),
        ) {
            if [x, cos, sin].into_iter().all(kernels::cpu_f32) {
                if let Some(y) =
                    self.fused(x, batch, heads, Keys::of(&mask), (qkv, out), (cos, sin))?
                {
                    return Ok(Tensor::from_vec(y, x.dims(), x.device())?);
                }
            }
        }
        let normed = match self.norm {
            Some(norm) => norm.forward(x, self.eps)?,
            None => x.clone(),
        };
        let qkv = self.qkv.forward(&normed)?;
        let qkv = match self.qk_norm {
            Some(norms) => rotate_qk_normed(&qkv, norms, cos, sin, heads, self.eps)?,
            None => rotate(&qkv, cos, sin, heads)?,
        };
        let ctx = batch.attend(&qkv, heads, mask, self.qkv.w.products())?;
        Ok((x + self.out.forward(&ctx)?)?)
    }

    /// [`attention::block`] with every operand read in place; None where it declines.
    fn fused(
        &self,
        x: &Tensor,
        batch: &Batch,
        heads: Heads,
        keys: Keys,
        (qkv, out): (&PackedLinear, &PackedLinear),
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let qkv_bias = kernels::read_optional(self.qkv.b.as_ref(), "qkv bias")?;
        let out_bias = kernels::read_optional(self.out.b.as_ref(), "out bias")?;
        let w = BlockWeights {
            qkv,
            qkv_bias: qkv_bias.as_ref().map(CpuF32::values),
            out,
            out_bias: out_bias.as_ref().map(CpuF32::values),
        };
        let norm = self.norm.map(NormRef::read_cpu).transpose()?;
        let qk_norm = match self.qk_norm {
            Some((q, k)) => Some((
                CpuF32::read(&q.weight, "q norm")?,
                CpuF32::read(&k.weight, "k norm")?,
            )),
            None => None,
        };
        let (cos, sin) = read_angles(cos, sin)?;
        let x = CpuF32::read(x, "attention input")?;
        let around = Around::PreNorm {
            norm: norm.as_ref().map(|n| (n.pre_norm(), self.eps)),
            qk_norm: qk_norm
                .as_ref()
                .map(|(q, k)| (q.values(), k.values(), self.eps)),
            cos: cos.values(),
            sin: sin.values(),
        };
        Ok(attention::block(
            w,
            x.values(),
            batch.lens(),
            heads,
            keys,
            around,
        ))
    }
}

/// A feed-forward and the add-norm after it: `act(x · up + up_bias) · down`, then
/// [`kernels::add_norm`] with the residual, `norm` = [bias; gamma; beta] (BERT's
/// intermediate and output layers).
pub(crate) struct FeedForward<'a> {
    pub(crate) up: &'a Weight,
    pub(crate) up_bias: &'a Tensor,
    pub(crate) act: Act,
    pub(crate) down: &'a Weight,
    pub(crate) norm: &'a Tensor,
    pub(crate) eps: f32,
}

impl FeedForward<'_> {
    /// LayerNorm(act(x · up + up_bias) · down + bias + x): the residual is the input, as
    /// in BERT. Packed f32 or int8 with the exact GELU on the CPU carries each task's rows
    /// through both layers ([`feed_forward::Bert`]); anything else runs the ops in turn.
    pub(crate) fn forward(&self, x: &Tensor, ops: CardOps) -> Result<Tensor, ModelError> {
        let fused = match (self.up, self.down, self.act) {
            (Weight::Dense(up), Weight::Dense(down), Act::Gelu) => self.fused(x, up, down)?,
            (Weight::Int8(up), Weight::Int8(down), Act::Gelu) => self.fused(x, up, down)?,
            _ => None,
        };
        if let Some(y) = fused {
            return Ok(y);
        }
        let mid = self.up.matmul_bias_act(x, self.up_bias, self.act, ops)?;
        self.down.matmul_add_norm(&mid, x, self.norm, self.eps, ops)
    }

    /// [`feed_forward::Bert`] on CPU f32 tensors; None for any other.
    fn fused<W: TaskProduct>(
        &self,
        x: &Tensor,
        up: &W,
        down: &W,
    ) -> Result<Option<Tensor>, ModelError> {
        let (params, eps) = (self.norm, self.eps);
        if !(kernels::cpu_f32(x) && kernels::cpu_f32(params)) {
            return Ok(None);
        }
        // `x` is read once, as the input and as the residual.
        let bias = CpuF32::read(self.up_bias, "bias")?;
        let norm = RowNormRead::read(x, params, eps)?;
        let norm = norm.norm();
        let (rows, m) = (norm.residual, norm.residual.len() / up.in_features());
        let up_bias = bias.values();
        let y = feed_forward::Bert { up, up_bias, down }.forward(rows, m, norm);
        Ok(Some(Tensor::from_vec(y, x.dims(), x.device())?))
    }
}

/// The norm before a pre-norm layer's feed-forward.
#[derive(Clone, Copy)]
pub(crate) enum NormRef<'a> {
    Layer(&'a Norm),
    Rms(&'a RmsNorm),
}

impl<'a> NormRef<'a> {
    fn forward(self, x: &Tensor, eps: f32) -> Result<Tensor, ModelError> {
        match self {
            NormRef::Layer(n) => n.forward(x, eps),
            NormRef::Rms(n) => n.forward(x, eps),
        }
    }

    /// Its weights as the CPU kernels take them ([`PreNorm`]), read in place: [gamma;
    /// beta] for LayerNorm, the weight for RMSNorm.
    fn read_cpu(self) -> Result<NormRead<'a>, ModelError> {
        let t = match self {
            NormRef::Layer(n) => &n.gamma_beta,
            NormRef::Rms(n) => &n.weight,
        };
        let rms = matches!(self, NormRef::Rms(_));
        Ok(NormRead {
            params: CpuF32::read(t, "norm weights")?,
            rms,
        })
    }
}

/// A [`NormRef`]'s weights, read in place ([`NormRef::read_cpu`]).
struct NormRead<'a> {
    params: CpuF32<'a>,
    rms: bool,
}

impl NormRead<'_> {
    fn pre_norm(&self) -> PreNorm<'_> {
        match self.rms {
            true => PreNorm::Rms(self.params.values()),
            false => PreNorm::Layer(self.params.values()),
        }
    }
}

/// A pre-norm layer's gated feed-forward and its residual: `x + down(act.gated(up(norm(x))))`
/// (ModernBERT's MLP, Qwen3's).
pub(crate) struct GatedFeedForward<'a> {
    pub(crate) norm: NormRef<'a>,
    pub(crate) eps: f32,
    pub(crate) up: &'a Linear,
    pub(crate) act: Act,
    pub(crate) down: &'a Linear,
}

impl GatedFeedForward<'_> {
    /// `x + down(act.gated(up(norm(x))))`. Packed f32 on the CPU without biases, gated
    /// by GELU or SiLU, runs [`feed_forward::Gated`] (each task's rows
    /// through all of it); anything else runs the ops in turn.
    pub(crate) fn forward(&self, x: &Tensor, ops: CardOps) -> Result<Tensor, ModelError> {
        let eps = self.eps;
        if let (Weight::Dense(up), Weight::Dense(down), None, None, Some(gate)) = (
            &self.up.w,
            &self.down.w,
            &self.up.b,
            &self.down.b,
            self.act.gated_row(),
        ) {
            if kernels::cpu_f32(x) {
                let m = x.elem_count() / up.in_features();
                let norm = self.norm.read_cpu()?;
                let x_in = CpuF32::read(x, "feed-forward input")?;
                let (norm, rows) = (norm.pre_norm(), x_in.values());
                let layer = feed_forward::Gated {
                    norm,
                    eps,
                    up,
                    gate,
                    down,
                };
                let y = layer.forward(rows, m);
                return Ok(Tensor::from_vec(y, x.dims(), x.device())?);
            }
        }
        let up = self.up.forward(&self.norm.forward(x, eps)?)?;
        Ok((x + self.down.forward(&self.act.gated(&up, ops)?)?)?)
    }
}

/// A CPU f32 `residual` and its add-norm `params` ([bias; gamma; beta]), read in place
/// for a [`RowNorm`] (the fused steps read the residual as their input too, through
/// `norm.residual`).
struct RowNormRead<'a> {
    residual: CpuF32<'a>,
    params: CpuF32<'a>,
    eps: f32,
}

impl<'a> RowNormRead<'a> {
    fn read(residual: &'a Tensor, params: &'a Tensor, eps: f32) -> Result<Self, ModelError> {
        Ok(Self {
            residual: CpuF32::read(residual, "add-norm residual")?,
            params: CpuF32::read(params, "add-norm params")?,
            eps,
        })
    }

    fn norm(&self) -> RowNorm<'_> {
        RowNorm {
            residual: self.residual.values(),
            params: self.params.values(),
            eps: self.eps,
        }
    }
}

/// `norm(x)` for a CPU f32 `x`, by the kernel the fused CPU steps normalize with
/// ([`PreNorm::apply`]) rather than candle's (one pass, E[x²] − mean², other bits): a
/// text's vector is then the same whether or not its batch was big enough for the fused
/// steps (`dense::fills_the_cores`).
fn normalize_on_cpu(x: &Tensor, norm: NormRef, eps: f32) -> Result<Tensor, ModelError> {
    let mut rows = CpuF32::read(x, "norm input")?.values().to_vec();
    norm.read_cpu()?.pre_norm().apply(&mut rows, eps);
    Ok(Tensor::from_vec(rows, x.dims(), x.device())?)
}

/// A CPU kernel's product on the f32 tensor `x` (any leading dimensions), read in place:
/// `f(rows, m)` returns the `[m, n]` outputs.
fn cpu_product(
    x: &Tensor,
    n: usize,
    f: impl FnOnce(&[f32], usize) -> Vec<f32>,
) -> Result<Tensor, ModelError> {
    let x = x.contiguous()?;
    let mut dims = x.dims().to_vec();
    let k = dims.last().copied().unwrap_or(1);
    let m = x.elem_count() / k.max(1);
    let y = f(CpuF32::read(&x, "dense input")?.values(), m);
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    Ok(Tensor::from_vec(y, dims, x.device())?)
}

/// A dense layer, bias optional.
pub(crate) struct Linear {
    pub(crate) w: Weight,
    pub(crate) b: Option<Tensor>,
}

impl Linear {
    pub(crate) fn load(vb: VarBuilder, i: usize, o: usize, bias: bool) -> Result<Self, ModelError> {
        let w = Weight::load(&vb, i, o)?;
        let b = if bias { Some(vb.get(o, "bias")?) } else { None };
        Ok(Self { w, b })
    }

    /// Several layers of one input side by side (see [`Weight::concat`]).
    pub(crate) fn concat(parts: Vec<Linear>) -> Result<Self, ModelError> {
        let all_biased = parts.iter().all(|p| p.b.is_some());
        let (ws, bs): (Vec<Weight>, Vec<Option<Tensor>>) =
            parts.into_iter().map(|p| (p.w, p.b)).unzip();
        let w = Weight::concat(&ws)?;
        let b = if all_biased {
            Some(Tensor::cat(
                &bs.into_iter().flatten().collect::<Vec<_>>(),
                0,
            )?)
        } else {
            None
        };
        Ok(Self { w, b })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        match &self.b {
            Some(b) => self.w.matmul_bias(x, b),
            None => self.w.matmul(x),
        }
    }
}

/// LayerNorm with an optional bias (ModernBERT's `norm_bias`, usually false). Not
/// candle_nn's `LayerNorm`: without a bias that one skips its fused op for six separate
/// ones.
pub(crate) struct Norm {
    gamma: Tensor,
    /// Zeros when the checkpoint has no bias, so one candle op serves both.
    beta: Tensor,
    /// [gamma; beta] as one vector, made once at load: what the CPU kernels read
    /// ([`PreNorm::Layer`]). Two rows' worth of floats.
    gamma_beta: Tensor,
}

impl Norm {
    pub(crate) fn load(vb: VarBuilder, hidden: usize, bias: bool) -> Result<Self, ModelError> {
        let gamma = vb.get(hidden, "weight")?;
        let beta = if bias {
            vb.get(hidden, "bias")?
        } else {
            gamma.zeros_like()?
        };
        let gamma_beta = Tensor::cat(&[&gamma, &beta], 0)?;
        Ok(Self {
            gamma,
            beta,
            gamma_beta,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor, eps: f32) -> Result<Tensor, ModelError> {
        if kernels::cpu_f32(x) {
            return normalize_on_cpu(x, NormRef::Layer(self), eps);
        }
        Ok(candle_nn::ops::layer_norm(x, &self.gamma, &self.beta, eps)?)
    }
}

/// RMSNorm over the last dimension (Qwen3's layer norms, and its per-head q/k norms).
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
}

impl RmsNorm {
    pub(crate) fn load(vb: VarBuilder, width: usize) -> Result<Self, ModelError> {
        Ok(Self {
            weight: vb.get(width, "weight")?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor, eps: f32) -> Result<Tensor, ModelError> {
        if kernels::cpu_f32(x) {
            return normalize_on_cpu(x, NormRef::Rms(self), eps);
        }
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &self.weight,
            eps,
        )?)
    }
}
