//! The `email` channel end to end: the real binary, keys that really expire on a real
//! `redis-server`, and a real SMTP server (Python's aiosmtpd, `tests/common/smtp_server.py`) that
//! keeps each mail it accepts, decoded by Python's own mail parser, with STARTTLS or TLS from a
//! test CA, AUTH, and scripted answers to DATA (4xx, 5xx).
//!
//! Each test has its own servers and daemon, so the tests run in parallel.

use crate::common;

use common::{Daemon, Mail, PATIENCE, Rules, SmtpServer, TestPki, assert_no_secret};
use serde_json::Value;

const FROM: &str = "keywatch <keywatch@example.com>";

/// Rules with an email channel `mail` (its fields after `type`, indented) and one rule,
/// `order-lock`, on `order_lock:{order_id}`, with `rule_extra` lines in its `notify`.
fn rules(channel: &str, rule_extra: &str) -> String {
    format!(
        r#"
channels:
  mail:
    type: email
{channel}
rules:
  - name: order-lock
    match: "order_lock:{{order_id}}"
    notify:
      to: [mail]
      title: "Order lock {{{{ order_id }}}} expired"
      message: "Lock of order {{{{ order_id }}}} expired before it was released."
{rule_extra}"#
    )
}

/// The fields of a channel to `smtp` without TLS, to one recipient.
fn plain_channel(smtp: &SmtpServer) -> String {
    format!(
        "    smtp: \"smtp://127.0.0.1:{}\"\n    tls: none\n    from: \"{FROM}\"\n    to: oncall@example.com",
        smtp.port()
    )
}

/// Asserts `id` is `<32 hex digits . what . mail @example.com>`: made from the event id, the
/// action and the channel.
fn assert_message_id(id: &str, what: &str) {
    let left = id
        .strip_prefix('<')
        .and_then(|s| s.strip_suffix(&format!(".{what}.mail@example.com>")))
        .unwrap_or_else(|| panic!("Message-ID {id:?}"));
    assert!(
        left.len() == 32 && left.chars().all(|c| c.is_ascii_hexdigit()),
        "Message-ID {id:?}"
    );
}

fn assert_clean(m: &Mail) {
    assert!(m.defects.is_empty(), "{:?}\n{}", m.defects, m.raw_text());
    assert_eq!(
        m.parts.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(),
        ["text/plain", "text/html"],
        "{}",
        m.raw_text()
    );
}

/// The `attempted` event on `mail` that ended with `outcome`.
fn attempt_logged(daemon: &Daemon, outcome: &str) -> Value {
    daemon.attempt_on("mail", outcome)
}

/// The `dead_lettered` event of `mail`.
fn dead_letter_logged(daemon: &Daemon) -> Value {
    daemon.dead_letter_on("mail")
}

fn queue_is_empty(daemon: &Daemon) {
    common::wait_until("no job waits in the queue", PATIENCE, || {
        redis::cmd("ZCARD")
            .arg("keywatch:queue")
            .query::<i64>(&mut daemon.conn())
            .unwrap()
            == 0
    });
}

#[test]
fn an_expiry_arrives_as_a_mail_with_a_plain_and_an_html_part() {
    let smtp = SmtpServer::start();
    let channel = format!(
        "    smtp: \"smtp://127.0.0.1:{}\"\n    tls: none\n    from: \"{FROM}\"\n    to: [\"oncall@example.com\", \"Team Lead <lead@example.com>\"]",
        smtp.port()
    );
    let daemon = Daemon::start(&rules(&channel, ""));
    daemon.expire("order_lock:42");
    let m = smtp.wait_for_mails(1, PATIENCE).remove(0);
    assert_eq!(m.mail_from, "keywatch@example.com");
    assert_eq!(m.rcpt_tos, ["oncall@example.com", "lead@example.com"]);
    assert!(!m.tls && m.login.is_none());
    assert_eq!(m.header("Subject"), Some("Order lock 42 expired"));
    assert_eq!(m.header("From"), Some(FROM));
    let to = m.header("To").unwrap();
    assert!(
        to.starts_with("oncall@example.com, ")
            && to.contains("Team Lead")
            && to.ends_with(" <lead@example.com>"),
        "{to}"
    );
    assert_eq!(m.header("Auto-Submitted"), Some("auto-generated"));
    assert_eq!(m.header("X-Keywatch-Rule"), Some("order-lock"));
    assert_eq!(m.header("MIME-Version"), Some("1.0"));
    assert!(
        m.header("Content-Type")
            .is_some_and(|c| c.starts_with("multipart/alternative; boundary=\"keywatch-")),
        "{:?}",
        m.header("Content-Type")
    );
    assert_message_id(m.header("Message-ID").unwrap(), "notify");
    assert_clean(&m);
    assert_eq!(
        m.part("text/plain"),
        "Lock of order 42 expired before it was released.\n"
    );
    assert_eq!(
        m.part("text/html"),
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"></head><body>\n\
         <p>Lock of order 42 expired before it was released.</p>\n</body></html>\n"
    );
    let sent = attempt_logged(&daemon, "sent");
    assert_eq!(sent["answer"], "250 2.0.0 Ok: queued as 1", "{sent}");
    daemon.stop();
}

#[test]
fn a_digest_is_one_mail_with_a_list() {
    let smtp = SmtpServer::start();
    let yaml = rules(
        &plain_channel(&smtp),
        "      group: { window: 2s, max_items: 2 }\n",
    );
    let daemon = Daemon::start(&yaml);
    daemon.expire_all(&["order_lock:1", "order_lock:2", "order_lock:3"]);
    let m = smtp.wait_for_mails(1, PATIENCE).remove(0);
    assert_clean(&m);
    let subject = m.header("Subject").unwrap();
    assert!(
        subject.starts_with("Order lock ") && subject.ends_with(" expired"),
        "{subject}"
    );
    assert_message_id(
        &m.header("Message-ID")
            .unwrap()
            .replace(".digest.mail.3@", ".x.mail@"),
        "x",
    );
    let plain = m.part("text/plain");
    assert!(
        plain.starts_with("3 expired events:\n- Lock of order "),
        "{plain}"
    );
    assert!(plain.ends_with("\n… and 1 more\n"), "{plain}");
    assert_eq!(plain.matches("\n- Lock of order ").count(), 2, "{plain}");
    let html = m.part("text/html");
    assert!(
        html.contains("<p>3 expired events:</p>\n<ul>\n<li>Lock of order "),
        "{html}"
    );
    assert_eq!(html.matches("<li>").count(), 2, "{html}");
    assert!(html.contains("</ul>\n<p>… and 1 more</p>"), "{html}");
    // One mail for the window, nothing after it.
    queue_is_empty(&daemon);
    assert_eq!(smtp.datas(), 1);
    daemon.stop();
}

#[test]
fn a_hostile_key_cannot_add_headers_recipients_or_markup() {
    let smtp = SmtpServer::start();
    let daemon = Daemon::start(&rules(&plain_channel(&smtp), ""));
    let mut key = b"order_lock:<script>alert(1)</script>\r\nBcc: evil@example.net\r\n\r\n<a href=\"http://evil.com\">x</a>\xe2\x80\xae\xff".to_vec();
    key.extend(std::iter::repeat_n(b'k', 300_000));
    daemon.expire(&key[..]);
    let m = smtp.wait_for_mails(1, PATIENCE).remove(0);
    assert_clean(&m);
    assert_eq!(m.rcpt_tos, ["oncall@example.com"]);
    assert!(m.header("Bcc").is_none(), "{:?}", m.headers);
    let names: Vec<&str> = m.headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "From",
            "Subject",
            "Date",
            "Message-ID",
            "Auto-Submitted",
            "X-Keywatch-Rule",
            "To",
            "MIME-Version",
            "Content-Type"
        ]
    );
    let subject = m.header("Subject").unwrap();
    assert!(subject.starts_with("Order lock <\u{200B}script>alert(1)<\u{200B}/script>\\r\\nBcc: evil@\u{200B}example.\u{200B}net"), "{subject}");
    assert!(
        !subject.contains('\u{202E}') && !subject.contains(['\r', '\n']),
        "{subject:?}"
    );
    assert_eq!(subject.chars().count(), 201, "{subject}");
    assert!(subject.ends_with('…'));
    // Every header line of the raw mail is bounded (folded), whatever the key's length.
    let head = m.raw_text();
    let head = &head[..head.find("\r\n\r\n").unwrap()];
    assert!(head.lines().all(|l| l.len() <= 998), "{head}");

    let html = m.part("text/html");
    assert!(
        !html.contains("<script") && !html.contains("<a href=\"http://evil"),
        "{html}"
    );
    assert!(html.contains("&lt;\u{200B}script&gt;alert(1)&lt;\u{200B}/script&gt;"));
    assert!(html.contains("http:\u{200B}//evil.\u{200B}com"));
    assert!(!html.contains('\u{202E}'));
    let plain = m.part("text/plain");
    assert!(
        plain.contains("\\r\\nBcc: evil@\u{200B}example.\u{200B}net\\r\\n\\r\\n"),
        "{}",
        &plain[..200]
    );
    assert!(plain.contains('\u{FFFD}') && !plain.contains('\u{202E}'));
    // The capture (the key after `order_lock:`) is shown by its cut view, saying how long it
    // is (docs/reliability.md#bounded-whatever-the-key).
    let capture = key.len() - "order_lock:".len();
    assert!(
        plain.len() < 8_000 && plain.contains(&format!("[{capture} bytes, sha256 ")),
        "{}",
        plain.len()
    );
    daemon.stop();
}

/// Mail clients make links of bare host names as well as of `http://`: in key text neither is
/// one, in the subject, the plain part or the HTML part (docs/rules.md#email).
#[test]
fn a_key_that_looks_like_a_link_mention_or_command_is_none_of_them() {
    let smtp = SmtpServer::start();
    let daemon = Daemon::start(&rules(&plain_channel(&smtp), ""));
    daemon.expire(
        "order_lock:evil.com/login http://x <a href=x> @all <!channel> /start a\u{202E}b\u{7}c",
    );
    let m = smtp.wait_for_mails(1, PATIENCE).remove(0);
    assert_clean(&m);
    let shown = "evil.\u{200B}com/login http:\u{200B}//x <\u{200B}a href=x> @\u{200B}all <\u{200B}!channel> /start";
    // Control and bidi characters are shown as `\u202E`, as in every channel's text.
    assert_eq!(
        m.header("Subject").unwrap(),
        format!("Order lock {shown} a\\u202Eb\\u0007c expired")
    );
    assert_eq!(
        m.part("text/plain"),
        format!("Lock of order {shown} a\\u202Eb\\u0007c expired before it was released.\n")
    );
    let html_shown = "evil.\u{200B}com/login http:\u{200B}//x &lt;\u{200B}a href=x&gt; @\u{200B}all &lt;\u{200B}!channel&gt; /start";
    assert_eq!(
        m.part("text/html"),
        format!(
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"></head><body>\n\
             <p>Lock of order {html_shown} a\\u202Eb\\u0007c expired before it was released.</p>\n</body></html>\n"
        )
    );
    daemon.stop();
}

#[test]
fn a_550_is_dead_lettered_at_once() {
    let smtp = SmtpServer::builder()
        .reply("550 5.7.1 Message content rejected")
        .start();
    let daemon = Daemon::start(&rules(&plain_channel(&smtp), ""));
    daemon.expire("order_lock:7");
    let dead = dead_letter_logged(&daemon);
    let text = dead.to_string();
    assert!(
        text.contains("550") && text.contains("Message content rejected"),
        "{dead}"
    );
    queue_is_empty(&daemon);
    // The server's report of the DATA it refused may trail keywatch's dead letter.
    smtp.wait_for_event("the refused DATA", PATIENCE, |e| e["data"] == 1);
    assert_eq!(smtp.datas(), 1, "the 550 was retried: {:?}", smtp.events());
    assert!(smtp.mails().is_empty());
    daemon.stop();
}

#[test]
fn a_451_is_retried_and_the_retry_carries_the_same_message_id() {
    let smtp = SmtpServer::builder()
        .reply("451 4.3.0 Try again later")
        .start();
    let daemon = Daemon::start(&rules(&plain_channel(&smtp), ""));
    daemon.expire("order_lock:8");
    let retry = attempt_logged(&daemon, "retry");
    assert!(retry.to_string().contains("451"), "{retry}");
    let m = smtp.wait_for_mails(1, PATIENCE).remove(0);
    // The server reports each DATA on its own line, which may trail the mail's file.
    smtp.wait_for_event("the accepted DATA", PATIENCE, |e| e["data"] == 2);
    assert_eq!(smtp.datas(), 2);
    let first = smtp.wait_for_event("the refused DATA", PATIENCE, |e| e["data"] == 1);
    assert_eq!(first["reply"], "451 4.3.0 Try again later");
    assert_eq!(
        first["message_id"].as_str(),
        m.header("Message-ID"),
        "the retry is recognisably the same mail"
    );
    assert_eq!(m.header("Subject"), Some("Order lock 8 expired"));
    daemon.stop();
}

#[test]
fn a_server_that_is_down_is_retried_until_it_is_up() {
    let closed = common::ports::closed_port();
    let port = closed.port;
    let channel = format!(
        "    smtp: \"smtp://127.0.0.1:{port}\"\n    tls: none\n    timeout: 2s\n    from: \"{FROM}\"\n    to: oncall@example.com"
    );
    let daemon = Daemon::start(&rules(&channel, ""));
    daemon.expire("order_lock:9");
    let retry = attempt_logged(&daemon, "retry");
    assert!(retry.to_string().contains("Connection"), "{retry}");
    drop(closed);
    let smtp = SmtpServer::builder().port(port).start();
    let m = smtp.wait_for_mails(1, PATIENCE).remove(0);
    assert_eq!(m.header("Subject"), Some("Order lock 9 expired"));
    daemon.stop();
}

// ---------------------------------------------------------------------------------------------
// TLS and AUTH, through `keywatch send-test`

/// A channel `mail` to `smtp` with `fields`, for `send-test`.
fn send_test(fields: &str, envs: &[(&str, &str)]) -> (i32, String, String) {
    let rules = Rules::new(&rules(fields, ""));
    let out = rules.run(&["send-test", "mail"], envs);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn starttls_with_auth_delivers_and_send_test_says_what_the_server_answered() {
    let pki = TestPki::generate();
    let smtp = SmtpServer::builder()
        .starttls(&pki.server_cert_file(), &pki.server_key_file())
        .login("keywatch", "s3cret-Passw0rd")
        .start();
    let fields = format!(
        "    smtp: \"smtp://127.0.0.1:{}\"\n    username: keywatch\n    password: \"${{SMTP_PASSWORD}}\"\n    ca_file: \"{}\"\n    from: \"{FROM}\"\n    to: oncall@example.com",
        smtp.port(),
        pki.ca_file().display()
    );
    let (code, stdout, stderr) = send_test(&fields, &[("SMTP_PASSWORD", "s3cret-Passw0rd")]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(
        stdout.trim(),
        format!(
            "sent to mail (email → smtp://127.0.0.1:{} (STARTTLS, AUTH) to oncall@example.com): 250 2.0.0 Ok: queued as 1",
            smtp.port()
        )
    );
    let m = smtp.mails().remove(0);
    assert!(m.tls, "the mail went without TLS");
    assert_eq!(m.login.as_deref(), Some("keywatch"));
    assert_eq!(m.header("Subject"), Some("keywatch test message"));
    assert!(
        m.part("text/plain")
            .starts_with("This is a test message from keywatch send-test")
    );
    assert_clean(&m);
}

#[test]
fn a_wrong_password_is_given_up_and_never_shown_even_when_the_server_echoes_it() {
    let pki = TestPki::generate();
    let smtp = SmtpServer::builder()
        .starttls(&pki.server_cert_file(), &pki.server_key_file())
        .login("keywatch", "the-right-one")
        .start();
    // Written inline: only the channel's own masking stands between it and the output.
    let password = "Wr0ng-Passw0rd";
    let fields = format!(
        "    smtp: \"smtp://127.0.0.1:{}\"\n    username: keywatch\n    password: \"{password}\"\n    ca_file: \"{}\"\n    from: \"{FROM}\"\n    to: oncall@example.com",
        smtp.port(),
        pki.ca_file().display()
    );
    let (code, stdout, stderr) = send_test(&fields, &[]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        stderr.contains("535") && stderr.contains("keywatch would not retry this"),
        "{stderr}"
    );
    let event = smtp.wait_for_event("the refused AUTH", PATIENCE, |e| e["ok"] == false);
    assert_eq!(event["login"], "keywatch");
    use base64::Engine;
    let blob = base64::engine::general_purpose::STANDARD.encode(format!("\0keywatch\0{password}"));
    for text in [&stdout, &stderr] {
        assert_no_secret("send-test output", text, &[password, &blob]);
    }
    assert!(stderr.contains("<secret>"), "{stderr}");
    assert!(smtp.mails().is_empty());
}

#[test]
fn smtp_without_starttls_is_refused_unless_tls_none() {
    let smtp = SmtpServer::start();
    let fields = format!(
        "    smtp: \"smtp://127.0.0.1:{}\"\n    from: \"{FROM}\"\n    to: oncall@example.com",
        smtp.port()
    );
    let (code, stdout, stderr) = send_test(&fields, &[]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        stderr.contains("STARTTLS is not supported")
            && stderr.contains("keywatch would retry this"),
        "{stderr}"
    );
    assert_eq!(smtp.datas(), 0);
    assert!(smtp.mails().is_empty());
}

#[test]
fn a_certificate_of_another_ca_is_refused() {
    let pki = TestPki::generate();
    let other = TestPki::generate();
    let smtp = SmtpServer::builder()
        .starttls(&pki.server_cert_file(), &pki.server_key_file())
        .start();
    let fields = format!(
        "    smtp: \"smtp://127.0.0.1:{}\"\n    ca_file: \"{}\"\n    from: \"{FROM}\"\n    to: oncall@example.com",
        smtp.port(),
        other.ca_file().display()
    );
    let (code, stdout, stderr) = send_test(&fields, &[]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        stderr.contains("TLS failed") && stderr.contains("keywatch would retry this"),
        "{stderr}"
    );
    assert!(smtp.mails().is_empty());
}

#[test]
fn smtps_is_tls_from_the_first_byte() {
    let pki = TestPki::generate();
    let smtp = SmtpServer::builder()
        .implicit_tls(&pki.server_cert_file(), &pki.server_key_file())
        .login("keywatch", "s3cret-Passw0rd")
        .start();
    // Credentials in the URL's user info, percent-encoded.
    let fields = format!(
        "    smtp: \"smtps://keywatch:s3cret%2DPassw0rd@127.0.0.1:{}\"\n    ca_file: \"{}\"\n    from: \"{FROM}\"\n    to: oncall@example.com",
        smtp.port(),
        pki.ca_file().display()
    );
    let (code, stdout, stderr) = send_test(&fields, &[]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!(
            "(email → smtps://127.0.0.1:{} (TLS, AUTH) to oncall@example.com): 250 ",
            smtp.port()
        )),
        "{stdout}"
    );
    let m = smtp.mails().remove(0);
    assert!(m.tls);
    assert_eq!(m.login.as_deref(), Some("keywatch"));
}

#[test]
fn explain_shows_the_relay_without_its_credentials() {
    let rules = Rules::new(&rules(
        "    smtp: \"smtps://keywatch:url-Passw0rd@relay.example.com\"\n    from: \"keywatch <keywatch@example.com>\"\n    to: [oncall@example.com]",
        "",
    ));
    let out = rules.run(&["explain", "order_lock:42"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "notify mail (email → smtps://relay.example.com:465 (TLS, AUTH) to oncall@example.com, rate 30/1m)"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("title: Order lock 42 expired"), "{stdout}");
    assert_no_secret("explain", &stdout, &["url-Passw0rd"]);
}
