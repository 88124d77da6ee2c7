//! End-to-end tests: the real daemon, driven by the real OpenSSH tools, as root.
//!
//! One daemon (with the debian image, built through `ssh new` on first use) is
//! shared by most tests; tests that restart or reconfigure a daemon run their
//! own. A custom runner (harness = false) guarantees the teardown (`moat purge`:
//! boxes, cgroups, the pool's loop mount, temp files) runs even when tests fail.
//! Pass words after `--` to run only the tests whose names contain them.

#![allow(missing_docs)]

mod checkpoints;
mod clients;
mod control;
mod egress;
mod exec;
mod files;
mod fixture;
mod forward;
mod hygiene;
mod isolation;
mod lifecycle;
mod microvm;
mod privsep;
mod pty;
mod restart;
mod secrets;
mod storage;
mod testnet;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use fixture::{run, Daemon, Key, Ran};

/// What every test gets.
pub struct Env {
    pub daemon: Daemon,
    pub alice: Key,
    pub bob: Key,
    pub dir: PathBuf,
    pub net: testnet::TestNet,
}

impl Env {
    /// Runs ssh as alice.
    pub fn alice(&self, user: Option<&str>, args: &[&str]) -> Ran {
        run(&mut self.daemon.ssh(&self.alice, user, args))
    }

    /// Creates one of alice's boxes (a VM box during the VM pass, unless the
    /// test names a backend).
    pub fn new_box(&self, name: &str, args: &[&str]) {
        let mut all = vec!["new", name];
        all.extend_from_slice(args);
        if VM_PASS.load(Ordering::Relaxed) && !args.contains(&"--backend") {
            all.extend_from_slice(&["--backend", "vm"]);
        }
        let out = self.alice(None, &all).ok();
        assert_eq!(out.stdout.trim(), name);
    }
}

type TestFn = fn(&Env);

const TESTS: &[(&str, TestFn)] = &[
    ("control_new_ls_info_rm", control::new_ls_info_rm),
    ("control_bad_input_is_one_line_and_leaves_nothing", control::bad_input_is_one_line_and_leaves_nothing),
    ("control_help_and_control_shell", control::help_and_control_shell),
    ("control_whoami_shows_the_key_and_its_limits", control::whoami_shows_the_key_and_its_limits),
    ("control_mistyped_boxes_and_commands_are_told_as_such", control::mistyped_boxes_and_commands_are_told_as_such),
    ("clients_git_clone_push_pull_with_defaults", clients::git_clone_push_pull_with_defaults),
    ("clients_unaccepted_env_still_runs_the_command", clients::unaccepted_env_still_runs_the_command),
    ("clients_controlmaster_100_commands_then_idle_suspends", clients::controlmaster_100_commands_then_idle_suspends),
    ("clients_paramiko_and_asyncssh_reuse_one_connection", clients::paramiko_and_asyncssh_reuse_one_connection),
    ("clients_ansible_playbook_on_two_boxes", clients::ansible_playbook_on_two_boxes),
    ("clients_user_names_never_misroute", clients::user_names_never_misroute),
    ("clients_box_sees_its_own_totals", clients::box_sees_its_own_totals),
    ("exec_streams_status_and_stderr", exec::streams_status_and_stderr),
    ("exec_death_by_signal_is_reported_as_openssh", exec::death_by_signal_is_reported_as_openssh),
    ("exec_tar_100mb_through_stdin", exec::tar_100mb_through_stdin),
    ("exec_processes_outlive_the_session", exec::processes_outlive_the_session),
    ("pty_shell_resize_and_ctrl_c", pty::shell_resize_and_ctrl_c),
    ("files_scp_both_ways", files::scp_both_ways),
    ("files_sftp_batch", files::sftp_batch),
    ("files_rsync_both_ways", files::rsync_both_ways),
    ("forward_local_reaches_box_server", forward::local_reaches_box_server),
    ("forward_outside_targets_and_other_forwards_refused", forward::outside_targets_and_other_forwards_refused),
    ("isolation_cannot_see_host", isolation::cannot_see_host),
    ("isolation_cannot_mount_load_modules_or_unshare", isolation::cannot_mount_load_modules_or_unshare),
    ("isolation_no_ptrace_or_signal_outside", isolation::no_ptrace_or_signal_outside),
    ("isolation_root_is_not_host_root", isolation::root_is_not_host_root),
    ("isolation_boxes_cannot_reach_each_other", isolation::boxes_cannot_reach_each_other),
    ("isolation_fork_bomb_contained", isolation::fork_bomb_contained),
    ("isolation_two_servers_never_share_host_uids", isolation::two_servers_never_share_host_uids),
    ("isolation_no_vsock_fd_theft_or_pty_exhaustion", isolation::no_vsock_fd_theft_or_pty_exhaustion),
    ("isolation_host_details_masked_and_agent_outlives_oom", isolation::host_details_masked_and_agent_outlives_oom),
    ("isolation_memory_hog_contained", isolation::memory_hog_contained),
    ("hygiene_keys_are_accounts", hygiene::keys_are_accounts),
    ("hygiene_only_public_keys", hygiene::only_public_keys),
    ("hygiene_banner_and_key_exchanges", hygiene::banner_and_key_exchanges),
    ("hygiene_bursts_wait_and_silent_sockets_lock_nobody_out", hygiene::bursts_wait_and_silent_sockets_lock_nobody_out),
    ("hygiene_operator_limits_are_enforced", hygiene::operator_limits_are_enforced),
    (
        "hygiene_penalized_sources_wait_their_turn_but_are_never_refused",
        hygiene::penalized_sources_wait_their_turn_but_are_never_refused,
    ),
    ("hygiene_unauthenticated_flood_does_not_lock_out", hygiene::unauthenticated_flood_does_not_lock_out),
    ("restart_loses_nothing", restart::restart_loses_nothing),
    (
        "restart_warm_boxes_are_named_when_taken_and_never_outlive_a_restart",
        restart::warm_boxes_are_named_when_taken_and_never_outlive_a_restart,
    ),
    ("privsep_front_door_is_unprivileged_and_restarts", privsep::front_door_is_unprivileged_and_restarts),
    ("lifecycle_suspend_resume_stop_park_and_ledger", lifecycle::lifecycle),
    ("storage_dup_copies_and_makes_a_new_machine", storage::dup_copies_and_makes_a_new_machine),
    ("storage_dup_of_a_box_whose_processes_died", storage::dup_of_a_box_whose_processes_died),
    ("storage_diff_lists_changes", storage::diff_lists_changes),
    ("storage_diff_streams_and_is_bounded", storage::diff_streams_and_is_bounded),
    ("storage_promote_swaps_parent_and_child", storage::promote_swaps_parent_and_child),
    ("storage_bad_dups_create_nothing", storage::bad_dups_create_nothing),
    ("storage_disk_limit_is_enforced_and_rm_frees", storage::disk_limit_is_enforced_and_rm_frees),
    ("storage_dup_interrupted_leaves_nothing", storage::dup_interrupted_leaves_nothing),
    ("checkpoints_restore_puts_a_damaged_box_back", checkpoints::restore_puts_a_damaged_box_back),
    ("checkpoints_count_against_the_disk_limit", checkpoints::checkpoints_count_against_the_disk_limit),
    (
        "checkpoints_interrupted_checkpoints_and_restores_finish_or_undo",
        checkpoints::interrupted_checkpoints_and_restores_finish_or_undo,
    ),
    ("storage_account_budgets_hold_across_dup_and_rm", storage::account_budgets_hold_across_dup_and_rm),
    ("egress_deny_by_default_allow_by_name", egress::deny_by_default_allow_by_name),
    ("egress_nothing_leaks_around_the_names", egress::nothing_leaks_around_the_names),
    ("egress_methods_and_presets", egress::methods_and_presets),
    ("egress_https_looked_inside_only_where_rules_need_it", egress::https_looked_inside_only_where_rules_need_it),
    ("egress_ask_mode_puts_names_to_the_owner", egress::ask_mode_puts_names_to_the_owner),
    ("egress_log_follow_streams", egress::log_follow_streams),
    ("secrets_reach_only_their_host_and_header", secrets::reach_only_their_host_and_header),
    ("secrets_limits_kill_and_usage", secrets::limits_kill_and_usage),
    ("egress_gateway_is_unprivileged_and_fails_closed", egress::gateway_is_unprivileged_and_fails_closed),
];

/// Tests run alone after the rest: a TCG guest takes a whole core for
/// seconds, which would starve the timing-sensitive tests beside it.
const ALONE_LAST: &[(&str, TestFn)] = &[
    ("hygiene_doctor_boots_a_guest", hygiene::doctor_boots_a_guest),
    ("microvm_box_runs_its_own_kernel_over_ssh", microvm::box_runs_its_own_kernel_over_ssh),
    ("microvm_suspend_resume_dup_checkpoint_and_rm", microvm::suspend_resume_dup_checkpoint_and_rm),
    ("microvm_restart_and_park_keep_the_guest_running", microvm::restart_and_park_keep_the_guest_running),
    ("microvm_secrets_reach_their_host_from_a_guest", microvm::secrets_reach_their_host_from_a_guest),
    ("microvm_dup_while_a_session_streams_in", microvm::dup_while_a_session_streams_in),
];

/// Tests of [`TESTS`] run again, alone, with their boxes VM boxes (as
/// `vm_NAME`): the same experience whatever isolates a box.
const VM_PASS_TESTS: &[&str] = &[
    "exec_streams_status_and_stderr",
    "exec_death_by_signal_is_reported_as_openssh",
    "pty_shell_resize_and_ctrl_c",
    "files_scp_both_ways",
    "files_sftp_batch",
    "files_rsync_both_ways",
    "forward_local_reaches_box_server",
    "clients_unaccepted_env_still_runs_the_command",
    "egress_methods_and_presets",
    "egress_deny_by_default_allow_by_name",
    "exec_processes_outlive_the_session",
    "clients_git_clone_push_pull_with_defaults",
    "clients_paramiko_and_asyncssh_reuse_one_connection",
    "clients_ansible_playbook_on_two_boxes",
    "storage_diff_lists_changes",
    "storage_promote_swaps_parent_and_child",
    "checkpoints_restore_puts_a_damaged_box_back",
    "secrets_reach_only_their_host_and_header",
];

/// Removes every box of alice's.
fn remove_all_boxes(env: &Env) {
    let listed = env.alice(None, &["ls", "--json"]);
    let boxes: serde_json::Value = serde_json::from_str(&listed.stdout).unwrap_or_default();
    for b in boxes.as_array().into_iter().flatten() {
        if let Some(name) = b["name"].as_str() {
            let _ = env.alice(None, &["rm", name]);
        }
    }
}

/// Set during the VM pass (see [`Env::new_box`]).
static VM_PASS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Tests at once; two cores, and most of a test's time is waiting on ssh.
const WORKERS: usize = 3;

fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let wanted = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()));
    let selected: Vec<&(&str, TestFn)> = TESTS.iter().filter(|(name, _)| wanted(name)).collect();
    let last: Vec<&(&str, TestFn)> = ALONE_LAST.iter().filter(|(name, _)| wanted(name)).collect();
    let vm_pass: Vec<(String, TestFn)> = VM_PASS_TESTS
        .iter()
        .map(|name| {
            let found = TESTS.iter().find(|(t, _)| t == name);
            (format!("vm_{name}"), found.unwrap_or_else(|| panic!("VM pass: no test {name}")).1)
        })
        .filter(|(name, _)| wanted(name))
        .collect();
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("e2e tests need root (namespaces, cgroups, mounts); run scripts/test.sh as root");
        println!("test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s");
        std::process::exit(1);
    }
    let started = Instant::now();
    println!("\nrunning {} tests", selected.len() + last.len() + vm_pass.len() + 1);

    let dir = fixture::scratch_root();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let alice = Key::generate(&dir, "alice");
    let bob = Key::generate(&dir, "bob");
    let keys_file = dir.join("authorized_keys");
    std::fs::write(&keys_file, format!("{}{}", alice.public, bob.public)).expect("authorized_keys");
    // The suite makes many boxes for one key; the per-account limit has its own test.
    // The gateway dials only the test internet.
    let net = testnet::TestNet::start(&dir);
    let mut flags = vec!["--max-boxes".to_string(), "1000".to_string()];
    flags.extend(net.daemon_flags());
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let daemon = Daemon::start(dir.join("state"), keys_file, &flags);
    let env = Env { daemon, alice, bob, dir, net };

    let failures = Mutex::new(Vec::new());
    let passed = AtomicUsize::new(0);
    let record = |name: &str, result: std::thread::Result<()>, took: f64| match result {
        Ok(()) => {
            passed.fetch_add(1, Ordering::Relaxed);
            println!("test {name} ... ok ({took:.1}s)");
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            println!("test {name} ... FAILED ({took:.1}s)");
            failures.lock().unwrap_or_else(|e| e.into_inner()).push((name.to_string(), msg));
        }
    };

    // Runs one test and records how it went; whether it passed.
    let run_one = |name: &str, test: TestFn| {
        let t = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| test(&env)));
        let ok = result.is_ok();
        record(name, result, t.elapsed().as_secs_f64());
        ok
    };

    // First, alone: `new` with no image builds the default image, with progress.
    let setup_ok = run_one("control_first_new_builds_default_image", control::first_new_builds_default_image);

    if setup_ok {
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..WORKERS {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((name, test)) = selected.get(i) else {
                        break;
                    };
                    run_one(name, *test);
                });
            }
        });
        for (name, test) in &last {
            run_one(name, *test);
        }
        // The earlier tests' boxes go first: they count against alice's limits.
        if !vm_pass.is_empty() {
            remove_all_boxes(&env);
        }
        VM_PASS.store(true, Ordering::Relaxed);
        for (name, test) in &vm_pass {
            run_one(name, *test);
        }
    }

    let Env { mut daemon, dir, mut net, .. } = env;
    daemon.purge();
    net.stop();
    let _ = std::fs::remove_dir_all(&dir);

    let failures = failures.into_inner().unwrap_or_else(|e| e.into_inner());
    let passed = passed.load(Ordering::Relaxed);
    if !failures.is_empty() {
        println!("\nfailures:");
        for (name, msg) in &failures {
            println!("\n---- {name} ----\n{msg}");
        }
    }
    let not_run = if setup_ok { 0 } else { selected.len() };
    let verdict = if failures.is_empty() && not_run == 0 { "ok" } else { "FAILED" };
    println!(
        "\ntest result: {verdict}. {passed} passed; {} failed; {not_run} ignored; 0 measured; {} filtered out; finished in {:.2}s\n",
        failures.len(),
        TESTS.len() + ALONE_LAST.len() + VM_PASS_TESTS.len() - selected.len() - last.len() - vm_pass.len(),
        started.elapsed().as_secs_f64()
    );
    if verdict != "ok" {
        std::process::exit(101);
    }
}
