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
    /// The last real token's vector (decoders: the EOS their tokenizer appends).
    LastToken,
}

impl Pooling {
    /// The name used in sentence-transformers' pooling config and in `gpulane models`.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Mean => "mean",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len",
            Pooling::LastToken => "lasttoken",
        }
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
