//! The `datetime` filter (docs/rules.md#templates): a time of the context (`deadline`, `now`, an
//! item's `observed_at`) as people read it in the rule files' `timezone`. The context keeps
//! times as the event JSON writes them (RFC 3339 in UTC with milliseconds), so a webhook body
//! and the event JSON agree; the filter is how a message says them in local time.

use std::fmt::Write;

use chrono::DateTime;
use chrono::format::{Item, StrftimeItems};
use chrono_tz::Tz;
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

/// What `{{ t | datetime }}` writes: `2026-12-06 18:30:05 CST`.
pub const DEFAULT_FORMAT: &str = "%Y-%m-%d %H:%M:%S %Z";

/// Registers `datetime` for times shown in `tz` (again, with another zone, after a reload).
pub(super) fn add(env: &mut Environment<'static>, tz: Tz) {
    env.add_filter(
        "datetime",
        move |value: &Value, format: Option<&str>| -> Result<Value, Error> {
            format_time(value, format.unwrap_or(DEFAULT_FORMAT), tz)
        },
    );
}

/// `value` (RFC 3339 text) written with `format` (strftime) in `tz`; `none` stays `none`, so
/// `{{ deadline | datetime }}` of an event without a deadline is what `{{ deadline }}` is.
/// `check`'s stand-in `detail` reads as now, so `{{ detail.at | datetime }}` passes it.
fn format_time(value: &Value, format: &str, tz: Tz) -> Result<Value, Error> {
    if value.is_none() || value.is_undefined() {
        return Ok(Value::from(()));
    }
    let items: Vec<Item<'_>> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "`datetime`: `{format}` is not a strftime format, e.g. `\"%H:%M\"` or `\"%Y-%m-%d %H:%M %Z\"`"
            ),
        ));
    }
    let t = if super::context::is_sample(value) {
        chrono::Utc::now().fixed_offset()
    } else {
        let text = value.as_str().ok_or_else(|| not_a_time(value))?;
        DateTime::parse_from_rfc3339(text.trim()).map_err(|_| not_a_time(value))?
    };
    let mut out = String::new();
    write!(
        out,
        "{}",
        t.with_timezone(&tz).format_with_items(items.into_iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("`datetime`: `{format}` cannot be written for this time"),
        )
    })?;
    Ok(Value::from(out))
}

fn not_a_time(value: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "`datetime` takes a time such as `deadline` or `now` (RFC 3339, e.g. `2026-12-06T10:30:05.000Z`), found `{value}`"
        ),
    )
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};

    use crate::event::{EventKind, KeyEvent};
    use crate::template::{Context, Escape, TemplateSet};

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn context(deadline: Option<&str>) -> Context {
        let event = KeyEvent {
            kind: EventKind::Expired,
            db: 0,
            key: bytes::Bytes::from(b"order_lock:42".to_vec()),
            field: None,
            observed_at: at("2026-12-06T10:30:05.012Z"),
            deadline: deadline.map(at),
            ttl_ms: None,
            recovered: false,
            source: "127.0.0.1:6379".to_owned(),
            place: None,
        };
        Context::for_event("r", &event, &[], &[], None)
    }

    fn render(tz: chrono_tz::Tz, source: &str, ctx: &Context) -> Result<String, String> {
        let mut set = TemplateSet::new();
        set.set_timezone(tz);
        let id = set.add(source, Escape::Raw).map_err(|e| e.message)?;
        set.render_text(id, ctx).map_err(|e| e.message)
    }

    #[test]
    fn a_time_reads_in_the_rule_files_time_zone() {
        let c = context(Some("2026-12-06T10:30:05.000Z"));
        let shanghai = chrono_tz::Asia::Shanghai;
        assert_eq!(
            render(shanghai, "{{ deadline | datetime }}", &c).unwrap(),
            "2026-12-06 18:30:05 CST"
        );
        assert_eq!(
            render(shanghai, "{{ deadline | datetime(\"%H:%M\") }}", &c).unwrap(),
            "18:30"
        );
        assert_eq!(
            render(chrono_tz::UTC, "{{ deadline | datetime }}", &c).unwrap(),
            "2026-12-06 10:30:05 UTC"
        );
        assert_eq!(
            render(
                chrono_tz::America::New_York,
                "{{ deadline | datetime(\"%a %-d %b, %H:%M %Z\") }}",
                &c
            )
            .unwrap(),
            "Sun 6 Dec, 05:30 EST"
        );
        // The context itself still says RFC 3339 in UTC, as the event JSON does.
        assert_eq!(
            render(shanghai, "{{ deadline }}", &c).unwrap(),
            "2026-12-06T10:30:05.000Z"
        );
        let now = render(shanghai, "{{ now | datetime(\"%Z\") }}", &c).unwrap();
        assert_eq!(now, "CST");
    }

    #[test]
    fn no_deadline_stays_none() {
        let c = context(None);
        assert_eq!(
            render(
                chrono_tz::UTC,
                "{{ deadline | datetime is none }} {{ deadline | datetime or \"unknown\" }}",
                &c
            )
            .unwrap(),
            "True unknown"
        );
    }

    /// `check` renders every template against a sample: a bad format or a value that is no
    /// time is found there, with what to write instead.
    #[test]
    fn a_bad_format_or_a_value_that_is_no_time_is_an_error_that_says_so() {
        let c = context(Some("2026-12-06T10:30:05.000Z"));
        let err = render(chrono_tz::UTC, "{{ deadline | datetime(\"%H:%Q\") }}", &c).unwrap_err();
        assert!(
            err.contains("`datetime`: `%H:%Q` is not a strftime format, e.g. `\"%H:%M\"`"),
            "{err}"
        );
        let err = render(chrono_tz::UTC, "{{ key | datetime }}", &c).unwrap_err();
        assert!(
            err.contains("`datetime` takes a time such as `deadline` or `now` (RFC 3339, e.g. `2026-12-06T10:30:05.000Z`), found `order_lock:42`"),
            "{err}"
        );
        let sample = Context::sample("r", EventKind::Expired, &[]);
        assert!(
            render(
                chrono_tz::UTC,
                "{{ detail.paid_by | datetime(\"%H:%M\") }}",
                &sample
            )
            .is_ok()
        );
    }
}
