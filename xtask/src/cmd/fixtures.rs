//! `cargo xtask fixtures`: generate the synthetic models, fetch and verify the real ones.

use crate::Exit;

#[derive(clap::Args)]
pub struct FixturesArgs {
    #[arg(long, help = concat!("Only this model (default: all of them): ", fixtures::model_names!(), "."))]
    model: Option<String>,
}

pub fn main(a: FixturesArgs) -> Result<u8, Exit> {
    let names: Vec<String> = match a.model {
        Some(m) => vec![m],
        None => ::fixtures::SYNTHETIC.iter().chain(::fixtures::REAL.iter()).map(|s| s.to_string()).collect(),
    };
    for n in names {
        let p = ::fixtures::resolve(&n, false)?;
        outln!("{n:12} {}  {}", ::fixtures::sha256_model(&p)?, p.display());
    }
    Ok(0)
}
