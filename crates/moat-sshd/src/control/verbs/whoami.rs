//! `whoami [--json]`: the account, its key's fingerprint, and the limits
//! the operator gives it (`moat serve --max-boxes` and the like).

use moat_api::{ApiError, Op, Reply};
use moat_core::limits::format_size;

use super::{Call, Plan, Verb};
use crate::control::args::{flags_only, UsageError};
use crate::control::render::to_json;

pub const VERB: Verb = Verb {
    names: &["whoami"],
    help: "  whoami [--json]     your account, its key's fingerprint, and what it may use\n",
    parse,
};

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    Ok(Plan::Call(Call::new(Op::Whoami, render).json(flags_only("whoami", args)?)))
}

fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Whoami(me) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&me));
    }
    let l = &me.limits;
    Ok(format!(
        "account:      {}\nfingerprint:  {} (as ssh-keygen -l shows your key)\nowner:        {} (names your boxes to those you share them with: NAME.{}@HOST)\nboxes:        {} of at most {}\nper box:      at most {} cpus, {} memory, {} processes, {} disk, {} checkpoints\nall boxes:    at most {} memory and {} disk together\nimages:       at most {} (pulled and saved)\n",
        me.account,
        me.fingerprint,
        me.owner,
        me.owner,
        me.boxes,
        l.max_boxes,
        l.per_box.cpus,
        format_size(l.per_box.memory),
        l.per_box.pids,
        format_size(l.per_box.disk),
        l.max_checkpoints,
        format_size(l.max_memory),
        format_size(l.max_disk),
        l.max_images,
    ))
}
