//! `expose NAME PORT [--public]`: a URL for a box's port, private unless
//! `--public` (see `url` for signing in).

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, port_arg, rest, usage, UsageError};

pub const VERB: Verb = Verb {
    names: &["expose"],
    help: "  \
  expose NAME PORT [--public]
                      a web URL for PORT of NAME; private (sign in with 'url') unless --public
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("expose", args.first())?;
    let port = port_arg("expose", args.get(1))?;
    let mut public = false;
    for arg in rest(args, 2) {
        match arg.as_str() {
            "--public" => public = true,
            other => return Err(usage(format!("expose: unexpected argument {other:?}"))),
        }
    }
    Ok(Plan::Call(Call::new(Op::Expose { name, port, public }, render)))
}

fn render(reply: Reply, _: &Op, _: bool) -> Result<String, ApiError> {
    let Reply::Exposures(exposed) = reply else { return Err(ApiError::unexpected(&reply)) };
    Ok(exposed
        .iter()
        .map(|e| {
            let url = e.url.as_deref().unwrap_or("(no URL: this server has no HTTP edge)");
            match e.public {
                true => format!("{url}\n"),
                false => format!("{url} (private: 'url {} {}' gives you a sign-in link)\n", e.name, e.port),
            }
        })
        .collect())
}
