"""What mxlaunch believes on a shared node (docs/security.md): `trust` — whose code it accepts from the store
(the user alone unless MXLAUNCH_TRUSTED_WRITERS names others; a file judged on its own descriptor); `redact` —
one redaction of secrets (URLs, secret options, secret variables, a launch's own values) for every output;
`ownership` — which names in shared places (/dev/shm, /tmp) are this user's own, and the one opener that judges
a descriptor before it is used; `logfile` — the launcher's and the zygote's log files (0600, never written through
a planted name). Imports only settings, errors and the engines' option tables; every other side may import it."""
