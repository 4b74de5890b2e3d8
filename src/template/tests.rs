//! Rendering through a whole `TemplateSet`: escaping per mode with hostile values, strictness,
//! the context, byte-exactness, and the properties that keep key text from widening an action.

use chrono::{DateTime, Utc};
use proptest::prelude::*;

use super::*;
use crate::event::{EventKind, KeyEvent};

fn event(key: &[u8]) -> KeyEvent {
    KeyEvent {
        kind: EventKind::Expired,
        db: 0,
        key: bytes::Bytes::from(key.to_vec()),
        field: None,
        observed_at: at("2026-11-29T10:15:00.012Z"),
        deadline: Some(at("2026-11-29T10:15:00Z")),
        ttl_ms: None,
        recovered: false,
        source: "127.0.0.1:6379".to_owned(),
        place: None,
    }
}

fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

/// A context whose key is `key` and whose one capture `x` is `value`.
fn ctx_with(key: &[u8], value: &[u8]) -> Context {
    Context::for_event(
        "r",
        &event(key),
        &["x".to_owned()],
        &[value.to_vec().into()],
        None,
    )
}

fn ctx(value: &[u8]) -> Context {
    ctx_with(value, value)
}

fn render(source: &str, escape: Escape, ctx: &Context) -> Vec<u8> {
    let mut set = TemplateSet::new();
    let id = set.add(source, escape).unwrap();
    set.render(id, ctx).unwrap()
}

fn render_text(source: &str, escape: Escape, ctx: &Context) -> String {
    let mut set = TemplateSet::new();
    let id = set.add(source, escape).unwrap();
    set.render_text(id, ctx).unwrap()
}

// ---- escaping per mode -----------------------------------------------------------------------

/// Every template of a set lives in one environment under a guessable name (`0.raw`): one that
/// could include, import or extend another would render it, secrets substituted. They are
/// refused at compile time, with the line.
#[test]
fn templates_cannot_render_other_templates() {
    let mut set = TemplateSet::new();
    set.add("Bearer s3cret", Escape::Raw).unwrap();
    for (source, tag) in [
        ("{% include '0.raw' %}", "include"),
        ("a\n{%- include '0.raw' ignore missing %}", "include"),
        ("{% import '0.raw' as m %}", "import"),
        ("{% from '0.raw' import x %}", "from"),
        ("{% extends '0.raw' %}", "extends"),
        ("{% block b %}{% endblock %}", "block"),
    ] {
        let err = set.add(source, Escape::Text).unwrap_err();
        assert!(
            err.message
                .starts_with(&format!("`{{% {tag} %}}` is not allowed")),
            "{source}: {err:?}"
        );
        assert!(err.line.is_some(), "{source}: {err:?}");
    }
    // Macros of the template itself still work.
    let id = set
        .add(
            "{% macro m(x) %}[{{ x }}]{% endmacro %}{{ m(1) }}",
            Escape::Text,
        )
        .unwrap();
    assert_eq!(
        set.source(id),
        "{% macro m(x) %}[{{ x }}]{% endmacro %}{{ m(1) }}"
    );
}

#[test]
fn glob_escapes_values_not_literals() {
    let out = render("session:{{ x }}:*", Escape::Glob, &ctx(b"*"));
    assert_eq!(out, b"session:\\*:*");
    let out = render("k:{{ x }}", Escape::Glob, &ctx(b"a?b[c]d\\e"));
    assert_eq!(out, b"k:a\\?b\\[c\\]d\\\\e");
}

#[test]
fn url_percent_encodes_values() {
    let out = render(
        "http://127.0.0.1:8080/reload/{{ x }}?k={{ x }}",
        Escape::Url,
        &ctx(b"a/../b?x=1#"),
    );
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "http://127.0.0.1:8080/reload/a%2F..%2Fb%3Fx%3D1%23?k=a%2F..%2Fb%3Fx%3D1%23"
    );
    let out = render("/{{ x }}", Escape::Url, &ctx(b"50% & more"));
    assert_eq!(out, b"/50%25%20%26%20more");
}

#[test]
fn redis_key_and_raw_are_verbatim() {
    let hostile = b"*?[]\\ @all <!channel> ../%#&";
    assert_eq!(render("{{ x }}", Escape::RedisKey, &ctx(hostile)), hostile);
    assert_eq!(render("{{ x }}", Escape::Raw, &ctx(hostile)), hostile);
}

#[test]
fn slack_kills_control_sequences() {
    let out = render_text(
        "{{ x }} <!here>",
        Escape::Slack,
        &ctx(b"<!channel> & <@U123>"),
    );
    assert_eq!(out, "&lt;!channel&gt; &amp; &lt;@U123&gt; <!here>");
}

#[test]
fn text_kills_mentions() {
    for (value, want) in [
        ("@all", "@\u{200B}all"),
        ("@13800000000", "@\u{200B}13800000000"),
        ("<at user_id=\"all\">", "<\u{200B}at user_id=\"all\">"),
        ("<@U123>", "<\u{200B}@\u{200B}U123>"),
        ("*_[]()#>`", "*_[]()#>`"),
    ] {
        assert_eq!(
            render_text("{{ x }}", Escape::Text, &ctx(value.as_bytes())),
            want
        );
    }
    // The author's own mention in literal text stays.
    assert_eq!(
        render_text("@all {{ x }}", Escape::Text, &ctx(b"k")),
        "@all k"
    );
}

/// Telegram: each value is a `<code>` entity, which Telegram never makes a link, mention,
/// hashtag or bot command of, so the key needs no zero-width space and copies as it is; where
/// the author's own markup cannot hold code (code, pre, link text, an attribute) it is plain.
#[test]
fn telegram_values_are_code_and_copy_exactly() {
    let hostile = "evil.com/login http://x <a href=x> @all <!channel> /start #h $T +1 555 0100";
    let c = ctx(hostile.as_bytes());
    let escaped =
        "evil.com/login http://x &lt;a href=x&gt; @all &lt;!channel&gt; /start #h $T +1 555 0100";
    assert_eq!(
        render_text(
            "<b>Lock {{ x }}</b>: <code>{{ x }}</code>",
            Escape::Html,
            &c
        ),
        format!("<b>Lock <code>{escaped}</code></b>: <code>{escaped}</code>")
    );
    assert_eq!(
        render_text(
            "<a href=\"https://w/?k={{ x }}\">{{ x }}</a>",
            Escape::Html,
            &ctx(b"a&b")
        ),
        "<a href=\"https://w/?k=a&amp;b\">a&amp;b</a>"
    );
    assert_eq!(
        render_text(
            "{{ x }}",
            Escape::Html,
            &ctx("a\u{202E}b\u{7}\nc".as_bytes())
        ),
        "<code>a\\u202Eb\\u0007\\nc</code>"
    );
    assert_eq!(render_text("[{{ x }}]", Escape::Html, &ctx(b"")), "[]");
}

#[test]
fn markdown_kills_markup_and_mentions() {
    let out = render_text(
        "**{{ x }}**",
        Escape::Markdown,
        &ctx(b"[phish](http://evil) *_#>` @all <at user_id=\"all\">"),
    );
    assert_eq!(
        out,
        "**\\[phish\\]\\(http:\u{200B}//evil\\) \\*\\_\\#\\>\\` @\u{200B}all <\u{200B}at user\\_id=\"all\"\\>**"
    );
}

#[test]
fn every_interpolation_is_escaped_not_only_captures() {
    let out = render_text(
        "{{ key }} {{ captures.x }} {{ detail.note }} {{ 'lit@all' }}",
        Escape::Text,
        &Context::for_event(
            "r",
            &event(b"@all"),
            &["x".to_owned()],
            &[b"@all".to_vec().into()],
            Some(serde_json::json!({"note": "<at user_id=\"all\">"})),
        ),
    );
    assert_eq!(
        out,
        "@\u{200B}all @\u{200B}all <\u{200B}at user_id=\"all\"> lit@\u{200B}all"
    );
}

#[test]
fn safe_and_tojson_are_escaped_in_chat_and_left_alone_elsewhere() {
    let c = ctx(b"<!channel> @all [x](http://evil)");
    assert_eq!(
        render_text("{{ x | safe }}", Escape::Slack, &c),
        "&lt;!channel&gt; @all [x](http:\u{200B}//evil)"
    );
    assert_eq!(
        render_text("{{ x | safe }}", Escape::Markdown, &c),
        "<\u{200B}!channel\\> @\u{200B}all \\[x\\]\\(http:\u{200B}//evil\\)"
    );
    assert_eq!(
        render_text("{{ x | tojson }}", Escape::Markdown, &c),
        "\"\\\\u003c!channel\\\\u003e @\u{200B}all \\[x\\]\\(http:\u{200B}//evil\\)\""
    );
    assert_eq!(
        render_text("{{ x | tojson }}", Escape::Text, &ctx(b"@all")),
        "\"@\u{200B}all\""
    );
    // `| e` escapes once, `| safe` after it changes nothing.
    assert_eq!(
        render_text("{{ x | e | safe }}", Escape::Text, &ctx(b"@all")),
        "@\u{200B}all"
    );
    // Outside chat they keep minijinja's meaning: the author's opt-out, JSON as it is.
    assert_eq!(
        render_text("{{ x | safe }}", Escape::Url, &ctx(b"a/b")),
        "a/b"
    );
    let c = ctx(b"a\"b");
    assert_eq!(
        render_text("{\"user\": {{ x | tojson }}}", Escape::Raw, &c),
        "{\"user\": \"a\\\"b\"}"
    );
    // `| escape` escapes for the template's own mode.
    assert_eq!(
        render_text("{{ x | e }}", Escape::Url, &ctx(b"a b")),
        "a%20b"
    );
}

// ---- strictness and errors -------------------------------------------------------------------

#[test]
fn undefined_name_is_an_error_with_line() {
    let mut set = TemplateSet::new();
    let id = set
        .add(
            "first line\nsecond {{ key }}\nthird {{ order_idd }}",
            Escape::Text,
        )
        .unwrap();
    let err = set.render_text(id, &ctx(b"k")).unwrap_err();
    assert_eq!(err.line, Some(3));
    assert!(err.message.contains("undefined"), "{}", err.message);
    assert!(err.message.contains("order_idd"), "{}", err.message);
    assert!(
        !err.message.contains("0.text"),
        "internal name leaked: {}",
        err.message
    );
}

#[test]
fn a_macro_that_calls_itself_runs_out_of_fuel_instead_of_spinning() {
    let mut set = TemplateSet::new();
    let id = set
        .add(
            "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",
            Escape::Text,
        )
        .unwrap();
    let started = std::time::Instant::now();
    let err = set.render(id, &ctx(b"x")).unwrap_err();
    assert!(
        err.message.contains("more work than one render may"),
        "{err}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Deep recursion without the blow-up stops at minijinja's recursion limit.
    let id = set
        .add(
            "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(100000) }}",
            Escape::Text,
        )
        .unwrap();
    assert!(set.render(id, &ctx(b"x")).is_err());
}

/// The budget must not cut what rules really do: the largest digest (`max_items: 1000`) with
/// a few lookups, a filter and `tojson` per event, and a 1 MB detail printed whole.
#[test]
fn the_fuel_budget_leaves_room_for_the_largest_digest_and_a_big_detail() {
    let mut set = TemplateSet::new();
    let id = set
        .add(
            "{{ count }} keys: {% for e in events %}{% if e.late_ms > 0 %}late {% endif %}{{ e.key | upper }} in db {{ e.db }} ({{ e.captures | tojson }}, {{ e.deadline }}){% if not loop.last %}, {% endif %}{% endfor %}",
            Escape::Markdown,
        )
        .unwrap();
    let events = (0..1000)
        .map(|i| {
            serde_json::json!({
                "key": format!("order_lock:{i}"), "db": 0, "late_ms": i % 3,
                "captures": {"order_id": i.to_string()}, "deadline": "2026-11-29T10:15:00.000Z",
            })
        })
        .collect();
    let out = set
        .render_text(id, &ctx(b"k").with_digest(1000, events))
        .unwrap();
    assert!(
        out.contains("ORDER\\_LOCK:999"),
        "{}",
        &out[out.len() - 200..]
    );

    let detail = serde_json::json!({ "blob": "x".repeat(1 << 20) });
    let c = Context::for_event("r", &event(b"k"), &[], &[], Some(detail));
    let id = set
        .add("{{ detail.blob }} {{ detail | tojson }}", Escape::Raw)
        .unwrap();
    assert_eq!(set.render(id, &c).unwrap().len(), 2 * (1 << 20) + 13);
}

#[test]
fn syntax_error_at_add_with_line() {
    let mut set = TemplateSet::new();
    let err = set.add("ok\n{{ key }\n", Escape::Text).unwrap_err();
    assert_eq!(err.line, Some(2));
    assert!(err.message.contains("syntax error"), "{}", err.message);
}

#[test]
fn digest_names_exist_only_in_digests() {
    let mut set = TemplateSet::new();
    let id = set
        .add(
            "{{ count }}: {% for e in events %}{{ e.key }} {% endfor %}",
            Escape::Text,
        )
        .unwrap();
    assert!(set.render_text(id, &ctx(b"k")).is_err());
    let digest = ctx(b"k").with_digest(
        3,
        vec![
            serde_json::json!({"key": "a"}),
            serde_json::json!({"key": "@all"}),
        ],
    );
    assert_eq!(set.render_text(id, &digest).unwrap(), "3: a @\u{200B}all ");
}

#[test]
fn variables_lists_top_level_names() {
    let mut set = TemplateSet::new();
    let id = set
        .add(
            "{{ key }} {{ captures.x }} {% set y = 1 %}{{ y }}{% for e in events %}{{ e.key }}{% endfor %}{{ order_id | upper }}",
            Escape::Text,
        )
        .unwrap();
    let vars: Vec<String> = set.variables(id).into_iter().collect();
    assert_eq!(vars, ["captures", "events", "key", "order_id"]);
    assert_eq!(set.escape(id), Escape::Text);
    assert!(set.source(id).starts_with("{{ key }}"));
}

// ---- the context -----------------------------------------------------------------------------

#[test]
fn context_values() {
    let mut e = event(b"order_lock:42");
    let c = Context::for_event(
        "order-lock",
        &e,
        &["order_id".to_owned()],
        &[b"42".to_vec().into()],
        None,
    );
    assert_eq!(
        render_text(
            "{{ rule }} {{ key }} {{ event }} {{ db }} {{ order_id }} {{ captures.order_id }} {{ deadline }} {{ late_ms }} {{ recovered }} {{ ttl is none }} {{ ttl_ms is none }} {{ detail is none }}",
            Escape::Raw,
            &c
        ),
        "order-lock order_lock:42 expired 0 42 42 2026-11-29T10:15:00.000Z 12 False True True True"
    );
    let now = render_text("{{ now }}", Escape::Raw, &c);
    assert!(DateTime::parse_from_rfc3339(&now).is_ok() && now.ends_with('Z') && now.len() == 24);

    e.kind = EventKind::Expiring;
    e.ttl_ms = Some(604_740_000);
    e.deadline = None;
    let c = Context::for_event("lic", &e, &[], &[], Some(serde_json::json!("text detail")));
    assert_eq!(
        render_text(
            "{{ ttl }} {{ ttl_ms }} {{ deadline is none }} {{ late_ms is none }} {{ detail }}",
            Escape::Raw,
            &c
        ),
        "6d 23h 604740000 True True text detail"
    );
}

#[test]
fn context_names_cover_the_context() {
    let c = Context::sample("r", EventKind::Expiring, &[])
        .with_digest(0, vec![])
        .with_gap(1_000);
    let mut set = TemplateSet::new();
    for name in CONTEXT_NAMES {
        let id = set.add(&format!("{{{{ {name} }}}}"), Escape::Raw).unwrap();
        assert!(set.render(id, &c).is_ok(), "{name} undefined");
    }
}

#[test]
fn sample_finds_undefined_names_and_bad_filters() {
    let names = vec!["order_id".to_owned()];
    let sample = Context::sample("order-lock", EventKind::Expired, &names);
    let mut set = TemplateSet::new();

    let good = set
        .add(
            "Lock {{ order_id }} of {{ key }} ({{ rule }}, {{ deadline }}, late {{ late_ms }}ms): \
             {{ detail.user.name | upper }} {{ detail['items'][0].sku }} {{ detail.amount | round(2) }} \
             {{ detail.n | int + 1 }} {{ detail | tojson }}{% for i in detail.items %}{{ i.sku }}{% endfor %}",
            Escape::Markdown,
        )
        .unwrap();
    let out = set.render_text(good, &sample).unwrap();
    assert!(
        out.starts_with("Lock order\\_id of <\u{200B}key\\> (order-lock, "),
        "{out}"
    );
    assert!(out.contains("<\u{200B}detail\\>"), "{out}");

    let undefined = set.add("{{ order }}", Escape::Text).unwrap();
    let err = set.render_text(undefined, &sample).unwrap_err();
    assert!(err.message.contains("order"), "{}", err.message);
    assert_eq!(err.line, Some(1));

    let bad_filter = set.add("x\n{{ order_id | uppr }}", Escape::Text).unwrap();
    let err = set.render_text(bad_filter, &sample).unwrap_err();
    assert!(err.message.contains("unknown filter"), "{}", err.message);
    assert!(err.message.contains("uppr"), "{}", err.message);
    assert_eq!(err.line, Some(2));

    // ttl only for expiring.
    let ttl = set.add("{{ ttl }}", Escape::Text).unwrap();
    // minijinja prints none like Jinja2 does.
    assert_eq!(set.render_text(ttl, &sample).unwrap(), "None");
    let expiring = Context::sample("lic", EventKind::Expiring, &[]);
    assert_eq!(set.render_text(ttl, &expiring).unwrap(), "6d 23h");
}

// ---- bytes -----------------------------------------------------------------------------------

#[test]
fn non_utf8_keys_in_every_mode() {
    let key: &[u8] = b"k:\xff\xfe*@all";
    let c = ctx(key);
    assert_eq!(render("{{ key }}", Escape::RedisKey, &c), key);
    assert_eq!(render("{{ key }}", Escape::Raw, &c), key);
    assert_eq!(
        render("{{ x }}:*", Escape::Glob, &c),
        b"k:\xff\xfe\\*@all:*"
    );
    assert_eq!(render("/{{ x }}", Escape::Url, &c), b"/k%3A%FF%FE%2A%40all");
    assert_eq!(
        render_text("{{ x }}", Escape::Slack, &c),
        "k:\u{FFFD}\u{FFFD}*@all"
    );
    assert_eq!(
        render_text("{{ x }}", Escape::Text, &c),
        "k:\u{FFFD}\u{FFFD}*@\u{200B}all"
    );
    assert_eq!(
        render_text("{{ x }}", Escape::Markdown, &c),
        "k:\u{FFFD}\u{FFFD}\\*@\u{200B}all"
    );
    // Text of an exact mode is replaced too.
    assert_eq!(
        render_text("{{ x }}", Escape::RedisKey, &c),
        "k:\u{FFFD}\u{FFFD}*@all"
    );
}

#[test]
fn genuine_private_use_chars_in_keys_and_sources() {
    let key = "k\u{F7FF}\u{F780}".as_bytes();
    let c = ctx(key);
    assert_eq!(render("{{ x }}", Escape::RedisKey, &c), key);
    assert_eq!(
        render("\u{F7AB}{{ x }}", Escape::RedisKey, &c),
        "\u{F7AB}k\u{F7FF}\u{F780}".as_bytes()
    );
    assert_eq!(
        render_text("{{ x }}", Escape::Text, &c),
        "k\u{F7FF}\u{F780}"
    );
    let detail = Some(serde_json::json!({"v": "\u{F7C0}"}));
    let c = Context::for_event("r", &event(b"k"), &[], &[], detail);
    assert_eq!(
        render("{{ detail.v }}", Escape::RedisKey, &c),
        "\u{F7C0}".as_bytes()
    );
}

#[test]
fn one_megabyte_key() {
    let mut key = vec![b'a'; 1 << 20];
    key[10] = b'*';
    key[20] = 0xff;
    let c = ctx(&key);
    for mode in Escape::ALL {
        let mut set = TemplateSet::new();
        let id = set.add("p:{{ key }}", mode).unwrap();
        let out = set.render(id, &c).unwrap();
        assert!(out.len() > 1 << 20, "{mode:?}");
        assert!(set.render_text(id, &c).unwrap().len() > 1 << 20);
    }
    assert_eq!(&render("{{ key }}", Escape::RedisKey, &c)[..], &key[..]);
}

#[test]
fn trailing_newline_is_kept() {
    assert_eq!(
        render("a:{{ x }}\n", Escape::RedisKey, &ctx(b"1")),
        b"a:1\n"
    );
}

// ---- properties ------------------------------------------------------------------------------

/// A port of Redis's `stringmatchlen` (util.c, case-sensitive), the matcher behind `SCAN MATCH`
/// and `KEYS`. Chars compare as bytes; Redis compares `char`, which only matters for ranges.
fn redis_match(pattern: &[u8], string: &[u8]) -> bool {
    let mut skip_longer = false;
    stringmatch(pattern, string, &mut skip_longer, 0)
}

fn stringmatch(mut p: &[u8], mut s: &[u8], skip_longer: &mut bool, nesting: u32) -> bool {
    if nesting > 1000 {
        return false;
    }
    while !p.is_empty() && !s.is_empty() {
        match p[0] {
            b'*' => {
                while p.len() > 1 && p[1] == b'*' {
                    p = &p[1..];
                }
                if p.len() == 1 {
                    return true;
                }
                while !s.is_empty() {
                    if stringmatch(&p[1..], s, skip_longer, nesting + 1) {
                        return true;
                    }
                    if *skip_longer {
                        return false;
                    }
                    s = &s[1..];
                }
                *skip_longer = true;
                return false;
            }
            b'?' => s = &s[1..],
            b'[' => {
                p = &p[1..];
                let not = p.first() == Some(&b'^');
                if not {
                    p = &p[1..];
                }
                let mut matched = false;
                // `p` keeps the position of the closing `]` (or the last byte if unclosed), as
                // in C, where the loop's `pattern++` below then steps past it.
                let mut i = 0;
                loop {
                    if i < p.len() && p[i] == b'\\' && p.len() - i >= 2 {
                        i += 1;
                        if p[i] == s[0] {
                            matched = true;
                        }
                    } else if i < p.len() && p[i] == b']' {
                        break;
                    } else if i >= p.len() {
                        i = i.saturating_sub(1);
                        break;
                    } else if p.len() - i >= 3 && p[i + 1] == b'-' {
                        let (mut start, mut end) = (p[i], p[i + 2]);
                        if start > end {
                            std::mem::swap(&mut start, &mut end);
                        }
                        i += 2;
                        if (start..=end).contains(&s[0]) {
                            matched = true;
                        }
                    } else if p[i] == s[0] {
                        matched = true;
                    }
                    i += 1;
                }
                p = &p[i.min(p.len())..];
                if not {
                    matched = !matched;
                }
                if !matched {
                    return false;
                }
                s = &s[1..];
            }
            c => {
                let lit = if c == b'\\' && p.len() >= 2 {
                    p = &p[1..];
                    p[0]
                } else {
                    c
                };
                if lit != s[0] {
                    return false;
                }
                s = &s[1..];
            }
        }
        if !p.is_empty() {
            p = &p[1..];
        }
        if s.is_empty() {
            while p.first() == Some(&b'*') {
                p = &p[1..];
            }
            break;
        }
    }
    p.is_empty() && s.is_empty()
}

#[test]
fn redis_match_port_agrees_with_redis_examples() {
    assert!(redis_match(b"h?llo", b"hello"));
    assert!(redis_match(b"h*llo", b"heeeello"));
    assert!(redis_match(b"h[ae]llo", b"hallo"));
    assert!(!redis_match(b"h[ae]llo", b"hillo"));
    assert!(redis_match(b"h[^e]llo", b"hallo"));
    assert!(!redis_match(b"h[^e]llo", b"hello"));
    assert!(redis_match(b"h[a-b]llo", b"hbllo"));
    assert!(redis_match(b"session:\\*:*", b"session:*:1"));
    assert!(!redis_match(b"session:\\*:*", b"session:abc:1"));
    assert!(redis_match(b"a\\\\b", b"a\\b"));
    assert!(redis_match(b"a*", b"a"));
    assert!(!redis_match(b"a", b""));
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    // Weighted towards the characters that matter.
    proptest::collection::vec(
        prop_oneof![
            3 => any::<u8>(),
            2 => prop::sample::select(b"*?[]\\^-!@<>&%#/:a".to_vec()),
        ],
        0..24,
    )
}

fn glob_set() -> (TemplateSet, TemplateId, TemplateId) {
    let mut set = TemplateSet::new();
    let exact = set.add("session:{{ x }}", Escape::Glob).unwrap();
    let prefix = set.add("session:{{ x }}:*", Escape::Glob).unwrap();
    (set, exact, prefix)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// (1) A glob built from a value matches exactly the literal it stands for.
    #[test]
    fn glob_matches_exactly_the_literal(x in bytes(), other in bytes(), suffix in bytes()) {
        let (set, exact, prefix) = glob_set();
        let c = ctx(&x);
        let pattern = set.render(exact, &c).unwrap();
        let literal = [b"session:".as_slice(), &x].concat();
        prop_assert!(redis_match(&pattern, &literal));
        let candidate = [b"session:".as_slice(), &other].concat();
        prop_assert_eq!(redis_match(&pattern, &candidate), other == x);
        let mut longer = literal.clone();
        longer.push(b'x');
        prop_assert!(!redis_match(&pattern, &longer));

        let pattern = set.render(prefix, &c).unwrap();
        let with_suffix = [literal.as_slice(), b":", &suffix].concat();
        prop_assert!(redis_match(&pattern, &with_suffix));
        let other_with_suffix = [b"session:".as_slice(), &other, b":", &suffix].concat();
        // `other` may itself end in `:…` and so legitimately sit under the prefix.
        let under = other_with_suffix.starts_with(&[literal.as_slice(), b":"].concat());
        prop_assert_eq!(redis_match(&pattern, &other_with_suffix), under);
    }

    /// (2) A URL percent-decodes to the literal text and the raw value bytes, and a value never
    /// adds a URL delimiter.
    #[test]
    fn url_decodes_to_literal_and_value(x in bytes(), y in bytes()) {
        let c = Context::for_event(
            "r",
            &event(b"k"),
            &["x".to_owned(), "y".to_owned()],
            &[x.clone().into(), y.clone().into()],
            None,
        );
        let out = render("http://h:1/reload/{{ x }}?y={{ y }}&z=1", Escape::Url, &c);
        let decoded: Vec<u8> = percent_encoding::percent_decode(&out).collect();
        let want = [b"http://h:1/reload/".as_slice(), &x, b"?y=", &y, b"&z=1"].concat();
        prop_assert_eq!(decoded, want);
        let text = String::from_utf8(out).unwrap();
        prop_assert_eq!(text.matches('/').count(), 4);
        prop_assert_eq!(text.matches('?').count(), 1);
        prop_assert_eq!(text.matches('&').count(), 1);
        prop_assert!(!text.contains('#'));
    }

    /// (3) RedisKey reproduces arbitrary bytes exactly, in captures and in `key`.
    #[test]
    fn redis_key_round_trip(x in proptest::collection::vec(any::<u8>(), 0..64)) {
        let c = ctx(&x);
        prop_assert_eq!(render("{{ key }}", Escape::RedisKey, &c), x.clone());
        let out = render("p:{{ x }}:s", Escape::RedisKey, &c);
        prop_assert_eq!(out, [b"p:".as_slice(), &x, b":s"].concat());
    }

    /// (4) Chat output of arbitrary values never carries a mention or control sequence.
    #[test]
    fn chat_output_never_mentions(a in ".*", b in "[<@!a-z \"=_]*") {
        let c = Context::for_event(
            "r",
            &event(a.as_bytes()),
            &["a".to_owned(), "b".to_owned()],
            &[a.clone().into_bytes().into(), b.clone().into_bytes().into()],
            None,
        );
        for mode in [Escape::Slack, Escape::Text, Escape::Markdown] {
            let out = render_text("{{ a }}{{ b }} {{ b }}{{ a }}{{ key }}", mode, &c);
            for bad in ["<!", "<@", "<at"] {
                prop_assert!(!out.contains(bad), "{:?} {:?}: {:?}", mode, bad, out);
            }
            if mode != Escape::Slack {
                prop_assert!(!out.contains("@all"), "{:?}: {:?}", mode, out);
                prop_assert!(!out.chars().zip(out.chars().skip(1)).any(|(p, q)| p == '@' && q.is_ascii_alphanumeric()),
                    "{:?}: {:?}", mode, out);
            }
        }
    }
}

#[test]
fn shareable_across_tasks() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<TemplateSet>();
    assert_send_sync::<Context>();
}

// ---- plain templates, rendered without a context ---------------------------------------------

/// `render_plain` of `source` with the key and the one capture `x` of [`ctx_with`], beside what
/// minijinja renders from the full context.
fn plain_and_full(
    source: &str,
    escape: Escape,
    key: &[u8],
    x: &[u8],
) -> (Option<Vec<u8>>, Vec<u8>) {
    let mut set = TemplateSet::new();
    let id = set.add(source, escape).unwrap();
    let plain = set.render_plain(id, |name| match name {
        "key" => Some(key),
        "x" => Some(x),
        _ => None,
    });
    (plain, set.render(id, &ctx_with(key, x)).unwrap())
}

#[test]
fn only_literal_text_and_bare_names_are_plain() {
    for source in [
        "{{ x }}",
        "{{x}}",
        "delay:detail",
        "",
        "order:{{ x }}:{{ key }}\n",
        "a{b}c{{ x }}",
    ] {
        let (plain, full) = plain_and_full(source, Escape::RedisKey, b"k", b"42");
        assert_eq!(plain.as_deref(), Some(full.as_slice()), "{source:?}");
    }
    for source in [
        "{{ x | upper }}",
        "{{- x }}",
        "{{ x -}}",
        "{{ x ~ 'a' }}",
        "{{ captures.x }}",
        "{{ true }}",
        "{{ none }}",
        "{% if x %}{{ x }}{% endif %}",
        "{# note #}{{ x }}",
        "{% raw %}{{ x }}{% endraw %}",
        "{{ '}}' }}",
    ] {
        let (plain, _) = plain_and_full(source, Escape::RedisKey, b"k", b"42");
        assert_eq!(plain, None, "{source:?}");
    }
    // Glob-escaped values (a cleanup's `delete`) are plain too; a chat mode never is.
    let (plain, full) = plain_and_full("s:{{ x }}:*", Escape::Glob, b"k", b"*?[]\\");
    assert_eq!(plain.as_deref(), Some(full.as_slice()));
    assert_eq!(full, b"s:\\*\\?\\[\\]\\\\:*");
    let (plain, _) = plain_and_full("{{ x }}", Escape::Slack, b"k", b"<");
    assert_eq!(plain, None);
}

#[test]
fn verbatim_names_are_the_key_and_captures_the_context_does_not_shadow() {
    // `check` refuses a capture named like a context name; were there one, the context's
    // value is the one a template sees, so the plain path leaves such names to it.
    let key = b"task:\xffAB".to_vec();
    let names = ["rule".to_string(), "id".to_string(), "id".to_string()];
    let vals = [
        b"1".to_vec().into(),
        b"2".to_vec().into(),
        b"3".to_vec().into(),
    ];
    assert_eq!(verbatim("rule", &key, &names, &vals), None);
    assert_eq!(verbatim("key", &key, &names, &vals), Some(key.as_slice()));
    assert_eq!(
        verbatim("id", &key, &names, &vals),
        Some(b"3".as_slice()),
        "the last of two, as in the context"
    );
    assert_eq!(verbatim("missing", &key, &names, &vals), None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A plain template renders to the same bytes without a context as with one, for any key and
    /// capture bytes (not UTF-8, the byte-encoding's reserved characters, delimiters) and any
    /// literal text around them.
    #[test]
    fn plain_rendering_is_the_full_rendering(
        key in proptest::collection::vec(any::<u8>(), 0..32),
        x in proptest::collection::vec(any::<u8>(), 0..32),
        before in "[a-z:{}%#*?\\-\u{f700}-\u{f7ff} ]{0,8}",
        after in "[a-z:{}%#\\-\u{f700}-\u{f7ff}\n ]{0,8}",
    ) {
        for escape in [Escape::RedisKey, Escape::Raw, Escape::Glob] {
            let source = format!("{before}{{{{ x }}}}{after}{{{{key}}}}");
            let mut set = TemplateSet::new();
            // Random text may itself be a tag or a syntax error: only what compiles compares.
            let Ok(id) = set.add(&source, escape) else { continue };
            let plain = set.render_plain(id, |name| match name {
                "key" => Some(key.as_slice()),
                "x" => Some(x.as_slice()),
                _ => None,
            });
            if let Some(plain) = plain {
                prop_assert_eq!(plain, set.render(id, &ctx_with(&key, &x)).unwrap(), "{:?}", source);
            }
        }
    }
}
