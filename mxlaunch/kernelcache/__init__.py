"""JIT kernel caches (torch.compile/Inductor, Triton, FlashInfer, DeepGEMM, the engines' cache roots), launcher
side and without torch: where each engine keeps them, the key and the node-local folders (`caches`), and one
checked tar archive per key in the artifact store (`archive`; the tar itself: `tarball`). `launch/kernel.py` runs them around a start."""
