//! Every metric of docs/operations.md#metrics, defined once, with its labels.
//!
//! Stages get an `Arc<Metrics>` and count as they go; `/metrics` encodes the registry. Label sets
//! are Vec<(String, String)> to keep one small type for all families.

use std::sync::atomic::{AtomicI64, AtomicU64};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

fn histogram_latency() -> Histogram {
    // 1 ms … ~65 s: expiry lateness and action durations both live in this range.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Counts of a batch by label values, added to a metric once per distinct value: a storm's
/// events share a handful of (kind, database) and (rule, kind) pairs.
#[derive(Debug)]
pub struct Tally<K>(pub Vec<(K, u64)>);

impl<K> Default for Tally<K> {
    fn default() -> Tally<K> {
        Tally(Vec::new())
    }
}

impl<K: PartialEq> Tally<K> {
    pub fn add(&mut self, key: K) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => self.0.push((key, 1)),
        }
    }
}

pub struct Metrics {
    registry: Registry,
    pub events: Family<Labels, Counter>,
    pub matches: Family<Labels, Counter>,
    pub actions: Family<Labels, Counter>,
    pub action_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    pub expiry_lateness: Histogram,
    pub queue_pending: Gauge<i64, AtomicI64>,
    /// Of those, the jobs due and not taken: the backlog, without the jobs that wait by design
    /// (an Alertmanager alert's next `resend`, retries, follow-ups, digest windows).
    pub queue_due: Gauge<i64, AtomicI64>,
    pub dead_letters: Counter<u64, AtomicU64>,
    pub ledger_keys: Gauge<i64, AtomicI64>,
    /// Keyspace events received and not yet matched: how far behind Redis keywatch is. The
    /// deadline poker reads it too (see `ledger::run_poker`).
    pub events_waiting: Gauge<i64, AtomicI64>,
    pub recovered: Family<Labels, Counter>,
    /// Expiries found afterwards that a rule's `recover` did not fire.
    pub recovery_skipped: Family<Labels, Counter>,
    /// Escalation messages sent (`escalate`), by rule.
    pub escalations: Family<Labels, Counter>,
    /// Resolved notices sent (`resolved`), by rule.
    pub resolved: Family<Labels, Counter>,
    /// Detail reads that failed (an error, not an absent detail): their events wait for a retry.
    pub detail_read_failures: Counter<u64, AtomicU64>,
    pub subscriber_up: Family<Labels, Gauge<i64, AtomicI64>>,
    /// Per watched node: 1 when its `notify-keyspace-events` had every flag the rules need
    /// when last checked (at each subscription), 0 when one was missing.
    pub notify_flags_ok: Family<Labels, Gauge<i64, AtomicI64>>,
    /// What `/readyz` says, as of the last scrape: 1 ready, 0 not.
    pub ready: Gauge<i64, AtomicI64>,
    pub reconnects: Counter<u64, AtomicU64>,
    pub rules_loaded: Gauge<i64, AtomicI64>,
    pub reload_failures: Counter<u64, AtomicU64>,
    pub config_last_reload_successful: Gauge<i64, AtomicI64>,
    /// Unix seconds of the last successful load (start or reload), as Prometheus has it.
    pub config_last_reload_success_timestamp: Gauge<i64, AtomicI64>,
    pub scan_keys: Counter<u64, AtomicU64>,
    pub scan_seconds: Histogram,
    pub silenced: Family<Labels, Counter>,
    /// Reads and writes of keywatch's state that Redis refused or did not answer, by operation
    /// (docs/operations.md#internal-events).
    pub state_errors: Family<Labels, Counter>,
    /// Messages held by quiet hours, by channel (docs/rules.md#quiet-hours).
    pub held: Family<Labels, Gauge<i64, AtomicI64>>,
}

fn l(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            events: Family::default(),
            matches: Family::default(),
            actions: Family::default(),
            action_seconds: Family::new_with_constructor(histogram_latency as fn() -> Histogram),
            expiry_lateness: histogram_latency(),
            queue_pending: Gauge::default(),
            queue_due: Gauge::default(),
            dead_letters: Counter::default(),
            ledger_keys: Gauge::default(),
            events_waiting: Gauge::default(),
            recovered: Family::default(),
            recovery_skipped: Family::default(),
            escalations: Family::default(),
            resolved: Family::default(),
            detail_read_failures: Counter::default(),
            subscriber_up: Family::default(),
            notify_flags_ok: Family::default(),
            ready: Gauge::default(),
            reconnects: Counter::default(),
            rules_loaded: Gauge::default(),
            reload_failures: Counter::default(),
            config_last_reload_successful: Gauge::default(),
            config_last_reload_success_timestamp: Gauge::default(),
            scan_keys: Counter::default(),
            scan_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            silenced: Family::default(),
            state_errors: Family::default(),
            held: Family::default(),
            registry: Registry::default(),
        };
        // The prometheus-client registry appends `_total` to counters itself.
        let r = &mut registry;
        r.register(
            "keywatch_events",
            "Keyspace events received, by event and database",
            m.events.clone(),
        );
        r.register(
            "keywatch_matches",
            "Events that matched a rule, by rule and event",
            m.matches.clone(),
        );
        r.register(
            "keywatch_actions",
            "Action attempts, by rule, action and outcome",
            m.actions.clone(),
        );
        r.register(
            "keywatch_action_seconds",
            "Time an action attempt took",
            m.action_seconds.clone(),
        );
        r.register(
            "keywatch_expiry_lateness_seconds",
            "Event receipt minus the key's deadline, where known",
            m.expiry_lateness.clone(),
        );
        r.register(
            "keywatch_queue_pending",
            "Jobs waiting or being retried",
            m.queue_pending.clone(),
        );
        r.register(
            "keywatch_queue_due",
            "Jobs due and not taken: in the queue and due, or waiting for their target's room",
            m.queue_due.clone(),
        );
        r.register(
            "keywatch_dead_letters",
            "Actions that failed for good",
            m.dead_letters.clone(),
        );
        r.register(
            "keywatch_ledger_keys",
            "Keys whose deadline keywatch tracks",
            m.ledger_keys.clone(),
        );
        r.register(
            "keywatch_events_waiting",
            "Keyspace events received and not yet matched",
            m.events_waiting.clone(),
        );
        r.register(
            "keywatch_recovered",
            "Expiries found after the fact (missed notifications), by rule",
            m.recovered.clone(),
        );
        r.register(
            "keywatch_recovery_skipped",
            "Expiries found after the fact that the rule's `recover` did not fire, by rule",
            m.recovery_skipped.clone(),
        );
        r.register(
            "keywatch_escalations",
            "Escalation messages sent, by rule",
            m.escalations.clone(),
        );
        r.register(
            "keywatch_resolved",
            "Resolved notices sent (the key existed again after its alert), by rule",
            m.resolved.clone(),
        );
        r.register(
            "keywatch_detail_read_failures",
            "Detail reads that failed (the event's actions wait for a retry)",
            m.detail_read_failures.clone(),
        );
        r.register(
            "keywatch_subscriber_up",
            "1 while the keyevent subscription of a node is live",
            m.subscriber_up.clone(),
        );
        r.register(
            "keywatch_notify_flags_ok",
            "1 when the node's notify-keyspace-events had every flag the rules need at the last check",
            m.notify_flags_ok.clone(),
        );
        r.register(
            "keywatch_ready",
            "1 while /readyz answers 200 (rules loaded, every watched node subscribed)",
            m.ready.clone(),
        );
        r.register(
            "keywatch_reconnects",
            "Subscriber connections lost and re-established",
            m.reconnects.clone(),
        );
        r.register(
            "keywatch_rules_loaded",
            "Rules in the running rule set",
            m.rules_loaded.clone(),
        );
        r.register(
            "keywatch_reload_failures",
            "Rule reloads that left the old rules in force (invalid rules, or a setting that needs a restart)",
            m.reload_failures.clone(),
        );
        r.register(
            "keywatch_config_last_reload_successful",
            "1 if the last rule reload succeeded",
            m.config_last_reload_successful.clone(),
        );
        r.register(
            "keywatch_config_last_reload_success_timestamp_seconds",
            "When the rules in force were loaded (Unix seconds)",
            m.config_last_reload_success_timestamp.clone(),
        );
        r.register(
            "keywatch_scan_keys",
            "Keys read by the TTL scanner",
            m.scan_keys.clone(),
        );
        r.register(
            "keywatch_scan_seconds",
            "Duration of TTL scanner runs",
            m.scan_seconds.clone(),
        );
        r.register(
            "keywatch_silenced",
            "Events matched but not sent because a silence applied, by rule",
            m.silenced.clone(),
        );
        r.register(
            "keywatch_state_errors",
            "Reads and writes of keywatch's state that Redis refused or did not answer, by operation; what they were about stays in Redis and is tried again",
            m.state_errors.clone(),
        );
        r.register(
            "keywatch_held",
            "Messages held by quiet hours until their window ends, by channel",
            m.held.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The Prometheus text format of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    pub fn event(&self, event: &str, db: u32) {
        self.events_by(event, db, 1);
    }

    /// `n` events of one kind in `db`: a batch counts each kind once, not each event (a storm's
    /// label lookups were a few per cent of its intake).
    pub fn events_by(&self, event: &str, db: u32, n: u64) {
        self.events
            .get_or_create(&l(&[("event", event), ("db", &db.to_string())]))
            .inc_by(n);
    }

    pub fn matched(&self, rule: &str, event: &str) {
        self.matched_by(rule, event, 1);
    }

    /// `n` events of one kind matched by `rule` (see [`Metrics::events_by`]).
    pub fn matched_by(&self, rule: &str, event: &str, n: u64) {
        self.matches
            .get_or_create(&l(&[("rule", rule), ("event", event)]))
            .inc_by(n);
    }

    pub fn action(&self, rule: &str, action: &str, outcome: &str, seconds: f64) {
        self.actions
            .get_or_create(&l(&[
                ("rule", rule),
                ("action", action),
                ("outcome", outcome),
            ]))
            .inc();
        self.action_seconds
            .get_or_create(&l(&[("action", action)]))
            .observe(seconds);
    }

    pub fn subscriber(&self, node: &str, up: bool) {
        self.subscriber_up
            .get_or_create(&l(&[("node", node)]))
            .set(i64::from(up));
    }

    pub fn notify_flags(&self, node: &str, ok: bool) {
        self.notify_flags_ok
            .get_or_create(&l(&[("node", node)]))
            .set(i64::from(ok));
    }

    /// A node no longer watched leaves the gauge, so dashboards do not show it as down.
    pub fn forget_subscriber(&self, node: &str) {
        self.subscriber_up.remove(&l(&[("node", node)]));
        self.notify_flags_ok.remove(&l(&[("node", node)]));
    }

    pub fn recovered_for(&self, rule: &str) {
        self.recovered.get_or_create(&l(&[("rule", rule)])).inc();
    }

    pub fn escalated_for(&self, rule: &str) {
        self.escalations.get_or_create(&l(&[("rule", rule)])).inc();
    }

    pub fn resolved_for(&self, rule: &str) {
        self.resolved.get_or_create(&l(&[("rule", rule)])).inc();
    }

    pub fn recovery_skipped_for(&self, rule: &str) {
        self.recovery_skipped
            .get_or_create(&l(&[("rule", rule)]))
            .inc();
    }

    pub fn state_error(&self, operation: &str) {
        self.state_errors
            .get_or_create(&l(&[("operation", operation)]))
            .inc();
    }

    /// Rules loaded (at start or by a reload) are in force since `unix_s`.
    pub fn reload_succeeded(&self, unix_s: i64) {
        self.config_last_reload_successful.set(1);
        self.config_last_reload_success_timestamp.set(unix_s);
    }

    pub fn silenced_for(&self, rule: &str) {
        self.silenced.get_or_create(&l(&[("rule", rule)])).inc();
    }

    /// `keywatch_held`: what each channel holds now; a channel left out (it holds nothing, and
    /// is not quiet any more) leaves the metric.
    pub fn held_by_channel<'c>(&self, counts: impl IntoIterator<Item = (&'c str, i64)>) {
        self.held.clear();
        for (channel, n) in counts {
            self.held.get_or_create(&l(&[("channel", channel)])).set(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    /// A metric as the registry has it, or as docs/operations.md#metrics lists it.
    #[derive(Debug, PartialEq)]
    struct Family {
        kind: String,
        /// Each label, with its values where they are a fixed set (empty otherwise).
        labels: BTreeMap<String, BTreeSet<String>>,
    }

    /// The values of the labels that take a fixed set of them, from the code that sets them.
    fn fixed_values() -> BTreeMap<&'static str, BTreeSet<String>> {
        use crate::firing::Action;
        use crate::outcome::Outcome;
        let outcomes = [
            Outcome::Sent(String::new()),
            Outcome::Skipped(String::new()),
            Outcome::Again {
                answer: String::new(),
                after: std::time::Duration::ZERO,
            },
            Outcome::Retry {
                reason: String::new(),
                after: None,
            },
            Outcome::Failed(String::new()),
            Outcome::Shadow(String::new()),
        ];
        let c = || "c".to_string();
        let actions = [
            Action::Reload,
            Action::Exec,
            Action::Cleanup,
            Action::Notify { channel: c() },
            Action::Alert {
                channel: c(),
                target: 0,
            },
            Action::Escalate { channel: c() },
            Action::Resolved { channel: c() },
        ];
        BTreeMap::from([
            (
                "outcome",
                outcomes.iter().map(|o| o.label().to_string()).collect(),
            ),
            (
                "action",
                actions.iter().map(|a| a.name().to_string()).collect(),
            ),
            (
                "event",
                crate::event::EventKind::ALL
                    .iter()
                    .map(|k| k.as_str().to_string())
                    .collect(),
            ),
        ])
    }

    /// Every family of the registry, each labelled one given a sample through the methods the
    /// stages call.
    fn registered() -> BTreeMap<String, Family> {
        let m = Metrics::new();
        m.event("expired", 0);
        m.matched("r", "expired");
        m.action("r", "notify", "sent", 0.01);
        m.subscriber("127.0.0.1:6379", true);
        m.notify_flags("127.0.0.1:6379", true);
        m.recovered_for("r");
        m.recovery_skipped_for("r");
        m.escalated_for("r");
        m.resolved_for("r");
        m.silenced_for("r");
        m.state_error("take");
        m.held_by_channel([("team", 14)]);
        let text = m.encode();
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let (name, kind) = rest.split_once(' ').unwrap();
            let shown = match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_string(),
            };
            let mut labels = BTreeMap::new();
            let samples: Vec<&str> = text
                .lines()
                .filter(|l| {
                    l.starts_with(&format!("{shown}{{"))
                        || l.starts_with(&format!("{name}_bucket{{"))
                })
                .collect();
            for sample in &samples {
                let inside = &sample[sample.find('{').unwrap() + 1..sample.find('}').unwrap()];
                for pair in inside.split(',') {
                    let label = pair.split('=').next().unwrap();
                    if label != "le" {
                        labels.insert(label.to_string(), BTreeSet::new());
                    }
                }
            }
            let family = Family {
                kind: kind.to_string(),
                labels,
            };
            out.insert(shown, family);
        }
        let fixed = fixed_values();
        for family in out.values_mut() {
            for (label, values) in &mut family.labels {
                if let Some(v) = fixed.get(label.as_str()) {
                    values.clone_from(v);
                }
            }
        }
        out
    }

    /// docs/operations.md's table of metrics: `` | `name` | type | `label` (`v`, `w`), `other` | … ``.
    fn documented() -> BTreeMap<String, Family> {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"),
        )
        .unwrap();
        let section = &doc[doc.find("\n## Metrics\n").expect("the section")..];
        let rows = section
            .lines()
            .skip_while(|l| !l.starts_with("| metric |"))
            .skip(2)
            .take_while(|l| l.starts_with('|'));
        let mut out = BTreeMap::new();
        for row in rows {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`').to_string();
            let mut labels = BTreeMap::new();
            // `a` (`x`, `y`), `b`: split at the commas outside parentheses.
            let mut depth = 0;
            let mut items = vec![String::new()];
            for ch in cells[3].chars() {
                match ch {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(String::new());
                        continue;
                    }
                    _ => {}
                }
                items.last_mut().unwrap().push(ch);
            }
            for item in items.iter().map(|i| i.trim()).filter(|i| !i.is_empty()) {
                let (label, values) = item.split_once('(').unwrap_or((item, ""));
                let values: BTreeSet<String> = values
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_string)
                    .collect();
                labels.insert(label.trim().trim_matches('`').to_string(), values);
            }
            let family = Family {
                kind: cells[2].to_string(),
                labels,
            };
            assert!(out.insert(name, family).is_none(), "listed twice: {row}");
        }
        out
    }

    #[test]
    fn the_documented_metrics_are_the_registry() {
        let registered = registered();
        let documented = documented();
        let names = |m: &BTreeMap<String, Family>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            names(&documented),
            names(&registered),
            "docs/operations.md#metrics and the registry name different metrics"
        );
        for (name, family) in &registered {
            assert_eq!(
                &documented[name], family,
                "docs/operations.md#metrics on `{name}` (labels with a fixed set of values list them)"
            );
        }
    }

    #[test]
    fn every_spec_metric_is_exported() {
        let m = Metrics::new();
        m.event("expired", 0);
        m.matched("r", "expired");
        m.action("r", "notify", "sent", 0.01);
        m.subscriber("127.0.0.1:6379", true);
        m.recovered_for("r");
        m.held_by_channel([("team", 14)]);
        let text = m.encode();
        for name in [
            "keywatch_events_total{",
            "keywatch_matches_total{",
            "keywatch_actions_total{",
            "keywatch_action_seconds_bucket",
            "keywatch_expiry_lateness_seconds_bucket",
            "keywatch_queue_pending ",
            "keywatch_queue_due ",
            "keywatch_dead_letters_total ",
            "keywatch_ledger_keys ",
            "keywatch_events_waiting ",
            "keywatch_recovered_total{",
            "keywatch_subscriber_up{",
            "keywatch_reconnects_total ",
            "keywatch_rules_loaded ",
            "keywatch_reload_failures_total ",
            "keywatch_config_last_reload_successful ",
            "keywatch_scan_keys_total ",
            "keywatch_scan_seconds_bucket",
            "keywatch_held{channel=\"team\"} 14",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }
}
