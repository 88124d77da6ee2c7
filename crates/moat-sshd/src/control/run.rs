//! Carries out a parsed command through the privileged side's API.

use moat_api::{ApiClient, ApiError, Event, Reply, Request};
use moat_core::egress::Answer;
use moat_core::secrets::{SecretValue, MAX_VALUE};
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
/// known (waiting for room there, so a slow reader slows the work). `input`
/// is the client's stdin (answers to questions, for `ask` and `log --ask`).
pub async fn run(
    cmd: Command,
    account: &AccountId,
    api: &ApiClient,
    out: &mpsc::Sender<Output>,
    mut input: mpsc::Receiver<Vec<u8>>,
) -> Result<(), ApiError> {
    let owner = account;
    let account = account.clone();
    let mut answers = false;
    let mut answered = None;
    let (request, json) = match cmd {
        Command::Help => return print(out, HELP.to_string()).await,
        Command::New { name, image, limits, idle, policy, ask, backend } => {
            (Request::Create { account, name, image, limits, idle, policy, ask, backend }, false)
        }
        Command::Ask { json } => {
            answers = true;
            (Request::Questions { account, follow: true }, json)
        }
        Command::SecretAdd { spec } => {
            let value = read_value(&mut input).await?;
            (Request::SecretAdd { account, spec, value }, false)
        }
        Command::SecretLs { json } => (Request::SecretList { account }, json),
        Command::SecretRm { name } => (Request::SecretRemove { account, name }, false),
        Command::SecretGrant { name, box_name, grant: true } => {
            (Request::SecretGrant { account, name, box_name }, false)
        }
        Command::SecretGrant { name, box_name, grant: false } => {
            (Request::SecretRevoke { account, name, box_name }, false)
        }
        Command::SecretLimit { name, box_name, limits } => {
            (Request::SecretLimit { account, name, box_name, limits }, false)
        }
        Command::SecretKill { name } => (Request::SecretKill { account, name }, false),
        Command::Answer { id, answer } => {
            answered = Some(answer);
            (Request::Answer { account, id, answer }, false)
        }
        Command::Policy { name, json } => (Request::Policy { account, name }, json),
        Command::ChangePolicy { name, change } => (Request::ChangePolicy { account, name, change }, false),
        Command::Log { name, follow, ask, since, json } => {
            answers = ask;
            let since_ms = since.unwrap_or(0).saturating_mul(1000);
            (Request::Log { account, name, since_ms, follow, ask }, json)
        }
        Command::Ls { json } => (Request::List { account }, json),
        Command::Info { name, json } => (Request::Get { account, name }, json),
        Command::Rm { name } => (Request::Remove { account, name }, false),
        Command::Dup { src, dst } => (Request::Dup { account, src, dst }, false),
        Command::Diff { a, b, json } => (Request::Diff { account, a, b }, json),
        Command::Promote { child } => (Request::Promote { account, child }, false),
        Command::Checkpoint { name, label } => (Request::Checkpoint { account, name, label }, false),
        Command::Checkpoints { name, json } => (Request::Checkpoints { account, name }, json),
        Command::Restore { name, label } => (Request::Restore { account, name, label }, false),
        Command::CheckpointRm { name, label } => (Request::CheckpointRemove { account, name, label }, false),
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
    // The newest question shown: what a bare answer on stdin is for.
    let newest = std::sync::Mutex::new(None::<u64>);
    let reply = {
        let answering = async {
            if answers {
                answer_from(input, owner, api, out, &newest).await;
            }
            // Stdin closed (or not read): keep showing until the client goes.
            std::future::pending::<()>().await
        };
        let call = async move { api.call_streaming(&request, &updates).await };
        // Returns whether the client went away (the only way `log --follow` ends).
        let shown = async {
            while let Some(update) = arriving.recv().await {
                let line = match update {
                    Event::Progress(line) => Output::Stderr(format!("{line}\n")),
                    Event::Changes(batch) => Output::Stdout(changes.next(&batch)),
                    Event::Log(entries) => Output::Stdout(render::log(&entries, json)),
                    Event::Question(q) => {
                        *newest.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(q.id);
                        Output::Stdout(render::question(&q, json))
                    }
                    Event::Outcome(_) => continue,
                };
                if out.send(line).await.is_err() {
                    return true;
                }
            }
            false
        };
        let show = async {
            tokio::select! {
                gone = shown => gone,
                () = answering => false,
            }
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
        Reply::Secrets(secrets) => render::secrets(&secrets, json),
        Reply::Checkpoints(saved) => render::checkpoints(&saved, json),
        Reply::Question(q) => render::answered(&q, answered.unwrap_or(moat_core::egress::Answer::Deny)),
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

/// A secret's value, from stdin to its end: never echoed or logged.
async fn read_value(input: &mut mpsc::Receiver<Vec<u8>>) -> Result<SecretValue, ApiError> {
    let mut value = Vec::new();
    while let Some(data) = input.recv().await {
        value.extend_from_slice(&data);
        if value.len() > MAX_VALUE + 2 {
            break;
        }
    }
    let bad = |e: moat_core::secrets::SecretError| ApiError { status: 2, message: format!("secret add: {e}") };
    let text = std::str::from_utf8(&value).map_err(|_| bad(moat_core::secrets::SecretError::BadValue))?;
    SecretValue::new(text).map_err(bad)
}

/// Longest answer line read; longer ones are skipped.
const MAX_ANSWER_LINE: usize = 256;

/// Reads answers, a line each (`ID ANSWER`, or `ANSWER` for the newest
/// question), from `input` until it closes, and sends them.
async fn answer_from(
    mut input: mpsc::Receiver<Vec<u8>>,
    account: &AccountId,
    api: &ApiClient,
    out: &mpsc::Sender<Output>,
    newest: &std::sync::Mutex<Option<u64>>,
) {
    let mut pending: Vec<u8> = Vec::new();
    while let Some(data) = input.recv().await {
        pending.extend_from_slice(&data);
        while let Some(end) = pending.iter().position(|b| *b == b'\n' || *b == b'\r') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim();
            if line.is_empty() || line.len() > MAX_ANSWER_LINE {
                continue;
            }
            let newest = *newest.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let said = match parse_answer(line, newest) {
                Ok((id, answer)) => match api.call(&Request::Answer { account: account.clone(), id, answer }).await {
                    Ok(Reply::Question(q)) => Output::Stdout(render::answered(&q, answer)),
                    Ok(other) => Output::Stderr(format!("moat: {}\n", ApiError::unexpected(&other))),
                    Err(e) => Output::Stderr(format!("moat: {e}\n")),
                },
                Err(e) => Output::Stderr(format!("moat: {e}\n")),
            };
            if out.send(said).await.is_err() {
                return;
            }
        }
        if pending.len() > MAX_ANSWER_LINE {
            pending.clear();
        }
    }
}

/// `ID ANSWER` or `ANSWER` (for `newest`).
fn parse_answer(line: &str, newest: Option<u64>) -> Result<(u64, Answer), String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words[..] {
        [id, answer] => Ok((id.parse().map_err(|_| format!("{id:?} is no question number"))?, answer.parse()?)),
        [answer] => Ok((newest.ok_or("no question yet")?, answer.parse()?)),
        _ => Err("answer with 'ID once', 'ID always' or 'ID deny'".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_lines() {
        assert_eq!(parse_answer("3 once", None), Ok((3, Answer::Once)));
        assert_eq!(parse_answer("always", Some(7)), Ok((7, Answer::Always)));
        assert_eq!(parse_answer("d", Some(7)), Ok((7, Answer::Deny)));
        assert!(parse_answer("once", None).is_err());
        assert!(parse_answer("x once", Some(1)).is_err());
        assert!(parse_answer("3 maybe", Some(1)).is_err());
        assert!(parse_answer("3 once now", Some(1)).is_err());
    }
}
