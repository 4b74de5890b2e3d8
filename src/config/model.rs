//! The validated rule set: what the rest of keywatch runs on.
//!
//! These types are built only by [`super::load`], after every check has passed, so the pipeline
//! never re-validates: a `Rule` always has a compiled pattern, a known channel list and templates
//! that rendered once against the rule's captures.

use std::path::PathBuf;
use std::time::Duration;

use crate::event::EventKind;
use crate::pattern::Pattern;
use crate::pattern::matcher::Matcher;
use crate::template::{Escape, TemplateId, TemplateSet};

pub use crate::channel::{Channel, Rate};
use crate::yaml::diagnostic::Loc;
pub use crate::yaml::{Secret, Secrets};

/// Everything loaded from the rule files.
pub struct Config {
    /// The rule files, in load order.
    pub files: Vec<PathBuf>,
    pub redis: RedisSettings,
    pub state: StateSettings,
    pub channels: Vec<Channel>,
    pub rules: Vec<Rule>,
    /// Present when a rule warns before expiry, or when the files configure it.
    pub scanner: Option<ScannerSettings>,
    pub templates: TemplateSet,
    pub matcher: Matcher,
    /// The values the files took from the environment and `*_file`s, masked in everything
    /// shown: `explain`, logs, errors, history.
    pub secrets: Secrets,
    /// `history`: how long firings are kept in Redis.
    pub history: super::followups::HistorySettings,
    /// `links`: signed acknowledge/silence links in messages of rules with `escalate`.
    pub links: Option<super::followups::LinksSettings>,
    /// `server`: protection of the `--listen` endpoint.
    pub server: super::server::ServerSettings,
    /// `timezone`: how times read in messages (the `datetime` filter) and where quiet hours
    /// are (UTC unless set).
    pub timezone: chrono_tz::Tz,
    /// `quiet_hours`: the named windows channels may be quiet during.
    pub quiet_hours: Vec<crate::quiet_hours::Window>,
}

impl Config {
    pub fn channel(&self, name: &str) -> Option<&Channel> {
        self.channels.iter().find(|c| c.name == name)
    }

    pub fn rule(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.name == name)
    }

    /// The event kinds some rule reacts to.
    pub fn event_kinds(&self) -> Vec<EventKind> {
        let mut kinds: Vec<EventKind> = self
            .rules
            .iter()
            .flat_map(|r| r.on.iter().copied())
            .collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }

    /// The `notify-keyspace-events` letters the rules need (docs/rules.md): `E` always, `x` for
    /// expiries, `e` for evictions, `g` for deletions and for learning deadlines.
    pub fn needed_notify_flags(&self) -> String {
        let mut flags = String::from("E");
        for k in self.event_kinds() {
            if let Some(f) = k.notify_flag()
                && !flags.contains(f)
            {
                flags.push(f);
            }
        }
        if self.uses_ledger() && !flags.contains('g') {
            flags.push('g');
        }
        if self.watches_fields() {
            flags.push('h');
        }
        flags
    }

    /// Whether keywatch keeps a deadline ledger: whenever a rule reacts to expiries or warns
    /// before them.
    pub fn uses_ledger(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.on.contains(&EventKind::Expired) || r.on.contains(&EventKind::Expiring))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notifications {
    /// Refuse to start while a flag is missing, saying the exact fix.
    Check,
    /// Add missing flags with CONFIG SET, keeping those already set.
    Enable,
    /// Start anyway.
    Ignore,
}

#[derive(Clone, Debug)]
pub struct RedisSettings {
    /// `redis.url` from the files; the CLI and `KEYWATCH_REDIS_URL` take precedence.
    pub url: Option<Secret>,
    pub cluster: bool,
    pub databases: Vec<u32>,
    pub notifications: Notifications,
    pub tls: Option<TlsFiles>,
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// `redis.sentinel`: the watched node is whichever master the sentinels name.
    pub sentinel: Option<SentinelSettings>,
}

/// A Sentinel-managed Redis: the master is asked of the sentinels by name and followed through
/// failovers. Credentials, TLS and databases of the master still come from `redis.url` and the
/// other `redis` fields; only the sentinels' own password is here, as they often have another.
#[derive(Clone, Debug)]
pub struct SentinelSettings {
    /// The name the sentinels monitor the master by (`sentinel monitor NAME …`).
    pub master: String,
    /// The sentinels, `host:port`, asked in this order.
    pub nodes: Vec<String>,
    pub password: Option<Secret>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

#[derive(Clone, Debug)]
pub struct StateSettings {
    pub prefix: String,
    pub url: Option<Secret>,
    /// Set in a shadow (`run --shadow`): the prefix of the keywatch it runs beside, whose keys
    /// are keywatch's own as much as the shadow's (never matched, learnt or deleted).
    pub shadow_of: Option<String>,
}

impl StateSettings {
    /// Whether `key` is keywatch's own: under `prefix`, or the real keywatch's beside a shadow.
    pub fn is_own(&self, key: &[u8]) -> bool {
        key.starts_with(self.prefix.as_bytes())
            || self
                .shadow_of
                .as_ref()
                .is_some_and(|p| key.starts_with(p.as_bytes()))
    }

    /// Whether this is a shadow's state (`run --shadow`).
    pub fn is_shadow(&self) -> bool {
        self.shadow_of.is_some()
    }
}

impl Config {
    /// These rules as a shadow runs them (`run --shadow`, docs/operations.md#rolling-out-beside-existing-code):
    /// its state under `state.prefix` + `shadow:`, so that it changes nothing of a keywatch
    /// running beside it, and that one's keys its own too.
    pub fn into_shadow(mut self) -> Config {
        if self.state.shadow_of.is_none() {
            let real = std::mem::take(&mut self.state.prefix);
            self.state.prefix = format!("{real}shadow:");
            self.state.shadow_of = Some(real);
        }
        // A shadow changes nothing of the watched Redis: missing flags are reported, not set.
        if self.redis.notifications == Notifications::Enable {
            self.redis.notifications = Notifications::Check;
        }
        self
    }
}

#[derive(Clone, Debug)]
pub enum Schedule {
    Every(Duration),
    Cron(Box<croner::Cron>),
}

#[derive(Clone, Debug)]
pub struct ScannerSettings {
    /// As written, for logs and the status page.
    pub schedule_text: String,
    pub schedule: Schedule,
    pub timezone: chrono_tz::Tz,
    pub max_keys_per_second: u64,
}

#[derive(Clone, Debug)]
pub struct Rule {
    pub name: String,
    pub loc: Loc,
    pub pattern: Pattern,
    /// `field`: a `hexpired` rule's field pattern (see `config::fields`).
    pub field: Option<FieldPattern>,
    pub on: Vec<EventKind>,
    /// `None`: every watched database.
    pub db: Option<Vec<u32>>,
    pub warn_before: Option<Duration>,
    /// What to do with an expiry found afterwards (nobody heard it at its deadline).
    pub recover: Recover,
    /// `recover.max_late`: an expiry found more than this after its deadline is skipped
    /// (counted, logged, kept in history) whatever `recover` says.
    pub max_late: Option<Duration>,
    pub detail: Option<DetailStep>,
    pub reload: Option<ReloadStep>,
    pub exec: Option<ExecStep>,
    pub cleanup: Option<CleanupStep>,
    pub notify: Option<NotifyStep>,
    /// `escalate`: tell `to` unless the alert was handled within `wait`.
    pub escalate: Option<FollowupStep>,
    /// `resolved`: tell `to` when the key exists again within `wait` of the alert.
    pub resolved: Option<FollowupStep>,
    /// `notify.quiet: ignore`: every message of this rule (its notifications, escalations and
    /// resolved notices) passes quiet hours.
    pub ignores_quiet: bool,
}

pub use super::followups::Unless;

/// `escalate` or `resolved` of a rule: a message to other channels, at a time after the alert.
#[derive(Clone, Debug)]
pub struct FollowupStep {
    /// `escalate.after` or `resolved.within`.
    pub wait: Duration,
    pub unless: Unless,
    pub to: Vec<String>,
    pub title: PerEscape,
    pub message: PerEscape,
}

impl Rule {
    pub fn fires_on(&self, kind: EventKind, db: u32) -> bool {
        self.on.contains(&kind) && self.db.as_ref().is_none_or(|dbs| dbs.contains(&db))
    }
}

/// A rule's `field` pattern, with the capture names of the whole event: the key's first, then the
/// field's (a name in both is refused by `check`).
#[derive(Clone, Debug)]
pub struct FieldPattern {
    pub pattern: Pattern,
    pub names: Vec<String>,
}

/// An expiry found afterwards cannot be told from a delete keywatch did not hear (the key and
/// its detail removed while nobody listened): `recover` says what a rule does with one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recover {
    /// Fire it, `recovered: true`.
    Always,
    /// Fire it only when the rule's detail still exists: an application that removes the
    /// detail with the key (the order was paid) is not acted on.
    IfDetail,
    /// Count and log it, never fire it.
    Never,
}

impl Recover {
    pub const ALL: [Recover; 3] = [Recover::Always, Recover::IfDetail, Recover::Never];

    pub fn as_str(self) -> &'static str {
        match self {
            Recover::Always => "always",
            Recover::IfDetail => "if_detail",
            Recover::Never => "never",
        }
    }

    pub fn parse(s: &str) -> Option<Recover> {
        Recover::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

#[derive(Clone, Debug)]
pub enum DetailSource {
    Hash { key: TemplateId, field: TemplateId },
    Key { key: TemplateId },
}

#[derive(Clone, Debug)]
pub struct DetailStep {
    pub source: DetailSource,
    /// Delete the detail once the event's jobs are stored.
    pub remove: bool,
}

#[derive(Clone, Debug)]
pub struct ReloadStep {
    pub url: TemplateId,
    pub method: String,
    pub headers: Vec<(String, TemplateId)>,
    pub body: Option<TemplateId>,
    pub timeout: Duration,
    /// Requests of this rule's reload in flight at once on one instance.
    pub concurrency: usize,
}

#[derive(Clone, Debug)]
pub struct ExecStep {
    pub command: Vec<TemplateId>,
    /// Per argument: its template starts with a value (`{{ file }}`), so key text decides
    /// whether it starts with `-` (refused by `action::exec` unless after `--`).
    pub value_led: Vec<bool>,
    /// `env`: variables the command gets besides `PATH`, `HOME` and the event's `KEYWATCH_*`.
    pub env: Vec<(String, TemplateId)>,
    pub timeout: Duration,
    /// Processes of this rule's exec running at once on one instance.
    pub concurrency: usize,
}

#[derive(Clone, Debug)]
pub struct HdelTarget {
    pub key: TemplateId,
    pub field: TemplateId,
}

#[derive(Clone, Debug)]
pub struct CleanupStep {
    pub delete: Vec<TemplateId>,
    pub hdel: Vec<HdelTarget>,
}

/// One template compiled once per escaping its channels need.
#[derive(Clone, Debug)]
pub struct PerEscape(pub Vec<(Escape, TemplateId)>);

impl PerEscape {
    pub fn get(&self, escape: Escape) -> Option<TemplateId> {
        self.0.iter().find(|(e, _)| *e == escape).map(|(_, t)| *t)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub window: Duration,
    pub max_items: usize,
}

#[derive(Clone, Debug)]
pub struct NotifyStep {
    /// Channel names, each known to exist.
    pub to: Vec<String>,
    pub title: PerEscape,
    pub message: PerEscape,
    pub group: Option<Group>,
    /// `notify.mention`: rendered per event and added to each channel's mentions.
    pub mention: RuleMention,
    /// `notify.labels` and `notify.annotations`: rendered per event for alertmanager channels.
    pub labels: Vec<(String, TemplateId)>,
    pub annotations: Vec<(String, TemplateId)>,
    /// The alertmanager channels of `to`, each with how many URLs it posts to: their
    /// notifications are one job per URL (`Action::Alert`).
    pub alerts: Vec<(String, u32)>,
}

impl NotifyStep {
    /// How many URLs `channel` posts each alert to, when it is an alertmanager channel.
    pub fn alert_targets(&self, channel: &str) -> Option<u32> {
        self.alerts
            .iter()
            .find(|(c, _)| c == channel)
            .map(|(_, n)| *n)
    }
}

/// A rule's own mentions: templates (`{{ detail.mobile }}`), each rendered value checked before
/// use (`action::mention`), so that a bad value is dropped, never turned into `@all`.
#[derive(Clone, Debug, Default)]
pub struct RuleMention {
    pub mobiles: Vec<TemplateId>,
    pub user_ids: Vec<TemplateId>,
    pub all: bool,
}
