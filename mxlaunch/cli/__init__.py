"""The command line: typer commands only (`mxlaunch launch`, `stage`, `profile`, `verify`, `bench`, `store`,
`cache`, `peers`, `zygotes`, `doctor`). Each command parses its options, calls the package that does the work,
and prints; nothing here is imported by another package (the in-engine side least of all).

`python -m mxlaunch.cli` and the `mxlaunch` console script both run `mxlaunch.cli.app:main`; this file imports
nothing, so importing a sibling (`mxlaunch.cli.common`) does not build every command.
"""
