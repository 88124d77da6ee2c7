//! Carries out `race` (see [`super::verbs::race`]): checks that N copies fit
//! the account's limits before any is made, dups the box N times (O(1)
//! each), runs the command in every copy at once over each copy's agent
//! session, streams each line prefixed by its copy (or as JSON lines), then
//! prints the table (exit, wall time, files changed from `diff`, effects)
//! and keeps what was asked. Copies not kept are removed however the race
//! ends: finished, failed, or the client gone (Ctrl-C closes the channel,
//! which ends every run: a removed box's processes end with it).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use moat_agent::client::{send, AgentReader};
use moat_agent::protocol::{AgentMsg, ExecRequest, ExitStatus, HostMsg, Run};
use moat_api::{ApiClient, ApiError, Event, Op, Reply, Request};
use moat_core::effects::Since;
use moat_core::{AccountId, Name};
use tokio::sync::mpsc;

use super::run::Output;
use super::verbs::race::{Keep, RaceSpec};
use crate::task::AbortOnDrop;

/// One copy's run, as it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// Its exit code, or why it has none (a signal, a failure to start).
    pub exit: Result<i32, String>,
    /// From the start of its command to its end.
    pub wall: Duration,
}

/// What a run says as it goes.
enum RunEvent {
    Line { copy: usize, stderr: bool, text: String },
    Done { copy: usize, finish: Finish },
}

/// Copies made so far; those not kept are removed when this is dropped
/// (also when the race is abandoned mid-way: the task is dropped).
struct Copies {
    api: ApiClient,
    account: AccountId,
    /// The box they are copies of.
    parent: Name,
    /// Each copy's name, and its id once its dup has answered (`None`: asked
    /// for, and the race abandoned before the answer).
    names: Vec<(Name, Option<String>)>,
    /// Stay when this is dropped.
    kept: Vec<Name>,
}

impl Copies {
    fn unkept(&self) -> Vec<(Name, Option<String>)> {
        self.names.iter().filter(|(n, _)| !self.kept.contains(n)).cloned().collect()
    }

    /// Removes the copies not kept, all at once, and answers once they are
    /// gone (the race's last word says so: a `dup` to one of their names
    /// right after must find it free). Cut short, the rest are removed when
    /// this is dropped.
    async fn remove_unkept(&mut self) {
        let gone = self.unkept();
        let (api, account, parent) = (&self.api, &self.account, &self.parent);
        futures::future::join_all(
            gone.iter().map(|(name, id)| remove(api, account, name.clone(), id.as_deref(), parent)),
        )
        .await;
        self.names.retain(|(n, _)| !gone.iter().any(|(g, _)| g == n));
    }
}

impl Drop for Copies {
    fn drop(&mut self) {
        let gone = self.unkept();
        if gone.is_empty() {
            return;
        }
        let (api, account, parent) = (self.api.clone(), self.account.clone(), self.parent.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for (name, id) in gone {
                    remove(&api, &account, name, id.as_deref(), &parent).await;
                }
            });
        }
    }
}

/// Removes copy `name`: the box of id `id`, or, where its dup never
/// answered, a copy of `parent` once it is made (a few seconds at most):
/// never a box that took the name meanwhile.
async fn remove(api: &ApiClient, account: &AccountId, name: Name, id: Option<&str>, parent: &Name) {
    for _ in 0..40 {
        let ours = match call(api, account, Op::Get { name: name.clone() }).await {
            Ok(Reply::Box(b)) if b.state == "creating" && id.is_none() => {
                tokio::time::sleep(Duration::from_millis(250)).await;
                continue;
            }
            Ok(Reply::Box(b)) => match id {
                Some(id) => b.id == id,
                None => b.parent.as_ref() == Some(parent),
            },
            Ok(_) | Err(_) => false,
        };
        if ours {
            let _ = call(api, account, Op::Remove { name }).await;
        }
        return;
    }
}

async fn call(api: &ApiClient, account: &AccountId, op: Op) -> Result<Reply, ApiError> {
    api.call(&Request::Act { account: account.clone(), op }).await
}

fn refused(message: String) -> ApiError {
    ApiError { status: 1, message }
}

/// Runs the race, printing to `out`.
pub async fn race(
    spec: RaceSpec,
    account: &AccountId,
    api: &ApiClient,
    out: &mpsc::Sender<Output>,
) -> Result<(), ApiError> {
    let names: Vec<Name> = (1..=spec.copies).map(|i| spec.copy_name(i).map_err(refused)).collect::<Result<_, _>>()?;
    fits(&spec, &names, account, api).await?;
    // Every copy is asked for at once (the parent is held only while each is
    // copied, and the copies boot side by side). Each is the race's to remove
    // until its dup says it failed (then the name may be another box's): one
    // whose dup is cut short by the client going away may still be made.
    let mut copies = Copies {
        api: api.clone(),
        account: account.clone(),
        parent: spec.name.clone(),
        names: names.iter().map(|n| (n.clone(), None)).collect(),
        kept: Vec::new(),
    };
    let mut dups = tokio::task::JoinSet::new();
    for name in &names {
        let (api, account, name) = (api.clone(), account.clone(), name.clone());
        let op = Op::Dup { src: spec.name.clone(), dst: name.clone() };
        dups.spawn(async move { (name, call(&api, &account, op).await) });
    }
    let mut failed = None;
    while let Some(done) = dups.join_next().await {
        match done {
            Ok((name, Ok(made))) => {
                let id = match made {
                    Reply::Box(b) => Some(b.id),
                    _ => None,
                };
                copies.names.iter_mut().filter(|(n, _)| *n == name).for_each(|(_, known)| *known = id.clone());
            }
            Ok((name, Err(e))) => {
                copies.names.retain(|(n, _)| *n != name);
                failed.get_or_insert(e);
            }
            Err(e) => {
                failed.get_or_insert(refused(format!("internal error: {e}")));
            }
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let (tx, mut rx) = mpsc::channel::<RunEvent>(256);
    let _runs: Vec<AbortOnDrop> = names
        .iter()
        .enumerate()
        .map(|(copy, name)| {
            let (api, account, name, command, tx) =
                (api.clone(), account.clone(), name.clone(), spec.command.clone(), tx.clone());
            AbortOnDrop(tokio::spawn(async move {
                let finish = run_one(&api, &account, &name, &command, copy, &tx).await;
                let _ = tx.send(RunEvent::Done { copy, finish }).await;
            }))
        })
        .collect();
    drop(tx);
    let mut finished: Vec<Option<Finish>> = vec![None; names.len()];
    // What each copy changed and did, asked as soon as its run ends (the
    // core takes diffs a few at a time), while the others still run.
    let mut tallies: Vec<Option<AbortOnDrop<Tally>>> = names.iter().map(|_| None).collect();
    let mut order = Vec::new();
    while order.len() < names.len() {
        let event = tokio::select! {
            event = rx.recv() => event,
            // The client went away (Ctrl-C): every run ends, copies go.
            () = out.closed() => return Ok(()),
        };
        let Some(event) = event else { break };
        let text = match event {
            RunEvent::Line { copy, stderr, text } => {
                let Some(name) = names.get(copy) else { continue };
                let line = if spec.json {
                    let stream = if stderr { "stderr" } else { "stdout" };
                    format!("{}\n", serde_json::json!({ "copy": name, "stream": stream, "line": text }))
                } else {
                    format!("[{name}] {text}\n")
                };
                if stderr && !spec.json {
                    Output::Stderr(line)
                } else {
                    Output::Stdout(line)
                }
            }
            RunEvent::Done { copy, finish } => {
                if let (Some(slot), Some(tally), Some(name)) =
                    (finished.get_mut(copy), tallies.get_mut(copy), names.get(copy))
                {
                    *slot = Some(finish);
                    *tally = Some(AbortOnDrop(tokio::spawn(tally_of(
                        api.clone(),
                        account.clone(),
                        spec.name.clone(),
                        name.clone(),
                    ))));
                }
                order.push(copy);
                continue;
            }
        };
        if out.send(text).await.is_err() {
            return Ok(());
        }
    }
    let mut rows = Vec::new();
    for (copy, (name, tally)) in names.iter().zip(tallies).enumerate() {
        let finish = finished.get(copy).cloned().flatten();
        let (files, effects) = match tally {
            Some(tally) => tally.join().await.unwrap_or((None, None)),
            None => (None, None),
        };
        rows.push(Row { name: name.clone(), finish, files, effects, kept: false });
    }
    let winner = match &spec.keep {
        Keep::All => None,
        Keep::Best => order
            .iter()
            .copied()
            .find(|&c| rows.get(c).is_some_and(|r| matches!(&r.finish, Some(f) if f.exit == Ok(0)))),
        Keep::Pick(test) => {
            let mut found = None;
            for &copy in &order {
                let Some(name) = names.get(copy) else { continue };
                let (quiet, _) = mpsc::channel(1);
                if run_one(api, account, name, test, copy, &quiet).await.exit == Ok(0) {
                    found = Some(copy);
                    break;
                }
            }
            found
        }
    };
    // The race's last word: what was kept (stdout), or why nothing was (an
    // error: the race exits non-zero when it was asked to keep a copy and
    // none is kept).
    let last: Result<String, ApiError> = match (&spec.keep, winner) {
        (Keep::All, _) => {
            copies.kept = names.clone();
            Ok(String::new())
        }
        (_, Some(copy)) => match (names.get(copy), rows.get_mut(copy)) {
            (Some(name), Some(row)) => {
                row.kept = true;
                copies.kept.push(name.clone());
                match call(api, account, Op::Promote { child: name.clone() }).await {
                    Ok(Reply::Name(prev)) => {
                        Ok(format!("{name} won and was promoted: it is {} now ({prev} is the box before)\n", spec.name))
                    }
                    Ok(_) => Err(refused(format!("race: {name} won; promoting it failed, so it stays as {name}"))),
                    Err(e) => Err(refused(format!(
                        "race: {name} won; promoting it failed ({}), so it stays as {name}",
                        e.message
                    ))),
                }
            }
            _ => Err(refused("race: no copy won: every copy was removed".into())),
        },
        (_, None) => Err(refused("race: no copy won: every copy was removed".into())),
    };
    let table = if spec.json { json_rows(&rows) } else { table(&rows) };
    let _ = out.send(Output::Stdout(table)).await;
    copies.remove_unkept().await;
    let note = last?;
    if !note.is_empty() {
        let _ = out.send(Output::Stdout(note)).await;
    }
    Ok(())
}

/// Refuses a race whose copies would not fit the account's limits (or
/// whose copies' names are taken), before any copy is made.
async fn fits(spec: &RaceSpec, names: &[Name], account: &AccountId, api: &ApiClient) -> Result<(), ApiError> {
    let Reply::Whoami(me) = call(api, account, Op::Whoami).await? else {
        return Err(refused("race: no account".into()));
    };
    let Reply::Boxes(boxes) = call(api, account, Op::List).await? else { return Err(refused("race: no list".into())) };
    let source = boxes
        .iter()
        .find(|b| b.name == spec.name)
        .ok_or_else(|| refused(format!("race: no box named {}", spec.name)))?;
    if let Some(taken) = boxes.iter().find(|b| names.contains(&b.name)) {
        return Err(refused(format!("race: a box named {} is there already", taken.name)));
    }
    let n = names.len();
    if me.boxes + n > me.limits.max_boxes {
        return Err(refused(format!(
            "race: {n} copies would not fit: this account has {} of at most {} boxes (nothing was made)",
            me.boxes, me.limits.max_boxes
        )));
    }
    let memory: u64 = boxes.iter().map(|b| b.limits.memory).sum();
    let more = source.limits.memory.saturating_mul(n as u64);
    if memory.saturating_add(more) > me.limits.max_memory {
        return Err(refused(format!(
            "race: {n} copies would not fit: their memory limits would bring this account to {} of at most {} bytes \
             (nothing was made)",
            memory.saturating_add(more),
            me.limits.max_memory
        )));
    }
    Ok(())
}

/// Runs `command` in box `name`, sending its output by line as `copy`.
async fn run_one(
    api: &ApiClient,
    account: &AccountId,
    name: &Name,
    command: &str,
    copy: usize,
    tx: &mpsc::Sender<RunEvent>,
) -> Finish {
    let started = Instant::now();
    let ran = async {
        let (fd, _lease) = api.open_session(account, name).await.map_err(|e| e.message)?;
        let stream = std::os::unix::net::UnixStream::from(fd);
        stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        let stream = tokio::net::UnixStream::from_std(stream).map_err(|e| e.to_string())?;
        let (read, mut write) = stream.into_split();
        let req = ExecRequest { run: Run::Command(command.as_bytes().to_vec()), env: Vec::new(), pty: None };
        send(&mut write, &HostMsg::Exec(req)).await.map_err(|e| e.to_string())?;
        relay_output(AgentReader::new(read), copy, tx).await
    };
    let exit = match ran.await {
        Ok(ExitStatus::Code(code)) => Ok(code),
        Ok(ExitStatus::Signal { signo, .. }) => Err(format!("signal {signo}")),
        Err(e) => Err(e),
    };
    Finish { exit, wall: started.elapsed() }
}

/// Sends a command's output by line until it ends; its exit status.
async fn relay_output(
    mut reader: AgentReader<tokio::net::unix::OwnedReadHalf>,
    copy: usize,
    tx: &mpsc::Sender<RunEvent>,
) -> Result<ExitStatus, String> {
    let (mut out, mut err) = (Lines::default(), Lines::default());
    let mut unasked = 0;
    loop {
        let msg = reader.recv().await.map_err(|e| e.to_string())?;
        let (lines, stderr, data) = match msg {
            Some(AgentMsg::Stdout(data)) => (&mut out, false, data),
            Some(AgentMsg::Stderr(data)) => (&mut err, true, data),
            Some(AgentMsg::Exit(status)) => {
                for (lines, stderr) in [(&mut out, false), (&mut err, true)] {
                    if let Some(text) = lines.rest() {
                        let _ = tx.send(RunEvent::Line { copy, stderr, text }).await;
                    }
                }
                return Ok(status);
            }
            Some(AgentMsg::Error(e)) => return Err(e),
            Some(_) if unasked < crate::boxchan::MAX_UNASKED => {
                unasked += 1;
                continue;
            }
            Some(_) => return Err("the box's agent sends what a command does not carry".into()),
            None => return Err("the box's agent hung up".into()),
        };
        for text in lines.feed(&data) {
            let _ = tx.send(RunEvent::Line { copy, stderr, text }).await;
        }
    }
}

/// Splits output into lines across reads.
#[derive(Default)]
struct Lines(Vec<u8>);

/// Longest line held before it is shown as it is.
const MAX_LINE: usize = 16 << 10;

impl Lines {
    fn feed(&mut self, data: &[u8]) -> Vec<String> {
        self.0.extend_from_slice(data);
        let mut lines = Vec::new();
        while let Some(at) = self.0.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.0.drain(..=at).collect();
            lines.push(String::from_utf8_lossy(line.strip_suffix(b"\n").unwrap_or(&line)).into_owned());
        }
        if self.0.len() > MAX_LINE {
            lines.push(String::from_utf8_lossy(&std::mem::take(&mut self.0)).into_owned());
        }
        lines
    }

    fn rest(&mut self) -> Option<String> {
        (!self.0.is_empty()).then(|| String::from_utf8_lossy(&std::mem::take(&mut self.0)).into_owned())
    }
}

/// Files a copy changed (from `diff`) and its effects, where they could be told.
type Tally = (Option<usize>, Option<usize>);

/// The tally of copy `name` of `parent`.
async fn tally_of(api: ApiClient, account: AccountId, parent: Name, name: Name) -> Tally {
    let files = files_changed(&api, &account, &parent, &name).await.ok();
    let effects = match call(&api, &account, Op::Effects { name, since: Since::Start }).await {
        Ok(Reply::Effects(list)) => Some(list.len()),
        _ => None,
    };
    (files, effects)
}

/// How many files `b` changed relative to `a` (from `diff`).
async fn files_changed(api: &ApiClient, account: &AccountId, a: &Name, b: &Name) -> Result<usize, ApiError> {
    let (tx, mut rx) = mpsc::channel::<Event>(16);
    let counting = tokio::spawn(async move {
        let mut n = 0;
        while let Some(event) = rx.recv().await {
            if let Event::Changes(batch) = event {
                n += batch.len();
            }
        }
        n
    });
    let request = Request::Act { account: account.clone(), op: Op::Diff { a: a.clone(), b: b.clone() } };
    api.call_streaming(&request, &tx).await?;
    drop(tx);
    counting.await.map_err(|e| refused(e.to_string()))
}

/// One line of the table.
struct Row {
    name: Name,
    finish: Option<Finish>,
    files: Option<usize>,
    effects: Option<usize>,
    kept: bool,
}

fn table(rows: &[Row]) -> String {
    let mut out = format!("{:<20} {:>8} {:>10} {:>8} {:>8}\n", "COPY", "EXIT", "WALL", "FILES", "EFFECTS");
    for r in rows {
        let exit = match r.finish.as_ref().map(|f| &f.exit) {
            Some(Ok(code)) => code.to_string(),
            Some(Err(why)) => why.chars().take(8).collect(),
            None => "-".into(),
        };
        let wall = r.finish.as_ref().map_or_else(|| "-".into(), |f| format!("{:.2}s", f.wall.as_secs_f64()));
        let count = |n: Option<usize>| n.map_or_else(|| "-".to_string(), |n| n.to_string());
        let mark = if r.kept { "  kept" } else { "" };
        let _ =
            writeln!(out, "{:<20} {exit:>8} {wall:>10} {:>8} {:>8}{mark}", r.name, count(r.files), count(r.effects));
    }
    out
}

fn json_rows(rows: &[Row]) -> String {
    rows.iter()
        .map(|r| {
            let row = serde_json::json!({
                "copy": r.name,
                "exit": r.finish.as_ref().and_then(|f| f.exit.as_ref().ok()),
                "error": r.finish.as_ref().and_then(|f| f.exit.as_ref().err()),
                "wall_ms": r.finish.as_ref().map(|f| f.wall.as_millis() as u64),
                "files_changed": r.files,
                "effects": r.effects,
                "kept": r.kept,
            });
            format!("{row}\n")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_splits_into_lines_across_reads() {
        let mut lines = Lines::default();
        assert!(lines.feed(b"one\ntw").len() == 1);
        assert_eq!(lines.feed(b"o\nthree"), ["two"]);
        assert_eq!(lines.rest().as_deref(), Some("three"));
        assert_eq!(lines.rest(), None);
        assert_eq!(lines.feed(&vec![b'x'; MAX_LINE + 1]).len(), 1);
    }
}
