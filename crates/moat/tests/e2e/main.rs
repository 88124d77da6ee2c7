//! End-to-end tests: the real daemon, driven by the real OpenSSH tools, as root.
//!
//! One daemon (with the debian image, built through `ssh new` on first use) is
//! shared by most tests; tests that restart or reconfigure a daemon run their
//! own. A custom runner (harness = false) guarantees the teardown (`moat purge`:
//! boxes, cgroups, the pool's loop mount, temp files) runs even when tests fail.
//! Pass words after `--` to run only the tests whose names contain them.

#![allow(missing_docs)]

mod access;
mod browser;
mod checkpoints;
mod clients;
mod control;
mod durable;
mod effects;
mod egress;
mod exec;
mod files;
mod fixture;
mod fleet;
mod forward;
mod hygiene;
mod image_push;
mod image_service;
mod images;
mod isolation;
mod lifecycle;
mod microvm;
mod moves;
mod packages;
mod privsep;
mod pty;
mod push;
mod race;
mod restart;
mod secrets;
mod storage;
mod testnet;
mod web;
mod web_hostile;

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
        if !args.contains(&"--backend") {
            all.extend_from_slice(pass_backend());
        }
        let out = self.alice(None, &all).ok();
        assert_eq!(out.stdout.trim(), name);
    }
}

/// The flags that make a box of this pass's kind (`--backend vm` during the
/// VM pass), for tests that make boxes on a daemon of their own.
pub fn pass_backend() -> &'static [&'static str] {
    if in_vm_pass() {
        &["--backend", "vm"]
    } else {
        &[]
    }
}

/// Whether the VM pass runs (see [`VM_PASS_TESTS`]).
pub fn in_vm_pass() -> bool {
    VM_PASS.load(Ordering::Relaxed)
}

type TestFn = fn(&Env);

/// A table of tests, each named after its module and function
/// (`control::new_ls_info_rm` runs as `control_new_ls_info_rm`), so that a
/// name cannot drift from what it runs.
macro_rules! tests {
    ($($module:ident::$test:ident),* $(,)?) => {
        &[$((concat!(stringify!($module), "_", stringify!($test)), $module::$test as TestFn)),*]
    };
}

/// Run first, alone: the rest need the image it builds.
const FIRST: &[(&str, TestFn)] = tests![control::first_new_builds_default_image];

/// The rest, [`WORKERS`] at once.
const TESTS: &[(&str, TestFn)] = tests![
    access::unshare_ends_the_other_accounts_sessions_and_forwards,
    access::a_removed_key_ends_its_sessions_and_connections,
    access::rsa_keys_sign_in_with_sha2_only,
    control::new_ls_info_rm,
    control::bad_input_is_one_line_and_leaves_nothing,
    control::help_and_control_shell,
    control::whoami_shows_the_key_and_its_limits,
    control::mistyped_boxes_and_commands_are_told_as_such,
    clients::git_clone_push_pull_with_defaults,
    clients::unaccepted_env_still_runs_the_command,
    clients::controlmaster_100_commands_then_idle_suspends,
    clients::paramiko_and_asyncssh_reuse_one_connection,
    clients::an_unread_channel_stalls_no_other,
    clients::signals_and_resizes_pass_unread_stdin,
    clients::floods_at_a_stalled_reader_or_rekey_are_cut_off,
    clients::asyncssh_rekeys_while_it_sends,
    clients::a_request_flood_at_a_stopped_reader_ends_its_connection,
    clients::paramiko_tries_its_keys_in_turn,
    clients::abandoned_channels_free_the_box,
    clients::ansible_playbook_on_two_boxes,
    clients::putty_plink_psftp_and_pscp,
    clients::user_names_never_misroute,
    clients::box_sees_its_own_totals,
    exec::streams_status_and_stderr,
    exec::death_by_signal_is_reported_as_openssh,
    exec::a_reader_that_closes_ends_the_command,
    exec::sessions_get_sshs_variables_and_bashrc,
    exec::programs_start_with_default_signals,
    exec::tar_100mb_through_stdin,
    exec::processes_outlive_the_session,
    exec::fifos_in_etc_lock_nobody_out,
    exec::sessions_leave_the_agent_small,
    pty::shell_resize_and_ctrl_c,
    files::scp_both_ways,
    files::sftp_batch,
    files::sftp_and_scp_without_the_images_sftp_server,
    files::sshfs_mount_is_the_boxs_tree,
    files::rsync_both_ways,
    forward::local_reaches_box_server,
    forward::socket_forward_reaches_box_unix_server,
    forward::dynamic_forward_reaches_only_the_box,
    forward::outside_targets_and_other_forwards_refused,
    forward::remote_forward_reaches_the_client,
    forward::many_forwards_leave_the_box_answering,
    isolation::cannot_see_host,
    isolation::cannot_mount_load_modules_or_unshare,
    isolation::no_ptrace_or_signal_outside,
    isolation::root_is_not_host_root,
    isolation::boxes_cannot_reach_each_other,
    isolation::fork_bomb_contained,
    isolation::a_full_box_says_why_a_session_cannot_start,
    isolation::two_servers_never_share_host_uids,
    isolation::no_vsock_fd_theft_or_pty_exhaustion,
    isolation::per_user_kernel_allowances_are_the_boxs_own,
    isolation::i386_calls_kill_the_caller,
    isolation::namespaces_refuse_changes_without_seccomp,
    isolation::cpu_limit_holds,
    isolation::memory_has_no_swap,
    isolation::host_details_masked_and_agent_outlives_oom,
    isolation::dev_and_run_share_one_tmpfs_yet_are_each_boxs_own,
    isolation::memory_hog_contained,
    hygiene::keys_are_accounts,
    hygiene::only_public_keys,
    hygiene::banner_and_key_exchanges,
    hygiene::bursts_wait_and_silent_sockets_lock_nobody_out,
    hygiene::operator_limits_are_enforced,
    hygiene::penalized_sources_wait_their_turn_but_are_never_refused,
    hygiene::unauthenticated_flood_does_not_lock_out,
    hygiene::one_source_cannot_lock_itself_out,
    hygiene::stalled_handshakes_give_their_slots_up,
    hygiene::an_honest_client_goes_before_stalled_sockets_of_its_address,
    restart::loses_nothing,
    restart::warm_boxes_are_named_when_taken_and_never_outlive_a_restart,
    restart::purge_copes_with_a_read_only_pool,
    privsep::front_door_is_unprivileged_and_restarts,
    microvm::supervisor_explains_a_qemu_that_ended,
    microvm::supervisor_holds_nothing_left_open,
    lifecycle::suspend_resume_stop_park_and_ledger,
    storage::dup_copies_and_makes_a_new_machine,
    storage::dup_of_a_box_whose_processes_died,
    storage::diff_lists_changes,
    storage::diff_sees_attributes,
    storage::diff_streams_and_is_bounded,
    storage::promote_swaps_parent_and_child,
    storage::bad_dups_create_nothing,
    storage::disk_limit_is_enforced_and_rm_frees,
    storage::dup_interrupted_leaves_nothing,
    checkpoints::restore_puts_a_damaged_box_back,
    checkpoints::count_against_the_disk_limit,
    checkpoints::a_box_whose_etc_leads_out_still_restores,
    checkpoints::interrupted_checkpoints_and_restores_finish_or_undo,
    durable::boxes_upload_at_suspend_checkpoint_and_every_interval,
    storage::account_budgets_hold_across_dup_and_rm,
    storage::copies_are_charged_for_what_removed_parents_left,
    egress::deny_by_default_allow_by_name,
    egress::nothing_leaks_around_the_names,
    egress::udp_is_logged_at_most_50_a_second,
    egress::a_flooding_box_loses_only_its_own_entries,
    egress::methods_and_presets,
    egress::https_looked_inside_only_where_rules_need_it,
    egress::packages_install_through_the_registries_preset,
    packages::package_rules_decide_what_comes_in,
    packages::uv_installs_under_the_same_rules,
    egress::ask_mode_puts_names_to_the_owner,
    egress::log_follow_streams,
    secrets::reach_only_their_host_and_header,
    push::push_rules_decide_each_ref,
    effects::effects_are_told_where_they_matter,
    race::race_runs_copies_at_once_and_keeps_what_was_asked,
    secrets::limits_kill_and_usage,
    images::pull_login_new_and_hostile_images,
    images::hostile_registries_are_refused_and_leave_nothing,
    image_service::run_serves_the_images_program_and_restarts_it,
    image_push::push_sends_what_a_template_adds_and_pulls_back,
    egress::gateway_is_unprivileged_and_fails_closed,
    web::private_urls_sign_in_share_and_wake_in_a_browser,
    web_hostile::hostile_clients_get_bounded_refusals,
];

type FleetTestFn = fn(&Env, &mut fleet::Fleet);

/// Tests of a fleet (PostgreSQL, three nodes, two front doors), in order on
/// one fleet, alone after the rest: its three daemons share the two cores.
const FLEET_TESTS: &[(&str, FleetTestFn)] = &[
    (
        "fleet_boxes_on_every_node_answer_through_either_front_door",
        fleet::boxes_on_every_node_answer_through_either_front_door,
    ),
    ("fleet_fifty_news_fill_the_nodes_exactly", fleet::fifty_news_fill_the_nodes_exactly),
    (
        "fleet_an_image_saved_on_one_node_makes_boxes_on_another",
        fleet::an_image_saved_on_one_node_makes_boxes_on_another,
    ),
    ("fleet_cordoned_nodes_take_no_new_boxes", fleet::cordoned_nodes_take_no_new_boxes),
    ("fleet_questions_from_every_node_reach_one_ask", fleet::questions_from_every_node_reach_one_ask),
    ("fleet_a_store_outage_spares_running_sessions", fleet::a_store_outage_spares_running_sessions),
    ("fleet_a_killed_node_is_lost_and_the_rest_answer", fleet::a_killed_node_is_lost_and_the_rest_answer),
    ("fleet_a_box_moves_to_another_node_with_its_files", moves::a_box_moves_to_another_node_with_its_files),
    (
        "fleet_a_drained_node_is_left_empty_and_every_box_answers",
        moves::a_drained_node_is_left_empty_and_every_box_answers,
    ),
    (
        "fleet_a_move_killed_at_each_step_lands_once_with_every_file",
        moves::a_move_killed_at_each_step_lands_once_with_every_file,
    ),
    (
        "fleet_a_lost_nodes_boxes_are_re_homed_and_it_serves_none_on_return",
        moves::a_lost_nodes_boxes_are_re_homed_and_it_serves_none_on_return,
    ),
    ("fleet_a_killed_front_door_leaves_the_other_serving", fleet::a_killed_front_door_leaves_the_other_serving),
];

/// Tests run alone after the rest: a TCG guest takes a whole core for
/// seconds, which would starve the timing-sensitive tests beside it (and
/// one kills the shared daemon's gateway, which would cut the others' egress;
/// one fills the shared LXCFS, which would fail the others' /proc reads).
const ALONE_LAST: &[(&str, TestFn)] = tests![
    isolation::lxcfs_memory_is_bounded,
    clients::an_account_holds_at_most_its_share_of_channels,
    clients::stalled_channels_hold_at_most_the_accounts_window,
    egress::one_account_cannot_starve_the_others,
    secrets::windowed_limits_restart_with_the_gateway,
    packages::a_killed_gateway_keeps_no_half_file_and_its_indexes,
    hygiene::doctor_boots_a_guest,
    microvm::box_runs_its_own_kernel_over_ssh,
    microvm::suspend_resume_dup_checkpoint_and_rm,
    microvm::restart_and_park_keep_the_guest_running,
    microvm::secrets_reach_their_host_from_a_guest,
    microvm::dup_while_a_session_streams_in,
    microvm::guest_packets_around_the_gateway_go_nowhere,
    microvm::a_guest_port_answers_its_web_url,
    image_service::vm_boxes_of_pulled_images_and_templates,
];

/// Tests of [`TESTS`] run again, alone, with their boxes VM boxes (as
/// `vm_NAME`): the same experience whatever isolates a box.
const VM_PASS_TESTS: &[(&str, TestFn)] = tests![
    exec::streams_status_and_stderr,
    exec::death_by_signal_is_reported_as_openssh,
    exec::a_reader_that_closes_ends_the_command,
    exec::programs_start_with_default_signals,
    pty::shell_resize_and_ctrl_c,
    files::scp_both_ways,
    files::sftp_batch,
    files::rsync_both_ways,
    forward::local_reaches_box_server,
    forward::remote_forward_reaches_the_client,
    clients::unaccepted_env_still_runs_the_command,
    egress::methods_and_presets,
    egress::deny_by_default_allow_by_name,
    exec::processes_outlive_the_session,
    exec::fifos_in_etc_lock_nobody_out,
    clients::git_clone_push_pull_with_defaults,
    clients::paramiko_and_asyncssh_reuse_one_connection,
    clients::abandoned_channels_free_the_box,
    clients::signals_and_resizes_pass_unread_stdin,
    clients::ansible_playbook_on_two_boxes,
    storage::diff_lists_changes,
    storage::promote_swaps_parent_and_child,
    storage::dup_copies_and_makes_a_new_machine,
    storage::dup_interrupted_leaves_nothing,
    checkpoints::restore_puts_a_damaged_box_back,
    checkpoints::interrupted_checkpoints_and_restores_finish_or_undo,
    secrets::reach_only_their_host_and_header,
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
    let fleet_tests: Vec<&(&str, FleetTestFn)> = FLEET_TESTS.iter().filter(|(name, _)| wanted(name)).collect();
    let vm_pass: Vec<(String, TestFn)> = VM_PASS_TESTS
        .iter()
        .map(|(name, test)| (format!("vm_{name}"), *test))
        .filter(|(name, _)| wanted(name))
        .collect();
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("e2e tests need root (namespaces, cgroups, mounts); run scripts/test.sh as root");
        println!("test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s");
        std::process::exit(1);
    }
    let started = Instant::now();
    println!("\nrunning {} tests", selected.len() + last.len() + vm_pass.len() + fleet_tests.len() + FIRST.len());

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
    // Boxes' web URLs, for the browser tests.
    flags.extend(["--http-listen", "127.0.0.1:0", "--http-domain", web::DOMAIN].map(String::from));
    // A stalled registry and a decompression bomb are told in seconds.
    flags.extend(["--pull-stall-timeout", "3", "--max-image-size", "512M"].map(String::from));
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
    let setup_ok = FIRST.iter().all(|(name, test)| run_one(name, *test));

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
        if !fleet_tests.is_empty() {
            let t = Instant::now();
            match catch_unwind(AssertUnwindSafe(|| fleet::Fleet::start(&env))) {
                Ok(mut fleet) => {
                    for (name, test) in &fleet_tests {
                        let t = Instant::now();
                        let before = fleet.box_names(&env);
                        let marks = fleet.log_marks();
                        let result = catch_unwind(AssertUnwindSafe(|| test(&env, &mut fleet)));
                        if result.is_err() {
                            // One failure is reported once, not again by every test after it.
                            fleet.print_log_warnings(&marks);
                            let _ = catch_unwind(AssertUnwindSafe(|| fleet.tidy_after_failure(&env, &before)));
                        }
                        record(name, result, t.elapsed().as_secs_f64());
                    }
                }
                Err(panic) => record("fleet_start", Err(panic), t.elapsed().as_secs_f64()),
            }
        }
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
        TESTS.len() + ALONE_LAST.len() + VM_PASS_TESTS.len() + FLEET_TESTS.len()
            - selected.len()
            - last.len()
            - vm_pass.len()
            - fleet_tests.len(),
        started.elapsed().as_secs_f64()
    );
    if verdict != "ok" {
        std::process::exit(101);
    }
}
