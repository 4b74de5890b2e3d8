//! One rule's templates, compiled against what they may read and reported at their fields: its
//! detail, reload, exec, cleanup, notifications and follow-ups (the second pass,
//! [`super::build`]).

use crate::event::EventKind;
use crate::template::{CONTEXT_NAMES, Context, Escape, TemplateId, TemplateSet};

use crate::channel::{Channel, check_http_url};
use crate::config::model::*;
use crate::config::rules::{
    CleanupDraft, DetailDraft, ExecDraft, MentionDraft, NotifyDraft, ReloadDraft,
};
use crate::yaml::decode::{Decoder, Text};
use crate::yaml::diagnostic::did_you_mean;

/// The default message of docs/rules.md, with the TTL and the deadline (in `timezone`) for
/// `expiring`. An expiry found after keywatch was down cannot be told from a delete made
/// meanwhile (docs/rules.md#recover-expiries-found-afterwards): the message says so instead of
/// claiming an expiry.
pub const DEFAULT_MESSAGE: &str = "{{ rule }}: {{ key }} {% if recovered %}found gone after keywatch was down: {{ event }}, or deleted while nobody listened{% else %}{{ event }}{% endif %}{% if ttl %} (expires in {{ ttl }}{% if deadline %}, at {{ deadline | datetime }}{% endif %}){% endif %}";

pub const DEFAULT_TITLE: &str = "keywatch: {{ rule }}";

/// What a rule's templates may read, and what `check` renders them against.
#[derive(Clone, Copy)]
pub(super) struct TemplateCheck<'a> {
    /// An `escalate` or `resolved` message: `gap` and `gap_ms` are defined.
    pub(super) followup: bool,
    pub(super) rule: &'a str,
    pub(super) captures: &'a [String],
    pub(super) kinds: &'a [EventKind],
    /// Rendered for digests too (`count` and `events` defined).
    pub(super) digest: bool,
    pub(super) pattern: &'a str,
    /// The rule reads a `detail`, so templates may use it.
    pub(super) has_detail: bool,
    /// The rule sends digests (`notify.group`).
    pub(super) has_group: bool,
}

/// The events `escalate` and `resolved` follow: the key is gone, so it can come back.
pub(super) const FOLLOWED: &[EventKind] =
    &[EventKind::Expired, EventKind::Evicted, EventKind::Hexpired];

/// Compiles one template, checks the names it reads, and renders it once per event kind of the
/// rule against sample values, strictly: what would fail at run time fails here.
pub(super) fn compile(
    d: &mut Decoder<'_>,
    templates: &mut TemplateSet,
    text: &Text,
    escape: Escape,
    what: &str,
    check: &TemplateCheck<'_>,
) -> Option<TemplateId> {
    let id = match templates.add(&text.value, escape) {
        Ok(id) => id,
        Err(e) => {
            let mut loc = text.loc.clone();
            if let Some(line) = e.line.filter(|l| *l > 1) {
                loc.line += line - 1;
            }
            d.error(&loc, format!("{what}: invalid template: {}", e.message));
            return None;
        }
    };
    let mut ok = true;
    for var in templates.variables(id) {
        if (var == "count" || var == "events") && !check.digest {
            ok = false;
            let hint = if check.has_group {
                "it is set in `notify.title` of digests, not in per-event messages"
            } else {
                "it is set only in digest titles: add `notify.group` and use it in `notify.title`"
            };
            d.error(&text.loc, format!("{what} uses `{var}`, but {hint}"));
            continue;
        }
        if (var == "gap" || var == "gap_ms") && !check.followup {
            ok = false;
            d.error(
                &text.loc,
                format!(
                    "{what} uses `{var}`, but it is set only in `escalate` and `resolved` messages"
                ),
            );
            continue;
        }
        if var == "detail" && !check.has_detail {
            ok = false;
            d.error(&text.loc, format!("{what} uses `detail`, but the rule has no `detail` step to read it (add e.g. `detail: {{ hash: \"...\", field: \"{{{{ id }}}}\" }}`)"));
            continue;
        }
        if CONTEXT_NAMES.contains(&var.as_str()) || check.captures.contains(&var) {
            continue;
        }
        ok = false;
        let mut known: Vec<&str> = CONTEXT_NAMES.to_vec();
        known.extend(check.captures.iter().map(String::as_str));
        let why = if check.pattern.is_empty() {
            "it is not a context name".to_string()
        } else {
            format!(
                "the pattern `{}` does not capture it and it is not a context name",
                check.pattern
            )
        };
        d.error(
            &text.loc,
            format!(
                "{what} uses `{var}`, but {why}{}",
                did_you_mean(&var, known)
            ),
        );
    }
    if !ok {
        return None;
    }
    for &kind in check.kinds {
        let mut ctx = Context::sample(check.rule, kind, check.captures);
        if check.digest {
            ctx = ctx.with_digest(2, Vec::new());
        }
        if check.followup {
            ctx = ctx.with_gap(900_000);
        }
        if let Err(e) = templates.render(id, &ctx) {
            d.error(
                &text.loc,
                format!("{what} fails to render for `{kind}` events: {}", e.message),
            );
            return None;
        }
    }
    Some(id)
}

fn channel_list(channels: &[Channel]) -> String {
    if channels.is_empty() {
        return "none".into();
    }
    channels
        .iter()
        .map(|c| format!("`{}`", c.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The user info of a URL (template) `u`: `user:pw` of `https://user:pw@host/…`.
fn user_info(u: &str) -> Option<&str> {
    let rest = &u[u.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    Some(&authority[..authority.rfind('@')?])
}

/// Compiles one rule's templates against what they may read, each reported at its field.
pub(super) struct RuleTemplates<'a, 'd, 'c> {
    pub(super) d: &'a mut Decoder<'d>,
    pub(super) templates: &'a mut TemplateSet,
    /// `rule \`NAME\``, for messages.
    pub(super) what: String,
    /// keywatch's own keys: a `detail` it removes may not be one of them.
    pub(super) state_prefix: &'c str,
    pub(super) check: TemplateCheck<'c>,
}

impl RuleTemplates<'_, '_, '_> {
    fn compile(&mut self, text: &Text, escape: Escape, field: &str) -> Option<TemplateId> {
        self.compile_as(text, escape, field, self.check)
    }

    fn compile_as(
        &mut self,
        text: &Text,
        escape: Escape,
        field: &str,
        check: TemplateCheck<'_>,
    ) -> Option<TemplateId> {
        let what = format!("{} `{field}`", self.what);
        compile(self.d, self.templates, text, escape, &what, &check)
    }

    pub(super) fn detail(&mut self, dd: &DetailDraft) -> Option<DetailStep> {
        let removed = match (&dd.hash, &dd.key) {
            (Some(k), _) | (None, Some(k)) if dd.remove => Some(k),
            _ => None,
        };
        // Templates whose literal start is under the prefix always remove keywatch's own keys;
        // the others are guarded at run time, where the rendered key is known.
        if let Some(k) = removed
            && k.value
                .split('{')
                .next()
                .unwrap_or("")
                .starts_with(self.state_prefix)
        {
            let field = if dd.hash.is_some() {
                "detail.hash"
            } else {
                "detail.key"
            };
            self.d.error(
                &k.loc,
                format!(
                    "{} `{field}`: `remove: true` would delete `{}`, under `state.prefix` (`{}`): keywatch never deletes its own keys (cleanup refuses them too); keep the detail elsewhere or drop `remove`",
                    self.what, k.value, self.state_prefix
                ),
            );
            return None;
        }
        let source = match (&dd.hash, &dd.field, &dd.key) {
            (Some(h), Some(f), None) => {
                let key = self.compile(h, Escape::RedisKey, "detail.hash");
                let field = self.compile(f, Escape::RedisKey, "detail.field");
                DetailSource::Hash {
                    key: key?,
                    field: field?,
                }
            }
            (None, None, Some(k)) => DetailSource::Key {
                key: self.compile(k, Escape::RedisKey, "detail.key")?,
            },
            _ => return None,
        };
        Some(DetailStep {
            source,
            remove: dd.remove,
        })
    }

    /// A `.` or `..` segment in the reload URL's own text: such a URL is never sent as written
    /// (docs/rules.md#reload), so it is an error here, not a failure per
    /// event. Samples of captures hold no dots, so one found here is the author's.
    fn dot_segment_in_url(&mut self, rendered: &[u8], loc: &crate::yaml::diagnostic::Loc) -> bool {
        let url = String::from_utf8_lossy(rendered);
        let Some(segment) = crate::channel::http::dot_segment(&url) else {
            return false;
        };
        self.d.error(
            loc,
            format!(
                "{} `reload.url` has the path segment `{segment}`; write the path it stands for (URLs resolve `.` and `..`, and keywatch never sends a reload whose path holds one)",
                self.what
            ),
        );
        true
    }

    pub(super) fn reload(&mut self, rd: &ReloadDraft) -> Option<ReloadStep> {
        let url = self.compile(&rd.url, Escape::Url, "reload.url");
        // Its user info travels as `Authorization: Basic`: masked in that spelling too.
        if let Some(info) = user_info(&rd.url.value) {
            self.d.note_secret(&format!("http://{info}@host/"));
        }
        // `on` is empty when every event listed was unknown (already an error): no sample then.
        if let Some(id) = url
            && let Some(&kind) = self.check.kinds.first()
            && !rd.url.unresolved
        {
            let sample = Context::sample(self.check.rule, kind, self.check.captures);
            if let Ok(bytes) = self.templates.render(id, &sample)
                && !self.dot_segment_in_url(&bytes, &rd.url.loc)
            {
                check_http_url(
                    self.d,
                    &String::from_utf8_lossy(&bytes),
                    &rd.url.loc,
                    &format!("{} `reload.url`", self.what),
                    "https://example.com/reload",
                );
            }
        }
        let headers: Vec<(String, TemplateId)> = rd
            .headers
            .iter()
            .filter_map(|(k, v)| {
                self.compile(v, Escape::Raw, &format!("reload.headers.{}", k.value))
                    .map(|id| (k.value.clone(), id))
            })
            .collect();
        let body = match &rd.body {
            Some(b) => Some(self.compile(b, Escape::Raw, "reload.body")?),
            None => None,
        };
        Some(ReloadStep {
            url: url?,
            method: rd.method.value.clone(),
            headers,
            body,
            timeout: rd.timeout,
            concurrency: rd.concurrency,
        })
    }

    pub(super) fn exec(&mut self, ed: &ExecDraft) -> Option<ExecStep> {
        let command: Vec<Option<TemplateId>> = ed
            .command
            .iter()
            .map(|a| self.compile(a, Escape::RedisKey, "exec.command"))
            .collect();
        let env: Vec<Option<(String, TemplateId)>> = ed
            .env
            .iter()
            .map(|(k, v)| {
                self.compile(v, Escape::RedisKey, &format!("exec.env.{}", k.value))
                    .map(|id| (k.value.clone(), id))
            })
            .collect();
        Some(ExecStep {
            command: command.into_iter().collect::<Option<Vec<_>>>()?,
            env: env.into_iter().collect::<Option<Vec<_>>>()?,
            value_led: ed
                .command
                .iter()
                .map(|a| a.value.starts_with("{{") || a.value.starts_with("{%"))
                .collect(),
            timeout: ed.timeout,
            concurrency: ed.concurrency,
        })
    }

    pub(super) fn cleanup(&mut self, cd: &CleanupDraft) -> Option<CleanupStep> {
        let delete: Vec<Option<TemplateId>> = cd
            .delete
            .iter()
            .map(|p| self.compile(p, Escape::Glob, "cleanup.delete"))
            .collect();
        let hdel: Vec<Option<HdelTarget>> = cd
            .hdel
            .iter()
            .map(|(k, f)| {
                let key = self.compile(k, Escape::RedisKey, "cleanup.hdel.key");
                let field = self.compile(f, Escape::RedisKey, "cleanup.hdel.field");
                Some(HdelTarget {
                    key: key?,
                    field: field?,
                })
            })
            .collect();
        Some(CleanupStep {
            delete: delete.into_iter().collect::<Option<Vec<_>>>()?,
            hdel: hdel.into_iter().collect::<Option<Vec<_>>>()?,
        })
    }

    /// The channels must exist; title and message are compiled once per escaping those
    /// channels need.
    pub(super) fn notify(
        &mut self,
        nd: &NotifyDraft,
        channels: &[Channel],
        channel_names: &[String],
    ) -> Option<NotifyStep> {
        let what = self.what.clone();
        let mut escapes: Vec<Escape> = Vec::new();
        let mut to = Vec::new();
        for name in &nd.to {
            match channels.iter().find(|c| c.name == name.value) {
                Some(c) => {
                    if nd.group.is_some() && !c.integration.takes_digests() {
                        self.d.error(
                            &name.loc,
                            format!(
                                "{what} `notify.to`: channel `{}` ({}) takes no digests: each event is its own alert there; drop `notify.group` or send the digest to another channel",
                                c.name, c.kind.name
                            ),
                        );
                    }
                    if !escapes.contains(&c.escape()) {
                        escapes.push(c.escape());
                    }
                    to.push(name.value.clone());
                }
                // Defined, but its definition had errors (already reported).
                None if channel_names.contains(&name.value) => {}
                None => self.d.error(
                    &name.loc,
                    format!(
                        "{what} `notify.to`: unknown channel `{}`{}",
                        name.value,
                        match did_you_mean(&name.value, channels.iter().map(|c| c.name.as_str())) {
                            s if s.is_empty() => format!(
                                "; define it under `channels` (known: {})",
                                channel_list(channels)
                            ),
                            s => s,
                        }
                    ),
                ),
            }
        }
        if nd.to.is_empty() {
            self.d
                .error(&nd.loc, format!("{what} `notify.to` names no channel"));
        }
        let default_message = Text {
            value: DEFAULT_MESSAGE.into(),
            loc: nd.loc.clone(),
            unresolved: false,
            quoted: false,
        };
        let default_title = Text {
            value: DEFAULT_TITLE.into(),
            ..default_message.clone()
        };
        let message_src = nd.message.as_ref().unwrap_or(&default_message);
        let title_src = nd.title.as_ref().unwrap_or(&default_title);
        // With `group` every message is a digest, so the title is rendered for digests only.
        let title_check = TemplateCheck {
            digest: nd.group.is_some(),
            ..self.check
        };
        let mut message = Vec::new();
        let mut title = Vec::new();
        for &e in &escapes {
            message.push((e, self.compile(message_src, e, "notify.message")?));
            title.push((
                e,
                self.compile_as(title_src, e, "notify.title", title_check)?,
            ));
        }
        let mention = match &nd.mention {
            Some(md) => self.mention(md, channels, &to)?,
            None => RuleMention::default(),
        };
        let alerts: Vec<(String, u32)> = to
            .iter()
            .filter_map(|name| channels.iter().find(|c| c.name == *name))
            .filter_map(|c| {
                let am = c.integration.alertmanager()?;
                Some((
                    c.name.clone(),
                    u32::try_from(am.urls.len()).unwrap_or(u32::MAX),
                ))
            })
            .collect();
        if let (Some(loc), Some((am, _))) = (&nd.group_loc, alerts.first()) {
            self.d.error(
                loc,
                format!(
                    "{what} `notify.group`: channel `{am}` is an alertmanager channel, and Alertmanager groups alerts itself (its route's `group_by`, `group_wait`, `group_interval`): remove `group`, or send digests to another channel in a rule of their own"
                ),
            );
        }
        let (labels, annotations) = self.alert_fields(nd, &alerts)?;
        Some(NotifyStep {
            to,
            title: PerEscape(title),
            message: PerEscape(message),
            group: nd.group,
            mention,
            labels,
            annotations,
            alerts,
        })
    }
}

impl RuleTemplates<'_, '_, '_> {
    /// `notify.labels` and `notify.annotations`: names every Alertmanager accepts, values
    /// templates rendered as text. Without an alertmanager channel in `to` they do nothing,
    /// which is worth a warning.
    #[allow(clippy::type_complexity)]
    fn alert_fields(
        &mut self,
        nd: &NotifyDraft,
        alerts: &[(String, u32)],
    ) -> Option<(Vec<(String, TemplateId)>, Vec<(String, TemplateId)>)> {
        let mut out = (Vec::new(), Vec::new());
        let mut ok = true;
        for (field, pairs, labels) in [
            ("labels", &nd.labels, true),
            ("annotations", &nd.annotations, false),
        ] {
            let what = format!("{} `notify.{field}`", self.what);
            if !pairs.is_empty() && alerts.is_empty() {
                let w = format!(
                    "{what} has no effect: they are for alertmanager channels, and `notify.to` names none"
                );
                self.d.warning(&pairs[0].0.loc, w);
            }
            ok &= crate::channel::alert::check_names(self.d, pairs, &what, labels);
            // Labels are matched by silences and routes, so they are the exact text; annotations
            // reach people through Alertmanager's receivers, so they are chat text
            // (docs/rules.md#alertmanager).
            let escape = if labels { Escape::Raw } else { Escape::Text };
            for (k, v) in pairs {
                match self.compile(v, escape, &format!("notify.{field}.{}", k.value)) {
                    Some(id) if labels => out.0.push((k.value.clone(), id)),
                    Some(id) => out.1.push((k.value.clone(), id)),
                    None => ok = false,
                }
            }
        }
        ok.then_some(out)
    }

    /// `escalate` or `resolved`: channels and templates as for `notify`, with `gap` defined;
    /// only after an alert of a key (or hash field) that is gone (`expired`, `evicted`,
    /// `hexpired`). `also`: channels of `notify.to` that keep alerts open
    /// ([`crate::channel::Integration::closes_on_resolved`]), which a `resolved` reaches
    /// whether or not its `to` lists them.
    pub(super) fn followup(
        &mut self,
        fd: &crate::config::followups::FollowupDraft,
        channels: &[Channel],
        channel_names: &[String],
        on: &[EventKind],
        name: &str,
        also: &[String],
    ) -> Option<FollowupStep> {
        if !on.iter().any(|k| FOLLOWED.contains(k)) {
            let w = format!(
                "{} `{name}` follows alerts of keys that are gone: add `expired`, `evicted` or `hexpired` to `on`",
                self.what
            );
            self.d.error(&fd.loc, w);
            return None;
        }
        let default_message = match name {
            "escalate" => "{{ rule }}: {{ key }} is still {{ event }} after {{ gap }} (escalation)",
            _ => "{{ rule }}: {{ key }} exists again after {{ gap }}",
        };
        if name == "escalate" {
            for t in &fd.to {
                if let Some(c) = channels.iter().find(|c| c.name == t.value)
                    && c.integration.alertmanager().is_some()
                {
                    let w = format!(
                        "{} `escalate.to`: channel `{}` is an alertmanager channel, where the alert already is: escalate with Alertmanager's own routes (e.g. a route with a longer `repeat_interval` or another receiver), or name a chat channel here",
                        self.what, c.name
                    );
                    self.d.error(&t.loc, w);
                    return None;
                }
            }
        }
        let mut to = fd.to.clone();
        for name in also {
            if !to.iter().any(|t| t.value == *name) {
                to.push(crate::yaml::decode::Spanned {
                    value: name.clone(),
                    loc: fd.loc.clone(),
                });
            }
        }
        if to.is_empty() {
            let w = format!(
                "{} `{name}` names no channel: add `to`, e.g. `to: [oncall]` (a `resolved` without `to` only closes the alerts of channels in `notify.to` that keep them open: alertmanager and pagerduty channels)",
                self.what
            );
            self.d.error(&fd.loc, w);
            return None;
        }
        let nd = NotifyDraft {
            loc: fd.loc.clone(),
            to,
            title: fd.title.clone(),
            message: Some(fd.message.clone().unwrap_or(Text {
                value: default_message.into(),
                loc: fd.loc.clone(),
                unresolved: false,
                quoted: false,
            })),
            group: None,
            group_loc: None,
            mention: None,
            labels: Vec::new(),
            annotations: Vec::new(),
            quiet: None,
        };
        let saved = self.check;
        self.check.followup = true;
        let step = self.notify(&nd, channels, channel_names);
        self.check = saved;
        let step = step?;
        Some(FollowupStep {
            wait: fd.wait,
            unless: fd.unless,
            to: step.to,
            title: step.title,
            message: step.message,
        })
    }

    /// `notify.mention`'s templates, rendered as plain values (they are checked, not escaped,
    /// when rendered: `action::mention`). Mobiles on a channel that cannot mention by mobile
    /// are a warning: they are left out there.
    fn mention(
        &mut self,
        md: &MentionDraft,
        channels: &[Channel],
        to: &[String],
    ) -> Option<RuleMention> {
        let mut mobiles = Vec::new();
        for t in &md.mobiles {
            mobiles.push(self.compile(t, Escape::Raw, "notify.mention.mobiles"));
        }
        let mut user_ids = Vec::new();
        for t in &md.user_ids {
            user_ids.push(self.compile(t, Escape::Raw, "notify.mention.user_ids"));
        }
        if !md.mobiles.is_empty() {
            for c in channels.iter().filter(|c| to.contains(&c.name)) {
                if c.escape().is_chat() && !c.integration.mentions_mobiles() {
                    let w = format!(
                        "{} `notify.mention.mobiles`: channel `{}` ({}) cannot mention by mobile number; only `user_ids` reach it",
                        self.what, c.name, c.kind.name
                    );
                    self.d.warning(&md.loc, w);
                }
            }
        }
        Some(RuleMention {
            mobiles: mobiles.into_iter().collect::<Option<Vec<_>>>()?,
            user_ids: user_ids.into_iter().collect::<Option<Vec<_>>>()?,
            all: md.all,
        })
    }
}
