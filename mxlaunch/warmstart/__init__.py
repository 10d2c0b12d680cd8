"""Warm start-up state: what lets an engine start without starting from nothing.

It owns the warm interpreter's launcher side (zygote.py, zygote_env.py its key's environment, zygote_starts.py one
launch's use of zygotes), zygote images (zygote_image.py), CRIU (criu.py) and the CUDA driver's checkpoint API
(cuda_checkpoint.py), whether a node can checkpoint at all (engine_checkpoint.py, for `mxlaunch doctor`), engine
snapshots (engine_snapshot.py their folder, engine_tree.py, snapshot_take.py, snapshot_maker.py and
snapshot_restore.py the mechanics, engine_snapshots.py one launch's use, snapshot_plan.py the plan's
answer, lean_snapshot.py without weights or KV cache), their keys (snapshot_key.py), the files they hold or keep
(held_files.py, snapshot_files.py — which CRIU runs with the standard library only), their checksums
(image_sums.py), their staging into /dev/shm before a restore (image_stage.py) and the seccomp filter that keeps io_uring out of a dumpable engine (no_io_uring.py).

It may import what every side shares (contract.py for the protocols the in-engine plugin answers, fileutil.py,
settings.py, plan.py), safety/ (ownership.py: names in shared places that must be this user's own; logfile.py:
its log files), store/ for where images live (store/zygote_images.py), staging/ for the readers that copy them, engines/ for an engine's facts
(engines/environment.py), and from launch/ only, for annotations, the plan's types (launch/decide.py). launch/ (the plan and the supervisor), cli/ and doctor.py import it. The plugin
(plugin/zygote.py, snapshot_signal.py, weight_refill.py: the same jobs' in-engine half) never imports it, nor it
the plugin: the two halves share contract.py. Callers import the module that defines the name: this file
re-exports nothing.
"""
