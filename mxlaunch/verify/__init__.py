"""`mxlaunch verify`: record a server's prompt logprobs and greedy continuations as gold, and compare a server
against it (`run`), with the gold file's format (`gold`), one prompt's scoring (`scorer`), position-by-position
comparison (`compare`), prompt fitting to a context (`fit`) and the prompt set (`prompts`). Talks HTTP only
(`mxlaunch.http`); never imports an engine."""
