"""`python -m mxlaunch.cli`."""

from mxlaunch.cli.app import main

main()
