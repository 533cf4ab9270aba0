//! The `touchstone` binary (`cargo install --path xtask`): the same command line as `cargo xtask`,
//! for an engine's own repository and CI.

fn main() -> std::process::ExitCode {
    xtask::main()
}
