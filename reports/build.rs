//! Records what built the binary (the compiler's version and the cargo profile) for report
//! provenance: a figure is only reproducible with the build that gave it.

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc).arg("-V").output().ok().and_then(|o| String::from_utf8(o.stdout).ok()).unwrap_or_default();
    println!("cargo:rustc-env=TOUCHSTONE_RUSTC={}", version.trim());
    println!("cargo:rustc-env=TOUCHSTONE_PROFILE={}", std::env::var("PROFILE").unwrap_or_default());
    println!("cargo:rerun-if-env-changed=RUSTC");
}
