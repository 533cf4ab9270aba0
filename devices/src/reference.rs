//! `ref`: the oracle wrapped as a device. Judging the oracle against itself must be exact; this
//! is the kernel suite's self-check (a non-zero error here is a bug in the suite, not a device).

use crate::{fail, Arithmetic, Device, DeviceError, Support};
use oracle::registry::{registry, OpCase, Output};

pub struct RefDevice;

impl Device for RefDevice {
    fn name(&self) -> String {
        "ref".into()
    }
    fn arithmetic(&self, _: &OpCase) -> Arithmetic {
        Arithmetic::F64
    }
    fn supports(&self, _: &OpCase) -> Support {
        Support::Yes
    }
    fn run_op(&self, case: &OpCase) -> Result<Vec<Output>, DeviceError> {
        let entry = registry().into_iter().find(|e| e.op == case.op).ok_or_else(|| fail("ref", case, "op not in the registry"))?;
        (entry.reference)(case).map_err(|e| fail("ref", case, e))
    }
}
