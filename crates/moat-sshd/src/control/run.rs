//! Carries out a parsed command through the privileged side's API: the
//! same for every verb (stdin, streamed events, the answer), which differ
//! only in the operation they ask and how they show the answer.

use moat_api::{ApiClient, ApiError, Event, Op, Reply, Request};
use moat_core::egress::Answer;
use moat_core::secrets::{SecretValue, MAX_VALUE};
use moat_core::AccountId;
use tokio::sync::mpsc;

use super::render;
use super::verbs::{Call, Plan};

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
/// is the client's stdin (a secret's value, or answers to questions).
pub async fn run(
    plan: Plan,
    account: &AccountId,
    api: &ApiClient,
    out: &mpsc::Sender<Output>,
    mut input: mpsc::Receiver<Vec<u8>>,
) -> Result<(), ApiError> {
    let Call { op, json, answers, render } = match plan {
        Plan::Print(text) => return print(out, text).await,
        Plan::Call(call) => call,
        Plan::ReadSecret(call) => call(read_value(&mut input).await?),
        Plan::ReadPassword(call) => call(read_password(&mut input).await?),
        Plan::ReadText(max, call) => call(read_text(&mut input, max).await?)?,
        Plan::Race(spec) => return super::race::race(spec, account, api, out).await,
    };
    // (The answer is shown with the operation in hand: `ask ID ANSWER` says what it answered.)
    let request = Request::Act { account: account.clone(), op: op.clone() };
    let mut changes = render::ChangeStream::new(json);
    let (updates, mut arriving) = mpsc::channel::<Event>(4);
    // The newest question shown: what a bare answer on stdin is for.
    let newest = std::sync::Mutex::new(None::<u64>);
    let reply = {
        let answering = async {
            if answers {
                answer_from(input, account, api, out, &newest).await;
            }
            // Stdin closed (or not read): keep showing until the client goes.
            std::future::pending::<()>().await
        };
        // (It owns `updates`: when it ends, the stream of updates ends.)
        let call = async move { api.call_streaming(&request, &updates).await };
        // Returns whether the client went away (the only way `log --follow` ends).
        let shown = async {
            while let Some(update) = arriving.recv().await {
                let line = match update {
                    Event::Progress(line) => Output::Stderr(format!("{}\n", render::terminal_safe(&line))),
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
    let reply = match reply {
        Ok(reply) => reply,
        Err(e) => {
            // JSON changes cut short still end as JSON; the error says why.
            if changes.started() && json {
                print(out, changes.end()).await?;
            }
            return Err(e);
        }
    };
    // An answer that came after changes closes them (then, as text, the
    // verb shows what follows them); any other is the verb's to show.
    let text = match changes.started() {
        true if json => changes.end(),
        true => changes.end() + &render(reply, &op, json)?,
        false => render(reply, &op, json)?,
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
/// Stdin to its end, or to a little past `max` bytes.
async fn read_stdin(input: &mut mpsc::Receiver<Vec<u8>>, max: usize) -> Vec<u8> {
    let mut value = Vec::new();
    while let Some(data) = input.recv().await {
        value.extend_from_slice(&data);
        if value.len() > max + 2 {
            break;
        }
    }
    value
}

/// A registry password from stdin (`image login`).
async fn read_password(input: &mut mpsc::Receiver<Vec<u8>>) -> Result<moat_api::Password, ApiError> {
    let value = read_stdin(input, 1024).await;
    let bad = |message: String| ApiError { status: 2, message: format!("image login: {message}") };
    let text = std::str::from_utf8(&value).map_err(|_| bad("the password is not text".into()))?;
    moat_api::Password::new(text).map_err(bad)
}

/// Text from stdin, to its end (`max` bytes at most).
async fn read_text(input: &mut mpsc::Receiver<Vec<u8>>, max: usize) -> Result<String, ApiError> {
    let value = read_stdin(input, max).await;
    if value.len() > max {
        return Err(ApiError { status: 2, message: format!("stdin holds more than {max} bytes") });
    }
    String::from_utf8(value).map_err(|_| ApiError { status: 2, message: "stdin is not UTF-8 text".into() })
}

async fn read_value(input: &mut mpsc::Receiver<Vec<u8>>) -> Result<SecretValue, ApiError> {
    let value = read_stdin(input, MAX_VALUE).await;
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
                Ok((id, answer)) => {
                    match api.call(&Request::Act { account: account.clone(), op: Op::Answer { id, answer } }).await {
                        Ok(Reply::Question(q)) => Output::Stdout(render::answered(&q, answer)),
                        Ok(other) => Output::Stderr(format!("moat: {}\n", ApiError::unexpected(&other))),
                        Err(e) => Output::Stderr(format!("moat: {e}\n")),
                    }
                }
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
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use std::os::fd::AsFd;
    use std::time::Duration;

    use moat_api::{AccountLimits, Packets, Whoami};
    use moat_core::ManagerConfig;

    use super::*;

    /// A stand-in for the core: answers one dial, reads one request, sends
    /// `events`, and keeps the connection open until the front door closes it.
    async fn core(dialer: Packets, events: Vec<Event>) -> Request {
        let dial = dialer.recv(1).await.unwrap().unwrap();
        let (ours, theirs) = Packets::pair().unwrap();
        dialer.send(&dial.bytes, &[theirs.as_fd()]).await.unwrap();
        drop(theirs);
        let conn = Packets::new(ours).unwrap();
        let request = conn.recv(1 << 16).await.unwrap().unwrap();
        for event in events {
            conn.send(&serde_json::to_vec(&event).unwrap(), &[]).await.unwrap();
        }
        while conn.recv(1).await.is_ok_and(|m| m.is_some()) {}
        serde_json::from_slice(&request.bytes).unwrap()
    }

    /// A call ends with its outcome: what streamed before it is shown, then
    /// the verb's rendering of the answer, and `run` returns (it once waited
    /// for a stream of updates that nothing closed).
    #[tokio::test]
    async fn a_call_ends_with_its_outcome() {
        let (ours, theirs) = Packets::pair().unwrap();
        let api = ApiClient::new(Packets::new(ours).unwrap());
        let me = Whoami {
            account: AccountId("SHA256:abc".into()),
            fingerprint: "SHA256:abc".into(),
            owner: "0123456789".into(),
            boxes: 1,
            limits: AccountLimits::from(&ManagerConfig::default()),
        };
        let events = vec![Event::Progress("working".into()), Event::Outcome(Ok(Reply::Whoami(me)))];
        let core = tokio::spawn(core(Packets::new(theirs).unwrap(), events));
        let plan = super::super::parse(&["whoami".to_string(), "--json".to_string()]).unwrap();
        let (out, mut shown) = mpsc::channel(16);
        let (_stdin, input) = mpsc::channel(1);
        let account = AccountId("SHA256:abc".into());
        let ran = tokio::time::timeout(Duration::from_secs(10), run(plan, &account, &api, &out, input)).await;
        assert!(matches!(ran, Ok(Ok(()))), "{ran:?}");
        drop((out, api));
        assert_eq!(core.await.unwrap(), Request::Act { account, op: Op::Whoami });
        let Some(Output::Stderr(progress)) = shown.recv().await else { panic!("no progress") };
        assert_eq!(progress, "working\n");
        let Some(Output::Stdout(json)) = shown.recv().await else { panic!("no answer") };
        assert!(json.contains("\"fingerprint\": \"SHA256:abc\""), "{json}");
        assert!(shown.recv().await.is_none());
    }

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
