//! `url NAME PORT [--owner OWNER]`: a one-time sign-in link to a private
//! URL (for a box shared with you, OWNER is the slug in its URL).

use moat_api::{ApiError, Op, Reply};
use moat_core::web::Owner;

use super::{Call, Plan, Verb};
use crate::control::args::{name_arg, port_arg, rest, usage, UsageError};

pub const VERB: Verb = Verb {
    names: &["url"],
    help: "  \
  url NAME PORT [--owner OWNER]
                      a one-time sign-in link to NAME's PORT (for a box shared with you,
                      OWNER is the last part of its URL's first label); it expires in minutes
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let name = name_arg("url", args.first())?;
    let port = port_arg("url", args.get(1))?;
    let mut owner = None;
    let mut rest = rest(args, 2).iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--owner" => {
                let value = rest.next().ok_or_else(|| usage("url: --owner needs a value"))?;
                owner = Some(Owner::parse(value).map_err(|e| usage(format!("url: --owner: {e}")))?);
            }
            other => return Err(usage(format!("url: unexpected argument {other:?}"))),
        }
    }
    Ok(Plan::Call(Call::new(Op::Url { name, port, owner }, render)))
}

fn render(reply: Reply, _: &Op, _: bool) -> Result<String, ApiError> {
    let Reply::SignInLink { url, expires_in } = reply else { return Err(ApiError::unexpected(&reply)) };
    Ok(format!("{url}\n(works once, for {} minutes)\n", expires_in / 60))
}
