//! `DEVICE+slow=PCT`: any device made really slower by a stated fraction, for calibrating A/B
//! comparisons. Each forward pass is timed and then followed by a busy wait of `PCT` percent of
//! that pass's own time (the core stays busy, as slower code would keep it), so the slowdown
//! follows the step's own speed on a noisy machine instead of adding a fixed delay. The numbers
//! are the wrapped device's, bit for bit; op cases run unslowed.

use crate::{Arithmetic, Device, DeviceError, DeviceModel, ModelOptions, Support};
use oracle::registry::{OpCase, Output};
use std::time::{Duration, Instant};

/// Splits `NAME+slow=PCT` into the wrapped device's name and the fraction (PCT / 100); None
/// when the name has no `+slow=` suffix; an error for a percentage that is not a finite number
/// from 0 to 1000.
pub fn parse(name: &str) -> Option<Result<(&str, f64), String>> {
    let (base, pct) = name.rsplit_once("+slow=")?;
    Some(match pct.trim_end_matches('%').parse::<f64>() {
        Ok(p) if p.is_finite() && (0.0..=1000.0).contains(&p) && !base.is_empty() => Ok((base, p / 100.0)),
        _ => Err(format!("`+slow={pct}`: give a device and a percentage from 0 to 1000 (e.g. cpu+slow=2)")),
    })
}

/// Spins until `extra` has passed.
fn busy_wait(extra: Duration) {
    let end = Instant::now() + extra;
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

pub struct SlowedDevice {
    pub inner: Box<dyn Device>,
    pub fraction: f64,
}

impl Device for SlowedDevice {
    fn name(&self) -> String {
        format!("{}+slow={}", self.inner.name(), self.fraction * 100.0)
    }
    fn describe(&self) -> String {
        format!("{}, each forward pass followed by a busy wait of {}% of its own time", self.inner.describe(), self.fraction * 100.0)
    }
    fn arithmetic(&self, case: &OpCase) -> Arithmetic {
        self.inner.arithmetic(case)
    }
    fn supports(&self, case: &OpCase) -> Support {
        self.inner.supports(case)
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        self.inner.run_op(case)
    }
    fn load_model(&self, path: &std::path::Path, opts: &ModelOptions) -> Result<Box<dyn DeviceModel>, DeviceError> {
        Ok(Box::new(SlowedModel { inner: self.inner.load_model(path, opts)?, fraction: self.fraction }))
    }
}

struct SlowedModel {
    inner: Box<dyn DeviceModel>,
    fraction: f64,
}

impl SlowedModel {
    fn slowed<T>(&mut self, run: impl FnOnce(&mut dyn DeviceModel) -> T) -> T {
        let t = Instant::now();
        let out = run(self.inner.as_mut());
        busy_wait(t.elapsed().mul_f64(self.fraction));
        out
    }
}

impl DeviceModel for SlowedModel {
    fn spec(&self) -> &oracle::ModelSpec {
        self.inner.spec()
    }
    fn arithmetic(&self) -> Arithmetic {
        self.inner.arithmetic()
    }
    fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        self.slowed(|m| m.forward(tokens, taps))
    }
    fn forward_last(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
        self.slowed(|m| m.forward_last(tokens, taps))
    }
    fn cached(&self) -> usize {
        self.inner.cached()
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_bad_percentages_are_refused() {
        assert_eq!(parse("cpu"), None);
        assert_eq!(parse("cpu+slow=2"), Some(Ok(("cpu", 0.02))));
        assert_eq!(parse("cpu:kv-f16+slow=3%"), Some(Ok(("cpu:kv-f16", 0.03))));
        for bad in ["cpu+slow=", "cpu+slow=-1", "cpu+slow=NaN", "+slow=2", "cpu+slow=1e9"] {
            assert!(matches!(parse(bad), Some(Err(_))), "{bad}");
        }
    }

    /// A model whose every pass takes at least `PASS` (it sleeps, then runs the cpu device's).
    struct Sleepy(Box<dyn DeviceModel>);
    const PASS: Duration = Duration::from_millis(20);

    impl DeviceModel for Sleepy {
        fn spec(&self) -> &oracle::ModelSpec {
            self.0.spec()
        }
        fn arithmetic(&self) -> Arithmetic {
            self.0.arithmetic()
        }
        fn forward(&mut self, tokens: &[u32], taps: &mut dyn oracle::Tap) -> Result<Vec<f32>, DeviceError> {
            std::thread::sleep(PASS);
            self.0.forward(tokens, taps)
        }
        fn cached(&self) -> usize {
            self.0.cached()
        }
        fn reset(&mut self) {
            self.0.reset()
        }
    }

    /// The wait follows the pass's own time: a pass of at least 20 ms slowed by 50% takes at
    /// least 30 ms, whatever else the machine is doing (a lower bound that holds by construction,
    /// not a timing that noise can break).
    #[test]
    fn a_slowed_pass_waits_its_fraction_of_the_pass_own_time() {
        let path = ::fixtures::resolve("tiny-llama", true).unwrap();
        let cpu = crate::open("cpu").unwrap();
        let mut m = SlowedModel { inner: Box::new(Sleepy(cpu.load_model(&path, &ModelOptions::default()).unwrap())), fraction: 0.5 };
        for _ in 0..3 {
            m.reset();
            let t = Instant::now();
            m.forward(&[1, 2, 3], &mut oracle::NoTap).unwrap();
            assert!(t.elapsed() >= PASS.mul_f64(1.5), "{:?}", t.elapsed());
        }
    }
}
