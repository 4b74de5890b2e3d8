//! Renders per second of the two templates an event storm renders most: a chat message and a
//! reload URL. Run with `cargo bench --bench template`.

use std::hint::black_box;

use chrono::Utc;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use keywatch::event::{EventKind, KeyEvent};
use keywatch::template::{Context, Escape, TemplateSet};

fn context() -> Context {
    let now = Utc::now();
    let event = KeyEvent {
        kind: EventKind::Expired,
        db: 0,
        key: bytes::Bytes::from_static(b"cache:10042:profile"),
        field: None,
        observed_at: now,
        deadline: Some(now - chrono::Duration::milliseconds(12)),
        ttl_ms: None,
        recovered: false,
        source: "127.0.0.1:6379".to_owned(),
        place: None,
    };
    Context::for_event(
        "cache-prewarm",
        &event,
        &["user_id".to_owned(), "kind".to_owned()],
        &[
            bytes::Bytes::from_static(b"10042"),
            bytes::Bytes::from_static(b"profile"),
        ],
        None,
    )
}

fn bench(c: &mut Criterion) {
    let mut set = TemplateSet::new();
    let message = set
        .add(
            "**{{ rule }}**: key `{{ key }}` {{ event }} (db {{ db }}, deadline {{ deadline }}, \
             {{ late_ms }} ms late). Cache {{ kind }} of user {{ user_id }} will be rebuilt.",
            Escape::Markdown,
        )
        .expect("message compiles");
    let url = set
        .add(
            "http://127.0.0.1:8080/reload/{{ kind }}/{{ user_id }}?db={{ db }}",
            Escape::Url,
        )
        .expect("url compiles");
    let ctx = context();

    let mut group = c.benchmark_group("template");
    group.throughput(Throughput::Elements(1));
    group.bench_function("chat_message_markdown", |b| {
        b.iter(|| {
            set.render_text(black_box(message), black_box(&ctx))
                .unwrap()
        })
    });
    group.bench_function("reload_url", |b| {
        b.iter(|| set.render(black_box(url), black_box(&ctx)).unwrap())
    });
    group.bench_function("context_for_event", |b| b.iter(context));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
