"""`mxlaunch profile`: engine start-up logs → a timeline of fixed phases (`profiler`, the names in `model`),
statistics and tables over runs (`report`), running a command to profile it live (`live`) and the optional PNG
chart (`chart`, matplotlib). Reads logs through each engine's log format (`engines/`); imports no engine."""
