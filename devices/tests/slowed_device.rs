//! `DEVICE+slow=PCT` (the A/B calibration's really-slower arm): the same logits as the wrapped
//! device, and each pass longer by its fraction of its own time.

use devices::{DeviceModel, ModelOptions};
use std::time::Instant;

#[test]
fn a_slowed_model_computes_the_same_and_takes_longer() {
    let path = fixtures::resolve("tiny-llama", true).unwrap();
    let slow = devices::open("cpu+slow=50").unwrap();
    assert_eq!(slow.name(), "cpu+slow=50");
    let mut a = devices::open("cpu").unwrap().load_model(&path, &ModelOptions::default()).unwrap();
    let mut b = slow.load_model(&path, &ModelOptions::default()).unwrap();
    let ids = [1u32, 2, 3, 4];
    assert_eq!(a.forward(&ids, &mut oracle::NoTap).unwrap(), b.forward(&ids, &mut oracle::NoTap).unwrap());
    let fastest = |m: &mut Box<dyn DeviceModel>| {
        (0..30)
            .map(|_| {
                m.reset();
                let t = Instant::now();
                m.forward(&ids, &mut oracle::NoTap).unwrap();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let (ta, tb) = (fastest(&mut a), fastest(&mut b));
    assert!(tb > 1.3 * ta, "fastest plain pass {ta} s, fastest slowed pass {tb} s");
    assert!(devices::open("cpu+slow=abc").is_err() && devices::open("nothing+slow=2").is_err());
}
