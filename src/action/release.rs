//! What a quiet channel sends when its quiet period ends (docs/rules.md#quiet-hours): the
//! notifications it held, as one digest (`digest`), one line of counts (`count`), or each on
//! its own (`each`), with those whose key exists again marked as resolved.
//!
//! Held escalations and resolved notices are not digested or counted: whether they still apply
//! (acknowledged? the key back?) is decided when they run, so they are released as themselves
//! ([`split`]), into the queue, whatever the channel's `release` says.

use std::collections::HashSet;
use std::fmt::Write;

use chrono::{DateTime, Utc};

use crate::channel::{Channel, Item, Message};
use crate::firing::{Action, Job};
use crate::store::held::Held;
use crate::template::Escape;

use super::context::ActionContext;

/// Events listed per rule in a released digest when the rule's `notify.group` does not say
/// (`max_items`): the text stays readable, and every event is still counted.
pub const DIGEST_ITEMS: usize = 20;

/// One quiet period's release through one channel.
#[derive(Clone, Copy)]
pub struct Release<'a> {
    pub channel: &'a Channel,
    /// The name of the channel's window; `None` when a reload removed it (or the channel's
    /// `quiet`), which released what it held.
    pub window: Option<&'a str>,
    /// When the quiet period ended.
    pub until: DateTime<Utc>,
    pub held: &'a Held,
}

/// The held notifications (digested, counted or sent each on its own), and the held follow-ups
/// (always released as themselves), each in the order they were held.
pub fn split(held: &Held) -> (Vec<&Job>, Vec<&Job>) {
    held.jobs.iter().partition(|j| j.action.is_notification())
}

/// The ids of the held jobs whose key (or hash field) exists again in the watched Redis: what
/// a release marks as resolved, besides what was marked while it was held.
pub async fn resolved_now(a: &ActionContext, jobs: &[&Job]) -> Result<HashSet<String>, String> {
    let mut out = HashSet::new();
    // A long key's held firing names its exact key by its hash: asked one at a time, each read
    // again from where it is kept (docs/reliability.md#bounded-whatever-the-key).
    let (long, jobs): (Vec<&Job>, Vec<&Job>) = jobs.iter().partition(|j| j.firing.apart.is_some());
    for j in long {
        let Ok(whole) = a.whole(&j.firing).await else {
            continue;
        };
        let conn =
            a.keyspace.conn(whole.db).await.map_err(|e| {
                format!("cannot reach Redis to see which held keys exist again: {e}")
            })?;
        let cmd = exists_cmd(&whole.key, whole.field.as_deref());
        let found: Vec<i64> = conn
            .each(vec![cmd])
            .await
            .map_err(|e| format!("cannot see which held keys exist again: {e}"))?;
        if found.first().is_some_and(|n| *n > 0) {
            out.insert(j.id());
        }
    }
    let mut by_db: std::collections::BTreeMap<u32, Vec<&Job>> = Default::default();
    for j in jobs {
        by_db.entry(j.firing.db).or_default().push(j);
    }
    for (db, jobs) in by_db {
        let conn =
            a.keyspace.conn(db).await.map_err(|e| {
                format!("cannot reach Redis to see which held keys exist again: {e}")
            })?;
        let cmds = jobs
            .iter()
            .map(|j| exists_cmd(&j.firing.key, j.firing.field.as_deref()))
            .collect();
        let found: Vec<i64> = conn
            .each(cmds)
            .await
            .map_err(|e| format!("cannot see which held keys exist again: {e}"))?;
        out.extend(
            jobs.iter()
                .zip(found)
                .filter(|(_, n)| *n > 0)
                .map(|(j, _)| j.id()),
        );
    }
    Ok(out)
}

/// Whether `key` (or its hash `field`) exists.
fn exists_cmd(key: &[u8], field: Option<&[u8]>) -> redis::Cmd {
    match field {
        Some(field) => {
            let mut c = redis::cmd("HEXISTS");
            c.arg(key).arg(field);
            c
        }
        None => {
            let mut c = redis::cmd("EXISTS");
            c.arg(key);
            c
        }
    }
}

/// `1 message`, `14 messages`.
fn messages(n: usize) -> String {
    if n == 1 {
        "1 message".to_string()
    } else {
        format!("{n} messages")
    }
}

/// The notifications of `jobs` by rule, in the order each rule's first one was held.
fn by_rule<'j>(jobs: &[&'j Job]) -> Vec<(&'j str, Vec<&'j Job>)> {
    let mut out: Vec<(&str, Vec<&Job>)> = Vec::new();
    for j in jobs {
        match out.iter_mut().find(|(r, _)| *r == j.firing.rule) {
            Some((_, list)) => list.push(j),
            None => out.push((&j.firing.rule, vec![j])),
        }
    }
    out
}

impl Release<'_> {
    fn escape(&self) -> Escape {
        self.channel.escape()
    }

    /// A name (a rule's, a window's) as this channel's messages write a value.
    fn name(&self, s: &str) -> String {
        self.escape().escape_value(s)
    }

    fn resolved(&self, j: &Job) -> bool {
        self.held.resolved.contains(&j.id())
    }

    /// `quiet hours "night" until 08:00 CST` (`quiet hours until 08:00 CST` without a window).
    fn period(&self, a: &ActionContext) -> String {
        let until = self
            .until
            .with_timezone(&a.config.timezone)
            .format("%H:%M %Z");
        match self.window {
            Some(w) => format!("quiet hours \"{}\" until {until}", self.name(w)),
            None => format!("quiet hours until {until}"),
        }
    }

    /// `14 messages held by quiet hours "night" until 08:00 CST`.
    fn headline(&self, a: &ActionContext, n: usize) -> String {
        format!("{} held by {}", messages(n), self.period(a))
    }

    fn title(&self, n: usize) -> String {
        format!("keywatch: {} held by quiet hours", messages(n))
    }

    /// `order-lock-timeout: 10 (2 resolved)`, or `order-lock-timeout 10 (2 resolved)` with
    /// `sep` a space.
    fn rule_count(&self, rule: &str, jobs: &[&Job], sep: &str) -> String {
        let resolved = jobs.iter().filter(|j| self.resolved(j)).count();
        let mut s = format!("{}{sep}{}", self.name(rule), jobs.len());
        if resolved > 0 {
            let _ = write!(s, " ({resolved} resolved)");
        }
        s
    }

    /// The message of `release: digest` for the held `notifications` (see [`split`]): a
    /// headline, then per rule its count and its events' messages (those whose key exists
    /// again marked `(resolved)`), up to the rule's `group.max_items` ([`DIGEST_ITEMS`] without
    /// one), then how many more. A rule whose messages cannot be composed (a reload removed it,
    /// or its template fails now) lists its keys instead: nothing held goes unmentioned.
    pub fn digest(&self, a: &ActionContext, notifications: &[&Job]) -> Message {
        let ch = self.channel;
        let escape = self.escape();
        let total = notifications.len();
        let resolved = notifications.iter().filter(|j| self.resolved(j)).count();
        let mut text = self.headline(a, total);
        if resolved > 0 {
            let _ = write!(text, ", {resolved} resolved since");
        }
        text.push(':');
        let mut items = Vec::new();
        let mut mention = crate::channel::chat::Mention::default();
        let mut channel_fields = None;
        let mut rules: Vec<&str> = Vec::new();
        let mut kinds: Vec<&str> = Vec::new();
        for (rule_name, jobs) in by_rule(notifications) {
            rules.push(rule_name);
            for j in &jobs {
                if !kinds.contains(&j.firing.kind.as_str()) {
                    kinds.push(j.firing.kind.as_str());
                }
            }
            let _ = write!(text, "\n{}", self.rule_count(rule_name, &jobs, ": "));
            let rule = a.config.rule(rule_name);
            let max = rule
                .and_then(|r| r.notify.as_ref())
                .and_then(|n| n.group)
                .map_or(DIGEST_ITEMS, |g| g.max_items);
            let firings: Vec<std::sync::Arc<crate::firing::Firing>> =
                jobs.iter().map(|j| j.firing.clone()).collect();
            let composed = match rule {
                Some(rule) => super::notify::compose_digest(a, &firings, rule, ch, max),
                None => Err(format!("rule `{rule_name}` is no longer in the rules")),
            };
            let resolved_ids: HashSet<&str> = jobs
                .iter()
                .filter(|j| self.resolved(j))
                .map(|j| j.firing.id.as_str())
                .collect();
            let listed = match composed {
                Ok(m) => {
                    mention = mention.merged(&m.mention);
                    channel_fields.get_or_insert(m.channel_fields);
                    for item in &m.items {
                        let mark = match item.event["id"].as_str() {
                            Some(id) if resolved_ids.contains(id) => "(resolved) ",
                            _ => "",
                        };
                        let _ = write!(text, "\n- {mark}{}", item.text);
                    }
                    m.items
                }
                Err(why) => {
                    tracing::warn!(rule = rule_name, channel = %ch.name, error = %why, "A held rule's messages cannot be composed; its keys are listed instead.");
                    let mut fallback = firings.clone();
                    fallback.sort_by_key(|f| f.observed_at);
                    fallback
                        .iter()
                        .take(max)
                        .map(|f| {
                            let mark = if resolved_ids.contains(f.id.as_str()) {
                                "(resolved) "
                            } else {
                                ""
                            };
                            let line = format!(
                                "{} {}",
                                escape.escape_value(&String::from_utf8_lossy(&f.key)),
                                f.kind.as_str()
                            );
                            let _ = write!(text, "\n- {mark}{line}");
                            Item {
                                event: f.to_json(),
                                text: line,
                            }
                        })
                        .collect()
                }
            };
            let more = jobs.len().saturating_sub(listed.len());
            if more > 0 {
                let _ = write!(text, "\n… and {more} more");
            }
            items.extend(listed);
        }
        let first = notifications.first().map_or("", |j| j.firing.id.as_str());
        Message {
            rule: rules.join(","),
            event: kinds.join(","),
            title: self.title(total),
            text: escape.finish(text),
            items,
            count: total,
            digest: true,
            idempotency_key: self.key(first, total),
            custom_body: None,
            mention,
            links: Vec::new(),
            channel_fields: channel_fields.unwrap_or_default(),
            followup: None,
        }
    }

    /// The message of `release: count`: one line, how many were held by rule (every one of
    /// them is in history).
    pub fn count(&self, a: &ActionContext, notifications: &[&Job]) -> Message {
        let total = notifications.len();
        let groups = by_rule(notifications);
        let counts: Vec<String> = groups
            .iter()
            .map(|(rule, jobs)| self.rule_count(rule, jobs, " "))
            .collect();
        let text = format!("{}: {}.", self.headline(a, total), counts.join(", "));
        let mut kinds: Vec<&str> = notifications
            .iter()
            .map(|j| j.firing.kind.as_str())
            .collect();
        kinds.dedup();
        let first = notifications.first().map_or("", |j| j.firing.id.as_str());
        Message {
            rule: groups.iter().map(|(r, _)| *r).collect::<Vec<_>>().join(","),
            event: kinds.join(","),
            title: self.title(total),
            text: self.escape().finish(text),
            items: Vec::new(),
            count: total,
            digest: true,
            idempotency_key: self.key(first, total),
            custom_body: None,
            mention: Default::default(),
            links: Vec::new(),
            channel_fields: Vec::new(),
            followup: None,
        }
    }

    /// The message of one held notification under `release: each`: the rule's own message,
    /// with a last line saying it was held, and whether its key exists again.
    pub fn each(&self, a: &ActionContext, job: &Job) -> Result<Message, String> {
        if !matches!(job.action, Action::Notify { .. }) {
            return Err(format!(
                "a held `{}` is released as itself",
                job.action.name()
            ));
        }
        let rule = a
            .config
            .rule(&job.firing.rule)
            .ok_or_else(|| format!("rule `{}` is no longer in the rules", job.firing.rule))?;
        let mut msg = super::notify::compose(a, &job.firing, rule, self.channel)?;
        let mut note = format!("(held by {}", self.period(a));
        if self.resolved(job) {
            note.push_str("; resolved since: the key exists again");
        }
        note.push(')');
        let note = self.escape().finish(note);
        msg.text = format!("{}\n{note}", msg.text);
        if let [item] = &mut msg.items[..] {
            item.text.clone_from(&msg.text);
        }
        Ok(msg)
    }

    /// Sends one held notification released as itself (`release: each`): the message of
    /// [`Release::each`], under the rules in force now.
    pub async fn send_released(
        a: &ActionContext,
        job: &Job,
        released: &crate::firing::Released,
    ) -> crate::outcome::Outcome {
        use crate::outcome::Outcome;
        let a = a.refreshed();
        let Action::Notify { channel } = &job.action else {
            return a.run(&job.firing, &job.action).await;
        };
        let Some(ch) = a.config.channel(channel) else {
            return Outcome::Failed(format!("channel `{channel}` is no longer defined"));
        };
        // A released message is a stored job as any: what the rules say for its key, or
        // nothing (docs/reliability.md#keywatchs-state-is-not-a-way-in).
        match a.config.rule(&job.firing.rule) {
            None => return Outcome::Failed(format!("rule `{}` no longer exists", job.firing.rule)),
            Some(rule) => {
                if let Some(why) = super::refused(rule, &job.firing) {
                    return Outcome::Failed(format!("refused: {why}"));
                }
            }
        }
        let held = Held {
            resolved: if released.resolved {
                HashSet::from([job.id()])
            } else {
                HashSet::new()
            },
            ..Held::default()
        };
        let release = Release {
            channel: ch,
            window: released.window.as_deref(),
            until: DateTime::from_timestamp_millis(released.until).unwrap_or_default(),
            held: &held,
        };
        match release.each(&a, job) {
            Ok(message) => crate::channel::send(&a.http, ch, &message).await,
            Err(e) => Outcome::Failed(e),
        }
    }

    /// The `Idempotency-Key` of a released digest or count: the same release (retried, or
    /// taken over by another instance) gives the same key.
    fn key(&self, first_id: &str, count: usize) -> String {
        format!(
            "{first_id}:quiet:{}:{}:{count}",
            self.channel.name,
            self.until.timestamp_millis()
        )
    }
}

crate::keyspace::commands::declare! {
    /// The commands a release sends to see which held keys exist again
    /// ([`crate::keyspace::commands`]).
    const WHY = "quiet hours: held keys that exist again";
    [
        Use::new(Server::Watched, "exists", WHY)
            .on(Keys::Watched, Access::Read)
            .args("{key}"),
        Use::new(Server::Watched, "hexists", WHY)
            .on(Keys::Watched, Access::Read)
            .args("{key} f"),
    ]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::event::{EventKind, KeyEvent};
    use crate::firing::Firing;

    const RULES: &str = r#"
timezone: Asia/Shanghai
quiet_hours:
  night: [{ days: [mon, tue, wed, thu, fri], from: "22:00", to: "08:00" }]
channels:
  team: { type: slack, url: "https://hooks.slack.com/services/T000/B000/XXXX", quiet: { during: night } }
  robot: { type: dingtalk, url: "https://oapi.dingtalk.com/robot/send?access_token=x", quiet: { during: night, release: count } }
rules:
  - name: order_lock
    match: "order_lock:{id}"
    notify: { to: [team, robot], message: "Lock of order {{ id }} expired <now>.", group: { window: 1m, max_items: 2 } }
  - name: cache
    match: "cache:{id}"
    notify: { to: [team], message: "Cache {{ id }} expired at {{ deadline | datetime('%H:%M') }}." }
"#;

    fn context() -> ActionContext {
        let config = crate::config::of_yaml(RULES, crate::config::Mode::Check);
        let keyspace = crate::keyspace::Keyspace::new(
            crate::yaml::Secret::new("redis://127.0.0.1:1"),
            config.redis.clone(),
        )
        .unwrap();
        ActionContext::new(
            crate::config::LiveConfig::fixed(config),
            crate::channel::http::client(),
            keyspace,
        )
    }

    /// A held notification of `rule` for key `prefix:id`, observed at minute `minute` past
    /// 23:00 Shanghai, its deadline a second before.
    fn held(rule: &str, prefix: &str, id: &str, minute: u32, channel: &str) -> Job {
        let observed: DateTime<Utc> = format!("2026-12-07T15:{minute:02}:00Z").parse().unwrap();
        let event = KeyEvent {
            kind: EventKind::Expired,
            db: 0,
            key: bytes::Bytes::from(format!("{prefix}:{id}").into_bytes()),
            field: None,
            observed_at: observed,
            deadline: Some(observed - chrono::Duration::seconds(1)),
            ttl_ms: None,
            recovered: false,
            source: "127.0.0.1:6379".into(),
            place: None,
        };
        let firing = Firing::new(
            rule,
            &event,
            &["id".into()],
            vec![id.as_bytes().to_vec().into()],
            None,
        );
        Job::first(
            Arc::new(firing),
            Action::Notify {
                channel: channel.into(),
            },
        )
    }

    fn night(channel: &str) -> Held {
        let jobs = vec![
            held("order_lock", "order_lock", "1", 1, channel),
            held("cache", "cache", "a", 2, channel),
            held("order_lock", "order_lock", "2", 3, channel),
            held("order_lock", "order_lock", "3", 4, channel),
            held("cache", "cache", "b", 5, channel),
            held("gone", "old", "<!channel>", 6, channel),
        ];
        let resolved = HashSet::from([jobs[2].id()]);
        Held {
            jobs,
            unreadable: Vec::new(),
            resolved,
        }
    }

    fn release<'a>(a: &'a ActionContext, channel: &str, held: &'a Held) -> Release<'a> {
        Release {
            channel: a.config.channel(channel).unwrap(),
            window: Some("night"),
            until: "2026-12-08T00:00:00Z".parse().unwrap(),
            held,
        }
    }

    /// One message listing everything held, by rule, in the order held, resolved ones marked,
    /// each rule cut at its `max_items`; a rule a reload removed still shows its keys.
    #[test]
    fn a_digest_lists_everything_held_by_rule() {
        let a = context();
        let held = night("team");
        let r = release(&a, "team", &held);
        let (notifications, followups) = split(&held);
        assert!(followups.is_empty());
        let m = r.digest(&a, &notifications);
        assert_eq!(m.title, "keywatch: 6 messages held by quiet hours");
        assert_eq!(
            m.text,
            "6 messages held by quiet hours \"night\" until 08:00 CST, 1 resolved since:\n\
             order_lock: 3 (1 resolved)\n\
             - Lock of order 1 expired <now>.\n\
             - (resolved) Lock of order 2 expired <now>.\n\
             … and 1 more\n\
             cache: 2\n\
             - Cache a expired at 23:01.\n\
             - Cache b expired at 23:04.\n\
             gone: 1\n\
             - old:&lt;!channel&gt; expired"
        );
        assert_eq!((m.count, m.items.len(), m.omitted()), (6, 5, 1));
        assert_eq!(m.rule, "order_lock,cache,gone");
        assert_eq!(m.event, "expired");
        assert!(m.digest);
        // The same release, composed again (retried, or by another instance): the same key.
        assert_eq!(
            r.digest(&a, &notifications).idempotency_key,
            m.idempotency_key
        );
        assert_eq!(
            m.idempotency_key,
            format!("{}:quiet:team:1796688000000:6", held.jobs[0].firing.id)
        );
    }

    #[test]
    fn a_count_is_one_line_by_rule() {
        let a = context();
        let held = night("robot");
        let r = release(&a, "robot", &held);
        let m = r.count(&a, &split(&held).0);
        // DingTalk's Markdown: a rule's `_` is escaped as any value's.
        assert_eq!(
            m.text,
            "6 messages held by quiet hours \"night\" until 08:00 CST: order\\_lock 3 (1 resolved), cache 2, gone 1."
        );
        assert_eq!((m.count, m.items.len()), (6, 0));
    }

    #[test]
    fn each_held_message_says_it_was_held() {
        let a = context();
        let held = night("team");
        let r = release(&a, "team", &held);
        let m = r.each(&a, &held.jobs[2]).unwrap();
        assert_eq!(
            m.text,
            "Lock of order 2 expired <now>.\n(held by quiet hours \"night\" until 08:00 CST; resolved since: the key exists again)"
        );
        assert_eq!(m.items[0].text, m.text);
        assert_eq!(m.idempotency_key, held.jobs[2].id(), "the job's own key");
        let m = r.each(&a, &held.jobs[1]).unwrap();
        assert_eq!(
            m.text,
            "Cache a expired at 23:01.\n(held by quiet hours \"night\" until 08:00 CST)"
        );
        assert!(r.each(&a, &held.jobs[5]).is_err(), "its rule is gone");
        // A window a reload removed released what it held: its name is gone with it.
        let r = Release { window: None, ..r };
        assert_eq!(
            r.each(&a, &held.jobs[1]).unwrap().text,
            "Cache a expired at 23:01.\n(held by quiet hours until 08:00 CST)"
        );
    }

    /// What exists again in the watched Redis is resolved, the rest is not.
    #[tokio::test]
    async fn keys_that_exist_again_are_resolved() {
        let (server, conn) = crate::local_redis::throwaway().await;
        redis::cmd("SET")
            .arg("order_lock:2")
            .arg("again")
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        let config = crate::config::of_yaml(RULES, crate::config::Mode::Check);
        let keyspace = crate::keyspace::Keyspace::new(
            crate::yaml::Secret::new(server.url()),
            config.redis.clone(),
        )
        .unwrap();
        let a = ActionContext::new(
            crate::config::LiveConfig::fixed(config),
            crate::channel::http::client(),
            keyspace,
        );
        let held = night("team");
        let jobs: Vec<&Job> = held.jobs.iter().collect();
        let resolved = resolved_now(&a, &jobs).await.unwrap();
        assert_eq!(resolved, HashSet::from([held.jobs[2].id()]));
    }

    /// Held escalations and resolved notices are released as themselves.
    #[test]
    fn follow_ups_are_not_digested() {
        let mut held = night("team");
        let mut escalation = held.jobs[0].clone();
        escalation.action = Action::Escalate {
            channel: "team".into(),
        };
        held.jobs.push(escalation);
        let (notifications, followups) = split(&held);
        assert_eq!((notifications.len(), followups.len()), (6, 1));
    }
}
