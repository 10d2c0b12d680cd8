"""Host memory primitives that both sides share: the project's one libc binding (mmap, madvise), a file mapped
at a 2 MiB-aligned address, and the collapse of its blocks into 2 MiB pages (hugepages.py). Standard library
only, importing nothing else from mxlaunch: below staging/ and remote/ (the launcher's byte movement) and
plugin/ (inside the engine), which all take their page helpers from here."""
