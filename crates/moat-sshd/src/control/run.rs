//! Carries out a parsed command through the privileged side's API.

use moat_api::{ApiClient, ApiError, Event, Reply, Request};
use moat_core::AccountId;
use tokio::sync::mpsc;

use super::grammar::{Command, HELP};
use super::render;

/// What a command prints, in order, as it goes.
#[derive(Debug)]
pub enum Output {
    /// For stdout.
    Stdout(String),
    /// For stderr (progress).
    Stderr(String),
}

/// Runs a command for `account`, sending what it prints to `out` as it is
/// known (waiting for room there, so a slow reader slows the work).
pub async fn run(
    cmd: Command,
    account: &AccountId,
    api: &ApiClient,
    out: &mpsc::Sender<Output>,
) -> Result<(), ApiError> {
    let account = account.clone();
    let (request, json) = match cmd {
        Command::Help => return print(out, HELP.to_string()).await,
        Command::New { name, image, limits, idle, policy } => {
            (Request::Create { account, name, image, limits, idle, policy }, false)
        }
        Command::Policy { name, json } => (Request::Policy { account, name }, json),
        Command::ChangePolicy { name, change } => (Request::ChangePolicy { account, name, change }, false),
        Command::Log { name, follow, since, json } => {
            let since_ms = since.unwrap_or(0).saturating_mul(1000);
            (Request::Log { account, name, since_ms, follow }, json)
        }
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
    let (diff, info) = (matches!(request, Request::Diff { .. }), matches!(request, Request::Get { .. }));
    let mut changes = render::ChangeStream::new(json);
    let (updates, mut arriving) = mpsc::channel::<Event>(4);
    let reply = {
        let call = async move { api.call_streaming(&request, &updates).await };
        // Returns whether the client went away (the only way `log --follow` ends).
        let show = async {
            while let Some(update) = arriving.recv().await {
                let line = match update {
                    Event::Progress(line) => Output::Stderr(format!("{line}\n")),
                    Event::Changes(batch) => Output::Stdout(changes.next(&batch)),
                    Event::Log(entries) => Output::Stdout(render::log(&entries, json)),
                    Event::Outcome(_) => continue,
                };
                if out.send(line).await.is_err() {
                    return true;
                }
            }
            false
        };
        tokio::pin!(call, show);
        tokio::select! {
            reply = &mut call => {
                show.await;
                reply
            }
            gone = &mut show => {
                if gone {
                    // Dropping the call closes its connection: the work stops.
                    return Ok(());
                }
                call.await
            }
        }
    };
    let text = match reply? {
        Reply::Boxes(boxes) => render::boxes(&boxes, json),
        Reply::Box(b) if info => render::info(&b, json),
        // `new` and `dup` print the name made, for scripts.
        Reply::Box(b) => format!("{}\n", b.name),
        Reply::Name(name) => format!("{name}\n"),
        Reply::Usage(report) => render::usage(&report, json),
        Reply::Policy(policy) => render::policy(&policy, json),
        Reply::Done if diff => changes.end(),
        Reply::Done => String::new(),
        other @ (Reply::Account(_) | Reply::Route(_) | Reply::Session) => return Err(ApiError::unexpected(&other)),
    };
    print(out, text).await
}

async fn print(out: &mpsc::Sender<Output>, text: String) -> Result<(), ApiError> {
    if !text.is_empty() {
        // A closed channel means the client has gone; nothing is left to tell.
        let _ = out.send(Output::Stdout(text)).await;
    }
    Ok(())
}
