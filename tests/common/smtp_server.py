"""A real SMTP server for the email tests: aiosmtpd on a loopback port, driven by tests/common/smtp_server.rs.

Each mail it accepts is written to --dir as NNNN.eml (the bytes received after DATA) and NNNN.json
(the envelope, the login, whether TLS was on, and the headers and parts as Python's own mail parser
decodes them), renamed into place whole. Every DATA and AUTH is
reported on stdout as one JSON line, flushed, so the test can wait for it. The first line is
{"ready": PORT} once the socket listens.

--reply LINE (repeatable) answers the next DATA with LINE instead of accepting it, in order; after
the last one, mails are accepted with "250 2.0.0 Ok: queued as N". --user/--password require AUTH
with those credentials; a wrong password is refused with a 535 that echoes what the client sent,
as careless servers do, so the test can check keywatch masks it.
"""

import argparse
import asyncio
import base64
import email
import email.policy
import json
import os
import socket
import ssl
import sys

from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword


def say(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Handler:
    def __init__(self, directory, replies):
        self.directory = directory
        self.replies = list(replies)
        self.datas = 0
        self.accepted = 0

    async def handle_DATA(self, server, session, envelope):
        self.datas += 1
        if self.replies:
            reply = self.replies.pop(0)
            parsed = email.message_from_bytes(envelope.original_content, policy=email.policy.default)
            say(data=self.datas, reply=reply, message_id=str(parsed["Message-ID"]))
            return reply
        self.accepted += 1
        n = self.accepted
        stem = os.path.join(self.directory, "%04d" % n)
        meta = {
            "mail_from": envelope.mail_from,
            "rcpt_tos": envelope.rcpt_tos,
            "login": session.auth_data.login.decode() if isinstance(session.auth_data, LoginPassword) else None,
            "tls": server.transport.get_extra_info("ssl_object") is not None,
        }
        # Decoded by Python's own mail parser, independently of lettre: what a mail client shows.
        parsed = email.message_from_bytes(envelope.original_content, policy=email.policy.default)
        meta["headers"] = [[k, str(v)] for k, v in parsed.items()]
        meta["parts"] = [
            {"type": part.get_content_type(), "text": part.get_content().replace("\r\n", "\n")}
            for part in parsed.walk()
            if not part.is_multipart()
        ]
        meta["defects"] = [repr(d) for part in parsed.walk() for d in part.defects]
        for suffix, data in ((".eml", envelope.original_content), (".json", json.dumps(meta).encode())):
            with open(stem + suffix + ".tmp", "wb") as f:
                f.write(data)
            os.rename(stem + suffix + ".tmp", stem + suffix)
        reply = "250 2.0.0 Ok: queued as %d" % n
        say(data=self.datas, reply=reply, accepted=n)
        return reply


def authenticator(user, password):
    def check(server, session, envelope, mechanism, auth_data):
        if not isinstance(auth_data, LoginPassword):
            return AuthResult(success=False, handled=False)
        login, given = auth_data.login.decode(), auth_data.password.decode()
        ok = login == user and given == password
        say(auth=mechanism, login=login, ok=ok)
        if ok:
            return AuthResult(success=True, auth_data=auth_data)
        blob = base64.b64encode(b"\0" + auth_data.login + b"\0" + auth_data.password).decode()
        return AuthResult(
            success=False,
            handled=False,
            message="535 5.7.8 Authentication failed for %s with password %s (AUTH PLAIN %s)" % (login, given, blob),
        )

    return check


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dir", required=True)
    p.add_argument("--reply", action="append", default=[])
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--implicit-tls", action="store_true")
    p.add_argument("--user")
    p.add_argument("--password")
    a = p.parse_args()

    context = None
    if a.cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(a.cert, a.key)
    options = {"hostname": "smtp.test", "enable_SMTPUTF8": True}
    if context is not None and not a.implicit_tls:
        options.update(tls_context=context, require_starttls=True)
    if a.user:
        options.update(auth_required=True, authenticator=authenticator(a.user, a.password))
        # aiosmtpd only counts STARTTLS as TLS; with implicit TLS the whole connection is.
        if a.implicit_tls:
            options.update(auth_require_tls=False)
    handler = Handler(a.dir, a.reply)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", a.port))
    sock.listen(16)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SMTP(handler, **options),
        sock=sock,
        ssl=context if a.implicit_tls else None,
    )
    say(ready=sock.getsockname()[1])
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
