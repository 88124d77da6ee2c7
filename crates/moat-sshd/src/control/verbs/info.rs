//! `info NAME [--json]`: one box.

use moat_api::{ApiError, BoxInfo, Op, Reply};
use moat_core::limits::format_size;

use super::{Call, Plan, Verb};
use crate::control::args::{name_and_json, UsageError};
use crate::control::render::to_json;
use crate::control::time::utc;

pub const VERB: Verb = Verb { names: &["info"], help: "  info NAME [--json]  show one box\n", parse };

fn parse(args: &[String]) -> Result<Plan, UsageError> {
    let (name, json) = name_and_json("info", args)?;
    Ok(Plan::Call(Call::new(Op::Get { name }, render).json(json)))
}

fn render(reply: Reply, _: &Op, json: bool) -> Result<String, ApiError> {
    let Reply::Box(b) = reply else { return Err(ApiError::unexpected(&reply)) };
    if json {
        return Ok(to_json(&b));
    }
    let parent = match (&b.parent, b.duplicated) {
        (Some(name), _) => format!("{name} (duplicated at {})", utc(b.created_at)),
        (None, true) => format!("a removed box (duplicated at {})", utc(b.created_at)),
        (None, false) => "-".to_string(),
    };
    let mut node = if b.node.is_empty() { String::new() } else { format!("node:     {}\n", b.node) };
    node += &durable(&b);
    node += &moved(&b);
    node += &moving(&b);
    let shared = match b.shared_with.as_slice() {
        [] => String::new(),
        keys => format!("shared:   {}\n", keys.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")),
    };
    Ok(format!(
        "name:     {}\nid:       {}\nstate:    {} (since {})\n{}idle:     {}\nimage:    {}\nbackend:  {}\ncpus:     {}\nmemory:   {}\npids:     {}\ndisk:     {}\ncreated:  {}\nparent:   {}\n{}",
        b.name,
        b.id,
        b.state,
        utc(b.state_since),
        node,
        idle_rule(&b),
        b.image,
        b.backend,
        b.limits.cpus,
        format_size(b.limits.memory),
        b.limits.pids,
        format_size(b.limits.disk),
        utc(b.created_at),
        parent,
        shared
    ))
}

/// When the box was last kept in the object store, and how far behind that is.
fn durable(b: &BoxInfo) -> String {
    let Some(d) = b.durable.as_deref() else { return String::new() };
    let pending = if d.pending { ", an upload is under way" } else { "" };
    let Some(as_of_ms) = d.as_of_ms else { return format!("durable:  not yet{pending}\n") };
    let behind = match b.state.as_str() {
        // A running box may have changed since; a box that stopped or
        // suspended before that snapshot has not.
        "running" => format!(", up to {}s behind", moat_core::clock::now_ms().saturating_sub(as_of_ms) / 1000),
        _ if b.state_since * 1000 <= as_of_ms => ", up to date".to_string(),
        _ => format!(", {}s behind", moat_core::clock::now_ms().saturating_sub(as_of_ms) / 1000),
    };
    format!(
        "durable:  as of {} ({} in the object store){behind}{pending}\n",
        utc(as_of_ms / 1000),
        format_size(d.bytes)
    )
}

/// Where the box came from, if it moved to its node.
fn moved(b: &BoxInfo) -> String {
    let Some(m) = &b.moved else { return String::new() };
    let why = match m.reason {
        moat_core::store::moves::MoveReason::Lost => "its node was lost",
        moat_core::store::moves::MoveReason::Drain => "its node was drained",
        moat_core::store::moves::MoveReason::Move => "moved",
    };
    format!(
        "moved:    from node {} at {} ({why}); its files as of {}, its processes did not move\n",
        m.from,
        utc(m.at_ms / 1000),
        utc(m.as_of_ms / 1000)
    )
}

/// Its move under way, or why the last attempt failed.
fn moving(b: &BoxInfo) -> String {
    use moat_core::store::moves::{retry_after_ms, MoveReason};
    let Some(m) = &b.moving else { return String::new() };
    let why = match m.reason {
        MoveReason::Lost => "its node was lost",
        MoveReason::Drain => "its node is drained",
        MoveReason::Move => "asked",
    };
    let Some(error) = &m.error else { return format!("moving:   to node {} ({why})\n", m.to) };
    if m.reason != MoveReason::Lost {
        return format!("moving:   to node {} failed ({why}): {error}; the box stayed\n", m.to);
    }
    let due = m.failed_at_ms.unwrap_or(0).saturating_add(retry_after_ms(m.failures));
    let wait = due.saturating_sub(moat_core::clock::now_ms()).div_ceil(1000);
    format!(
        "moving:   re-homing failed {} time{} ({error}); tried again in {wait}s\n",
        m.failures,
        if m.failures == 1 { "" } else { "s" }
    )
}

/// How the idle rule applies to a box.
fn idle_rule(b: &BoxInfo) -> String {
    match (b.keep_running, b.idle) {
        (true, _) => "keep-running (billed while idle)".into(),
        (false, Some(s)) => format!("suspend after {s}s without a session"),
        (false, None) => "suspend after the default grace without a session".into(),
    }
}
