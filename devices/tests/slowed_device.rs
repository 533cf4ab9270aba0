//! `DEVICE+slow=PCT` (the A/B calibration's really-slower arm) gives the same logits as the
//! wrapped device (the wait itself: `slowed.rs`'s unit test, a lower bound that noise cannot
//! break).

use devices::ModelOptions;

#[test]
fn a_slowed_model_computes_the_same() {
    let path = fixtures::resolve("tiny-llama", true).unwrap();
    let slow = devices::open("cpu+slow=50").unwrap();
    assert_eq!(slow.name(), "cpu+slow=50");
    let mut a = devices::open("cpu").unwrap().load_model(&path, &ModelOptions::default()).unwrap();
    let mut b = slow.load_model(&path, &ModelOptions::default()).unwrap();
    let ids = [1u32, 2, 3, 4];
    assert_eq!(a.forward(&ids, &mut oracle::NoTap).unwrap(), b.forward(&ids, &mut oracle::NoTap).unwrap());
    assert!(devices::open("cpu+slow=abc").is_err() && devices::open("nothing+slow=2").is_err());
}
