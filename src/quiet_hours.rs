//! Quiet hours (docs/rules.md#quiet-hours): named windows of wall-clock time in the rule files'
//! `timezone`, what a channel does with them (`quiet: { during, release }`), and the arithmetic
//! that says whether an instant is inside a window, when that quiet period ends, and when the
//! next one starts. Pure: no clock, no Redis; the callers pass the instant (Redis's clock).
//!
//! # How a window becomes instants
//!
//! Each entry of a window starts on each of its `days` at `from` and ends at `to` the same day,
//! or the next day when `to` is not after `from` (`22:00`–`08:00`); `24:00` ends at the next
//! midnight. An entry belongs to the day it starts on: `fri 22:00–08:00` ends on Saturday.
//! Those wall-clock bounds become instants in the zone one at a time, and on the nights the
//! clocks change (docs/rules.md#quiet-hours-and-clock-changes):
//! - a bound in the hour that is skipped (spring) is the moment the clocks jump: a window from
//!   `02:30` starts when the clocks go from 02:00 to 03:00, and one that lies wholly inside the
//!   skipped hour does not happen that night;
//! - a `from` in the hour that is repeated (autumn) is its first occurrence and a `to` its
//!   second, so the window holds for as long as the clock shows a time inside it: a window from
//!   22:00 to 08:00 lasts 11 hours that night, and 9 on the night the clocks go forward.
//!
//! Periods of one window that touch or overlap (Friday's `22:00`–`08:00` and Saturday's
//! `00:00`–`24:00`) are one quiet period: a hold lasts until the last of them ends.

use std::fmt;

use chrono::{DateTime, Datelike, Duration, LocalResult, NaiveDate, NaiveDateTime, TimeZone, Utc};
use chrono_tz::Tz;

/// Minutes in a day: `24:00`, the only `to` that is not a time of day.
pub const DAY: u16 = 24 * 60;

/// The days of the week an entry starts on, Monday first (bit 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Days(u8);

/// The names `days` takes, Monday first.
pub const DAY_NAMES: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

impl Days {
    /// Every day.
    pub const ALL: Days = Days(0x7f);

    /// The day `name` (`mon` … `sun`), by its index from Monday.
    pub fn day(name: &str) -> Option<usize> {
        DAY_NAMES.iter().position(|d| *d == name)
    }

    pub fn with(self, day: usize) -> Days {
        Days(self.0 | (1 << day))
    }

    pub fn contains(self, day: usize) -> bool {
        self.0 & (1 << day) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    fn iter(self) -> impl Iterator<Item = usize> {
        (0..7).filter(move |d| self.contains(*d))
    }
}

impl fmt::Display for Days {
    /// `mon–fri`, `sat, sun`, `mon, wed–fri`: runs of three or more days as a range.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        let mut day = 0;
        while day < 7 {
            if !self.contains(day) {
                day += 1;
                continue;
            }
            let first = day;
            while day + 1 < 7 && self.contains(day + 1) {
                day += 1;
            }
            match day - first {
                0 => parts.push(DAY_NAMES[first].to_string()),
                1 => parts.push(format!("{}, {}", DAY_NAMES[first], DAY_NAMES[day])),
                _ => parts.push(format!("{}–{}", DAY_NAMES[first], DAY_NAMES[day])),
            }
            day += 1;
        }
        f.write_str(&parts.join(", "))
    }
}

/// A time of day as `HH:MM`, in minutes from midnight; `24:00` (= [`DAY`]) only as an end.
pub fn clock(minutes: u16) -> String {
    format!("{:02}:{:02}", minutes / 60, minutes % 60)
}

/// `HH:MM` (or `H:MM`) → minutes from midnight; `24:00` only when `end`. `None` for anything
/// else: the caller says what is expected.
pub fn parse_clock(text: &str, end: bool) -> Option<u16> {
    let (h, m) = text.trim().split_once(':')?;
    if h.is_empty() || h.len() > 2 || m.len() != 2 {
        return None;
    }
    if !h.bytes().chain(m.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (h, m): (u16, u16) = (h.parse().ok()?, m.parse().ok()?);
    match (h, m) {
        (24, 0) if end => Some(DAY),
        (0..=23, 0..=59) => Some(h * 60 + m),
        _ => None,
    }
}

/// One entry of a window: on each of `days`, from `from` to `to` (minutes from midnight; `to`
/// not after `from` means the next day).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub days: Days,
    pub from: u16,
    pub to: u16,
}

impl Span {
    /// Its end in minutes from the midnight of the day it starts on (past [`DAY`] when it
    /// crosses midnight).
    pub fn end(&self) -> u16 {
        if self.to > self.from {
            self.to
        } else {
            self.to + DAY
        }
    }
}

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}–{}", self.days, clock(self.from), clock(self.to))
    }
}

/// A named window of `quiet_hours`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub name: String,
    pub spans: Vec<Span>,
}

/// What a quiet channel sends when a quiet period ends (docs/rules.md#quiet-hours).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Release {
    /// One message listing everything held, resolved ones marked, with the count per rule.
    #[default]
    Digest,
    /// Every held message, in the order they were held.
    Each,
    /// One line: how many were held, by rule.
    Count,
}

impl Release {
    pub const ALL: [Release; 3] = [Release::Digest, Release::Each, Release::Count];

    pub fn as_str(self) -> &'static str {
        match self {
            Release::Digest => "digest",
            Release::Each => "each",
            Release::Count => "count",
        }
    }

    pub fn parse(s: &str) -> Option<Release> {
        Release::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// A channel's `quiet`: the window it is quiet during, and how it releases what it held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quiet {
    /// The name of a window of `quiet_hours` (checked to exist by `check`).
    pub during: String,
    pub release: Release,
}

/// A quiet period: from `start` (inclusive) to `end` (exclusive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Period {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
}

/// Whether a bound is a window's start or its end: the two read a repeated hour differently.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bound {
    Start,
    End,
}

/// Days before the day of an instant whose entries may still be running at it: an entry lasts
/// at most a day, plus an hour on the night the clocks go back.
const LOOK_BACK: u64 = 2;

/// Days after it that are searched for the end of a period or the next one. A window that
/// covers the whole week is refused by `check`, so a period ends within a week, and the next
/// one starts within another.
const LOOK_AHEAD: u64 = 16;

impl Window {
    /// When the quiet period holding `at` ends: `Some(end)` while quiet, `None` when not.
    pub fn quiet_until(&self, tz: Tz, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.period_at(tz, at).map(|p| p.end)
    }

    /// The quiet period holding `at`, if any.
    pub fn period_at(&self, tz: Tz, at: DateTime<Utc>) -> Option<Period> {
        self.periods(tz, at)
            .into_iter()
            .find(|p| p.start <= at && at < p.end)
    }

    /// The start of the first quiet period after `at` (not the one holding it).
    pub fn next_start(&self, tz: Tz, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.periods(tz, at)
            .into_iter()
            .find(|p| p.start > at)
            .map(|p| p.start)
    }

    /// The end of the quiet period holding `at`, or else of the next one.
    pub fn next_end(&self, tz: Tz, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.periods(tz, at)
            .into_iter()
            .find(|p| at < p.end)
            .map(|p| p.end)
    }

    /// The quiet periods around `at`, merged where they touch or overlap, in order.
    fn periods(&self, tz: Tz, at: DateTime<Utc>) -> Vec<Period> {
        let today = at.with_timezone(&tz).date_naive();
        let mut all = Vec::new();
        let first = today - chrono::Days::new(LOOK_BACK);
        for date in first
            .iter_days()
            .take((LOOK_BACK + LOOK_AHEAD + 1) as usize)
        {
            let weekday = date.weekday().num_days_from_monday() as usize;
            for span in self.spans.iter().filter(|s| s.days.contains(weekday)) {
                let start = instant(tz, at_minute(date, span.from), Bound::Start);
                let end = instant(tz, at_minute(date, span.end()), Bound::End);
                // Empty when the entry lies inside the hour the clocks skip.
                if start < end {
                    all.push(Period { start, end });
                }
            }
        }
        all.sort_by_key(|p| p.start);
        let mut merged: Vec<Period> = Vec::with_capacity(all.len());
        for p in all {
            match merged.last_mut() {
                Some(last) if p.start <= last.end => last.end = last.end.max(p.end),
                _ => merged.push(p),
            }
        }
        merged
    }

    /// Whether the window is quiet all week long, so that nothing held would ever be released
    /// (refused by `check`). Read on wall-clock minutes of a week without clock changes.
    pub fn covers_the_week(&self) -> bool {
        const WEEK: usize = 7 * DAY as usize;
        let mut covered = vec![false; WEEK];
        for span in &self.spans {
            for day in span.days.iter() {
                let start = day * DAY as usize + span.from as usize;
                for minute in start..day * DAY as usize + span.end() as usize {
                    covered[minute % WEEK] = true;
                }
            }
        }
        covered.iter().all(|c| *c)
    }
}

impl fmt::Display for Window {
    /// `sat, sun 00:00–24:00; mon–fri 22:00–08:00`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let spans: Vec<String> = self.spans.iter().map(ToString::to_string).collect();
        f.write_str(&spans.join("; "))
    }
}

/// Two entries of one window that share a day and whose times overlap on it (`check` refuses
/// them: one of them is a mistake), as their indexes and the day; an entry that lists a day twice
/// is the decoder's to report.
pub fn overlapping(spans: &[Span]) -> Option<(usize, usize, usize)> {
    for (i, a) in spans.iter().enumerate() {
        for (j, b) in spans.iter().enumerate().skip(i + 1) {
            let shared = Days(a.days.0 & b.days.0);
            if let Some(day) = shared.iter().next()
                && a.from < b.end()
                && b.from < a.end()
            {
                return Some((i, j, day));
            }
        }
    }
    None
}

/// Whether a held group whose period ends at `end` is to be released at `now`: its end has
/// passed, or the channel's window no longer says that its quiet period ends then (`current`,
/// what [`Window::quiet_until`] says now for the channel as configured, `None` when it is not
/// quiet or no longer has quiet hours): a window edited or removed by a reload releases what it
/// held at once (docs/rules.md#quiet-hours).
pub fn release_due(end: DateTime<Utc>, now: DateTime<Utc>, current: Option<DateTime<Utc>>) -> bool {
    end <= now || current != Some(end)
}

/// `held until 08:00, 14 messages` (the status page, `explain`): the end in `tz`, as the time
/// alone on the day of `now`, with the weekday within a week, else with the date.
pub fn held_line(until: DateTime<Utc>, count: usize, tz: Tz, now: DateTime<Utc>) -> String {
    let messages = if count == 1 {
        "1 message".to_string()
    } else {
        format!("{count} messages")
    };
    format!("held until {}, {messages}", shown_until(until, tz, now))
}

/// An end as people read it in `tz`: `08:00` on the day of `now`, `Tue 08:00` within a week,
/// `2026-12-20 08:00` after that.
pub fn shown_until(until: DateTime<Utc>, tz: Tz, now: DateTime<Utc>) -> String {
    let local = until.with_timezone(&tz);
    let today = now.with_timezone(&tz).date_naive();
    let days = (local.date_naive() - today).num_days();
    match days {
        0 => local.format("%H:%M").to_string(),
        1..=6 => local.format("%a %H:%M").to_string(),
        _ => local.format("%Y-%m-%d %H:%M").to_string(),
    }
}

/// The instant `date` + `minutes` (up to two days' worth) as a local wall-clock time.
fn at_minute(date: NaiveDate, minutes: u16) -> NaiveDateTime {
    date.and_hms_opt(0, 0, 0).unwrap_or_default() + Duration::minutes(i64::from(minutes))
}

/// The instant the wall clock of `tz` shows `local`: a start in a repeated hour is its first
/// occurrence, an end its second; a time the clocks skip is the moment they jump.
fn instant(tz: Tz, local: NaiveDateTime, bound: Bound) -> DateTime<Utc> {
    match tz.from_local_datetime(&local) {
        LocalResult::Single(t) => t.with_timezone(&Utc),
        LocalResult::Ambiguous(first, second) => match bound {
            Bound::Start => first.with_timezone(&Utc),
            Bound::End => second.with_timezone(&Utc),
        },
        LocalResult::None => jump_after(tz, local),
    }
}

/// The moment the clocks jump over `skipped`, a wall-clock time that does not exist: the first
/// wall-clock minute after it that does (transitions fall on whole minutes). Searched for up to
/// two days (a zone once skipped a whole day); past that, `skipped` read as UTC.
fn jump_after(tz: Tz, skipped: NaiveDateTime) -> DateTime<Utc> {
    let mut t = skipped;
    for _ in 0..2 * DAY {
        t += Duration::minutes(1);
        if let Some(found) = tz.from_local_datetime(&t).earliest() {
            return found.with_timezone(&Utc);
        }
    }
    Utc.from_utc_datetime(&skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .unwrap_or_else(|e| panic!("{s}: {e}"))
            .with_timezone(&Utc)
    }

    fn span(days: &[&str], from: &str, to: &str) -> Span {
        let days = days.iter().fold(Days::default(), |d, n| {
            d.with(Days::day(n).unwrap_or_else(|| panic!("{n}")))
        });
        Span {
            days,
            from: parse_clock(from, false).unwrap(),
            to: parse_clock(to, true).unwrap(),
        }
    }

    fn window(spans: &[Span]) -> Window {
        Window {
            name: "night".into(),
            spans: spans.to_vec(),
        }
    }

    /// The window of docs/rules.md's example: weeknights, and whole weekends.
    fn night() -> Window {
        window(&[
            span(&["mon", "tue", "wed", "thu", "fri"], "22:00", "08:00"),
            span(&["sat", "sun"], "00:00", "24:00"),
        ])
    }

    const SHANGHAI: Tz = chrono_tz::Asia::Shanghai;
    const NEW_YORK: Tz = chrono_tz::America::New_York;
    const BERLIN: Tz = chrono_tz::Europe::Berlin;

    #[test]
    fn clocks_parse_as_hours_and_minutes_and_24_00_only_ends() {
        assert_eq!(parse_clock("00:00", false), Some(0));
        assert_eq!(parse_clock("8:30", false), Some(510));
        assert_eq!(parse_clock("23:59", false), Some(1439));
        assert_eq!(parse_clock("24:00", true), Some(DAY));
        assert_eq!(parse_clock("24:00", false), None);
        for bad in [
            "24:01", "25:00", "12:60", "12", "12:5", "-1:00", "ab:cd", "12:00:00", "",
        ] {
            assert_eq!(parse_clock(bad, true), None, "{bad}");
        }
        assert_eq!(clock(DAY), "24:00");
        assert_eq!(clock(510), "08:30");
    }

    /// 2026-12-07 is a Monday. In Shanghai (UTC+8, no DST) Monday 23:00 is 15:00 UTC.
    #[test]
    fn a_window_crosses_midnight_and_ends_the_next_morning() {
        let w = night();
        // Monday 23:00 → quiet until Tuesday 08:00.
        assert_eq!(
            w.quiet_until(SHANGHAI, utc("2026-12-07T15:00:00Z")),
            Some(utc("2026-12-08T00:00:00Z"))
        );
        // Tuesday 03:00, inside Monday's entry.
        assert_eq!(
            w.quiet_until(SHANGHAI, utc("2026-12-07T19:00:00Z")),
            Some(utc("2026-12-08T00:00:00Z"))
        );
        // Tuesday 08:00 sharp is no longer quiet; the next period starts at 22:00.
        let eight = utc("2026-12-08T00:00:00Z");
        assert_eq!(w.quiet_until(SHANGHAI, eight), None);
        assert_eq!(
            w.next_start(SHANGHAI, eight),
            Some(utc("2026-12-08T14:00:00Z"))
        );
        assert_eq!(
            w.next_end(SHANGHAI, eight),
            Some(utc("2026-12-09T00:00:00Z"))
        );
        // Monday 21:59:59.999 is not quiet yet.
        assert_eq!(
            w.quiet_until(SHANGHAI, utc("2026-12-07T13:59:59.999Z")),
            None
        );
        // Inside a period, the next start is the following night's.
        assert_eq!(
            w.next_start(SHANGHAI, utc("2026-12-07T15:00:00Z")),
            Some(utc("2026-12-08T14:00:00Z"))
        );
    }

    /// Friday 22:00–08:00 runs into Saturday 00:00–24:00 and Sunday 00:00–24:00: one period,
    /// held until the last end, Monday 00:00 — and Monday has no morning entry of its own.
    #[test]
    fn touching_entries_are_one_period_held_until_the_last_end() {
        let w = night();
        // Friday 2026-12-11 23:00 Shanghai.
        let friday_night = utc("2026-12-11T15:00:00Z");
        assert_eq!(
            w.quiet_until(SHANGHAI, friday_night),
            Some(utc("2026-12-13T16:00:00Z")),
            "Monday 00:00 Shanghai"
        );
        // Two windows of a channel's one name that meet exactly: 20:00–22:00 and 22:00–23:00.
        let w = window(&[
            span(&["mon"], "20:00", "22:00"),
            span(&["mon"], "22:00", "23:00"),
        ]);
        assert_eq!(
            w.quiet_until(chrono_tz::UTC, utc("2026-12-07T21:00:00Z")),
            Some(utc("2026-12-07T23:00:00Z"))
        );
    }

    /// Sunday's entry crossing midnight ends on Monday: the week wraps.
    #[test]
    fn the_week_wraps_from_sunday_to_monday() {
        let w = window(&[span(&["sun"], "20:00", "06:00")]);
        // Sunday 2026-12-13 21:00 UTC.
        assert_eq!(
            w.quiet_until(chrono_tz::UTC, utc("2026-12-13T21:00:00Z")),
            Some(utc("2026-12-14T06:00:00Z"))
        );
        // Monday 05:59 is still Sunday's.
        assert_eq!(
            w.quiet_until(chrono_tz::UTC, utc("2026-12-14T05:59:00Z")),
            Some(utc("2026-12-14T06:00:00Z"))
        );
        // From Monday noon the next one is six days away.
        assert_eq!(
            w.next_start(chrono_tz::UTC, utc("2026-12-14T12:00:00Z")),
            Some(utc("2026-12-20T20:00:00Z"))
        );
    }

    #[test]
    fn a_whole_day_is_00_00_to_24_00() {
        let w = window(&[span(&["wed"], "00:00", "24:00")]);
        // Wednesday 2026-12-09, in Shanghai.
        assert_eq!(
            w.quiet_until(SHANGHAI, utc("2026-12-08T16:00:00Z")),
            Some(utc("2026-12-09T16:00:00Z")),
            "from Wednesday 00:00 to Thursday 00:00"
        );
        assert_eq!(w.quiet_until(SHANGHAI, utc("2026-12-08T15:59:59Z")), None);
        assert!(!w.covers_the_week());
        let every = window(&[span(&DAY_NAMES, "00:00", "24:00")]);
        assert!(every.covers_the_week());
        let nightly = window(&[
            span(&DAY_NAMES, "12:00", "12:01"),
            span(&DAY_NAMES, "12:01", "12:00"),
        ]);
        assert!(nightly.covers_the_week());
        assert!(!night().covers_the_week());
    }

    /// New York goes from 02:00 EST to 03:00 EDT on Sunday 2026-03-08.
    #[test]
    fn on_the_night_the_clocks_go_forward_the_window_is_an_hour_shorter() {
        let w = window(&[span(&DAY_NAMES, "22:00", "08:00")]);
        // Saturday 22:00 EST = 03:00 UTC; Sunday 08:00 EDT = 12:00 UTC: 9 hours.
        let p = w.period_at(NEW_YORK, utc("2026-03-08T06:00:00Z")).unwrap();
        assert_eq!(p.start, utc("2026-03-08T03:00:00Z"));
        assert_eq!(p.end, utc("2026-03-08T12:00:00Z"));
        // A bound inside the skipped hour is the moment of the jump (07:00 UTC).
        let w = window(&[span(&["sun"], "02:30", "06:00")]);
        let p = w.period_at(NEW_YORK, utc("2026-03-08T08:00:00Z")).unwrap();
        assert_eq!(p.start, utc("2026-03-08T07:00:00Z"));
        assert_eq!(p.end, utc("2026-03-08T10:00:00Z"));
        let w = window(&[span(&["sun"], "01:00", "02:30")]);
        assert_eq!(
            w.quiet_until(NEW_YORK, utc("2026-03-08T06:30:00Z")),
            Some(utc("2026-03-08T07:00:00Z")),
            "ends when the clocks jump to 03:00"
        );
        // Wholly inside the skipped hour: no quiet period that night; the next is a week on.
        let w = window(&[span(&["sun"], "02:10", "02:40")]);
        assert_eq!(w.quiet_until(NEW_YORK, utc("2026-03-08T07:00:00Z")), None);
        assert_eq!(
            w.next_start(NEW_YORK, utc("2026-03-08T00:00:00Z")),
            Some(utc("2026-03-15T06:10:00Z"))
        );
    }

    /// New York goes from 02:00 EDT back to 01:00 EST on Sunday 2026-11-01.
    #[test]
    fn on_the_night_the_clocks_go_back_the_window_is_an_hour_longer() {
        let w = window(&[span(&DAY_NAMES, "22:00", "08:00")]);
        // Saturday 22:00 EDT = 02:00 UTC; Sunday 08:00 EST = 13:00 UTC: 11 hours.
        let p = w.period_at(NEW_YORK, utc("2026-11-01T06:00:00Z")).unwrap();
        assert_eq!(p.start, utc("2026-11-01T02:00:00Z"));
        assert_eq!(p.end, utc("2026-11-01T13:00:00Z"));
        // An end in the repeated hour is its second occurrence: 01:30 EST = 06:30 UTC.
        let w = window(&[span(&["sat"], "22:00", "01:30")]);
        assert_eq!(
            w.quiet_until(NEW_YORK, utc("2026-11-01T05:45:00Z")),
            Some(utc("2026-11-01T06:30:00Z")),
            "05:45 UTC is 01:45 EDT, between the two 01:30s: still quiet"
        );
        // A start in the repeated hour is its first occurrence: 01:30 EDT = 05:30 UTC.
        let w = window(&[span(&["sun"], "01:30", "06:00")]);
        let p = w.period_at(NEW_YORK, utc("2026-11-01T05:30:00Z")).unwrap();
        assert_eq!(p.start, utc("2026-11-01T05:30:00Z"));
        assert_eq!(p.end, utc("2026-11-01T11:00:00Z"));
    }

    /// Berlin: forward 02:00 → 03:00 on 2026-03-29, back 03:00 → 02:00 on 2026-10-25.
    #[test]
    fn clock_changes_in_berlin_both_ways() {
        let w = window(&[span(&DAY_NAMES, "01:00", "07:00")]);
        // Spring: 01:00 CET = 00:00 UTC, 07:00 CEST = 05:00 UTC: 5 hours.
        let p = w.period_at(BERLIN, utc("2026-03-29T02:00:00Z")).unwrap();
        assert_eq!(
            (p.start, p.end),
            (utc("2026-03-29T00:00:00Z"), utc("2026-03-29T05:00:00Z"))
        );
        // Autumn: 01:00 CEST = 23:00 UTC the day before, 07:00 CET = 06:00 UTC: 7 hours.
        let p = w.period_at(BERLIN, utc("2026-10-25T02:00:00Z")).unwrap();
        assert_eq!(
            (p.start, p.end),
            (utc("2026-10-24T23:00:00Z"), utc("2026-10-25T06:00:00Z"))
        );
        // A window ending at 02:30 ends at the second 02:30 (01:30 UTC).
        let w = window(&[span(&["sun"], "00:00", "02:30")]);
        assert_eq!(
            w.quiet_until(BERLIN, utc("2026-10-25T00:45:00Z")),
            Some(utc("2026-10-25T01:30:00Z"))
        );
        // A window starting at 02:30 in spring starts at the jump (01:00 UTC).
        let w = window(&[span(&["sun"], "02:30", "05:00")]);
        assert_eq!(
            w.next_start(BERLIN, utc("2026-03-28T12:00:00Z")),
            Some(utc("2026-03-29T01:00:00Z"))
        );
    }

    #[test]
    fn overlapping_entries_are_found_on_a_shared_day_only() {
        let ok = [
            span(&["mon", "tue", "wed", "thu", "fri"], "22:00", "08:00"),
            span(&["sat", "sun"], "00:00", "24:00"),
        ];
        assert_eq!(overlapping(&ok), None);
        // Monday twice with times apart: fine.
        let apart = [
            span(&["mon"], "00:00", "06:00"),
            span(&["mon"], "22:00", "24:00"),
        ];
        assert_eq!(overlapping(&apart), None);
        let over = [
            span(&["mon", "tue"], "22:00", "08:00"),
            span(&["tue", "wed"], "23:00", "02:00"),
        ];
        assert_eq!(overlapping(&over), Some((0, 1, 1)));
    }

    #[test]
    fn a_held_group_is_released_at_its_end_or_when_its_window_changed() {
        let end = utc("2026-12-08T00:00:00Z");
        let before = utc("2026-12-07T23:00:00Z");
        assert!(!release_due(end, before, Some(end)));
        assert!(release_due(end, end, None));
        assert!(release_due(end, utc("2026-12-08T00:00:01Z"), Some(end)));
        // Edited to end at 07:00, or removed: at once.
        assert!(release_due(end, before, Some(utc("2026-12-07T23:30:00Z"))));
        assert!(release_due(end, before, None));
    }

    #[test]
    fn what_is_held_reads_in_the_zone() {
        // Tuesday 2026-12-08 07:00 Shanghai.
        let now = utc("2026-12-07T23:00:00Z");
        let eight = utc("2026-12-08T00:00:00Z");
        assert_eq!(
            held_line(eight, 14, SHANGHAI, now),
            "held until 08:00, 14 messages"
        );
        assert_eq!(
            held_line(eight, 1, SHANGHAI, utc("2026-12-07T10:00:00Z")),
            "held until Tue 08:00, 1 message"
        );
        assert_eq!(
            shown_until(utc("2026-12-20T00:00:00Z"), SHANGHAI, now),
            "2026-12-20 08:00"
        );
    }

    #[test]
    fn windows_and_days_read_as_written() {
        assert_eq!(
            night().to_string(),
            "mon–fri 22:00–08:00; sat, sun 00:00–24:00"
        );
        let d = ["mon", "wed", "thu", "fri", "sun"]
            .iter()
            .fold(Days::default(), |d, n| d.with(Days::day(n).unwrap()));
        assert_eq!(d.to_string(), "mon, wed–fri, sun");
    }
}
