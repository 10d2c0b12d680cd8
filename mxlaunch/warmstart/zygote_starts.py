"""One launch's use of zygotes (`--zygote`): fork the engine from a waiting zygote, or from one restored from its
CRIU image, else spawn it and start a zygote for the next start once this one is ready (and, where CRIU runs,
have that zygote dumped into the store: warmstart/zygote_image.py). The launcher (launch/run.py) calls `fork`
before spawning, `start_next` once ready and `abandon` when it stops; every decision is a `zygote` or
`zygote-image` event with its reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from mxlaunch.warmstart import criu, zygote, zygote_image
from mxlaunch.warmstart.criu import CriuError
from mxlaunch.plan import PLAN_ENV

if TYPE_CHECKING:  # annotations only: warmstart/ never imports the plan at run time
    from mxlaunch.launch.decide import LaunchOptions, LaunchPlan


class ZygoteStarts:
    def __init__(self, plan: LaunchPlan, opts: LaunchOptions, store_root: Path, log_dir: Path,
                 emit: Callable[..., None], stage_root: Optional[Path] = None) -> None:
        self.plan, self.opts = plan, opts
        self.store_root, self.log_dir = Path(store_root), log_dir
        self.stage_root = stage_root  # the run folder: a store's image is staged into it (warmstart/image_stage.py)
        self.emit = emit
        self._next: Optional[tuple] = None  # (key, entry, env): the zygote to start once ready
        self._criu_checked: Optional[tuple] = None  # (binary or None, why not): asked once per launch
        self.image_restore_s: Optional[float] = None  # this launch's engine came from a restored image: its restore
        self.image_maker: Optional[zygote_image.ImageMaker] = None

    def fork(self, argv: list[str], env: dict[str, str]) -> Optional[zygote.ZygoteChild]:
        """The engine forked from a warm interpreter for this command (waiting, or restored from its image), or
        None: spawn it (the zygote for the next start is started once this one is ready)."""
        start = self.plan.engine_start
        if start is None or start.zygote is None:
            return None
        entry, why = zygote.entry_for(argv, start.zygote.python, self.plan.runtime.executable if self.plan.runtime else None,
                                      start.zygote.preload)
        if entry is None:
            self.emit("zygote", status="off", reason=why)
            return None
        key = zygote.zygote_key(entry, self.plan.spec.engine_version, env, os.getcwd(),
                                salt=zygote_image.key_salt(self.store_root))
        child = zygote.fork_from(key, entry, env, os.getcwd())
        if child is not None:
            self.emit("zygote", status="forked", key=key, pid=child.pid, reason="forked from a warm interpreter")
            return child
        refused = zygote.refusal(key)
        if refused:  # a zygote for this key would not serve: say why, and do not start another
            self.emit("zygote", status="refused", key=key, reason=refused)
            return None
        restored = self._restore(key)
        child = zygote.fork_from(key, entry, env, os.getcwd()) if restored else None
        if child is not None:
            assert restored is not None
            self.image_restore_s = restored["restore_s"]
            self.emit("zygote", status="restored", key=key, pid=child.pid, restore_s=restored["restore_s"],
                      image=restored["image"], read_ahead=restored.get("read_ahead"),
                      reason="forked from a zygote restored from its CRIU image")
            return child
        self._next = (key, entry, {k: v for k, v in env.items() if k != PLAN_ENV})
        self.emit("zygote", status="miss", key=key, reason="no warm interpreter for this command yet: spawned; "
                  "one starts once the engine is ready")
        return None

    def start_next(self) -> None:
        """Once ready: start the zygote for the next start (after ready, so it never competes with this one's
        imports); where CRIU runs and the store has no image for it yet, it is dumped once it has imported."""
        if self._next is None:
            return
        key, entry, env = self._next
        self._next = None
        binary = self._criu()
        # an image refused (said by _restore) means the store's image folder is not this user's alone: no dump into it
        for_image = binary is not None and zygote_image.check_image(self.store_root, key) == (None, "")
        try:
            pid = zygote.start_zygote(key, entry, env, os.getcwd(), self.log_dir, for_image=for_image)
        except OSError as exc:
            self.emit("zygote", status="off", key=key, reason=f"cannot start one: {exc.strerror or exc}")
            return
        if pid is None:
            return
        self.emit("zygote", status="starting", key=key, pid=pid, socket=str(zygote.socket_path(key)),
                  log=str(self.log_dir / "zygote.log"),
                  reason="a warm interpreter for the next start (it exits after 15 min with nothing to start)"
                         + ("; once it has imported, CRIU dumps it into the store for this node's next first start"
                            if for_image else ""))
        if for_image:
            assert binary is not None
            self.image_maker = zygote_image.ImageMaker(binary, pid, key, self.store_root, self.log_dir / "zygote.log",
                                                       self.log_dir / "criu", self.emit)
            self.image_maker.start()

    def abandon(self, wait_s: float) -> None:
        """The launcher stops: a dump not yet claimed is called off (the zygote serves plain at once)."""
        if self.image_maker is not None:
            self.image_maker.abandon(wait_s=wait_s)

    def _criu(self) -> Optional[str]:
        """The CRIU binary for zygote images, once per launch; None (said once, in an event) when unusable."""
        if self._criu_checked is None:
            binary, why = criu.why_not() if self.opts.zygote_image else (None, "--no-zygote-image")
            blocked = zygote.image_blocker() if binary is not None else None  # the socket folder is squatted
            if blocked:
                binary, why = None, blocked
            self._criu_checked = (binary, why)
            if binary is None:
                self.emit("zygote-image", status="off", reason=why)
        return self._criu_checked[0]

    def _restore(self, key: str) -> Optional[dict]:
        """Restore this key's zygote image; None when there is none or CRIU refused (said in an event)."""
        found, why = zygote_image.check_image(self.store_root, key)
        if why:  # an image is there that this user did not write alone: one event, then spawn as always
            self.emit("zygote-image", status="refused", key=key, reason=why)
            return None
        if found is None:
            return None
        binary = self._criu()
        if binary is None:
            return None
        try:
            return zygote_image.restore_zygote(binary, self.store_root, key, self.log_dir / "zygote.log",
                                               self.log_dir / "criu", stage_root=self.stage_root)
        except CriuError as exc:
            self.emit("zygote-image", status="restore-failed", key=key, reason=str(exc))
            return None
