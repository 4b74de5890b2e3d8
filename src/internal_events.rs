//! keywatch's internal events: what happened inside keywatch that operators, dashboards and
//! tests read, each one a type whose `emit` logs it and counts it in one call (Vector's
//! `emit!`, `src/internal_events/`).
//!
//! Every log line of an internal event carries the field `internal_event` with the event's
//! name (`NAME`, stable: docs/operations.md#internal-events lists them), beside its own fields.
//! Tests and log pipelines match that name and the fields, never the wording of the sentence,
//! which may change. An internal event is not a keyspace event (docs/how-it-works.md#glossary):
//! the name says where it comes from.

use std::fmt::Display;
use std::net::SocketAddr;

use crate::metrics::Metrics;
use crate::outcome::Outcome;

/// The HTTP endpoint accepts connections at `addr` (the port the OS chose for `:0` included),
/// at most `connections` at once: half the limit on open files in force (`open_files`), which
/// `run` raised to the hard limit at start (docs/operations.md#exposing-the-endpoint).
pub struct Listening {
    pub addr: SocketAddr,
    pub open_files: u64,
    pub connections: usize,
    /// Beyond loopback without `server.token`, as `server.open: true` says is meant: anyone
    /// who reaches it can read the status page and the history and reload the rules.
    pub open: bool,
}

impl Listening {
    pub const NAME: &'static str = "listening";

    pub fn emit(self) {
        let Listening {
            addr,
            open_files,
            connections,
            open,
        } = self;
        if open {
            tracing::warn!(internal_event = Self::NAME, %addr, open_files, connections, open, "The HTTP endpoint listens beyond loopback without `server.token`, as `server.open: true` says is meant: anyone who reaches it can read the status page and the history and reload the rules (docs/operations.md#exposing-the-endpoint).");
        } else {
            tracing::info!(internal_event = Self::NAME, %addr, open_files, connections, open, "HTTP endpoint listening (/, /metrics, /healthz, /readyz, /-/reload); connections bounded to half the limit on open files.");
        }
    }
}

/// A subscriber's connection to `node` is subscribed to the keyevent channels the rules need:
/// events flow from now on.
pub struct Subscribed<'a> {
    pub node: &'a str,
    pub channels: usize,
}

impl Subscribed<'_> {
    pub const NAME: &'static str = "subscribed";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, node = %self.node, channels = self.channels, "Subscribed to keyspace events.");
    }
}

/// A subscriber's connection to `node` ended: what Redis publishes until the next
/// [`Subscribed`] is recovered from the ledger, not heard.
pub struct SubscriptionLost<'a> {
    pub node: &'a str,
    pub reason: &'a str,
}

impl SubscriptionLost<'_> {
    pub const NAME: &'static str = "subscription_lost";

    /// Logs it and counts it in `keywatch_reconnects_total`.
    pub fn emit(self, metrics: &Metrics) {
        metrics.reconnects.inc();
        tracing::warn!(internal_event = Self::NAME, node = %self.node, reason = %self.reason, "Subscriber connection ended; reconnecting. Keyspace events published until the subscription is back are lost; expiries of keys with known deadlines will be recovered.");
    }
}

/// A subscriber follows a reload on its connection: subscribed to the `channels` the new rules
/// need and unsubscribed from the rest, without reconnecting.
pub struct SubscriptionsChanged<'a> {
    pub node: &'a str,
    pub channels: usize,
}

impl SubscriptionsChanged<'_> {
    pub const NAME: &'static str = "subscriptions_changed";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, node = %self.node, channels = self.channels, "Subscriptions follow the reloaded rules.");
    }
}

/// keywatch fell `waiting` events (`mib` MiB) behind what `node` publishes and lets go of the
/// subscription, as Redis would at its output-buffer limit; a [`SubscriptionLost`] follows
/// (docs/operations.md#falling-behind).
pub struct FellBehind<'a> {
    pub node: &'a str,
    pub waiting: usize,
    pub mib: usize,
}

impl FellBehind<'_> {
    pub const NAME: &'static str = "fell_behind";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, node = %self.node, waiting = self.waiting, mib = self.mib, "keywatch fell behind Redis's events: letting go of the subscription as Redis does at its output-buffer limit; the deadline ledger recovers expiries published meanwhile.");
    }
}

/// `node` emptied databases without a keyevent: a `FLUSHDB` or `FLUSHALL` (`how` = `flush`) or a
/// `SWAPDB` (`swap`). The ledger drops the deadlines of the keys that left rather than report
/// them as expired (docs/how-it-works.md#flushes-and-swaps).
pub struct KeysLeftUnannounced<'a> {
    pub node: &'a str,
    pub how: &'a str,
}

impl KeysLeftUnannounced<'_> {
    pub const NAME: &'static str = "keys_left_unannounced";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, node = %self.node, how = %self.how, "Keys left a database without a keyevent (FLUSHDB, FLUSHALL or SWAPDB): the ledger drops their deadlines rather than report them as expired.");
    }
}

/// `node` refused client-side tracking (`HELLO 3` or `CLIENT TRACKING`), which is how a flush is
/// heard at once: flushes are then noticed by `INFO commandstats`, within a second, and a key
/// flushed in that second may be reported as a recovered expiry
/// (docs/how-it-works.md#flushes-and-swaps). Emitted when the reason changes.
pub struct FlushTrackingRefused<'a> {
    pub node: &'a str,
    pub reason: &'a str,
}

impl FlushTrackingRefused<'_> {
    pub const NAME: &'static str = "flush_tracking_refused";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, node = %self.node, reason = %self.reason, "Client-side tracking refused: a FLUSHDB or FLUSHALL is noticed within a second (INFO commandstats) instead of at once. `keywatch doctor` says which grant is missing.");
    }
}

/// `node` is not watched, and why (a replica, a Sentinel): readiness stays false while it is
/// asked again. Emitted when the reason changes, not at every attempt.
pub struct NodeRefused<'a> {
    pub node: &'a str,
    /// What the node is, and what to point keywatch at instead.
    pub reason: &'a str,
}

impl NodeRefused<'_> {
    pub const NAME: &'static str = "node_refused";

    pub fn emit(self) {
        let NodeRefused { node, reason } = self;
        tracing::error!(internal_event = Self::NAME, %node, %reason, "Not watching {node}: {reason}. Readiness stays false; asking again with backoff.");
    }
}

/// `redis.notifications: enable` added the flags `node` lacked: its `notify-keyspace-events`
/// went `from` → `to` (docs/redis.md).
pub struct NotifyFlagsAdded<'a> {
    pub node: &'a str,
    pub from: &'a str,
    pub to: &'a str,
}

impl NotifyFlagsAdded<'_> {
    pub const NAME: &'static str = "notify_flags_added";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, node = %self.node, from = %self.from, to = %self.to, "Added missing notify-keyspace-events flags (kept the ones already set).");
    }
}

/// `node`'s `notify-keyspace-events` (`flags`) lacks `missing`, which the rules need, and
/// `redis.notifications: ignore` says to go on: events of those kinds are not heard.
pub struct NotifyFlagsMissing<'a> {
    pub node: &'a str,
    pub flags: &'a str,
    pub missing: &'a str,
}

impl NotifyFlagsMissing<'_> {
    pub const NAME: &'static str = "notify_flags_missing";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, node = %self.node, flags = %self.flags, missing = %self.missing, "notify-keyspace-events lacks flags the rules need; starting anyway (`redis.notifications: ignore`).");
    }
}

/// This host's clock is `offset_ms` behind Redis's (negative: ahead). keywatch compares
/// deadlines and leases against Redis's clock, so this is a warning, not a fault.
pub struct ClockOffset {
    pub offset_ms: i64,
}

impl ClockOffset {
    pub const NAME: &'static str = "clock_offset";

    pub fn emit(self) {
        tracing::warn!(
            internal_event = Self::NAME,
            offset_ms = self.offset_ms,
            "This host's clock differs from Redis's; keywatch compares deadlines and leases against Redis's clock, but check NTP on both."
        );
    }
}

/// A step of following a Sentinel failover of `master` (docs/redis.md#sentinel).
pub struct SentinelSwitch<'a> {
    pub master: &'a str,
    pub step: SwitchStep,
    /// The node keywatch acted on before (`""` when none).
    pub from: &'a str,
    /// The node it acts on, or waits for.
    pub to: &'a str,
}

/// How far a switch has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwitchStep {
    /// A replica was selected: keywatch no longer acts on the old master, and its commands
    /// wait until the replica is master.
    Selected,
    /// The selected replica is master: watched.
    Promoted,
    /// The selected replica did not become master in time: the sentinels are asked again.
    NotPromoted,
    /// The sentinels name another master than the one watched: watched now.
    Moved,
}

impl SwitchStep {
    pub fn as_str(self) -> &'static str {
        match self {
            SwitchStep::Selected => "selected",
            SwitchStep::Promoted => "promoted",
            SwitchStep::NotPromoted => "not_promoted",
            SwitchStep::Moved => "moved",
        }
    }
}

impl SentinelSwitch<'_> {
    pub const NAME: &'static str = "sentinel_switch";

    pub fn emit(self) {
        let SentinelSwitch {
            master,
            step,
            from,
            to,
        } = self;
        let name = Self::NAME;
        let s = step.as_str();
        match step {
            SwitchStep::Selected => {
                tracing::info!(internal_event = name, %master, step = s, %from, %to, "Sentinel: a failover is under way; no longer acting on the old master, and keywatch's commands wait until the selected replica is master.")
            }
            SwitchStep::Promoted => {
                tracing::info!(internal_event = name, %master, step = s, %from, %to, "Sentinel: the selected replica is master; watching it.")
            }
            SwitchStep::NotPromoted => {
                tracing::warn!(internal_event = name, %master, step = s, %from, %to, "Sentinel: the selected replica did not become master; asking the sentinels.")
            }
            SwitchStep::Moved => {
                tracing::info!(internal_event = name, %master, step = s, %from, %to, "Sentinel: the master moved; watching the new one.")
            }
        }
    }
}

/// The Redis `user` lacks grants the rules need: keywatch is not ready until it has them
/// (docs/redis.md#least-privilege-acl). Emitted when what is missing changes.
pub struct GrantsMissing<'a> {
    pub user: &'a str,
    /// The grants, space-separated (`+select`, `~keywatch:*` …).
    pub missing: &'a str,
    /// The `ACL SETUSER` that adds them.
    pub fix: &'a str,
    /// How often they are checked again, seconds.
    pub recheck_s: u64,
}

impl GrantsMissing<'_> {
    pub const NAME: &'static str = "grants_missing";

    pub fn emit(self) {
        let GrantsMissing {
            user,
            missing,
            fix,
            recheck_s,
        } = self;
        tracing::error!(internal_event = Self::NAME, %user, %missing, %fix, recheck_s, "The Redis user lacks grants the rules need: not ready until it has them. Fix: {fix}");
    }
}

/// The Redis `user` has every grant the rules in force need (`commands` of them, `checked`
/// as said).
pub struct GrantsComplete<'a> {
    pub user: &'a str,
    pub commands: usize,
    pub checked: &'a str,
}

impl GrantsComplete<'_> {
    pub const NAME: &'static str = "grants_complete";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, user = %self.user, commands = self.commands, checked = %self.checked, "The Redis user has every grant the rules need.");
    }
}

/// A reload put new rules in force (`cause`: SIGHUP, `POST /-/reload`, a rule file changed).
pub struct ReloadApplied<'a> {
    pub cause: &'a str,
    pub rules: usize,
    pub channels: usize,
}

impl ReloadApplied<'_> {
    pub const NAME: &'static str = "reload_applied";

    /// Logs it, sets `keywatch_config_last_reload_successful` to 1 and
    /// `keywatch_config_last_reload_success_timestamp_seconds` to now.
    pub fn emit(self, metrics: &Metrics) {
        metrics.reload_succeeded(chrono::Utc::now().timestamp());
        tracing::info!(
            internal_event = Self::NAME,
            cause = %self.cause,
            rules = self.rules,
            channels = self.channels,
            "Rules reloaded."
        );
    }
}

/// A reload was refused: the old rules stay in force. `error` says why, with each problem's
/// `FILE:LINE:COLUMN`.
pub struct ReloadFailed<'a> {
    pub cause: &'a str,
    pub error: &'a dyn Display,
}

impl ReloadFailed<'_> {
    pub const NAME: &'static str = "reload_failed";

    /// Logs it, counts it in `keywatch_reload_failures_total` and sets
    /// `keywatch_config_last_reload_successful` to 0.
    pub fn emit(self, metrics: &Metrics) {
        metrics.reload_failures.inc();
        metrics.config_last_reload_successful.set(0);
        let ReloadFailed { cause, error } = self;
        tracing::error!(internal_event = Self::NAME, %cause, %error, "Reload failed; the old rules stay in force: {error}");
    }
}

/// An event a silence mutes: counted, kept in history as skipped, not sent.
pub struct Silenced<'a> {
    pub rule: &'a str,
    pub key: &'a str,
}

impl Silenced<'_> {
    pub const NAME: &'static str = "silenced";

    /// Logs it and counts it in `keywatch_silenced_total{rule}`.
    pub fn emit(self, metrics: &Metrics) {
        metrics.silenced_for(self.rule);
        tracing::info!(internal_event = Self::NAME, rule = %self.rule, key = %self.key, "Silenced: counted, not sent.");
    }
}

/// An expiry found afterwards that the rule does not fire (`recover: never`, `recover.max_late`
/// passed, the key exists again …): `reason` says which.
pub struct RecoverySkipped<'a> {
    pub rule: &'a str,
    pub key: &'a str,
    /// The key's deadline when known (RFC 3339), `""` otherwise.
    pub deadline: &'a str,
    pub reason: &'a str,
}

impl RecoverySkipped<'_> {
    pub const NAME: &'static str = "recovery_skipped";

    /// Logs it and counts it in `keywatch_recovery_skipped_total{rule}`.
    pub fn emit(self, metrics: &Metrics) {
        metrics.recovery_skipped_for(self.rule);
        tracing::info!(internal_event = Self::NAME, rule = %self.rule, key = %self.key, deadline = %self.deadline, reason = %self.reason, "Recovered expiry not fired.");
    }
}

/// A run of the TTL scanner ended: `keys` read, `due` of them, read `from` the ledger or by
/// a scan of the keyspace.
pub struct ScanDone {
    pub keys: u64,
    /// Keys due within their rule's `warn_before` (warned now, or earlier for this deadline).
    pub due: u64,
    pub pauses: u64,
    pub from: &'static str,
    pub took: std::time::Duration,
}

impl ScanDone {
    pub const NAME: &'static str = "scan_done";

    /// Logs it and counts its duration in `keywatch_scan_seconds` (the keys are counted in
    /// `keywatch_scan_keys_total` as they are read).
    pub fn emit(self, metrics: &Metrics) {
        metrics.scan_seconds.observe(self.took.as_secs_f64());
        tracing::info!(
            internal_event = Self::NAME,
            keys = self.keys,
            due = self.due,
            pauses = self.pauses,
            from = self.from,
            took_ms = self.took.as_millis() as u64,
            "Scanner: run done."
        );
    }
}

/// A fill of the ledger ended: the deadlines of the `keys` of database `db` that existed
/// before keywatch subscribed (or while its events were lost) are learnt, read by a paced scan
/// that took `took`. With `error`, the scan failed part way: the deadlines of the keys it did
/// not reach are learnt from events only, until the next fill.
pub struct LedgerFilled<'a> {
    pub db: u32,
    pub keys: usize,
    pub took: std::time::Duration,
    pub error: Option<&'a str>,
}

impl LedgerFilled<'_> {
    pub const NAME: &'static str = "ledger_filled";

    pub fn emit(self) {
        let took_ms = self.took.as_millis() as u64;
        match self.error {
            None => tracing::info!(
                internal_event = Self::NAME,
                db = self.db,
                keys = self.keys,
                took_ms,
                "Ledger: learnt the deadlines of existing keys."
            ),
            Some(error) => tracing::warn!(
                internal_event = Self::NAME,
                db = self.db,
                keys = self.keys,
                took_ms,
                error,
                "Ledger: the scan failed; the deadlines of the keys it did not reach are learnt from events only."
            ),
        }
    }
}

/// `keywatch upcoming` reads the deadlines of database `db` `from` the ledger (what `run`
/// keeps) or by a scan of the keyspace.
pub struct DeadlinesRead {
    pub db: u32,
    pub from: &'static str,
}

impl DeadlinesRead {
    pub const NAME: &'static str = "deadlines_read";

    pub fn emit(self) {
        tracing::debug!(
            internal_event = Self::NAME,
            db = self.db,
            from = self.from,
            "Reading deadlines."
        );
    }
}

/// A mention (`mention.mobiles`, `mention.user_ids`) left out of a message: rendered empty,
/// not plausible (say `@all` from a key's value), or not renderable.
pub struct MentionDropped<'a> {
    pub rule: &'a str,
    /// `mobile` or `user id`.
    pub kind: &'static str,
    /// What it rendered to, printable (`""` when it did not render).
    pub value: &'a str,
    pub why: &'a str,
}

impl MentionDropped<'_> {
    pub const NAME: &'static str = "mention_dropped";

    pub fn emit(self) {
        let MentionDropped {
            rule,
            kind,
            value,
            why,
        } = self;
        tracing::warn!(internal_event = Self::NAME, %rule, kind, %value, %why, "A mention {kind} is left out: {why}.");
    }
}

/// An exec's command ran past its `timeout`: killed with its process group; the attempt is
/// retried (docs/rules.md#exec-arguments-options-and-process-groups).
pub struct ExecTimedOut<'a> {
    pub rule: &'a str,
    pub program: &'a str,
    pub timeout: std::time::Duration,
}

impl ExecTimedOut<'_> {
    pub const NAME: &'static str = "exec_timed_out";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, rule = %self.rule, program = %self.program, timeout = %humantime::format_duration(self.timeout), "exec: the command did not finish within its timeout; killed with its process group.");
    }
}

/// An exec's command exited but processes it started kept its output open: they were killed
/// with its process group.
pub struct ExecGroupKilled<'a> {
    pub rule: &'a str,
    pub program: &'a str,
}

impl ExecGroupKilled<'_> {
    pub const NAME: &'static str = "exec_group_killed";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, rule = %self.rule, program = %self.program, "exec: the command exited but processes it started kept its output open; they were killed with its process group.");
    }
}

/// What an exec's command wrote, secrets masked and control characters written out.
pub struct ExecOutput<'a> {
    pub rule: &'a str,
    pub program: &'a str,
    pub stdout: &'a str,
    pub stderr: &'a str,
}

impl ExecOutput<'_> {
    pub const NAME: &'static str = "exec_output";

    pub fn emit(self) {
        tracing::info!(internal_event = Self::NAME, rule = %self.rule, program = %self.program, stdout = %self.stdout, stderr = %self.stderr, "exec output.");
    }
}

/// The endpoint closed a connection whose client stopped reading its answer for the write
/// timeout. At most one per period; `suppressed` says how many were not logged since.
pub struct ClientStalled<'a> {
    pub peer: &'a dyn Display,
    pub write_timeout_s: u64,
    pub suppressed: u64,
}

impl ClientStalled<'_> {
    pub const NAME: &'static str = "client_stalled";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, peer = %self.peer, write_timeout_s = self.write_timeout_s, suppressed = self.suppressed, "HTTP connection closed: its client stopped reading its answer.");
    }
}

/// A signed link (silence, acknowledge) was refused: forged, expired or for other rules. At
/// most one per period; `suppressed` says how many were not logged since.
pub struct LinkRefused<'a> {
    pub reason: &'a dyn Display,
    pub suppressed: u64,
}

impl LinkRefused<'_> {
    pub const NAME: &'static str = "link_refused";

    pub fn emit(self) {
        tracing::warn!(internal_event = Self::NAME, reason = %self.reason, suppressed = self.suppressed, "A signed link was refused.");
    }
}

/// Readiness changed (`/readyz`): `ready`, or not and why.
pub struct Readiness<'a> {
    pub ready: bool,
    /// The watched nodes not subscribed, space-separated (when not ready).
    pub nodes_down: &'a str,
    /// The other reasons, `; `-separated (when not ready).
    pub reasons: &'a str,
}

impl Readiness<'_> {
    pub const NAME: &'static str = "readiness";

    pub fn emit(self) {
        if self.ready {
            tracing::info!(
                internal_event = Self::NAME,
                ready = true,
                "keywatch is ready."
            );
        } else {
            tracing::warn!(internal_event = Self::NAME, ready = false, nodes_not_subscribed = %self.nodes_down, reasons = %self.reasons, "keywatch is not ready.");
        }
    }
}

/// What one attempt of an action (or a digest) is named by in its internal event.
pub struct Attempted<'a> {
    pub rule: &'a str,
    /// The key as shown to people, or how many keys a digest stands for.
    pub key: &'a str,
    pub action: &'static str,
    /// The channel, for any action that has one (a follow-up's included); `""` otherwise.
    pub channel: &'a str,
    /// Which attempt this was (from 1).
    pub attempt: u32,
    pub outcome: &'a Outcome,
    pub seconds: f64,
}

impl Attempted<'_> {
    pub const NAME: &'static str = "attempted";

    /// Logs the attempt (secrets already masked in its text) and counts it in
    /// `keywatch_actions_total{rule,action,outcome}` and `keywatch_action_seconds`.
    pub fn emit(self, metrics: &Metrics) {
        let Attempted {
            rule,
            key,
            action,
            channel,
            attempt,
            outcome,
            seconds,
        } = self;
        metrics.action(rule, action, outcome.label(), seconds);
        let label = outcome.label();
        let name = Self::NAME;
        match outcome {
            Outcome::Sent(_) | Outcome::Skipped(_) => {
                tracing::info!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, answer = %outcome.text(), "Action done.")
            }
            Outcome::Shadow(rendered) => {
                tracing::info!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %rendered, "Shadow: the action was rendered, not done.")
            }
            Outcome::Again { answer, after } => {
                tracing::info!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %answer, again_in = %humantime::format_duration(*after), "Action done; it runs again later.")
            }
            Outcome::Retry { reason, .. } => {
                tracing::warn!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %reason, "Action failed; will retry.")
            }
            Outcome::Failed(reason) => {
                tracing::error!(internal_event = name, %rule, %key, action, channel, outcome = label, attempt, %reason, "Action failed for good.")
            }
        }
    }
}

/// An action given up for good: kept as a dead letter (`keywatch dead list`).
pub struct DeadLettered<'a> {
    pub rule: &'a str,
    pub key: &'a str,
    pub action: &'a str,
    pub channel: &'a str,
    /// The event id (or a digest's).
    pub id: &'a str,
    pub reason: &'a str,
}

impl DeadLettered<'_> {
    pub const NAME: &'static str = "dead_lettered";

    /// Logs the dead letter and counts it in `keywatch_dead_letters_total`.
    pub fn emit(self, metrics: &Metrics) {
        metrics.dead_letters.inc();
        let DeadLettered {
            rule,
            key,
            action,
            channel,
            id,
            reason,
        } = self;
        tracing::error!(internal_event = Self::NAME, %rule, %key, action, channel, %id, %reason, "Dead letter: the action will not be retried.");
    }
}

/// Redis did not take a write (or answer a read) of keywatch's state. What it was about stays
/// where it is in Redis (an event's intake record, a job's lease) and is tried again: the
/// event names the `operation` (docs/operations.md#internal-events lists them) and what
/// happens next.
pub struct StateError<'a> {
    pub operation: &'static str,
    pub error: &'a dyn Display,
    /// How many jobs, events or windows it was about.
    pub items: usize,
    /// What happens next, as a sentence.
    pub then: &'static str,
}

impl StateError<'_> {
    pub const NAME: &'static str = "state_error";

    /// Logs it and counts it in `keywatch_state_errors_total{operation}`.
    pub fn emit(self, metrics: &Metrics) {
        metrics.state_error(self.operation);
        let StateError {
            operation,
            error,
            items,
            then,
        } = self;
        tracing::warn!(internal_event = Self::NAME, operation, error = %error, items, "Redis did not take keywatch's state: {then}");
    }
}

/// A message to a channel in its quiet hours is held until they end (docs/rules.md#quiet-hours).
pub struct HeldMessage<'a> {
    pub rule: &'a str,
    /// The key as shown to people, or how many keys a digest stands for.
    pub key: &'a str,
    pub channel: &'a str,
    /// The channel's window.
    pub window: &'a str,
    pub until: chrono::DateTime<chrono::Utc>,
    /// How many messages (a window's digest holds each of its notifications).
    pub messages: usize,
}

impl HeldMessage<'_> {
    pub const NAME: &'static str = "held";

    pub fn emit(self) {
        let HeldMessage {
            rule,
            key,
            channel,
            window,
            until,
            messages,
        } = self;
        tracing::info!(internal_event = Self::NAME, %rule, %key, %channel, %window, until = %crate::firing::rfc3339(until), messages, "Held by quiet hours.");
    }
}

/// A thread or task of `run` panicked: what it was doing ended there (tokio keeps the rest
/// going), so this is always a bug to report.
pub struct Panicked<'a> {
    pub thread: &'a str,
    /// `FILE:LINE:COLUMN` of the panic.
    pub location: &'a str,
    /// What the panic said.
    pub payload: &'a str,
}

impl Panicked<'_> {
    pub const NAME: &'static str = "panicked";

    pub fn emit(self) {
        tracing::error!(internal_event = Self::NAME, thread = %self.thread, location = %self.location, payload = %self.payload, "A thread or task of keywatch panicked: please report it.");
    }

    /// Emits one for every panic from now on, before the hook in place (which prints it).
    pub fn on_every_panic() {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info
                .payload()
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            let location = info
                .location()
                .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
                .unwrap_or_default();
            let thread = std::thread::current();
            Panicked {
                thread: thread.name().unwrap_or(""),
                location: &location,
                payload,
            }
            .emit();
            before(info);
        }));
    }
}

#[cfg(test)]
mod tests {
    //! docs/operations.md#internal-events is what `emit` does: every event of this file, emitted
    //! once in each of its forms under the JSON log format `run --log-format json` uses, logs
    //! the name, levels and fields the table lists and changes the metrics it names, no more.

    use std::collections::{BTreeMap, BTreeSet};
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What one event did: the levels it logged at, its own fields, the metrics it changed.
    #[derive(Debug, Default, PartialEq)]
    struct Seen {
        levels: BTreeSet<String>,
        fields: BTreeSet<String>,
        metrics: BTreeSet<String>,
    }

    /// The metric families whose samples differ between two encodings (`_bucket`, `_sum` and
    /// `_count` are their histogram's).
    fn changed(before: &str, after: &str) -> BTreeSet<String> {
        let samples = |text: &str| -> BTreeSet<String> {
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .map(str::to_string)
                .collect()
        };
        let (before, after) = (samples(before), samples(after));
        before
            .symmetric_difference(&after)
            .map(|line| {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(name)
                    .to_string()
            })
            .collect()
    }

    /// Every event in each of its forms, each emitted once: a new event type goes here (the
    /// test fails on a `NAME` no form emits).
    fn every_form(metrics: &Metrics) -> Vec<Box<dyn Fn() + '_>> {
        let error = "connection refused";
        let outcomes = [
            Outcome::Sent("200 ok".into()),
            Outcome::Skipped("the alert was acknowledged".into()),
            Outcome::Again {
                answer: "200".into(),
                after: Duration::from_secs(60),
            },
            Outcome::Retry {
                reason: "HTTP 503".into(),
                after: None,
            },
            Outcome::Failed("HTTP 404".into()),
            Outcome::Shadow("POST https://chat.example/hook".into()),
        ];
        let mut forms: Vec<Box<dyn Fn() + '_>> = vec![
            Box::new(|| {
                Listening {
                    addr: "127.0.0.1:9464".parse().unwrap(),
                    open_files: 1024,
                    connections: 512,
                    open: false,
                }
                .emit()
            }),
            Box::new(|| {
                Listening {
                    addr: "0.0.0.0:9464".parse().unwrap(),
                    open_files: 1024,
                    connections: 512,
                    open: true,
                }
                .emit()
            }),
            Box::new(|| {
                Readiness {
                    ready: false,
                    nodes_down: "127.0.0.1:6379",
                    reasons: "",
                }
                .emit()
            }),
            Box::new(|| {
                Readiness {
                    ready: true,
                    nodes_down: "",
                    reasons: "",
                }
                .emit()
            }),
            Box::new(|| {
                Subscribed {
                    node: "127.0.0.1:6379",
                    channels: 4,
                }
                .emit()
            }),
            Box::new(|| {
                SubscriptionLost {
                    node: "127.0.0.1:6379",
                    reason: error,
                }
                .emit(metrics)
            }),
            Box::new(|| {
                SubscriptionsChanged {
                    node: "127.0.0.1:6379",
                    channels: 2,
                }
                .emit()
            }),
            Box::new(|| {
                FellBehind {
                    node: "127.0.0.1:6379",
                    waiting: 70_000,
                    mib: 16,
                }
                .emit()
            }),
            Box::new(|| {
                KeysLeftUnannounced {
                    node: "127.0.0.1:6379",
                    how: "flush",
                }
                .emit()
            }),
            Box::new(|| {
                FlushTrackingRefused {
                    node: "127.0.0.1:6379",
                    reason: "HELLO 3: NOPERM",
                }
                .emit()
            }),
            Box::new(|| {
                NodeRefused {
                    node: "127.0.0.1:6380",
                    reason: "a replica",
                }
                .emit()
            }),
            Box::new(|| {
                NotifyFlagsAdded {
                    node: "127.0.0.1:6379",
                    from: "",
                    to: "Exg",
                }
                .emit()
            }),
            Box::new(|| {
                NotifyFlagsMissing {
                    node: "127.0.0.1:6379",
                    flags: "",
                    missing: "Exg",
                }
                .emit()
            }),
            Box::new(|| ClockOffset { offset_ms: 20_000 }.emit()),
            Box::new(|| {
                GrantsMissing {
                    user: "keywatch",
                    missing: "+select",
                    fix: "ACL SETUSER keywatch +select",
                    recheck_s: 5,
                }
                .emit()
            }),
            Box::new(|| {
                GrantsComplete {
                    user: "keywatch",
                    commands: 30,
                    checked: "ACL DRYRUN",
                }
                .emit()
            }),
            Box::new(|| {
                ReloadApplied {
                    cause: "SIGHUP",
                    rules: 1,
                    channels: 1,
                }
                .emit(metrics)
            }),
            Box::new(|| {
                ReloadFailed {
                    cause: "SIGHUP",
                    error: &"rules.yaml:3:5: bad",
                }
                .emit(metrics)
            }),
            Box::new(|| {
                Silenced {
                    rule: "r",
                    key: "k",
                }
                .emit(metrics)
            }),
            Box::new(|| {
                RecoverySkipped {
                    rule: "r",
                    key: "k",
                    deadline: "",
                    reason: "recover: never",
                }
                .emit(metrics)
            }),
            Box::new(|| {
                ScanDone {
                    keys: 10,
                    due: 1,
                    pauses: 0,
                    from: "scan",
                    took: Duration::from_millis(3),
                }
                .emit(metrics)
            }),
            Box::new(|| {
                LedgerFilled {
                    db: 0,
                    keys: 200,
                    took: Duration::from_millis(3),
                    error: None,
                }
                .emit()
            }),
            Box::new(|| {
                LedgerFilled {
                    db: 0,
                    keys: 0,
                    took: Duration::from_millis(3),
                    error: Some("connection refused"),
                }
                .emit()
            }),
            Box::new(|| {
                DeadlinesRead {
                    db: 0,
                    from: "ledger",
                }
                .emit()
            }),
            Box::new(|| {
                MentionDropped {
                    rule: "r",
                    kind: "mobile",
                    value: "@all",
                    why: "it is not plausible",
                }
                .emit()
            }),
            Box::new(|| {
                DeadLettered {
                    rule: "r",
                    key: "k",
                    action: "notify",
                    channel: "team",
                    id: "e1",
                    reason: "HTTP 404",
                }
                .emit(metrics)
            }),
            Box::new(|| {
                ExecTimedOut {
                    rule: "r",
                    program: "sleep",
                    timeout: Duration::from_millis(300),
                }
                .emit()
            }),
            Box::new(|| {
                ExecGroupKilled {
                    rule: "r",
                    program: "sh",
                }
                .emit()
            }),
            Box::new(|| {
                ExecOutput {
                    rule: "r",
                    program: "sh",
                    stdout: "out",
                    stderr: "",
                }
                .emit()
            }),
            Box::new(|| {
                StateError {
                    operation: "take",
                    error: &"connection refused",
                    items: 1,
                    then: "tried again",
                }
                .emit(metrics)
            }),
            Box::new(|| {
                Panicked {
                    thread: "tokio-runtime-worker",
                    location: "src/lib.rs:1:1",
                    payload: "oops",
                }
                .emit()
            }),
            Box::new(|| {
                ClientStalled {
                    peer: &"127.0.0.1:50000",
                    write_timeout_s: 10,
                    suppressed: 0,
                }
                .emit()
            }),
            Box::new(|| {
                LinkRefused {
                    reason: &"forged",
                    suppressed: 3,
                }
                .emit()
            }),
            Box::new(|| {
                HeldMessage {
                    rule: "r",
                    key: "k",
                    channel: "team",
                    window: "22:00-08:00",
                    until: chrono::DateTime::UNIX_EPOCH,
                    messages: 1,
                }
                .emit()
            }),
        ];
        for step in [
            SwitchStep::Selected,
            SwitchStep::Promoted,
            SwitchStep::NotPromoted,
            SwitchStep::Moved,
        ] {
            forms.push(Box::new(move || {
                SentinelSwitch {
                    master: "mymaster",
                    step,
                    from: "127.0.0.1:6380",
                    to: "127.0.0.1:6381",
                }
                .emit()
            }));
        }
        for outcome in outcomes {
            forms.push(Box::new(move || {
                Attempted {
                    rule: "r",
                    key: "k",
                    action: "notify",
                    channel: "team",
                    attempt: 1,
                    outcome: &outcome,
                    seconds: 0.1,
                }
                .emit(metrics)
            }));
        }
        forms
    }

    /// What each event did, by name.
    fn emitted() -> BTreeMap<String, Seen> {
        let metrics = Metrics::new();
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish();
        let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
        tracing::subscriber::with_default(subscriber, || {
            for form in every_form(&metrics) {
                let before = metrics.encode();
                out.0.lock().unwrap().clear();
                form();
                let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
                let lines: Vec<serde_json::Value> = text
                    .lines()
                    .map(|l| serde_json::from_str(l).unwrap())
                    .collect();
                assert_eq!(lines.len(), 1, "one line per emit: {text}");
                let line = lines[0].as_object().unwrap();
                let name = line["internal_event"].as_str().unwrap().to_string();
                let entry = seen.entry(name).or_default();
                entry
                    .levels
                    .insert(line["level"].as_str().unwrap().to_lowercase());
                entry.fields.extend(
                    line.keys()
                        .filter(|k| {
                            !["timestamp", "level", "target", "message", "internal_event"]
                                .contains(&k.as_str())
                        })
                        .cloned(),
                );
                entry.metrics.extend(changed(&before, &metrics.encode()));
            }
        });
        seen
    }

    /// The `NAME` of every event type in this file.
    fn names_in_source() -> BTreeSet<String> {
        include_str!("internal_events.rs")
            .lines()
            .filter_map(|l| {
                l.trim()
                    .strip_prefix("pub const NAME: &'static str = \"")?
                    .strip_suffix("\";")
                    .map(str::to_string)
            })
            .collect()
    }

    /// The backticked names of a table cell (`` `a`, `b` `` → a, b).
    fn code_in(cell: &str) -> BTreeSet<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    }

    /// docs/operations.md's table of internal events, by name.
    fn documented() -> BTreeMap<String, Seen> {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"),
        )
        .unwrap();
        let section = &doc[doc.find("\n## Internal events\n").expect("the section")..];
        let table = section
            .lines()
            .skip_while(|l| !l.starts_with("| event |"))
            .skip(2)
            .take_while(|l| l.starts_with('|'));
        let mut out = BTreeMap::new();
        for row in table {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = code_in(cells[1]).into_iter().next().expect(row);
            let levels = cells[2].split(',').map(|l| l.trim().to_string()).collect();
            let seen = Seen {
                levels,
                fields: code_in(cells[3]),
                metrics: code_in(cells[4]),
            };
            assert!(out.insert(name, seen).is_none(), "listed twice: {row}");
        }
        out
    }

    #[test]
    fn the_documented_internal_events_are_what_emit_does() {
        let emitted = emitted();
        let names: BTreeSet<String> = emitted.keys().cloned().collect();
        assert_eq!(
            names,
            names_in_source(),
            "every event type has a form in `every_form`"
        );
        let documented = documented();
        for (name, seen) in &emitted {
            let Some(doc) = documented.get(name) else {
                panic!("docs/operations.md#internal-events lacks `{name}`: {seen:?}");
            };
            assert_eq!(doc, seen, "docs/operations.md#internal-events on `{name}`");
        }
        let extra: Vec<&String> = documented
            .keys()
            .filter(|n| !emitted.contains_key(*n))
            .collect();
        assert!(
            extra.is_empty(),
            "docs/operations.md#internal-events lists events that do not exist: {extra:?}"
        );
    }
}
