//! Prometheus Alertmanager: alerts handed to `POST /api/v2/alerts` of every URL in `urls`, so
//! Alertmanager's routing, grouping, inhibition, silences and receivers take them from there
//! (docs/rules.md#alertmanager).
//!
//! Alertmanager keeps alerts in memory only, so an alert is posted again every `resend` while
//! it fires (as Prometheus does): that lives in `action::alert`, whose jobs each post one alert
//! to one URL. This file owns the channel's fields; [`super::alert`] the exact JSON of an alert.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::outcome::Outcome;
use crate::template::Escape;
use crate::yaml::Secret;

use super::alert::{Alertmanager, DEFAULT_HOLD, DEFAULT_RESEND, bad_label_name, judge, test_alert};
use super::fields::{Fields, check_http_url};
use super::http::Answer;
use super::integration::{Channel, Dispatch, Integration, Kind};
use super::message::Message;

pub const KIND: Kind = Kind {
    name: "alertmanager",
    fields: &["urls", "labels", "hold", "resend", "headers"],
    default_rate: None,
    example_url: "http://alertmanager:9093",
    decode,
};

fn decode(f: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    let what = f.what.clone();
    if let Some(loc) = f.m.key_loc("rate") {
        f.d.error(
            &loc,
            format!("{what}: `rate` does not apply to alertmanager channels: Alertmanager paces its notifications itself (`group_wait`, `group_interval`)"),
        );
    }
    let mut urls = Vec::new();
    match f.m.get("urls") {
        None => f.d.error(
            &f.m.loc,
            format!(
                "{what} is missing the field `urls`, e.g. `urls: [\"{}\"]`",
                KIND.example_url
            ),
        ),
        Some(n) => {
            let items = f.d.one_or_many(n, &format!("{what} `urls`"));
            if items.is_empty() {
                f.d.error(&n.loc, format!("{what} `urls` lists no URL"));
            }
            for item in items {
                let Some(t) = f.d.text(item, &format!("{what} `urls`")) else {
                    continue;
                };
                if !t.unresolved {
                    check_http_url(
                        f.d,
                        &t.value,
                        &t.loc,
                        &format!("{what} `urls`"),
                        KIND.example_url,
                    );
                }
                // Where a URL carries credentials: masked wherever they show, whether or not
                // they came from `${…}` (docs/rules.md#alertmanager).
                if let Some(creds) = url_credentials(&t.value) {
                    f.d.note_secret(&creds);
                }
                let value = t.value;
                let posted = super::alert::alerts_url(&value);
                if urls
                    .iter()
                    .any(|u: &Secret| super::alert::alerts_url(u.expose()) == posted)
                {
                    f.d.warning(&t.loc, format!("{what}: this URL is listed twice in `urls`"));
                    continue;
                }
                urls.push(Secret::new(value));
            }
        }
    }
    let mut labels = Vec::new();
    if let Some(n) = f.m.get("labels") {
        for (k, v) in f.d.string_map(n, &format!("{what} `labels`")) {
            if let Some(why) = bad_label_name(&k.value) {
                f.d.error(&k.loc, format!("{what} `labels`: {why}"));
            } else if k.value == "alertname" {
                f.d.error(
                    &k.loc,
                    format!("{what} `labels`: `alertname` is the rule's name and cannot be set"),
                );
            } else {
                labels.push((k.value, v.value));
            }
        }
    }
    let hold = duration(f, "hold", DEFAULT_HOLD);
    let resend = duration(f, "resend", DEFAULT_RESEND);
    if let (Some(h), Some(r)) = (&hold, &resend)
        && r.value >= h.value
        && h.explicit
    {
        f.d.warning(
            &r.loc,
            format!(
                "{what}: `resend` ({}) is not shorter than `hold` ({}): an Alertmanager that restarts loses the alert until it ends",
                humantime::format_duration(r.value),
                humantime::format_duration(h.value)
            ),
        );
    }
    let headers =
        f.m.get("headers")
            .map(|n| f.d.string_map(n, &format!("{what} `headers`")))
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k.value, Secret::new(v.value)))
            .collect::<Vec<_>>();
    // A header is a credential more often than not (`Authorization: Bearer …`): masked
    // wherever it shows, and so is the credential of `SCHEME CREDENTIAL` alone, since an
    // answer may quote only that.
    for (_, v) in &headers {
        f.d.note_secret(v.expose());
        if let Some((_, credential)) = v.expose().split_once(' ') {
            f.d.note_secret(credential.trim());
        }
    }
    if urls.is_empty() {
        return None;
    }
    Some(Arc::new(Alertmanager {
        urls,
        labels,
        hold: hold?.value,
        resend: resend?.value,
        headers,
    }))
}

/// The user info and query of `url` on a stand-in host, when it has either: the form
/// [`crate::yaml::Secrets`] takes a URL's credentials from (its password, the `Basic` header
/// made of its user info, its query values), without masking the Alertmanager's address.
fn url_credentials(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    if u.username().is_empty() && u.password().is_none() && u.query().is_none() {
        return None;
    }
    let mut bare = url::Url::parse("http://host/").ok()?;
    bare.set_username(u.username()).ok()?;
    bare.set_password(u.password()).ok()?;
    bare.set_query(u.query());
    Some(bare.to_string())
}

struct Setting {
    value: Duration,
    loc: crate::yaml::diagnostic::Loc,
    explicit: bool,
}

/// `hold` or `resend`: more than 0; the default when not written.
fn duration(f: &mut Fields<'_, '_>, field: &str, default: Duration) -> Option<Setting> {
    let what = format!("{} `{field}`", f.what);
    match f.m.get(field) {
        None => Some(Setting {
            value: default,
            loc: f.loc.clone(),
            explicit: false,
        }),
        Some(n) => {
            let d = f.d.duration(n, &what)?;
            if d.value.is_zero() {
                f.d.error(&d.loc, format!("{what} must be more than 0"));
                return None;
            }
            Some(Setting {
                value: d.value,
                loc: d.loc,
                explicit: true,
            })
        }
    }
}

impl Integration for Alertmanager {
    /// Alertmanager hands annotations to Slack, Telegram, email and chat receivers as they
    /// are: the title and message (`summary`, `description`) are chat text, so key text in them
    /// mentions nobody and links nowhere. Labels are rendered exact (docs/rules.md#alertmanager).
    fn escape(&self) -> Escape {
        Escape::Text
    }

    /// The acknowledge and silence links stay out of `description`: an alert links the
    /// event's history (`generatorURL`), and Alertmanager's own silences are the ones it obeys.
    fn links_as_buttons(&self) -> bool {
        true
    }

    fn target(&self) -> String {
        let urls: Vec<String> = (0..self.urls.len()).map(|i| self.shown_url(i)).collect();
        urls.join(", ")
    }

    /// A message that is not one of the channel's alert jobs (`send-test`): a test alert to
    /// the first URL; `send-test` posts to every URL itself through [`Alertmanager::request`].
    fn dispatch(&self, _ch: &Channel, msg: &Message, now: DateTime<Utc>) -> Dispatch {
        match self.request(0, &test_alert(self, msg, now)) {
            Some(req) => Dispatch::Request(req),
            None => Dispatch::Done(Outcome::Failed("the channel has no URL".into())),
        }
    }

    fn judge(&self, _ch: &Channel, answer: &Answer) -> Outcome {
        judge(answer)
    }

    fn closes_on_resolved(&self) -> bool {
        true
    }

    fn alertmanager(&self) -> Option<&Alertmanager> {
        Some(self)
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_credentials_keep_user_info_and_query_but_not_the_address() {
        assert_eq!(
            url_credentials("http://kw:p%40ss@am-0:9093/prefix?token=t0ken#x").as_deref(),
            Some("http://kw:p%40ss@host/?token=t0ken")
        );
        assert_eq!(url_credentials("http://am-0:9093/prefix"), None);
    }
}
