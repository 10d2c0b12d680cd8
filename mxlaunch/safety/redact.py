"""The one redaction for everything mxlaunch prints or writes: events, --json, the plan, manifests, logs.

What counts as a secret:
- in a URL: the password of `user:pass@` (a lone `token@` userinfo too) and the value of every query key that
  names a secret (`?password=`, `?token=`, `?X-Amz-Signature=`, ...);
- on a command line: the value(s) of every option that names a secret — by the rule below, applied to each
  engine's own option table (vLLM: --api-key, --hf-token; SGLang: --api-key, --admin-api-key,
  --ssl-keyfile-password) and to options no table knows (`--token`), as `--flag value` or `--flag=value`;
- in an environment: the value of every variable that names a secret (HF_TOKEN, VLLM_API_KEY, ...).

A name names a secret when its last word (split at `-`, `_`, `.` and camelCase) is one of SECRET_WORDS or ends in
key/token/password/secret (`apikey`), unless the word before it counts (`--bucket-time-to-first-token`): `--ssl-keyfile`, `--max-num-batched-tokens` or `--long-prefill-token-threshold`
do not. Redaction is for output only: the engine gets the real argv and environment.

Structure is not always there (an engine prints its own arguments: SGLang logs its server_args with the API key),
so `secret_values` collects the actual values of a launch's secrets and every function here also replaces those
wherever they appear in free text; `Scrubber` does it on the engine's byte stream (engine.log).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Optional, Sequence
from urllib.parse import unquote

MASK = "***"
SECRET_WORDS = frozenset({"key", "apikey", "token", "password", "passwd", "pwd", "secret", "signature", "sig",
                          "credential", "credentials"})
_SECRET_ENDINGS = ("key", "token", "password", "secret")
# not derivable from a name: vLLM redacts --watermark-config in its own log (its watermark key)
EXTRA_SECRET_FLAGS = frozenset({"--watermark-config"})
MIN_SCRUB = 4  # shorter values are not searched for in free text (a 1-3 character "secret" would mangle every line)
_COUNTING = frozenset({"per", "first", "last", "next", "max", "min", "num"})
_NOT_SECRET = frozenset({"true", "false", "none", "null", "auto", "yes"})

_WORDS = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def names_secret(name: str) -> bool:
    """Does an option, query key or variable name a secret (by its last word)?"""
    words = [w.lower() for w in _WORDS.split(name) if w]
    if not words:
        return False
    last = words[-1]
    if len(words) > 1 and words[-2] in _COUNTING:  # --kt-max-deferred-experts-per-token: a count of tokens
        return False
    return last in SECRET_WORDS or last.endswith(_SECRET_ENDINGS)


def _tables() -> dict[str, str]:
    """Every engine's long options → arity ("0", "1", "?", "*", "+"), merged (one engine's secret is another's)."""
    from mxlaunch.engines import sglang_flags, vllm_flags

    merged: dict[str, str] = {}
    for table in (sglang_flags.OPTIONS, vllm_flags.OPTIONS):
        merged.update(table)
    return merged


_OPTIONS: Optional[dict[str, str]] = None


def _options() -> dict[str, str]:
    global _OPTIONS
    if _OPTIONS is None:
        _OPTIONS = _tables()
    return _OPTIONS


def secret_flags() -> frozenset[str]:
    """The engines' options that take a secret (from their option tables), plus EXTRA_SECRET_FLAGS."""
    return frozenset(f for f, arity in _options().items()
                     if arity != "0" and (names_secret(f) or f in EXTRA_SECRET_FLAGS))


def _flag_arity(flag: str) -> Optional[str]:
    """The arity of a secret option (None: not a secret). Underscores count as dashes (vLLM takes --api_key), and
    an abbreviation that only secret options start with is one of them (argparse's allow_abbrev)."""
    name = flag.replace("_", "-")
    opts = _options()
    if name in opts:
        return opts[name] if opts[name] != "0" and (names_secret(name) or name in EXTRA_SECRET_FLAGS) else None
    if names_secret(name):
        return "1"
    longer = [o for o in opts if o.startswith(name)] if len(name) > 3 else []
    if longer and all(opts[o] != "0" and (names_secret(o) or o in EXTRA_SECRET_FLAGS) for o in longer):
        return opts[longer[0]]
    return None


# ---- URLs -------------------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """The URL with its userinfo password (a lone userinfo: all of it) and secret query values masked; every other
    character as it was."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = len(rest)
    for ch in "/?#":
        k = rest.find(ch)
        if k != -1:
            end = min(end, k)
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _pw = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{MASK}@{host}"
    path, q, query = tail.partition("?")
    if q:
        query, hashmark, fragment = query.partition("#")
        parts = []
        for part in query.split("&"):
            name, eq, value = part.partition("=")
            parts.append(f"{name}={MASK}" if eq and value and names_secret(unquote(name)) else part)
        tail = path + "?" + "&".join(parts) + hashmark + fragment
    return f"{scheme}://{netloc}{tail}"


def _url_secrets(url: str) -> list[str]:
    """The secret parts of one URL (as written, and unquoted)."""
    found: list[str] = []
    _, sep, rest = url.partition("://")
    if not sep:
        return found
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in netloc:
        userinfo = netloc.rpartition("@")[0]
        user, colon, pw = userinfo.partition(":")
        found.append(pw if colon else user)
    if "?" in rest:
        for part in rest.split("?", 1)[1].split("#", 1)[0].split("&"):
            name, eq, value = part.partition("=")
            if eq and value and names_secret(unquote(name)):
                found.append(value)
    return found + [unquote(v) for v in found if unquote(v) != v]


# ---- text, argv, environments, documents --------------------------------------------------------------------


def _flag_pattern() -> re.Pattern[str]:
    names = sorted(secret_flags() | {"--token", "--password"}, key=len, reverse=True)
    return re.compile(r"(?<![\w-])(" + "|".join(re.escape(n) for n in names) + r")(=|\s+)(?!-)(\S+)")


_FLAGS: Optional[re.Pattern[str]] = None


def redact_text(text: str, known: Iterable[str] = ()) -> str:
    """Free text (a reason, a command line joined with spaces, a log line): URLs redacted, the value after a
    secret option masked, and every known secret value replaced."""
    global _FLAGS
    if _FLAGS is None:
        _FLAGS = _flag_pattern()
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    text = _FLAGS.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    for value in sorted(set(known), key=len, reverse=True):
        if value and value in text:
            text = text.replace(value, MASK)
    return text


def redact_argv(argv: Sequence[str], known: Iterable[str] = ()) -> list[str]:
    """A command line with every secret option's value(s) masked (`--flag V`, `--flag V1 V2` for a list option,
    `--flag=V`) and URLs and known values redacted in every other token."""
    known = tuple(known)
    out: list[str] = []
    k = 0
    argv = [str(a) for a in argv]
    while k < len(argv):
        tok = argv[k]
        k += 1
        if not tok.startswith("-") or tok == "--":
            out.append(redact_text(tok, known))
            continue
        flag, eq, value = tok.partition("=")
        arity = _flag_arity(flag) if flag.startswith("--") else None
        if arity is None:
            out.append(redact_text(tok, known))
            continue
        if eq:
            out.append(f"{flag}={MASK}")
            continue
        out.append(tok)
        taken = 0
        while k < len(argv) and not argv[k].startswith("-") and (arity in ("*", "+") or taken == 0):
            out.append(MASK)
            k += 1
            taken += 1
    return out


def redact_env(env: Mapping[str, str], known: Iterable[str] = ()) -> dict[str, str]:
    """Variables that name a secret masked, URLs and known values in the others redacted."""
    known = tuple(known)
    return {k: (MASK if names_secret(k) and v else redact_text(str(v), known)) for k, v in env.items()}


def _secret_key(name: object) -> bool:
    """A document's key that names a secret; a bare "key" is mxlaunch's own cache or snapshot key, not one."""
    return isinstance(name, str) and name.lower() != "key" and names_secret(name)


def redact(obj: Any, known: Iterable[str] = ()) -> Any:
    """A JSON-like document (an event's fields, a plan, a manifest) redacted: a key that names a secret has its
    value masked, a list of strings is read as a command line, every other string as free text."""
    known = tuple(known)
    if isinstance(obj, Mapping):
        return {k: (MASK if _secret_key(k) and isinstance(v, (str, list, tuple)) and v else redact(v, known))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(v, str) for v in obj):
            return redact_argv(obj, known)
        return [redact(v, known) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj, known)
    return obj


# ---- the values of one launch's secrets ---------------------------------------------------------------------


def secret_values(argv: Sequence[str] = (), environ: Optional[Mapping[str, str]] = None,
                  urls: Iterable[Optional[str]] = ()) -> frozenset[str]:
    """The actual secrets of a launch (at least MIN_SCRUB characters): secret option values in `argv`, the secret
    parts of every URL in argv, `urls` and the environment's values, and the variables that name a secret."""
    found: list[str] = []
    argv = [str(a) for a in argv]
    redacted = redact_argv(argv)
    if len(redacted) == len(argv):
        found += [a for a, r in zip(argv, redacted) if r == MASK]
    for tok in argv:
        flag, eq, value = tok.partition("=")
        if eq and flag.startswith("--") and _flag_arity(flag) is not None:
            found.append(value)
    texts = list(argv) + [u for u in urls if u]
    if environ is not None:
        for name, value in environ.items():
            if names_secret(name):
                found.append(value)
            texts.append(value)
    for text in texts:
        for m in _URL.finditer(text):
            found += _url_secrets(m.group(0))
    return frozenset(v for v in found if len(v) >= MIN_SCRUB and v.lower() not in _NOT_SECRET)


class Scrubber:
    """Known secret values replaced in a byte stream (the engine's output on its way to engine.log). A value cut
    between two chunks is caught: the unfinished end of the last line is held back until the next chunk (at most
    the longest value less one byte); `end()` returns what is still held."""

    def __init__(self, known: Iterable[str]) -> None:
        self.values = sorted({v.encode() for v in known if v}, key=len, reverse=True)
        self.keep = max((len(v) for v in self.values), default=1) - 1
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        if not self.values:
            return data
        buf = self.held + data
        for value in self.values:
            buf = buf.replace(value, MASK.encode())
        brk = max(buf.rfind(b"\n"), buf.rfind(b"\r")) + 1
        cut = max(brk, len(buf) - self.keep)
        self.held = buf[cut:]
        return buf[:cut]

    def end(self) -> bytes:
        held, self.held = self.held, b""
        return held
