//! `moat`: the operator's one binary.

mod agent;
mod bench;
mod bench_burst;
mod bench_density;
mod bench_durable;
mod bench_egress;
mod bench_fleet;
mod bench_fleet_rig;
mod bench_http;
mod bench_images;
mod bench_node_loss;
mod bench_packages;
mod bench_pg;
mod bench_proxy_peer;
mod bench_resume;
mod bench_vm;
mod doctor;
mod drain;
mod durable;
mod fleet;
mod front;
mod front_door;
mod front_router;
mod gateway;
mod gateway_supervisor;
mod image_fetch;
mod image_pull;
mod image_push;
mod image_unpack;
mod microvm;
mod node;
mod node_links;
mod nodes;
mod paths;
mod privsep;
mod procs;
mod purge;
mod registries;
mod serve;
mod uid_block;
mod web;
mod web_edge;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "moat", version, about = "Disposable, isolated boxes for coding agents, over plain SSH")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the service in the foreground.
    Serve(Box<serve::ServeArgs>),
    /// Build or list images.
    Image {
        #[command(subcommand)]
        command: ImageCmd,
    },
    /// Check that this host can run boxes, and say how.
    Doctor {
        /// State directory.
        #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
    },
    /// Measure box and SSH latency next to bubblewrap and OpenSSH (with
    /// --fleet: a fleet's front door, placement and `new` next to one host and
    /// ProxyJump); prints a table.
    Bench(bench::BenchArgs),
    /// Stop and delete every box, unmount the pool, remove the state directory.
    Purge {
        /// State directory.
        #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
    },
    /// List the fleet's nodes: address, lease, boxes and room, uploads waiting, boxes moving off.
    Nodes {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        at: fleet::StoreAt,
    },
    /// Cordon, uncordon or drain a node of the fleet.
    Node {
        #[command(subcommand)]
        command: nodes::NodeCmd,
    },
    /// Make a fleet, its members, and its accounts' keys.
    Fleet {
        #[command(subcommand)]
        command: fleet::FleetCmd,
    },
    /// Run a fleet's front door: SSH for the whole fleet, routed to its nodes
    /// (the state dir is one `moat fleet join` made for a front door).
    Front(front::FrontArgs),
    /// (internal) the router of a fleet's front door; run by `moat front`.
    #[command(hide = true)]
    FrontRouter {
        /// Its uid and gid.
        #[arg(long)]
        id: u32,
    },
    /// (internal) the SSH-facing process; run by `moat serve`.
    #[command(hide = true)]
    FrontDoor {
        /// Its uid and gid.
        #[arg(long)]
        id: u32,
    },
    /// (internal) the HTTP edge for boxes' web URLs; run by `moat serve`.
    #[command(hide = true)]
    WebEdge {
        /// Its uid and gid.
        #[arg(long)]
        id: u32,
    },
    /// (internal) the egress gateway; run by `moat serve`.
    #[command(hide = true)]
    Gateway {
        /// Its uid and gid.
        #[arg(long)]
        id: u32,
        /// The network namespace to dial from.
        #[arg(long)]
        netns: Option<PathBuf>,
        #[command(flatten)]
        packages: gateway::PackageArgs,
    },
    /// (internal) a pull's registry client; run by `moat serve`.
    #[command(hide = true)]
    ImageFetch {
        /// Its uid and gid.
        #[arg(long)]
        id: u32,
        /// The network namespace to dial from.
        #[arg(long)]
        netns: Option<PathBuf>,
    },
    /// (internal) apply one layer from stdin onto TREE, confined; run by `moat serve`.
    #[command(hide = true)]
    ImageUnpack {
        /// The layer's tree.
        tree: PathBuf,
        /// none, gzip or zstd.
        compression: String,
        /// Most bytes it may unpack to.
        max: u64,
    },
    /// (internal) start one box from a plan on stdin; run by the daemon.
    #[command(hide = true)]
    BoxSpawn {
        /// cgroup.procs files to join before reading the plan (a spare helper).
        #[arg(long, num_args = 1..)]
        join: Vec<PathBuf>,
    },
    /// (internal) start one VM box's supervisor from a plan on stdin; run by the daemon.
    #[command(hide = true)]
    BoxVm,
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Build an image: `busybox` (seconds) or `debian` (debootstrap, about a minute).
    Build {
        /// Image name.
        name: String,
        /// State directory.
        #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// Rebuild even if the image exists (boxes made from it keep their copy).
        #[arg(long)]
        force: bool,
    },
    /// List built images.
    Ls {
        /// State directory.
        #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        // The helper must stay single-threaded: no runtime, no logging threads.
        Cmd::BoxSpawn { join } => std::process::exit(moat_box::ns::enforce::helper_main(&join)),
        Cmd::BoxVm => std::process::exit(moat_box::vm::supervise::helper_main()),
        Cmd::ImageUnpack { tree, compression, max } => std::process::exit(image_unpack::main(&tree, &compression, max)),
        Cmd::ImageFetch { id, netns } => image_fetch::run(id, netns),
        Cmd::Serve(args) => serve::run(*args),
        Cmd::FrontDoor { id } => front_door::run(id),
        Cmd::WebEdge { id } => web_edge::run(id),
        Cmd::Front(args) => front::run(args),
        Cmd::Fleet { command } => fleet::run(command),
        Cmd::Nodes { json, at } => nodes::list(&at, json),
        Cmd::Node { command } => nodes::run(command),
        Cmd::FrontRouter { id } => front_router::run(id),
        Cmd::Gateway { id, netns, packages } => gateway::run(id, netns, packages),
        Cmd::Image { command } => image(command),
        Cmd::Doctor { state_dir } => doctor::run(&state_dir),
        Cmd::Purge { state_dir } => purge::run(&state_dir),
        Cmd::Bench(args) => bench::run(args),
    };
    if let Err(e) = result {
        eprintln!("moat: {e:#}");
        std::process::exit(1);
    }
}

fn image(cmd: ImageCmd) -> Result<()> {
    match cmd {
        ImageCmd::Build { name, state_dir, force } => {
            let name = moat_core::Name::new(&name)?;
            let pool = paths::open_pool(&state_dir)?;
            if pool.has_image(&name) {
                if !force {
                    println!("image {name} already built (use --force to rebuild)");
                    return Ok(());
                }
                moat_box::image::remove(&pool, &name)?;
            }
            moat_box::image::build(&pool, &name, &mut |line: &str| eprintln!("{line}"))?;
            Ok(())
        }
        ImageCmd::Ls { state_dir, json } => {
            let pool = paths::open_pool(&state_dir)?;
            let images = moat_box::image::list(&pool)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&images)?);
            } else {
                for image in images {
                    println!("{image}");
                }
            }
            Ok(())
        }
    }
}
