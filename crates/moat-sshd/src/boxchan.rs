//! Session channels: the requests that set a channel up (pty, env), then the
//! program it runs (a box command, a box shell, the sftp subsystem, or a
//! control command), bridged to the box agent's protocol.
//!
//! Input and output run on separate tasks. A single loop would deadlock on bulk
//! transfers in both directions: blocked writing output while the SSH window is
//! full, it would stop draining input, and russh's session loop, blocked
//! handing us input, could not process the window adjustments.

use std::net::SocketAddr;
use std::sync::Arc;

use moat_agent::client::{send, AgentReader};
use moat_agent::protocol::{AgentMsg, ExecRequest, ExitStatus, HostMsg, PtySpec, Run, WinSize, MAX_CHUNK};
use moat_api::{ApiClient, ApiError, Lease, Op, Reply, Request, Route};
use moat_core::ids::CONTROL_USER;
use moat_core::web::Owner;
use moat_core::{AccountId, Name};
use russh::server::{Handle, Msg};
use russh::{Channel, ChannelId, ChannelMsg, ChannelReadHalf, ChannelWriteHalf, Sig};
use tokio::net::UnixStream;

use crate::control;
use crate::setup::ChannelSetup;
use crate::task::AbortOnDrop;

/// Exit status for failures of moat itself rather than of the command (as ssh).
const EXIT_MOAT_FAILED: u32 = 255;
/// How long an agent that refused a session has to say why.
const AGENT_LAST_WORD: std::time::Duration = std::time::Duration::from_secs(1);

/// The subsystem moat serves (inside the box).
pub const SFTP_SUBSYSTEM: &str = "sftp";

/// Who is on the other end and what they can reach.
#[derive(Clone)]
pub struct ChannelCtx {
    /// The privileged side.
    pub api: ApiClient,
    /// The authenticated account.
    pub account: AccountId,
    /// The SSH user name, which picks the target.
    pub user: String,
    /// The connection's handle, for replies russh's channel API lacks.
    pub handle: Handle,
    /// The connection's two ends, client's first, as sshd gives a session
    /// them (`SSH_CLIENT`, `SSH_CONNECTION`), when known.
    pub ends: Option<(SocketAddr, SocketAddr)>,
}

/// What a channel talks to, by its SSH user name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `moat@`: the control plane, always.
    Control,
    /// One of the account's boxes.
    Box(Name),
    /// A name that was one of the account's boxes (removed, or renamed by
    /// `promote`): nothing runs, whatever the command.
    Gone(String),
    /// A name close to one of the account's boxes (`b11` when `b1` is one):
    /// a mistyped box, told as one; nothing runs, control commands included.
    Near(String, Name),
    /// Any other name (the client's local user, as in `ssh HOST ls`): control
    /// commands run, anything else is taken for a mistyped box.
    Other(String),
    /// What the name is could not be told (the state store unreachable, a
    /// fleet's node lost): nothing runs, and the user hears why.
    Unknown(ApiError),
}

impl ChannelCtx {
    /// The user name picks the target. A command meant for a box never acts on
    /// the control plane; another account's box looks like no box at all.
    pub async fn target(&self) -> Target {
        if self.user == CONTROL_USER {
            return Target::Control;
        }
        // A user name that is no box name is looked up as the name it comes
        // closest to spelling (`WEB`, `web `, `wéb`): a box there makes it
        // a mistyped box, not the control plane (`ssh WEB@HOST rm x` must not
        // remove box x).
        let (name, owner, respelled) = match self.shared() {
            Some((name, owner)) => (name, Some(owner), false),
            None => match Name::new(&self.user) {
                Ok(name) => (name, None, false),
                Err(_) => match respelled_as_name(&self.user) {
                    Some(name) => (name, None, true),
                    None => return Target::Other(self.user.clone()),
                },
            },
        };
        let route = Request::Act { account: self.account.clone(), op: Op::Route { name: name.clone(), owner } };
        let route = self.api.call(&route).await;
        match route {
            Ok(Reply::Route(Route::Box)) if respelled => Target::Near(self.user.clone(), name),
            Ok(Reply::Route(Route::Box)) => Target::Box(name),
            Ok(Reply::Route(Route::Near(meant))) => Target::Near(self.user.clone(), meant),
            Ok(Reply::Route(Route::None)) => Target::Other(self.user.clone()),
            Ok(Reply::Route(Route::Gone)) => Target::Gone(self.user.clone()),
            // A failure must not route a box's command to the control plane.
            Ok(reply) => Target::Unknown(ApiError::unexpected(&reply)),
            Err(e) => Target::Unknown(e),
        }
    }

    /// The box a user name `NAME.OWNER` names: `OWNER`'s box `NAME`, if it
    /// shared it with this account (`share`); `OWNER` is the slug in its URLs.
    fn shared(&self) -> Option<(Name, Owner)> {
        let (name, owner) = self.user.split_once('.')?;
        Some((Name::new(name).ok()?, Owner::parse(owner).ok()?))
    }

    /// Opens a session on the box (resuming or booting it as needed): a
    /// stream to its agent. The box stays up while the lease lives.
    pub async fn connect(&self, name: &Name) -> Result<(UnixStream, Lease), ApiError> {
        let owner = self.shared().map(|(_, owner)| owner);
        let (fd, lease) = self.api.open_shared_session(&self.account, name, owner.as_ref()).await?;
        let stream = std::os::unix::net::UnixStream::from(fd);
        let stream = stream.set_nonblocking(true).and_then(|()| UnixStream::from_std(stream));
        let stream = stream.map_err(|e| ApiError { status: 255, message: format!("box {name}: {e}") })?;
        Ok((stream, lease))
    }
}

/// The box name `user` comes closest to spelling: in lower case, each
/// character a name cannot hold made a `-`, without `-` at its ends.
fn respelled_as_name(user: &str) -> Option<Name> {
    let spelled: String = user
        .chars()
        .take(63)
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' })
        .collect();
    Name::new(spelled.trim_matches('-')).ok()
}

/// `SSH_CLIENT` and `SSH_CONNECTION`, as sshd sets them: bash reads
/// `~/.bashrc` for a command only when it sees them (Debian's and most
/// builds), which is where nvm, pyenv and `~/.local/bin` go on `PATH`.
fn ssh_variables(ends: Option<(SocketAddr, SocketAddr)>) -> Vec<(String, String)> {
    let Some((client, server)) = ends else { return Vec::new() };
    let ip = |a: &SocketAddr| a.ip().to_canonical().to_string();
    vec![
        ("SSH_CLIENT".into(), format!("{} {} {}", ip(&client), client.port(), server.port())),
        ("SSH_CONNECTION".into(), format!("{} {} {} {}", ip(&client), client.port(), ip(&server), server.port())),
    ]
}

/// What a command through a user name that is not a box hears.
fn no_box(user: &str) -> String {
    format!("no box named {user:?} (`ssh HOST ls` lists yours; `ssh {CONTROL_USER}@HOST help` for commands)")
}

/// What a command that is no control command hears through a user name that
/// is no box: when its first word is close to a verb (`lst`), that it is a
/// mistyped command as well.
fn no_box_nor_command(user: &str, command: &[u8]) -> String {
    let line = String::from_utf8_lossy(command);
    let first = crate::words::split(&line).ok().and_then(|words| words.into_iter().next());
    match first.as_deref().and_then(|word| Some((word, control::closest_verb(word)?))) {
        Some((word, verb)) => {
            format!("no box named {user:?}, and {word:?} is not a moat command (did you mean {verb:?}?)")
        }
        None => no_box(user),
    }
}

enum Program {
    Exec(Vec<u8>),
    Shell,
    Sftp,
}

/// Serves one session channel until it closes. The connection's handler has
/// answered its requests already; `setup` holds what it accepted.
pub async fn serve(channel: Channel<Msg>, ctx: ChannelCtx, setup: Arc<ChannelSetup>) {
    let (mut rx, tx) = channel.split();
    let mut pty: Option<PtySpec> = None;
    let program = loop {
        match rx.wait().await {
            // The first only: a second was refused (see `take_terminal`).
            Some(ChannelMsg::RequestPty { term, col_width, row_height, .. }) if pty.is_none() => {
                pty = Some(PtySpec { term, size: winsize(col_width, row_height) });
            }
            Some(ChannelMsg::WindowChange { col_width, row_height, .. }) => {
                if let Some(p) = pty.as_mut() {
                    p.size = winsize(col_width, row_height);
                }
            }
            Some(ChannelMsg::Exec { command, .. }) if command.contains(&0) => {
                return fail(&tx, "the command holds a NUL byte: refused", EXIT_MOAT_FAILED).await;
            }
            Some(ChannelMsg::Exec { command, .. }) => break Program::Exec(command),
            Some(ChannelMsg::RequestShell { .. }) => break Program::Shell,
            Some(ChannelMsg::RequestSubsystem { name, .. }) if name == SFTP_SUBSYSTEM => break Program::Sftp,
            Some(ChannelMsg::Close) | None => return,
            Some(_) => {}
        }
    };
    let env = setup.take_env();
    match ctx.target().await {
        Target::Control => run_control(program, rx, &tx, &ctx).await,
        Target::Box(name) => run_in_box(&name, program, pty, env, rx, tx, &ctx).await,
        Target::Gone(user) => fail(&tx, &no_box(&user), EXIT_MOAT_FAILED).await,
        Target::Unknown(e) => fail(&tx, &e.message, EXIT_MOAT_FAILED).await,
        Target::Near(user, meant) => {
            let msg = format!("no box named {user:?} (did you mean {:?}?)", meant.as_str());
            fail(&tx, &msg, EXIT_MOAT_FAILED).await
        }
        Target::Other(user) => match &program {
            Program::Exec(cmd) if control::is_control_command(&String::from_utf8_lossy(cmd)) => {
                run_control(program, rx, &tx, &ctx).await
            }
            Program::Shell => run_control(program, rx, &tx, &ctx).await,
            Program::Exec(cmd) => fail(&tx, &no_box_nor_command(&user, cmd), EXIT_MOAT_FAILED).await,
            Program::Sftp => fail(&tx, &no_box(&user), EXIT_MOAT_FAILED).await,
        },
    }
}

fn winsize(cols: u32, rows: u32) -> WinSize {
    let clamp = |v: u32| u16::try_from(v).unwrap_or(u16::MAX);
    WinSize { cols: clamp(cols), rows: clamp(rows) }
}

/// Ends a channel with an exit status: status, EOF, close. The status goes
/// first: a client that has sent its own EOF closes the channel once it sees
/// ours (OpenSSH's does, over a ControlMaster connection often), and a
/// status arriving after that close is dropped: the client exits 255.
async fn finish(tx: &ChannelWriteHalf<Msg>, status: u32) {
    let _ = tx.exit_status(status).await;
    let _ = tx.eof().await;
    let _ = tx.close().await;
}

async fn fail(tx: &ChannelWriteHalf<Msg>, msg: &str, status: u32) {
    let msg = crate::control::render::terminal_safe(msg);
    let _ = tx.extended_data(1, format!("moat: {msg}\n").as_bytes()).await;
    finish(tx, status).await;
}

async fn run_control(program: Program, mut rx: ChannelReadHalf, tx: &ChannelWriteHalf<Msg>, ctx: &ChannelCtx) {
    let line = match program {
        Program::Exec(cmd) => String::from_utf8_lossy(&cmd).into_owned(),
        Program::Shell => {
            let mut text = String::new();
            if ctx.user != CONTROL_USER && Name::new(&ctx.user).is_ok() {
                text.push_str(&format!("moat: you have no box named {:?}; this is the control plane.\n\n", ctx.user));
            }
            text.push_str(&control::help());
            let _ = tx.data(text.as_bytes()).await;
            return finish(tx, 0).await;
        }
        Program::Sftp => return fail(tx, "sftp needs a box: sftp NAME@HOST", 1).await,
    };
    let words = match crate::words::split(&line) {
        Ok(words) => words,
        Err(e) => return fail(tx, &e.to_string(), 2).await,
    };
    let plan = match control::parse(&words) {
        Ok(plan) => plan,
        Err(e) => return fail(tx, &e.to_string(), 2).await,
    };
    // (`moat` itself the manager refuses, for every way in.)
    if let Some(name) = plan.creates().filter(|name| name.as_str() == ctx.user && ctx.user != CONTROL_USER) {
        let msg = format!(
            "you are connected as \"{name}\": a box by that name would take that user name from the control \
             plane; create it through the control plane's own name: ssh {CONTROL_USER}@HOST ..."
        );
        return fail(tx, &msg, 2).await;
    }
    // What the command prints goes out as it comes (progress of an image build
    // to stderr, a diff's lines to stdout); the channel's window paces it.
    let (out_tx, mut out_rx) = tokio::sync::mpsc::channel::<control::Output>(4);
    // The client's stdin, for the commands that read it; a command that does
    // not leaves it unread, and the channel's window stops the client.
    let (in_tx, in_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
    // The channel closed (the client gone, Ctrl-C): the work stops then,
    // even when it prints nothing (a race's copies running `sleep`).
    let (gone_tx, mut gone_rx) = tokio::sync::oneshot::channel::<()>();
    let stdin = tokio::spawn(async move {
        let mut in_tx = Some(in_tx);
        while let Some(msg) = rx.wait().await {
            match msg {
                ChannelMsg::Data { data } => {
                    if let Some(sender) = &in_tx {
                        if sender.send(data.to_vec()).await.is_err() {
                            in_tx = None;
                        }
                    }
                }
                ChannelMsg::Eof => in_tx = None,
                ChannelMsg::Close => break,
                _ => {}
            }
        }
        let _ = gone_tx.send(());
    });
    let api = ctx.api.clone();
    let account = ctx.account.clone();
    // Returning (or this task's end with the connection's) stops the work.
    let mut work = AbortOnDrop(tokio::spawn(async move { control::run(plan, &account, &api, &out_tx, in_rx).await }));
    let _stdin = AbortOnDrop(stdin);
    loop {
        let output = tokio::select! {
            output = out_rx.recv() => output,
            _ = &mut gone_rx => return,
        };
        let Some(output) = output else { break };
        let sending = async {
            match output {
                control::Output::Stdout(text) => tx.data(text.as_bytes()).await,
                control::Output::Stderr(text) => tx.extended_data(1, text.as_bytes()).await,
            }
        };
        // A closed channel's window never opens again: its close ends the wait.
        let sent = tokio::select! {
            sent = sending => sent.is_ok(),
            _ = &mut gone_rx => false,
        };
        if !sent {
            // The client has gone: stop the work rather than run it unread.
            return;
        }
    }
    match (&mut work.0).await {
        Ok(Ok(())) => finish(tx, 0).await,
        Ok(Err(e)) => fail(tx, &e.message, e.status).await,
        Err(e) => fail(tx, &format!("internal error: {e}"), EXIT_MOAT_FAILED).await,
    }
}

async fn run_in_box(
    name: &Name,
    program: Program,
    pty: Option<PtySpec>,
    env: Vec<(String, String)>,
    rx: ChannelReadHalf,
    tx: ChannelWriteHalf<Msg>,
    ctx: &ChannelCtx,
) {
    let (stream, session) = match ctx.connect(name).await {
        Ok(s) => s,
        Err(e) => return fail(&tx, &e.message, EXIT_MOAT_FAILED).await,
    };
    let id = tx.id();
    let mut env = env;
    env.extend(ssh_variables(ctx.ends));
    // Ending the work drops the stream to the agent: the session ends in the
    // box as when the client goes.
    if while_leased(&session, carry_session(name, program, pty, env, rx, tx, ctx, stream)).await {
        let why = format!("moat: your access to box {name} was taken away\n");
        let _ = ctx.handle.extended_data(id, 1, why.into_bytes()).await;
        let _ = ctx.handle.exit_status_request(id, EXIT_MOAT_FAILED).await;
        let _ = ctx.handle.eof(id).await;
        let _ = ctx.handle.close(id).await;
    }
}

/// How long work goes on after its lease ended before that is taken for
/// access taken away (see [`while_leased`]).
const LEASE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Runs `work` for as long as `session` lasts; whether it was cut short
/// because the account's access to the box was taken away. The lease's end
/// is taken so only if `work` does not end on its own within [`LEASE_GRACE`]
/// of it: through a fleet's router the lease ends with the session's stream,
/// and what is still on its way to the client must get there.
pub(crate) async fn while_leased(session: &Lease, work: impl std::future::Future<Output = ()>) -> bool {
    tokio::pin!(work);
    tokio::select! {
        () = &mut work => return false,
        () = session.ended() => {}
    }
    tokio::time::timeout(LEASE_GRACE, &mut work).await.is_err()
}

/// Runs `program` in the box over `stream`, the agent's, until it ends.
#[allow(clippy::too_many_arguments)]
async fn carry_session(
    name: &Name,
    program: Program,
    pty: Option<PtySpec>,
    env: Vec<(String, String)>,
    mut rx: ChannelReadHalf,
    tx: ChannelWriteHalf<Msg>,
    ctx: &ChannelCtx,
    stream: UnixStream,
) {
    let (read, mut write) = stream.into_split();
    let run = match program {
        Program::Exec(cmd) => Run::Command(cmd),
        Program::Shell => Run::Shell,
        Program::Sftp => Run::Sftp,
    };
    let req = ExecRequest { run, env, pty };
    let mut read = AgentReader::new(read);
    if let Err(e) = send(&mut write, &HostMsg::Exec(req)).await {
        // An agent that could not take the session says why before it
        // closes (a box at its process limit): that, not the broken pipe.
        let why = match tokio::time::timeout(AGENT_LAST_WORD, read.recv()).await {
            Ok(Ok(Some(AgentMsg::Error(why)))) => why,
            _ => e.to_string(),
        };
        return fail(&tx, &format!("box {name}: {why}"), EXIT_MOAT_FAILED).await;
    }
    let id = tx.id();
    let handle = ctx.handle.clone();
    let mut output = AbortOnDrop(tokio::spawn(pump_output(read, tx, handle, id)));

    loop {
        // Once the output side has closed the channel, russh drops the client's
        // closing reply instead of passing it on: waiting for it would hold
        // this channel's slot and the box's session for the whole connection.
        let msg = tokio::select! {
            msg = rx.wait() => msg,
            _ = &mut output.0 => return,
        };
        // The client closed the channel: nothing more goes to it, and output
        // waiting for its window would wait forever. Returning drops both
        // ends of the agent's stream, so the process's output pipes close
        // (it gets EPIPE, as under sshd) and the box's session ends.
        let Some(msg) = msg else { return };
        let sent = match msg {
            ChannelMsg::Data { data } => {
                let mut result = Ok(());
                for chunk in data.chunks(MAX_CHUNK) {
                    result = send(&mut write, &HostMsg::Stdin(chunk.to_vec())).await;
                    if result.is_err() {
                        break;
                    }
                }
                result
            }
            ChannelMsg::Eof => send(&mut write, &HostMsg::StdinEof).await,
            ChannelMsg::Eow => send(&mut write, &HostMsg::OutputClosed).await,
            ChannelMsg::WindowChange { col_width, row_height, .. } => {
                send(&mut write, &HostMsg::Resize(winsize(col_width, row_height))).await
            }
            ChannelMsg::Signal { signal } => match signo(&signal) {
                Some(n) => send(&mut write, &HostMsg::Signal(n)).await,
                None => Ok(()),
            },
            ChannelMsg::Close => return,
            _ => Ok(()),
        };
        if sent.is_err() {
            // The agent hung up; the output task reports why.
            break;
        }
    }
    drop(write);
    let _ = (&mut output.0).await;
}

/// Messages a session's agent may send besides output and its end (it says
/// `Started` once).
pub(crate) const MAX_UNASKED: usize = 16;

async fn pump_output(
    mut agent: AgentReader<tokio::net::unix::OwnedReadHalf>,
    tx: ChannelWriteHalf<Msg>,
    handle: Handle,
    id: ChannelId,
) {
    // An agent is the box's (a microVM guest's root can speak for it): what a
    // session does not carry is let by a few times, then ends it.
    let mut unasked = 0;
    loop {
        match agent.recv().await {
            Ok(Some(AgentMsg::Stdout(data))) => {
                if tx.data(&data[..]).await.is_err() {
                    return;
                }
            }
            Ok(Some(AgentMsg::Stderr(data))) => {
                if tx.extended_data(1, &data[..]).await.is_err() {
                    return;
                }
            }
            Ok(Some(AgentMsg::Exit(ExitStatus::Code(code)))) => {
                return finish(&tx, u32::try_from(code).unwrap_or(EXIT_MOAT_FAILED)).await;
            }
            Ok(Some(AgentMsg::Exit(ExitStatus::Signal { signo, core_dumped }))) => {
                // As sshd: exit-signal instead of exit-status (the client
                // exits 255), before EOF as in `finish`.
                let _ = handle.exit_signal_request(id, sig(signo), core_dumped, String::new(), String::new()).await;
                let _ = tx.eof().await;
                let _ = tx.close().await;
                return;
            }
            // The shell could not be started (a command past execve's limits,
            // no shell in the image): sshd's child says why and exits 1.
            Ok(Some(AgentMsg::Error(msg))) => return fail(&tx, &msg, 1).await,
            Ok(Some(_)) if unasked < MAX_UNASKED => unasked += 1,
            Ok(Some(_)) => {
                return fail(&tx, "the box's agent sends what a session does not carry", EXIT_MOAT_FAILED).await
            }
            Ok(None) | Err(_) => return fail(&tx, "lost the connection to the box", EXIT_MOAT_FAILED).await,
        }
    }
}

/// The signal number for an SSH signal name (RFC 4254 names, without "SIG").
fn signo(sig: &Sig) -> Option<i32> {
    Some(match sig {
        Sig::HUP => libc_sig::HUP,
        Sig::INT => libc_sig::INT,
        Sig::QUIT => libc_sig::QUIT,
        Sig::ILL => libc_sig::ILL,
        Sig::ABRT => libc_sig::ABRT,
        Sig::FPE => libc_sig::FPE,
        Sig::KILL => libc_sig::KILL,
        Sig::USR1 => libc_sig::USR1,
        Sig::SEGV => libc_sig::SEGV,
        Sig::PIPE => libc_sig::PIPE,
        Sig::ALRM => libc_sig::ALRM,
        Sig::TERM => libc_sig::TERM,
        Sig::Custom(name) if name == "USR2" => libc_sig::USR2,
        Sig::Custom(_) => return None,
    })
}

/// The SSH signal name for a signal number.
fn sig(signo: i32) -> Sig {
    match signo {
        libc_sig::HUP => Sig::HUP,
        libc_sig::INT => Sig::INT,
        libc_sig::QUIT => Sig::QUIT,
        libc_sig::ILL => Sig::ILL,
        libc_sig::ABRT => Sig::ABRT,
        libc_sig::FPE => Sig::FPE,
        libc_sig::KILL => Sig::KILL,
        libc_sig::USR1 => Sig::USR1,
        libc_sig::SEGV => Sig::SEGV,
        libc_sig::PIPE => Sig::PIPE,
        libc_sig::ALRM => Sig::ALRM,
        libc_sig::TERM => Sig::TERM,
        libc_sig::USR2 => Sig::Custom("USR2".into()),
        // RFC 4254 names no others, and a name outside its list must be
        // `name@domain`: OpenSSH's sshd sends this one for them all.
        _ => Sig::Custom("SIG@openssh.com".into()),
    }
}

/// Linux signal numbers (x86-64), the ones SSH has names for.
mod libc_sig {
    pub const HUP: i32 = 1;
    pub const INT: i32 = 2;
    pub const QUIT: i32 = 3;
    pub const ILL: i32 = 4;
    pub const ABRT: i32 = 6;
    pub const FPE: i32 = 8;
    pub const KILL: i32 = 9;
    pub const USR1: i32 = 10;
    pub const SEGV: i32 = 11;
    pub const USR2: i32 = 12;
    pub const PIPE: i32 = 13;
    pub const ALRM: i32 = 14;
    pub const TERM: i32 = 15;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mistyped_commands_are_told_as_such() {
        let told = no_box_nor_command("root", b"lst --json");
        assert_eq!(told, "no box named \"root\", and \"lst\" is not a moat command (did you mean \"ls\"?)");
        for other in [&b"make test"[..], b"", b"'unterminated", &[0xff, b' ', b'x']] {
            assert_eq!(no_box_nor_command("root", other), no_box("root"), "{other:?}");
        }
    }

    #[test]
    fn user_names_that_are_no_box_name_are_respelled_as_one() {
        let respelled = |user: &str| respelled_as_name(user).map(|n| n.as_str().to_string());
        for (user, name) in [("WEB", "web"), ("web ", "web"), ("bb.", "bb"), ("wéb", "w-b"), ("John.Doe", "john-doe")]
        {
            assert_eq!(respelled(user).as_deref(), Some(name), "{user:?}");
        }
        for user in ["", "--", "é", "\u{0}"] {
            assert_eq!(respelled(user), None, "{user:?}");
        }
    }

    #[test]
    fn signals_map_both_ways() {
        for n in [1, 2, 3, 4, 6, 8, 9, 10, 11, 12, 13, 14, 15] {
            assert_eq!(signo(&sig(n)), Some(n));
        }
        assert_eq!(signo(&Sig::Custom("WINCH".into())), None);
        // SIGBUS, SIGXCPU: not named by SSH.
        for n in [7, 24] {
            assert!(matches!(sig(n), Sig::Custom(name) if name == "SIG@openssh.com"), "{n}");
        }
    }
}
