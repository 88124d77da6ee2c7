//! `diff A B [--json]`: the files added, modified and deleted in B relative
//! to A. They stream as the comparison finds them (see `render::ChangeStream`);
//! then, as text, what each box did outside since they split (effects), and
//! the package files each let in.

use moat_api::{ApiError, Op, Reply};

use super::{Call, Plan, Verb};
use crate::control::args::{flags_only, name_arg, rest, UsageError};
use crate::control::render;

pub const VERB: Verb = Verb {
    names: &["diff"],
    help: "  \
  diff A B [--json]   the files added (A), modified (M) and deleted (D) in B relative to A, then
                      what each did outside since they split (see effects), and the package
                      files each let in (see packages)
",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let a = name_arg("diff", args.first())?;
    let b = name_arg("diff", args.get(1))?;
    let json = flags_only("diff", rest(args, 2))?;
    Ok(Plan::Call(Call::new(Op::Diff { a, b }, render).json(json)))
}

/// What follows the changes: `[]` for JSON that found none (the stream
/// closes JSON that found some); as text, each box's effects since the split.
pub fn render(reply: Reply, op: &Op, json: bool) -> Result<String, ApiError> {
    let (Reply::Diffed { a, b, a_packages, b_packages }, Op::Diff { a: an, b: bn }) = (&reply, op) else {
        return Err(ApiError::unexpected(&reply));
    };
    if json {
        return Ok("[]\n".into());
    }
    let mut out = render::effects_summary(&format!("{an} since the split did what a restore does not undo:"), a);
    out.push_str(&render::effects_summary(&format!("{bn} since the split did what a restore does not undo:"), b));
    for (name, added) in [(an, a_packages), (bn, b_packages)] {
        let files: Vec<String> = added
            .iter()
            .filter_map(|e| e.package.as_ref())
            .map(|p| format!("  {} {} {} ({})\n", p.ecosystem, p.name, p.version, p.file))
            .collect();
        if !files.is_empty() {
            out.push_str(&format!("{name} since the split let in these package files:\n"));
            out.extend(files);
        }
    }
    Ok(out)
}
