#!/usr/bin/env python3
"""A local OAuth 2.0 client-credentials token endpoint for the SASL OAUTHBEARER tests.

    token-endpoint.py PORT [--dir DIR] [--lifetime SECONDS] [--client-id ID]
                           [--client-secret SECRET] [--audience AUD] [--issuer URL]

Started by `scripts/stack up oidc` (and by `up kafka` when KAFKA_OAUTH_PORT is set);
it stands in for a real identity provider (Keycloak, Entra ID, Okta) so the product's
librdkafka `sasl.oauthbearer.method=oidc` path meets a real broker. Python 3 standard
library and the `openssl` command only: nothing to pip install. Listens on 127.0.0.1.

  POST /token        grant_type=client_credentials[&scope=...] -> {"access_token": JWT, ...}
                     client authentication: HTTP Basic (what librdkafka sends) or the
                     form fields client_id / client_secret; anything else -> 401
  GET  /jwks         the public key as a JWK Set (also /.well-known/jwks.json): what the
                     broker's OAuthBearerValidatorCallbackHandler verifies tokens with
  GET  /.well-known/openid-configuration   discovery document, for tools that want one
  GET  /stats        {"issued": N, "refused": M} since this process started

Every token issued or refused is logged on stdout, one line each ("issued token #N ...",
"refused ..."), so a test can assert that a client fetched tokens and refreshed them.
"""

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote_plus


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_json(obj) -> str:
    return b64url(json.dumps(obj, separators=(",", ":")).encode())


class Signer:
    """RS256 with the openssl CLI: the standard library has no RSA, and pip is not an
    option. One subprocess per token is cheap at the rate clients refresh (80 % of the
    lifetime)."""

    def __init__(self, key_path: str):
        if not os.path.exists(key_path):
            # Kept on disk so a restarted endpoint (or a broker that cached the JWKS)
            # keeps verifying the tokens clients already hold.
            tmp = key_path + ".tmp"
            subprocess.run(["openssl", "genpkey", "-algorithm", "RSA",
                            "-pkeyopt", "rsa_keygen_bits:2048", "-out", tmp],
                           check=True, capture_output=True)
            os.chmod(tmp, 0o600)
            os.replace(tmp, key_path)
        self.key_path = key_path
        text = subprocess.run(["openssl", "rsa", "-in", key_path, "-noout", "-text"],
                              check=True, capture_output=True, text=True).stdout
        modulus = subprocess.run(["openssl", "rsa", "-in", key_path, "-noout", "-modulus"],
                                 check=True, capture_output=True, text=True).stdout
        n = int(modulus.strip().split("=", 1)[1], 16)
        e = int(next(l for l in text.splitlines() if l.startswith("publicExponent:")).split()[1])
        def be(i):
            return i.to_bytes((i.bit_length() + 7) // 8, "big")
        jwk = {"e": b64url(be(e)), "kty": "RSA", "n": b64url(be(n))}
        # RFC 7638 thumbprint as the kid: stable for the key, so the broker's cached JWKS
        # and a new key can never be confused.
        kid = b64url(hashlib.sha256(json.dumps(jwk, separators=(",", ":"), sort_keys=True).encode()).digest())
        self.kid = kid
        self.jwks = {"keys": [dict(jwk, kid=kid, use="sig", alg="RS256")]}

    def sign(self, claims: dict) -> str:
        header = {"alg": "RS256", "typ": "JWT", "kid": self.kid}
        signing_input = f"{b64url_json(header)}.{b64url_json(claims)}".encode()
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", self.key_path],
                             input=signing_input, check=True, capture_output=True).stdout
        return signing_input.decode() + "." + b64url(sig)


class Endpoint:
    def __init__(self, args):
        self.args = args
        self.signer = Signer(os.path.join(args.dir, "key.pem"))
        self.lock = threading.Lock()
        self.issued = 0
        self.refused = 0

    def log(self, msg: str):
        # One line per event with a wall-clock time: tests grep these.
        print(time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z " + msg, flush=True)


def client_credentials(headers, form):
    """(client_id, client_secret) from Basic auth or the form, (None, None) if neither.
    librdkafka sends `Authorization: Basic base64(id:secret)` without the form-encoding
    RFC 6749 2.3.1 asks for; decoding it anyway is harmless for plain ids and secrets."""
    auth = headers.get("Authorization", "")
    if auth[:6].lower() == "basic ":
        try:
            raw = base64.b64decode(auth[6:].strip(), validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            return None, None
        cid, sep, secret = raw.partition(":")
        return (unquote_plus(cid), unquote_plus(secret)) if sep else (None, None)
    if "client_id" in form:
        return form["client_id"][0], form.get("client_secret", [""])[0]
    return None, None


def make_handler(ep: Endpoint):
    a = ep.args

    class Handler(BaseHTTPRequestHandler):
        server_version = "clickagg-oidc/1"

        def reply(self, status, body, extra=()):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            for k, v in extra:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path in ("/jwks", "/.well-known/jwks.json"):
                self.reply(200, ep.signer.jwks)
            elif path == "/.well-known/openid-configuration":
                self.reply(200, {"issuer": a.issuer, "token_endpoint": a.base + "/token",
                                 "jwks_uri": a.base + "/jwks",
                                 "grant_types_supported": ["client_credentials"],
                                 "token_endpoint_auth_methods_supported":
                                     ["client_secret_basic", "client_secret_post"],
                                 "id_token_signing_alg_values_supported": ["RS256"]})
            elif path == "/stats":
                with ep.lock:
                    self.reply(200, {"issued": ep.issued, "refused": ep.refused})
            else:
                self.reply(404, {"error": "not_found"})

        def do_POST(self):
            if self.path.split("?", 1)[0] != "/token":
                return self.reply(404, {"error": "not_found"})
            length = int(self.headers.get("Content-Length") or 0)
            # librdkafka does not URL-encode the scope it appends; parse_qs keeps a raw
            # space, so "a b" still reads as two scopes.
            form = parse_qs(self.rfile.read(length).decode("utf-8", "replace"))
            cid, secret = client_credentials(self.headers, form)
            if cid != a.client_id or secret != a.client_secret:
                with ep.lock:
                    ep.refused += 1
                ep.log(f"refused client {cid!r}: {'no credentials' if cid is None else 'wrong id or secret'}")
                return self.reply(401, {"error": "invalid_client"},
                                  [("WWW-Authenticate", 'Basic realm="clickagg-oidc"')])
            grant = form.get("grant_type", [""])[0]
            if grant != "client_credentials":
                ep.log(f"refused grant_type {grant!r}")
                return self.reply(400, {"error": "unsupported_grant_type"})
            scope = form.get("scope", [a.scope])[0]
            now = int(time.time())
            claims = {"iss": a.issuer, "sub": cid, "aud": a.audience, "iat": now, "nbf": now,
                      "exp": now + a.lifetime, "jti": str(uuid.uuid4()), "scope": scope,
                      "client_id": cid}
            token = ep.signer.sign(claims)
            with ep.lock:
                ep.issued += 1
                n = ep.issued
            ep.log(f"issued token #{n} sub={cid} scope={scope!r} lifetime={a.lifetime}s exp={now + a.lifetime} jti={claims['jti']}")
            self.reply(200, {"access_token": token, "token_type": "Bearer",
                             "expires_in": a.lifetime, "scope": scope})

        def log_message(self, fmt, *args):
            pass  # the token lines above are the log; per-request lines would drown them

    return Handler


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("port", type=int)
    p.add_argument("--dir", default=".", help="where key.pem lives (created if missing)")
    p.add_argument("--lifetime", type=int, default=60, help="token lifetime in seconds")
    p.add_argument("--client-id", default="clickagg")
    p.add_argument("--client-secret", default="clickagg-oidc-secret")
    p.add_argument("--audience", default="clickagg-kafka")
    p.add_argument("--issuer", help="the iss claim (default http://127.0.0.1:PORT)")
    p.add_argument("--scope", default="kafka", help="scope claim when the client asks for none")
    a = p.parse_args()
    a.base = f"http://127.0.0.1:{a.port}"
    a.issuer = a.issuer or a.base
    os.makedirs(a.dir, exist_ok=True)
    ep = Endpoint(a)
    server = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(ep))
    ep.log(f"listening on {a.base}: token {a.base}/token, jwks {a.base}/jwks, "
           f"client {a.client_id}, audience {a.audience}, issuer {a.issuer}, lifetime {a.lifetime}s, kid {ep.signer.kid}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
