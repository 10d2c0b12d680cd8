"""Engine-specific knowledge outside the engine process. The registry of engines is engines/registry.py
(`ENGINES`, `detect`, `detect_engine`); the log formats by name are engines/log_formats.py. This package's
own import runs nothing (callers import the module that defines the name), so the plugin can use the light
modules without pulling in the argv mirrors."""
