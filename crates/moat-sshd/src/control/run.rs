//! Carries out a parsed command through the privileged side's API.

use moat_api::{ApiClient, ApiError, Reply, Request};
use moat_core::AccountId;

use super::grammar::{Command, HELP};
use super::render;

/// Runs a command for `account`, passing progress lines to `progress`;
/// returns what goes to stdout.
pub async fn run(
    cmd: Command,
    account: &AccountId,
    api: &ApiClient,
    progress: &mut (dyn FnMut(&str) + Send),
) -> Result<String, ApiError> {
    let account = account.clone();
    let (request, json) = match cmd {
        Command::Help => return Ok(HELP.to_string()),
        Command::New { name, image, limits, idle } => (Request::Create { account, name, image, limits, idle }, false),
        Command::Ls { json } => (Request::List { account }, json),
        Command::Info { name, json } => (Request::Get { account, name }, json),
        Command::Rm { name } => (Request::Remove { account, name }, false),
        Command::Dup { src, dst } => (Request::Dup { account, src, dst }, false),
        Command::Diff { a, b, json } => (Request::Diff { account, a, b }, json),
        Command::Promote { child } => (Request::Promote { account, child }, false),
        Command::Stop { name } => (Request::Stop { account, name }, false),
        Command::Start { name } => (Request::Start { account, name }, false),
        Command::Suspend { name } => (Request::Suspend { account, name }, false),
        Command::SetIdle { name, seconds } => (Request::SetIdle { account, name, seconds }, false),
        Command::SetKeepRunning { name, on } => (Request::SetKeepRunning { account, name, on }, false),
        Command::Usage { name, since, json } => (Request::Usage { account, since: since.unwrap_or(0), name }, json),
    };
    let info = matches!(request, Request::Get { .. });
    let reply = api.call_with_progress(&request, progress).await?;
    Ok(match reply {
        Reply::Boxes(boxes) => render::boxes(&boxes, json),
        Reply::Box(b) if info => render::info(&b, json),
        // `new` and `dup` print the name made, for scripts.
        Reply::Box(b) => format!("{}\n", b.name),
        Reply::Changes(changes) => render::changes(&changes, json),
        Reply::Name(name) => format!("{name}\n"),
        Reply::Usage(report) => render::usage(&report, json),
        Reply::Done => String::new(),
        other @ (Reply::Account(_) | Reply::Route(_) | Reply::Session) => return Err(ApiError::unexpected(&other)),
    })
}
