"""mxlaunch: fast, verified cold starts for SGLang and vLLM."""

__version__ = "0.1.0"
