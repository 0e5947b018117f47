use candle_core::{DType, Tensor, D};


use crate::ModelError;

/// How token vectors become one text vector, as sentence-transformers'
/// `1_Pooling/config.json` declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The first token's vector (`[CLS]`).
    Cls,
    /// The mean of the real (unpadded) tokens' vectors.
    Mean,
    /// The element-wise max over real tokens.
    Max,
    /// The sum of real tokens divided by the square root of their count.
    MeanSqrtLen,
}

impl Pooling {
    /// The name used in sentence-transformers' pooling config and in `gpulane models`.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Mean => "mean",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len",
        }
    }

    /// Pools `hidden` (`[batch, seq, hidden]`) under `mask` (`[batch, seq]`, 1 for real
    /// tokens, 0 for padding) into `[batch, hidden]`, in f32.
    pub fn pool(self, hidden: &Tensor, mask: &Tensor) -> Result<Tensor, ModelError> {
        let hidden = hidden.to_dtype(DType::F32)?;
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(D::Minus1)?;
        let pooled = match self {
            Pooling::Cls => hidden.narrow(1, 0, 1)?.squeeze(1)?,
            Pooling::Mean | Pooling::MeanSqrtLen => {
                let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
                // sentence-transformers clamps the count at 1e-9 so an all-padding row
                // divides by a tiny number instead of zero; do the same.
                let count = mask.sum(1)?.clamp(1e-9f32, f32::MAX)?;
                let count = if self == Pooling::MeanSqrtLen {
                    count.sqrt()?
                } else {
                    count
                };
                summed.broadcast_div(&count)?
            }
            Pooling::Max => {
                // Padding must never win the max: push it far below any real value.
                let penalty = ((mask.ones_like()? - &mask)? * -1e9f64)?;
                hidden.broadcast_add(&penalty)?.max(1)?
            }
        };
        Ok(pooled)
    }
}

/// Scales `v` to unit L2 norm, as sentence-transformers' `Normalize` module does (it
/// clamps the norm at 1e-12, so an all-zero vector stays zero instead of NaN).
pub(crate) fn l2_normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn hidden() -> Tensor {
        // batch 2, seq 3, hidden 2; the second row's last token is padding.
        Tensor::new(
            &[
                [[1f32, 2.], [3., 4.], [5., 6.]],
                [[1., -1.], [3., 1.], [100., 100.]],
            ],
            &Device::Cpu,
        )
        .unwrap()
    }

    fn mask() -> Tensor {
        Tensor::new(&[[1u32, 1, 1], [1, 1, 0]], &Device::Cpu).unwrap()
    }

    fn rows(t: Tensor) -> Vec<Vec<f32>> {
        t.to_vec2().unwrap()
    }

    #[test]
    fn mean_ignores_padding() {
        let out = rows(Pooling::Mean.pool(&hidden(), &mask()).unwrap());
        assert_eq!(out, vec![vec![3., 4.], vec![2., 0.]]);
    }

    #[test]
    fn cls_takes_first_token() {
        let out = rows(Pooling::Cls.pool(&hidden(), &mask()).unwrap());
        assert_eq!(out, vec![vec![1., 2.], vec![1., -1.]]);
    }

    #[test]
    fn max_ignores_padding() {
        let out = rows(Pooling::Max.pool(&hidden(), &mask()).unwrap());
        assert_eq!(out, vec![vec![5., 6.], vec![3., 1.]]);
    }

    #[test]
    fn mean_sqrt_len_divides_by_root_count() {
        let out = rows(Pooling::MeanSqrtLen.pool(&hidden(), &mask()).unwrap());
        let r2 = 2f32.sqrt();
        assert!((out[1][0] - 4. / r2).abs() < 1e-6 && (out[1][1] - 0.).abs() < 1e-6);
        assert!((out[0][0] - 9. / 3f32.sqrt()).abs() < 1e-5);
    }

    #[test]
    fn normalize_gives_unit_rows_and_keeps_zero_rows_finite() {
        let mut a = [3f32, 4.];
        let mut zero = [0f32, 0.];
        l2_normalize(&mut a);
        l2_normalize(&mut zero);
        assert_eq!(a, [0.6, 0.8]);
        assert_eq!(zero, [0., 0.]);
    }
}
