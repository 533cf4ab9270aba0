//! The number formats a device declares its storage and accumulation in.

/// Number formats a device can declare.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NumFormat {
    F64,
    F32,
    /// IEEE half precision (10 stored mantissa bits).
    F16,
    /// bfloat16 (7 stored mantissa bits).
    BF16,
    /// Integer accumulation (exact within range).
    I32,
}

impl NumFormat {
    /// Unit roundoff (half an ulp at 1.0).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            NumFormat::F64 => f64::EPSILON / 2.0,
            NumFormat::F32 => f32::EPSILON as f64 / 2.0,
            NumFormat::F16 => (-11f64).exp2(),
            NumFormat::BF16 => (-8f64).exp2(),
            NumFormat::I32 => 0.0,
        }
    }
}
