//! The `xtask` binary (`cargo xtask …` in this checkout): Touchstone's command line.

fn main() -> std::process::ExitCode {
    xtask::main()
}
