//! The command line of docs/commands.md: parsed once into [`Command`], which dispatches.
//!
//! Exit codes: 0 success; 1 the checked thing is bad (invalid rules, Redis not ready, no rule
//! matches for `explain`); 2 usage error or unreadable input.

pub(crate) mod admin;
pub(crate) mod demo;
pub(crate) mod doctor;
pub(crate) mod explain;
pub(crate) mod history;
pub(crate) mod rule_tests;
pub mod run;
pub(crate) mod send_test;
pub(crate) mod upcoming;

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use crate::config::{self, LoadError, Loaded, Mode};
use crate::event::EventKind;

#[derive(Debug, Parser)]
#[command(
    name = "keywatch",
    version,
    about = "Act on Redis keys that expire, are evicted or are about to expire, by rules kept in git."
)]
pub struct Cli {
    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log level (error, warn, info, debug, trace); `RUST_LOG` overrides it.
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Watch, match and act until SIGTERM/SIGINT.
    Run {
        #[command(flatten)]
        rules: RulesArg,
        /// Redis URL (overrides KEYWATCH_REDIS_URL and `redis.url`).
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
        /// Address of the HTTP endpoint (the status page, /metrics, /healthz, /readyz,
        /// /-/reload, /api/history, /l/).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
        listen: std::net::SocketAddr,
        /// Act on nothing: record what each action would have done (history outcome `shadow`),
        /// with state under `state.prefix` + `shadow:`, beside a keywatch or the code it
        /// replaces.
        #[arg(long)]
        shadow: bool,
    },
    /// Send one test message through CHANNEL and show the target's answer.
    SendTest {
        /// The channel's name in the rules.
        channel: String,
        #[command(flatten)]
        rules: RulesArg,
    },
    /// A self-contained tour on a throwaway local redis-server.
    Demo,
    /// Mute a rule for a while (kept in Redis; every instance obeys).
    Silence {
        #[command(subcommand)]
        command: SilenceCommand,
        #[command(flatten)]
        target: StateArgs,
    },
    /// Actions that failed for good: inspect, re-drive, discard.
    Dead {
        #[command(subcommand)]
        command: DeadCommand,
        #[command(flatten)]
        target: StateArgs,
    },
    /// What fired, for which key, where it went and how it ended (newest first), as every
    /// instance recorded it in Redis.
    History {
        /// Only keys matching this pattern (the pattern language of the rules).
        #[arg(long = "key", value_name = "PATTERN", value_parser = parse_pattern)]
        key: Option<Box<crate::pattern::Pattern>>,
        /// Only firings of this rule.
        #[arg(long, value_name = "NAME")]
        rule: Option<String>,
        /// Only firings this recent (`30m`, `2h`, `7d`).
        #[arg(long, value_name = "DUR", value_parser = parse_duration_arg)]
        since: Option<std::time::Duration>,
        /// One JSON object per line: the event JSON plus "actions".
        #[arg(long)]
        json: bool,
        /// At most this many firings.
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: usize,
        /// What a shadow (`run --shadow`) recorded, not what keywatch did.
        #[arg(long)]
        shadow: bool,
        #[command(flatten)]
        target: StateArgs,
    },
    /// Validate rule files; send nothing.
    Check {
        #[command(flatten)]
        rules: RulesArg,
    },
    /// Keys that expire soon, soonest first, with their TTL, deadline and matching rules.
    Upcoming {
        /// How far ahead to look (`30s`, `15m`, `2h`, `7d`).
        #[arg(long, value_name = "DUR", default_value = "1h", value_parser = parse_duration)]
        within: std::time::Duration,
        /// Only keys matching this pattern (the pattern language of the rules); default: any
        /// rule's pattern.
        #[arg(long = "match", value_name = "PATTERN", value_parser = parse_pattern)]
        pattern: Option<Box<crate::pattern::Pattern>>,
        /// One JSON object per line: {"key", "db", "ttl_ms", "deadline", "rules"}, and "field"
        /// for a hash field.
        #[arg(long)]
        json: bool,
        /// At most this many keys.
        #[arg(long, value_name = "N", default_value_t = 1000)]
        limit: usize,
        /// Redis URL (overrides KEYWATCH_REDIS_URL and `redis.url`).
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
        #[command(flatten)]
        rules: RulesArg,
    },
    /// Is Redis ready for keywatch? Reachability, version, role, notify-keyspace-events,
    /// cluster masters, permissions, expiry backlog; each problem with its fix (exit 1).
    Doctor {
        /// Redis URL (overrides KEYWATCH_REDIS_URL and `redis.url`).
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
        /// One JSON object: {"node", "ready", "checks": [{"check", "verdict", "detail", "fix"}]}.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        rules: RulesArg,
    },
    /// Show which rules match KEY and the actions they would run, fully rendered; send nothing.
    Explain {
        /// The key (bytes that are not UTF-8 may be given as `\xNN`).
        key: OsString,
        /// The event to explain: expired, evicted, deleted, expiring or hexpired (the default
        /// with `--field`).
        #[arg(long, value_parser = parse_event)]
        event: Option<EventKind>,
        /// A field of the hash KEY, for `hexpired` rules (bytes as for KEY).
        #[arg(long, value_name = "F")]
        field: Option<OsString>,
        /// The database the key lives in.
        #[arg(long, default_value_t = 0)]
        db: u32,
        #[command(flatten)]
        rules: RulesArg,
    },
    /// Rule unit tests: given events, the actions they render, compared with each test's.
    ///
    /// Each test's events go through the rules as `run` would take them, and every action they
    /// render (messages, URLs and bodies, commands, cleanups, escalations) is compared with what
    /// the test expects. Sends, runs and reads nothing: no Redis, no network.
    Test {
        /// Test files (`*.test.yaml`).
        #[arg(required = true, value_name = "TESTFILE")]
        files: Vec<PathBuf>,
        /// The rules to test (a file or a folder; may repeat), instead of each file's `rules:`.
        #[arg(short = 'r', long = "rules", value_name = "PATH")]
        rules: Vec<PathBuf>,
        /// One JSON object per test: {"file", "test", "line", "ok", "problems", "rendered"}.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script, e.g. `keywatch completions bash > /etc/bash_completion.d/keywatch`.
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
pub enum SilenceCommand {
    /// Mute RULE (or only its keys matching PATTERN) for DUR.
    Add {
        /// The rule to mute.
        #[arg(long, value_name = "NAME")]
        rule: String,
        /// Only keys matching this pattern (docs/rules.md#patterns) are muted.
        #[arg(long = "match", value_name = "PATTERN")]
        pattern: Option<String>,
        /// How long, e.g. `2h`.
        #[arg(long = "for", value_name = "DUR", value_parser = parse_duration_arg)]
        duration: std::time::Duration,
        /// Why (shown by `silence list`).
        #[arg(long, value_name = "TEXT")]
        comment: String,
    },
    /// The silences in force.
    List {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// End a silence now.
    Remove {
        /// The silence's id (`silence list` shows it).
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeadCommand {
    /// The dead letters, newest first.
    List {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// At most this many letters.
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: usize,
    },
    /// Move dead letters back into the job queue, due now: whichever instance takes them sends
    /// them again (IDs, or --all).
    Retry {
        /// The letters' ids (`dead list` shows them).
        #[arg(value_name = "ID")]
        ids: Vec<String>,
        /// Every dead letter.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
    },
    /// Discard dead letters (IDs, or --all).
    Drop {
        /// The letters' ids (`dead list` shows them).
        #[arg(value_name = "ID")]
        ids: Vec<String>,
        /// Every dead letter.
        #[arg(long, conflicts_with = "ids")]
        all: bool,
    },
}

/// Where keywatch's state is: the rules' `state`/`redis` settings, or `--redis`.
#[derive(Debug, clap::Args)]
pub struct StateArgs {
    /// A rule file or a folder of them, for their `state` and `redis` settings; may repeat.
    #[arg(
        short = 'r',
        long = "rules",
        value_name = "PATH",
        default_value = "rules",
        global = true
    )]
    pub rules: Vec<PathBuf>,
    /// Redis URL (overrides KEYWATCH_REDIS_URL and `redis.url`).
    #[arg(long, value_name = "URL", global = true)]
    pub redis: Option<String>,
}

fn parse_duration_arg(s: &str) -> Result<std::time::Duration, String> {
    crate::yaml::decode::parse_duration(s)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("`{s}` is not a duration; write e.g. `30m`, `2h` or `7d`"))
}

#[derive(Debug, clap::Args)]
pub struct RulesArg {
    /// A rule file or a folder of them (every *.yaml/*.yml below it); may repeat.
    #[arg(
        short = 'r',
        long = "rules",
        value_name = "PATH",
        default_value = "rules"
    )]
    pub paths: Vec<PathBuf>,
}

fn parse_event(s: &str) -> Result<EventKind, String> {
    EventKind::parse(s).ok_or_else(|| {
        format!(
            "`{s}` is not an event; expected one of {}",
            EventKind::ALL.map(|k| k.as_str()).join(", ")
        )
    })
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|_| format!("`{s}` is not a duration, e.g. `30s`, `15m`, `2h`, `7d`"))
}

fn parse_pattern(s: &str) -> Result<Box<crate::pattern::Pattern>, String> {
    crate::pattern::Pattern::parse(s)
        .map(Box::new)
        .map_err(|e| format!("`{s}` is not a pattern: {e}"))
}

/// Runs the command line; what `main` returns.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                    ExitCode::SUCCESS
                }
                _ => ExitCode::from(2),
            };
        }
    };
    run(cli)
}

/// Logging to stderr through a writer thread: a mass expiry logs a line per action, and
/// formatting plus one `write` per line on the delivery path cost about 40 % of its time. The
/// thread writes whatever lines have piled up with one `write` and flushes whenever it runs
/// dry, so a quiet daemon's lines still appear at once; it never drops a line (a full buffer
/// makes the logging task wait instead). The guard flushes what is left when `run` returns.
fn init_logging(
    format: LogFormat,
    level: Option<&str>,
    default: &str,
) -> tracing_appender::non_blocking::WorkerGuard {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(level.unwrap_or(default)));
    // Colours only for a person at a terminal: escape codes in a log file or journald are noise,
    // and they break `grep 'rule=x'`. NO_COLOR (https://no-color.org) is honoured too.
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .thread_name("keywatch-log")
        .finish(std::io::BufWriter::with_capacity(
            64 * 1024,
            std::io::stderr(),
        ));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    guard
}

fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            None
        }
    }
}

pub fn run(cli: Cli) -> ExitCode {
    crate::allocator::tune();
    // One TLS provider for reqwest and redis, chosen before either builds a TLS config.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let default_level = match cli.command {
        Command::Check { .. }
        | Command::Test { .. }
        | Command::Explain { .. }
        | Command::Upcoming { .. }
        | Command::Doctor { .. } => "warn",
        // The tour shows what fires and what the actions did, not the daemon's housekeeping.
        Command::Demo => "warn,keywatch::alert=info,keywatch::delivery=info",
        _ => "info",
    };
    let _log = init_logging(cli.log_format, cli.log_level.as_deref(), default_level);
    match cli.command {
        Command::Completions { shell } => completions(shell),
        Command::Run {
            rules,
            redis,
            listen,
            shadow,
        } => {
            let mut loaded = match load_or_report(&rules.paths, Mode::Run) {
                Ok(l) => l,
                Err(code) => return code,
            };
            if shadow {
                loaded.config = loaded.config.into_shadow();
            }
            // A task that panics ends alone while the daemon goes on: said where logs are read.
            crate::internal_events::Panicked::on_every_panic();
            let Some(rt) = runtime() else {
                return ExitCode::from(1);
            };
            let opts = crate::command::run::RunOptions {
                redis,
                listen,
                stop_after: None,
                rules: rules.paths.clone(),
                shadow,
            };
            match rt.block_on(crate::command::run::run(
                loaded.config,
                opts,
                tokio_util::sync::CancellationToken::new(),
            )) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("keywatch: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Check { rules } => check(&rules.paths),
        Command::Test { files, rules, json } => {
            crate::command::rule_tests::main(&crate::command::rule_tests::Options {
                files,
                rules,
                json,
            })
        }
        Command::Upcoming {
            within,
            pattern,
            json,
            limit,
            redis,
            rules,
        } => {
            let loaded = match load_or_report(&rules.paths, Mode::Check) {
                Ok(l) => l,
                Err(code) => return code,
            };
            let Some(rt) = runtime() else {
                return ExitCode::from(1);
            };
            let opts = crate::command::upcoming::Options {
                within,
                pattern: pattern.map(|p| *p),
                redis,
                limit,
            };
            crate::command::upcoming::main(&loaded.config, &opts, json, &rt)
        }
        Command::Doctor { redis, json, rules } => {
            let loaded = match load_or_report(&rules.paths, Mode::Check) {
                Ok(l) => l,
                Err(code) => return code,
            };
            let Some(rt) = runtime() else {
                return ExitCode::from(1);
            };
            let opts = crate::command::doctor::Options { redis, json };
            crate::command::doctor::main(&loaded.config, &opts, &rt)
        }
        Command::SendTest { channel, rules } => {
            let loaded = match load_or_report(&rules.paths, Mode::Run) {
                Ok(l) => l,
                Err(code) => return code,
            };
            let Some(rt) = runtime() else {
                return ExitCode::from(1);
            };
            match rt.block_on(crate::command::send_test::run(&loaded.config, &channel)) {
                Ok(msg) => {
                    println!("{msg}");
                    ExitCode::SUCCESS
                }
                Err(msg) => {
                    eprintln!("{msg}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Silence { command, target } => {
            let redis_flag = target.redis.clone();
            admin(target, |config, mut conn| async move {
                let changes = !matches!(command, SilenceCommand::List { .. });
                let out = match command {
                    SilenceCommand::Add {
                        rule,
                        pattern,
                        duration,
                        comment,
                    } => {
                        crate::command::admin::silence_add(
                            &config,
                            &mut conn,
                            &rule,
                            pattern.as_deref(),
                            duration,
                            &comment,
                        )
                        .await
                    }
                    SilenceCommand::List { json } => {
                        crate::command::admin::silence_list(&config, &mut conn, json).await
                    }
                    SilenceCommand::Remove { id } => {
                        crate::command::admin::silence_remove(&config, &mut conn, &id).await
                    }
                }?;
                if changes {
                    crate::command::admin::announce(
                        &config,
                        redis_flag.as_deref(),
                        crate::store::notices::Notice::Silences,
                    )
                    .await;
                }
                Ok(out)
            })
        }
        Command::Dead { command, target } => {
            let redis_flag = target.redis.clone();
            admin(target, |config, conn| async move {
                match command {
                    DeadCommand::List { json, limit } => {
                        crate::command::admin::dead_list(&config, &conn, json, limit).await
                    }
                    DeadCommand::Retry { ids, all } => {
                        if ids.is_empty() && !all {
                            return Err("name the dead letters to retry, or --all".into());
                        }
                        let out = crate::command::admin::dead_retry(&config, &conn, &ids).await?;
                        crate::command::admin::announce(
                            &config,
                            redis_flag.as_deref(),
                            crate::store::notices::Notice::Work,
                        )
                        .await;
                        Ok(out)
                    }
                    DeadCommand::Drop { ids, all } => {
                        if ids.is_empty() && !all {
                            return Err("name the dead letters to drop, or --all".into());
                        }
                        crate::command::admin::dead_drop(&config, &conn, &ids).await
                    }
                }
            })
        }
        Command::History {
            key,
            rule,
            since,
            json,
            limit,
            shadow,
            target,
        } => admin(target, |config, conn| async move {
            let config = if shadow { config.into_shadow() } else { config };
            let filter = crate::store::history::Filter {
                key: key.map(|k| *k),
                rule,
                id: None,
                since,
                limit,
            };
            crate::command::history::run(&config, conn, &filter, json).await
        }),
        Command::Demo => {
            let Some(rt) = runtime() else {
                return ExitCode::from(1);
            };
            match rt.block_on(crate::command::demo::run()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("keywatch demo: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Explain {
            key,
            event,
            field,
            db,
            rules,
        } => {
            let loaded = match load_or_report(&rules.paths, Mode::Check) {
                Ok(l) => l,
                Err(code) => return code,
            };
            let key = crate::command::explain::key_bytes(&key);
            let field = field.as_deref().map(crate::command::explain::key_bytes);
            let event = event.unwrap_or(match field {
                Some(_) => EventKind::Hexpired,
                None => EventKind::Expired,
            });
            let out = crate::command::explain::explain_field(
                &loaded.config,
                &key,
                field.as_deref(),
                event,
                db,
            );
            print!("{}", out.text);
            if out.matched {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// Runs a state command: opens the state Redis, runs `f`, prints its answer (exit 0) or its
/// error (exit 1).
fn admin<F, Fut>(target: StateArgs, f: F) -> ExitCode
where
    F: FnOnce(crate::config::Config, crate::keyspace::Conn) -> Fut,
    Fut: std::future::Future<Output = Result<String, String>>,
{
    let Some(rt) = runtime() else {
        return ExitCode::from(1);
    };
    let result = rt.block_on(async {
        let (config, conn) =
            crate::command::admin::open(&target.rules, target.redis.as_deref()).await?;
        f(config, conn).await
    });
    match result {
        Ok(out) => {
            // Nothing at all for an empty `--json` listing: a blank line is no JSON object.
            if !out.is_empty() {
                print!("{}", if out.ends_with('\n') { out } else { out + "\n" });
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("keywatch: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints every diagnostic to stderr; returns the load, or the exit code of the failure (2 when
/// a path could not be read, 1 when the rules are invalid).
fn load_or_report(paths: &[PathBuf], mode: Mode) -> Result<Loaded, ExitCode> {
    let env = |name: &str| std::env::var(name).ok();
    let mut err = std::io::stderr().lock();
    match config::load(paths, mode, &env) {
        Ok(loaded) => {
            for w in &loaded.warnings {
                let _ = writeln!(err, "{w}");
            }
            Ok(loaded)
        }
        Err(LoadError::Unreadable(msg)) => {
            let _ = writeln!(err, "{msg}");
            Err(ExitCode::from(2))
        }
        Err(LoadError::Invalid(diags)) => {
            for d in &diags {
                let _ = writeln!(err, "{d}");
            }
            let errors = diags
                .iter()
                .filter(|d| d.severity == config::Severity::Error)
                .count();
            let _ = writeln!(err, "{errors} error(s) found.");
            Err(ExitCode::from(1))
        }
    }
}

/// The script is generated into memory first: clap_complete panics when its writer fails, and
/// `keywatch completions bash | head` must end quietly, not with a panic.
fn completions(shell: clap_complete::Shell) -> ExitCode {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "keywatch", &mut script);
    match std::io::stdout().lock().write_all(&script) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keywatch: cannot write the completion script: {e}");
            ExitCode::from(1)
        }
    }
}

fn check(paths: &[PathBuf]) -> ExitCode {
    let loaded = match load_or_report(paths, Mode::Check) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let c = &loaded.config;
    println!(
        "OK: {} file(s), {} rule(s), {} channel(s){}",
        c.files.len(),
        c.rules.len(),
        c.channels.len(),
        if loaded.warnings.is_empty() {
            String::new()
        } else {
            format!(", {} warning(s)", loaded.warnings.len())
        }
    );
    println!(
        "Redis needs notify-keyspace-events with at least `{}`.",
        c.needed_notify_flags()
    );
    ExitCode::SUCCESS
}
